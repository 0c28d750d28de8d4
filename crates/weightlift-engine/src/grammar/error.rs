//! Why a grammar (or a JSON schema) was refused, or why constrained sampling could not go on.

use std::fmt;

/// A GBNF grammar that cannot be used, a JSON schema that cannot be made into one, or a
/// constrained generation that cannot continue. Every message names where (a line and column,
/// the rule, or the place in the schema), what was expected and what was found, in the form
/// `<where>: expected <what>, got <found>`; a schema keyword the converter does not enforce reads
/// `json schema keyword '<keyword>' at <place> is not supported: <why>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarError {
    /// The text is not GBNF.
    Syntax {
        line: usize,
        column: usize,
        expected: String,
        got: String,
    },

    /// A rule is used but never defined.
    UndefinedRule {
        name: String,
        line: usize,
        column: usize,
    },

    /// There is no `root` rule, where matching starts.
    NoRoot { defined: String },

    /// A rule can reach itself before matching a character, which a left-to-right matcher can
    /// never finish expanding (llama.cpp refuses these too). A repetition of something that can
    /// match nothing, such as `("a"?)*`, is one.
    LeftRecursion { rule: String },

    /// A grammar past this crate's bounds (repetition counts, rule sizes, nesting).
    TooLarge {
        what: &'static str,
        line: usize,
        column: usize,
        limit: u64,
        got: u64,
    },

    /// So many parses are alive at once that matching would not finish in reasonable time or
    /// memory (an ambiguous grammar, such as one with nested optional repetitions).
    TooAmbiguous { limit: usize, got: usize },

    /// The grammar reaches more distinct states within one token than the matcher holds.
    TooManyStates { limit: usize },

    /// No token of the vocabulary can continue the text and the grammar cannot end here.
    NoContinuation { vocab: usize },

    /// A token the grammar forbids was fed to the matcher.
    Rejected { token: u32 },

    /// A JSON schema keyword, or a value of one, that the schema converter does not turn into
    /// grammar, so that text the grammar allows could break it; `path` is where in the schema
    /// (a JSON pointer such as `#/properties/code`).
    SchemaUnsupported {
        keyword: String,
        path: String,
        detail: String,
    },

    /// Not a JSON schema the converter can read: not JSON, a keyword with a value of the wrong
    /// kind, a `$ref` that leads nowhere, or a schema no value satisfies.
    SchemaInvalid {
        path: String,
        expected: String,
        got: String,
    },
}

impl GrammarError {
    /// Where, what was expected, and what was found.
    pub fn parts(&self) -> (String, String, String) {
        let at = |line: &usize, column: &usize| format!("grammar line {line}, column {column}");
        match self {
            GrammarError::Syntax {
                line,
                column,
                expected,
                got,
            } => (at(line, column), expected.clone(), got.clone()),
            GrammarError::UndefinedRule { name, line, column } => (
                at(line, column),
                format!("a definition of rule '{name}' (`{name} ::= ...`)"),
                "none; is the name misspelt?".into(),
            ),
            GrammarError::NoRoot { defined } => (
                "grammar".into(),
                "a rule named 'root' (where generation starts)".into(),
                format!("rules {defined}"),
            ),
            GrammarError::LeftRecursion { rule } => (
                format!("grammar rule '{rule}'"),
                "a rule that matches a character before it can reach itself".into(),
                "a left-recursive rule; write it right-recursively (`x ::= \"a\" x | \"a\"`), or \
                 repeat only what cannot be empty"
                    .into(),
            ),
            GrammarError::TooLarge {
                what,
                line,
                column,
                limit,
                got,
            } => (
                at(line, column),
                format!("{what} of at most {limit}"),
                got.to_string(),
            ),
            GrammarError::TooAmbiguous { limit, got } => (
                "grammar-constrained sampling".into(),
                format!("at most {limit} live parses"),
                format!(
                    "{got}; the grammar is too ambiguous, make its alternatives start differently"
                ),
            ),
            GrammarError::TooManyStates { limit } => (
                "grammar-constrained sampling".into(),
                format!("at most {limit} grammar states within one token"),
                "more; the grammar is too large to match, simplify it".into(),
            ),
            GrammarError::NoContinuation { vocab } => (
                "grammar-constrained sampling".into(),
                "a token that continues the grammar".into(),
                format!(
                    "none of the {vocab} tokens of the vocabulary; the grammar needs a character \
                     no token spells"
                ),
            ),
            GrammarError::Rejected { token } => (
                "grammar-constrained sampling".into(),
                "a token the grammar allows here".into(),
                format!("token {token}"),
            ),
            GrammarError::SchemaUnsupported {
                keyword,
                path,
                detail,
            } => (
                format!("json schema keyword '{keyword}' at {path}"),
                "a keyword the schema converter enforces".into(),
                detail.clone(),
            ),
            GrammarError::SchemaInvalid {
                path,
                expected,
                got,
            } => (
                format!("json schema at {path}"),
                expected.clone(),
                got.clone(),
            ),
        }
    }
}

impl fmt::Display for GrammarError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, expected, got) = self.parts();
        match self {
            GrammarError::SchemaUnsupported { .. } => write!(f, "{what} is not supported: {got}"),
            _ => write!(f, "{what}: expected {expected}, got {got}"),
        }
    }
}

impl std::error::Error for GrammarError {}

/// 1-based line and column (in characters) of byte offset `at` of `src`.
pub(super) fn line_column(src: &str, at: usize) -> (usize, usize) {
    let before = &src[..at.min(src.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}
