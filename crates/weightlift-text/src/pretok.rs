//! Pre-tokenizer regexes for byte-level BPE vocabularies, by `tokenizer.ggml.pre` name.
//!
//! The names and the regex lists are llama.cpp's (its BPE tokenizer's
//! pre-tokenizer table). Each regex is applied in turn to the pieces
//! the previous ones left, keeping matches and the text between them as separate pieces; that is
//! the Hugging Face `Split` pre-tokenizer with `Isolated` behaviour.

/// How one pre-tokenizer family splits text before BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PreTok {
    /// Regexes applied in order.
    pub regexes: &'static [&'static str],
    /// Look a whole pre-token up in the vocabulary before merging (llama.cpp `ignore_merges`).
    pub ignore_merges: bool,
    /// llama.cpp's default for `add_bos` when `tokenizer.ggml.add_bos_token` is absent.
    pub add_bos: bool,
}

const GPT2: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];

const DEFAULT: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "\\p{N}+",
    "[0-9][0-9][0-9]",
];

const LLAMA3: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];

const QWEN2: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];

const QWEN35: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];

const STARCODER: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];

const FALCON: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "[0-9][0-9][0-9]",
];

const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
];

const DEEPSEEK_CODER: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}",
];

/// The `tokenizer.ggml.pre` names this crate builds, grouped as llama.cpp groups them.
pub(crate) const SUPPORTED: &[(&[&str], PreTok)] = &[
    (
        &["default"],
        PreTok {
            regexes: DEFAULT,
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "dbrx",
            "smaug-bpe",
        ],
        PreTok {
            regexes: LLAMA3,
            ignore_merges: true,
            add_bos: true,
        },
    ),
    (
        &["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"],
        PreTok {
            regexes: QWEN2,
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &["qwen35"],
        PreTok {
            regexes: QWEN35,
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        PreTok {
            regexes: STARCODER,
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &["gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"],
        PreTok {
            regexes: GPT2,
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &["falcon"],
        PreTok {
            regexes: FALCON,
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &["deepseek-llm"],
        PreTok {
            regexes: DEEPSEEK_LLM,
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &["deepseek-coder"],
        PreTok {
            regexes: DEEPSEEK_CODER,
            ignore_merges: false,
            add_bos: false,
        },
    ),
];

/// The pre-tokenizer for `name` (a missing name is llama.cpp's `default`, with its warning).
pub(crate) fn lookup(name: &str) -> Option<PreTok> {
    SUPPORTED
        .iter()
        .find(|(names, _)| names.contains(&name))
        .map(|(_, p)| *p)
}

/// Every supported name, comma-separated, for error messages.
pub(crate) fn supported_names() -> String {
    SUPPORTED
        .iter()
        .flat_map(|(n, _)| n.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_regex_compiles() {
        for (names, p) in SUPPORTED {
            for r in p.regexes {
                let pattern =
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex((*r).to_owned());
                let split = tokenizers::pre_tokenizers::split::Split::new(
                    pattern,
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                );
                assert!(split.is_ok(), "{names:?}: {r}");
            }
        }
    }
}
