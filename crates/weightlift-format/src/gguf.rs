//! GGUF v2/v3 reader over mmap (single and split files).
//!
//! The layout follows llama.cpp's `docs/gguf.md` and `ggml/src/gguf.cpp`: a little-endian
//! header (`"GGUF"`, version, tensor count, key/value count), the key/value section, the tensor
//! info section, padding to `general.alignment`, then the tensor data.
//!
//! Every file is hostile until proven otherwise. [`parse`] is a pure function of the bytes: it
//! never panics, never loops on a claimed count without consuming input, and never reserves
//! memory from a claimed count beyond what the bytes that remain could hold. Every limit below
//! is a named constant. Every structural check runs before a tensor is handed out:
//!
//! - magic, version (1 and unknown versions are refused; a byte-swapped version means a
//!   big-endian file, refused with [`hint::BYTE_ORDER`]);
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
//! of at least [`LAZY_ARRAY_MIN_LEN`] scalars or strings (vocabularies, merges, scores, token
//! types) are validated in place, completely (every length, bound, bool byte and UTF-8
//! sequence, against the same caps and with the same messages), and kept as
//! [`MetaArray`]s that point into the shared map and decode elements on demand. UTF-8 is
//! checked a run of strings at a time (see `Parser::string_array`), with no allocation per
//! element.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::checkpoint::{Parsed, TokenizerInfo};
use crate::mapped::MappedFile;
use crate::metadata::{Backing, Decoder, Elem, LAZY_ARRAY_MIN_LEN};
use crate::{
    DType, FormatError, MetaArray, MetaRef, MetaValue, Metadata, Result, TensorInfo, hint,
};

/// `"GGUF"` as it appears on disk (always in this byte order, whatever the file's endianness).
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Versions this reader accepts.
pub const SUPPORTED_VERSIONS: [u32; 2] = [2, 3];
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

// The fewest bytes each record can take, used to refuse counts the file cannot hold before
// anything is reserved.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // key length, value type, one byte of value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8; // name length, n_dims, one dim, type, offset

/// GGUF metadata value type ids (`enum gguf_type`).
mod vt {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;

    pub const fn name(t: u32) -> &'static str {
        match t {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            BOOL => "bool",
            STRING => "string",
            ARRAY => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
            _ => "unknown",
        }
    }

    /// Bytes the smallest value of this type takes on disk.
    pub const fn min_size(t: u32) -> u64 {
        match t {
            U8 | I8 | BOOL => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | STRING => 8,
            ARRAY => 12,
            _ => 1,
        }
    }
}

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

/// Parse the bytes of `src`; long metadata arrays keep a handle on `src`.
fn parse_backed(src: &Backing, path: &Path, with_tensors: bool) -> Result<GgufHeader> {
    Parser::new(src, path).parse(with_tensors)
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

/// A bounds-checked little-endian reader over the file bytes.
struct Parser<'a> {
    bytes: &'a [u8],
    /// The owner of `bytes`, shared with lazy metadata arrays.
    src: &'a Backing,
    pos: usize,
    path: &'a Path,
    /// Metadata values read so far, against [`MAX_METADATA_VALUES`].
    n_values: u64,
}

impl<'a> Parser<'a> {
    fn new(src: &'a Backing, path: &'a Path) -> Self {
        Parser {
            bytes: (**src).as_ref(),
            src,
            pos: 0,
            path,
            n_values: 0,
        }
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// The next `n` bytes. `what` names the field for the message and is only built on error.
    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8]> {
        let start = self.pos;
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| start.checked_add(n))
            .filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(invalid(
                self.path,
                what(),
                format!("{n} bytes at offset {start}"),
                format!("{} bytes before the end of the file", self.remaining()),
                hint::TRUNCATED,
            ));
        };
        self.pos = end;
        Ok(&self.bytes[start..end])
    }

    fn array<const N: usize>(&mut self, what: impl FnOnce() -> String) -> Result<[u8; N]> {
        let b = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A `gguf_string`: u64 length, then that many UTF-8 bytes.
    fn string(&mut self, cap: u64, what: &dyn Fn() -> String) -> Result<&'a str> {
        let b = self.string_bytes(cap, what)?;
        self.utf8(b, what)
    }

    /// The bytes of a `gguf_string`, not yet checked for UTF-8.
    fn string_bytes(&mut self, cap: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let at = self.pos;
        let len = self.u64(|| format!("{} length", what()))?;
        if len > cap {
            return Err(invalid(
                self.path,
                format!("{} length", what()),
                format!("at most {cap} bytes"),
                format!("{len} bytes (at offset {at})"),
                hint::HOSTILE,
            ));
        }
        self.take(len, what)
    }

    /// `b`, a sub-slice of the file, as UTF-8.
    fn utf8(&self, b: &'a [u8], what: &dyn Fn() -> String) -> Result<&'a str> {
        std::str::from_utf8(b).map_err(|e| {
            // The string's length field sits just before its bytes.
            let at = (b.as_ptr() as usize)
                .wrapping_sub(self.bytes.as_ptr() as usize)
                .wrapping_sub(8);
            invalid(
                self.path,
                what(),
                "a UTF-8 string",
                format!(
                    "invalid UTF-8 at byte {} of the string at offset {at}",
                    e.valid_up_to()
                ),
                hint::CORRUPT,
            )
        })
    }

    /// Validates a string array of `n` elements at the cursor and steps over it. Vocabularies
    /// hold ~10^5 strings and dominate the parse, so this is one tight pass over the length
    /// fields that allocates nothing (the general path only builds messages), and UTF-8 is
    /// checked a run of strings at a time rather than string by string.
    ///
    /// A run ("segment") is a stretch of the array in which every length field is ASCII (no
    /// byte ≥ 0x80: true of every length below 128, so of almost every token). If a segment is
    /// valid UTF-8 then so is each string in it: every string is bordered by ASCII bytes or by
    /// the segment's ends, so its ends are character boundaries of a valid string. A length
    /// field with a byte ≥ 0x80 ends the segment before it and starts the next one after it.
    ///
    /// Lengths and bounds are checked for every element before a UTF-8 error is reported, so a
    /// truncated array is reported as truncated whatever its earlier strings hold; a UTF-8
    /// error names the first bad element.
    fn string_array(&mut self, n: usize, key: &str) -> Result<()> {
        const HIGH_BITS: u64 = 0x8080_8080_8080_8080;
        let what = |i: usize| move || format!("key '{key}' element {i}");
        let bytes = self.bytes;
        // The open segment: its first byte, and its first element with that element's
        // length field.
        let mut seg_start = self.pos;
        let mut seg_first = (0usize, self.pos);
        // The first segment that is not UTF-8: its first element, length field, and end.
        let mut bad: Option<(usize, usize, usize)> = None;
        let mut check = |from: usize, to: usize, first: (usize, usize)| {
            let valid = bytes
                .get(from..to)
                .is_some_and(|run| simdutf8::basic::from_utf8(run).is_ok());
            if bad.is_none() && !valid {
                bad = Some((first.0, first.1, to));
            }
        };
        for i in 0..n {
            let pos = self.pos;
            let word = bytes
                .get(pos..pos.wrapping_add(8))
                .map(|l| u64::from_le_bytes([l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7]]));
            let end = word
                .filter(|&len| len <= MAX_STRING_LEN)
                .and_then(|len| (pos + 8).checked_add(len as usize))
                .filter(|&end| end <= bytes.len());
            match (word, end) {
                (Some(word), Some(end)) => {
                    if word & HIGH_BITS != 0 {
                        check(seg_start, pos, seg_first);
                        seg_start = pos + 8;
                        seg_first = (i, pos);
                    }
                    self.pos = end;
                }
                // The general path reports exactly what is wrong (and cannot succeed here);
                // should it ever, the string is checked on its own.
                _ => {
                    check(seg_start, pos, seg_first);
                    self.string_bytes(MAX_STRING_LEN, &what(i))?;
                    check(pos + 8, self.pos, (i, pos));
                    seg_start = self.pos;
                    seg_first = (i + 1, self.pos);
                }
            }
        }
        check(seg_start, self.pos, seg_first);

        let Some((first, mut pos, seg_end)) = bad else {
            return Ok(());
        };
        // Find the first bad string of the bad segment, string by string.
        for i in first..n {
            let b = self.string_at(pos).filter(|b| pos + 8 + b.len() <= seg_end);
            let Some(b) = b else { break };
            self.utf8(b, &what(i))?;
            pos += 8 + b.len();
        }
        // Unreachable for a segment that holds whole strings; refuse the array regardless.
        Err(invalid(
            self.path,
            what(first)(),
            "a UTF-8 string",
            "invalid UTF-8",
            hint::CORRUPT,
        ))
    }

    /// The bytes of the string whose length field is at `pos`, if they lie in the file.
    fn string_at(&self, pos: usize) -> Option<&'a [u8]> {
        let l = self.bytes.get(pos..pos.checked_add(8)?)?;
        let len = usize::try_from(u64::from_le_bytes(l.try_into().ok()?)).ok()?;
        self.bytes.get(pos + 8..(pos + 8).checked_add(len)?)
    }

    /// A claimed count, refused when it exceeds `cap` or when the bytes that remain could not
    /// hold `count` records of at least `min_size` bytes each.
    fn check_count(&self, count: u64, cap: u64, min_size: u64, what: &str) -> Result<()> {
        let left = self.remaining();
        if count > cap {
            return Err(invalid(
                self.path,
                what,
                format!("at most {cap}"),
                count.to_string(),
                hint::HOSTILE,
            ));
        }
        let fits = count.checked_mul(min_size).is_some_and(|need| need <= left);
        if !fits {
            return Err(invalid(
                self.path,
                what,
                format!(
                    "at most {} ({left} bytes remain, and each entry takes at least {min_size})",
                    left / min_size
                ),
                count.to_string(),
                hint::TRUNCATED,
            ));
        }
        Ok(())
    }

    fn parse(mut self, with_tensors: bool) -> Result<GgufHeader> {
        let magic = self.array::<4>(|| "header magic".into())?;
        if magic == *b"FUGG" {
            // The magic written as a big-endian u32 (gguf-py always writes it little-endian,
            // other big-endian writers may not).
            return Err(invalid(
                self.path,
                "header magic",
                "the bytes 'GGUF'",
                "'FUGG', the magic stored big-endian",
                hint::BYTE_ORDER,
            ));
        }
        if magic != MAGIC {
            return Err(invalid(
                self.path,
                "header magic",
                "the bytes 'GGUF' (47 47 55 46)",
                format!(
                    "{:02x} {:02x} {:02x} {:02x}",
                    magic[0], magic[1], magic[2], magic[3]
                ),
                "the file is not a GGUF file, or is corrupted",
            ));
        }
        let version = self.u32(|| "header version".into())?;
        self.check_version(version)?;
        let n_tensors = self.u64(|| "header tensor count".into())?;
        let n_kv = self.u64(|| "header key/value count".into())?;
        self.check_count(n_kv, MAX_KV, MIN_KV_BYTES, "header key/value count")?;
        // The tensor info section follows the key/values, so this bound is loose until the
        // key/values are read; it is checked again, tightly, below.
        self.check_count(
            n_tensors,
            MAX_TENSORS,
            MIN_TENSOR_INFO_BYTES,
            "header tensor count",
        )?;

        let metadata = self.read_metadata(n_kv)?;
        let alignment = self.alignment(&metadata)?;

        let mut header = GgufHeader {
            version,
            n_tensors,
            metadata,
            tensors: Vec::new(),
            alignment,
            data_offset: 0,
        };
        if with_tensors {
            self.check_count(
                n_tensors,
                MAX_TENSORS,
                MIN_TENSOR_INFO_BYTES,
                "header tensor count",
            )?;
            let (tensors, data_offset) = self.read_tensors(n_tensors, alignment)?;
            header.tensors = tensors;
            header.data_offset = data_offset;
        }
        Ok(header)
    }

    fn check_version(&self, version: u32) -> Result<()> {
        if SUPPORTED_VERSIONS.contains(&version) {
            return Ok(());
        }
        let swapped = version.swap_bytes();
        // gguf-py's reader uses the same test: a little-endian version never has its low 16
        // bits all zero, a big-endian one read as little-endian always does.
        if version & 0xffff == 0 && swapped != 0 {
            return Err(invalid(
                self.path,
                "header version",
                "2 or 3, stored little-endian",
                format!("{version:#010x}, which is version {swapped} stored big-endian"),
                hint::BYTE_ORDER,
            ));
        }
        if version == 1 {
            return Err(FormatError::Unsupported {
                path: self.path.to_path_buf(),
                what: "gguf version 1".into(),
                detail: format!(
                    "version 1 (32-bit counts and lengths) is refused; this build reads versions 2 and 3; {}",
                    hint::OLD_GGUF
                ),
            });
        }
        if version == 0 {
            return Err(invalid(
                self.path,
                "header version",
                "2 or 3",
                "0",
                hint::CORRUPT,
            ));
        }
        Err(FormatError::Unsupported {
            path: self.path.to_path_buf(),
            what: format!("gguf version {version}"),
            detail: format!("this build reads versions 2 and 3; {}", hint::NEWER_WRITER),
        })
    }

    fn read_metadata(&mut self, n_kv: u64) -> Result<Metadata> {
        // n_kv was checked against the remaining bytes, so this reservation is bounded by the
        // file size.
        let mut metadata = Metadata::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let at = self.pos;
            let key = self.string(MAX_KEY_LEN, &|| format!("key #{i}"))?;
            if key.is_empty() {
                return Err(invalid(
                    self.path,
                    format!("key #{i} (at offset {at})"),
                    "a non-empty key",
                    "an empty string",
                    hint::CORRUPT,
                ));
            }
            let ty = self.u32(|| format!("key '{key}' value type"))?;
            let value = self.read_value(ty, key, 0)?;
            if metadata.contains_key(key) {
                return Err(invalid(
                    self.path,
                    format!("key '{key}'"),
                    "each key once",
                    format!("a second '{key}' (key #{i} at offset {at})"),
                    hint::CORRUPT,
                ));
            }
            metadata.insert(key.to_owned(), value);
        }
        Ok(metadata)
    }

    fn count_values(&mut self, n: u64, key: &str) -> Result<()> {
        self.n_values = self.n_values.saturating_add(n);
        if self.n_values > MAX_METADATA_VALUES {
            return Err(invalid(
                self.path,
                format!("key '{key}'"),
                format!("at most {MAX_METADATA_VALUES} metadata values in all"),
                format!("{} so far", self.n_values),
                hint::HOSTILE,
            ));
        }
        Ok(())
    }

    fn read_value(&mut self, ty: u32, key: &str, depth: u32) -> Result<MetaValue> {
        self.count_values(1, key)?;
        let what = || format!("key '{key}' {} value", vt::name(ty));
        Ok(match ty {
            vt::U8 => MetaValue::U8(self.array::<1>(what)?[0]),
            vt::I8 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            vt::U16 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            vt::I16 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            vt::U32 => MetaValue::U32(u32::from_le_bytes(self.array(what)?)),
            vt::I32 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            vt::F32 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            vt::U64 => MetaValue::U64(u64::from_le_bytes(self.array(what)?)),
            vt::I64 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            vt::F64 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            vt::BOOL => {
                let at = self.pos;
                let b = self.array::<1>(what)?[0];
                MetaValue::Bool(self.bool_byte(b, key, at)?)
            }
            vt::STRING => MetaValue::String(
                self.string(MAX_STRING_LEN, &|| format!("key '{key}' string value"))?
                    .to_owned(),
            ),
            vt::ARRAY => self.read_array(key, depth)?,
            other => return Err(self.bad_type(other, key, self.pos.saturating_sub(4))),
        })
    }

    fn bool_byte(&self, b: u8, key: &str, at: usize) -> Result<bool> {
        match b {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(invalid(
                self.path,
                format!("key '{key}' bool value (at offset {at})"),
                "0 or 1",
                b.to_string(),
                hint::CORRUPT,
            )),
        }
    }

    fn bad_type(&self, ty: u32, key: &str, at: usize) -> FormatError {
        invalid(
            self.path,
            format!("key '{key}' value type (at offset {at})"),
            "a gguf value type id 0..=12",
            ty.to_string(),
            hint::CORRUPT,
        )
    }

    fn read_array(&mut self, key: &str, depth: u32) -> Result<MetaValue> {
        let at = self.pos;
        let ety = self.u32(|| format!("key '{key}' array element type"))?;
        if ety > vt::F64 {
            return Err(self.bad_type(ety, key, at));
        }
        if ety == vt::ARRAY && depth + 1 >= MAX_ARRAY_DEPTH {
            return Err(invalid(
                self.path,
                format!("key '{key}' array (at offset {at})"),
                format!("arrays nested at most {MAX_ARRAY_DEPTH} deep"),
                format!("{} levels", depth + 2),
                hint::HOSTILE,
            ));
        }
        let count = self.u64(|| format!("key '{key}' array length"))?;
        self.check_count(
            count,
            MAX_ARRAY_LEN,
            vt::min_size(ety),
            &format!("key '{key}' array length (element type {})", vt::name(ety)),
        )?;
        self.count_values(count, key)?;
        let n = count as usize; // bounded by the remaining bytes, checked above
        let what = || format!("key '{key}' array of {count} {}", vt::name(ety));

        let elem = match ety {
            vt::U8 => Elem::U8,
            vt::I8 => Elem::I8,
            vt::U16 => Elem::U16,
            vt::I16 => Elem::I16,
            vt::U32 => Elem::U32,
            vt::I32 => Elem::I32,
            vt::F32 => Elem::F32,
            vt::U64 => Elem::U64,
            vt::I64 => Elem::I64,
            vt::F64 => Elem::F64,
            vt::BOOL => Elem::Bool,
            vt::STRING => Elem::String,
            _ => {
                // Nested arrays; depth was checked above.
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.read_array(key, depth + 1)?);
                }
                return Ok(MetaValue::Array(v.into()));
            }
        };

        // Validate the whole array in place: one bounds check for fixed-size elements, every
        // byte of a bool array, every length and byte of a string array.
        let start = self.pos;
        match elem.size() {
            Some(size) => {
                let b = self.take((n * size) as u64, what)?;
                if elem == Elem::Bool {
                    for (i, &x) in b.iter().enumerate() {
                        self.bool_byte(x, key, start + i)?;
                    }
                }
            }
            None => self.string_array(n, key)?,
        }
        let end = self.pos;

        if n >= LAZY_ARRAY_MIN_LEN {
            return Ok(MetaValue::Array(MetaArray::mapped(
                Arc::clone(self.src),
                start,
                end,
                n,
                elem,
            )));
        }
        let mut v = Vec::with_capacity(n);
        v.extend(Decoder::new(&self.bytes[start..end], n, elem).map(MetaRef::to_value));
        Ok(MetaValue::Array(v.into()))
    }

    fn alignment(&self, metadata: &Metadata) -> Result<u64> {
        match metadata.get(ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(MetaValue::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
            Some(MetaValue::U32(a)) => Err(invalid(
                self.path,
                format!("key '{ALIGNMENT_KEY}'"),
                "a power of two",
                a.to_string(),
                hint::CORRUPT,
            )),
            Some(other) => Err(invalid(
                self.path,
                format!("key '{ALIGNMENT_KEY}'"),
                "a u32 value",
                format!("{other:?}"),
                hint::CORRUPT,
            )),
        }
    }

    fn read_tensors(&mut self, n_tensors: u64, alignment: u64) -> Result<(Vec<TensorInfo>, u64)> {
        let n = n_tensors as usize; // checked against the remaining bytes by the caller
        let mut tensors = Vec::with_capacity(n);
        let mut names: HashSet<&'a str> = HashSet::with_capacity(n);
        let mut rel_offsets = Vec::with_capacity(n);
        for i in 0..n {
            let at = self.pos;
            let name = self.string(MAX_KEY_LEN, &|| format!("tensor #{i} name"))?;
            if name.is_empty() {
                return Err(invalid(
                    self.path,
                    format!("tensor #{i} name (at offset {at})"),
                    "a non-empty name",
                    "an empty string",
                    hint::CORRUPT,
                ));
            }
            if !names.insert(name) {
                return Err(invalid(
                    self.path,
                    format!("tensor '{name}'"),
                    "each tensor name once",
                    format!("a second '{name}' (tensor #{i} at offset {at})"),
                    hint::CORRUPT,
                ));
            }
            let tw = |field: &str| format!("tensor '{name}' {field}");
            let n_dims = self.u32(|| tw("dimension count"))?;
            if !(1..=MAX_DIMS).contains(&n_dims) {
                return Err(invalid(
                    self.path,
                    tw("dimension count"),
                    format!("1 to {MAX_DIMS} dimensions"),
                    n_dims.to_string(),
                    hint::CORRUPT,
                ));
            }
            let mut ne = [1u64; MAX_DIMS as usize];
            for (d, slot) in ne.iter_mut().take(n_dims as usize).enumerate() {
                let v = self.u64(|| tw(&format!("ne[{d}]")))?;
                if v == 0 || v > i64::MAX as u64 {
                    return Err(invalid(
                        self.path,
                        tw(&format!("ne[{d}]")),
                        format!("a dimension in 1..={}", i64::MAX),
                        v.to_string(),
                        hint::CORRUPT,
                    ));
                }
                *slot = v;
            }
            let ne = &ne[..n_dims as usize];
            let type_at = self.pos;
            let type_id = self.u32(|| tw("type"))?;
            let Some(dtype) = DType::from_ggml_id(type_id) else {
                let detail = match type_id {
                    4 | 5 => " (Q4_2/Q4_3, removed from ggml in 2023)",
                    31..=33 => " (Q4_0_4_4/Q4_0_4_8/Q4_0_8_8, removed from ggml in 2024)",
                    _ => "",
                };
                return Err(invalid(
                    self.path,
                    tw(&format!("type (at offset {type_at})")),
                    "a ggml type id that llama.cpp defines",
                    format!("{type_id}{detail}"),
                    if detail.is_empty() {
                        hint::NEWER_WRITER
                    } else {
                        hint::OLD_GGUF
                    },
                ));
            };
            let offset = self.u64(|| tw("offset"))?;

            let shape_str = || format!("{dtype} with ne {ne:?}");
            let n_elements = ne
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64);
            let Some(n_elements) = n_elements else {
                return Err(invalid(
                    self.path,
                    tw("shape"),
                    format!("at most {} elements", i64::MAX),
                    format!("{} (overflows)", shape_str()),
                    hint::HOSTILE,
                ));
            };
            if ne[0] % dtype.block_size() != 0 {
                return Err(invalid(
                    self.path,
                    tw("row length ne[0]"),
                    format!("a multiple of {dtype}'s block size {}", dtype.block_size()),
                    ne[0].to_string(),
                    hint::CORRUPT,
                ));
            }
            let Some(nbytes) = dtype.bytes_for(n_elements) else {
                return Err(invalid(
                    self.path,
                    tw("size"),
                    "a byte size that fits 64 bits",
                    format!("{} (overflows)", shape_str()),
                    hint::HOSTILE,
                ));
            };
            if offset % alignment != 0 {
                return Err(invalid(
                    self.path,
                    tw("offset"),
                    format!("a multiple of the alignment {alignment}"),
                    offset.to_string(),
                    hint::CORRUPT,
                ));
            }
            rel_offsets.push(offset);
            tensors.push(TensorInfo {
                name: name.to_owned(),
                dtype,
                shape: ne.iter().rev().copied().collect(),
                nbytes,
                file: 0,
                offset: 0, // made absolute below, once the data section start is known
                layer: None,
                role: None,
            });
        }

        let end_of_infos = self.pos as u64;
        let data_offset = end_of_infos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| {
                invalid(
                    self.path,
                    "data section offset",
                    "an offset that fits 64 bits",
                    format!("{end_of_infos} rounded up to {alignment}"),
                    hint::HOSTILE,
                )
            })?;
        let file_len = self.bytes.len() as u64;
        for (t, rel) in tensors.iter_mut().zip(&rel_offsets) {
            let start = data_offset.checked_add(*rel);
            let end = start.and_then(|s| s.checked_add(t.nbytes));
            match (start, end) {
                (Some(start), Some(end)) if end <= file_len => t.offset = start,
                _ => {
                    return Err(invalid(
                        self.path,
                        format!("tensor '{}' data", t.name),
                        format!(
                            "{} bytes ({} × {:?}) at data offset {rel} (absolute {}) within the file of {file_len} bytes",
                            t.nbytes,
                            t.dtype,
                            t.shape,
                            data_offset.saturating_add(*rel)
                        ),
                        format!(
                            "data ending at {}, past the end of the file",
                            data_offset.saturating_add(*rel).saturating_add(t.nbytes)
                        ),
                        hint::TRUNCATED,
                    ));
                }
            }
        }

        // Overlap: in offset order, each tensor must start at or after the end of the previous.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_unstable_by_key(|&i| tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            let a_end = a.offset + a.nbytes; // in bounds, checked above
            if b.offset < a_end {
                return Err(invalid(
                    self.path,
                    format!("tensor '{}' offset", b.name),
                    format!(
                        "at least {} (after tensor '{}', which needs {} bytes for {} × {:?} from offset {})",
                        a_end - data_offset,
                        a.name,
                        a.nbytes,
                        a.dtype,
                        a.shape,
                        a.offset - data_offset
                    ),
                    format!("{} (the tensors overlap)", b.offset - data_offset),
                    hint::CORRUPT,
                ));
            }
        }
        Ok((tensors, data_offset))
    }
}

/// A split part's name, `{prefix}-{no:05}-of-{count:05}.gguf` (llama.cpp's `llama_split_path`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct SplitName {
    prefix: String,
    /// 1-based, as in the file name.
    no: u32,
    count: u32,
    /// Digits used for the numbers (5, or more for ≥ 100000 parts).
    width: usize,
}

impl SplitName {
    fn parse(path: &Path) -> Option<SplitName> {
        let name = path.file_name()?.to_str()?;
        let stem = name.strip_suffix(".gguf")?;
        let (head, count) = stem.rsplit_once("-of-")?;
        let (prefix, no) = head.rsplit_once('-')?;
        let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
        if prefix.is_empty() || !digits(no) || !digits(count) || no.len() != count.len() {
            return None;
        }
        Some(SplitName {
            prefix: prefix.to_owned(),
            no: no.parse().ok()?,
            count: count.parse().ok()?,
            width: no.len(),
        })
    }

    fn part_path(&self, dir: &Path, no: u32) -> PathBuf {
        let w = self.width;
        dir.join(format!(
            "{}-{no:0w$}-of-{:0w$}.gguf",
            self.prefix, self.count
        ))
    }
}

/// The split keys gguf-split writes into every part.
pub const SPLIT_NO_KEY: &str = "split.no";
pub const SPLIT_COUNT_KEY: &str = "split.count";
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// Most parts of one split checkpoint.
pub const MAX_SPLIT_PARTS: u32 = 9_999;

fn split_key(meta: &Metadata, key: &str, path: &Path) -> Result<Option<u64>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            invalid(
                path,
                format!("key '{key}'"),
                "a non-negative integer",
                format!("{v:?}"),
                hint::CORRUPT,
            )
        }),
    }
}

/// Open a GGUF checkpoint: one file, or every part of a split set when `path` names any part
/// (`name-00002-of-00003.gguf` opens parts 1 to 3).
///
/// With `vocab_only`, each part's header and key/value section are parsed and validated, the
/// tensor info section is skipped, and no tensor is returned; tensor data is never touched.
pub(crate) fn read(path: &Path, vocab_only: bool) -> Result<Parsed> {
    let parse_file = |file: &Arc<MappedFile>, path: &Path| {
        let src: Backing = file.clone();
        parse_backed(&src, path, !vocab_only)
    };
    let split = SplitName::parse(path).filter(|s| s.count > 1);

    let Some(split) = split else {
        let file = Arc::new(MappedFile::open(path)?);
        let header = parse_file(&file, path)?;
        if let Some(count) = split_key(&header.metadata, SPLIT_COUNT_KEY, path)?
            && count > 1
        {
            return Err(invalid(
                path,
                format!("key '{SPLIT_COUNT_KEY}'"),
                "a file name like name-00001-of-00003.gguf for a split checkpoint",
                format!("{count} parts, in a file named '{}'", path.display()),
                hint::SPLIT_NAMES,
            ));
        }
        return Ok(assemble(vec![file], vec![header], vocab_only));
    };

    if split.no == 0 || split.no > split.count || split.count > MAX_SPLIT_PARTS {
        return Err(invalid(
            path,
            "split file name",
            format!("part 1..={} of at most {MAX_SPLIT_PARTS}", split.count),
            format!("part {} of {}", split.no, split.count),
            hint::SPLIT_NAMES,
        ));
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut files = Vec::with_capacity(split.count as usize);
    let mut headers = Vec::with_capacity(split.count as usize);
    for no in 1..=split.count {
        let part = split.part_path(dir, no);
        if !part.exists() {
            return Err(invalid(
                &part,
                format!("split part {no} of {}", split.count),
                "the file to exist",
                "no such file",
                hint::SHARDS,
            ));
        }
        let file = Arc::new(MappedFile::open(&part)?);
        let header = parse_file(&file, &part)?;
        files.push(file);
        headers.push(header);
    }

    // Every part carries split.no (0-based), split.count and split.tensors.count.
    let mut total_claimed = None;
    let mut total_found = 0u64;
    for (i, (file, h)) in files.iter().zip(&headers).enumerate() {
        let p = file.path();
        let req = |key: &str| -> Result<u64> {
            split_key(&h.metadata, key, p)?.ok_or_else(|| {
                invalid(
                    p,
                    format!("key '{key}'"),
                    "the key in every part of a split checkpoint",
                    "no such key",
                    hint::SPLIT_NAMES,
                )
            })
        };
        let no = req(SPLIT_NO_KEY)?;
        if no != i as u64 {
            return Err(invalid(
                p,
                format!("key '{SPLIT_NO_KEY}'"),
                format!("{i} (0-based) for part {} of the file names", i + 1),
                no.to_string(),
                hint::SPLIT_NAMES,
            ));
        }
        let count = req(SPLIT_COUNT_KEY)?;
        if count != u64::from(split.count) {
            return Err(invalid(
                p,
                format!("key '{SPLIT_COUNT_KEY}'"),
                format!("{} as the file names say", split.count),
                count.to_string(),
                hint::SHARDS,
            ));
        }
        let claimed = req(SPLIT_TENSORS_COUNT_KEY)?;
        match total_claimed {
            None => total_claimed = Some(claimed),
            Some(first) if first != claimed => {
                return Err(invalid(
                    p,
                    format!("key '{SPLIT_TENSORS_COUNT_KEY}'"),
                    format!("{first}, as in part 1"),
                    claimed.to_string(),
                    hint::SHARDS,
                ));
            }
            Some(_) => {}
        }
        total_found = total_found.saturating_add(h.n_tensors);
    }
    if let Some(claimed) = total_claimed
        && claimed != total_found
    {
        return Err(invalid(
            files[0].path(),
            format!("key '{SPLIT_TENSORS_COUNT_KEY}'"),
            format!("{claimed} tensors over the {} parts", split.count),
            format!("{total_found} tensors in the parts' headers"),
            hint::SHARDS,
        ));
    }
    if !vocab_only {
        let mut seen: HashSet<&str> = HashSet::new();
        for (file, h) in files.iter().zip(&headers) {
            for t in &h.tensors {
                if !seen.insert(&t.name) {
                    return Err(invalid(
                        file.path(),
                        format!("tensor '{}'", t.name),
                        "each tensor name once over all split parts",
                        "a second copy in this part",
                        hint::SHARDS,
                    ));
                }
            }
        }
    }
    Ok(assemble(files, headers, vocab_only))
}

/// Metadata from the first part, tensors from every part (each pointing at its part).
fn assemble(files: Vec<Arc<MappedFile>>, headers: Vec<GgufHeader>, vocab_only: bool) -> Parsed {
    let mut headers = headers.into_iter();
    let first = headers.next();
    let (metadata, mut tensors) = match first {
        Some(h) => (h.metadata, h.tensors),
        None => (Metadata::new(), Vec::new()),
    };
    for (i, h) in headers.enumerate() {
        tensors.extend(h.tensors.into_iter().map(|mut t| {
            t.file = i + 1;
            t
        }));
    }
    if vocab_only {
        tensors.clear();
    }
    let tokenizer = tokenizer_info(&metadata);
    Parsed {
        files,
        metadata,
        tensors,
        config: None,
        tokenizer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        let s = SplitName::parse(Path::new("/m/llama-7b-00002-of-00003.gguf")).unwrap();
        assert_eq!(
            s,
            SplitName {
                prefix: "llama-7b".into(),
                no: 2,
                count: 3,
                width: 5
            }
        );
        assert_eq!(
            s.part_path(Path::new("/m"), 1),
            PathBuf::from("/m/llama-7b-00001-of-00003.gguf")
        );
        assert_eq!(SplitName::parse(Path::new("model.gguf")), None);
        assert_eq!(SplitName::parse(Path::new("m-1-of-3.gguf")), None);
        assert_eq!(SplitName::parse(Path::new("-00001-of-00003.gguf")), None);
    }
}
