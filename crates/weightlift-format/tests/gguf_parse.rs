//! GGUF parsing: a valid hand-built file, and one hand-built file per structural error, each
//! asserting that the message names the field and says what was expected.

use crate::gguf_util;

use std::path::Path;

use gguf_util::{Gguf, V, t, valid};
use weightlift_format::gguf::{self, GgufHeader};
use weightlift_format::{DType, FormatError, LAZY_ARRAY_MIN_LEN, MetaArray, MetaRef, MetaValue};

const P: &str = "/models/test.gguf";

fn parse(bytes: &[u8]) -> weightlift_format::Result<GgufHeader> {
    gguf::parse(bytes, Path::new(P))
}

/// The error message for `g`, which must fail to parse.
fn err(g: &Gguf) -> String {
    err_bytes(&g.bytes())
}

fn err_bytes(b: &[u8]) -> String {
    match parse(b) {
        Ok(h) => panic!("expected an error, parsed {} tensors", h.tensors.len()),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn has(msg: &str, parts: &[&str]) {
    assert!(
        msg.starts_with(P),
        "message must start with the path: {msg}"
    );
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}: {msg}");
    }
    assert_eq!(
        msg.chars().next().map(char::is_lowercase),
        Some(false),
        "path first"
    );
}

#[test]
fn valid_file_parses_with_every_value_type() {
    let (bytes, layout) = valid().build();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.alignment, 32);
    assert_eq!(h.data_offset as usize, layout.data_start);
    let m = &h.metadata;
    assert_eq!(m["t.u8"], MetaValue::U8(200));
    assert_eq!(m["t.i8"], MetaValue::I8(-100));
    assert_eq!(m["t.u16"], MetaValue::U16(60000));
    assert_eq!(m["t.i16"], MetaValue::I16(-30000));
    assert_eq!(m["t.u32"], MetaValue::U32(4_000_000_000));
    assert_eq!(m["t.i32"], MetaValue::I32(-2_000_000_000));
    assert_eq!(m["t.f32"], MetaValue::F32(1.5));
    assert_eq!(m["t.bool"], MetaValue::Bool(true));
    assert_eq!(m["t.string"], MetaValue::String("héllo".into()));
    assert_eq!(m["t.u64"], MetaValue::U64(u64::MAX));
    assert_eq!(m["t.i64"], MetaValue::I64(i64::MIN));
    assert_eq!(m["t.f64"], MetaValue::F64(-0.25));
    assert_eq!(
        m["t.array"],
        MetaValue::Array(
            vec![
                MetaValue::Array(vec![MetaValue::U32(1), MetaValue::U32(2)].into()),
                MetaValue::Array(
                    vec![
                        MetaValue::String("a".into()),
                        MetaValue::String("bc".into())
                    ]
                    .into()
                ),
            ]
            .into()
        )
    );
    // File order is kept.
    let keys: Vec<&str> = m.keys().map(String::as_str).collect();
    assert_eq!(keys[..3], ["general.architecture", "t.u8", "t.i8"]);

    assert_eq!(h.tensors.len(), 3);
    let e = &h.tensors[0];
    assert_eq!(e.name, "token_embd.weight");
    assert_eq!(e.dtype, DType::Q8_0);
    assert_eq!(e.shape, vec![3, 64], "numpy order is the reverse of ne");
    assert_eq!(e.nbytes, 3 * 2 * 34);
    assert_eq!(e.offset as usize, layout.data_start);
    let q = &h.tensors[2];
    assert_eq!(q.dtype, DType::Q4_K);
    assert_eq!(q.shape, vec![2, 256]);
    assert_eq!(q.nbytes, 2 * 144);
    assert_eq!(q.offset % 32, 0);
    assert!(q.offset + q.nbytes <= bytes.len() as u64);

    let tok = gguf::tokenizer_info(m);
    assert_eq!(tok.model.as_deref(), Some("gpt2"));
    assert_eq!(tok.n_tokens, Some(3));
    assert_eq!(tok.n_merges, Some(1));
    assert_eq!((tok.bos_token_id, tok.eos_token_id), (Some(0), Some(1)));
}

#[test]
fn version_2_parses() {
    let mut g = valid();
    g.version = 2;
    assert_eq!(parse(&g.bytes()).unwrap().version, 2);
}

#[test]
fn metadata_only_skips_the_tensor_table() {
    let (mut bytes, layout) = valid().build();
    // Garbage after the key/value section does not matter to parse_metadata.
    bytes.truncate(layout.tensor_info_start + 3);
    let h = gguf::parse_metadata(&bytes, Path::new(P)).unwrap();
    assert_eq!(h.n_tensors, 3);
    assert!(h.tensors.is_empty());
    assert_eq!(h.metadata.len(), valid().kv.len());
    has(
        &err_bytes(&bytes),
        &["header tensor count", "3 bytes remain", "truncated"],
    );
}

#[test]
fn bad_magic() {
    let mut g = valid();
    g.magic = *b"GGML";
    has(
        &err(&g),
        &[
            "header magic: expected the GGUF magic 47 47 55 46 ('GGUF'), got 47 47 4d 4c ('GGML')",
            "not a GGUF file",
        ],
    );
    // Bytes that are not text show as hex, with the printable ones beside: never an escape.
    g.magic = [0x18, 0x00, 0xaf, 0x3c];
    let msg = err(&g);
    has(&msg, &["got 18 00 af 3c ('...<')"]);
    assert!(!msg.contains("\\u{"), "{msg}");
    g.magic = *b"FUGG";
    has(&err(&g), &["header magic", "big-endian"]);
}

#[test]
fn version_1_is_refused() {
    let mut g = valid();
    g.version = 1;
    let msg = err(&g);
    has(
        &msg,
        &["gguf version 1 is not supported", "versions 2 and 3"],
    );
    assert!(matches!(
        parse(&g.bytes()),
        Err(FormatError::Unsupported { .. })
    ));
}

#[test]
fn unknown_version_is_refused() {
    let mut g = valid();
    // Just above the versions read: a later GGUF revision.
    for v in [4, gguf::MAX_LATER_VERSION] {
        g.version = v;
        let e = parse(&g.bytes()).unwrap_err();
        assert!(matches!(e, FormatError::Unsupported { .. }), "{e}");
        has(
            &e.to_string(),
            &[&format!("gguf version {v} is not supported"), "newer tool"],
        );
    }
    g.version = 0;
    has(&err(&g), &["header version", "expected 2 or 3, got 0"]);
}

#[test]
fn a_wild_version_is_a_corrupt_header_not_a_newer_tool() {
    let mut g = valid();
    for v in [
        gguf::MAX_LATER_VERSION + 1,
        0x3cfa_12ab,
        u32::from_le_bytes(*b"ggml"),
    ] {
        g.version = v;
        let e = parse(&g.bytes()).unwrap_err();
        assert!(matches!(e, FormatError::Invalid { .. }), "{e}");
        let msg = e.to_string();
        has(
            &msg,
            &[
                "header version: expected 2 or 3 (a later GGUF revision would be a small number",
                &format!("got {v} (bytes "),
                "the header is corrupted, or the file is not a GGUF file this tool can read",
            ],
        );
        assert!(!msg.contains("newer"), "{msg}");
    }
    g.version = u32::from_le_bytes(*b"ggml");
    has(&err(&g), &["(bytes 67 67 6d 6c ('ggml'))"]);
    // Low 16 bits zero, but no version stored big-endian: corrupt too.
    g.version = 0x1234_0000;
    let msg = err(&g);
    has(&msg, &["the header is corrupted"]);
    assert!(!msg.contains("big-endian"), "{msg}");
}

#[test]
fn big_endian_file_is_detected() {
    let mut g = valid();
    g.version = 3u32.swap_bytes(); // what a big-endian writer puts there
    let msg = err(&g);
    has(
        &msg,
        &[
            "header version",
            "0x03000000",
            "version 3 stored big-endian",
        ],
    );
    assert!(msg.contains(weightlift_format::hint::BYTE_ORDER), "{msg}");
}

#[test]
fn every_truncation_fails_cleanly() {
    let (bytes, layout) = valid().build();
    for cut in 0..bytes.len() {
        let msg = err_bytes(&bytes[..cut]);
        assert!(msg.contains("truncated"), "cut at {cut}: {msg}");
    }
    // A cut inside the data section names the tensor whose data is missing.
    let msg = err_bytes(&bytes[..layout.data_start + 10]);
    has(&msg, &["tensor 'token_embd.weight' data", "past the end"]);
}

#[test]
fn duplicate_key() {
    let g = valid().kv("t.u8", V::U8(1));
    has(&err(&g), &["key 't.u8'", "expected each key once"]);
}

#[test]
fn duplicate_tensor_name() {
    let g = valid().tensor(t("output_norm.weight", &[5], 0));
    has(
        &err(&g),
        &[
            "tensor 'output_norm.weight'",
            "expected each tensor name once",
        ],
    );
}

#[test]
fn empty_key_and_name() {
    let g = Gguf::default().kv("", V::U8(1));
    has(&err(&g), &["key #0", "non-empty key"]);
    let g = Gguf::default().tensor(t("", &[4], 0));
    has(&err(&g), &["tensor #0 name", "non-empty name"]);
}

#[test]
fn invalid_utf8_key() {
    let mut g = Gguf::default();
    g.kv.push((vec![b'a', 0xff, b'b'], V::U8(1)));
    has(
        &err(&g),
        &[
            "key #0",
            "expected a UTF-8 string",
            "invalid UTF-8 at byte 1",
        ],
    );
}

#[test]
fn dimension_count() {
    let g = Gguf::default().tensor(t("five", &[1, 1, 1, 1, 1], 0));
    has(
        &err(&g),
        &["tensor 'five' dimension count", "expected 1 to 4", "got 5"],
    );
    let g = Gguf::default().tensor(t("zero", &[], 0));
    has(&err(&g), &["tensor 'zero' dimension count", "got 0"]);
}

#[test]
fn zero_dimension() {
    let g = Gguf::default().tensor(t("w", &[4, 0], 0));
    has(&err(&g), &["tensor 'w' ne[1]", "got 0"]);
}

#[test]
fn negative_as_i64_dimension() {
    let g = Gguf::default().tensor(t("w", &[1 << 63], 0));
    has(&err(&g), &["tensor 'w' ne[0]", "9223372036854775808"]);
}

#[test]
fn element_count_overflow() {
    let g = Gguf::default().tensor(t("big", &[1 << 32, 1 << 32], 0));
    has(&err(&g), &["tensor 'big' shape", "overflows"]);
    // Fits i64 as elements, but not as bytes.
    let g = Gguf::default().tensor(t("big", &[1 << 31, 1 << 31], 0));
    has(&err(&g), &["tensor 'big' size", "overflows"]);
}

#[test]
fn unknown_type_id() {
    let g = Gguf::default().tensor(t("w", &[32], 4));
    has(&err(&g), &["tensor 'w' type", "got 4", "removed from ggml"]);
    let g = Gguf::default().tensor(t("w", &[32], 99));
    has(
        &err(&g),
        &[
            "tensor 'w' type",
            "ggml type id that llama.cpp defines",
            "got 99",
        ],
    );
}

#[test]
fn row_not_divisible_by_block() {
    let g = Gguf::default().tensor(t("q", &[48, 2], 2));
    has(
        &err(&g),
        &[
            "tensor 'q' row length ne[0]",
            "multiple of Q4_0's block size 32",
            "got 48",
        ],
    );
}

#[test]
fn misaligned_offset() {
    let mut tensor = t("w", &[8], 0);
    tensor.offset = Some(16);
    let g = Gguf::default().tensor(tensor);
    has(
        &err(&g),
        &[
            "tensor 'w' offset",
            "multiple of the alignment 32",
            "got 16",
        ],
    );
}

#[test]
fn data_outside_file() {
    // Lay the file out normally, then point the tensor's offset 1 TiB past the data section.
    let (mut b, layout) = Gguf::default().tensor(t("w", &[8], 0)).build();
    let off_field = layout.tensor_info_start + 8 + 1 + 4 + 8 + 4; // name len, "w", n_dims, ne[0], type
    b[off_field..off_field + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    has(
        &err_bytes(&b),
        &["tensor 'w' data", "past the end of the file", "truncated"],
    );
    // An offset whose sum with the data start overflows.
    b[off_field..off_field + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    has(
        &err_bytes(&b),
        &["tensor 'w' data", "past the end of the file"],
    );
}

#[test]
fn overlapping_tensors() {
    let mut a = t("a", &[64], 0);
    a.offset = Some(0);
    let mut b = t("b", &[8], 0);
    b.offset = Some(224); // a covers 0..256
    let g = Gguf::default().tensor(a).tensor(b);
    has(
        &err(&g),
        &[
            "tensor 'b' offset",
            "expected at least 256 (after tensor 'a'",
            "got 224",
            "overlap",
        ],
    );
}

#[test]
fn alignment_key() {
    let g = valid().kv("general.alignment", V::U32(48));
    has(
        &err(&g),
        &["key 'general.alignment'", "power of two", "got 48"],
    );
    let g = valid().kv("general.alignment", V::U64(64));
    has(&err(&g), &["key 'general.alignment'", "expected a u32"]);
    let g = valid().kv("general.alignment", V::U32(0));
    has(
        &err(&g),
        &["key 'general.alignment'", "power of two", "got 0"],
    );
    // A valid non-default alignment is honoured.
    let mut g = valid().kv("general.alignment", V::U32(64));
    g.alignment = 64;
    let (bytes, layout) = g.build();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.alignment, 64);
    assert_eq!(h.data_offset as usize, layout.data_start);
    assert_eq!(h.data_offset % 64, 0);
}

#[test]
fn absurd_counts_and_lengths() {
    let mut g = valid();
    g.n_tensors = Some(1 << 62);
    has(&err(&g), &["header tensor count", "4611686018427387904"]);
    let mut g = valid();
    g.n_kv = Some(1 << 62);
    has(&err(&g), &["header key/value count", "4611686018427387904"]);
    // A key/value count just past the real one runs into the tensor table.
    let mut g = valid();
    g.n_kv = Some(g.kv.len() as u64 + 1);
    assert!(parse(&g.bytes()).is_err());

    // A 2^63-byte string.
    let g = Gguf::default().kv("k", V::Raw(8, (1u64 << 63).to_le_bytes().to_vec()));
    has(
        &err(&g),
        &["key 'k' string value length", "9223372036854775808"],
    );
    // A 2^62-element array of u32 and of strings.
    for ety in [4u32, 8] {
        let mut raw = ety.to_le_bytes().to_vec();
        raw.extend((1u64 << 62).to_le_bytes());
        let g = Gguf::default().kv("arr", V::Raw(9, raw));
        has(&err(&g), &["key 'arr' array length", "4611686018427387904"]);
    }
    // A long key.
    let long = "k".repeat(70_000);
    let g = Gguf::default().kv(&long, V::U8(0));
    has(&err(&g), &["key #0 length", "at most 65535"]);
}

#[test]
fn array_lengths_are_bounded_by_the_bytes_left() {
    // 1000 u64 claimed, 16 bytes present.
    let mut raw = 10u32.to_le_bytes().to_vec();
    raw.extend(1000u64.to_le_bytes());
    raw.extend([0u8; 16]);
    let g = Gguf::default().kv("arr", V::Raw(9, raw));
    has(&err(&g), &["key 'arr' array length", "got 1000"]);
}

#[test]
fn nesting_depth() {
    let mut v = V::Arr(0, vec![V::U8(1)]);
    for _ in 0..10 {
        v = V::Arr(9, vec![v]);
    }
    let g = Gguf::default().kv("deep", v);
    has(&err(&g), &["key 'deep' array", "nested at most 8 deep"]);
    // Depth 8 is fine.
    let mut v = V::Arr(0, vec![V::U8(1)]);
    for _ in 0..7 {
        v = V::Arr(9, vec![v]);
    }
    assert!(parse(&Gguf::default().kv("ok", v).bytes()).is_ok());
}

#[test]
fn bad_value_types() {
    let g = Gguf::default().kv("k", V::Raw(13, vec![0; 8]));
    has(&err(&g), &["key 'k' value type", "0..=12", "got 13"]);
    let mut raw = 42u32.to_le_bytes().to_vec();
    raw.extend(0u64.to_le_bytes());
    let g = Gguf::default().kv("k", V::Raw(9, raw));
    has(&err(&g), &["key 'k' value type", "got 42"]);
    let g = Gguf::default().kv("flag", V::Bool(2));
    has(
        &err(&g),
        &["key 'flag' bool value", "expected 0 or 1, got 2"],
    );
    let g = Gguf::default().kv("flags", V::Arr(7, vec![V::Bool(1), V::Bool(9)]));
    has(&err(&g), &["key 'flags' bool value", "got 9"]);
}

#[test]
fn errors_are_typed_invalid_with_hints() {
    let mut g = valid();
    g.n_tensors = Some(1 << 62);
    match parse(&g.bytes()) {
        Err(FormatError::Invalid {
            path, what, hint, ..
        }) => {
            assert_eq!(path, Path::new(P));
            assert_eq!(what, "header tensor count");
            assert_eq!(hint, weightlift_format::hint::HOSTILE);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn no_tensors_and_no_metadata() {
    let h = parse(&Gguf::default().bytes()).unwrap();
    assert!(h.tensors.is_empty() && h.metadata.is_empty());
}

#[test]
fn invalid_utf8_in_a_string_array_names_the_element() {
    // A short array (sequential path) and a vocabulary-sized one (parallel path).
    for n in [10usize, 40_000] {
        let mut items: Vec<V> = (0..n)
            .map(|i| V::Str(format!("t{i}").into_bytes()))
            .collect();
        items[n - 3] = V::Str(vec![b'x', 0xc3]);
        items[n - 1] = V::Str(vec![0xff]);
        let g = Gguf::default().kv("tokenizer.ggml.tokens", V::Arr(8, items));
        has(
            &err(&g),
            &[
                &format!("key 'tokenizer.ggml.tokens' element {}", n - 3),
                "invalid UTF-8 at byte 1",
            ],
        );
    }
    // And a valid long array round-trips in order.
    let items: Vec<V> = (0..40_000)
        .map(|i| V::Str(format!("t{i}").into_bytes()))
        .collect();
    let h = parse(&Gguf::default().kv("k", V::Arr(8, items)).bytes()).unwrap();
    let a = h.metadata["k"].as_array().unwrap();
    assert_eq!(a.len(), 40_000);
    assert!(a.is_lazy());
    assert_eq!(a.get(39_999).and_then(|v| v.as_str()), Some("t39999"));
    assert_eq!(a.get(12_345).and_then(|v| v.as_str()), Some("t12345"));
    assert_eq!(a.get(40_000), None);
    for (i, v) in a.iter().enumerate() {
        assert_eq!(v.as_str(), Some(format!("t{i}").as_str()));
    }
}

#[test]
fn truncated_string_array_is_reported_at_the_element() {
    let items: Vec<V> = (0..20)
        .map(|i| V::Str(format!("t{i}").into_bytes()))
        .collect();
    let (bytes, layout) = Gguf::default().kv("k", V::Arr(8, items)).build();
    let msg = err_bytes(&bytes[..layout.tensor_info_start - 5]);
    has(&msg, &["key 'k' element 19", "truncated"]);
}

/// Element `i` as written, and as it should read back.
type MakeElement = dyn Fn(usize) -> (V, MetaValue);

/// Every scalar element type, on both sides of the lazy threshold: the values read back are the
/// values written, in order, by index and by iteration, and equal to plain value arrays.
#[test]
fn long_arrays_of_every_type_read_back() {
    for n in [0, 1, LAZY_ARRAY_MIN_LEN - 1, LAZY_ARRAY_MIN_LEN, 1000] {
        let cases: Vec<(u32, Box<MakeElement>)> = vec![
            (0, Box::new(|i| (V::U8(i as u8), MetaValue::U8(i as u8)))),
            (
                1,
                Box::new(|i| (V::I8(-((i % 100) as i8)), MetaValue::I8(-((i % 100) as i8)))),
            ),
            (
                2,
                Box::new(|i| (V::U16(i as u16 * 7), MetaValue::U16(i as u16 * 7))),
            ),
            (
                3,
                Box::new(|i| (V::I16(-(i as i16)), MetaValue::I16(-(i as i16)))),
            ),
            (
                4,
                Box::new(|i| (V::U32(i as u32 * 70_001), MetaValue::U32(i as u32 * 70_001))),
            ),
            (
                5,
                Box::new(|i| (V::I32(-(i as i32) * 3), MetaValue::I32(-(i as i32) * 3))),
            ),
            (
                6,
                Box::new(|i| (V::F32(i as f32 * -0.5), MetaValue::F32(i as f32 * -0.5))),
            ),
            (
                7,
                Box::new(|i| (V::Bool((i % 3 == 0) as u8), MetaValue::Bool(i % 3 == 0))),
            ),
            (
                8,
                Box::new(|i| {
                    let s = "é".repeat(i % 5) + &i.to_string();
                    (V::Str(s.clone().into_bytes()), MetaValue::String(s))
                }),
            ),
            (
                10,
                Box::new(|i| {
                    (
                        V::U64(u64::MAX - i as u64),
                        MetaValue::U64(u64::MAX - i as u64),
                    )
                }),
            ),
            (
                11,
                Box::new(|i| {
                    (
                        V::I64(i64::MIN + i as i64),
                        MetaValue::I64(i64::MIN + i as i64),
                    )
                }),
            ),
            (
                12,
                Box::new(|i| (V::F64(i as f64 / 3.0), MetaValue::F64(i as f64 / 3.0))),
            ),
        ];
        for (ty, make) in &cases {
            let (written, expected): (Vec<V>, Vec<MetaValue>) = (0..n).map(make).unzip();
            let g = Gguf::default()
                .kv("before", V::U32(7))
                .kv("k", V::Arr(*ty, written))
                .kv("after", s("x"));
            let h = parse(&g.bytes()).unwrap();
            assert_eq!(h.metadata["before"], MetaValue::U32(7));
            assert_eq!(h.metadata["after"], MetaValue::String("x".into()));
            let a = h.metadata["k"].as_array().unwrap();
            assert_eq!(
                a.is_lazy(),
                n >= LAZY_ARRAY_MIN_LEN,
                "type {ty}, {n} elements"
            );
            assert_eq!(a.len(), n);
            assert_eq!(a.to_vec(), expected, "type {ty}");
            assert_eq!(*a, MetaArray::from(expected.clone()));
            for (i, e) in expected.iter().enumerate().rev() {
                assert_eq!(a.get(i), Some(e.view()), "type {ty} element {i}");
            }
            assert_eq!(a.get(n), None);
            assert_eq!(format!("{a:?}"), format!("{expected:?}"));
        }
    }
}

fn s(v: &str) -> V {
    gguf_util::s(v)
}

#[test]
fn long_bool_array_with_a_bad_byte_is_refused() {
    let mut items = vec![V::Bool(1); 500];
    items[321] = V::Bool(5);
    let (bytes, layout) = Gguf::default().kv("flags", V::Arr(7, items)).build();
    let msg = err_bytes(&bytes);
    has(&msg, &["key 'flags' bool value", "expected 0 or 1, got 5"]);
    // Truncated inside the array: the length check names the array and the shortfall.
    let msg = err_bytes(&bytes[..layout.tensor_info_start - 100]);
    has(&msg, &["key 'flags' array length", "got 500", "truncated"]);
}

/// Lengths and bounds win over an earlier bad string: a truncated array reads as truncated.
#[test]
fn truncation_is_reported_before_an_earlier_utf8_error() {
    let mut items: Vec<V> = (0..300).map(|i| s(&format!("t{i}"))).collect();
    items[10] = V::Str(vec![0xff]);
    let (bytes, layout) = Gguf::default().kv("k", V::Arr(8, items)).build();
    has(&err_bytes(&bytes), &["key 'k' element 10", "invalid UTF-8"]);
    let msg = err_bytes(&bytes[..layout.tensor_info_start - 5]);
    has(&msg, &["key 'k' element 299", "truncated"]);
}

#[test]
fn nested_arrays_hold_long_inner_arrays() {
    let inner: Vec<V> = (0..200).map(|i| s(&format!("m{i} n{i}"))).collect();
    let ints: Vec<V> = (0..100).map(V::I32).collect();
    let g = Gguf::default().kv(
        "k",
        V::Arr(
            9,
            vec![V::Arr(8, inner), V::Arr(5, ints), V::Arr(0, vec![])],
        ),
    );
    let h = parse(&g.bytes()).unwrap();
    let outer = h.metadata["k"].as_array().unwrap();
    assert!(!outer.is_lazy());
    assert_eq!(outer.len(), 3);
    let first = outer.get(0).and_then(MetaRef::as_array).unwrap();
    assert!(first.is_lazy());
    assert_eq!(first.get(199).and_then(MetaRef::as_str), Some("m199 n199"));
    let second = outer.get(1).and_then(MetaRef::as_array).unwrap();
    let got: Vec<i32> = second
        .iter()
        .map(|v| match v {
            MetaRef::I32(x) => x,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(got, (0..100).collect::<Vec<_>>());
    assert_eq!(
        outer.get(2).and_then(MetaRef::as_array).map(MetaArray::len),
        Some(0)
    );
}

/// Metadata serialises as plain JSON values, lazy arrays as lists.
#[test]
fn metadata_serialises_as_json() {
    let words: Vec<V> = (0..100).map(|i| s(&format!("w{i}"))).collect();
    let g = Gguf::default()
        .kv("words", V::Arr(8, words))
        .kv("small", V::Arr(6, vec![V::F32(0.5), V::F32(-2.0)]));
    let h = parse(&g.bytes()).unwrap();
    let json = serde_json::to_value(&h.metadata).unwrap();
    let words: Vec<String> = (0..100).map(|i| format!("w{i}")).collect();
    assert_eq!(json["words"], serde_json::json!(words));
    assert_eq!(json["small"], serde_json::json!([0.5, -2.0]));
}

/// UTF-8 of string arrays is checked a run at a time; the verdict and the element named must
/// be those of checking each string on its own with `std::str::from_utf8`. Strings of 128
/// bytes or more (whose length fields are not ASCII) split the runs, and the byte pairs below
/// are halves of characters that would be valid if two strings were joined.
mod string_array_utf8 {
    use super::*;
    use proptest::prelude::*;

    fn piece() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            4 => "[a-z\\u{e9}\\u{120}\\u{4e2d}\\u{1f600}]{0,6}".prop_map(String::into_bytes),
            1 => proptest::collection::vec(any::<u8>(), 0..4),
            1 => Just(vec![0xc3]),
            1 => Just(vec![0xa9]),
            1 => Just(vec![0xe4, 0xb8]),
            1 => Just(vec![0xed, 0xa0, 0x80]),
            1 => Just(vec![0xf4, 0x90, 0x80, 0x80]),
            1 => Just(vec![0xc0, 0xaf]),
            1 => (128usize..300).prop_map(|n| "é".repeat(n / 2).into_bytes()),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]
        #[test]
        fn matches_per_string_from_utf8(
            items in proptest::collection::vec(piece(), LAZY_ARRAY_MIN_LEN - 4..LAZY_ARRAY_MIN_LEN + 40)
        ) {
            let first_bad = items.iter().position(|b| std::str::from_utf8(b).is_err());
            let g = Gguf::default().kv(
                "k",
                V::Arr(8, items.iter().cloned().map(V::Str).collect()),
            );
            match (parse(&g.bytes()), first_bad) {
                (Ok(h), None) => {
                    let a = h.metadata["k"].as_array().unwrap();
                    prop_assert_eq!(a.len(), items.len());
                    for (v, want) in a.iter().zip(&items) {
                        prop_assert_eq!(v.as_str().map(str::as_bytes), Some(want.as_slice()));
                    }
                }
                (Err(e), Some(i)) => {
                    let msg = e.to_string();
                    let want = format!("key 'k' element {i}:");
                    prop_assert!(msg.contains(&want), "{}", msg);
                    prop_assert!(msg.contains("invalid UTF-8"), "{}", msg);
                }
                (Ok(_), Some(i)) => prop_assert!(false, "accepted a bad element {}", i),
                (Err(e), None) => prop_assert!(false, "refused a valid array: {}", e),
            }
        }
    }
}
