//! GGUF v2/v3 reader over mmap (single and split files).
//!
//! The layout is the GGUF format as llama.cpp defines it: a little-endian
//! header (`"GGUF"`, version, tensor count, key/value count), the key/value section, the tensor
//! info section, padding to `general.alignment`, then the tensor data.
//!
//! Every file is hostile until proven otherwise. [`parse`] is a pure function of the bytes: it
//! never panics, never loops on a claimed count without consuming input, and never reserves
//! memory from a claimed count beyond what the bytes that remain could hold. Every limit below
//! is a named constant. Every structural check runs before a tensor is handed out:
//!
//! - magic, version (1 and unknown versions are refused: one up to [`MAX_LATER_VERSION`] as
//!   written by a newer tool, a larger one as a corrupt header; a byte-swapped version means a
//!   big-endian file, refused with [`hint::BYTE_ORDER`](crate::hint::BYTE_ORDER));
//! - keys: UTF-8, non-empty, at most [`MAX_KEY_LEN`] bytes, unique; values of all 13 types,
//!   arrays nested at most [`MAX_ARRAY_DEPTH`] deep, each at most [`MAX_ARRAY_LEN`] long, at most
//!   [`MAX_METADATA_VALUES`] values in all;
//! - `general.alignment`: a `u32` power of two (default [`DEFAULT_ALIGNMENT`]);
//! - tensors: unique non-empty names, 1 to 4 dimensions, no zero dimension, an element count
//!   that fits `i64`, a known ggml type, a row length divisible by the block size, an offset
//!   that is a multiple of the alignment, data inside the file, and no two tensors overlapping.
//!
//! GGUF does not store a tensor's byte size: it is implied by type × shape. The "stored size"
//! check is therefore that those implied bytes fit between the tensor's offset and the next
//! tensor (the overlap check) or the end of the file (the bounds check).
//!
//! Opening copies nothing from the file. Scalars and short strings become plain values; arrays
//! of at least [`LAZY_ARRAY_MIN_LEN`](crate::LAZY_ARRAY_MIN_LEN) scalars or strings
//! (vocabularies, merges, scores, token types) are validated in place, completely (every
//! length, bound, bool byte and UTF-8 sequence, against the same caps and with the same
//! messages), and kept as [`MetaArray`](crate::MetaArray)s that point into the shared map and
//! decode elements on demand. UTF-8 is checked a run of strings at a time (see
//! `Parser::string_array`), with no allocation per element.
//!
//! The code is in three parts: `parser` reads and validates one file (the header and counts,
//! the alignment; `parser::kv` the key/value section, `parser::tensors` the tensor info table),
//! and `split` finds the parts of a `-0000N-of-0000M.gguf` set, checks that they agree and
//! assembles one tensor table. This module holds the public face: the limits, [`GgufHeader`]
//! and the entry points.

mod parser;
mod split;

use std::path::Path;
use std::sync::Arc;

use crate::checkpoint::TokenizerInfo;
use crate::metadata::Backing;
use crate::{FormatError, MetaValue, Metadata, Result, TensorInfo};

use parser::parse_backed;
pub(crate) use split::read;
pub use split::{MAX_SPLIT_PARTS, SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY};

/// `"GGUF"` as it appears on disk (always in this byte order, whatever the file's endianness).
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Versions this reader accepts.
pub const SUPPORTED_VERSIONS: [u32; 2] = [2, 3];
/// The largest version read as a later revision of GGUF ("written by a newer tool") rather than
/// as a corrupt header. GGUF reached version 3 within months of its start in 2023 and has stayed
/// there; each revision adds one. llama.cpp refuses any version above its `GGUF_VERSION` (3),
/// gguf-py any but 2 and 3, and both print the number they read.
pub const MAX_LATER_VERSION: u32 = 15;
/// Alignment of the data section and of every tensor offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Longest key (and tensor name) accepted, in bytes; the GGUF spec caps keys at 2^16 - 1.
pub const MAX_KEY_LEN: u64 = 65_535;
/// Longest string value accepted, in bytes (chat templates are the longest seen: tens of KiB).
pub const MAX_STRING_LEN: u64 = 64 << 20;
/// Most elements in one metadata array (tokenizer vocabularies and merges run to ~10^6).
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Most values, counting every array element, in the whole metadata section.
pub const MAX_METADATA_VALUES: u64 = 1 << 24;
/// Deepest nesting of arrays inside arrays.
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Most key/value pairs in one file.
pub const MAX_KV: u64 = 1 << 20;
/// Most tensors in one file.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most dimensions of a tensor (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

/// Everything in a GGUF file before the tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    /// 2 or 3.
    pub version: u32,
    /// The tensor count the header claims (equal to `tensors.len()` after a full parse).
    pub n_tensors: u64,
    /// Key/value pairs in file order. Long arrays refer to the parsed bytes (a shared handle
    /// on the map, or on the copy [`parse`] makes), so the header may outlive the borrow.
    pub metadata: Metadata,
    /// Tensors in file order: `shape` in numpy order (the reverse of `ne`), `offset` absolute
    /// within the file, `file` 0, `layer` and `role` unset. Empty after [`parse_metadata`].
    pub tensors: Vec<TensorInfo>,
    /// `general.alignment`, or [`DEFAULT_ALIGNMENT`].
    pub alignment: u64,
    /// Absolute offset of the data section (0 after [`parse_metadata`], which does not read
    /// the tensor info section).
    pub data_offset: u64,
}

/// Parse and validate a whole GGUF file held in `bytes`. `path` is used only in messages.
///
/// Never panics, and allocates at most in proportion to `bytes.len()`. Long metadata arrays
/// refer to the bytes instead of being copied (see [`crate::MetaArray`]), so the header keeps
/// one shared copy of `bytes`; [`crate::Checkpoint::open`] reads over the memory map instead
/// and copies nothing.
pub fn parse(bytes: &[u8], path: &Path) -> Result<GgufHeader> {
    parse_backed(&owned(bytes), path, true)
}

/// Parse and validate only the header and the key/value section; the tensor info section and
/// the tensor data are not read. This is what `vocab_only` uses.
pub fn parse_metadata(bytes: &[u8], path: &Path) -> Result<GgufHeader> {
    parse_backed(&owned(bytes), path, false)
}

fn owned(bytes: &[u8]) -> Backing {
    Arc::new(bytes.to_vec())
}

/// What the `tokenizer.ggml.*` keys say.
pub fn tokenizer_info(metadata: &Metadata) -> TokenizerInfo {
    let get = |k: &str| metadata.get(k);
    TokenizerInfo {
        model: get("tokenizer.ggml.model")
            .and_then(MetaValue::as_str)
            .map(str::to_owned),
        pre: get("tokenizer.ggml.pre")
            .and_then(MetaValue::as_str)
            .map(str::to_owned),
        n_tokens: get("tokenizer.ggml.tokens")
            .and_then(MetaValue::as_array)
            .map(|a| a.len() as u64),
        n_merges: get("tokenizer.ggml.merges")
            .and_then(MetaValue::as_array)
            .map(|a| a.len() as u64),
        bos_token_id: get("tokenizer.ggml.bos_token_id").and_then(MetaValue::as_u64),
        eos_token_id: get("tokenizer.ggml.eos_token_id").and_then(MetaValue::as_u64),
        has_tokenizer_json: false,
    }
}

fn invalid(
    path: &Path,
    what: impl Into<String>,
    expected: impl Into<String>,
    got: impl Into<String>,
    hint: &'static str,
) -> FormatError {
    FormatError::Invalid {
        path: path.to_path_buf(),
        what: what.into(),
        expected: expected.into(),
        got: got.into(),
        hint,
    }
}
