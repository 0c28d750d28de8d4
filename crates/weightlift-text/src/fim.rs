//! The fill-in-the-middle tokens of a vocabulary, by llama.cpp's rule: the ids the GGUF
//! declares (`tokenizer.ggml.fim_{pre,suf,mid}_token_id`, or the older
//! `tokenizer.ggml.{prefix,suffix,middle}_token_id`), else the first token with one of the texts
//! the code models use for them.

/// Prefix-token texts (Qwen, Granite, DeepSeek, CodeLlama, GLM-4.5, Falcon-H1 and others).
const PRE: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
/// Suffix-token texts.
const SUF: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
/// Middle-token texts.
const MID: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];

/// The fill-in-the-middle tokens of a vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
}

/// The FIM tokens of a vocabulary of `texts`: each declared id (`declared`: prefix, suffix,
/// middle), else found by its text; `None` unless all three are known.
pub(crate) fn fim_tokens(texts: &[String], declared: [Option<u32>; 3]) -> Option<FimTokens> {
    let by_text = |names: &[&str]| {
        texts
            .iter()
            .position(|t| names.contains(&t.as_str()))
            .and_then(|i| u32::try_from(i).ok())
    };
    let [pre, suf, mid] = declared;
    Some(FimTokens {
        prefix: pre.or_else(|| by_text(PRE))?,
        suffix: suf.or_else(|| by_text(SUF))?,
        middle: mid.or_else(|| by_text(MID))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_ids_win_and_texts_fill_in() {
        let texts: Vec<String> = ["a", "<fim_prefix>", "<fim_middle>", "<fim_suffix>"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let found = fim_tokens(&texts, [None; 3]).unwrap();
        assert_eq!((found.prefix, found.suffix, found.middle), (1, 3, 2));
        let declared = fim_tokens(&texts, [Some(0), None, None]).unwrap();
        assert_eq!(declared.prefix, 0);
        assert_eq!(fim_tokens(&texts[..2], [None; 3]), None);
    }
}
