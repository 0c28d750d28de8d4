//! [`Tokenizer`]: text to ids and back, built from GGUF `tokenizer.ggml.*` metadata or from a
//! Hugging Face `tokenizer.json`, with llama.cpp's rules for special tokens, BOS and pieces.

use std::collections::HashMap;

use crate::eog;
use std::path::Path;

use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};
use weightlift_format::{MetaArray, MetaRef, MetaValue, Metadata};

use crate::error::{Result, TextError};
use crate::pretok;

/// More tokens than any released vocabulary has (the largest are ~260k); a larger count means a
/// hostile or corrupted file.
const MAX_VOCAB: usize = 1 << 22;

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_gguf(v: u64) -> TokenType {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Control and unknown tokens: parsed only with `special`, dropped by `skip_special`.
    fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::Unknown)
    }
}

/// How vocabulary texts map to bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// SentencePiece style: `▁` is a space, `<0xNN>` tokens are single bytes.
    Spm,
    /// GPT-2 byte-level BPE: every character stands for one byte.
    ByteLevel,
}

/// The most ids [`Tokenizer::pad_to`] pads a vocabulary to: past any published vocabulary, and a
/// cap on what a config's `vocab_size` can make it allocate.
pub const MAX_PADDED: usize = 1 << 22;

/// A tokenizer. Encoding splits out special tokens the way llama.cpp does
/// (`tokenizer_st_partition`), then runs a Hugging Face `tokenizers` model on each stretch of
/// plain text; decoding follows llama.cpp's `token_to_piece`.
pub struct Tokenizer {
    /// Encodes plain-text fragments only: special tokens never reach it.
    hf: tokenizers::Tokenizer,
    kind: VocabKind,
    /// GGUF SPM: this crate adds the space prefix and the `▁` escapes (the HF model sees them).
    escape_spm: bool,
    add_space_prefix: bool,
    texts: Vec<String>,
    types: Vec<TokenType>,
    /// Control, user-defined and unknown ids, longest text first (llama.cpp's partition order).
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    fim: Option<crate::FimTokens>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("n_vocab", &self.texts.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

enum Frag<'a> {
    Text(&'a str),
    Token(u32),
}

fn meta_err(key: &str, expected: impl Into<String>, got: impl Into<String>) -> TextError {
    TextError::Metadata {
        key: key.to_owned(),
        expected: expected.into(),
        got: got.into(),
        hint: "the GGUF was written by a converter that does not follow llama.cpp's tokenizer keys, or it is corrupted",
    }
}

fn kind_name(v: &MetaValue) -> &'static str {
    match v {
        MetaValue::String(_) => "a string",
        MetaValue::Array(_) => "an array",
        MetaValue::Bool(_) => "a bool",
        MetaValue::F32(_) | MetaValue::F64(_) => "a float",
        _ => "an integer",
    }
}

fn get_array<'m>(md: &'m Metadata, key: &str) -> Result<Option<&'m MetaArray>> {
    match md.get(key) {
        None => Ok(None),
        Some(MetaValue::Array(a)) => Ok(Some(a)),
        Some(v) => Err(meta_err(key, "an array", kind_name(v))),
    }
}

fn get_str<'m>(md: &'m Metadata, key: &str) -> Result<Option<&'m str>> {
    match md.get(key) {
        None => Ok(None),
        Some(MetaValue::String(s)) => Ok(Some(s)),
        Some(v) => Err(meta_err(key, "a string", kind_name(v))),
    }
}

fn get_bool(md: &Metadata, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| meta_err(key, "a bool", kind_name(v))),
    }
}

/// The GGUF key of a checkpoint's chat template; `KEY.NAME` keys hold other templates it names
/// (llama-cpp-python's `chat_format="chat_template.NAME"`).
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

fn get_id(md: &Metadata, key: &str, n_vocab: usize) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    // llama.cpp writes -1 (as u32::MAX or i32 -1) for "no such token".
    if matches!(v, MetaValue::I32(-1) | MetaValue::I64(-1)) {
        return Ok(None);
    }
    let id = v
        .as_u64()
        .ok_or_else(|| meta_err(key, "a token id", kind_name(v)))?;
    if id == u64::from(u32::MAX) {
        return Ok(None);
    }
    match u32::try_from(id) {
        Ok(id) if (id as usize) < n_vocab => Ok(Some(id)),
        _ => Err(meta_err(
            key,
            format!("a token id below the vocabulary size {n_vocab}"),
            id.to_string(),
        )),
    }
}

/// A BOS or EOS id as llama.cpp reads it: the metadata's, or `default` (when the vocabulary
/// has that many tokens) where the key is missing or says -1.
fn special_id(md: &Metadata, key: &str, n_vocab: usize, default: u32) -> Result<Option<u32>> {
    match get_id(md, key, n_vocab)? {
        Some(id) => Ok(Some(id)),
        None => Ok(((default as usize) < n_vocab).then_some(default)),
    }
}

fn backend(stage: &'static str, e: impl std::fmt::Display) -> TextError {
    TextError::Backend {
        stage,
        detail: e.to_string(),
    }
}

/// GPT-2's byte-to-character table, inverted: the byte each vocabulary character stands for.
fn byte_decoder() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = Vec::new();
    printable.extend(u32::from(b'!')..=u32::from(b'~'));
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0u32..256 {
        let c = if printable.contains(&b) {
            b
        } else {
            n += 1;
            255 + n
        };
        if let (Some(ch), Ok(byte)) = (char::from_u32(c), u8::try_from(b)) {
            map.insert(ch, byte);
        }
    }
    map
}

/// `<0xNN>` → the byte.
fn byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Build the tokenizer a GGUF file describes (`tokenizer.ggml.*`).
    ///
    /// `tokenizer.ggml.model = "gpt2"` is byte-level BPE with the merges and the pre-tokenizer
    /// named by `tokenizer.ggml.pre`; `"llama"` is SentencePiece-style BPE over the scores with
    /// byte fallback, a `▁` space prefix and `▁` for spaces, as llama.cpp's `llm_tokenizer_spm`.
    pub fn from_gguf(md: &Metadata) -> Result<Tokenizer> {
        const MODEL: &str = "tokenizer.ggml.model";
        let model = get_str(md, MODEL)?.ok_or_else(|| {
            meta_err(
                MODEL,
                "a tokenizer model name such as \"gpt2\" or \"llama\"",
                "no such key",
            )
        })?;
        if model != "gpt2" && model != "llama" {
            return Err(TextError::Unsupported {
                what: "model",
                name: model.to_owned(),
                supported: "gpt2, llama".to_owned(),
                hint: "this crate builds byte-level BPE and SentencePiece BPE vocabularies only (not t5/ugm, bert/wpm, rwkv or others)",
            });
        }

        const TOKENS: &str = "tokenizer.ggml.tokens";
        let tokens = get_array(md, TOKENS)?
            .ok_or_else(|| meta_err(TOKENS, "an array of token strings", "no such key"))?;
        if tokens.len() > MAX_VOCAB {
            return Err(meta_err(
                TOKENS,
                format!("at most {MAX_VOCAB} tokens"),
                tokens.len().to_string(),
            ));
        }
        let mut texts = Vec::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            let Some(s) = t.as_str() else {
                return Err(meta_err(
                    TOKENS,
                    "strings",
                    format!("a non-string at index {i}"),
                ));
            };
            texts.push(s.to_owned());
        }
        let n = texts.len();

        const TYPES: &str = "tokenizer.ggml.token_type";
        let types = match get_array(md, TYPES)? {
            None => vec![TokenType::Normal; n],
            Some(a) if a.len() == n => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map_or(TokenType::Undefined, TokenType::from_gguf)
                })
                .collect(),
            Some(a) => {
                return Err(meta_err(
                    TYPES,
                    format!("{n} entries (one per token)"),
                    a.len().to_string(),
                ));
            }
        };

        let (hf, kind, add_bos_default, add_space_prefix) = if model == "gpt2" {
            let (hf, add_bos) = build_gpt2(md, &texts)?;
            (hf, VocabKind::ByteLevel, add_bos, false)
        } else {
            let hf = build_spm(md, &texts, &types)?;
            let prefix = get_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
            (hf, VocabKind::Spm, true, prefix)
        };

        // Without an id (or with -1) llama.cpp takes its default for the tokenizer model:
        // SentencePiece BOS 1 and EOS 2, byte-level BPE 11 for both (GPT-2's comma).
        let (bos_default, eos_default) = if model == "gpt2" { (11, 11) } else { (1, 2) };
        let bos = special_id(md, "tokenizer.ggml.bos_token_id", n, bos_default)?;
        let eos = special_id(md, "tokenizer.ggml.eos_token_id", n, eos_default)?;
        let declared = [
            eos,
            get_id(md, "tokenizer.ggml.eot_token_id", n)?,
            get_id(md, "tokenizer.ggml.eom_token_id", n)?,
        ];
        let fim = [
            get_id(md, "tokenizer.ggml.fim_pad_token_id", n)?,
            get_id(md, "tokenizer.ggml.fim_rep_token_id", n)?,
            get_id(md, "tokenizer.ggml.fim_sep_token_id", n)?,
        ];
        let add_bos = get_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos_default);
        let chat_template = get_str(md, CHAT_TEMPLATE_KEY)?.map(str::to_owned);

        let eog = eog::end_of_generation(&texts, &declared, fim, |_| true);
        let declared_fim = [
            "tokenizer.ggml.fim_pre_token_id",
            "tokenizer.ggml.fim_suf_token_id",
            "tokenizer.ggml.fim_mid_token_id",
        ];
        let older_fim = [
            "tokenizer.ggml.prefix_token_id",
            "tokenizer.ggml.suffix_token_id",
            "tokenizer.ggml.middle_token_id",
        ];
        let mut fim_ids = [None; 3];
        for (slot, (key, older)) in fim_ids.iter_mut().zip(declared_fim.iter().zip(older_fim)) {
            *slot = match get_id(md, key, n)? {
                Some(id) => Some(id),
                None => get_id(md, older, n)?,
            };
        }
        let fim_tokens = crate::fim::fim_tokens(&texts, fim_ids);
        let mut types = types;
        let fim_list = fim_tokens.map(|f| [f.prefix, f.suffix, f.middle]);
        for &i in eog.iter().chain(fim_list.iter().flatten()) {
            // llama.cpp overrides a control-looking token that is not typed control.
            types[i as usize] = TokenType::Control;
        }
        let mut t = Tokenizer::assemble(
            hf,
            kind,
            model == "llama",
            add_space_prefix,
            texts,
            types,
            bos,
            eos,
            eog,
            add_bos,
            chat_template,
        );
        t.fim = fim_tokens;
        Ok(t)
    }

    /// Build the tokenizer in a Hugging Face folder: `tokenizer.json`, plus `tokenizer_config.json`
    /// (`add_bos_token`, `bos_token`, `eos_token`, `chat_template`) and `chat_template.jinja`
    /// when present.
    pub fn from_files(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        let dir = dir.as_ref();
        let json_path = dir.join("tokenizer.json");
        let mut hf = tokenizers::Tokenizer::from_file(&json_path).map_err(|e| TextError::File {
            path: json_path.clone(),
            expected: "a Hugging Face tokenizer.json".to_owned(),
            got: e.to_string(),
            hint: "the folder holds no tokenizer, or one written by a newer tokenizers version",
        })?;
        // Special tokens are split out here, with llama.cpp's rules, before HF sees the text.
        hf.set_encode_special_tokens(true);

        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read(&config_path) {
            Err(_) => serde_json::Value::Null,
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TextError::File {
                path: config_path.clone(),
                expected: "a JSON object".to_owned(),
                got: e.to_string(),
                hint: "the file is truncated or not JSON",
            })?,
        };
        let token_name = |key: &str| -> Option<String> {
            match config.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                v => v.get("content")?.as_str().map(str::to_owned),
            }
        };

        let n = hf.get_vocab_size(true);
        if n > MAX_VOCAB {
            return Err(TextError::File {
                path: json_path,
                expected: format!("at most {MAX_VOCAB} tokens"),
                got: n.to_string(),
                hint: "the file is corrupted",
            });
        }
        let mut texts = vec![String::new(); n];
        for (text, id) in hf.get_vocab(true) {
            if let Some(slot) = texts.get_mut(id as usize) {
                *slot = text;
            }
        }
        let kind = if hf.token_to_id("<0x0A>").is_some() {
            VocabKind::Spm
        } else {
            VocabKind::ByteLevel
        };
        let mut types: Vec<TokenType> = texts
            .iter()
            .map(|t| match (kind, byte_token(t)) {
                (VocabKind::Spm, Some(_)) => TokenType::Byte,
                _ => TokenType::Normal,
            })
            .collect();
        for (id, added) in hf.get_added_tokens_decoder() {
            if let Some(slot) = types.get_mut(id as usize) {
                *slot = if added.special {
                    TokenType::Control
                } else {
                    TokenType::UserDefined
                };
            }
        }

        let bos = token_name("bos_token").and_then(|t| hf.token_to_id(&t));
        let eos = token_name("eos_token").and_then(|t| hf.token_to_id(&t));
        // Without `add_bos_token`, BOS is added when the post-processor adds it (transformers).
        let add_bos = match config
            .get("add_bos_token")
            .and_then(serde_json::Value::as_bool)
        {
            Some(b) => b,
            None => {
                let probe = hf.encode("", true).map_err(|e| backend("encode", e))?;
                bos.is_some() && probe.get_ids().first().copied() == bos
            }
        };
        let eog = eog::end_of_generation(&texts, &[eos], [None; 3], |i| {
            types[i] == TokenType::Control
        });

        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => Some(s),
            Err(_) => match config.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: take "default".
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
                _ => None,
            },
        };

        let fim = crate::fim::fim_tokens(&texts, [None; 3]);
        let mut t = Tokenizer::assemble(
            hf,
            kind,
            false,
            false,
            texts,
            types,
            bos,
            eos,
            eog,
            add_bos,
            chat_template,
        );
        t.fim = fim;
        Ok(t)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        hf: tokenizers::Tokenizer,
        kind: VocabKind,
        escape_spm: bool,
        add_space_prefix: bool,
        texts: Vec<String>,
        types: Vec<TokenType>,
        bos: Option<u32>,
        eos: Option<u32>,
        mut eog: Vec<u32>,
        add_bos: bool,
        chat_template: Option<String>,
    ) -> Tokenizer {
        let mut specials: Vec<u32> = (0..texts.len() as u32)
            .filter(|&i| {
                let t = types[i as usize];
                !texts[i as usize].is_empty() && (t.is_special() || t == TokenType::UserDefined)
            })
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(texts[i as usize].len()));
        eog.sort_unstable();
        eog.dedup();
        Tokenizer {
            hf,
            kind,
            escape_spm,
            add_space_prefix,
            texts,
            types,
            specials,
            bos,
            eos,
            eog,
            fim: None,
            add_bos,
            chat_template,
        }
    }

    /// Split `text` at special tokens: user-defined ones always, control and unknown ones only
    /// with `parse_special` (llama.cpp's `tokenizer_st_partition`, longest token first).
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Frag<'a>> {
        let mut frags = vec![Frag::Text(text)];
        for &id in &self.specials {
            if !parse_special && self.types[id as usize].is_special() {
                continue;
            }
            let needle = self.texts[id as usize].as_str();
            if !frags
                .iter()
                .any(|f| matches!(f, Frag::Text(s) if s.contains(needle)))
            {
                continue;
            }
            let mut out = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Frag::Text(mut s) = f else {
                    out.push(f);
                    continue;
                };
                while let Some(at) = s.find(needle) {
                    if at > 0 {
                        out.push(Frag::Text(&s[..at]));
                    }
                    out.push(Frag::Token(id));
                    s = &s[at + needle.len()..];
                }
                if !s.is_empty() {
                    out.push(Frag::Text(s));
                }
            }
            frags = out;
        }
        frags
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let enc = self
            .hf
            .encode(text, false)
            .map_err(|e| backend("encode", e))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Text to ids.
    ///
    /// `add_bos`: `None` adds BOS when the vocabulary asks for it (`tokenizer.ggml.add_bos_token`,
    /// or llama.cpp's default for the tokenizer type; `add_bos_token` or the post-processor for
    /// `tokenizer.json`), as llama.cpp's `add_special`; `Some(b)` forces it on or off.
    /// `special`: parse control tokens such as `<|im_start|>` in the text; otherwise they are
    /// plain text. User-defined tokens are always parsed, as in llama.cpp and HF.
    pub fn encode(&self, text: &str, add_bos: Option<bool>, special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos.unwrap_or(self.add_bos)
            && let Some(bos) = self.bos
        {
            out.push(bos);
        }
        if text.is_empty() {
            return Ok(out);
        }
        let mut prev_special = true;
        for frag in self.partition(text, special) {
            match frag {
                Frag::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Frag::Text(s) if self.escape_spm => {
                    // llama.cpp: a space prefix on the first fragment and after each special token.
                    let mut t = String::with_capacity(s.len() + 3);
                    if self.add_space_prefix && prev_special {
                        t.push('▁');
                    }
                    for c in s.chars() {
                        t.push(if c == ' ' { '▁' } else { c });
                    }
                    self.encode_plain(&t, &mut out)?;
                    prev_special = false;
                }
                Frag::Text(s) => {
                    self.encode_plain(s, &mut out)?;
                    prev_special = false;
                }
            }
        }
        Ok(out)
    }

    fn check_id(&self, id: u32) -> Result<usize> {
        let i = id as usize;
        if i < self.texts.len() {
            Ok(i)
        } else {
            Err(TextError::BadId {
                id,
                n_vocab: self.texts.len(),
            })
        }
    }

    /// The bytes token `id` decodes to (llama.cpp's `token_to_piece` with `lstrip = 0`): control
    /// and unknown tokens give their text only with `special`, and nothing otherwise. A piece can
    /// be part of a UTF-8 character.
    pub fn token_piece(&self, id: u32, special: bool) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.push_piece(id, special, &mut out)?;
        Ok(out)
    }

    pub(crate) fn push_piece(&self, id: u32, special: bool, out: &mut Vec<u8>) -> Result<()> {
        let i = self.check_id(id)?;
        let text = self.texts[i].as_str();
        match self.types[i] {
            // Control and unknown tokens only with `special`; user-defined ones always.
            t if t.is_special() && !special => {}
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined => {
                out.extend_from_slice(text.as_bytes());
            }
            TokenType::Byte => match byte_token(text) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(text.as_bytes()),
            },
            // Unused and undefined tokens decode to nothing, as in llama.cpp.
            TokenType::Normal => match self.kind {
                VocabKind::Spm => match byte_token(text) {
                    // tokenizer.json vocabularies do not type their byte tokens.
                    Some(b) => out.push(b),
                    None => out.extend_from_slice(text.replace('▁', " ").as_bytes()),
                },
                VocabKind::ByteLevel => {
                    let table = byte_table();
                    for c in text.chars() {
                        match table.get(&c) {
                            Some(&b) => out.push(b),
                            None => {
                                let mut buf = [0u8; 4];
                                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            }
                        }
                    }
                }
            },
            _ => {}
        }
        Ok(())
    }

    /// Ids to text, as llama-cpp-python's `detokenize`: the pieces joined, control tokens dropped
    /// when `skip_special`, and one leading space removed when the first id is BOS (SPM's space
    /// prefix). Bytes that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// [`Tokenizer::decode`]'s bytes before any UTF-8 check (llama-cpp-python's
    /// `Llama.detokenize`, which returns bytes): a cut through a character stays cut.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            self.push_piece(id, !skip_special, &mut bytes)?;
        }
        if self.bos.is_some() && ids.first().copied() == self.bos && bytes.first() == Some(&b' ') {
            bytes.remove(0);
        }
        Ok(bytes)
    }

    /// A streaming decoder over this tokenizer (see [`crate::StreamDecoder`]).
    pub fn stream(&self, skip_special: bool) -> crate::StreamDecoder {
        crate::StreamDecoder::new(skip_special)
    }

    /// The vocabulary text of token `id` (`▁Once`, `Ġcapital`, `<0x0A>`), not decoded.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The type of token `id`.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn kind(&self) -> VocabKind {
        self.kind
    }

    /// Unused tokens `[PAD{id}]` appended up to `n` ids (at most [`MAX_PADDED`]), as llama.cpp's
    /// converter writes them for a model whose embedding has more rows than its tokenizer.json
    /// has tokens (Qwen's and Phi's configs pad `vocab_size`): they decode to nothing, as
    /// transformers decodes them, and no text encodes to them.
    pub fn pad_to(&mut self, n: usize) {
        for id in self.texts.len()..n.min(MAX_PADDED) {
            self.texts.push(format!("[PAD{id}]"));
            self.types.push(TokenType::Unused);
        }
    }

    pub fn n_vocab(&self) -> usize {
        self.texts.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether [`Tokenizer::encode`] adds BOS when `add_bos` is `None`.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// End-of-generation ids, sorted: EOS, `tokenizer.ggml.eot_token_id` / `eom_token_id`, and
    /// the control tokens llama.cpp's `llama_vocab_is_eog` recognises by text (`<|im_end|>`,
    /// `<|eot_id|>`, `<|endoftext|>`, ...).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The fill-in-the-middle tokens (llama.cpp's `llama_vocab_fim_pre`/`_suf`/`_mid`), when
    /// the vocabulary has all three.
    pub fn fim(&self) -> Option<crate::FimTokens> {
        self.fim
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The Jinja chat template (`tokenizer.chat_template`, or `chat_template.jinja` /
    /// `tokenizer_config.json`), when there is one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The chat template compiled, with this vocabulary's BOS and EOS texts, as llama-cpp-python
    /// passes them to its `Jinja2ChatFormatter`.
    pub fn chat(&self) -> Result<Option<crate::ChatTemplate>> {
        self.chat_template
            .as_deref()
            .map(|src| self.compile_chat(src))
            .transpose()
    }

    /// Template `src` compiled with this vocabulary's BOS and EOS texts, as [`Tokenizer::chat`]
    /// compiles the checkpoint's own (another template a GGUF names, say).
    pub fn compile_chat(&self, src: &str) -> Result<crate::ChatTemplate> {
        let text = |id: Option<u32>| {
            id.and_then(|i| self.token_text(i))
                .unwrap_or_default()
                .to_owned()
        };
        crate::ChatTemplate::new(src, &text(self.bos), &text(self.eos))
    }
}

fn byte_table() -> &'static HashMap<char, u8> {
    static TABLE: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(byte_decoder)
}

/// Byte-level BPE from `tokenizer.ggml.merges` and the `tokenizer.ggml.pre` regexes.
fn build_gpt2(md: &Metadata, texts: &[String]) -> Result<(tokenizers::Tokenizer, bool)> {
    const PRE: &str = "tokenizer.ggml.pre";
    let pre_name = get_str(md, PRE)?.unwrap_or("default");
    let pre = pretok::lookup(pre_name).ok_or_else(|| TextError::Unsupported {
        what: "pre-tokenizer",
        name: pre_name.to_owned(),
        supported: pretok::supported_names(),
        hint: "the model was converted for a newer llama.cpp pre-tokenizer; add its regexes to pretok.rs",
    })?;

    const MERGES: &str = "tokenizer.ggml.merges";
    let merges_arr = get_array(md, MERGES)?
        .ok_or_else(|| meta_err(MERGES, "an array of \"left right\" strings", "no such key"))?;
    let vocab: Vocab = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut merges: Merges = Vec::with_capacity(merges_arr.len());
    for (i, m) in merges_arr.iter().enumerate() {
        let Some(s) = m.as_str() else {
            return Err(meta_err(
                MERGES,
                "strings",
                format!("a non-string at index {i}"),
            ));
        };
        // llama.cpp splits at the first space after the first byte (a merge may start with one).
        let split = s.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(p) = split else {
            return Err(meta_err(
                MERGES,
                "\"left right\" pairs",
                format!("{s:?} at index {i}"),
            ));
        };
        let (a, b) = (&s[..p], &s[p + 1..]);
        // A merge whose parts or result are missing from the vocabulary can never apply; HF
        // refuses such merges, llama.cpp ignores them.
        let joined = format!("{a}{b}");
        if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&joined) {
            merges.push((a.to_owned(), b.to_owned()));
        }
    }
    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| backend("build", e))?;

    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for r in pre.regexes {
        let split = Split::new(
            SplitPattern::Regex((*r).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| backend("pre-tokenizer regex", e))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut hf = tokenizers::Tokenizer::new(model);
    hf.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok((hf, pre.add_bos))
}

/// SentencePiece BPE: merges derived from the scores (the merge producing the higher-scored
/// piece first, which is the bigram order of llama.cpp's `llm_tokenizer_spm`), byte fallback.
fn build_spm(
    md: &Metadata,
    texts: &[String],
    types: &[TokenType],
) -> Result<tokenizers::Tokenizer> {
    const SCORES: &str = "tokenizer.ggml.scores";
    let scores_arr = get_array(md, SCORES)?
        .ok_or_else(|| meta_err(SCORES, "an array of f32 scores", "no such key"))?;
    if scores_arr.len() != texts.len() {
        return Err(meta_err(
            SCORES,
            format!("{} entries (one per token)", texts.len()),
            scores_arr.len().to_string(),
        ));
    }
    let scores: Vec<f64> = scores_arr
        .iter()
        .map(|v: MetaRef<'_>| v.as_f64().unwrap_or(0.0))
        .collect();
    let vocab: Vocab = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();

    let mut ranked: Vec<(f64, u32, String, String)> = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        if types[i] == TokenType::Byte {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(at);
            if vocab.contains_key(a) && vocab.contains_key(b) {
                ranked.push((scores[i], i as u32, a.to_owned(), b.to_owned()));
            }
        }
    }
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    let merges: Merges = ranked.into_iter().map(|(_, _, a, b)| (a, b)).collect();

    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(false);
    if let Some(unk) = get_id(md, "tokenizer.ggml.unknown_token_id", texts.len())? {
        builder = builder.unk_token(texts[unk as usize].clone());
    }
    let model = builder.build().map_err(|e| backend("build", e))?;
    Ok(tokenizers::Tokenizer::new(model))
}
