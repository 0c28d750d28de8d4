//! Which tokens end a generation: llama.cpp's rule (`llama_vocab_is_eog`), which works from the
//! declared ids and from token texts, because most vocabularies mark no end-of-turn token.
//!
//! - the declared EOS, EOT and EOM ids;
//! - the fill-in-the-middle padding, repository and file-separator tokens (declared, or found
//!   by their text: the first token with one of [`FIM_PAD`], [`FIM_REP`], [`FIM_SEP`]), which
//!   a code model emits when it is done;
//! - every token whose text is one of [`TEXTS`];
//! - except `<|end|>` where the vocabulary also has `<|return|>` and `<|call|>` (or `<|calls|>`
//!   and `<|flush|>`): there it separates channels within a turn; and `</s>` beside
//!   `<|tool_response>`, where it is an ordinary token.

/// Texts that end a generation wherever they are in a vocabulary.
pub(crate) const TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
];

/// Fill-in-the-middle padding token texts.
pub(crate) const FIM_PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
/// Fill-in-the-middle repository-name token texts.
pub(crate) const FIM_REP: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
/// Fill-in-the-middle file-separator token texts.
pub(crate) const FIM_SEP: &[&str] = &["<|file_sep|>"];

/// The end-of-generation ids of a vocabulary of `texts`: `declared` (EOS, EOT, EOM), the FIM
/// pad/rep/sep tokens (`fim`: declared ids, else found by text), and the [`TEXTS`] tokens that
/// `counts` accepts (the GGUF reader takes any; `tokenizer.json` only control tokens). Sorted,
/// without repeats.
pub(crate) fn end_of_generation(
    texts: &[String],
    declared: &[Option<u32>],
    fim: [Option<u32>; 3],
    counts: impl Fn(usize) -> bool,
) -> Vec<u32> {
    let by_text = |names: &[&str]| {
        texts
            .iter()
            .position(|t| names.contains(&t.as_str()))
            .map(|i| i as u32)
    };
    let mut eog: Vec<u32> = declared.iter().flatten().copied().collect();
    for (id, names) in fim.into_iter().zip([FIM_PAD, FIM_REP, FIM_SEP]) {
        eog.extend(id.or_else(|| by_text(names)));
    }
    eog.extend(
        texts
            .iter()
            .enumerate()
            .filter(|&(i, t)| TEXTS.contains(&t.as_str()) && counts(i))
            .map(|(i, _)| i as u32),
    );
    let text_of = |id: &u32| texts.get(*id as usize).map_or("", String::as_str);
    let has = |eog: &[u32], t: &str| eog.iter().any(|id| text_of(id) == t);
    if has(&eog, "<|end|>")
        && ((has(&eog, "<|return|>") && has(&eog, "<|call|>"))
            || (has(&eog, "<|calls|>") && has(&eog, "<|flush|>")))
    {
        eog.retain(|id| text_of(id) != "<|end|>");
    }
    if has(&eog, "<|tool_response>") {
        eog.retain(|id| text_of(id) != "</s>");
    }
    eog.sort_unstable();
    eog.dedup();
    eog
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn declared_fim_and_texts_end_a_generation() {
        let v = vocab(&[
            "<|endoftext|>",
            "a",
            "<fim_pad>",
            "<reponame>",
            "<file_sep>",
            "b",
        ]);
        assert_eq!(
            end_of_generation(&v, &[Some(5)], [None; 3], |_| true),
            [0, 2, 3, 5]
        );
        // a declared FIM id wins over the text search
        assert_eq!(
            end_of_generation(&v, &[], [Some(1), None, None], |_| true),
            [0, 1, 3]
        );
        // texts can be limited to control tokens; the FIM search is not
        assert_eq!(end_of_generation(&v, &[], [None; 3], |i| i != 0), [2, 3]);
    }

    #[test]
    fn channel_and_tool_vocabularies_drop_their_ordinary_tokens() {
        let harmony = vocab(&["<|end|>", "<|return|>", "<|call|>"]);
        assert_eq!(
            end_of_generation(&harmony, &[], [None; 3], |_| true),
            [1, 2]
        );
        let alone = vocab(&["<|end|>", "<|return|>"]);
        assert_eq!(end_of_generation(&alone, &[], [None; 3], |_| true), [0, 1]);
        let tools = vocab(&["</s>", "<|tool_response>", "<eos>"]);
        assert_eq!(end_of_generation(&tools, &[], [None; 3], |_| true), [1, 2]);
    }
}
