//! Shared helpers of the forward-pass tests: the reference folder, a reader for its float32
//! `.npy` files, opening and loading a checkpoint (whole on one device, or layer by layer over
//! several), the demo model and its reference prompts, and greedy decoding.

#![allow(dead_code)]

pub mod batch;
pub mod family;

use std::path::{Path, PathBuf};

/// The reference data (`make reference` lays it out; a missing folder fails the test).
pub fn reference() -> PathBuf {
    weightlift_testdata::reference()
}

/// A little-endian float32, C-order `.npy` file: `(shape, values)`. Panics (failing the test)
/// on anything else, naming the file.
pub fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        &data[..6],
        b"\x93NUMPY",
        "{}: not an npy file",
        path.display()
    );
    let (hlen, start) = match data[6] {
        1 => (u16::from_le_bytes([data[8], data[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&data[start..start + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<f4'"),
        "{}: {header}",
        path.display()
    );
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape_txt = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape: Vec<usize> = shape_txt
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let body = &data[start + hlen..];
    let values: Vec<f32> = body
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(
        values.len(),
        shape.iter().product::<usize>(),
        "{}",
        path.display()
    );
    (shape, values)
}

/// Index of the largest value (the first of equals).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

/// Top-1 minus top-2.
pub fn margin(row: &[f32]) -> f32 {
    let mut a = f32::NEG_INFINITY;
    let mut b = f32::NEG_INFINITY;
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Rank of `id` in `row` (0: the largest).
pub fn rank(row: &[f32], id: usize) -> usize {
    row.iter().filter(|v| **v > row[id]).count()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// transformers' f32 logits for SmolLM2's reference prompt `k`, as whole vocabulary rows at
/// the positions the reference keeps: `(positions, vocab, rows)`. Prompt 1 keeps all 5;
/// prompt 2 keeps 11 of its 41 ([`kept_rows`]).
pub fn smollm2_hf_logits(k: u32) -> (Vec<usize>, usize, Vec<f32>) {
    if k == 2 {
        return kept_rows("smollm2-135m/hf_logits_2");
    }
    let (shape, rows) = read_npy(&reference().join("smollm2-135m/hf_logits_1.npy"));
    ((0..shape[0]).collect(), shape[1], rows)
}

/// Logits the reference keeps at some positions only, whole vocabulary rows:
/// `<name>_rows.npy`, holding the rows at the positions `<name>_rows.json` lists (`name` under
/// the reference folder, e.g. `tiny-llama/hf_dequant_logits_Q8_0`). `(positions, vocab, rows)`;
/// compare them with [`rows_at`] of the logits at every position.
pub fn kept_rows(name: &str) -> (Vec<usize>, usize, Vec<f32>) {
    let listed = json_ids(&reference().join(format!("{name}_rows.json")), "positions");
    let positions: Vec<usize> = listed.into_iter().map(|p| p as usize).collect();
    let (shape, rows) = read_npy(&reference().join(format!("{name}_rows.npy")));
    assert_eq!(
        positions.len(),
        shape[0],
        "{name}_rows: rows against positions"
    );
    (positions, shape[1], rows)
}

/// The rows of `logits` (`vocab` wide) at `positions`, one after another.
pub fn rows_at(logits: &[f32], vocab: usize, positions: &[usize]) -> Vec<f32> {
    positions
        .iter()
        .flat_map(|&p| logits[p * vocab..(p + 1) * vocab].iter().copied())
        .collect()
}

/// llama.cpp's logits as the reference keeps them: each position's top entries, best first
/// (ids and exact values), enough for its argmax, its top-1/top-2 margin and the rank of a
/// token among its first few.
pub struct LlamaCppTop {
    pub vocab: usize,
    pub ids: Vec<Vec<usize>>,
    pub logits: Vec<Vec<f32>>,
}

impl LlamaCppTop {
    /// `rel`: a `llamacpp_top8_*.json` file of the reference folder.
    pub fn read(rel: &str) -> LlamaCppTop {
        let path = reference().join(rel);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let table = |key: &str| -> Vec<Vec<serde_json::Value>> {
            v[key]
                .as_array()
                .unwrap_or_else(|| panic!("{}: no list at {key}", path.display()))
                .iter()
                .map(|row| row.as_array().unwrap().clone())
                .collect()
        };
        LlamaCppTop {
            vocab: v["vocab"].as_u64().unwrap() as usize,
            ids: table("ids")
                .iter()
                .map(|r| r.iter().map(|x| x.as_u64().unwrap() as usize).collect())
                .collect(),
            logits: table("logits")
                .iter()
                .map(|r| r.iter().map(|x| x.as_f64().unwrap() as f32).collect())
                .collect(),
        }
    }

    pub fn argmax(&self, pos: usize) -> usize {
        self.ids[pos][0]
    }

    /// Top-1 minus top-2.
    pub fn margin(&self, pos: usize) -> f32 {
        self.logits[pos][0] - self.logits[pos][1]
    }

    /// Rank of `id` at `pos` (0: the largest), or the number of kept entries when `id` is not
    /// among them.
    pub fn rank(&self, pos: usize, id: usize) -> usize {
        let row = &self.ids[pos];
        row.iter().position(|&i| i == id).unwrap_or(row.len())
    }
}

/// The ids of a reference JSON list field, e.g. `"ids"`.
pub fn json_ids(path: &Path, key: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut cur = &v;
    for k in key.split('.') {
        cur = &cur[k];
    }
    cur.as_array()
        .unwrap_or_else(|| panic!("{}: no list at {key}", path.display()))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Checks greedy ids `ours` against the two reference continuations of `greedy` (a
/// `greedy.json`): llama.cpp's and transformers'. The fast path rounds activations to 8 bits as
/// llama.cpp does, but not bit for bit, and last-bit differences between instruction sets move
/// its logits by a few hundredths through that rounding, so where the model's top two are close
/// it may take either reference's branch (the references themselves part at such a step).
/// Passes when `ours` is one reference's ids, or departs from the one it follows longest only at
/// a step where that reference's own top-two margin is below `margin`; the error names the step.
pub fn follows_a_greedy_reference(greedy: &Path, ours: &[u32], margin: f64) -> Result<(), String> {
    let text = std::fs::read_to_string(greedy).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut parted = Vec::new();
    for engine in ["llamacpp", "transformers"] {
        let ids = json_ids(greedy, &format!("{engine}.ids"));
        let agree = ours.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        if agree == ours.len().min(ids.len()) {
            return Ok(());
        }
        let gap = v[engine]["top1_minus_top2_per_step"][agree]
            .as_f64()
            .unwrap_or_else(|| panic!("{}: no {engine} margin at step {agree}", greedy.display()));
        parted.push((agree, engine, ids[agree], gap));
    }
    let longest = parted.iter().map(|p| p.0).max().unwrap();
    let near_tie = parted.iter().any(|p| p.0 == longest && p.3 < margin);
    if near_tie {
        return Ok(());
    }
    Err(parted
        .iter()
        .map(|(step, engine, theirs, gap)| {
            format!(
                "{engine}'s ids part from ours at step {step} ({theirs} against {}), where its \
                 margin is {gap:.3} (at least {margin} is no near-tie)",
                ours[*step]
            )
        })
        .collect::<Vec<_>>()
        .join("; "))
}

/// Open a checkpoint (a GGUF file or a safetensors folder), failing the test with the reason.
pub fn open(path: impl AsRef<Path>) -> std::sync::Arc<dyn weightlift_engine::Source> {
    let path = path.as_ref();
    std::sync::Arc::new(
        weightlift_format::Checkpoint::open(path, weightlift_format::OpenOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
}

/// Load `src` whole onto `device` of the inventory `devices`, with a cache of `max_seq_len`
/// positions in `dtype`; the model and its cache.
pub fn load_on(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    devices: &str,
    device: &str,
    max_seq_len: u64,
    dtype: weightlift_engine::CacheDType,
) -> (
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
) {
    use weightlift_engine::{Cache, Inventory, LoadOptions, Model, Placement};
    let mut m = Model::new(
        std::sync::Arc::clone(src),
        Inventory::parse(devices).unwrap(),
    );
    let config = m.cache_config(max_seq_len, 1, dtype, false).unwrap();
    let cache = std::sync::Arc::new(Cache::new(config).unwrap());
    let placement = Placement::all_on(src.as_ref(), device, m.n_layers());
    m.load(
        &placement,
        &LoadOptions::default(),
        Some(&cache),
        true,
        &mut |_| true,
    )
    .unwrap();
    (m, cache)
}

/// Plans `m` with `options` over its own inventory and loads it as planned (default load
/// options, no progress callback): the plan, as `Model::plan_and_load` returns it.
pub fn plan_and_load(
    m: &mut weightlift_engine::Model,
    options: weightlift_plan::PlanOptions,
) -> weightlift_plan::Plan {
    m.plan_and_load(
        None,
        options,
        &Default::default(),
        None,
        &weightlift_engine::LoadOptions::default(),
        &mut |_| true,
    )
    .unwrap()
}

/// Load `m` as `plan` places it, with the cache the plan sizes (which it must have).
pub fn load_planned(
    m: &mut weightlift_engine::Model,
    plan: &weightlift_plan::Plan,
) -> weightlift_engine::Result<std::sync::Arc<weightlift_engine::Cache>> {
    let placement = m.placement(plan)?;
    load_placed(m, plan, &placement)
}

/// Load `m` by `placement` (made from `plan`), with the cache the plan sizes.
pub fn load_placed(
    m: &mut weightlift_engine::Model,
    plan: &weightlift_plan::Plan,
    placement: &weightlift_engine::Placement,
) -> weightlift_engine::Result<std::sync::Arc<weightlift_engine::Cache>> {
    let c = plan.cache().expect("a plan with a cache");
    let config = m.cache_config(c.max_seq_len, c.batch_size, c.dtype, c.offload)?;
    let cache = std::sync::Arc::new(weightlift_engine::Cache::new(config)?);
    m.load(
        placement,
        &weightlift_engine::LoadOptions::default(),
        Some(&cache),
        true,
        &mut |_| true,
    )?;
    Ok(cache)
}

/// `src` loaded tensor-parallel over `devices` by the planner's tables, with `runtime` and a
/// cache of 64 positions in `dtype`: the model, its cache and the plan.
pub fn load_tp_planned(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    devices: &str,
    runtime: weightlift_plan::RuntimeSpec,
    dtype: weightlift_engine::CacheDType,
) -> (
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
    weightlift_plan::Plan,
) {
    use weightlift_plan as wp;
    let inventory = weightlift_engine::Inventory::parse(devices).unwrap();
    let mut m = weightlift_engine::Model::new(std::sync::Arc::clone(src), inventory);
    let mut req = m.plan_request().unwrap();
    req.runtime = runtime;
    wp::PlanOptions {
        strategy: Some("tensor_parallel".into()),
        expect_cache: Some(wp::ExpectCache { tokens: 64, dtype }),
        ..wp::PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let plan = wp::plan(&req).unwrap();
    let cache = load_planned(&mut m, &plan).unwrap();
    (m, cache, plan)
}

/// Load `src` with layer `l` on `devs[l * devs.len() / n_layers]` (or on `disk` below
/// `disk_below`) and everything else on cpu, with a cache of 64 positions in `dtype`
/// (`offload`: in host RAM); workspaces are allocated by the first forward call.
pub fn split_load(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    inv: &str,
    devs: &[&str],
    dtype: weightlift_engine::CacheDType,
    disk_below: u32,
    offload: bool,
) -> (
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
) {
    use weightlift_engine::{Cache, Inventory, LoadOptions, Model, Placement};
    let mut m = Model::new(std::sync::Arc::clone(src), Inventory::parse(inv).unwrap());
    let n = m.n_layers();
    let layer_dev = |l: u32| -> String {
        if l < disk_below {
            "disk".into()
        } else {
            devs[(l as usize * devs.len()) / n as usize].to_owned()
        }
    };
    let mut p = Placement::all_on(src.as_ref(), "cpu", n);
    for (t, info) in p.tensors.iter_mut().zip(src.tensors()) {
        if let Some(l) = info.layer {
            t.device = layer_dev(l);
        }
    }
    p.layers = (0..n).map(layer_dev).collect();
    let cfg = m.cache_config(64, 1, dtype, offload).unwrap();
    let cache = std::sync::Arc::new(Cache::new(cfg).unwrap());
    m.load(&p, &LoadOptions::default(), Some(&cache), true, &mut |_| {
        true
    })
    .unwrap();
    (m, cache)
}

/// The SmolLM2 demo model (`make demo-model` fetches it).
pub fn smollm2() -> std::sync::Arc<dyn weightlift_engine::Source> {
    open(weightlift_testdata::demo_gguf())
}

/// Reference prompt `k` of SmolLM2, as llama.cpp tokenised it.
pub fn smollm2_prompt(k: u32) -> Vec<u32> {
    json_ids(
        &reference().join("smollm2-135m/prompts.json"),
        &format!("prompts.{k}.ids_llamacpp"),
    )
}

/// Every position's logits of `ids` from position 0.
pub fn forward_all(
    m: &mut weightlift_engine::Model,
    cache: &std::sync::Arc<weightlift_engine::Cache>,
    ids: &[u32],
) -> Vec<f32> {
    cache.reset();
    let mut out = Vec::new();
    m.forward(
        ids,
        Some(cache),
        weightlift_engine::forward::Logits::All,
        &mut out,
    )
    .unwrap();
    out
}

/// Greedy continuation: `steps` argmax tokens after `prompt`, one forward call per token.
pub fn greedy(
    m: &mut weightlift_engine::Model,
    cache: &std::sync::Arc<weightlift_engine::Cache>,
    prompt: &[u32],
    steps: usize,
) -> Vec<u32> {
    use weightlift_engine::forward::Logits;
    cache.reset();
    let mut out = Vec::new();
    let mut ids = Vec::new();
    m.forward(prompt, Some(cache), Logits::Last, &mut out)
        .unwrap();
    for _ in 0..steps {
        let next = argmax(&out) as u32;
        ids.push(next);
        m.forward(&[next], Some(cache), Logits::Last, &mut out)
            .unwrap();
    }
    ids
}

/// `src` planned on `devices` with its last `n_gpu_layers` on the first and the rest kept on
/// the cpu, executing on that first device under `offload` when given; a cache of 32
/// positions and a small runtime, so a 12-token prompt runs in two chunks (the all-on-cpu run
/// it is compared with takes the same runtime: chunks of another length sum in another
/// order). The model, its cache, the plan and the inventory.
pub fn planned_layers(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    devices: &str,
    n_gpu_layers: i64,
    offload: Option<weightlift_plan::WeightOffload>,
) -> (
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
    weightlift_plan::Plan,
    weightlift_engine::Inventory,
) {
    use std::sync::Arc;
    use weightlift_engine::{Inventory, Model};
    use weightlift_plan as wp;
    let inv = Inventory::parse(devices).unwrap();
    let mut m = Model::new(Arc::clone(src), inv.clone());
    let mut req = m.plan_request().unwrap();
    req.strategy = wp::Strategy::Layers(wp::LayerOptions {
        n_gpu_layers,
        ..wp::LayerOptions::default()
    });
    req.cache = Some(wp::CacheSpec::new(
        32,
        1,
        weightlift_engine::CacheDType::F32,
    ));
    req.runtime = wp::RuntimeSpec {
        max_input_len: 8,
        max_attention_size: 8 * 32,
        max_dq_size: 1 << 12,
        low_mem: false,
    };
    req.offload = offload;
    let plan = wp::plan(&req).unwrap();
    let cache = load_planned(&mut m, &plan).unwrap();
    (m, cache, plan, inv)
}

/// The prompt `ids`' logits at every position, then three decode steps' (the cache reset
/// first), as bits.
pub fn prompt_and_decode(
    m: &mut weightlift_engine::Model,
    cache: &std::sync::Arc<weightlift_engine::Cache>,
    ids: &[u32],
) -> Vec<u32> {
    let mut all = forward_all(m, cache, ids);
    let mut out = Vec::new();
    for id in &ids[..3] {
        m.forward(
            &[*id],
            Some(cache),
            weightlift_engine::forward::Logits::Last,
            &mut out,
        )
        .unwrap();
        all.extend_from_slice(&out);
    }
    all.iter().map(|v| v.to_bits()).collect()
}

/// Bytes of the tensors layer `l`'s packed products read, from the checkpoint's byte ranges:
/// what an onload slot holds of the layer. `read` names a linear's product tensors (GPTQ:
/// qweight, qzeros, scales; EXL2: q_weight, q_scale, q_scale_max) and panics on another
/// scheme; every one of the 7 projections must be packed.
pub fn packed_layer_bytes(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    l: u32,
    read: impl Fn(&weightlift_format::quantized::QuantizedLinear) -> [String; 3],
) -> u64 {
    let ckpt = src.checkpoint().unwrap();
    let linears: Vec<_> = ckpt
        .quantization()
        .unwrap()
        .linears()
        .iter()
        .filter(|q| q.layer() == Some(l))
        .collect();
    assert_eq!(linears.len(), 7, "layer {l}: every projection is packed");
    linears
        .iter()
        .flat_map(|q| read(q))
        .map(|name| ckpt.tensor(&name).unwrap().nbytes)
        .sum()
}

pub fn qwen2_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tiny-qwen2")
}

/// The tiny Qwen2 for tensor parallelism, with its MLP widened to 768 by zero rows of gate and
/// up and zero columns of down: exllamav2's split wants the intermediate size in units of 128 (at least two
/// per device), and the added units contribute exact zeros (`silu(0)·0`), so transformers'
/// logits of the original still hold.
///
/// A static is never dropped, so the copy would outlive the test process: it is made in cargo's
/// temporary folder for integration tests, named by the process, and each process first removes
/// the copies of processes that have ended.
pub fn qwen2() -> PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let parent = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let prefix = "qwen2-wide-";
        for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix(prefix).and_then(|r| r.split('.').next());
            if pid.is_some_and(|p| !Path::new("/proc").join(p).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let prefix = format!("{prefix}{}.", std::process::id());
        widened_mlp_in(&qwen2_data(), parent, &prefix)
    })
    .path()
    .to_path_buf()
}

/// A copy of the GGUF file `path` (F32, F16 or Q8_0 matrices) in `dir`, with its MLP widened
/// to 768 as [`widened_mlp`] widens a safetensors model: zero rows appended to `ffn_gate` and
/// `ffn_up` (to each half of an `ffn_up` holding gate and up, phi3's), zero columns to each row
/// of `ffn_down` (whole blocks,
/// since 768 and the tiny models' sizes are multiples of 32), and `feed_forward_length` set to
/// 768. The header is patched in place (every value keeps its size); the data is laid out
/// again at the file's alignment. Returns the copy's path.
pub fn widened_gguf(path: &Path, dir: &Path) -> PathBuf {
    const WIDE: u64 = 768;
    let bytes = std::fs::read(path).unwrap();
    let mut head = bytes.clone();
    let mut at = 8usize;
    let read_u32 = |at: &mut usize| {
        let v = u32::from_le_bytes(bytes[*at..*at + 4].try_into().unwrap());
        *at += 4;
        v
    };
    let read_u64 = |at: &mut usize| {
        let v = u64::from_le_bytes(bytes[*at..*at + 8].try_into().unwrap());
        *at += 8;
        v
    };
    let read_str = |at: &mut usize| {
        let n = read_u64(at) as usize;
        let s = String::from_utf8(bytes[*at..*at + n].to_vec()).unwrap();
        *at += n;
        s
    };
    // the sizes of gguf's scalar value types, by type id (8: string, 9: array)
    let scalar = |ty: u32| [1usize, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8][ty as usize];
    fn skip(ty: u32, at: &mut usize, b: &[u8], scalar: &dyn Fn(u32) -> usize) {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        match ty {
            8 => *at += 8 + u64_at(*at) as usize,
            9 => {
                let inner = u32_at(*at);
                let n = u64_at(*at + 4);
                *at += 12;
                for _ in 0..n {
                    skip(inner, at, b, scalar);
                }
            }
            _ => *at += scalar(ty),
        }
    }
    let n_tensors = read_u64(&mut at);
    let n_kv = read_u64(&mut at);
    let mut alignment = 32u64;
    let mut inter = 0u64;
    for _ in 0..n_kv {
        let key = read_str(&mut at);
        let ty = read_u32(&mut at);
        if key.ends_with(".feed_forward_length") {
            assert_eq!(ty, 4, "{key}: a u32");
            inter = u64::from(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()));
            head[at..at + 4].copy_from_slice(&(WIDE as u32).to_le_bytes());
        }
        if key == "general.alignment" {
            alignment = u64::from(read_u32(&mut at));
            continue;
        }
        skip(ty, &mut at, &bytes, &scalar);
    }
    // (name, where its dims are, its dims, its type, where its offset is, its offset)
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name = read_str(&mut at);
        let n_dims = read_u32(&mut at) as usize;
        let dims_at = at;
        let dims: Vec<u64> = (0..n_dims).map(|_| read_u64(&mut at)).collect();
        let ty = read_u32(&mut at);
        let offset_at = at;
        let offset = read_u64(&mut at);
        infos.push((name, dims_at, dims, ty, offset_at, offset));
    }
    let data_start = (at as u64).next_multiple_of(alignment) as usize;
    let mut ends: Vec<u64> = infos.iter().map(|i| i.5).collect();
    ends.sort_unstable();
    ends.push((bytes.len() - data_start) as u64);
    let mut data = Vec::new();
    for (name, dims_at, dims, ty, offset_at, offset) in &infos {
        // the span up to the next tensor: its bytes and its padding
        let end = ends[ends.iter().position(|e| e == offset).unwrap() + 1];
        let mut t = bytes[data_start + *offset as usize..data_start + end as usize].to_vec();
        let (cols, rows) = (dims[0], dims.get(1).copied().unwrap_or(1));
        let row = match ty {
            0 => 4 * cols,
            1 => 2 * cols,
            8 => cols / 32 * 34,
            _ => 0,
        };
        let ffn = ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"];
        if ffn.iter().any(|f| name.ends_with(f)) {
            assert!(row > 0, "{name}: type {ty}");
            t.truncate((row * rows) as usize);
        }
        let new_dims = if name.ends_with("ffn_up.weight") && rows == 2 * inter {
            let (gate, up) = t.split_at((row * inter) as usize);
            let mut both = Vec::new();
            for half in [gate, up] {
                both.extend_from_slice(half);
                both.resize(both.len() + (row * (WIDE - inter)) as usize, 0);
            }
            t = both;
            Some([cols, 2 * WIDE])
        } else if name.ends_with("ffn_gate.weight") || name.ends_with("ffn_up.weight") {
            t.resize((row * WIDE) as usize, 0);
            Some([cols, WIDE])
        } else if name.ends_with("ffn_down.weight") {
            let wide_row = row * WIDE / cols;
            t = t
                .chunks(row as usize)
                .flat_map(|r| {
                    let mut r = r.to_vec();
                    r.resize(wide_row as usize, 0);
                    r
                })
                .collect();
            Some([WIDE, rows])
        } else {
            None
        };
        if let Some(d) = new_dims {
            for (k, v) in d.iter().enumerate() {
                head[dims_at + 8 * k..dims_at + 8 * k + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        let new_offset = data.len() as u64;
        head[*offset_at..*offset_at + 8].copy_from_slice(&new_offset.to_le_bytes());
        data.extend_from_slice(&t);
        data.resize((data.len() as u64).next_multiple_of(alignment) as usize, 0);
    }
    head.truncate(data_start);
    head.extend_from_slice(&data);
    let out = dir.join(path.file_name().unwrap());
    std::fs::write(&out, head).unwrap();
    out
}

/// A copy of the tiny safetensors model in `data` with its MLP widened to 768 by zero rows and
/// columns (each half of a stacked gate_up on its own), as [`qwen2`] describes: a model the
/// tensor-parallel tables can split, with the original's logits.
pub fn widened_mlp(data: &Path) -> tempfile::TempDir {
    widened_mlp_in(data, &std::env::temp_dir(), ".tmp")
}

/// [`widened_mlp`] in a new folder under `parent` whose name starts with `prefix`.
pub fn widened_mlp_in(data: &Path, parent: &Path, prefix: &str) -> tempfile::TempDir {
    use safetensors::SafeTensors;
    use safetensors::tensor::TensorView;
    const WIDE: usize = 768;
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(parent)
        .unwrap();
    let cfg = std::fs::read_to_string(data.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let inter = cfg["intermediate_size"].as_u64().unwrap() as usize;
    assert!(
        inter < WIDE,
        "{}: intermediate size {inter}",
        data.display()
    );
    cfg["intermediate_size"] = WIDE.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(data.join(f), dir.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(data.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let padded: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let shape = v.shape().to_vec();
            let data = v.data();
            // bytes per element, the tensor's own dtype kept
            let e = v.dtype().bitsize() / 8;
            let (shape, d) = if n.ends_with("gate_up_proj.weight") {
                // gate and up stacked (phi3): each half widened on its own
                let mut d = Vec::new();
                for part in data.chunks(inter * shape[1] * e) {
                    d.extend_from_slice(part);
                    d.resize(d.len() + (WIDE - inter) * shape[1] * e, 0);
                }
                (vec![2 * WIDE, shape[1]], d)
            } else if n.contains(".experts.") {
                // a mixture-of-experts layer's experts keep their own width
                (shape, data.to_vec())
            } else if n.ends_with("gate_proj.weight") || n.ends_with("up_proj.weight") {
                let mut d = data.to_vec();
                d.resize(WIDE * shape[1] * e, 0);
                (vec![WIDE, shape[1]], d)
            } else if n.ends_with("down_proj.weight") {
                let mut d = Vec::new();
                for row in data.chunks(inter * e) {
                    d.extend_from_slice(row);
                    d.resize(d.len() + (WIDE - inter) * e, 0);
                }
                (vec![shape[0], WIDE], d)
            } else {
                (shape, data.to_vec())
            };
            (n, v.dtype(), shape, d)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = padded
        .iter()
        .map(|(n, t, s, d)| (n.clone(), TensorView::new(*t, s.clone(), d).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

/// A copy of the tiny safetensors llama in `data` with `n_layers` layers, layer `l` a copy of
/// the original's layer `l % n` (of its `n`): a model deep enough for several onload groups,
/// made from the reference pack, so that it travels where the demo model is too large to.
/// No reference holds its logits; tests compare its runs with each other.
pub fn deepened(data: &Path, n_layers: usize) -> tempfile::TempDir {
    use safetensors::SafeTensors;
    use safetensors::tensor::TensorView;
    let dir = tempfile::Builder::new().prefix(".tmp").tempdir().unwrap();
    let cfg = std::fs::read_to_string(data.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let n = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    assert!(n <= n_layers, "{}: {n} layers already", data.display());
    cfg["num_hidden_layers"] = n_layers.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if data.join(f).is_file() {
            std::fs::copy(data.join(f), dir.path().join(f)).unwrap();
        }
    }
    let bytes = std::fs::read(data.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
    for (name, v) in st.tensors() {
        let view = || TensorView::new(v.dtype(), v.shape().to_vec(), v.data()).unwrap();
        let layer = name.strip_prefix("model.layers.").and_then(|rest| {
            let (l, tail) = rest.split_once('.')?;
            Some((l.parse::<usize>().ok()?, tail))
        });
        match layer {
            Some((l, tail)) => {
                for copy in (l..n_layers).step_by(n) {
                    views.push((format!("model.layers.{copy}.{tail}"), view()));
                }
            }
            None => views.push((name.clone(), view())),
        }
    }
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

/// A tensor-parallel run's logits, and per part of the cache every layer's K and V rows.
pub type TpRan = (Vec<f32>, Vec<Vec<Vec<f32>>>);

/// Every position's logits of `ids` from an empty `cache` (in chunks of the runtime's tokens),
/// then two decode steps' logits, and every layer's rows of each part of the split cache.
pub fn tp_run(
    m: &mut weightlift_engine::Model,
    cache: &std::sync::Arc<weightlift_engine::Cache>,
    ids: &[u32],
) -> TpRan {
    use weightlift_engine::forward::Logits;
    cache.reset();
    let mut logits = Vec::new();
    m.forward(ids, Some(cache), Logits::All, &mut logits)
        .unwrap();
    let mut step = Vec::new();
    for id in [7u32, 11] {
        m.forward(&[id], Some(cache), Logits::Last, &mut step)
            .unwrap();
        logits.extend_from_slice(&step);
    }
    let n = cache.seq_len();
    let parts = cache.tp_parts();
    let rows = parts.iter().map(|p| {
        let mut rows = Vec::new();
        for l in 0..m.n_layers() as usize {
            let (k, v) = p.cache.read(l, 0, n).unwrap();
            rows.push(k);
            rows.push(v);
        }
        rows
    });
    (logits, rows.collect())
}

/// The offload modes the packed-format (GPTQ, EXL2) tests run: sequential, then groups of one
/// layer with and without prefetch, and of two with.
pub const OFFLOAD_MODES: [weightlift_plan::WeightOffload; 4] = {
    use weightlift_plan::WeightOffload::{Group, Sequential};
    [
        Sequential,
        Group {
            blocks_per_group: 1,
            prefetch: true,
        },
        Group {
            blocks_per_group: 1,
            prefetch: false,
        },
        Group {
            blocks_per_group: 2,
            prefetch: true,
        },
    ]
};

/// One offloaded case of a packed model `src`, `n_gpu_layers` of its layers on
/// `virtual:8MiB` and the rest kept on the cpu under `mode`: the kept layers are the first
/// ones and compute on the device; the slot holds the largest group's packed bytes
/// (`layer_bytes` of each layer); prompt and decode of `ids` give `cpu`'s logits bit for bit in
/// both compute modes; with more groups than slots a decode step copies every kept layer again; the
/// device's peak is the plan's weights + kv + scratch within 1 %. Returns the model and its
/// cache.
pub fn check_packed_offload(
    what: &str,
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    (n_gpu_layers, mode): (i64, weightlift_plan::WeightOffload),
    (cpu, cpu_cache, ids): (
        &mut weightlift_engine::Model,
        &std::sync::Arc<weightlift_engine::Cache>,
        &[u32],
    ),
    layer_bytes: impl Fn(u32) -> u64,
) -> (
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
) {
    use weightlift_engine::forward::Compute;
    let (mut m, cache, plan, inv) =
        planned_layers(src, "virtual:8MiB,cpu", n_gpu_layers, Some(mode));
    let o = plan.onload().expect("an onload plan").clone();
    let kept: Vec<u32> = o.groups.iter().flatten().copied().collect();
    let n = m.n_layers();
    assert_eq!(
        kept,
        (0..n - n_gpu_layers as u32).collect::<Vec<_>>(),
        "{what}"
    );
    assert!(
        m.layer_devices().unwrap().iter().all(|d| d == "virtual:0"),
        "{what}: {:?}",
        m.layer_devices()
    );
    let largest = o
        .groups
        .iter()
        .map(|g| g.iter().map(|&l| layer_bytes(l)).sum::<u64>())
        .max()
        .unwrap();
    assert_eq!(o.slot_bytes, largest, "{what}: slot bytes");
    for compute in [Compute::Exact, Compute::Fast] {
        cpu.set_compute(compute);
        m.set_compute(compute);
        let want = prompt_and_decode(cpu, cpu_cache, ids);
        let got = prompt_and_decode(&mut m, &cache, ids);
        assert!(got == want, "{what} ({}): logits differ", compute.name());
    }
    if o.groups.len() as u64 > o.slots {
        // more groups than slots: every call copies each group in again
        let moved = m.transfer_stats().bytes;
        let kept_bytes: u64 = kept.iter().map(|&l| layer_bytes(l)).sum();
        assert!(
            moved >= kept_bytes,
            "{what}: {moved} B moved in a decode step"
        );
    }
    let d = plan
        .devices()
        .iter()
        .find(|d| d.name == "virtual:0")
        .unwrap();
    let promised = d.weights + d.kv + d.scratch;
    let peak = inv.get("virtual:0").unwrap().peak();
    eprintln!(
        "{what}: plan {promised} B (weights {}, kv {}, scratch {} with {} slot(s) of {}), \
         peak {peak} B",
        d.weights, d.kv, d.scratch, o.slots, o.slot_bytes
    );
    assert!(
        peak.abs_diff(promised) <= promised / 100,
        "{what}: plan {promised} B, peak {peak} B"
    );
    (m, cache)
}

/// Every device of `plan` holds exactly what the plan charges it (weights, KV and scratch), as
/// `m.memory()` reports it; `what` names the case in the failure.
pub fn assert_holds_the_plan_exactly(
    m: &weightlift_engine::Model,
    plan: &weightlift_plan::Plan,
    what: &str,
) {
    let held = m.memory();
    for d in plan.devices() {
        let got = held
            .iter()
            .find(|(n, _)| *n == d.name)
            .map_or(0, |(_, b)| *b);
        assert_eq!(got, d.weights + d.kv + d.scratch, "{what}: {}", d.name);
    }
}
