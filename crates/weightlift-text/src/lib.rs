//! Text in and out of a model: tokenizers from GGUF metadata or `tokenizer.json`, a streaming detokenizer and chat templates.
//!
//! [`Tokenizer::from_gguf`] builds a Hugging Face `tokenizers` model from `tokenizer.ggml.*`
//! keys and applies llama.cpp's rules around it: special tokens are split out before the model
//! sees the text (user-defined ones always, control ones only when asked), BOS follows
//! `tokenizer.ggml.add_bos_token`, and pieces decode as llama.cpp's `token_to_piece`.
//! [`Tokenizer::from_files`] does the same for a Hugging Face folder.
//!
//! Supported `tokenizer.ggml.model` values: `gpt2` (byte-level BPE) and `llama`
//! (SentencePiece BPE with byte fallback). Supported `tokenizer.ggml.pre` names are listed in
//! `pretok.rs` (`default`, the llama3, qwen2, qwen35, starcoder/smollm, gpt-2, falcon,
//! deepseek-llm and deepseek-coder families).
//!
//! llama.cpp's own vocab test vectors (`models/ggml-vocab-*.gguf.inp/.out`, vendored in
//! llama-cpp-python 0.3.36; `tests/vocab_vectors.rs`, `make vocab`) pass, every vector, for:
//! llama-spm and phi-3 (SentencePiece); llama-bpe, qwen2, qwen35, gpt-2, starcoder, refact,
//! command-r, mpt, falcon, deepseek-llm and deepseek-coder (byte-level BPE). Not built:
//! bert-bge (WordPiece) and gemma-4 (`tokenizer.ggml.model = "gemma4"`).
//!
//! Where this differs from llama.cpp: tokens' `lstrip`/`rstrip` attributes are not applied,
//! `tokenizer.ggml.add_eos_token` is ignored, and `remove_extra_whitespaces` is not supported.

mod chat;
mod chat_formats;
mod eog;
mod error;
mod fim;
mod pretok;
mod pyjson;
mod stream;
mod tokenizer;

pub use chat::{ChatTemplate, ChatTools, Message};
pub use chat_formats::{CHAT_FORMATS, ChatFormat, chat_format};
pub use error::{Result, TextError};
pub use fim::FimTokens;
pub use stream::StreamDecoder;
pub use tokenizer::{CHAT_TEMPLATE_KEY, TokenType, Tokenizer, VocabKind};
