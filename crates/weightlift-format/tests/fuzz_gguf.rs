//! A proptest fuzzer for the GGUF parser: valid files mutated by bit flips, truncations,
//! random splices and absurd u64 counts, fed to `gguf::parse` and `gguf::parse_metadata`.
//! Neither may panic, and whatever `parse` accepts must satisfy the checks it promises (data
//! inside the file, aligned, non-overlapping; unique names; 1 to 4 dimensions).
//!
//! `fuzz_quick` runs 500 cases in every `cargo test`. `fuzz_long` is ignored by default and
//! runs `$WEIGHTLIFT_FUZZ_CASES` cases (default 2000); `make fuzz` runs it with 100,000 in
//! release mode.

use crate::gguf_util;

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gguf_util::{Gguf, V, s, t, valid};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use weightlift_format::{MetaArray, MetaRef, MetaValue, Metadata, gguf};

/// The inputs mutations start from.
fn seeds() -> Vec<Vec<u8>> {
    let mut v2 = valid();
    v2.version = 2;
    let many = (0..12).fold(
        Gguf::default()
            .kv("general.alignment", V::U32(64))
            .kv("split.count", V::U16(1))
            // Long enough to be kept lazily in the file (LAZY_ARRAY_MIN_LEN).
            .kv(
                "tokenizer.ggml.tokens",
                V::Arr(8, (0..80).map(|i| s(&format!("tok{i}"))).collect()),
            )
            .kv("tokenizer.ggml.scores", V::Arr(6, vec![V::F32(0.5); 80]))
            .kv("tokenizer.ggml.token_type", V::Arr(5, vec![V::I32(1); 80]))
            .kv("t.flags", V::Arr(7, vec![V::Bool(1); 70]))
            .kv(
                "t.nested",
                V::Arr(
                    9,
                    vec![V::Arr(8, (0..70).map(|i| s(&format!("m{i}"))).collect())],
                ),
            ),
        |g, i| g.tensor(t(&format!("blk.{i}.w"), &[32, 2], [0, 1, 2, 8][i % 4])),
    );
    let mut many = many;
    many.alignment = 64;
    vec![valid().bytes(), v2.bytes(), many.bytes()]
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    Truncate {
        at: usize,
    },
    /// Overwrite 8 bytes with an interesting or random u64.
    PutU64 {
        at: usize,
        value: u64,
    },
    /// Copy `len` bytes from `from` over position `to`.
    Splice {
        from: usize,
        to: usize,
        len: usize,
    },
    /// Insert random bytes.
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    /// Delete a range.
    Delete {
        at: usize,
        len: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(3),
        Just(4),
        Just(5),
        Just(31),
        Just(32),
        Just(255),
        Just(65_535),
        Just(1 << 24),
        Just(1 << 32),
        Just((1 << 32) - 1),
        Just(1 << 62),
        Just(1 << 63),
        Just(i64::MAX as u64),
        Just(u64::MAX),
        Just(u64::MAX - 31),
        any::<u64>(),
        0u64..4096,
    ];
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        2 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        4 => (any::<usize>(), interesting).prop_map(|(at, value)| Mutation::PutU64 { at, value }),
        1 => (any::<usize>(), any::<usize>(), 1usize..64)
            .prop_map(|(from, to, len)| Mutation::Splice { from, to, len }),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1usize..32).prop_map(|(at, len)| Mutation::Delete { at, len }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    if n == 0 {
        return;
    }
    match m {
        Mutation::FlipBit { at, bit } => bytes[at % n] ^= 1 << bit,
        Mutation::Truncate { at } => bytes.truncate(at % n),
        Mutation::PutU64 { at, value } => {
            // Mostly at 8-byte-aligned or field-like positions, where counts live.
            let at = at % n;
            for (i, b) in value.to_le_bytes().iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at + i) {
                    *slot = *b;
                }
            }
        }
        Mutation::Splice { from, to, len } => {
            let (from, to) = (from % n, to % n);
            let len = (*len).min(n - from).min(n - to);
            let chunk = bytes[from..from + len].to_vec();
            bytes[to..to + len].copy_from_slice(&chunk);
        }
        Mutation::Insert { at, bytes: ins } => {
            let at = at % (n + 1);
            bytes.splice(at..at, ins.iter().copied());
        }
        Mutation::Delete { at, len } => {
            let at = at % n;
            let end = (at + len).min(n);
            bytes.drain(at..end);
        }
    }
}

/// Inputs tried and inputs `parse` accepted, for the report.
static TRIED: AtomicU64 = AtomicU64::new(0);
static ACCEPTED: AtomicU64 = AtomicU64::new(0);

/// Parse one input; panics propagate, and an accepted file must honour the validation rules.
fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = Path::new("fuzz.gguf");
    let start = Instant::now();
    if let Ok(h) = gguf::parse_metadata(bytes, path) {
        decode_all(&h.metadata)?;
    }
    TRIED.fetch_add(1, Ordering::Relaxed);
    if let Ok(h) = gguf::parse(bytes, path) {
        ACCEPTED.fetch_add(1, Ordering::Relaxed);
        decode_all(&h.metadata)?;
        let len = bytes.len() as u64;
        prop_assert!(h.alignment.is_power_of_two());
        prop_assert_eq!(h.data_offset % h.alignment, 0);
        prop_assert_eq!(h.tensors.len() as u64, h.n_tensors);
        let mut names = HashSet::new();
        let mut spans = Vec::new();
        for t in &h.tensors {
            prop_assert!(names.insert(t.name.as_str()), "duplicate {}", t.name);
            prop_assert!((1..=4).contains(&t.shape.len()));
            prop_assert!(t.shape.iter().all(|&d| d > 0));
            prop_assert_eq!(Some(t.nbytes), t.dtype.bytes_for(t.n_elements()));
            prop_assert_eq!((t.offset - h.data_offset) % h.alignment, 0);
            prop_assert!(t.offset >= h.data_offset && t.offset + t.nbytes <= len);
            spans.push((t.offset, t.offset + t.nbytes));
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
        }
    }
    // Parsing is linear in the input; anything slow means a claimed count drove a loop.
    prop_assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    Ok(())
}

/// Every array the parser accepted decodes completely, by iteration and by index, to as many
/// elements as it claims.
fn decode_all(m: &Metadata) -> Result<(), TestCaseError> {
    fn walk(a: &MetaArray) -> Result<(), TestCaseError> {
        let mut n = 0;
        for (i, v) in a.iter().enumerate() {
            // Compared as text, so that a NaN a mutation wrote equals itself.
            prop_assert_eq!(format!("{:?}", a.get(i)), format!("{:?}", Some(v)));
            if let MetaRef::Array(inner) = v {
                walk(inner)?;
            }
            n += 1;
        }
        prop_assert_eq!(n, a.len());
        prop_assert_eq!(a.get(n), None);
        Ok(())
    }
    for v in m.values() {
        if let MetaValue::Array(a) = v {
            walk(a)?;
        }
    }
    Ok(())
}

fn run(cases: u32) {
    let seeds = seeds();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (0..seeds.len(), proptest::collection::vec(mutation(), 1..6));
    runner
        .run(&strategy, |(seed, muts)| {
            let mut bytes = seeds[seed].clone();
            for m in &muts {
                apply(&mut bytes, m);
            }
            check(&bytes)
        })
        .unwrap();
}

#[test]
fn seeds_are_valid() {
    for s in seeds() {
        let h = gguf::parse(&s, Path::new("seed.gguf")).unwrap();
        assert!(!h.tensors.is_empty());
    }
}

#[test]
fn fuzz_quick() {
    run(500);
}

#[test]
#[ignore = "long; `make fuzz` runs it with WEIGHTLIFT_FUZZ_CASES=100000"]
fn fuzz_long() {
    let cases = std::env::var("WEIGHTLIFT_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let start = Instant::now();
    run(cases);
    eprintln!(
        "fuzz_gguf: {cases} cases ({} inputs parsed, {} accepted) in {:.1?}",
        TRIED.load(Ordering::Relaxed),
        ACCEPTED.load(Ordering::Relaxed),
        start.elapsed()
    );
}
