//! GBNF grammars (llama.cpp's grammar format) and the constraint that keeps sampling inside one.
//!
//! A [`Grammar`] is parsed once from GBNF text ([`Grammar::parse`]), or made from a JSON schema
//! as llama.cpp's converter makes one ([`Grammar::from_json_schema`], [`json_schema_to_gbnf`]:
//! `schema.rs` says what it covers, refuses and does differently); a [`Constraint`] follows
//! one generation through it. Before each token is sampled, [`Constraint::mask`] sets the logit
//! of every token whose text cannot continue the grammar to −inf, as llama.cpp's grammar sampler
//! does; after it, [`Constraint::accept`] advances the grammar by the token's text.
//!
//! The rules llama.cpp applies, applied here: a token is matched as the bytes it decodes to
//! (special tokens as their text), so it may end inside a UTF-8 character, and is then allowed
//! when some completion of that character could match; an end-of-generation token is allowed
//! only where the grammar can end, and once the grammar is complete nothing else is; a token that
//! decodes to nothing, or starts with a NUL byte, is never allowed. Left-recursive grammars are
//! refused, as llama.cpp refuses them. Differences, all at the edges: a partial character is
//! checked against the exact set of characters that could complete it, where llama.cpp tests
//! ranges and refuses, for instance, the first byte of `è` under `[^é]`; bytes that are not
//! UTF-8 (overlong forms, surrogates, a lead byte followed by a non-continuation byte) and NUL
//! anywhere in a token never match, where llama.cpp decodes some of them loosely.
//!
//! The parser and the matcher are written here rather than taken from a crate: the Rust grammar
//! crates parse EBNF or build regular-language automata, and none reads GBNF with llama.cpp's
//! semantics (its repetition rewriting, `.`, classes over code points) or matches a whole
//! vocabulary of byte strings incrementally.
//!
//! How the matcher stays fast. The grammar's state is a set of parse stacks, as in llama.cpp;
//! stacks are interned as shared linked lists, sets of them as sorted id lists, and a state plus
//! any partial UTF-8 character is one id of a lazily built byte automaton, whose transitions are
//! cached 256 to a state; characters that the same stacks take share one computed successor. The
//! vocabulary is kept sorted by token bytes with the length of the prefix each token shares with
//! the one before, so one pass walks it as a trie: a prefix is stepped once for all tokens that
//! share it, and a dead prefix rejects them all in O(1) each. The resulting mask is kept per
//! state (a bit per token), so a state that comes back, as inside a JSON string, costs no walk.

mod class;
mod dfa;
mod error;
mod json;
mod parse;
mod schema;
mod vocab;

#[cfg(test)]
mod schema_tests;
#[cfg(test)]
mod tests;

use std::sync::Arc;

pub use error::GrammarError;
pub use schema::json_schema_to_gbnf;
pub use vocab::Constraint;

use class::CharClass;
use json::Json;
use parse::Sym;

/// A grammar accepting JSON values whose top level is an object: the same language as
/// llama-cpp-python's `JSON_GBNF`, which `response_format={"type": "json_object"}` uses, so
/// JSON mode constrains exactly as it does there. Its quirks are kept: at most 16 digits per
/// integer part, exponents whose digits after the first are 1 to 9, and whitespace limited to
/// one space or a newline with up to 20 spaces and tabs.
pub const JSON_GBNF: &str = r#"# JSON, with an object at the top level
root ::= object
value ::= object | array | string | number | ( "true" | "false" | "null" ) ws

object ::= "{" ws ( member ( "," ws member )* )? "}" ws
member ::= string ":" ws value
array ::= "[" ws ( value ( "," ws value )* )? "]" ws

string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" escape )* "\"" ws
escape ::= ["\\bfnrt] | "u" [0-9a-fA-F]{4}

number ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) fraction? exponent? ws
fraction ::= "." [0-9]+
exponent ::= [eE] [-+]? [0-9] [1-9]{0,15}

ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// One element of the flattened rules: a character class to match, a rule to expand, or the end
/// of an alternative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    Class(u32),
    Ref(u32),
    End,
}

/// A parsed GBNF grammar, ready to constrain generations (immutable; share it with an `Arc`).
pub struct Grammar {
    source: String,
    /// Every alternative of every rule, laid end to end, each closed by [`Elem::End`].
    elems: Vec<Elem>,
    /// Rule id to the index in `elems` of each of its alternatives.
    rules: Vec<Vec<u32>>,
    names: Vec<String>,
    classes: Vec<CharClass>,
    root: u32,
    /// The helper rules of each bounded repetition, the one allowing 1 more copy first.
    chains: Vec<Vec<u32>>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("rules", &self.rules.len())
            .field("symbols", &self.elems.len())
            .field("source_bytes", &self.source.len())
            .finish_non_exhaustive()
    }
}

/// Grammars are equal when their texts are.
impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl Grammar {
    /// Parses GBNF text whose start rule is `root`. The error names the line and column and
    /// what was expected there, an undefined rule and where it is used, or a left-recursive
    /// rule.
    pub fn parse(source: &str) -> Result<Grammar, GrammarError> {
        let parsed = parse::parse(source)?;
        let mut elems = Vec::new();
        let mut rules = Vec::with_capacity(parsed.rules.len());
        for alternatives in &parsed.rules {
            let mut starts = Vec::with_capacity(alternatives.len());
            for alt in alternatives {
                starts.push(elems.len() as u32);
                elems.extend(alt.iter().map(|s| match *s {
                    Sym::Class(c) => Elem::Class(c),
                    Sym::Ref(r) => Elem::Ref(r),
                }));
                elems.push(Elem::End);
            }
            rules.push(starts);
        }
        let grammar = Grammar {
            source: source.to_owned(),
            elems,
            rules,
            names: parsed.names,
            classes: parsed.classes,
            root: parsed.root,
            chains: parsed.chains,
        };
        grammar.check_left_recursion()?;
        Ok(grammar)
    }

    /// [`JSON_GBNF`], parsed.
    pub fn json() -> Arc<Grammar> {
        static JSON: std::sync::OnceLock<Arc<Grammar>> = std::sync::OnceLock::new();
        Arc::clone(JSON.get_or_init(|| {
            Arc::new(Grammar::parse(JSON_GBNF).expect("the built-in JSON grammar parses"))
        }))
    }

    /// The grammar of the JSON texts JSON Schema `schema` (JSON text) accepts, as llama.cpp's
    /// converter writes it ([`json_schema_to_gbnf`]: what it covers, and where it differs). A
    /// keyword it cannot enforce is refused with [`GrammarError::SchemaUnsupported`], naming
    /// the keyword and where it is.
    pub fn from_json_schema(schema: &str) -> Result<Grammar, GrammarError> {
        Grammar::parse(&json_schema_to_gbnf(schema)?)
    }

    /// The grammar an OpenAI-style `response_format` (JSON text of an object) asks for:
    /// `{"type": "text"}` none; `{"type": "json_object"}` the JSON grammar, as
    /// llama-cpp-python; `{"type": "json_object", "schema": {...}}` (llama-cpp-python's form)
    /// and `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` (OpenAI's;
    /// `strict` changes nothing, the grammar always keeps to the schema) the schema's grammar
    /// ([`Grammar::from_json_schema`]); a `json_schema` without a schema the JSON grammar.
    /// Where llama-cpp-python falls back to the JSON grammar for a schema its converter fails
    /// on, this raises the converter's error; another type is refused by name.
    pub fn for_response_format(
        response_format: &str,
    ) -> Result<Option<Arc<Grammar>>, crate::EngineError> {
        let invalid = |what: &str, expected: &str, got: String| crate::EngineError::Invalid {
            what: what.into(),
            expected: expected.into(),
            got,
        };
        let format = Json::parse(response_format)
            .map_err(|e| invalid("response_format", "JSON text of an object", e.to_string()))?;
        let Json::Object(_) = format else {
            return Err(invalid(
                "response_format",
                "an object such as {\"type\": \"json_object\"}",
                format.python_dumps(),
            ));
        };
        let from_schema = |schema: Option<&Json>| -> Result<Arc<Grammar>, crate::EngineError> {
            match schema {
                None | Some(Json::Null) => Ok(Grammar::json()),
                Some(schema) => Ok(Arc::new(Grammar::parse(&schema::convert(schema)?)?)),
            }
        };
        match format.get("type") {
            Some(Json::Str(t)) if t == "text" => Ok(None),
            Some(Json::Str(t)) if t == "json_object" => from_schema(format.get("schema")).map(Some),
            Some(Json::Str(t)) if t == "json_schema" => match format.get("json_schema") {
                Some(spec @ Json::Object(_)) => from_schema(spec.get("schema")).map(Some),
                other => Err(invalid(
                    "response_format[\"json_schema\"]",
                    "an object with the schema, such as {\"name\": \"reply\", \"schema\": {...}}",
                    other.map_or_else(|| "nothing".to_owned(), Json::python_dumps),
                )),
            },
            other => Err(crate::EngineError::Unsupported {
                what: format!(
                    "response_format type {}",
                    match other {
                        None => "(none given)".to_owned(),
                        Some(Json::Str(t)) => format!("'{t}'"),
                        Some(v) => v.python_dumps(),
                    }
                ),
                detail: "expected 'json_object', 'json_schema' or 'text'".into(),
            }),
        }
    }

    /// The GBNF text this grammar was parsed from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Rules, helper rules for groups and repetitions included.
    pub fn n_rules(&self) -> usize {
        self.rules.len()
    }

    /// The symbols of alternative `start`, up to its end.
    fn alternative(&self, start: u32) -> impl Iterator<Item = Elem> + '_ {
        self.elems[start as usize..]
            .iter()
            .copied()
            .take_while(|e| *e != Elem::End)
    }

    /// Positions with every bounded repetition's remaining count capped at `cap` (>= 2): a
    /// position in the helper rule that allows `j > cap` more copies maps to the same place in
    /// the one that allows `cap`. From a state so mapped, every text shorter than `cap`
    /// characters is taken or refused as from the state itself: it can use up neither count,
    /// and both can stop anywhere. `None` when no repetition is that long.
    fn capped_positions(&self, cap: usize) -> Option<Vec<u32>> {
        let mut map: Option<Vec<u32>> = None;
        for chain in self.chains.iter().filter(|c| c.len() > cap && cap >= 2) {
            let target = &self.rules[chain[cap - 1] as usize];
            let map = map.get_or_insert_with(|| (0..self.elems.len() as u32).collect());
            for &helper in &chain[cap..] {
                // Helpers alike in shape: the item and a reference to the next, or nothing.
                for (&from, &to) in self.rules[helper as usize].iter().zip(target) {
                    let len = self.alternative(from).count();
                    for o in 0..=len as u32 {
                        map[(from + o) as usize] = to + o;
                    }
                }
            }
        }
        map
    }

    /// Which rules can match nothing: those with an alternative whose every element is a
    /// reference to such a rule. Found from a worklist: each alternative of references only
    /// counts the references not yet known to match nothing, and a rule found to match nothing
    /// counts down the alternatives that refer to it. Work linear in the grammar's size; a
    /// fixpoint of whole passes took one pass a rule along a chain (a schema's long property name
    /// is a rule a character, 5,000 in a chain: 25 million alternative checks).
    fn nullable_rules(&self) -> Vec<bool> {
        let n = self.rules.len();
        let mut nullable = vec![false; n];
        // per alternative of references only: its rule and the references left to find empty
        let mut left: Vec<(usize, usize)> = Vec::new();
        // per rule: the alternatives that refer to it, once per reference
        let mut referrers: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut found = Vec::new();
        for (r, alternatives) in self.rules.iter().enumerate() {
            for &alt in alternatives {
                let refs: Option<Vec<u32>> = self
                    .alternative(alt)
                    .map(|e| match e {
                        Elem::Ref(s) => Some(s),
                        _ => None,
                    })
                    .collect();
                // an alternative with a character class never matches nothing
                let Some(refs) = refs else { continue };
                let id = left.len();
                left.push((r, refs.len()));
                for s in refs {
                    referrers[s as usize].push(id);
                }
                if left[id].1 == 0 && !nullable[r] {
                    nullable[r] = true;
                    found.push(r);
                }
            }
        }
        while let Some(s) = found.pop() {
            for &id in &referrers[s] {
                let (r, refs) = &mut left[id];
                *refs -= 1;
                if *refs == 0 && !nullable[*r] {
                    nullable[*r] = true;
                    found.push(*r);
                }
            }
        }
        nullable
    }

    /// Refuses a rule that can reach itself before matching a character: expanding it would
    /// push forever. Which rules can match nothing is found first ([`Self::nullable_rules`]),
    /// then a cycle in the graph of "rule A can start with rule B".
    fn check_left_recursion(&self) -> Result<(), GrammarError> {
        let n = self.rules.len();
        let nullable = self.nullable_rules();
        let starts_with = |r: usize| -> Vec<u32> {
            let mut out = Vec::new();
            for &alt in &self.rules[r] {
                for e in self.alternative(alt) {
                    match e {
                        Elem::Ref(s) => {
                            out.push(s);
                            if !nullable[s as usize] {
                                break;
                            }
                        }
                        _ => break,
                    }
                }
            }
            out
        };
        // Iterative depth-first search: 0 unvisited, 1 on the path, 2 done.
        let mut color = vec![0u8; n];
        for first in 0..n {
            if color[first] != 0 {
                continue;
            }
            let mut path: Vec<(usize, Vec<u32>)> = vec![(first, starts_with(first))];
            color[first] = 1;
            while let Some((_, next)) = path.last_mut() {
                match next.pop() {
                    Some(s) => {
                        let s = s as usize;
                        match color[s] {
                            1 => {
                                return Err(GrammarError::LeftRecursion {
                                    rule: self.names[s].clone(),
                                });
                            }
                            0 => {
                                color[s] = 1;
                                let edges = starts_with(s);
                                path.push((s, edges));
                            }
                            _ => {}
                        }
                    }
                    None => {
                        if let Some((r, _)) = path.pop() {
                            color[r] = 2;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
