//! The key/value section: every value type, arrays nested to a capped depth, and the caps on
//! key, string and array lengths and on the number of values in all. Long arrays of scalars or
//! strings are validated in place and kept as lazy [`MetaArray`]s over the file bytes; string
//! arrays (vocabularies, merges) take the fast path in `string_array`.

use std::sync::Arc;

use super::Parser;
use crate::gguf::{
    MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_KEY_LEN, MAX_METADATA_VALUES, MAX_STRING_LEN, invalid,
};
use crate::metadata::{Decoder, Elem, LAZY_ARRAY_MIN_LEN};
use crate::{FormatError, MetaArray, MetaRef, MetaValue, Metadata, Result, hint};

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

impl<'a> Parser<'a> {
    pub(super) fn read_metadata(&mut self, n_kv: u64) -> Result<Metadata> {
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
}
