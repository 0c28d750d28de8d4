//! A minimal GGUF writer for hand-built test files, following llama.cpp's `docs/gguf.md`
//! byte for byte. It writes whatever it is told, including invalid files: every field can be
//! overridden so each structural error can be produced in isolation.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A metadata value as written on disk.
#[derive(Clone, Debug)]
pub enum V {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(u8),
    Str(Vec<u8>),
    /// Element type id and elements (all of that type).
    Arr(u32, Vec<V>),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Any type id with raw value bytes.
    Raw(u32, Vec<u8>),
}

pub fn s(v: &str) -> V {
    V::Str(v.as_bytes().to_vec())
}

impl V {
    pub fn type_id(&self) -> u32 {
        match self {
            V::U8(_) => 0,
            V::I8(_) => 1,
            V::U16(_) => 2,
            V::I16(_) => 3,
            V::U32(_) => 4,
            V::I32(_) => 5,
            V::F32(_) => 6,
            V::Bool(_) => 7,
            V::Str(_) => 8,
            V::Arr(..) => 9,
            V::U64(_) => 10,
            V::I64(_) => 11,
            V::F64(_) => 12,
            V::Raw(t, _) => *t,
        }
    }

    /// The value bytes (without the type id).
    pub fn write(&self, out: &mut Vec<u8>) {
        match self {
            V::U8(v) => out.push(*v),
            V::I8(v) => out.extend(v.to_le_bytes()),
            V::U16(v) => out.extend(v.to_le_bytes()),
            V::I16(v) => out.extend(v.to_le_bytes()),
            V::U32(v) => out.extend(v.to_le_bytes()),
            V::I32(v) => out.extend(v.to_le_bytes()),
            V::F32(v) => out.extend(v.to_le_bytes()),
            V::Bool(v) => out.push(*v),
            V::Str(b) => {
                out.extend((b.len() as u64).to_le_bytes());
                out.extend(b);
            }
            V::Arr(t, items) => {
                out.extend(t.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for i in items {
                    i.write(out);
                }
            }
            V::U64(v) => out.extend(v.to_le_bytes()),
            V::I64(v) => out.extend(v.to_le_bytes()),
            V::F64(v) => out.extend(v.to_le_bytes()),
            V::Raw(_, b) => out.extend(b),
        }
    }
}

#[derive(Clone, Debug)]
pub struct T {
    pub name: Vec<u8>,
    pub ne: Vec<u64>,
    pub type_id: u32,
    /// Offset relative to the data section; `None` lays tensors out one after another.
    pub offset: Option<u64>,
}

pub fn t(name: &str, ne: &[u64], type_id: u32) -> T {
    T {
        name: name.as_bytes().to_vec(),
        ne: ne.to_vec(),
        type_id,
        offset: None,
    }
}

/// (block size, bytes per block) for the type ids used in these tests.
pub fn type_size(type_id: u32) -> (u64, u64) {
    match type_id {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0
        8 => (32, 34),    // Q8_0
        12 => (256, 144), // Q4_K
        30 => (1, 2),     // BF16
        _ => (1, 1),
    }
}

/// Largest file `Gguf::build` lays data out for.
pub const MAX_FIXTURE_BYTES: u64 = 1 << 24;

#[derive(Clone, Debug)]
pub struct Gguf {
    pub magic: [u8; 4],
    pub version: u32,
    pub kv: Vec<(Vec<u8>, V)>,
    pub tensors: Vec<T>,
    /// Header counts; `None` writes the real counts.
    pub n_tensors: Option<u64>,
    pub n_kv: Option<u64>,
    /// Alignment used for layout (write `general.alignment` yourself to change what the file
    /// says).
    pub alignment: u64,
    /// Byte that fills tensor data.
    pub fill: u8,
}

impl Default for Gguf {
    fn default() -> Self {
        Gguf {
            magic: *b"GGUF",
            version: 3,
            kv: Vec::new(),
            tensors: Vec::new(),
            n_tensors: None,
            n_kv: None,
            alignment: 32,
            fill: 0,
        }
    }
}

/// Where each structural part of a written file starts.
#[derive(Debug, Default, Clone)]
pub struct Layout {
    pub kv_start: usize,
    pub tensor_info_start: usize,
    pub data_start: usize,
    pub len: usize,
}

impl Gguf {
    pub fn kv(mut self, key: &str, v: V) -> Self {
        self.kv.push((key.as_bytes().to_vec(), v));
        self
    }

    pub fn tensor(mut self, t: T) -> Self {
        self.tensors.push(t);
        self
    }

    pub fn bytes(&self) -> Vec<u8> {
        self.build().0
    }

    pub fn build(&self) -> (Vec<u8>, Layout) {
        let mut out = Vec::new();
        let mut layout = Layout::default();
        out.extend(self.magic);
        out.extend(self.version.to_le_bytes());
        out.extend(
            self.n_tensors
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        out.extend(self.n_kv.unwrap_or(self.kv.len() as u64).to_le_bytes());
        layout.kv_start = out.len();
        for (k, v) in &self.kv {
            out.extend((k.len() as u64).to_le_bytes());
            out.extend(k);
            out.extend(v.type_id().to_le_bytes());
            v.write(&mut out);
        }
        layout.tensor_info_start = out.len();
        let a = self.alignment;
        let pad = |n: u64| n.div_ceil(a).saturating_mul(a);
        let mut next = 0u64;
        let mut sizes = Vec::new();
        for t in &self.tensors {
            let (bs, ts) = type_size(t.type_id);
            let n = t.ne.iter().fold(1u64, |a, &d| a.saturating_mul(d));
            let nbytes = (n / bs).saturating_mul(ts);
            let off = t.offset.unwrap_or(next);
            next = pad(off.saturating_add(nbytes));
            sizes.push((off, nbytes));
            out.extend((t.name.len() as u64).to_le_bytes());
            out.extend(&t.name);
            out.extend((t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.type_id.to_le_bytes());
            out.extend(off.to_le_bytes());
        }
        let data_start = pad(out.len() as u64) as usize;
        out.resize(data_start, 0);
        layout.data_start = data_start;
        let end = sizes
            .iter()
            .map(|(o, n)| (data_start as u64).saturating_add(*o).saturating_add(*n))
            .max()
            .unwrap_or(data_start as u64);
        // Absurd layouts (the overflow tests) get no data rather than a huge allocation.
        if end <= MAX_FIXTURE_BYTES {
            out.resize(end as usize, self.fill);
        }
        layout.len = out.len();
        (out, layout)
    }
}

/// A small valid file: every metadata type, a nested array, three tensors.
pub fn valid() -> Gguf {
    Gguf::default()
        .kv("general.architecture", s("llama"))
        .kv("t.u8", V::U8(200))
        .kv("t.i8", V::I8(-100))
        .kv("t.u16", V::U16(60000))
        .kv("t.i16", V::I16(-30000))
        .kv("t.u32", V::U32(4_000_000_000))
        .kv("t.i32", V::I32(-2_000_000_000))
        .kv("t.f32", V::F32(1.5))
        .kv("t.bool", V::Bool(1))
        .kv("t.string", s("héllo"))
        .kv(
            "t.array",
            V::Arr(
                9,
                vec![
                    V::Arr(4, vec![V::U32(1), V::U32(2)]),
                    V::Arr(8, vec![s("a"), s("bc")]),
                ],
            ),
        )
        .kv("t.u64", V::U64(u64::MAX))
        .kv("t.i64", V::I64(i64::MIN))
        .kv("t.f64", V::F64(-0.25))
        .kv("tokenizer.ggml.model", s("gpt2"))
        .kv(
            "tokenizer.ggml.tokens",
            V::Arr(8, vec![s("<s>"), s("</s>"), s("a")]),
        )
        .kv("tokenizer.ggml.merges", V::Arr(8, vec![s("a b")]))
        .kv("tokenizer.ggml.bos_token_id", V::U32(0))
        .kv("tokenizer.ggml.eos_token_id", V::U32(1))
        .tensor(t("token_embd.weight", &[64, 3], 8))
        .tensor(t("output_norm.weight", &[5], 0))
        .tensor(t("blk.0.attn_q.weight", &[256, 2], 12))
}

/// A fresh empty directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "weightlift-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

pub fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write fixture");
}
