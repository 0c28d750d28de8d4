//! The loader against the real tiny-llama safetensors (single file and sharded). Every tensor
//! read back is compared with the bytes the official `safetensors` crate reads.

use std::path::PathBuf;
use std::sync::Arc;

use safetensors::SafeTensors;
use weightlift_engine::{Device, EngineError, Inventory, LoadOptions, Source, TensorTarget, load};
use weightlift_format::{Checkpoint, DType, OpenOptions};

fn reference() -> PathBuf {
    weightlift_testdata::reference().join("tiny-llama")
}

fn open(sub: &str) -> Arc<dyn Source> {
    Arc::new(
        Checkpoint::open(reference().join(sub), OpenOptions::default()).expect("open tiny-llama"),
    )
}

/// name -> bytes, read by the safetensors crate from every shard of `sub`.
fn truth(sub: &str) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let dir = reference().join(sub);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let data = std::fs::read(&p).unwrap();
            let st = SafeTensors::deserialize(&data).unwrap();
            for (name, view) in st.tensors() {
                out.push((name, view.data().to_vec()));
            }
        }
    }
    out.sort();
    out
}

fn targets(
    src: &Arc<dyn Source>,
    pick: impl Fn(Option<u32>) -> Arc<Device>,
) -> Vec<Option<TensorTarget>> {
    src.tensors()
        .iter()
        .map(|t| Some(TensorTarget::new(pick(t.layer), t.dtype)))
        .collect()
}

/// Every tensor of `src` loaded onto `dev` with the default options, no progress and no layer
/// hook.
fn load_onto(
    src: &Arc<dyn Source>,
    dev: &Arc<Device>,
) -> weightlift_engine::Result<weightlift_engine::Loaded> {
    let t = targets(src, |_| Arc::clone(dev));
    load(src, &t, &LoadOptions::default(), &mut |_| true, &mut |_| {
        Ok(())
    })
}

fn check_bit_exact(src: &Arc<dyn Source>, loaded: &weightlift_engine::Loaded, sub: &str) {
    let want = truth(sub);
    assert_eq!(want.len(), src.tensors().len());
    for (name, bytes) in want {
        let i = src.tensors().iter().position(|t| t.name == name).unwrap();
        assert!(
            loaded.tensors[i].as_ref().unwrap().to_host().unwrap() == bytes,
            "tensor {name} differs"
        );
    }
}

#[test]
fn cpu_paths_are_bit_exact_and_identical() {
    for sub in ["safetensors", "safetensors-sharded"] {
        let src = open(sub);
        let inv = Inventory::cpu_only();
        let cpu = Arc::clone(inv.cpu());
        let t = targets(&src, |_| Arc::clone(&cpu));
        for (mmap, direct) in [(true, false), (false, false), (false, true)] {
            let opts = LoadOptions {
                use_mmap: mmap,
                use_direct_io: direct,
                staging_bytes: 1 << 20,
                ..Default::default()
            };
            let loaded = load(&src, &t, &opts, &mut |_| true, &mut |_| Ok(())).unwrap();
            check_bit_exact(&src, &loaded, sub);
            let total: u64 = src.tensors().iter().map(|t| t.nbytes).sum();
            if mmap {
                assert!(loaded.tensors.iter().flatten().all(|t| t.is_mapped()));
                assert_eq!(cpu.used(), 0, "mmap views hold no anonymous memory");
            } else {
                assert!(loaded.tensors.iter().flatten().all(|t| !t.is_mapped()));
                assert_eq!(cpu.used(), total);
            }
            drop(loaded);
            assert_eq!(cpu.used(), 0);
        }
    }
}

#[test]
fn two_virtual_devices_by_layer() {
    let src = open("safetensors-sharded");
    let inv = Inventory::parse("virtual:2x16MiB").unwrap();
    let [a, b] = inv.accelerators() else { panic!() };
    let cpu = Arc::clone(inv.cpu());
    // Embeddings stay on cpu, layer 0 on virtual:0, layer 1 and the head on virtual:1.
    let t = targets(&src, |layer| match layer {
        Some(0) => Arc::clone(a),
        Some(_) => Arc::clone(b),
        None => Arc::clone(&cpu),
    });
    let mut layers = Vec::new();
    let loaded = load(&src, &t, &LoadOptions::default(), &mut |_| true, &mut |l| {
        layers.push(l);
        Ok(())
    })
    .unwrap();
    assert_eq!(layers, [0, 1]);
    check_bit_exact(&src, &loaded, "safetensors-sharded");
    let on = |d: &Arc<Device>| -> u64 {
        src.tensors()
            .iter()
            .zip(&t)
            .filter(|(_, t)| Arc::ptr_eq(&t.as_ref().unwrap().device, d))
            .map(|(i, _)| i.nbytes)
            .sum()
    };
    assert_eq!(a.used(), on(a));
    assert_eq!(b.used(), on(b));
    drop(loaded);
    assert_eq!((a.used(), b.used(), cpu.used()), (0, 0, 0));
}

#[test]
fn bf16_converts_to_f16_on_the_way() {
    let src = open("safetensors");
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    let t: Vec<_> = src
        .tensors()
        .iter()
        .map(|_| Some(TensorTarget::new(Arc::clone(&dev), DType::F16)))
        .collect();
    // A small staging buffer forces the embedding (16 MB) through many chunks.
    let opts = LoadOptions {
        staging_bytes: 64 << 10,
        ..Default::default()
    };
    let loaded = load(&src, &t, &opts, &mut |_| true, &mut |_| Ok(())).unwrap();
    for (name, bytes) in truth("safetensors") {
        let i = src.tensors().iter().position(|t| t.name == name).unwrap();
        let want: Vec<u8> = bytes
            .chunks_exact(2)
            .flat_map(|c| {
                let x = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                half::f16::from_f32(x).to_le_bytes()
            })
            .collect();
        let got = loaded.tensors[i].as_ref().unwrap();
        assert_eq!(got.dtype(), DType::F16);
        assert!(got.to_host().unwrap() == want, "{name}");
    }
}

#[test]
fn oom_leaves_nothing_allocated() {
    let src = open("safetensors");
    let inv = Inventory::parse("virtual:2x4MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[1]);
    let err = load_onto(&src, &dev).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::OutOfMemory { .. }), "{msg}");
    assert!(msg.contains("out of memory on virtual:1"), "{msg}");
    assert!(
        msg.contains("requested 16384000 bytes"),
        "the embedding: {msg}"
    );
    assert_eq!(dev.used(), 0);
}

#[test]
fn progress_is_monotone_and_cancel_frees_everything() {
    let src = open("safetensors-sharded");
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    let t = targets(&src, |_| Arc::clone(&dev));
    let opts = LoadOptions {
        staging_bytes: 1 << 20,
        ..Default::default()
    };
    let mut seen = Vec::new();
    let loaded = load(
        &src,
        &t,
        &opts,
        &mut |p| {
            seen.push((
                p.bytes_done,
                p.bytes_total,
                p.tensor.to_owned(),
                p.device.to_owned(),
            ));
            true
        },
        &mut |_| Ok(()),
    )
    .unwrap();
    let total: u64 = src.tensors().iter().map(|t| t.nbytes).sum();
    assert!(
        seen.windows(2).all(|w| w[0].0 < w[1].0),
        "strictly increasing"
    );
    assert_eq!(seen.last().unwrap().0, total);
    assert!(seen.iter().all(|s| s.1 == total && s.3 == "virtual:0"));
    // Embedding first (16 chunks of 1 MiB), then layer 0.
    assert_eq!(seen[0].2, "model.embed_tokens.weight");
    assert!(seen.len() > 16);
    drop(loaded);

    for stop_after in [1, 5, 20] {
        let mut calls = 0;
        let err = load(
            &src,
            &t,
            &opts,
            &mut |_| {
                calls += 1;
                calls < stop_after
            },
            &mut |_| Ok(()),
        )
        .unwrap_err();
        assert!(matches!(err, EngineError::Cancelled { .. }), "{err}");
        assert_eq!(calls, stop_after, "no callback after cancelling");
        assert_eq!(dev.used(), 0, "cancel frees everything");
    }
}

#[test]
fn layer_hook_error_aborts_and_frees() {
    let src = open("safetensors");
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    let t = targets(&src, |_| Arc::clone(&dev));
    let err = load(&src, &t, &LoadOptions::default(), &mut |_| true, &mut |l| {
        if l == 1 {
            dev.alloc(1 << 40).map(drop)
        } else {
            Ok(())
        }
    })
    .unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory { .. }));
    assert_eq!(dev.used(), 0);
}

#[test]
fn mixed_views_preads_and_staged_tensors_keep_order_and_progress() {
    // Even layers go to a virtual device (staged through the reader thread); everything else
    // stays on cpu (views or preads inline). Bytes, progress and layer hooks must all hold.
    let sub = "safetensors-sharded";
    let src = open(sub);
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let cpu = Arc::clone(inv.cpu());
    let dev = Arc::clone(&inv.accelerators()[0]);
    let t = targets(&src, |l| match l {
        Some(l) if l % 2 == 0 => Arc::clone(&dev),
        _ => Arc::clone(&cpu),
    });
    let total: u64 = src.tensors().iter().map(|t| t.nbytes).sum();
    for mmap in [true, false] {
        let opts = LoadOptions {
            use_mmap: mmap,
            staging_bytes: 64 << 10,
            ..Default::default()
        };
        let mut last = 0u64;
        let mut layers = Vec::new();
        let loaded = load(
            &src,
            &t,
            &opts,
            &mut |p| {
                assert!(p.bytes_done >= last && p.bytes_total == total);
                last = p.bytes_done;
                true
            },
            &mut |l| {
                layers.push(l);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(last, total);
        assert!(layers.windows(2).all(|w| w[0] < w[1]) && !layers.is_empty());
        check_bit_exact(&src, &loaded, sub);
        drop(loaded);
        assert_eq!(cpu.used() + dev.used(), 0);

        // Cancelling from an inline (cpu) tensor or a staged one stops at once and frees all.
        for stop_after in [1, 3, 8] {
            let mut calls = 0;
            let err = load(
                &src,
                &t,
                &opts,
                &mut |_| {
                    calls += 1;
                    calls < stop_after
                },
                &mut |_| Ok(()),
            )
            .unwrap_err();
            assert!(matches!(err, EngineError::Cancelled { .. }), "{err}");
            assert_eq!(calls, stop_after, "no callback after cancelling");
            assert_eq!(cpu.used() + dev.used(), 0, "cancel frees everything");
        }
    }
}

#[test]
fn large_tensors_read_in_parallel_are_bit_exact() {
    use safetensors::tensor::{Dtype, TensorView};
    // Over the parallel-pread threshold (8 MiB), with a length that splits unevenly.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let big: Vec<u8> = (0..(9usize << 20) + 4 * 12_345)
        .map(|i| (i * 7 % 253) as u8)
        .collect();
    let small: Vec<u8> = (0..64u8).collect();
    let mut views = std::collections::HashMap::new();
    views.insert(
        "model.layers.0.mlp.up_proj.weight".to_owned(),
        TensorView::new(Dtype::F32, vec![big.len() / 4], &big).unwrap(),
    );
    views.insert(
        "model.layers.0.input_layernorm.weight".to_owned(),
        TensorView::new(Dtype::F32, vec![16], &small).unwrap(),
    );
    safetensors::serialize_to_file(&views, None, &path).unwrap();
    let data = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    let inv = Inventory::cpu_only();
    let cpu = Arc::clone(inv.cpu());
    let t = targets(&src, |_| Arc::clone(&cpu));
    let opts = LoadOptions {
        use_mmap: false,
        ..Default::default()
    };
    let loaded = load(&src, &t, &opts, &mut |_| true, &mut |_| Ok(())).unwrap();
    for (name, view) in st.tensors() {
        let i = src.tensors().iter().position(|t| t.name == name).unwrap();
        let got = loaded.tensors[i].as_ref().unwrap();
        assert!(!got.is_mapped());
        assert!(
            got.to_host().unwrap() == view.data(),
            "tensor {name} differs"
        );
    }
}

#[test]
fn large_tensors_staged_onto_a_virtual_device_are_bit_exact() {
    use safetensors::tensor::{Dtype, TensorView};
    // Over the size whose destination is faulted in before the copies (4 MiB), through small
    // staging buffers (many chunks, the last one partial), beside a small tensor that is not.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let big: Vec<u8> = (0..(6usize << 20) + 2 * 4099)
        .map(|i| (i * 13 % 251) as u8)
        .collect();
    let small: Vec<u8> = (0..256u32).map(|i| (i * 3) as u8).collect();
    let mut views = std::collections::HashMap::new();
    views.insert(
        "model.layers.0.mlp.up_proj.weight".to_owned(),
        TensorView::new(Dtype::F16, vec![big.len() / 2], &big).unwrap(),
    );
    views.insert(
        "model.layers.0.input_layernorm.weight".to_owned(),
        TensorView::new(Dtype::F16, vec![128], &small).unwrap(),
    );
    safetensors::serialize_to_file(&views, None, &path).unwrap();
    let data = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    let inv = Inventory::parse("virtual:1x16MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    let t = targets(&src, |_| Arc::clone(&dev));
    for staging in [1 << 20, 4 << 20, 64 << 20] {
        let opts = LoadOptions {
            staging_bytes: staging,
            ..Default::default()
        };
        let loaded = load(&src, &t, &opts, &mut |_| true, &mut |_| Ok(())).unwrap();
        for (name, view) in st.tensors() {
            let i = src.tensors().iter().position(|t| t.name == name).unwrap();
            let got = loaded.tensors[i].as_ref().unwrap();
            assert_eq!(got.device().name(), "virtual:0");
            assert!(
                got.to_host().unwrap() == view.data(),
                "tensor {name} differs (staging {staging})"
            );
        }
        assert_eq!(dev.used(), (big.len() + small.len()) as u64);
        drop(loaded);
        assert_eq!(dev.used(), 0);
    }
}

/// A file cut short after it was opened fails the load of a tensor read window by window into
/// a device (the path CUDA's pinned staging takes; here a virtual device's arena) with the
/// typed read error naming the file and the tensor, in the second of its 16 MiB windows, and
/// the windows already filled are released with it: the device holds nothing after.
#[test]
fn a_file_cut_short_mid_fill_fails_by_name_and_frees_the_device() {
    use safetensors::tensor::{Dtype, TensorView};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let big: Vec<u8> = (0..(20usize << 20) + 2 * 7)
        .map(|i| (i * 11 % 249) as u8)
        .collect();
    let mut views = std::collections::HashMap::new();
    views.insert(
        "model.layers.0.mlp.up_proj.weight".to_owned(),
        TensorView::new(Dtype::F16, vec![big.len() / 2], &big).unwrap(),
    );
    safetensors::serialize_to_file(&views, None, &path).unwrap();
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    let full = std::fs::metadata(&path).unwrap().len();
    // the tensor's last 2 MiB and a little more are gone: inside its second window
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(full - (2 << 20) - 3)
        .unwrap();
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    let err = load_onto(&src, &dev).unwrap_err();
    let msg = err.to_string();
    let EngineError::Io { tensor, source, .. } = &err else {
        panic!("not a read error: {msg}");
    };
    assert_eq!(tensor, "model.layers.0.mlp.up_proj.weight", "{msg}");
    assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof, "{msg}");
    assert!(msg.contains("model.safetensors"), "{msg}");
    assert_eq!(dev.used(), 0);
}
