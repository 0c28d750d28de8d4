//! The forward pass's working memory on one device, region by region: the one definition that
//! both the planner (to charge scratch) and the engine (to carve its buffers out of that
//! scratch) use, so the plan's scratch column is exactly what a forward pass holds.
//!
//! With `T = min(max_input_len, max_seq_len) × batch` tokens per chunk, `h` the hidden size,
//! `qd = n_heads × head_dim`, `kvd = max(n_kv_heads) × head_dim` (for a model with experts, at
//! least `h` and the experts a token uses), `i` the widest MLP the model runs
//! ([`Dims::with_experts`]) and `V` the vocabulary, all in f32 unless noted, each region rounded
//! up to [`ALIGN`] bytes:
//!
//! | region | values | held by a device that computes |
//! |---|---|---|
//! | `x` (the residual stream) | `T·h` | anything |
//! | `xn` (normed input, projection output) | `T·h` | layers or the head |
//! | `q`, `att` (queries; attention output) | `T·qd` each | layers |
//! | `k`, `v` (this chunk's keys and values) | `T·kvd` each | layers |
//! | `gate`, `up` (MLP) | `T·i` each | layers |
//! | `kt`, `vt` (a tile of cached keys and values, decoded) | `Tk·kvd` each | layers |
//! | `scores` (attention weights of one tile, every head) | `n_heads·Tq·Tk` | layers |
//! | `stats` (running max and sum of the online softmax) | `2·T·n_heads` | layers |
//! | `parts` (an accelerator's attention split into `S` key ranges: max, sum and `head_dim` accumulators per head and range) | `n_heads·S·(head_dim + 2)` | layers |
//! | `pos` (positions, i32) and `freqs` (RoPE inverse frequencies) | `T` and `head_dim/2` | layers |
//! | `logits` | `R·V` | the head |
//!
//! A CUDA device's layout ([`Workspace::for_kernel_attention`]) has no `kt`, `vt`, `scores` or
//! `stats`: its attention kernels hold their tiles and running softmax on the chip.
//!
//! `Tk = min(KV_TILE, max_seq_len, max_attention_size)` keys per tile, and
//! `Tq = min(T, max(1, max_attention_size / Tk))` queries per tile, so no head ever holds more
//! than `max_attention_size` attention weights. `R = min(LOGIT_ROWS, T)`: logits for more rows
//! (`logits="all"`) are produced `R` rows at a time straight into the caller's array.
//! `S = min(ATTENTION_SPLITS, ceil(max_seq_len / ATTENTION_SPLIT_KEYS))`: the CUDA attention
//! kernel splits a decode step's keys across thread blocks so that every SM has work, never into
//! ranges under `ATTENTION_SPLIT_KEYS` keys, and a call of `n` queries into at most `S / n`
//! ranges, so its partial results fit here.
//!
//! Weights are used in their stored type (the CPU kernels dequantise in registers), so no
//! dequantisation buffer is reserved; `max_dq_size` bounds the kernels' own tiles. A CUDA
//! device's prompt products allocate such tiles of their own (a dequantised chunk, the
//! activations re-encoded), which the plan charges in the scratch column beside the workspace
//! ([`cuda_product_tiles`], `DeviceUsage::kernel_scratch`); the engine does not allocate them.

use std::collections::BTreeSet;

use weightlift_format::{ModelSpec, MoeSpec, Role, TensorInfo};

use crate::memory::RuntimeSpec;

/// Alignment of every region, in bytes.
pub const ALIGN: u64 = 64;
/// Cached keys decoded per attention tile.
pub const KV_TILE: u64 = 256;
/// Rows of logits computed at once.
pub const LOGIT_ROWS: u64 = 32;
/// The most key ranges an accelerator's attention call is split into, over all its queries
/// (weightlift-kernels' `ATTENTION_MAX_SPLITS`; the engine tests that they are equal).
pub const ATTENTION_SPLITS: u64 = 128;
/// The fewest keys in one range of a split attention call (weightlift-kernels'
/// `ATTENTION_MIN_SPLIT_KEYS`): a cache of `n` positions is split at most `ceil(n / this)` ways.
pub const ATTENTION_SPLIT_KEYS: u64 = 16;

/// The most values one dequantised weight chunk of a CUDA prompt product holds, whatever
/// `max_dq_size` allows (weightlift-kernels' `DQ_CHUNK_CAP`; the engine tests that they are
/// equal).
pub const DQ_CHUNK_VALUES: u64 = 16 << 20;

/// Device memory a CUDA device's prompt products allocate beside the workspace, per product
/// and freed after it (so the largest one counts), which the plan charges as scratch the
/// kernels allocate themselves (`DeviceUsage::kernel_scratch`; the engine's buffer holds the
/// rest of the scratch column): the dequantised chunk of weight rows of the
/// exact path, `min(max_dq_size, DQ_CHUNK_VALUES, the largest matrix)` f32 values (fast mode's
/// f16 chunk is half of it), plus the activations as the products re-encode them, `T` tokens of
/// the widest input at 2 bytes a value (fast mode's f16/bf16 copy for cuBLAS; the Q8 blocks of
/// the quantised kernels take 1.25). 0 for a device that computes no layers and no head.
/// The cuBLAS workspace is not here: it is part of the device's overhead (`overhead.rs`).
pub fn cuda_product_tiles(d: &Dims, max_dq_size: u64, hosts: Hosts) -> u64 {
    if d.tokens == 0 || !(hosts.layers || hosts.head) {
        return 0;
    }
    let mut widest_out = 0u64;
    let mut widest_in = 0u64;
    if hosts.layers {
        widest_out = widest_out.max(d.q_dim).max(d.kv_dim).max(d.inter);
        widest_in = widest_in.max(d.hidden).max(d.q_dim).max(d.inter);
    }
    if hosts.head {
        widest_out = widest_out.max(d.vocab);
        widest_in = widest_in.max(d.hidden);
    }
    // the largest matrix: the down projection (hidden × inter) or one of hidden columns
    let largest = widest_out
        .max(d.hidden)
        .saturating_mul(d.hidden)
        .max(d.hidden.saturating_mul(d.inter));
    let chunk = max_dq_size.min(DQ_CHUNK_VALUES).min(largest);
    let round = |b: u64| b.div_ceil(ALIGN).saturating_mul(ALIGN);
    round(chunk.saturating_mul(4))
        .saturating_add(round(d.tokens.saturating_mul(widest_in).saturating_mul(2)))
}

/// What a device computes, which decides the regions it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hosts {
    /// Decoder layers.
    pub layers: bool,
    /// The output norm and head.
    pub head: bool,
    /// The token embedding lookup.
    pub embed: bool,
}

impl Hosts {
    /// Whether the device computes anything.
    pub fn any(self) -> bool {
        self.layers || self.head || self.embed
    }
}

/// Sizes that decide the workspace, from the spec, the cache and the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Tokens per chunk, `T`.
    pub tokens: u64,
    pub hidden: u64,
    pub q_dim: u64,
    pub kv_dim: u64,
    /// Values per token of the MLP's gate and up regions ([`Dims::with_experts`]).
    pub inter: u64,
    pub vocab: u64,
    pub n_heads: u64,
    pub head_dim: u64,
    /// Keys per attention tile, `Tk`.
    pub kv_tile: u64,
    /// Queries per attention tile, `Tq`.
    pub q_tile: u64,
    /// Rows of logits at once, `R`.
    pub logit_rows: u64,
    /// Key ranges of a split attention call, `S`.
    pub att_splits: u64,
}

impl Dims {
    /// The dimensions for `spec` with a cache of `max_seq_len × batch` and `runtime`. A runtime
    /// with `max_input_len == 0` ([`RuntimeSpec::none`]) plans no forward pass: `tokens` is 0.
    pub fn new(spec: &ModelSpec, runtime: &RuntimeSpec, max_seq_len: u64, batch: u64) -> Dims {
        let (max_input, max_attn) = runtime.effective();
        let seq = max_seq_len.max(1);
        let tokens = if max_input == 0 {
            0
        } else {
            max_input.min(seq).saturating_mul(batch.max(1))
        };
        let head_dim = u64::from(spec.head_dim);
        let kv_heads = u64::from(spec.n_kv_heads.iter().copied().max().unwrap_or(0));
        let kv_tile = KV_TILE.min(seq).min(max_attn.max(1));
        Dims {
            tokens,
            hidden: spec.hidden_size,
            q_dim: u64::from(spec.n_heads).saturating_mul(head_dim),
            kv_dim: kv_heads.saturating_mul(head_dim),
            inter: spec.intermediate_size,
            vocab: spec.vocab_size,
            n_heads: u64::from(spec.n_heads),
            head_dim,
            kv_tile,
            q_tile: tokens.min((max_attn / kv_tile).max(1)),
            logit_rows: LOGIT_ROWS.min(tokens),
            att_splits: seq.div_ceil(ATTENTION_SPLIT_KEYS).min(ATTENTION_SPLITS),
        }
    }

    /// The dimensions of a model whose layers route to experts by `moe` (`None`: a dense
    /// model, unchanged): the MLP regions hold the widest MLP it runs. Every token of a chunk
    /// may route to one expert, so an expert's gate and up products take `T × expert_ffn`
    /// values, and the router's scores, `n_experts` per token, are held in an MLP region too.
    /// The dense width counts only when `dense_layers` ([`has_dense_layers`]): a model with
    /// dense layers beside its expert ones runs both, and one whose every layer routes runs
    /// none (Qwen3-30B-A3B's `intermediate_size` 6144 beside experts 768 wide).
    ///
    /// A device computing its experts holds hidden-wide rows in the attention's regions
    /// between attention calls (an expert's gathered input rows in `q`, the block's sums in
    /// `att`) and each token's chosen experts and weights in `k` and `v`: those regions are
    /// at least `T × hidden` and `T × n_used` values, for a model whose queries are narrower
    /// than its hidden state too.
    pub fn with_experts(mut self, moe: Option<&MoeSpec>, dense_layers: bool) -> Dims {
        if let Some(m) = moe {
            let dense = if dense_layers { self.inter } else { 0 };
            self.inter = dense.max(m.expert_ffn).max(u64::from(m.n_experts));
            self.q_dim = self.q_dim.max(self.hidden);
            self.kv_dim = self.kv_dim.max(u64::from(m.n_used));
        }
        self
    }
}

/// Whether a model of `n_layers` layers with the tensor table `tensors` has a layer with a
/// dense MLP: one without a router (`ffn_gate_inp`, transformers' `mlp.gate`), as the engine
/// builds a layer's MLP. The plan and the engine both size the MLP regions by this
/// ([`Dims::with_experts`]).
pub fn has_dense_layers(n_layers: u32, tensors: &[TensorInfo]) -> bool {
    let routed: BTreeSet<u32> = tensors
        .iter()
        .filter(|t| t.role == Some(Role::FfnGateInp))
        .filter_map(|t| t.layer)
        .collect();
    // stops at the first layer without a router: never more steps than the table has routers
    (0..n_layers).any(|l| !routed.contains(&l))
}

/// A named region: byte offset and length in values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Region {
    pub offset: u64,
    pub len: u64,
}

/// The regions of one device's workspace, laid out in order; absent regions have length 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Workspace {
    pub x: Region,
    pub xn: Region,
    pub q: Region,
    pub att: Region,
    pub k: Region,
    pub v: Region,
    pub gate: Region,
    pub up: Region,
    pub kt: Region,
    pub vt: Region,
    pub scores: Region,
    pub stats: Region,
    pub parts: Region,
    pub pos: Region,
    pub freqs: Region,
    pub logits: Region,
    /// Total bytes.
    pub bytes: u64,
}

impl Workspace {
    /// The layout for a device that computes `hosts`. Every value is 4 bytes (f32 or i32).
    pub fn new(d: &Dims, hosts: Hosts) -> Workspace {
        Workspace::layout(d, hosts, true)
    }

    /// The layout for a device whose attention is one kernel over the cache (CUDA: the split
    /// decode kernel and the prompt kernel keep their tiles, scores and running softmax in
    /// registers and shared memory): [`Workspace::new`] without `kt`, `vt`, `scores` and
    /// `stats`, which only the host's tiled attention uses.
    pub fn for_kernel_attention(d: &Dims, hosts: Hosts) -> Workspace {
        Workspace::layout(d, hosts, false)
    }

    fn layout(d: &Dims, hosts: Hosts, host_attention: bool) -> Workspace {
        let mut w = Workspace::default();
        if d.tokens == 0 || !hosts.any() {
            return w;
        }
        let t = d.tokens;
        let mut at = 0u64;
        let mut take = |len: u64| {
            let r = Region { offset: at, len };
            let bytes = len.saturating_mul(4);
            at = at.saturating_add(bytes.div_ceil(ALIGN).saturating_mul(ALIGN));
            r
        };
        w.x = take(t.saturating_mul(d.hidden));
        if hosts.layers || hosts.head {
            w.xn = take(t.saturating_mul(d.hidden));
        }
        if hosts.layers {
            w.q = take(t.saturating_mul(d.q_dim));
            w.att = take(t.saturating_mul(d.q_dim));
            w.k = take(t.saturating_mul(d.kv_dim));
            w.v = take(t.saturating_mul(d.kv_dim));
            w.gate = take(t.saturating_mul(d.inter));
            w.up = take(t.saturating_mul(d.inter));
            if host_attention {
                w.kt = take(d.kv_tile.saturating_mul(d.kv_dim));
                w.vt = take(d.kv_tile.saturating_mul(d.kv_dim));
                w.scores = take(d.n_heads.saturating_mul(d.q_tile).saturating_mul(d.kv_tile));
                w.stats = take(2u64.saturating_mul(t).saturating_mul(d.n_heads));
            }
            w.parts = take(
                d.n_heads
                    .saturating_mul(d.att_splits)
                    .saturating_mul(d.head_dim.saturating_add(2)),
            );
            w.pos = take(t);
            w.freqs = take(d.head_dim / 2);
        }
        if hosts.head {
            w.logits = take(d.logit_rows.saturating_mul(d.vocab));
        }
        w.bytes = at;
        w
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// SmolLM2-135M's shape (its GGUF's metadata), for the crate's unit tests.
    pub(crate) fn spec() -> ModelSpec {
        ModelSpec {
            architecture: "llama".into(),
            n_layers: 30,
            hidden_size: 576,
            intermediate_size: 1536,
            n_heads: 9,
            n_kv_heads: vec![3; 30],
            head_dim: 64,
            vocab_size: 49152,
            context_length: 8192,
            rope_theta: 1e5,
            rope_dim: 64,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            attention_bias: false,
        }
    }

    /// The MLP regions hold the widest MLP the model runs: an expert's width for every token of
    /// the chunk, or the router's scores (one per expert and token), whichever is widest, and
    /// the dense width too when a layer runs a dense MLP; a dense width under the experts' or 0
    /// never shrinks them.
    #[test]
    fn mlp_regions_hold_the_experts_and_the_router_scores() {
        let rt = RuntimeSpec {
            max_input_len: 64,
            ..RuntimeSpec::default()
        };
        let moe = |n_experts, expert_ffn| MoeSpec {
            n_experts,
            n_used: 2,
            expert_ffn,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        };
        let mlp = |dense: u64, m: Option<MoeSpec>, dense_layers: bool| {
            let s = ModelSpec {
                intermediate_size: dense,
                ..spec()
            };
            let d = Dims::new(&s, &rt, 8192, 1).with_experts(m.as_ref(), dense_layers);
            let w = Workspace::new(
                &d,
                Hosts {
                    layers: true,
                    ..Hosts::default()
                },
            );
            (d.inter, w.gate.len, w.up.len)
        };
        for dense_layers in [true, false] {
            // a dense model is unchanged
            assert_eq!(mlp(1536, None, dense_layers), (1536, 64 * 1536, 64 * 1536));
            assert_eq!(mlp(0, None, dense_layers).0, 0);
            for dense in [64, 0] {
                assert_eq!(
                    mlp(dense, Some(moe(4, 256)), dense_layers),
                    (256, 64 * 256, 64 * 256)
                );
                assert_eq!(
                    mlp(dense, Some(moe(512, 256)), dense_layers),
                    (512, 64 * 512, 64 * 512)
                );
            }
        }
        // Qwen3-30B-A3B: every layer routes, so its dense width 6144 runs nowhere and only the
        // experts' 768 count; beside a dense layer, the dense width stays
        assert_eq!(
            mlp(6144, Some(moe(128, 768)), false),
            (768, 64 * 768, 64 * 768)
        );
        assert_eq!(mlp(6144, Some(moe(128, 768)), true).0, 6144);
    }

    /// A device computing its experts keeps hidden-wide rows in the query and attention output
    /// regions and each token's chosen experts in the key and value regions: with queries
    /// narrower than the hidden state (4 heads of 8 under 64) and one kv head of 8 under 10
    /// experts a token, those regions widen for a model with experts, and stay as they are for
    /// a dense one.
    #[test]
    fn attention_regions_hold_the_expert_blocks_rows() {
        let rt = RuntimeSpec {
            max_input_len: 16,
            ..RuntimeSpec::default()
        };
        let s = ModelSpec {
            hidden_size: 64,
            n_heads: 4,
            n_kv_heads: vec![1; 30],
            head_dim: 8,
            ..spec()
        };
        let moe = MoeSpec {
            n_experts: 16,
            n_used: 10,
            expert_ffn: 32,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        };
        let d = Dims::new(&s, &rt, 8192, 1);
        assert_eq!((d.q_dim, d.kv_dim), (32, 8));
        assert_eq!(d.with_experts(None, true), d);
        let e = d.with_experts(Some(&moe), false);
        assert_eq!((e.q_dim, e.kv_dim, e.inter), (64, 10, 32));
        let w = Workspace::new(
            &e,
            Hosts {
                layers: true,
                ..Hosts::default()
            },
        );
        assert_eq!(
            (w.q.len, w.att.len, w.k.len, w.v.len),
            (16 * 64, 16 * 64, 16 * 10, 16 * 10)
        );
    }

    /// A layer runs a dense MLP when it has no router, whatever else it holds.
    #[test]
    fn dense_layers_are_the_ones_without_a_router() {
        let t = |name: &str, layer: Option<u32>, role: Role| TensorInfo {
            name: name.into(),
            dtype: weightlift_format::DType::F32,
            shape: vec![4, 8],
            nbytes: 128,
            file: 0,
            offset: 0,
            layer,
            role: Some(role),
        };
        let router = |l: u32| {
            t(
                &format!("blk.{l}.ffn_gate_inp.weight"),
                Some(l),
                Role::FfnGateInp,
            )
        };
        let dense = t("blk.1.ffn_gate.weight", Some(1), Role::FfnGate);
        let embed = t("token_embd.weight", None, Role::TokenEmbd);
        assert!(!has_dense_layers(2, &[embed.clone(), router(0), router(1)]));
        assert!(has_dense_layers(2, &[embed.clone(), router(0), dense]));
        assert!(has_dense_layers(2, &[router(1)]));
        // a router of a layer past the last decides nothing
        assert!(has_dense_layers(1, &[router(1)]));
        assert!(!has_dense_layers(0, &[embed]));
    }

    #[test]
    fn regions_follow_the_table() {
        let rt = RuntimeSpec {
            max_input_len: 512,
            ..RuntimeSpec::default()
        };
        let d = Dims::new(&spec(), &rt, 8192, 1);
        assert_eq!(
            (d.tokens, d.kv_tile, d.q_tile, d.logit_rows, d.att_splits),
            (512, 256, 512, 32, 128)
        );
        let all = Hosts {
            layers: true,
            head: true,
            embed: true,
        };
        let w = Workspace::new(&d, all);
        let values = 2 * 512 * 576
            + 2 * 512 * 576
            + 2 * 512 * 192
            + 2 * 512 * 1536
            + 2 * 256 * 192
            + 9 * 512 * 256
            + 2 * 512 * 9
            + 9 * 128 * 66
            + 512
            + 32
            + 32 * 49152;
        // every region here is a whole number of 64-byte lines
        assert_eq!(w.bytes, values * 4);
        assert_eq!(w.logits.offset + w.logits.len * 4, w.bytes);
        // an embedding-only device holds the residual stream alone
        let e = Workspace::new(
            &d,
            Hosts {
                embed: true,
                ..Hosts::default()
            },
        );
        assert_eq!(e.bytes, 512 * 576 * 4);
        assert_eq!(Workspace::new(&d, Hosts::default()).bytes, 0);
    }

    /// A CUDA device's prompt tiles: the largest dequantised chunk (capped by `max_dq_size`
    /// and [`DQ_CHUNK_VALUES`]) in f32 and the widest input of `T` tokens in 2 bytes, charged
    /// on top of the workspace on cuda devices only.
    #[test]
    fn cuda_devices_are_charged_their_prompt_tiles() {
        use crate::device::DeviceKind;
        use crate::memory::ScratchModel;
        let rt = RuntimeSpec {
            max_input_len: 512,
            ..RuntimeSpec::default()
        };
        let d = Dims::new(&spec(), &rt, 8192, 1);
        let layers = Hosts {
            layers: true,
            ..Hosts::default()
        };
        let all = Hosts {
            layers: true,
            head: true,
            embed: true,
        };
        // layers: the 1536 × 576 gate/up/down matrices in one f32 chunk, 512 tokens of the
        // 1536-wide down projection's input in f16
        let acts = 512 * 1536 * 2;
        assert_eq!(
            cuda_product_tiles(&d, rt.max_dq_size, layers),
            1536 * 576 * 4 + acts
        );
        // the head's 49152 × 576 matrix is chunked at DQ_CHUNK_VALUES
        assert_eq!(
            cuda_product_tiles(&d, rt.max_dq_size, all),
            DQ_CHUNK_VALUES * 4 + acts
        );
        // max_dq_size bounds the chunk; nothing for an embedding-only device or no tokens
        assert_eq!(cuda_product_tiles(&d, 1 << 20, all), (4 << 20) + acts);
        let embed = Hosts {
            embed: true,
            ..Hosts::default()
        };
        assert_eq!(cuda_product_tiles(&d, rt.max_dq_size, embed), 0);
        let none = Dims::new(&spec(), &RuntimeSpec::none(), 8192, 1);
        assert_eq!(cuda_product_tiles(&none, 1 << 20, all), 0);
        // the scratch model: cuda devices hold the kernel-attention layout, and are charged
        // the tiles besides
        let m = ScratchModel::new(&spec(), &[], None, &rt, 8192, 1);
        let ws = Workspace::new(&d, all).bytes;
        let kernel = Workspace::for_kernel_attention(&d, all).bytes;
        for kind in [DeviceKind::Virtual, DeviceKind::Cpu] {
            assert_eq!(m.for_device(all, kind), ws);
            assert_eq!(m.charged(all, kind), ws);
            assert_eq!(m.cuda_tiles(all, kind), 0);
        }
        assert_eq!(m.for_device(all, DeviceKind::Cuda), kernel);
        assert_eq!(
            m.cuda_tiles(all, DeviceKind::Cuda),
            DQ_CHUNK_VALUES * 4 + acts
        );
        assert_eq!(
            m.charged(all, DeviceKind::Cuda),
            kernel + DQ_CHUNK_VALUES * 4 + acts
        );
    }

    /// A CUDA device's layout drops the host attention's regions (decoded K/V tiles, one
    /// tile's scores, the softmax stats) and keeps every other region the same size.
    #[test]
    fn kernel_attention_layouts_hold_no_host_attention_tiles() {
        let rt = RuntimeSpec {
            max_input_len: 512,
            ..RuntimeSpec::default()
        };
        let d = Dims::new(&spec(), &rt, 8192, 1);
        let all = Hosts {
            layers: true,
            head: true,
            embed: true,
        };
        let (w, k) = (
            Workspace::new(&d, all),
            Workspace::for_kernel_attention(&d, all),
        );
        for r in [k.kt, k.vt, k.scores, k.stats] {
            assert_eq!(r.len, 0);
        }
        for (a, b) in [
            (w.x, k.x),
            (w.xn, k.xn),
            (w.q, k.q),
            (w.att, k.att),
            (w.k, k.k),
            (w.v, k.v),
            (w.gate, k.gate),
            (w.up, k.up),
            (w.parts, k.parts),
            (w.pos, k.pos),
            (w.freqs, k.freqs),
            (w.logits, k.logits),
        ] {
            assert_eq!(a.len, b.len);
        }
        // SmolLM2 at 512 tokens: 2 × 256 × 192 decoded keys and values, 9 × 512 × 256 scores
        // and 2 × 512 × 9 stats, 4 bytes each
        let host = 2 * 256 * 192 + 9 * 512 * 256 + 2 * 512 * 9;
        assert_eq!(w.bytes - k.bytes, host * 4);
        assert_eq!(k.logits.offset + k.logits.len * 4, k.bytes);
    }

    #[test]
    fn attention_tiles_respect_max_attention_size() {
        let rt = RuntimeSpec {
            max_input_len: 2048,
            max_attention_size: 1000,
            ..RuntimeSpec::default()
        };
        let d = Dims::new(&spec(), &rt, 8192, 1);
        assert!(d.q_tile * d.kv_tile <= 1000);
        assert_eq!((d.kv_tile, d.q_tile), (256, 3));
        let tiny = RuntimeSpec {
            max_attention_size: 100,
            ..rt
        };
        let d = Dims::new(&spec(), &tiny, 8192, 1);
        assert_eq!((d.kv_tile, d.q_tile), (100, 1));
    }

    #[test]
    fn no_forward_pass_no_workspace() {
        let d = Dims::new(&spec(), &RuntimeSpec::none(), 8192, 1);
        let all = Hosts {
            layers: true,
            head: true,
            embed: true,
        };
        assert_eq!(Workspace::new(&d, all).bytes, 0);
    }
}

#[cfg(test)]
mod split_tests {
    use super::tests::spec;
    use super::*;

    #[test]
    fn attention_splits_follow_the_cache_length() {
        let rt = RuntimeSpec {
            max_input_len: 16,
            ..RuntimeSpec::default()
        };
        let layers = Hosts {
            layers: true,
            ..Hosts::default()
        };
        // 9 heads of 64: one range of 66 values per head and split
        for (seq, splits) in [
            (1, 1),
            (16, 1),
            (17, 2),
            (2048, 128),
            (4096, 128),
            (1 << 20, 128),
        ] {
            let d = Dims::new(&spec(), &rt, seq, 1);
            assert_eq!(d.att_splits, splits, "max_seq_len {seq}");
            assert_eq!(Workspace::new(&d, layers).parts.len, 9 * splits * 66);
        }
        // a device without layers holds none
        let d = Dims::new(&spec(), &rt, 2048, 1);
        let head = Hosts {
            head: true,
            ..Hosts::default()
        };
        assert_eq!(Workspace::new(&d, head).parts.len, 0);
    }
}
