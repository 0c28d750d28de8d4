//! The parser of one GGUF file: a bounds-checked little-endian cursor over the bytes, the
//! header (magic, version, counts), `general.alignment`, and the order in which the sections
//! are read. The key/value section is in [`kv`], the tensor info table in [`tensors`].
//!
//! Every claimed count is checked against what the remaining bytes could hold before anything
//! is reserved, so a hostile header cannot make the parser allocate beyond the file's size.

mod kv;
mod tensors;

use std::path::Path;

use super::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GgufHeader, MAGIC, MAX_KV, MAX_LATER_VERSION, MAX_TENSORS,
    SUPPORTED_VERSIONS, invalid,
};
use crate::error::show_bytes;
use crate::metadata::Backing;
use crate::{FormatError, MetaValue, Metadata, Result, hint};

// The fewest bytes each record can take, used to refuse counts the file cannot hold before
// anything is reserved.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // key length, value type, one byte of value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8; // name length, n_dims, one dim, type, offset

/// Parse the bytes of `src`; long metadata arrays keep a handle on `src`.
pub(super) fn parse_backed(src: &Backing, path: &Path, with_tensors: bool) -> Result<GgufHeader> {
    Parser::new(src, path).parse(with_tensors)
}

/// A bounds-checked little-endian reader over the file bytes.
struct Parser<'a> {
    bytes: &'a [u8],
    /// The owner of `bytes`, shared with lazy metadata arrays.
    src: &'a Backing,
    pos: usize,
    path: &'a Path,
    /// Metadata values read so far, against [`MAX_METADATA_VALUES`](super::MAX_METADATA_VALUES).
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
                format!("the GGUF magic {}", show_bytes(&MAGIC)),
                format!("{}, the magic stored big-endian", show_bytes(&magic)),
                hint::BYTE_ORDER,
            ));
        }
        if magic != MAGIC {
            return Err(invalid(
                self.path,
                "header magic",
                format!("the GGUF magic {}", show_bytes(&MAGIC)),
                show_bytes(&magic),
                hint::NOT_GGUF,
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
        // bits all zero, a big-endian one read as little-endian always does. Only a swapped
        // value that is itself a version is taken for one.
        if version & 0xffff == 0 && (1..=MAX_LATER_VERSION).contains(&swapped) {
            return Err(invalid(
                self.path,
                "header version",
                "2 or 3, stored little-endian",
                format!("{version:#010x}, which is version {swapped} stored big-endian"),
                hint::BYTE_ORDER,
            ));
        }
        match version {
            1 => Err(FormatError::Unsupported {
                path: self.path.to_path_buf(),
                what: "gguf version 1".into(),
                detail: format!(
                    "version 1 (32-bit counts and lengths) is refused; this build reads versions 2 and 3; {}",
                    hint::OLD_GGUF
                ),
            }),
            0 => Err(invalid(
                self.path,
                "header version",
                "2 or 3",
                "0",
                hint::CORRUPT,
            )),
            4..=MAX_LATER_VERSION => Err(FormatError::Unsupported {
                path: self.path.to_path_buf(),
                what: format!("gguf version {version}"),
                detail: format!("this build reads versions 2 and 3; {}", hint::NEWER_WRITER),
            }),
            _ => Err(invalid(
                self.path,
                "header version",
                format!(
                    "2 or 3 (a later GGUF revision would be a small number, at most \
                     {MAX_LATER_VERSION})"
                ),
                format!("{version} (bytes {})", show_bytes(&version.to_le_bytes())),
                hint::CORRUPT_HEADER,
            )),
        }
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
}
