//! GBNF text to rules: a recursive-descent parser with llama.cpp's grammar syntax and its
//! rewriting of repetitions into helper rules.
//!
//! The syntax, as llama.cpp's `llama_grammar_parser` reads it: `name ::= alternatives`, one rule
//! per line (a rule continues onto the next line only after `::=`, after `|`, or inside
//! parentheses); names of ASCII letters, digits and `-`; `#` comments to the end of the line;
//! string literals `"..."`; character classes `[a-z0-9_]`, negated `[^"\\]`; `.` for any
//! character; groups `( ... )`; and `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` after any item. Escapes
//! in literals and classes: `\xHH`, `\uHHHH`, `\UHHHHHHHH`, `\t`, `\r`, `\n`, `\\`, `\"`, `\[`,
//! `\]`, `\-`. A rule defined twice keeps its last definition, as in llama.cpp.
//!
//! A repetition becomes helper rules, as llama.cpp rewrites it: `S{m,n}` is `S` written `m` times
//! followed by a chain of `n − m` optional copies (`S'ₖ ::= S S'ₖ₋₁ |`), and an unbounded one a
//! recursive `S' ::= S S' |`. Like llama.cpp, a count above 2000 is refused as a minimum and
//! means "unbounded" as a maximum.
//!
//! Not read: llama.cpp's token references (`<[id]>`, `<|name|>`, `!<...>`); they are refused by
//! name.

use std::collections::HashMap;

use super::class::CharClass;
use super::error::{GrammarError, line_column};

/// llama.cpp's `MAX_REPETITION_THRESHOLD`.
const MAX_REPETITION: u64 = 2000;
/// Symbols in all rules together: enough for any hand-written grammar, small enough that a
/// hostile one (`("a"{2000}){2000}`) is refused instead of allocated.
const MAX_SYMBOLS: u64 = 1 << 20;
/// How deep parentheses may nest (the parser recurses once per level).
const MAX_NESTING: u64 = 256;

/// One symbol of a sequence: a character class, or a reference to a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Sym {
    Class(u32),
    Ref(u32),
}

/// The parser's output: every rule's alternatives, by rule id.
#[derive(Debug)]
pub(super) struct Rules {
    pub(super) rules: Vec<Vec<Vec<Sym>>>,
    pub(super) names: Vec<String>,
    pub(super) classes: Vec<CharClass>,
    pub(super) root: u32,
    /// The helper rules of each bounded repetition, the one allowing 1 more copy first.
    pub(super) chains: Vec<Vec<u32>>,
}

/// Parses GBNF `src` (see the module docs).
pub(super) fn parse(src: &str) -> Result<Rules, GrammarError> {
    let mut p = Parser {
        src,
        pos: 0,
        ids: HashMap::new(),
        names: Vec::new(),
        rules: Vec::new(),
        first_use: Vec::new(),
        classes: Vec::new(),
        class_ids: HashMap::new(),
        symbols: 0,
        depth: 0,
        chains: Vec::new(),
    };
    p.skip_space(true);
    while p.pos < src.len() {
        p.rule()?;
    }
    let mut rules = Vec::with_capacity(p.rules.len());
    for (id, rule) in p.rules.into_iter().enumerate() {
        match rule {
            Some(r) => rules.push(r),
            None => {
                let (line, column) = line_column(src, p.first_use[id]);
                return Err(GrammarError::UndefinedRule {
                    name: p.names[id].clone(),
                    line,
                    column,
                });
            }
        }
    }
    let Some(&root) = p.ids.get("root") else {
        let defined: Vec<&str> = p
            .names
            .iter()
            .map(String::as_str)
            .filter(|n| p.ids.contains_key(*n))
            .collect();
        return Err(GrammarError::NoRoot {
            defined: if defined.is_empty() {
                "none (the grammar is empty)".into()
            } else {
                defined.join(", ")
            },
        });
    };
    Ok(Rules {
        rules,
        names: p.names,
        classes: p.classes,
        root,
        chains: p.chains,
    })
}

struct Parser<'a> {
    src: &'a str,
    /// Byte offset of the next character; always on a character boundary.
    pos: usize,
    /// Names written in the grammar (generated helper rules are not in it).
    ids: HashMap<String, u32>,
    names: Vec<String>,
    /// Each rule's alternatives, `None` until defined.
    rules: Vec<Option<Vec<Vec<Sym>>>>,
    /// Where each rule was first referenced, for "undefined" errors.
    first_use: Vec<usize>,
    classes: Vec<CharClass>,
    class_ids: HashMap<CharClass, u32>,
    symbols: u64,
    depth: u64,
    chains: Vec<Vec<u32>>,
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-'
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.src.as_bytes().get(self.pos).copied()
    }

    fn peek_at(&self, ahead: usize) -> Option<u8> {
        self.src.as_bytes().get(self.pos + ahead).copied()
    }

    fn syntax(&self, at: usize, expected: impl Into<String>) -> GrammarError {
        let (line, column) = line_column(self.src, at);
        let got = match self.src[at..].chars().next() {
            None => "the end of the grammar".to_owned(),
            Some('\n' | '\r') => "the end of the line".to_owned(),
            Some(c) => format!("{c:?}"),
        };
        GrammarError::Syntax {
            line,
            column,
            expected: expected.into(),
            got,
        }
    }

    fn too_large(&self, what: &'static str, limit: u64, got: u64) -> GrammarError {
        let (line, column) = line_column(self.src, self.pos);
        GrammarError::TooLarge {
            what,
            line,
            column,
            limit,
            got,
        }
    }

    /// Spaces, tabs and `#` comments; newlines too when `newline_ok`.
    fn skip_space(&mut self, newline_ok: bool) {
        while let Some(b) = self.peek() {
            match b {
                b' ' | b'\t' => self.pos += 1,
                b'\r' | b'\n' if newline_ok => self.pos += 1,
                b'#' => {
                    while self.peek().is_some_and(|b| b != b'\r' && b != b'\n') {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<&str, GrammarError> {
        let start = self.pos;
        while self.peek().is_some_and(is_word) {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.syntax(start, "a rule name (letters, digits and '-')"));
        }
        Ok(&self.src[start..self.pos])
    }

    fn rule_id(&mut self, name: &str, at: usize) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.new_rule(name.to_owned(), at);
        self.ids.insert(name.to_owned(), id);
        id
    }

    fn new_rule(&mut self, name: String, at: usize) -> u32 {
        let id = self.names.len() as u32;
        self.names.push(name);
        self.rules.push(None);
        self.first_use.push(at);
        id
    }

    /// A helper rule for a group or a repetition inside `base`, named as llama.cpp names them.
    fn helper(&mut self, base: &str, alternatives: Vec<Vec<Sym>>) -> u32 {
        let name = format!("{base}_{}", self.names.len());
        let id = self.new_rule(name, self.pos);
        self.rules[id as usize] = Some(alternatives);
        id
    }

    fn rule(&mut self) -> Result<(), GrammarError> {
        let at = self.pos;
        let name = self.name()?.to_owned();
        let id = self.rule_id(&name, at);
        self.skip_space(false);
        if !self.src[self.pos..].starts_with("::=") {
            return Err(self.syntax(self.pos, format!("'::=' after the rule name '{name}'")));
        }
        self.pos += 3;
        self.skip_space(true);
        let alternatives = self.alternatives(&name, false)?;
        self.rules[id as usize] = Some(alternatives);
        match self.peek() {
            None => {}
            Some(b'\r') => self.pos += if self.peek_at(1) == Some(b'\n') { 2 } else { 1 },
            Some(b'\n') => self.pos += 1,
            Some(_) => {
                return Err(self.syntax(
                    self.pos,
                    "a string, a character class, a rule name, '(', '.', a repetition, '|' or \
                     the end of the line",
                ));
            }
        }
        self.skip_space(true);
        Ok(())
    }

    fn alternatives(&mut self, rule: &str, nested: bool) -> Result<Vec<Vec<Sym>>, GrammarError> {
        let mut alternatives = vec![self.sequence(rule, nested)?];
        while self.peek() == Some(b'|') {
            self.pos += 1;
            self.skip_space(true);
            alternatives.push(self.sequence(rule, nested)?);
        }
        Ok(alternatives)
    }

    fn count(&mut self, n: u64) -> Result<(), GrammarError> {
        self.symbols = self.symbols.saturating_add(n);
        if self.symbols > MAX_SYMBOLS {
            return Err(self.too_large("symbols in all rules", MAX_SYMBOLS, self.symbols));
        }
        Ok(())
    }

    /// Items up to `|`, `)`, the end of the line (at the top level) or of the text.
    fn sequence(&mut self, rule: &str, nested: bool) -> Result<Vec<Sym>, GrammarError> {
        let mut seq = Vec::new();
        // Where the last item starts: a repetition applies to it.
        let mut last: Option<usize> = None;
        while let Some(b) = self.peek() {
            let start = seq.len();
            match b {
                b'"' => {
                    let open = self.pos;
                    self.pos += 1;
                    loop {
                        match self.peek() {
                            Some(b'"') => break,
                            None => {
                                return Err(self.syntax(
                                    self.pos,
                                    format!(
                                        "'\"' to close the string opened at {}",
                                        self.place(open)
                                    ),
                                ));
                            }
                            Some(_) => {
                                let c = self.char()?;
                                let class = self.class_id(CharClass::new(false, vec![(c, c)]));
                                seq.push(Sym::Class(class));
                            }
                        }
                    }
                    self.pos += 1;
                    last = Some(start);
                }
                b'[' => {
                    let class = self.class()?;
                    seq.push(Sym::Class(class));
                    last = Some(start);
                }
                b'.' => {
                    self.pos += 1;
                    let class = self.class_id(CharClass::any());
                    seq.push(Sym::Class(class));
                    last = Some(start);
                }
                b'(' => {
                    let open = self.pos;
                    self.depth += 1;
                    if self.depth > MAX_NESTING {
                        return Err(self.too_large(
                            "nesting of parentheses",
                            MAX_NESTING,
                            self.depth,
                        ));
                    }
                    self.pos += 1;
                    self.skip_space(true);
                    let alternatives = self.alternatives(rule, true)?;
                    if self.peek() != Some(b')') {
                        return Err(self.syntax(
                            self.pos,
                            format!("')' to close the group opened at {}", self.place(open)),
                        ));
                    }
                    self.pos += 1;
                    self.depth -= 1;
                    let id = self.helper(rule, alternatives);
                    seq.push(Sym::Ref(id));
                    last = Some(start);
                }
                b'<' | b'!' => {
                    return Err(self.syntax(
                        self.pos,
                        "a string, a character class, a rule name, '(' or '.' (token references \
                         such as <[id]> are not supported: write the token's text as a string)",
                    ));
                }
                b'*' | b'+' | b'?' | b'{' => {
                    let at = self.pos;
                    let (min, max) = self.repetition()?;
                    let Some(from) = last else {
                        return Err(self.syntax(
                            at,
                            "an item (a string, a class, a rule name, a group or '.') before the \
                             repetition",
                        ));
                    };
                    self.repeat(rule, &mut seq, from, min, max)?;
                    self.skip_space(nested);
                    continue;
                }
                b if is_word(b) => {
                    let at = self.pos;
                    let name = self.name()?.to_owned();
                    let id = self.rule_id(&name, at);
                    seq.push(Sym::Ref(id));
                    last = Some(start);
                }
                _ => break,
            }
            self.count((seq.len() - start) as u64)?;
            self.skip_space(nested);
        }
        Ok(seq)
    }

    fn place(&self, at: usize) -> String {
        let (line, column) = line_column(self.src, at);
        format!("line {line}, column {column}")
    }

    /// `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`: the least and most copies, `None` for no most.
    fn repetition(&mut self) -> Result<(u64, Option<u64>), GrammarError> {
        let b = self.peek();
        self.pos += 1;
        match b {
            Some(b'*') => return Ok((0, None)),
            Some(b'+') => return Ok((1, None)),
            Some(b'?') => return Ok((0, Some(1))),
            _ => {}
        }
        self.skip_space(false);
        let min = self.int("the least number of copies, an integer")?;
        self.skip_space(false);
        let max = match self.peek() {
            Some(b'}') => Some(min),
            Some(b',') => {
                self.pos += 1;
                self.skip_space(false);
                let max = if self.peek().is_some_and(|b| b.is_ascii_digit()) {
                    Some(self.int("the most number of copies, an integer")?)
                } else {
                    None
                };
                self.skip_space(false);
                if self.peek() != Some(b'}') {
                    return Err(self.syntax(self.pos, "'}' to close the repetition"));
                }
                max
            }
            _ => return Err(self.syntax(self.pos, "',' or '}' in the repetition")),
        };
        self.pos += 1;
        if min > MAX_REPETITION {
            return Err(self.too_large("the least number of copies", MAX_REPETITION, min));
        }
        if let Some(max) = max
            && max < min
        {
            return Err(self.syntax(
                self.pos,
                format!("a most number of copies >= the least ({min}), not {max}"),
            ));
        }
        // llama.cpp treats a larger maximum as none.
        Ok((min, max.filter(|&m| m <= MAX_REPETITION)))
    }

    fn int(&mut self, expected: &str) -> Result<u64, GrammarError> {
        let start = self.pos;
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(self.syntax(start, expected));
        }
        // Past u64 is past every limit anyway.
        Ok(self.src[start..self.pos].parse().unwrap_or(u64::MAX))
    }

    /// Rewrites `seq[from..]` (the last item) as `min` to `max` copies of it.
    fn repeat(
        &mut self,
        rule: &str,
        seq: &mut Vec<Sym>,
        from: usize,
        min: u64,
        max: Option<u64>,
    ) -> Result<(), GrammarError> {
        let item: Vec<Sym> = seq[from..].to_vec();
        // An upper bound on the symbols the copies and helper rules add, counted before any of
        // them is allocated.
        let copies = min.max(max.unwrap_or(0)).saturating_add(1);
        self.count((item.len() as u64 + 1).saturating_mul(copies))?;
        if min == 0 {
            seq.truncate(from);
        }
        for _ in 1..min {
            seq.extend_from_slice(&item);
        }
        let tail = match max {
            // S' ::= S S' |
            None => {
                let id = self.helper(rule, Vec::new());
                let mut again = item.clone();
                again.push(Sym::Ref(id));
                self.rules[id as usize] = Some(vec![again, Vec::new()]);
                Some(id)
            }
            // S'1 ::= S |, S'k ::= S S'(k-1) |
            Some(max) => {
                let mut prev: Option<u32> = None;
                let mut chain = Vec::new();
                for _ in 0..max - min {
                    let mut once = item.clone();
                    once.extend(prev.map(Sym::Ref));
                    let id = self.helper(rule, vec![once, Vec::new()]);
                    chain.push(id);
                    prev = Some(id);
                }
                if chain.len() > 1 {
                    self.chains.push(chain);
                }
                prev
            }
        };
        seq.extend(tail.map(Sym::Ref));
        Ok(())
    }

    fn class_id(&mut self, class: CharClass) -> u32 {
        if let Some(&id) = self.class_ids.get(&class) {
            return id;
        }
        let id = self.classes.len() as u32;
        self.classes.push(class.clone());
        self.class_ids.insert(class, id);
        id
    }

    /// `[...]` or `[^...]`.
    fn class(&mut self) -> Result<u32, GrammarError> {
        let open = self.pos;
        self.pos += 1;
        let negated = self.peek() == Some(b'^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                Some(b']') if !ranges.is_empty() => break,
                Some(b']') => {
                    return Err(self.syntax(self.pos, "a character in the class (it is empty)"));
                }
                None => {
                    return Err(self.syntax(
                        self.pos,
                        format!("']' to close the class opened at {}", self.place(open)),
                    ));
                }
                Some(_) => {
                    let lo = self.char()?;
                    let hi = if self.peek() == Some(b'-')
                        && self.peek_at(1).is_some_and(|b| b != b']')
                    {
                        self.pos += 1;
                        self.char()?
                    } else {
                        lo
                    };
                    ranges.push((lo, hi));
                }
            }
        }
        self.pos += 1;
        Ok(self.class_id(CharClass::new(negated, ranges)))
    }

    /// One character of a literal or a class, escapes decoded.
    fn char(&mut self) -> Result<u32, GrammarError> {
        let Some(c) = self.src[self.pos..].chars().next() else {
            return Err(self.syntax(self.pos, "a character"));
        };
        if c != '\\' {
            self.pos += c.len_utf8();
            return Ok(c as u32);
        }
        let at = self.pos;
        self.pos += 1;
        let Some(e) = self.peek() else {
            return Err(self.syntax(self.pos, "an escaped character after '\\'"));
        };
        self.pos += 1;
        let digits = match e {
            b'x' => 2,
            b'u' => 4,
            b'U' => 8,
            b't' => return Ok('\t' as u32),
            b'r' => return Ok('\r' as u32),
            b'n' => return Ok('\n' as u32),
            b'\\' | b'"' | b'[' | b']' | b'-' => return Ok(u32::from(e)),
            _ => {
                return Err(self.syntax(
                    at,
                    "an escape: \\xHH, \\uHHHH, \\UHHHHHHHH, \\t, \\r, \\n, \\\\, \\\", \\[, \\] \
                     or \\-",
                ));
            }
        };
        let hex = self.src.as_bytes().get(self.pos..self.pos + digits);
        let value = hex
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| u32::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match value {
            Some(v) => {
                self.pos += digits;
                Ok(v)
            }
            None => Err(self.syntax(
                self.pos,
                format!("{digits} hexadecimal digits after '\\{}'", e as char),
            )),
        }
    }
}
