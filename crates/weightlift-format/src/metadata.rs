//! Checkpoint metadata: GGUF key/value pairs (all 13 value types) or safetensors `__metadata__`.
//!
//! Large GGUF arrays (tokenizer vocabularies, merges, scores, token types: ~10^5 elements) are
//! not copied out of the file. The reader validates them completely at open time (bounds,
//! lengths, caps, bool bytes, strict UTF-8) in one pass that allocates nothing per element,
//! and keeps a [`MetaArray`] that refers to their bytes: a byte range, an element count and an
//! element type, together with a shared handle on the bytes (the memory map), so the value
//! outlives any borrow of the checkpoint. Elements are decoded on demand by [`MetaArray::get`]
//! and [`MetaArray::iter`] as [`MetaRef`]s, which borrow strings from the map.
//!
//! Arrays shorter than [`LAZY_ARRAY_MIN_LEN`] elements, and arrays of arrays, are decoded at
//! open into plain values: they are few and small (per-layer head counts, nested test data),
//! and eager values are simpler to inspect. Arrays of arrays still hold lazy inner arrays when
//! those are long.

use std::fmt;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Arrays with at least this many elements of one scalar or string type stay in the file and
/// are decoded on demand; shorter ones (and arrays of arrays) are decoded at open.
pub const LAZY_ARRAY_MIN_LEN: usize = 64;

/// The bytes lazy arrays point into: a memory-mapped file, or (for [`crate::gguf::parse`]
/// over a byte slice) one owned copy of the input.
pub(crate) type Backing = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// One metadata value. Arrays may nest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A borrowed metadata value: what [`MetaArray`] elements decode to (strings borrow the file),
/// and what [`MetaValue::view`] gives for a plain value. Same variants as [`MetaValue`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MetaRef<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(&'a str),
    Array(&'a MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// This value as a [`MetaRef`], to share code with array elements.
    pub fn view(&self) -> MetaRef<'_> {
        match *self {
            MetaValue::U8(v) => MetaRef::U8(v),
            MetaValue::I8(v) => MetaRef::I8(v),
            MetaValue::U16(v) => MetaRef::U16(v),
            MetaValue::I16(v) => MetaRef::I16(v),
            MetaValue::U32(v) => MetaRef::U32(v),
            MetaValue::I32(v) => MetaRef::I32(v),
            MetaValue::F32(v) => MetaRef::F32(v),
            MetaValue::Bool(v) => MetaRef::Bool(v),
            MetaValue::String(ref s) => MetaRef::String(s),
            MetaValue::Array(ref a) => MetaRef::Array(a),
            MetaValue::U64(v) => MetaRef::U64(v),
            MetaValue::I64(v) => MetaRef::I64(v),
            MetaValue::F64(v) => MetaRef::F64(v),
        }
    }

    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        self.view().as_u64()
    }

    /// The value as a float, when it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        self.view().as_f64()
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        self.view().as_bool()
    }

    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl<'a> MetaRef<'a> {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(self) -> Option<u64> {
        match self {
            MetaRef::U8(v) => Some(v.into()),
            MetaRef::U16(v) => Some(v.into()),
            MetaRef::U32(v) => Some(v.into()),
            MetaRef::U64(v) => Some(v),
            MetaRef::I8(v) => u64::try_from(v).ok(),
            MetaRef::I16(v) => u64::try_from(v).ok(),
            MetaRef::I32(v) => u64::try_from(v).ok(),
            MetaRef::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is any number.
    pub fn as_f64(self) -> Option<f64> {
        match self {
            MetaRef::F32(v) => Some(v.into()),
            MetaRef::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(self) -> Option<&'a str> {
        match self {
            MetaRef::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(self) -> Option<bool> {
        match self {
            MetaRef::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(self) -> Option<&'a MetaArray> {
        match self {
            MetaRef::Array(a) => Some(a),
            _ => None,
        }
    }

    /// An owned copy (lazy arrays inside stay lazy: cloning one shares the bytes).
    pub fn to_value(self) -> MetaValue {
        match self {
            MetaRef::U8(v) => MetaValue::U8(v),
            MetaRef::I8(v) => MetaValue::I8(v),
            MetaRef::U16(v) => MetaValue::U16(v),
            MetaRef::I16(v) => MetaValue::I16(v),
            MetaRef::U32(v) => MetaValue::U32(v),
            MetaRef::I32(v) => MetaValue::I32(v),
            MetaRef::F32(v) => MetaValue::F32(v),
            MetaRef::Bool(v) => MetaValue::Bool(v),
            MetaRef::String(s) => MetaValue::String(s.to_owned()),
            MetaRef::Array(a) => MetaValue::Array(a.clone()),
            MetaRef::U64(v) => MetaValue::U64(v),
            MetaRef::I64(v) => MetaValue::I64(v),
            MetaRef::F64(v) => MetaValue::F64(v),
        }
    }
}

impl Serialize for MetaRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            MetaRef::U8(v) => s.serialize_u8(v),
            MetaRef::I8(v) => s.serialize_i8(v),
            MetaRef::U16(v) => s.serialize_u16(v),
            MetaRef::I16(v) => s.serialize_i16(v),
            MetaRef::U32(v) => s.serialize_u32(v),
            MetaRef::I32(v) => s.serialize_i32(v),
            MetaRef::F32(v) => s.serialize_f32(v),
            MetaRef::Bool(v) => s.serialize_bool(v),
            MetaRef::String(v) => s.serialize_str(v),
            MetaRef::Array(a) => a.serialize(s),
            MetaRef::U64(v) => s.serialize_u64(v),
            MetaRef::I64(v) => s.serialize_i64(v),
            MetaRef::F64(v) => s.serialize_f64(v),
        }
    }
}

/// The element type of an array kept in the file (GGUF value types other than array).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    U64,
    I64,
    F64,
}

impl Elem {
    /// Bytes per element, or `None` for strings (a u64 length, then the bytes).
    pub(crate) const fn size(self) -> Option<usize> {
        match self {
            Elem::U8 | Elem::I8 | Elem::Bool => Some(1),
            Elem::U16 | Elem::I16 => Some(2),
            Elem::U32 | Elem::I32 | Elem::F32 => Some(4),
            Elem::U64 | Elem::I64 | Elem::F64 => Some(8),
            Elem::String => None,
        }
    }
}

/// Decodes the elements of a validated array region, front to back.
///
/// The region was validated when the file was opened. A memory map can still change under us
/// if another process rewrites the file (outside the contract of every mmap loader), so
/// decoding stays checked: it never panics, and it stops early instead of reading garbage.
#[derive(Clone)]
pub(crate) struct Decoder<'a> {
    bytes: &'a [u8],
    left: usize,
    elem: Elem,
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(bytes: &'a [u8], len: usize, elem: Elem) -> Self {
        Decoder {
            bytes,
            left: len,
            elem,
        }
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.bytes.split_first_chunk::<N>()?;
        self.bytes = rest;
        Some(*head)
    }

    /// Skips one element without decoding it.
    fn skip_one(&mut self) -> Option<()> {
        let n = match self.elem.size() {
            Some(n) => n,
            None => usize::try_from(u64::from_le_bytes(self.take::<8>()?)).ok()?,
        };
        self.bytes = self.bytes.get(n..)?;
        Some(())
    }
}

impl<'a> Decoder<'a> {
    fn decode(&mut self) -> Option<MetaRef<'a>> {
        Some(match self.elem {
            Elem::U8 => MetaRef::U8(u8::from_le_bytes(self.take()?)),
            Elem::I8 => MetaRef::I8(i8::from_le_bytes(self.take()?)),
            Elem::U16 => MetaRef::U16(u16::from_le_bytes(self.take()?)),
            Elem::I16 => MetaRef::I16(i16::from_le_bytes(self.take()?)),
            Elem::U32 => MetaRef::U32(u32::from_le_bytes(self.take()?)),
            Elem::I32 => MetaRef::I32(i32::from_le_bytes(self.take()?)),
            Elem::F32 => MetaRef::F32(f32::from_le_bytes(self.take()?)),
            Elem::U64 => MetaRef::U64(u64::from_le_bytes(self.take()?)),
            Elem::I64 => MetaRef::I64(i64::from_le_bytes(self.take()?)),
            Elem::F64 => MetaRef::F64(f64::from_le_bytes(self.take()?)),
            Elem::Bool => match self.take::<1>()? {
                [0] => MetaRef::Bool(false),
                [1] => MetaRef::Bool(true),
                _ => return None,
            },
            Elem::String => {
                let n = usize::try_from(u64::from_le_bytes(self.take::<8>()?)).ok()?;
                let (s, rest) = self.bytes.split_at_checked(n)?;
                self.bytes = rest;
                MetaRef::String(std::str::from_utf8(s).ok()?)
            }
        })
    }
}

impl<'a> Iterator for Decoder<'a> {
    type Item = MetaRef<'a>;

    fn next(&mut self) -> Option<MetaRef<'a>> {
        if self.left == 0 {
            return None;
        }
        match self.decode() {
            Some(v) => {
                self.left -= 1;
                Some(v)
            }
            None => {
                // Only a file rewritten since it was validated gets here: stop for good.
                self.left = 0;
                None
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.left))
    }
}

/// A metadata array: plain values, or (for long arrays read from GGUF) a validated region of
/// the file decoded on demand. Both compare, print and serialise as the list of their values.
#[derive(Clone)]
pub struct MetaArray(Repr);

#[derive(Clone)]
enum Repr {
    Values(Vec<MetaValue>),
    Mapped(Arc<Mapped>),
}

/// A validated array region of a shared byte buffer.
struct Mapped {
    src: Backing,
    /// Byte range of the elements (after the array's type and length fields).
    start: usize,
    end: usize,
    len: usize,
    elem: Elem,
    /// Offsets (from `start`) of each string element, built on the first `get` of a string
    /// array so that random access is O(1) after one walk.
    index: OnceLock<Box<[usize]>>,
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        let all: &[u8] = (*self.src).as_ref();
        all.get(self.start..self.end).unwrap_or(&[])
    }

    fn decoder(&self) -> Decoder<'_> {
        Decoder::new(self.bytes(), self.len, self.elem)
    }

    fn get(&self, i: usize) -> Option<MetaRef<'_>> {
        if i >= self.len {
            return None;
        }
        let bytes = self.bytes();
        let at = match self.elem.size() {
            Some(size) => i.checked_mul(size)?,
            None => *self.index.get_or_init(|| self.string_offsets()).get(i)?,
        };
        Decoder::new(bytes.get(at..)?, 1, self.elem).next()
    }

    fn string_offsets(&self) -> Box<[usize]> {
        let bytes = self.bytes();
        let mut d = self.decoder();
        let mut offsets = Vec::with_capacity(self.len);
        for _ in 0..self.len {
            offsets.push(bytes.len() - d.bytes.len());
            if d.skip_one().is_none() {
                offsets.pop();
                break;
            }
        }
        offsets.into_boxed_slice()
    }
}

impl MetaArray {
    /// An array kept in `src[start..end]`: `len` elements of `elem`, already validated.
    pub(crate) fn mapped(src: Backing, start: usize, end: usize, len: usize, elem: Elem) -> Self {
        MetaArray(Repr::Mapped(Arc::new(Mapped {
            src,
            start,
            end,
            len,
            elem,
            index: OnceLock::new(),
        })))
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Values(v) => v.len(),
            Repr::Mapped(m) => m.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i`. O(1); the first `get` on a lazy string array walks it once to index it.
    pub fn get(&self, i: usize) -> Option<MetaRef<'_>> {
        match &self.0 {
            Repr::Values(v) => v.get(i).map(MetaValue::view),
            Repr::Mapped(m) => m.get(i),
        }
    }

    /// The elements in order.
    pub fn iter(&self) -> MetaIter<'_> {
        MetaIter(match &self.0 {
            Repr::Values(v) => IterRepr::Values(v.iter()),
            Repr::Mapped(m) => IterRepr::Mapped(m.decoder()),
        })
    }

    /// True when the elements are decoded from the file on demand rather than held as values.
    pub fn is_lazy(&self) -> bool {
        matches!(self.0, Repr::Mapped(_))
    }

    /// Every element as an owned value.
    pub fn to_vec(&self) -> Vec<MetaValue> {
        let mut v = Vec::with_capacity(self.len());
        v.extend(self.iter().map(MetaRef::to_value));
        v
    }
}

impl From<Vec<MetaValue>> for MetaArray {
    fn from(v: Vec<MetaValue>) -> Self {
        MetaArray(Repr::Values(v))
    }
}

impl FromIterator<MetaValue> for MetaArray {
    fn from_iter<I: IntoIterator<Item = MetaValue>>(iter: I) -> Self {
        MetaArray(Repr::Values(iter.into_iter().collect()))
    }
}

impl<'a> IntoIterator for &'a MetaArray {
    type Item = MetaRef<'a>;
    type IntoIter = MetaIter<'a>;
    fn into_iter(self) -> MetaIter<'a> {
        self.iter()
    }
}

impl PartialEq for MetaArray {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl fmt::Debug for MetaArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for MetaArray {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for MetaArray {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<MetaValue>::deserialize(d).map(MetaArray::from)
    }
}

/// Iterator over a [`MetaArray`]'s elements.
#[derive(Clone)]
pub struct MetaIter<'a>(IterRepr<'a>);

#[derive(Clone)]
enum IterRepr<'a> {
    Values(std::slice::Iter<'a, MetaValue>),
    Mapped(Decoder<'a>),
}

impl<'a> Iterator for MetaIter<'a> {
    type Item = MetaRef<'a>;

    fn next(&mut self) -> Option<MetaRef<'a>> {
        match &mut self.0 {
            IterRepr::Values(it) => it.next().map(MetaValue::view),
            IterRepr::Mapped(d) => d.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterRepr::Values(it) => it.size_hint(),
            IterRepr::Mapped(d) => d.size_hint(),
        }
    }
}

/// Ordered key/value metadata, in file order.
pub type Metadata = indexmap::IndexMap<String, MetaValue>;
