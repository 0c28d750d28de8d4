//! Model: placement, lazy co-located cache, memory accounting, validation, TP and unload
//! hygiene, on the real tiny-llama files.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use safetensors::SafeTensors;
use weightlift_engine::model::TensorPlace;
use weightlift_engine::tp::Splits;
use weightlift_engine::{
    Cache, CacheDType, EngineError, Inventory, LoadOptions, Model, Placement, Source,
};
use weightlift_format::{Checkpoint, OpenOptions};

fn reference() -> PathBuf {
    weightlift_testdata::reference().join("tiny-llama")
}

fn open(sub: &str) -> Arc<dyn Source> {
    Arc::new(Checkpoint::open(reference().join(sub), OpenOptions::default()).unwrap())
}

fn truth(file: &str) -> HashMap<String, Vec<u8>> {
    let data = std::fs::read(reference().join(file)).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect()
}

/// Layer 0 on virtual:0, layer 1 on virtual:1, globals on cpu.
fn by_layer(src: &Arc<dyn Source>) -> Placement {
    Placement {
        tensors: src
            .tensors()
            .iter()
            .map(|t| {
                let d = match t.layer {
                    Some(l) => format!("virtual:{l}"),
                    None => "cpu".into(),
                };
                TensorPlace {
                    device: d,
                    dtype: t.dtype,
                    split: None,
                }
            })
            .collect(),
        layers: vec!["virtual:0".into(), "virtual:1".into()],
        copies: Vec::new(),
        scratch: Vec::new(),
        forward: None,
        onload: None,
    }
}

#[test]
fn lazy_cache_sits_beside_each_layer_and_memory_matches_prediction() {
    let src = open("safetensors");
    let inv = Inventory::parse("virtual:2x8MiB").unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let cfg = model.cache_config(256, 1, CacheDType::Q8, false).unwrap();
    let cache = Arc::new(Cache::new(cfg.clone()).unwrap());
    let placement = by_layer(&src);
    model
        .load(
            &placement,
            &LoadOptions::default(),
            Some(&cache),
            true,
            &mut |_| true,
        )
        .unwrap();
    for l in 0..2 {
        assert_eq!(
            cache.device_of(l).unwrap(),
            model.layer_devices().unwrap()[l]
        );
    }
    // Prediction: the tensors' bytes per device plus the cache formula
    // (2 × kv heads × head_dim × positions × bytes per element).
    let mut want: HashMap<String, u64> = HashMap::new();
    for (t, p) in src.tensors().iter().zip(&placement.tensors) {
        *want.entry(p.device.clone()).or_default() += t.nbytes;
    }
    // 2 × n_kv_heads(2) × head_dim(64) × 256 tokens × 8.5/8 bytes per layer.
    let kv = (2.0 * 2.0 * 64.0 * 256.0 * 8.5 / 8.0) as u64;
    *want.entry("virtual:0".into()).or_default() += kv;
    *want.entry("virtual:1".into()).or_default() += kv;
    for (d, b) in model.memory() {
        assert_eq!(b, want.get(&d).copied().unwrap_or(0), "{d}");
    }
    // Device arenas hold exactly that (cpu tensors are mmap views).
    for d in inv.accelerators() {
        assert_eq!(d.used(), want[d.name()]);
    }
    assert_eq!(inv.cpu().used(), 0);
    let truth = truth("safetensors/model.safetensors");
    for t in src.tensors() {
        assert!(
            model.tensor_bytes(&t.name).unwrap().0 == truth[&t.name],
            "{}",
            t.name
        );
    }
    model.unload();
    assert!(inv.all().iter().all(|d| d.used() == 0));
    assert!(matches!(
        cache.device_of(0),
        Err(EngineError::NotLoaded { .. })
    ));
}

#[test]
fn twenty_load_unload_cycles_return_to_baseline() {
    let src = open("gguf/tiny-llama-Q8_0.gguf");
    let inv = Inventory::parse("virtual:2x16MiB").unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let cache =
        Arc::new(Cache::new(model.cache_config(128, 2, CacheDType::Fp16, false).unwrap()).unwrap());
    let placement = by_layer(&src);
    let opts = LoadOptions {
        use_mmap: false,
        ..Default::default()
    };
    let mut peak = [0u64; 3];
    for _ in 0..20 {
        model
            .load(&placement, &opts, Some(&cache), true, &mut |_| true)
            .unwrap();
        for (p, d) in peak.iter_mut().zip(inv.all()) {
            *p = (*p).max(d.used());
        }
        model.unload();
        assert!(inv.all().iter().all(|d| d.used() == 0));
    }
    assert!(peak.iter().all(|&p| p > 0));
}

#[test]
fn oom_during_load_frees_weights_and_cache() {
    let src = open("safetensors");
    // Layer weights fit, but a 4096-token fp16 cache does not.
    let inv = Inventory::parse("virtual:2x3MiB").unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let cache = Arc::new(
        Cache::new(
            model
                .cache_config(4096, 1, CacheDType::Fp16, false)
                .unwrap(),
        )
        .unwrap(),
    );
    let err = model
        .load(
            &by_layer(&src),
            &LoadOptions::default(),
            Some(&cache),
            true,
            &mut |_| true,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("out of memory on virtual:0"),
        "{err}"
    );
    assert!(!model.is_loaded());
    assert!(inv.all().iter().all(|d| d.used() == 0));
}

#[test]
fn missing_tensors_are_listed_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        reference().join("safetensors/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let data = std::fs::read(reference().join("safetensors/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();
    let keep: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight")
        .collect();
    safetensors::serialize_to_file(keep, None, &dir.path().join("model.safetensors")).unwrap();
    let src: Arc<dyn Source> =
        Arc::new(Checkpoint::open(dir.path(), OpenOptions::default()).unwrap());
    let inv = Inventory::cpu_only();
    let mut model = Model::new(Arc::clone(&src), inv);
    let placement = Placement::all_on(src.as_ref(), "cpu", 2);
    let err = model
        .load(&placement, &LoadOptions::default(), None, true, &mut |_| {
            true
        })
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("missing tensors: model.layers.1.mlp.up_proj.weight"),
        "{msg}"
    );
}

/// `src` loaded over two virtual devices by the tensor-parallel placement of `splits`, every
/// tensor read back as the checkpoint's bytes (`what` names the checkpoint in a failure).
fn load_tp_parts(
    src: &Arc<dyn Source>,
    splits: &Splits,
    what: &str,
) -> (Model, Inventory, Placement) {
    let inv = Inventory::parse("virtual:2x16MiB").unwrap();
    let mut model = Model::new(Arc::clone(src), inv.clone());
    let placement = model.tp_placement(splits).unwrap();
    model
        .load(&placement, &LoadOptions::default(), None, true, &mut |_| {
            true
        })
        .unwrap();
    for (i, t) in src.tensors().iter().enumerate() {
        assert!(
            model.tensor_bytes(&t.name).unwrap().0 == src.bytes(i),
            "{what} {}",
            t.name
        );
    }
    (model, inv, placement)
}

#[test]
fn tp_parts_reassemble_to_the_checkpoint() {
    // exllamav2-style tables for 2 devices: 2 KV heads, 4 Q heads, 768 intermediate, 256 hidden,
    // 32000 vocab.
    let splits = Splits {
        kv: vec![(0, 0, 1), (1, 1, 2)],
        q: vec![(0, 0, 2), (1, 2, 4)],
        id: vec![(0, 0, 384), (1, 384, 768)],
        rs: vec![(0, 0, 128), (1, 128, 256)],
        vc: vec![(0, 0, 16000), (1, 16000, 32000)],
        ex: vec![],
    };
    for sub in ["safetensors-sharded", "gguf/tiny-llama-Q8_0.gguf"] {
        let src = open(sub);
        let (mut model, inv, _) = load_tp_parts(&src, &splits, sub);
        let q = src
            .tensors()
            .iter()
            .find(|t| t.name.contains("q_proj") || t.name.contains("attn_q"))
            .unwrap();
        assert_eq!(model.device_of(&q.name).unwrap(), "virtual:0,virtual:1");
        let used: u64 = inv.accelerators().iter().map(|d| d.used()).sum();
        assert!(used >= src.tensors().iter().map(|t| t.nbytes).sum::<u64>());
        model.unload();
        assert!(inv.all().iter().all(|d| d.used() == 0));
    }
}

/// phi3's stacked `qkv_proj` and `gate_up_proj` (GGUF: `attn_qkv`, `ffn_up` holding gate and
/// up) are cut block by block: each device holds its heads' q, k and v rows and its share of the
/// gate and up rows, and the parts laid end to end are the checkpoint's tensor.
#[test]
fn tp_parts_of_stacked_matrices_reassemble_to_the_checkpoint() {
    let splits = Splits {
        kv: vec![(0, 0, 1), (1, 1, 2)],
        q: vec![(0, 0, 2), (1, 2, 4)],
        id: vec![(0, 0, 16), (1, 16, 32)],
        rs: vec![(0, 0, 32), (1, 32, 64)],
        vc: vec![(0, 0, 160), (1, 160, 320)],
        ex: vec![],
    };
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tiny-phi3");
    for path in [data.clone(), data.join("tiny-phi3-F16.gguf")] {
        let src: Arc<dyn Source> =
            Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
        let (_, _, placement) = load_tp_parts(&src, &splits, &path.display().to_string());
        // q rows of heads 0-1, k and v rows of kv head 0, and the same for device 1: halves
        let qkv = src
            .tensors()
            .iter()
            .position(|t| t.role == Some(weightlift_format::Role::AttnQkv))
            .unwrap();
        let s = placement.tensors[qkv].split.as_ref().unwrap();
        let rows: Vec<(&str, u64, u64)> = s.shards.iter().map(|x| (&x.0[..], x.1, x.2)).collect();
        assert_eq!(
            rows,
            [
                ("virtual:0", 0, 32),
                ("virtual:1", 32, 64),
                ("virtual:0", 64, 80),
                ("virtual:1", 80, 96),
                ("virtual:0", 96, 112),
                ("virtual:1", 112, 128),
            ]
        );
    }
}

/// A mixture-of-experts model's expert tensors split by an expert table (GGUF's stacked
/// `[experts, rows, columns]` cut along their experts, quantised or not; transformers' per-expert
/// tensors whole on their expert's device) and its routers replicated read back as the
/// checkpoint's bytes, each device holding only its experts.
#[test]
fn tp_expert_parts_reassemble_to_the_checkpoint() {
    // both kv heads on device 0: a cut between the two heads of 8 would fall inside Q8_0's
    // 32-value blocks of attn_output
    let splits = Splits {
        kv: vec![(0, 0, 2)],
        q: vec![(0, 0, 4)],
        rs: vec![(0, 0, 32)],
        vc: vec![(0, 0, 320)],
        ex: vec![(0, 0, 3), (1, 3, 4)],
        ..Splits::default()
    };
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
    for path in [
        data.join("tiny-mixtral"),
        data.join("tiny-qwen3moe/tiny-qwen3moe-F16.gguf"),
        data.join("tiny-mixtral/tiny-mixtral-Q8_0.gguf"),
    ] {
        let src: Arc<dyn Source> =
            Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
        let (mut model, inv, _) = load_tp_parts(&src, &splits, &path.display().to_string());
        for t in src.tensors() {
            let what = format!("{}: {}", path.display(), t.name);
            let on = model.device_of(&t.name).unwrap();
            match (weightlift_format::expert_of(&t.name), t.shape.len()) {
                (Some(e), _) => {
                    let want = if e < 3 { "virtual:0" } else { "virtual:1" };
                    assert_eq!(on, want, "{what}");
                }
                (None, 3) => assert_eq!(on, "virtual:0,virtual:1", "{what}"),
                _ => {}
            }
        }
        model.unload();
        assert!(inv.all().iter().all(|d| d.used() == 0));
    }
}

/// `dequantized` works through chunks of at most `max_dq_size` values: host-resident tensors are
/// decoded in place (no transient buffer), split tensors through one buffer of at most one
/// chunk's bytes; either way the values equal a whole-tensor dequantisation of the file's bytes.
#[test]
fn dequantize_is_chunked_by_max_dq_size() {
    let splits = Splits {
        kv: vec![(0, 0, 1), (1, 1, 2)],
        q: vec![(0, 0, 2), (1, 2, 4)],
        id: vec![(0, 0, 384), (1, 384, 768)],
        rs: vec![(0, 0, 128), (1, 128, 256)],
        vc: vec![(0, 0, 16000), (1, 16000, 32000)],
        ex: vec![],
    };
    let src = open("gguf/tiny-llama-Q8_0.gguf");
    let inv = Inventory::parse("virtual:2x16MiB").unwrap();
    for tp in [false, true] {
        let mut model = Model::new(Arc::clone(&src), inv.clone());
        let placement = if tp {
            model.tp_placement(&splits).unwrap()
        } else {
            by_layer(&src)
        };
        model
            .load(&placement, &LoadOptions::default(), None, true, &mut |_| {
                true
            })
            .unwrap();
        let max_dq = 100u64;
        for (i, t) in src.tensors().iter().enumerate() {
            if !weightlift_format::dequant::supports(t.dtype) {
                continue;
            }
            let d = model.dequantized(&t.name, max_dq).unwrap();
            let want = weightlift_format::dequant::dequantize(t.dtype, src.bytes(i)).unwrap();
            assert!(d.values == want, "{} (tp {tp})", t.name);
            assert_eq!(d.shape, t.shape);
            let bs = t.dtype.block_size();
            let per = (max_dq / bs).max(1) * bs;
            assert_eq!(d.chunks as u64, t.n_elements().div_ceil(per), "{}", t.name);
            let chunk_bytes = t.dtype.bytes_for(per).unwrap();
            if tp {
                assert!(d.transient_bytes > 0, "{}", t.name);
                assert!(d.transient_bytes <= chunk_bytes, "{}", t.name);
            } else {
                assert_eq!(d.transient_bytes, 0, "{}", t.name);
            }
        }
        model.unload();
    }
}
