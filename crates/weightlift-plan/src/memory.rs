//! The exact memory model of the KV cache and of per-device scratch, in integers.

use serde::{Deserialize, Serialize};
use weightlift_format::{ModelSpec, MoeSpec, TensorInfo};

use crate::device::DeviceKind;
use crate::error::{PlanError, Result};
use crate::workspace::{Dims, Hosts, Workspace, cuda_product_tiles, has_dense_layers};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheDType {
    /// f32: exact runs (llama.cpp's `type_k=f32`).
    F32,
    #[default]
    Fp16,
    /// bfloat16: f32's range at 8 bits of precision, 2 bytes (transformers' default cache
    /// dtype for a bf16 model; llama.cpp's `type_k=bf16`).
    Bf16,
    Fp8,
    Q8,
    Q6,
    Q4,
}

impl CacheDType {
    pub const ALL: &'static [CacheDType] = &[
        CacheDType::F32,
        CacheDType::Fp16,
        CacheDType::Bf16,
        CacheDType::Fp8,
        CacheDType::Q8,
        CacheDType::Q6,
        CacheDType::Q4,
    ];

    /// The one grammar of cache dtypes: ours (`fp16`, `bf16`/`bfloat16`, `fp8`/`e4m3`, `q8`,
    /// `q6`, `q4`, `f32`) and llama.cpp's `type_k`/`type_v` names with the same storage (`f16`,
    /// `bf16`, `f32`, `q8_0`, `q4_0`:
    /// our q8 and q4 groups are 32 values with one f16 scale, the sizes of ggml's Q8_0 and Q4_0).
    /// llama.cpp's `type_k` / `type_v` pair as one cache dtype: equal types, or q8_0 keys with
    /// q4_0 values (the q6 cache); `None` for a pair no cache here stores.
    pub fn from_llama_types(type_k: &str, type_v: &str) -> Result<Option<CacheDType>> {
        Ok(
            match (CacheDType::parse(type_k)?, CacheDType::parse(type_v)?) {
                (k, v) if k == v => Some(k),
                (CacheDType::Q8, CacheDType::Q4) => Some(CacheDType::Q6),
                _ => None,
            },
        )
    }

    pub fn parse(s: &str) -> Result<CacheDType> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(CacheDType::F32),
            "fp16" | "f16" | "float16" => Ok(CacheDType::Fp16),
            "bf16" | "bfloat16" => Ok(CacheDType::Bf16),
            "fp8" | "8bit" | "e4m3" | "f8" => Ok(CacheDType::Fp8),
            "q8" | "q8_0" => Ok(CacheDType::Q8),
            "q6" => Ok(CacheDType::Q6),
            "q4" | "q4_0" => Ok(CacheDType::Q4),
            _ => Err(PlanError::option(
                "cache dtype",
                "f32, fp16 (f16), bf16 (bfloat16), fp8 (e4m3), q8 (q8_0), q6 or q4 (q4_0)",
                format!("'{s}'"),
            )),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            CacheDType::F32 => "f32",
            CacheDType::Fp16 => "fp16",
            CacheDType::Bf16 => "bf16",
            CacheDType::Fp8 => "fp8",
            CacheDType::Q8 => "q8",
            CacheDType::Q6 => "q6",
            CacheDType::Q4 => "q4",
        }
    }

    /// The documented round-trip bound of the cache encoding for one value `x` of `group`
    /// (the 32 consecutive values it is stored with), in K (`is_v = false`) or V: f32 is exact;
    /// fp16 `|x|·2⁻¹¹ + 2⁻²⁵`; bf16 `|x|·2⁻⁸ + 2⁻¹³³` (round to nearest at 8 bits of
    /// precision, f32's exponent range, so only f32's subnormals lose more: at most half of
    /// bf16's smallest step, 2⁻¹³³); fp8 (e4m3) `|x|·2⁻⁴ + 2⁻¹⁰` within ±448. The quantised kinds
    /// store each group turned by an orthonormal Hadamard transform, so the bound is stated on
    /// the group's L2 norm `‖g‖`: q8 `√32·‖g‖/254·(1+2⁻⁹) + 2⁻¹⁷`, q4 `√32·‖g‖/14·(1+2⁻⁹) +
    /// 2⁻¹⁷` (the turned group's largest value is at most `‖g‖`, and turning back spreads each
    /// value's rounding over the group); q6 is q8 for K and q4 for V.
    pub fn error_bound(self, is_v: bool, x: f32, group: &[f32]) -> f32 {
        let norm = group.iter().map(|v| v * v).sum::<f32>().sqrt() * 32f32.sqrt();
        let q8 = norm / 254.0 * (1.0 + 2f32.powi(-9)) + 2f32.powi(-17);
        let q4 = norm / 14.0 * (1.0 + 2f32.powi(-9)) + 2f32.powi(-17);
        match self {
            CacheDType::F32 => 0.0,
            CacheDType::Fp16 => x.abs() * 2f32.powi(-11) + 2f32.powi(-25),
            // 2⁻¹³³ is an f32 subnormal (bits 0x0001_0000); `powi` would overflow on the way
            CacheDType::Bf16 => x.abs() * 2f32.powi(-8) + f32::from_bits(0x0001_0000),
            CacheDType::Fp8 => x.abs() * 2f32.powi(-4) + 2f32.powi(-10),
            CacheDType::Q8 => q8,
            CacheDType::Q6 if is_v => q4,
            CacheDType::Q6 => q8,
            CacheDType::Q4 => q4,
        }
    }

    /// Bytes for `n` K elements and for `n` V elements. Quantised caches store groups of 32
    /// values with one f16 scale: 8-bit is 32 + 2 = 34 bytes per group (8.5/8 B per element),
    /// 4-bit is 16 + 2 = 18 bytes (4.5/8 B). q6 is exllamav2's Q6 cache: 8-bit K and 4-bit V.
    /// A partial group costs a whole one.
    pub fn kv_bytes(self, n: u64) -> (u64, u64) {
        let groups = n.div_ceil(32);
        let q8 = groups.saturating_mul(34);
        let q4 = groups.saturating_mul(18);
        match self {
            CacheDType::F32 => (n.saturating_mul(4), n.saturating_mul(4)),
            CacheDType::Fp16 | CacheDType::Bf16 => (n.saturating_mul(2), n.saturating_mul(2)),
            CacheDType::Fp8 => (n, n),
            CacheDType::Q8 => (q8, q8),
            CacheDType::Q6 => (q8, q4),
            CacheDType::Q4 => (q4, q4),
        }
    }
}

/// Prefetch slots an offloaded cache keeps on each device that computes layers: the layer in
/// use and the next one being copied in on a second stream or thread (transformers'
/// `OffloadedCache` keeps the same pair on the GPU). The engine's offloaded cache allocates
/// exactly this many (`weightlift_engine::cache::SLOTS` is this constant).
pub const OFFLOAD_SLOTS: u64 = 2;

/// The KV cache to plan for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CacheSpec {
    pub max_seq_len: u64,
    pub batch_size: u64,
    pub dtype: CacheDType,
    /// An offloaded cache (transformers' `OffloadedCache`): every layer's K and V live in host
    /// RAM, charged to `cpu`, and each device that computes layers holds only its prefetch
    /// slots, [`CacheSpec::offload_slots_bytes`]. Off by default (each layer's KV beside the
    /// layer, as exllamav2 and llama.cpp allocate it). Left out of a plan's JSON when off.
    #[serde(default, skip_serializing_if = "is_false")]
    pub offload: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl CacheSpec {
    /// A cache beside the layers (not offloaded).
    pub const fn new(max_seq_len: u64, batch_size: u64, dtype: CacheDType) -> Self {
        CacheSpec {
            max_seq_len,
            batch_size,
            dtype,
            offload: false,
        }
    }

    /// The same cache, offloaded to host RAM or not.
    pub fn with_offload(self, offload: bool) -> Self {
        CacheSpec { offload, ..self }
    }

    /// Refuses an empty cache: a plan, and every cache the engine allocates, holds at least one
    /// token of one sequence.
    pub fn check(&self) -> Result<()> {
        if self.max_seq_len == 0 || self.batch_size == 0 {
            return Err(PlanError::option(
                "cache",
                "max_seq_len and batch_size of at least 1",
                format!(
                    "max_seq_len {}, batch_size {}",
                    self.max_seq_len, self.batch_size
                ),
            ));
        }
        Ok(())
    }

    /// Bytes of an offloaded cache's prefetch slots on a device that computes `n_layers` layers
    /// whose largest cache is `largest_layer` bytes: `min(n_layers, OFFLOAD_SLOTS) ×
    /// largest_layer` (a device computing a single layer needs one slot, as in the engine).
    pub fn offload_slots_bytes(n_layers: u64, largest_layer: u64) -> u64 {
        n_layers.min(OFFLOAD_SLOTS).saturating_mul(largest_layer)
    }

    /// Bytes of layer `layer`'s cache: `2 × n_kv_heads(layer) × head_dim × max_seq_len × batch`
    /// elements, half K and half V, at the cache dtype's exact size.
    pub fn layer_bytes(&self, spec: &ModelSpec, layer: usize) -> u64 {
        let heads = spec.n_kv_heads.get(layer).copied().unwrap_or(0);
        self.bytes_for_heads(spec, u64::from(heads))
    }

    /// Bytes of one layer's cache holding `heads` KV heads.
    pub fn bytes_for_heads(&self, spec: &ModelSpec, heads: u64) -> u64 {
        let n = heads
            .saturating_mul(u64::from(spec.head_dim))
            .saturating_mul(self.max_seq_len)
            .saturating_mul(self.batch_size);
        let (k, v) = self.dtype.kv_bytes(n);
        k.saturating_add(v)
    }

    /// Bytes of the whole cache.
    pub fn total_bytes(&self, spec: &ModelSpec) -> u64 {
        (0..spec.n_layers as usize).fold(0u64, |a, l| a.saturating_add(self.layer_bytes(spec, l)))
    }
}

/// Runtime limits that size the compute scratch, the forward pass's workspace
/// ([`Workspace`](crate::Workspace), defined in `workspace.rs`); named and defaulted as in
/// exllamav2's `ExLlamaV2Config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RuntimeSpec {
    /// Longest chunk of input ids in one forward pass (exllamav2 default 2048): the workspace
    /// holds `min(max_input_len, max_seq_len) × batch` tokens.
    pub max_input_len: u64,
    /// Largest attention-weights matrix, in elements per head (default 2048²): it bounds the
    /// workspace's attention tile.
    pub max_attention_size: u64,
    /// Most elements dequantised at once (default 512 Mi): it bounds the kernels' own tiles;
    /// the workspace reserves no dequantisation buffer, since weights are used in their stored
    /// type.
    pub max_dq_size: u64,
    /// exllamav2's `ExLlamaV2Config.set_low_mem()`, which sets `max_input_len = 1024` and
    /// `max_attention_size = 1024 ** 2`. From the defaults that halves `max_input_len`
    /// (2048 -> 1024) and halves the side of the attention square, so `max_attention_size` is
    /// QUARTERED (2048² -> 1024²), not halved. In the workspace that caps the tokens per
    /// chunk at `1024 × batch`, and with them every per-token region, and each head's attention
    /// tile at 1024² weights.
    ///
    /// One difference from exllamav2: it overwrites the two fields, so a smaller
    /// `max_input_len` given before `set_low_mem()` would be raised back to 1024; we take the
    /// minimum, so low_mem never increases scratch. See [`RuntimeSpec::effective`].
    pub low_mem: bool,
}

impl Default for RuntimeSpec {
    fn default() -> Self {
        RuntimeSpec {
            max_input_len: 2048,
            max_attention_size: 2048 * 2048,
            max_dq_size: 512 * 1024 * 1024,
            low_mem: false,
        }
    }
}

impl RuntimeSpec {
    /// No forward passes planned: zero scratch everywhere. This is accelerate's view (it counts
    /// weights only), used to reproduce its device maps exactly.
    pub const fn none() -> Self {
        RuntimeSpec {
            max_input_len: 0,
            max_attention_size: 0,
            max_dq_size: 0,
            low_mem: false,
        }
    }

    /// exllamav2's `set_low_mem()` values: `max_input_len` 1024.
    pub const LOW_MEM_INPUT_LEN: u64 = 1024;
    /// exllamav2's `set_low_mem()` values: `max_attention_size` 1024².
    pub const LOW_MEM_ATTENTION_SIZE: u64 = 1024 * 1024;

    /// `(max_input_len, max_attention_size)` after `low_mem`: with it, each is capped at
    /// exllamav2's `set_low_mem()` value (1024 and 1024²; from the defaults, max_input_len is
    /// halved and max_attention_size quartered, not halved).
    pub fn effective(&self) -> (u64, u64) {
        if self.low_mem {
            (
                self.max_input_len.min(Self::LOW_MEM_INPUT_LEN),
                self.max_attention_size.min(Self::LOW_MEM_ATTENTION_SIZE),
            )
        } else {
            (self.max_input_len, self.max_attention_size)
        }
    }
}

/// Per-device compute scratch: the forward pass's [`Workspace`](crate::Workspace), region by
/// region, for what the device computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScratchModel {
    dims: Dims,
    max_dq_size: u64,
}

impl ScratchModel {
    /// The workspace dimensions of `spec` with the tensor table `tensors`, routing to experts
    /// by `moe`, with a cache of `max_seq_len × batch`. A runtime with `max_input_len == 0`
    /// ([`RuntimeSpec::none`]) has no scratch at all.
    pub fn new(
        spec: &ModelSpec,
        tensors: &[TensorInfo],
        moe: Option<&MoeSpec>,
        runtime: &RuntimeSpec,
        max_seq_len: u64,
        batch: u64,
    ) -> Self {
        let dense = has_dense_layers(spec.n_layers, tensors);
        ScratchModel {
            dims: Dims::new(spec, runtime, max_seq_len, batch).with_experts(moe, dense),
            max_dq_size: runtime.max_dq_size,
        }
    }

    /// Scratch of a `kind` device that hosts what `hosts` says: its workspace (the engine
    /// allocates this), laid out without the host attention's tiles on a CUDA device
    /// ([`Workspace::for_kernel_attention`]).
    pub fn for_device(&self, hosts: Hosts, kind: DeviceKind) -> u64 {
        if kind == DeviceKind::Cuda {
            Workspace::for_kernel_attention(&self.dims, hosts).bytes
        } else {
            Workspace::new(&self.dims, hosts).bytes
        }
    }

    /// The prompt products' own tiles on a `kind` device ([`cuda_product_tiles`] on CUDA, 0
    /// elsewhere): charged as scratch, allocated by the kernels.
    pub fn cuda_tiles(&self, hosts: Hosts, kind: DeviceKind) -> u64 {
        if kind == DeviceKind::Cuda {
            cuda_product_tiles(&self.dims, self.max_dq_size, hosts)
        } else {
            0
        }
    }

    /// What computing `hosts` costs a `kind` device beside its weights and cache: the scratch
    /// and the tiles, for the placement's budgets.
    pub fn charged(&self, hosts: Hosts, kind: DeviceKind) -> u64 {
        self.for_device(hosts, kind)
            .saturating_add(self.cuda_tiles(hosts, kind))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        ModelSpec {
            architecture: "llama".into(),
            n_layers: 2,
            hidden_size: 4096,
            intermediate_size: 14336,
            n_heads: 32,
            n_kv_heads: vec![8, 4],
            head_dim: 128,
            vocab_size: 128256,
            context_length: 8192,
            rope_theta: 5e5,
            rope_dim: 128,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            attention_bias: false,
        }
    }

    #[test]
    fn kv_bytes_follow_the_design_table() {
        let s = spec();
        // layer 0: 8 heads × 128 × 4096 tokens × batch 1 = 4 Mi elements per K and per V.
        let n: u64 = 8 * 128 * 4096;
        let c = |d| CacheSpec::new(4096, 1, d).layer_bytes(&s, 0);
        assert_eq!(c(CacheDType::Fp16), 2 * n * 2);
        assert_eq!(c(CacheDType::Bf16), 2 * n * 2);
        assert_eq!(c(CacheDType::Fp8), 2 * n);
        assert_eq!(c(CacheDType::Q8), 2 * n * 17 / 16); // 8.5/8 B
        assert_eq!(c(CacheDType::Q6), n * 17 / 16 + n * 9 / 16); // 8.5/8 + 4.5/8
        assert_eq!(c(CacheDType::Q4), 2 * n * 9 / 16); // 4.5/8 B
        // per-layer head counts are respected
        assert_eq!(
            CacheSpec::new(4096, 1, CacheDType::Fp16).layer_bytes(&s, 1),
            n * 2
        );
        assert_eq!(
            CacheSpec::new(4096, 2, CacheDType::Fp16).total_bytes(&s),
            2 * (2 * n * 2 + n * 2)
        );
    }

    /// bf16 in the one grammar: both spellings, llama.cpp's `type_k`/`type_v`, and its name
    /// and serde form; the bound is round-to-nearest at 8 bits of precision.
    #[test]
    fn bf16_cache_parses_sizes_and_bounds() {
        for s in ["bf16", "BFloat16", " bfloat16 "] {
            assert_eq!(CacheDType::parse(s).unwrap(), CacheDType::Bf16, "{s}");
        }
        assert_eq!(
            CacheDType::from_llama_types("bf16", "bf16").unwrap(),
            Some(CacheDType::Bf16)
        );
        assert_eq!(CacheDType::from_llama_types("bf16", "f16").unwrap(), None);
        assert_eq!(CacheDType::Bf16.name(), "bf16");
        assert_eq!(
            serde_json::to_string(&CacheDType::Bf16).unwrap(),
            "\"bf16\""
        );
        assert_eq!(CacheDType::Bf16.kv_bytes(96), (192, 192));
        assert_eq!(
            CacheDType::Bf16.error_bound(false, 3.0, &[]),
            3.0 / 256.0 + 2f32.powi(-126) / 128.0
        );
        assert!(CacheDType::Bf16.error_bound(true, 0.0, &[]) > 0.0);
        let e = CacheDType::parse("bfloat8").unwrap_err().to_string();
        assert!(
            e.contains("bf16 (bfloat16)") && e.contains("'bfloat8'"),
            "{e}"
        );
    }

    #[test]
    fn low_mem_matches_exllamav2() {
        let r = RuntimeSpec {
            low_mem: true,
            ..RuntimeSpec::default()
        };
        // exllamav2 `set_low_mem()`: max_input_len = 1024, max_attention_size = 1024 ** 2.
        assert_eq!(r.effective(), (1024, 1024 * 1024));
        // Smaller values are kept (exllamav2 would overwrite them; low_mem never adds scratch).
        let small = RuntimeSpec {
            max_input_len: 256,
            max_attention_size: 256 * 256,
            ..r
        };
        assert_eq!(small.effective(), (256, 256 * 256));
        let off = RuntimeSpec::default();
        assert_eq!(off.effective(), (2048, 2048 * 2048));
    }
}
