use std::sync::Arc;

use proptest::prelude::*;
use weightlift_text::Tokenizer;

use super::dfa::{DEAD, Dfa};
use super::*;

fn grammar(src: &str) -> Arc<Grammar> {
    Arc::new(Grammar::parse(src).unwrap_or_else(|e| panic!("{src:?}: {e}")))
}

/// Whether `text` is a prefix of something `src` accepts (`Some(true)` when `src` accepts it
/// whole, `Some(false)` when only as a prefix, `None` when not even that).
fn run(src: &str, text: &str) -> Option<bool> {
    let (mut dfa, mut s) = Dfa::new(grammar(src)).unwrap();
    for &b in text.as_bytes() {
        s = dfa.step(s, b).unwrap();
        if s == DEAD {
            return None;
        }
    }
    Some(dfa.can_end(s))
}

fn accepts(src: &str, text: &str) -> bool {
    run(src, text) == Some(true)
}

#[test]
fn strings_the_grammar_accepts_and_rejects() {
    let cases: &[(&str, &[&str], &[&str])] = &[
        (
            r#"root ::= "yes" | "no""#,
            &["yes", "no"],
            &["", "ye", "yess", "maybe", "Yes"],
        ),
        // Repetitions: *, +, ?, {m}, {m,}, {m,n}.
        (r#"root ::= "x"*"#, &["", "x", "xxxx"], &["y", "xy"]),
        (r#"root ::= "ab"+"#, &["ab", "abab"], &["", "a", "aba"]),
        (r#"root ::= "a" "b"? "c""#, &["ac", "abc"], &["abbc", "a"]),
        (r#"root ::= [0-9]{3}"#, &["123"], &["12", "1234"]),
        (r#"root ::= [0-9]{2,}"#, &["12", "12345"], &["1"]),
        (
            r#"root ::= [a-c]{1,3} "!""#,
            &["a!", "abc!"],
            &["!", "abca!"],
        ),
        (
            r#"root ::= ("ab" | "c"){0,2}"#,
            &["", "ab", "cab", "cc"],
            &["abcab", "a"],
        ),
        // Classes: ranges, several ranges, negation, escapes, `.`.
        (
            r#"root ::= [a-zA-Z_] [a-zA-Z0-9_]*"#,
            &["x", "_a9", "Zz"],
            &["9a", "a-b"],
        ),
        (
            r#"root ::= "\"" [^"\\\n]* "\"""#,
            &["\"\"", "\"hi there\"", "\"é\""],
            &["\"a\"b\"", "\"a\nb\""],
        ),
        (
            r#"root ::= [\x41-\x43] "\u00e9" "\t""#,
            &["Aé\t", "Cé\t"],
            &["Dé\t", "Ae\t"],
        ),
        (r#"root ::= [\-\]] "\[""#, &["-[", "]["], &["a["]),
        (
            r#"root ::= . . "!""#,
            &["ab!", "é世!", "  !"],
            &["a!", "abc!"],
        ),
        (r#"root ::= [α-ω]+"#, &["αβγ", "ω"], &["a", "αa"]),
        // Rules, groups, comments, and rules spread over lines after '::=', '|' and '('.
        (
            "# a comment\nroot ::= greeting \" \" name # trailing\n\
             greeting ::= \"hi\" |\n  \"hello\"\nname ::= (\n  \"bob\"\n  | \"al\" \"ice\"?\n)\n",
            &["hi bob", "hello al", "hi alice"],
            &["hi", "hey bob", "hi ali"],
        ),
        // Right recursion.
        (
            r#"root ::= "(" root ")" | """#,
            &["", "()", "((()))"],
            &["(()", ")("],
        ),
    ];
    for (src, good, bad) in cases {
        for text in *good {
            assert!(accepts(src, text), "{src:?} should accept {text:?}");
        }
        for text in *bad {
            assert!(!accepts(src, text), "{src:?} should reject {text:?}");
        }
    }
}

#[test]
fn prefixes_are_viable_until_they_cannot_continue() {
    let src = r#"root ::= "yes" | "no""#;
    assert_eq!(run(src, "ye"), Some(false));
    assert_eq!(run(src, "yes"), Some(true));
    assert_eq!(run(src, "yex"), None);
    // A character cut inside its UTF-8 bytes: alive while some completion could match.
    let src = r#"root ::= "é" | "a""#;
    let (mut dfa, s) = Dfa::new(grammar(src)).unwrap();
    // é is C3 A9.
    let half = dfa.step(s, 0xC3).unwrap();
    assert_ne!(half, DEAD);
    assert!(!dfa.can_end(half));
    let whole = dfa.step(half, 0xA9).unwrap();
    assert!(dfa.can_end(whole));
    // è shares é's first byte; its second byte is refused.
    assert_eq!(dfa.step(half, 0xA8).unwrap(), DEAD);
    // No two-byte character starts with 0xE4 (a three-byte lead): 世 cannot be "é" or "a".
    assert_eq!(dfa.step(s, 0xE4).unwrap(), DEAD);
}

#[test]
fn invalid_utf8_and_nul_never_continue() {
    let src = "root ::= .*";
    let (mut dfa, s) = Dfa::new(grammar(src)).unwrap();
    for b in [0x00u8, 0x80, 0xBF, 0xC0, 0xC1, 0xF5, 0xFF] {
        assert_eq!(dfa.step(s, b).unwrap(), DEAD, "byte {b:#x}");
    }
    // Overlong (E0 80) and surrogate (ED A0 80) forms.
    let e0 = dfa.step(s, 0xE0).unwrap();
    assert_eq!(dfa.step(e0, 0x80).unwrap(), DEAD);
    let ed = dfa.step(s, 0xED).unwrap();
    let ed_a0 = dfa.step(ed, 0xA0).unwrap();
    assert_eq!(dfa.step(ed_a0, 0x80).unwrap(), DEAD);
}

#[test]
fn the_json_grammar_accepts_json_objects() {
    let good = [
        "{}",
        "{\"a\": 1}",
        "{\"name\": \"Ada\", \"age\": 36, \"tags\": [\"x\", \"y\"], \"ok\": true, \"n\": null}",
        "{\"x\": -0.5e1, \"y\": {\"z\": []}, \"s\": \"\\u00e9\\n\\\"\"}",
        "{\n  \"a\": [1, 2.25, -3]\n}",
    ];
    for text in good {
        assert!(accepts(JSON_GBNF, text), "{text}");
        assert!(
            serde_json::from_str::<serde_json::Value>(text).is_ok(),
            "{text}"
        );
    }
    let bad = [
        "[1]",
        "{\"a\": 01}",
        "{\"a\": 1,}",
        "{'a': 1}",
        "{\"a\": \"\t\"}",
        "{\"a\": tru}",
        // llama-cpp-python's grammar allows at most one space here.
        "{  \"a\": 1}",
    ];
    for text in bad {
        assert!(!accepts(JSON_GBNF, text), "{text}");
    }
}

proptest! {
    /// JSON objects of strings, integers, booleans and nulls, written compactly by serde_json,
    /// are in the JSON grammar's language.
    #[test]
    fn serde_json_objects_are_in_the_json_grammar(
        members in prop::collection::vec(
            ("[a-zA-Z0-9 é\"\\\\]{0,8}", prop_oneof![
                any::<i32>().prop_map(serde_json::Value::from),
                "[a-z é\n\"]{0,6}".prop_map(serde_json::Value::from),
                any::<bool>().prop_map(serde_json::Value::from),
                Just(serde_json::Value::Null),
            ]),
            0..5,
        ),
    ) {
        let object: serde_json::Map<String, serde_json::Value> = members.into_iter().collect();
        let text = serde_json::to_string(&object).unwrap();
        prop_assert!(accepts(JSON_GBNF, &text), "{}", text);
    }
}

/// Parses `src` and returns its error's message.
fn error(src: &str) -> String {
    Grammar::parse(src).unwrap_err().to_string()
}

#[test]
fn parse_errors_name_the_line_the_column_and_what_was_expected() {
    let cases = [
        (
            "root ::= \"a\"\nitem := \"b\"",
            "grammar line 2, column 6: expected '::=' after the rule name 'item', got ':'",
        ),
        (
            "root ::= (\"a\" | \"b\"",
            "grammar line 1, column 20: expected ')' to close the group opened at line 1, \
             column 10, got the end of the grammar",
        ),
        (
            "root ::= \"abc",
            "grammar line 1, column 14: expected '\"' to close the string opened at line 1, \
             column 10, got the end of the grammar",
        ),
        (
            "root ::= [a-z",
            "grammar line 1, column 14: expected ']' to close the class opened at line 1, \
             column 10, got the end of the grammar",
        ),
        (
            "root ::= \"\\q\"",
            "grammar line 1, column 11: expected an escape: \\xHH, \\uHHHH, \\UHHHHHHHH, \\t, \
             \\r, \\n, \\\\, \\\", \\[, \\] or \\-, got '\\\\'",
        ),
        (
            "root ::= \"\\x4\"",
            "grammar line 1, column 13: expected 2 hexadecimal digits after '\\x', got '4'",
        ),
        (
            "root ::= * \"a\"",
            "grammar line 1, column 10: expected an item (a string, a class, a rule name, a \
             group or '.') before the repetition, got '*'",
        ),
        (
            "root ::= \"a\"{3,1}",
            "grammar line 1, column 18: expected a most number of copies >= the least (3), not \
             1, got the end of the grammar",
        ),
        (
            "root ::= \"a\"{x}",
            "grammar line 1, column 14: expected the least number of copies, an integer, got 'x'",
        ),
        (
            "root ::= []",
            "grammar line 1, column 11: expected a character in the class (it is empty), got ']'",
        ),
        (
            "root ::= \"a\" ; \"b\"",
            "grammar line 1, column 14: expected a string, a character class, a rule name, '(', \
             '.', a repetition, '|' or the end of the line, got ';'",
        ),
        (
            "root ::= <[42]>",
            "grammar line 1, column 10: expected a string, a character class, a rule name, '(' \
             or '.' (token references such as <[id]> are not supported: write the token's text \
             as a string), got '<'",
        ),
        (
            "root ::= \"a\"\n  | \"b\"",
            "grammar line 2, column 3: expected a rule name (letters, digits and '-'), got '|'",
        ),
        (
            "root ::= item\nitme ::= \"x\"",
            "grammar line 1, column 10: expected a definition of rule 'item' (`item ::= ...`), \
             got none; is the name misspelt?",
        ),
        (
            "start ::= \"x\"\nother ::= start",
            "grammar: expected a rule named 'root' (where generation starts), got rules start, \
             other",
        ),
        (
            "",
            "grammar: expected a rule named 'root' (where generation starts), got rules none \
             (the grammar is empty)",
        ),
        (
            "root ::= \"a\"{2001}",
            "grammar line 1, column 19: expected the least number of copies of at most 2000, \
             got 2001",
        ),
    ];
    for (src, message) in cases {
        assert_eq!(error(src), message, "{src:?}");
    }
}

#[test]
fn grammar_errors_stay_grammar_errors_in_the_engine_error() {
    // The bindings map `EngineError::Grammar` to Python's GrammarError, not to an invalid
    // request; the message is the grammar's own.
    let e = Grammar::parse("root ::= )").unwrap_err();
    let message = e.to_string();
    let engine = crate::EngineError::from(e.clone());
    assert!(
        matches!(&engine, crate::EngineError::Grammar(g) if *g == e),
        "{engine:?}"
    );
    assert_eq!(engine.to_string(), message);
    assert!(
        message.starts_with("grammar line 1, column 10: expected ") && message.ends_with("got ')'"),
        "{message}"
    );
    let stuck = crate::EngineError::from(GrammarError::NoContinuation { vocab: 7 });
    assert!(matches!(stuck, crate::EngineError::Grammar(_)), "{stuck:?}");
}

#[test]
fn left_recursion_is_refused_by_rule() {
    for (src, rule) in [
        ("root ::= root \"a\" | \"b\"", "root"),
        ("root ::= x\nx ::= y \"a\"\ny ::= \"\" | x", "x"),
        // A repetition of something that can be empty repeats without consuming.
        ("root ::= (\"a\"?)*", "root_"),
    ] {
        let message = error(src);
        assert!(
            message.starts_with(&format!("grammar rule '{rule}"))
                && message.contains("left-recursive"),
            "{src:?}: {message}"
        );
    }
    // Right recursion and nullable prefixes before a character are fine.
    Grammar::parse("root ::= \"a\" root | \"\"").unwrap();
    Grammar::parse("root ::= x? \"b\" root?\nx ::= \"a\"").unwrap();
}

#[test]
fn emptiness_flows_back_along_a_chain_of_rules() {
    // r0 ::= r1 ... r299 ::= r300 ::= "": each rule matches nothing only once the one after it,
    // defined later, is known to; p matches nothing through two references to q.
    let chain: String = (0..300).map(|i| format!("r{i} ::= r{}\n", i + 1)).collect();
    let src = format!(
        "root ::= r0 p root \"a\" | \"b\"\np ::= q q | \"c\"\nq ::= \"\" | \"d\"\n{chain}r300 ::= \"\""
    );
    let message = error(&src);
    assert!(
        message.starts_with("grammar rule 'root") && message.contains("left-recursive"),
        "{message}"
    );
    // one rule of the chain needs a character: root then starts with one, and is fine
    Grammar::parse(&src.replace("r150 ::= r151", "r150 ::= r151 \"x\"")).unwrap();
    // and so it is when p needs one
    Grammar::parse(&src.replace("p ::= q q |", "p ::= q \"e\" q |")).unwrap();
}

#[test]
fn hostile_grammars_are_refused_before_they_are_allocated() {
    // A long item copied 2000 times; a group is copied as one reference, so that is cheap.
    let message = error(&format!("root ::= \"{}\"{{2000}}", "a".repeat(1000)));
    assert!(
        message.contains("symbols in all rules of at most 1048576"),
        "{message}"
    );
    let deep = format!("root ::= {}\"a\"{}", "(".repeat(300), ")".repeat(300));
    assert!(error(&deep).contains("nesting of parentheses of at most 256"));
    // llama.cpp reads a maximum above 2000 as none.
    assert!(accepts("root ::= \"a\"{1,5000}", &"a".repeat(3000)));
    assert_eq!(
        run("root ::= (\"a\"{2000}){2000}", &"a".repeat(20_000)),
        Some(false)
    );
}

#[test]
fn a_rule_defined_twice_keeps_its_last_definition() {
    let src = "root ::= \"a\"\nroot ::= \"b\"";
    assert!(accepts(src, "b"));
    assert!(!accepts(src, "a"));
}

/// A byte-level BPE vocabulary (GPT-2's byte-to-character table: 'Ġ' is a space, 'Ã' and '©'
/// are the bytes 0xC3 and 0xA9 of "é") with an end-of-generation token and a control token.
const VOCAB: &[&str] = &[
    "<eos>",
    "y",
    "e",
    "s",
    "yes",
    "Ġyes",
    "no",
    "n",
    "o",
    "Ã",
    "©",
    "Ã©",
    "1",
    "2",
    "12",
    "a",
    "<|im_start|>",
    "ye",
    "\"",
    "Ã¨",
];

fn tokenizer() -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> = VOCAB
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_owned(), serde_json::Value::from(i)))
        .collect();
    let added = |id: usize| {
        serde_json::json!({"id": id, "content": VOCAB[id], "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(0), added(16)],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
            "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
            "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<eos>"}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_files(dir.path()).unwrap();
    (dir, tok)
}

fn id(text: &str) -> u32 {
    VOCAB.iter().position(|t| *t == text).unwrap() as u32
}

/// The tokens `c` allows next, by their vocabulary text.
fn allowed(c: &mut Constraint) -> Vec<&'static str> {
    let mut logits = vec![0.0f32; VOCAB.len()];
    let n = c.mask(&mut logits).unwrap();
    let out: Vec<&str> = VOCAB
        .iter()
        .zip(&logits)
        .filter(|(_, l)| **l == 0.0)
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(out.len(), n);
    out
}

#[test]
fn the_constraint_masks_tokens_by_their_bytes() {
    let (_dir, tok) = tokenizer();
    let n = VOCAB.len();
    let mut c = Constraint::new(grammar(r#"root ::= "yes" | "no""#), &tok, n).unwrap();
    assert_eq!(allowed(&mut c), ["y", "yes", "no", "n", "ye"]);
    c.accept(id("ye")).unwrap();
    assert_eq!(allowed(&mut c), ["s"]);
    assert!(!c.can_end());
    c.accept(id("s")).unwrap();
    // Complete: only the end of generation.
    assert!(c.can_end());
    assert_eq!(allowed(&mut c), ["<eos>"]);
    c.accept(id("<eos>")).unwrap();
    assert_eq!(
        c.accept(id("y")).unwrap_err().to_string(),
        "grammar-constrained sampling: expected a token the grammar allows here, got token 1"
    );
}

#[test]
fn a_token_may_end_inside_a_character_that_can_still_match() {
    let (_dir, tok) = tokenizer();
    let n = VOCAB.len();
    let mut c = Constraint::new(grammar(r#"root ::= "é" | "a""#), &tok, n).unwrap();
    assert_eq!(allowed(&mut c), ["Ã", "Ã©", "a"]);
    c.accept(id("Ã")).unwrap();
    assert_eq!(allowed(&mut c), ["©"]);
    // Under [^é], the first byte of é stays allowed: è and others start with it too.
    let mut c = Constraint::new(grammar("root ::= [^é]"), &tok, n).unwrap();
    let a = allowed(&mut c);
    assert!(
        a.contains(&"Ã") && a.contains(&"Ã¨") && !a.contains(&"Ã©"),
        "{a:?}"
    );
    assert!(!a.contains(&"©"), "a lone continuation byte");
}

#[test]
fn special_tokens_are_matched_as_their_text_and_eog_only_at_the_end() {
    let (_dir, tok) = tokenizer();
    let n = VOCAB.len();
    let mut c = Constraint::new(grammar("root ::= [^\"]*"), &tok, n).unwrap();
    let a = allowed(&mut c);
    assert!(a.contains(&"<|im_start|>") && a.contains(&"<eos>") && !a.contains(&"\""));
    let mut c = Constraint::new(grammar("root ::= [a-z]+"), &tok, n).unwrap();
    let a = allowed(&mut c);
    assert!(
        !a.contains(&"<|im_start|>") && !a.contains(&"<eos>"),
        "{a:?}"
    );
}

#[test]
fn no_token_that_continues_is_an_error_and_padded_ids_are_masked() {
    let (_dir, tok) = tokenizer();
    let mut c = Constraint::new(grammar(r#"root ::= "z""#), &tok, VOCAB.len()).unwrap();
    let err = c.mask(&mut vec![0.0; VOCAB.len()]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "grammar-constrained sampling: expected a token that continues the grammar, got none \
         of the 20 tokens of the vocabulary; the grammar needs a character no token spells"
    );
    // An embedding with rows past the tokenizer's vocabulary: those ids are never allowed.
    let mut c = Constraint::new(grammar("root ::= .*"), &tok, VOCAB.len() + 4).unwrap();
    let mut logits = vec![0.0f32; VOCAB.len() + 4];
    c.mask(&mut logits).unwrap();
    assert!(
        logits[VOCAB.len()..]
            .iter()
            .all(|&l| l == f32::NEG_INFINITY)
    );
}

/// Masks `c` and checks the mask against stepping each token's bytes from the state itself
/// (no trie, no cached mask, no capped counts); the allowed ids, or `None` when none is.
fn checked_mask(c: &mut Constraint, tok: &Tokenizer) -> Option<Vec<u32>> {
    let n = VOCAB.len();
    let mut logits = vec![0.0f32; n];
    c.mask(&mut logits).ok()?;
    for (id, text) in VOCAB.iter().enumerate() {
        let alone = if tok.is_eog(id as u32) {
            c.can_end()
        } else {
            let piece = tok.token_piece(id as u32, true).unwrap();
            let mut s = c.state;
            for &b in &piece {
                s = c.dfa.step(s, b).unwrap();
                if s == DEAD {
                    break;
                }
            }
            s != DEAD
        };
        assert_eq!(logits[id] == 0.0, alone, "token {text:?}");
    }
    Some(
        (0..n as u32)
            .filter(|&i| logits[i as usize] == 0.0)
            .collect(),
    )
}

proptest! {
    /// The trie walk allows exactly the tokens whose bytes, stepped one by one from the current
    /// state, stay alive: the shared-prefix skipping loses and adds nothing.
    #[test]
    fn the_trie_walk_equals_stepping_each_token(path in prop::collection::vec(0usize..8, 0..6)) {
        let (_dir, tok) = tokenizer();
        let src = r#"root ::= ( "y" "e"? "s"* | "n" "o"+ | [0-9é"]+ | "a" )*"#;
        let mut c = Constraint::new(grammar(src), &tok, VOCAB.len()).unwrap();
        for choice in path {
            let Some(options) = checked_mask(&mut c, &tok) else { break };
            c.accept(options[choice % options.len()]).unwrap();
        }
    }

    /// Long bounded repetitions share masks between counts past the longest token (12 bytes
    /// here): masks stay exact all the way to and past the counts' ends.
    #[test]
    fn capped_repetition_counts_mask_as_the_state_itself(
        path in prop::collection::vec(0usize..16, 0..60),
    ) {
        let (_dir, tok) = tokenizer();
        let src = r#"root ::= "\"" [^"]{1,40} "\"" ("y" | "12"){0,20} "é"?"#;
        let mut c = Constraint::new(grammar(src), &tok, VOCAB.len()).unwrap();
        prop_assert!(c.capped.is_some());
        for choice in path {
            let Some(options) = checked_mask(&mut c, &tok) else { break };
            c.accept(options[choice % options.len()]).unwrap();
        }
    }
}

#[test]
fn a_rebuilt_automaton_goes_on_where_the_old_one_was() {
    let text = "{\"a\": [1, {\"b\": \"é\"}], \"c\": -2.5}".as_bytes();
    for cut in 0..=text.len() {
        let (mut dfa, mut s) = Dfa::new(Grammar::json()).unwrap();
        for &b in &text[..cut] {
            s = dfa.step(s, b).unwrap();
        }
        // Cuts inside "é" carry a partial character across.
        let (mut fresh, mut t) = dfa.rebuilt(s).unwrap();
        for &b in &text[cut..] {
            t = fresh.step(t, b).unwrap();
            assert_ne!(t, DEAD, "cut at {cut}");
        }
        assert!(fresh.can_end(t), "cut at {cut}");
    }
}
