//! The checks every tiny family fixture (`tests/data/tiny-<family>`, made by
//! `tests/gen_<family>.py` from transformers and llama.cpp's converter) is held to: each
//! checkpoint (the f16 safetensors folder, the F16 GGUF and, where the generator wrote one, the
//! Q8_0 GGUF) in exact mode within
//! 1e-3 of transformers at every position with the same argmax; the GGUF files within
//! llama.cpp's own distance to transformers; the same bits on cpu, over 2 and 3 virtual devices
//! and through the backend op sequence; transformers' greedy ids; a plan that is what the load
//! holds. Each family's test file states what is particular to it and calls these.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use weightlift_engine::forward::Compute;
use weightlift_engine::{CacheDType, Inventory, Model};
use weightlift_plan as wp;

use super::{
    argmax, forward_all, greedy, json_ids, load_on, load_planned, load_tp_planned, max_abs_diff,
    open, read_npy, split_load,
};

/// One fixture, named by its family (`"qwen3"` reads `tests/data/tiny-qwen3`).
#[derive(Clone, Copy)]
pub struct Family(pub &'static str);

impl Family {
    pub fn data(self) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data")
            .join(format!("tiny-{}", self.0))
    }

    /// The generator's `stats.json` (its measurements, prompt ids and greedy ids).
    pub fn stats(self) -> serde_json::Value {
        let text = std::fs::read_to_string(self.data().join("stats.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// The prompt ids the reference logits are for.
    pub fn ids(self) -> Vec<u32> {
        json_ids(&self.data().join("stats.json"), "ids")
    }

    /// A GGUF copy of the fixture: `"F16"` or `"Q8_0"`.
    pub fn gguf(self, ty: &str) -> PathBuf {
        self.data().join(format!("tiny-{}-{ty}.gguf", self.0))
    }

    /// The GGUF types the generator wrote (`stats.json` → `gguf`): F16, and Q8_0 but where a
    /// fixture's README says why not; none where llama.cpp's converter refused the checkpoint
    /// (`stats.json` → `gguf_refused`, its message).
    pub fn gguf_types(self) -> Vec<String> {
        let stats = self.stats();
        if stats["gguf_refused"].is_string() {
            return Vec::new();
        }
        let types = stats["gguf"]
            .as_object()
            .expect("stats.json has a gguf entry");
        assert!(types.contains_key("F16"), "{}: no F16 GGUF", self.0);
        types.keys().cloned().collect()
    }

    /// The checkpoints: the safetensors folder, then the F16 GGUF and the Q8_0 GGUF where the
    /// generator wrote them ([`Family::gguf_types`]).
    pub fn checkpoints(self) -> Vec<PathBuf> {
        let mut out = vec![self.data()];
        out.extend(self.gguf_types().iter().map(|ty| self.gguf(ty)));
        out
    }

    /// The reference a checkpoint is held to: transformers' logits, or for Q8_0 transformers'
    /// on the weights gguf-py dequantised from the file.
    pub fn reference_of(path: &Path) -> &'static str {
        if path.to_string_lossy().contains("Q8_0") {
            "hf_dequant_logits_Q8_0.npy"
        } else {
            "hf_logits.npy"
        }
    }

    /// Every position's logits of `path` (a folder or a GGUF), loaded whole on cpu with an f32
    /// cache and exact compute (`backend`: through the CPU backend's op sequence, the path cuda
    /// devices take).
    pub fn exact_logits(self, path: &Path, backend: bool) -> Vec<f32> {
        let (mut m, cache) = load_on(&open(path), "cpu", "cpu", 64, CacheDType::F32);
        m.set_compute(Compute::Exact);
        m.set_host_backend(backend);
        let ids = self.ids();
        let out = forward_all(&mut m, &cache, &ids);
        assert_eq!(cache.seq_len(), ids.len() as u64);
        out
    }

    /// max|Δ| ≤ 1e-3 against the reference `npy` and the same argmax at every position (each
    /// generator picks a seed whose smallest reference margin is far above 1e-3; see the data
    /// README).
    pub fn assert_matches(self, what: &str, out: &[f32], npy: &str) {
        let f = self.0;
        let (shape, want) = read_npy(&self.data().join(npy));
        assert_eq!(out.len(), shape[0] * shape[1], "{f} {what}");
        let d = max_abs_diff(out, &want);
        eprintln!("{f} {what}: max|Δ| {d:e} against {npy}");
        assert!(d <= 1e-3, "{f} {what}: max|Δ| {d} against {npy}");
        for (i, (a, b)) in out.chunks(shape[1]).zip(want.chunks(shape[1])).enumerate() {
            assert_eq!(argmax(a), argmax(b), "{f} {what}: position {i}");
        }
    }

    /// The safetensors folder, in exact mode, is transformers' within 1e-3.
    pub fn safetensors_exact_matches_transformers(self) {
        let out = self.exact_logits(&self.data(), false);
        self.assert_matches("safetensors", &out, "hf_logits.npy");
    }

    /// The F16 GGUF, in exact mode, is transformers' within 1e-3 (the generator checks that it
    /// holds the safetensors' tensors bit for bit: no row permutation, norms in f32).
    pub fn f16_gguf_exact_matches_transformers(self) {
        let out = self.exact_logits(&self.gguf("F16"), false);
        self.assert_matches("F16 GGUF", &out, "hf_logits.npy");
    }

    /// The Q8_0 GGUF, in exact mode, is transformers' within 1e-3 on the weights gguf-py
    /// dequantised from the file.
    pub fn q8_0_gguf_exact_matches_transformers_on_dequantised_weights(self) {
        let out = self.exact_logits(&self.gguf("Q8_0"), false);
        self.assert_matches("Q8_0 GGUF", &out, "hf_dequant_logits_Q8_0.npy");
    }

    /// llama.cpp's own logits for the GGUF files (`llamacpp_logits_*.npy`) are as far from
    /// transformers' as its arithmetic (and for Q8_0 its 8-bit activations) makes them. In exact
    /// mode (f32 activations) the engine on each file is no farther from transformers than
    /// llama.cpp is; on Q8_0 in fast mode (8-bit activations, llama.cpp's scheme) it is nearer to
    /// llama.cpp than llama.cpp is to transformers. Exact mode keeps transformers' argmax at
    /// every position, fast mode on Q8_0 at least where llama.cpp does.
    pub fn gguf_within_llamacpps_distance_to_transformers(self) {
        let f = self.0;
        let ids = self.ids();
        let (shape, hf) = read_npy(&self.data().join("hf_logits.npy"));
        let (n, vocab) = (shape[0], shape[1]);
        for ty in self.gguf_types() {
            let ty = ty.as_str();
            let (_, lc) = read_npy(&self.data().join(format!("llamacpp_logits_{ty}.npy")));
            let bound = max_abs_diff(&lc, &hf);
            let (mut m, cache) = load_on(&open(self.gguf(ty)), "cpu", "cpu", 64, CacheDType::F32);
            for compute in [Compute::Exact, Compute::Fast] {
                m.set_compute(compute);
                let out = forward_all(&mut m, &cache, &ids);
                let (d, to_lc) = (max_abs_diff(&out, &hf), max_abs_diff(&out, &lc));
                eprintln!(
                    "{f} {ty} {compute:?}: max|Δ| {d:e} to transformers (llama.cpp {bound:e}), \
                     {to_lc:e} to llama.cpp"
                );
                // fast mode multiplies float weights exactly too
                let held = if compute == Compute::Fast && ty != "F16" {
                    to_lc
                } else {
                    d
                };
                assert!(
                    held <= bound,
                    "{f} {ty} {compute:?}: {held} > llama.cpp's {bound}"
                );
                let agree = |x: &[f32]| {
                    x.chunks(vocab)
                        .zip(hf.chunks(vocab))
                        .filter(|(a, b)| argmax(a) == argmax(b))
                        .count()
                };
                // exact: transformers' argmax everywhere; fast on Q8_0: as often as llama.cpp's
                let want = if held == d { n } else { agree(&lc) };
                assert!(
                    agree(&out) >= want,
                    "{f} {ty} {compute:?}: argmax agrees with transformers at {} of {n} \
                     positions, expected {want}",
                    agree(&out)
                );
            }
        }
    }

    /// Placement never changes the bits: whole on cpu, layers over 2 and 3 virtual devices (the
    /// hidden state crossing device boundaries), its first layer on disk (computed by the host
    /// from the mapped file), and the backend op sequence a GPU runs (on the CPU backend), for
    /// each checkpoint; and every run is transformers' within 1e-3.
    pub fn same_bits_on_cpu_virtual_devices_and_the_backend(self) {
        self.same_bits_across_placements(true);
    }

    /// [`Family::same_bits_on_cpu_virtual_devices_and_the_backend`], through the backend op
    /// sequence only when `backend` (a family it refuses checks the host path alone).
    pub fn same_bits_across_placements(self, backend: bool) {
        let ids = self.ids();
        for path in self.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let (mut m, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            m.set_compute(Compute::Exact);
            let cpu = forward_all(&mut m, &cache, &ids);
            self.assert_matches(&format!("{file} cpu"), &cpu, Self::reference_of(&path));
            if backend {
                m.set_host_backend(true);
                let through = forward_all(&mut m, &cache, &ids);
                assert!(
                    through == cpu,
                    "{file}: backend and host paths differ (max|Δ| {})",
                    max_abs_diff(&through, &cpu)
                );
            }
            for (inv, devs) in [
                ("virtual:2x64MiB,cpu", &["virtual:0", "virtual:1"][..]),
                (
                    "virtual:3x64MiB,cpu",
                    &["virtual:0", "virtual:1", "virtual:2"][..],
                ),
            ] {
                let (mut m, cache) = split_load(&src, inv, devs, CacheDType::F32, 0, false);
                m.set_compute(Compute::Exact);
                let out = forward_all(&mut m, &cache, &ids);
                assert!(
                    out == cpu,
                    "{file} over {inv}: max|Δ| {} from cpu",
                    max_abs_diff(&out, &cpu)
                );
                if backend {
                    m.set_host_backend(true);
                    let out = forward_all(&mut m, &cache, &ids);
                    assert!(out == cpu, "{file} over {inv} through the backend");
                }
            }
            self.disk_layers_give_these_bits(&path, 1, &cpu);
        }
    }

    /// `path` with its first `n_disk` layers on disk and the rest over two virtual devices
    /// gives `cpu`, the bits of the whole model on cpu, in exact mode.
    pub fn disk_layers_give_these_bits(self, path: &Path, n_disk: u32, cpu: &[f32]) {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let src = open(path);
        let (mut m, cache) = split_load(
            &src,
            "virtual:2x64MiB,cpu,disk",
            &["virtual:0", "virtual:1"],
            CacheDType::F32,
            n_disk,
            false,
        );
        m.set_compute(Compute::Exact);
        let out = forward_all(&mut m, &cache, &self.ids());
        assert!(
            out == cpu,
            "{file} with {n_disk} disk layer(s): max|Δ| {}",
            max_abs_diff(&out, cpu)
        );
    }

    /// Greedy decoding, one token per forward call from the cache, from the safetensors folder
    /// and the F16 GGUF (where there is one), on the host path and through the backend, is
    /// transformers' greedy continuation (`greedy_ids`; the generator records each step's
    /// margin).
    pub fn greedy_ids_are_transformers(self) {
        let want = json_ids(&self.data().join("stats.json"), "greedy_ids");
        let ids = self.ids();
        let same_weights = self.checkpoints().into_iter();
        for path in same_weights.filter(|p| !p.to_string_lossy().contains("Q8_0")) {
            let (mut m, cache) = load_on(&open(&path), "cpu", "cpu", 64, CacheDType::F32);
            m.set_compute(Compute::Exact);
            for backend in [false, true] {
                m.set_host_backend(backend);
                let got = greedy(&mut m, &cache, &ids, want.len());
                assert_eq!(got, want, "{} backend {backend}", path.display());
            }
        }
    }

    /// The three checkpoints with their MLP widened to 768 by zeros ([`super::widened_mlp`],
    /// [`super::widened_gguf`]), which the tensor-parallel tables can split (whole units of 128
    /// intermediate rows) and which give the originals' logits; the folders holding them.
    pub fn widened(self) -> ([tempfile::TempDir; 2], [PathBuf; 3]) {
        let st = super::widened_mlp(&self.data());
        let ggufs = tempfile::tempdir().unwrap();
        let [f16, q8] = ["F16", "Q8_0"].map(|ty| super::widened_gguf(&self.gguf(ty), ggufs.path()));
        let folder = st.path().to_path_buf();
        ([st, ggufs], [folder, f16, q8])
    }

    /// Tensor-parallel over 2 and 3 virtual devices (and cpu), on the host path and through
    /// the CPU backend's op sequence, in exact mode: every checkpoint's logits at every position
    /// (its MLP widened, [`Family::widened`]) within 1e-5 (of the largest) of the original's on
    /// a layer split on cpu, and within 1e-3 of the reference. Prompt chunks of 8 tokens.
    pub fn tensor_parallel_matches_the_layer_split(self) {
        let f = self.0;
        let ids = self.ids();
        let runtime = wp::RuntimeSpec {
            max_input_len: 8,
            max_attention_size: 8 * 64,
            max_dq_size: 1 << 16,
            low_mem: false,
        };
        let (_dirs, wide) = self.widened();
        for (path, wide) in self.checkpoints().iter().zip(&wide) {
            let want = self.exact_logits(path, false);
            let top = want.iter().fold(0f32, |a, x| a.max(x.abs()));
            for devices in ["virtual:2x64MiB,cpu", "virtual:3x64MiB,cpu"] {
                let (mut m, cache, _) =
                    load_tp_planned(&open(wide), devices, runtime, CacheDType::F32);
                m.set_compute(Compute::Exact);
                for backend in [false, true] {
                    m.set_host_backend(backend);
                    let got = forward_all(&mut m, &cache, &ids);
                    let what = format!(
                        "{} tensor-parallel over {devices} (backend {backend})",
                        path.file_name().unwrap().to_string_lossy()
                    );
                    let d = max_abs_diff(&got, &want);
                    eprintln!("{f} {what}: max|Δ| {d:e} of {top} against the layer split");
                    assert!(d <= 1e-5 * top, "{f} {what}: max|Δ| {d} of {top}");
                    self.assert_matches(&what, &got, Self::reference_of(path));
                }
            }
        }
    }

    /// Plans over virtual devices, carried out by the loader: each device holds what the plan
    /// says (weights, the KV of its layers and its workspace), every tensor's bytes are the
    /// file's, and the planned model is transformers' within 1e-3.
    pub fn plan_is_what_the_load_holds(self) {
        let ids = self.ids();
        let runtime = wp::RuntimeSpec {
            max_input_len: ids.len() as u64,
            max_attention_size: ids.len() as u64 * 64,
            max_dq_size: 1 << 16,
            low_mem: false,
        };
        let split = |n: usize| {
            wp::Strategy::Layers(wp::LayerOptions {
                n_gpu_layers: -1,
                tensor_split: vec![1.0; n],
                ..wp::LayerOptions::default()
            })
        };
        for path in self.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            for (devices, strategy) in [
                ("virtual:2x4MiB,cpu", wp::Strategy::Autosplit),
                ("virtual:2x4MiB", split(2)),
                ("virtual:3x4MiB", split(3)),
            ] {
                let src = open(&path);
                let inv = Inventory::parse(devices).unwrap();
                let mut m = Model::new(Arc::clone(&src), inv.clone());
                let mut req = m.plan_request().unwrap();
                req.strategy = strategy;
                req.cache = Some(wp::CacheSpec::new(64, 1, CacheDType::F32));
                req.runtime = runtime;
                let plan = wp::plan(&req).unwrap();
                let layers = plan.layer_devices();
                let cache = load_planned(&mut m, &plan).unwrap();
                let mem = m.memory();
                for d in plan.devices() {
                    let want = d.weights + d.kv + d.scratch;
                    let got = mem
                        .iter()
                        .find(|(n, _)| *n == d.name)
                        .map_or(0, |(_, b)| *b);
                    assert_eq!(got, want, "{file} {devices}: {} plan vs held", d.name);
                }
                for (i, t) in src.tensors().iter().enumerate() {
                    assert_eq!(
                        m.tensor_bytes(&t.name).unwrap().0,
                        src.bytes(i),
                        "{}",
                        t.name
                    );
                }
                m.set_compute(Compute::Exact);
                let out = forward_all(&mut m, &cache, &ids);
                self.assert_matches(
                    &format!("{file} {devices} {layers:?}"),
                    &out,
                    Self::reference_of(&path),
                );
                // the forward pass allocated nothing the plan does not count on the devices
                // that stand for GPUs (the cpu's weights are views of the mapped file, which
                // its device does not count)
                for d in plan
                    .devices()
                    .iter()
                    .filter(|d| d.name.starts_with("virtual"))
                {
                    let dev = inv.get(&d.name).unwrap();
                    let want = d.weights + d.kv + d.scratch;
                    assert_eq!(
                        dev.peak(),
                        want,
                        "{file} {devices}: {} plan vs peak",
                        d.name
                    );
                }
                m.unload();
                assert!(inv.all().iter().all(|d| d.used() == 0));
            }
        }
    }

    /// The safetensors folder's `config.json`.
    pub fn config(self) -> serde_json::Value {
        let text = std::fs::read_to_string(self.data().join("config.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// A copy of the safetensors folder (its weights and config) with the config's `key` set to
    /// `value`.
    pub fn with_config_set(self, key: &str, value: serde_json::Value) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            self.data().join("model.safetensors"),
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let mut config = self.config();
        config[key] = value;
        std::fs::write(
            dir.path().join("config.json"),
            serde_json::to_string_pretty(&config).unwrap(),
        )
        .unwrap();
        dir
    }

    /// A copy of the safetensors folder (its config) with every tensor whose name `pick`
    /// accepts set to `value` throughout, in the tensor's own dtype; how many were set.
    pub fn with_tensors_set(
        self,
        pick: impl Fn(&str) -> bool,
        value: f32,
    ) -> (tempfile::TempDir, usize) {
        use safetensors::tensor::TensorView;
        use safetensors::{Dtype, SafeTensors};
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            self.data().join("config.json"),
            dir.path().join("config.json"),
        )
        .unwrap();
        let bytes = std::fs::read(self.data().join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let set: Vec<(String, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| pick(n))
            .map(|(n, v)| {
                let one: Vec<u8> = match v.dtype() {
                    Dtype::F32 => value.to_le_bytes().to_vec(),
                    Dtype::F16 => half::f16::from_f32(value).to_le_bytes().to_vec(),
                    Dtype::BF16 => half::bf16::from_f32(value).to_le_bytes().to_vec(),
                    other => panic!("{n}: a float tensor expected, got {other:?}"),
                };
                let count = v.data().len() / one.len();
                (n, one.repeat(count))
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| match set.iter().find(|(z, _)| *z == n) {
                Some((_, buf)) => (
                    n,
                    TensorView::new(v.dtype(), v.shape().to_vec(), buf).unwrap(),
                ),
                None => (n, v),
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        (dir, set.len())
    }
}
