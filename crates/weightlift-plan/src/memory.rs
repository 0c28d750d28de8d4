//! The exact memory model of the KV cache and of per-device scratch, in integers.

use serde::{Deserialize, Serialize};
use weightlift_format::ModelSpec;

use crate::error::{PlanError, Result};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheDType {
    #[default]
    Fp16,
    Fp8,
    Q8,
    Q6,
    Q4,
}

impl CacheDType {
    pub const ALL: &'static [CacheDType] = &[
        CacheDType::Fp16,
        CacheDType::Fp8,
        CacheDType::Q8,
        CacheDType::Q6,
        CacheDType::Q4,
    ];

    pub fn parse(s: &str) -> Result<CacheDType> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp16" | "f16" | "float16" => Ok(CacheDType::Fp16),
            "fp8" | "8bit" => Ok(CacheDType::Fp8),
            "q8" => Ok(CacheDType::Q8),
            "q6" => Ok(CacheDType::Q6),
            "q4" => Ok(CacheDType::Q4),
            _ => Err(PlanError::option(
                "cache dtype",
                "fp16, fp8, q8, q6 or q4",
                format!("'{s}'"),
            )),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            CacheDType::Fp16 => "fp16",
            CacheDType::Fp8 => "fp8",
            CacheDType::Q8 => "q8",
            CacheDType::Q6 => "q6",
            CacheDType::Q4 => "q4",
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
            CacheDType::Fp16 => (n.saturating_mul(2), n.saturating_mul(2)),
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
    pub fn new(max_seq_len: u64, batch_size: u64, dtype: CacheDType) -> Self {
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

/// Runtime limits that decide scratch sizes, named and defaulted as in exllamav2's
/// `ExLlamaV2Config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RuntimeSpec {
    /// Longest chunk of input ids in one forward pass (exllamav2 default 2048).
    pub max_input_len: u64,
    /// Largest attention-weights matrix, in elements per head (default 2048²).
    pub max_attention_size: u64,
    /// Most elements dequantised at once (default 512 Mi).
    pub max_dq_size: u64,
    /// exllamav2's `ExLlamaV2Config.set_low_mem()`, which sets `max_input_len = 1024` and
    /// `max_attention_size = 1024 ** 2`. From the defaults that halves `max_input_len`
    /// (2048 -> 1024) and halves the side of the attention square, so `max_attention_size` is
    /// QUARTERED (2048² -> 1024²), not halved.
    ///
    /// This deliberately differs from DESIGN.md, which says low_mem "halves the first two":
    /// we follow exllamav2, since these scratch formulas are exllamav2's. One difference from
    /// exllamav2 itself: it overwrites the two fields, so a smaller `max_input_len` given
    /// before `set_low_mem()` would be raised back to 1024; we take the minimum, so low_mem
    /// never increases scratch. See [`RuntimeSpec::effective`].
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
    /// halved and max_attention_size quartered, not halved as DESIGN.md says).
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

/// What a device computes, which decides its scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Hosts {
    pub layers: bool,
    pub head: bool,
    pub embed: bool,
}

/// Scratch components for one device, each from exllamav2's module code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ScratchModel {
    /// `max(module.scratch_space_fixed())` over attention, MLP and head (exllamav2 allocates
    /// this once per device in `load_autosplit_gen` as `ExLlamaV2DeviceContext`).
    pub fixed: u64,
    /// RoPE sin/cos tables: `head_dim × max_seq_len` halves, twice (`constant_size` in
    /// `ExLlamaV2.set_device_map`).
    pub sincos: u64,
    /// Attention weights, `ExLlamaV2Attention.temp_attn_size()` without flash-attn:
    /// `2 × min(max_attention_size, max_seq_len²) × n_heads × 2 + 128`. With flash-attn
    /// exllamav2 divides by a fudge factor; we keep the larger, safe figure.
    pub attn: u64,
    /// Logits of the head: `max_input_len × batch × vocab × 4` (f32). exllamav2 does not count
    /// them (its autosplit catches the OOM instead); they are real memory, so we do.
    pub logits: u64,
    /// The embedding output, `max_input_len × batch × hidden × 2`, for a device that holds
    /// only the embedding.
    pub embed_state: u64,
}

impl ScratchModel {
    /// Derive the components from the spec, cache length and runtime. `L` below is
    /// `min(max_input_len, max_seq_len)` (`load_autosplit_gen` clamps it the same way), `B` the
    /// batch, `dq(n) = 2 × min(n, max_dq_size)` (`ExLlamaV2Linear.temp_dq_size`):
    ///
    /// - attention fixed: `L·B·max(heads·head_dim, hidden)·2 + 128` (state) + `dq` of the
    ///   largest of q/k/v/o;
    /// - MLP fixed: `L·B·hidden·2 + 128` (state) + 2 × (`L·B·max(hidden, inter)·2 + 128`)
    ///   (temp a and b) + `dq(hidden·inter)`;
    /// - head fixed: `dq(hidden·vocab)`.
    ///
    /// A runtime with `max_input_len == 0` ([`RuntimeSpec::none`]) has no scratch at all.
    pub fn new(spec: &ModelSpec, runtime: &RuntimeSpec, max_seq_len: u64, batch: u64) -> Self {
        let (max_input, max_attn) = runtime.effective();
        if max_input == 0 {
            return ScratchModel::default();
        }
        let l = max_input.min(max_seq_len).max(1);
        let b = batch.max(1);
        let lb = l.saturating_mul(b);
        let h = spec.hidden_size;
        let i = spec.intermediate_size;
        let q = u64::from(spec.n_heads) * u64::from(spec.head_dim);
        let kv = u64::from(spec.n_kv_heads.iter().copied().max().unwrap_or(0))
            * u64::from(spec.head_dim);
        let dq = |n: u64| 2u64.saturating_mul(n.min(runtime.max_dq_size));
        let attn_fixed = lb
            .saturating_mul(q.max(h))
            .saturating_mul(2)
            .saturating_add(128)
            .saturating_add(dq(h.saturating_mul(q).max(h.saturating_mul(kv))));
        let temp = lb
            .saturating_mul(h.max(i))
            .saturating_mul(2)
            .saturating_add(128);
        let mlp_fixed = lb
            .saturating_mul(h)
            .saturating_mul(2)
            .saturating_add(128)
            .saturating_add(temp.saturating_mul(2))
            .saturating_add(dq(h.saturating_mul(i)));
        let head_fixed = dq(h.saturating_mul(spec.vocab_size));
        let att = max_attn.min(max_seq_len.saturating_mul(max_seq_len));
        ScratchModel {
            fixed: attn_fixed.max(mlp_fixed).max(head_fixed),
            sincos: u64::from(spec.head_dim)
                .saturating_mul(max_seq_len)
                .saturating_mul(4),
            attn: att
                .saturating_mul(u64::from(spec.n_heads))
                .saturating_mul(4)
                .saturating_add(128),
            logits: lb.saturating_mul(spec.vocab_size).saturating_mul(4),
            embed_state: lb.saturating_mul(h).saturating_mul(2),
        }
    }

    /// Scratch of a device that hosts what `hosts` says.
    pub fn for_hosts(&self, hosts: Hosts) -> u64 {
        let mut s = 0u64;
        if hosts.layers || hosts.head {
            s = self.fixed.saturating_add(self.sincos);
        }
        if hosts.layers {
            s = s.saturating_add(self.attn);
        }
        if hosts.head {
            s = s.saturating_add(self.logits);
        }
        if hosts.embed && !hosts.layers && !hosts.head {
            s = s.saturating_add(self.embed_state);
        }
        s
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

    #[test]
    fn scratch_formula() {
        let s = spec();
        let m = ScratchModel::new(&s, &RuntimeSpec::default(), 8192, 1);
        // MLP: 2048·4096·2+128 + 2·(2048·14336·2+128) + 2·min(4096·14336, 512Mi)
        let mlp = 2048 * 4096 * 2 + 128 + 2 * (2048 * 14336 * 2 + 128) + 2 * 4096 * 14336;
        // head: 2·min(4096·128256, 512Mi) = 2·4096·128256 (just under 512Mi)
        let head: u64 = 2 * 4096 * 128256;
        assert_eq!(m.fixed, (mlp as u64).max(head));
        assert_eq!(m.attn, 2048 * 2048 * 32 * 4 + 128);
        assert_eq!(m.sincos, 128 * 8192 * 4);
    }
}
