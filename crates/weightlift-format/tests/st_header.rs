//! Single safetensors files: every dtype the format defines, `__metadata__`, and headers that
//! are truncated, overlong, overlapping, duplicated or not JSON. Valid files come from the
//! official `safetensors` crate's writer; broken ones are cut or written by hand.

use crate::st_util;

use std::path::PathBuf;

use safetensors::tensor::{Dtype, TensorView};
use st_util::{Scratch, open_err, st_f32, st_raw};
use weightlift_format::{Checkpoint, DType, FormatError, OpenOptions};

fn file(s: &Scratch, bytes: &[u8]) -> PathBuf {
    s.write("m.safetensors", bytes)
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}: {msg}");
    }
}

fn small() -> Vec<u8> {
    st_f32(
        &[
            ("a", vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]),
            ("b", vec![3], vec![5.0, 6.0, 7.0]),
        ],
        Some(&[("format", "pt"), ("note", "hi")]),
    )
}

#[test]
fn every_dtype_of_the_format() {
    // (safetensors dtype, our type, elements): element counts keep sub-byte types whole bytes.
    let all = [
        (Dtype::BOOL, DType::BOOL),
        (Dtype::U8, DType::U8),
        (Dtype::I8, DType::I8),
        (Dtype::I16, DType::I16),
        (Dtype::U16, DType::U16),
        (Dtype::F16, DType::F16),
        (Dtype::BF16, DType::BF16),
        (Dtype::I32, DType::I32),
        (Dtype::U32, DType::U32),
        (Dtype::F32, DType::F32),
        (Dtype::F64, DType::F64),
        (Dtype::I64, DType::I64),
        (Dtype::U64, DType::U64),
        (Dtype::C64, DType::C64),
        (Dtype::F8_E4M3, DType::F8_E4M3),
        (Dtype::F8_E5M2, DType::F8_E5M2),
        (Dtype::F8_E8M0, DType::F8_E8M0),
        (Dtype::F4, DType::F4),
        (Dtype::F6_E2M3, DType::F6_E2M3),
        (Dtype::F6_E3M2, DType::F6_E3M2),
        (Dtype::F8_E4M3FNUZ, DType::F8_E4M3FNUZ),
        (Dtype::F8_E5M2FNUZ, DType::F8_E5M2FNUZ),
    ];
    let shape = vec![2usize, 4];
    let datas: Vec<Vec<u8>> = all
        .iter()
        .map(|(d, _)| (0..8 * d.bitsize() / 8).map(|i| i as u8).collect())
        .collect();
    let views: Vec<(String, TensorView<'_>)> = all
        .iter()
        .zip(&datas)
        .map(|((d, _), b)| {
            (
                format!("t_{d}"),
                TensorView::new(*d, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    let s = Scratch::new("dtypes");
    let p = file(&s, &bytes);
    let c = Checkpoint::open(&p, OpenOptions::default()).unwrap();
    assert_eq!(c.tensors().len(), all.len());
    // What the official reader says about the same bytes.
    let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (d, ours) in all {
        let t = c.tensor(&format!("t_{d}")).unwrap();
        assert_eq!(t.dtype, ours);
        assert_eq!(t.dtype.name(), d.to_string());
        assert_eq!(t.shape, vec![2, 4]);
        let view = reference.tensor(&t.name).unwrap();
        assert_eq!(c.bytes(t), view.data(), "{d}");
        assert_eq!(t.nbytes as usize, view.data().len());
    }
}

#[test]
fn unknown_dtype_is_unsupported() {
    let s = Scratch::new("unknown-dtype");
    let p = file(
        &s,
        &st_raw(
            r#"{"w":{"dtype":"F7_E3M3","shape":[1],"data_offsets":[0,1]}}"#,
            &[0],
        ),
    );
    let e = Checkpoint::open(&p, OpenOptions::default()).unwrap_err();
    assert!(matches!(e, FormatError::Unsupported { .. }), "{e:?}");
    assert_has(&e.to_string(), &["tensor 'w'", "F7_E3M3"]);
}

#[test]
fn metadata_and_offsets() {
    let s = Scratch::new("meta");
    let bytes = small();
    let c = Checkpoint::open(file(&s, &bytes), OpenOptions::default()).unwrap();
    assert_eq!(c.metadata()["format"].as_str(), Some("pt"));
    assert_eq!(c.metadata()["note"].as_str(), Some("hi"));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let a = c.tensor("a").unwrap();
    let b = c.tensor("b").unwrap();
    assert_eq!(a.offset, 8 + n);
    assert_eq!(b.offset, 8 + n + 16);
    assert_eq!(c.bytes(b), st_util::f32_bytes(&[5.0, 6.0, 7.0]).as_slice());
    // No config.json: opened, spec explains, roles unknown.
    assert!(c.spec().unwrap_err().contains("no config.json"));
    assert!(
        c.warnings()[0].contains("unsupported architecture 'unknown'"),
        "{:?}",
        c.warnings()
    );
}

#[test]
fn truncated_everywhere_fails_cleanly() {
    let bytes = small();
    let s = Scratch::new("trunc");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for cut in 0..bytes.len() {
        let p = file(&s, &bytes[..cut]);
        let e = Checkpoint::open(&p, OpenOptions::default()).unwrap_err();
        assert!(matches!(e, FormatError::Invalid { .. }), "cut {cut}: {e:?}");
        let msg = e.to_string();
        assert!(msg.contains("m.safetensors"), "{msg}");
        if cut < 8 {
            assert_has(&msg, &["header length", "truncated"]);
        } else if cut < 8 + n {
            assert_has(
                &msg,
                &["header length", &format!("got {n} bytes"), "truncated"],
            );
        } else {
            assert_has(&msg, &["data section", "expected 28 bytes", "truncated"]);
        }
    }
}

#[test]
fn trailing_bytes() {
    let mut bytes = small();
    bytes.extend_from_slice(&[0; 5]);
    let s = Scratch::new("trailing");
    assert_has(
        &open_err(&file(&s, &bytes)),
        &["data section", "got 33 bytes", "trailing bytes"],
    );
}

#[test]
fn header_length_past_eof_or_absurd() {
    let s = Scratch::new("hlen");
    let mut bytes = small();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&(len + 100).to_le_bytes());
    assert_has(
        &open_err(&file(&s, &bytes)),
        &["header length", &format!("got {} bytes", len + 100)],
    );
    bytes[..8].copy_from_slice(&(1u64 << 63).to_le_bytes());
    assert_has(
        &open_err(&file(&s, &bytes)),
        &["header length", "at most 100000000", "exhaust memory"],
    );
}

#[test]
fn overlapping_and_gapped_offsets() {
    let s = Scratch::new("overlap");
    let h = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#;
    let msg = open_err(&file(&s, &st_raw(h, &[0; 24])));
    assert_has(
        &msg,
        &[
            "tensor 'b' data_offsets",
            "[8, 24]",
            "previous tensor ends at 16",
        ],
    );
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    assert_has(
        &open_err(&file(&s, &st_raw(h, &[0; 12]))),
        &["tensor 'b'", "[8, 12]"],
    );
}

#[test]
fn size_disagrees_with_shape() {
    let s = Scratch::new("size");
    let h = r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#;
    let msg = open_err(&file(&s, &st_raw(h, &[0; 12])));
    assert_has(&msg, &["tensor 'a'", "F32 x [2, 2] = 16 bytes", "12 bytes"]);
    let h = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#;
    assert_has(
        &open_err(&file(&s, &st_raw(h, &[0; 4]))),
        &["tensor 'a'", "overflows"],
    );
    let h = r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
    assert_has(
        &open_err(&file(&s, &st_raw(h, &[0; 2]))),
        &["tensor 'a'", "not whole bytes"],
    );
}

#[test]
fn bad_json_and_utf8() {
    let s = Scratch::new("json");
    assert_has(
        &open_err(&file(&s, &st_raw("{not json}", &[]))),
        &["header json", "parse error"],
    );
    assert_has(
        &open_err(&file(&s, &st_raw("[1,2]", &[]))),
        &["header json"],
    );
    let h = r#"{"a":{"dtype":"F32","shape":"x","data_offsets":[0,4]}}"#;
    assert_has(&open_err(&file(&s, &st_raw(h, &[0; 4]))), &["header json"]);
    let mut bytes = st_raw("{\"\u{e9}\":1}", &[]);
    bytes[10] = 0xff;
    assert_has(&open_err(&file(&s, &bytes)), &["invalid utf-8"]);
}

#[test]
fn duplicate_tensor_names() {
    let s = Scratch::new("dupname");
    // Both entries line up, so the official crate's hash map merges them without complaint.
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert_has(
        &open_err(&file(&s, &st_raw(h, &[0; 4]))),
        &["tensor 'a'", "the name twice"],
    );
    // A repeat followed by more entries.
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    assert_has(
        &open_err(&file(&s, &st_raw(h, &[0; 8]))),
        &["tensor 'a'", "the name twice"],
    );
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    assert_has(
        &open_err(&file(&s, &st_raw(h, &[0; 8]))),
        &["tensor 'a'", "the name twice"],
    );
}

#[test]
fn bit_flips_in_the_header_never_panic() {
    let bytes = small();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let s = Scratch::new("flip");
    let p = s.path().join("m.safetensors");
    let mut opened = 0;
    for byte in 0..8 + n {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[byte] ^= 1 << bit;
            std::fs::write(&p, &b).unwrap();
            match Checkpoint::open(&p, OpenOptions::default()) {
                Ok(c) => {
                    opened += 1;
                    for t in c.tensors() {
                        assert_eq!(c.bytes(t).len() as u64, t.nbytes);
                    }
                }
                Err(e) => assert!(!e.to_string().is_empty()),
            }
        }
    }
    // Flips inside names and metadata values still parse; most others must not.
    assert!(opened < (8 + n) * 8 / 2, "{opened}");
}
