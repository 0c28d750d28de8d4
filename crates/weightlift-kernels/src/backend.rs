//! One interface for every device: allocate, copy, run an [`Op`], synchronise.
//!
//! [`CpuBackend`](crate::CpuBackend) is the reference; [`CudaBackend`](crate::CudaBackend) runs
//! the same operations from `kernels/*.cu`. Operations read and write whole buffers from offset
//! 0; element counts say how much of each buffer is used, and each backend checks that every
//! buffer is large enough before it touches it. A part of a buffer (a region of a workspace, the
//! cache rows at a position) is a buffer of its own through [`Backend::view`] and
//! [`Backend::split`]: no copy, and nothing freed when the part is dropped.
//!
//! Copies: host to device and back, a range within a device ([`Backend::copy`]), strided rows
//! within a device ([`Backend::copy_2d`]: a block of columns of a row-major matrix packed or
//! unpacked in one call) and a range to another device of the same kind
//! ([`Backend::copy_peer`], device to device where [`Backend::peer_access`]).
//!
//! The operations cover one llama-family decoder layer: RMSNorm, the projections
//! ([`Op::Matmul`], or [`Op::Int8Matmul`] for LLM.int8 weights; a bias by [`Op::AddBias`]),
//! RoPE on a table of frequencies ([`Op::RopeInPlace`]), the cache rows in any of the cache's
//! storage formats ([`Op::KvStore`] into a view; both at once, [`Op::RopeKvStore`]), causal
//! grouped-query [`Op::Attention`] over
//! the cache,
//! the residual adds ([`Op::AddInPlace`]) and the gated MLP ([`Op::SwiGluInPlace`], or with the
//! gate and up products in one op, [`Op::MatmulSwiGlu`]; gemma's
//! [`Op::GeGluTanhInPlace`], with its embedding scale [`Op::ScaleInPlace`] and the attention's
//! sliding window and soft-cap). A mixture-of-experts block gathers the rows routed to an
//! expert ([`Op::GatherRows`]) and adds its weighted output rows back ([`Op::ScatterAddRows`]).

use std::collections::BTreeMap;

use crate::cpu::kv_format::KvFormat;
use crate::cpu::matvec::MatvecMode;
use crate::cpu::ops::RopeParams;
use crate::error::{KernelError, Result};
use crate::types::{FloatType, QuantType};

/// An operation on buffers of one backend. Outputs are `&mut`, so no output aliases an input.
#[derive(Debug)]
pub enum Op<'a, B> {
    /// `dst[..n] = dequantize(src)` for `n` values of `ty`, written as `out` (f32 or f16).
    Dequantize {
        /// Storage type of `src`.
        ty: QuantType,
        /// Output float type: [`FloatType::F32`] or [`FloatType::F16`].
        out: FloatType,
        /// Number of values (a multiple of `ty.block_size()`).
        n: usize,
        /// Quantised input.
        src: &'a B,
        /// Output.
        dst: &'a mut B,
    },
    /// `dst[..n] = f16(src)` for `from` = [`FloatType::F32`] or [`FloatType::BF16`].
    ConvertToF16 {
        /// Input type.
        from: FloatType,
        /// Number of values.
        n: usize,
        /// Input.
        src: &'a B,
        /// Output (f16).
        dst: &'a mut B,
    },
    /// `y[t*rows + r] = dot(W[r], x[t])` for `n_tok` tokens (see [`crate::matmul`]).
    Matmul {
        /// Weight type.
        ty: QuantType,
        /// Exact or llama.cpp-style q8 activations.
        mode: MatvecMode,
        /// Activation type, f32 or f16.
        act: FloatType,
        /// Output rows.
        rows: usize,
        /// Values per row.
        cols: usize,
        /// Tokens (1 is a matrix–vector product).
        n_tok: usize,
        /// Chunk size of the dequantised path, in values.
        max_dq_size: usize,
        /// Weights.
        w: &'a B,
        /// Activations, `n_tok × cols`.
        x: &'a B,
        /// Output, f32, `n_tok × rows`.
        y: &'a mut B,
    },
    /// Products of one activation matrix with several weight matrices: for each member,
    /// `y[t*rows + r] = dot(W[r], x[t])`, each with its own weight type and rows, all with the
    /// same `cols`, tokens, mode and activations (a layer's q, k and v, or its gate and up).
    /// The results are those of one [`Op::Matmul`] per member; a backend may share work
    /// between them (CUDA quantises the activations once in Q8 mode).
    MatmulShared {
        /// Exact or llama.cpp-style q8 activations.
        mode: MatvecMode,
        /// Activation type, f32 or f16.
        act: FloatType,
        /// Values per row, of every member.
        cols: usize,
        /// Tokens.
        n_tok: usize,
        /// Chunk size of the dequantised path, in values.
        max_dq_size: usize,
        /// Activations, `n_tok × cols`.
        x: &'a B,
        /// The weight matrices and their outputs.
        products: Vec<Product<'a, B>>,
    },
    /// The gated MLP's first half, SwiGLU over a gate and an up matrix of the same rows and
    /// input: `gate.y[t*rows + r] = silu(dot(G[r], x[t])) · dot(U[r], x[t])`. The values of
    /// [`Op::MatmulShared`] over the two and then [`Op::SwiGluInPlace`] on `gate.y` (the CPU
    /// backend runs exactly those). CUDA runs one token of one weight type with a kernel that
    /// writes the product directly, from the same sums as the two ops (f16, bf16 and f32 in
    /// exact mode, the Q8 types in Q8 mode, on activations quantised once), and the two ops
    /// otherwise. `up.y` is room for the up products: what it holds afterwards is unspecified.
    MatmulSwiGlu {
        /// Exact or llama.cpp-style q8 activations.
        mode: MatvecMode,
        /// Activation type, f32 or f16.
        act: FloatType,
        /// Values per row, of both matrices.
        cols: usize,
        /// Tokens.
        n_tok: usize,
        /// Chunk size of the dequantised path, in values.
        max_dq_size: usize,
        /// Activations, `n_tok × cols`.
        x: &'a B,
        /// The gate matrix; its output receives the gated product.
        gate: Product<'a, B>,
        /// The up matrix (as many rows as the gate); its output is scratch.
        up: Product<'a, B>,
    },
    /// The LLM.int8 product `y[t*rows + r] = Σ_i x[t, i] · W[r, i]` over row-wise absmax int8
    /// weights, with the outlier columns (`|x| ≥ threshold` for some token) in f32 (see
    /// [`crate::cpu::int8`]; `threshold ≤ 0` quantises every column). Every backend computes
    /// the same i32 sums and the same float epilogue, so the results have the same bits.
    Int8Matmul {
        /// Output rows.
        rows: usize,
        /// Values per row (at most [`crate::cpu::int8::INT8_MAX_COLS`]).
        cols: usize,
        /// Tokens.
        n_tok: usize,
        /// Outlier threshold (bitsandbytes' `llm_int8_threshold`, default
        /// [`crate::INT8_DEFAULT_THRESHOLD`]).
        threshold: f32,
        /// Weights in the one-buffer layout of [`crate::cpu::int8::int8_packed_bytes`]: the
        /// `rows × cols` quants, then one f32 absmax per row.
        w: &'a B,
        /// Activations, `n_tok × cols` f32.
        x: &'a B,
        /// Output, `n_tok × rows` f32.
        y: &'a mut B,
    },
    /// RMSNorm of `n_rows` rows of `n_cols` f32 values with an f32 weight of `n_cols`.
    RmsNorm {
        /// Rows.
        n_rows: usize,
        /// Values per row.
        n_cols: usize,
        /// Epsilon.
        eps: f32,
        /// Input.
        x: &'a B,
        /// Weight.
        weight: &'a B,
        /// Output.
        out: &'a mut B,
    },
    /// A block's output added to the residual stream and the sum normed for the next block:
    /// `x += h`, then `h = RMSNorm(x) · weight`, over `n_rows` rows of `n_cols` f32 values.
    /// The same values as [`Op::AddInPlace`] then [`Op::RmsNorm`], in one pass.
    AddRmsNorm {
        /// Rows.
        n_rows: usize,
        /// Values per row.
        n_cols: usize,
        /// Epsilon.
        eps: f32,
        /// The residual stream, updated in place.
        x: &'a mut B,
        /// The block's output on the way in; the normed sum on the way out.
        h: &'a mut B,
        /// Weight.
        weight: &'a B,
        /// The next op's products read `h` in Q8 mode (the engine's hint): the CUDA backend
        /// then quantises it in the norm's own launch, and that op takes the blocks instead of
        /// quantising `h` again (the same bytes). No op in between, or the next op on other
        /// activations, and the blocks go unused. The other backends ignore it.
        q8_next: bool,
    },
    /// RoPE over `n_tok × n_heads × head_dim` f32 values with one i32 position per token.
    Rope {
        /// Style, head size, rotated dims, frequencies.
        params: RopeParams,
        /// Tokens.
        n_tok: usize,
        /// Heads per token.
        n_heads: usize,
        /// Input.
        x: &'a B,
        /// Positions (i32).
        positions: &'a B,
        /// Output.
        out: &'a mut B,
    },
    /// Softmax of `n_rows` rows of `n_cols` f32 values.
    Softmax {
        /// Rows.
        n_rows: usize,
        /// Values per row.
        n_cols: usize,
        /// Input.
        x: &'a B,
        /// Output.
        out: &'a mut B,
    },
    /// `out = silu(gate) * up` over `n` f32 values.
    SwiGlu {
        /// Values.
        n: usize,
        /// Gate.
        gate: &'a B,
        /// Up.
        up: &'a B,
        /// Output.
        out: &'a mut B,
    },
    /// `out = a + b` over `n` f32 values.
    Add {
        /// Values.
        n: usize,
        /// Left.
        a: &'a B,
        /// Right.
        b: &'a B,
        /// Output.
        out: &'a mut B,
    },
    /// Encode `n` f32 values into cache storage `format` (see [`crate::KvFormat`]): `dst` holds
    /// `format.byte_at(n)` bytes, usually a view of a cache layer at the row being written.
    KvStore {
        /// Storage of the cache half.
        format: KvFormat,
        /// Values (whole groups of 32 for the quantised formats).
        n: usize,
        /// f32 values.
        src: &'a B,
        /// Cache bytes.
        dst: &'a mut B,
    },
    /// Decode `n` values of cache storage `format` to f32.
    KvLoad {
        /// Storage of the cache half.
        format: KvFormat,
        /// Values (whole groups of 32 for the quantised formats).
        n: usize,
        /// Cache bytes.
        src: &'a B,
        /// f32 values.
        dst: &'a mut B,
    },
    /// RoPE in place over `n_tok × n_heads × head_dim` f32 values with one i32 position per
    /// token and the per-pair angles `inv_freqs` (`params.n_dims / 2` f32, see
    /// [`crate::rope_inv_freqs`]; Llama 3's frequency factors are folded in there): pair `i` at
    /// position `p` turns by `p · inv_freqs[i]` (see [`crate::rope_in_place`]).
    RopeInPlace {
        /// Style, head size and rotated dims (`freq_base` and `freq_scale` are in `inv_freqs`).
        params: RopeParams,
        /// Tokens.
        n_tok: usize,
        /// Heads per token.
        n_heads: usize,
        /// Values, rotated in place.
        x: &'a mut B,
        /// Positions (i32).
        positions: &'a B,
        /// Angle per position of each rotated pair (f32).
        inv_freqs: &'a B,
    },
    /// RoPE on a layer's queries and keys, and the keys and values stored in the cache, for
    /// `n_tok` tokens: [`Op::RopeInPlace`] on `q` (`n_heads` heads a token) and on `k`
    /// (`kv_heads` heads), then [`Op::KvStore`] of `k` into `k_cache` and of `v` into `v_cache`
    /// (each `n_tok × kv_heads × head_dim` values: the cache rows being written). The CPU
    /// backend runs exactly those; CUDA runs them in one launch for every cache dtype, with the
    /// same arithmetic. `k` is room for the rotated keys: what it holds afterwards is
    /// unspecified (CUDA rotates them on their way into the cache and leaves `k` as it was).
    ///
    /// With `cache_rows`, `k_cache` and `v_cache` are whole cache layers of that many rows and
    /// token `t` is written at row `positions[t] % cache_rows` (a sliding-window layer's ring, as
    /// [`Op::Attention`] reads it), which the device reads: a captured CUDA graph then writes
    /// each step's row without a host-computed offset. A negative position is refused by the CPU
    /// backend and writes nothing on CUDA (which does not read it on the host). The bytes
    /// written are those of the rows form at those rows.
    RopeKvStore {
        /// Style, head size and rotated dims (the angles are in `inv_freqs`).
        params: RopeParams,
        /// Tokens.
        n_tok: usize,
        /// Query heads per token.
        n_heads: usize,
        /// Key/value heads per token.
        kv_heads: usize,
        /// Queries, rotated in place.
        q: &'a mut B,
        /// Keys (f32), rotated on their way into the cache.
        k: &'a mut B,
        /// Values (f32).
        v: &'a B,
        /// Positions (i32), one per token.
        positions: &'a B,
        /// Angle per position of each rotated pair (f32, see [`Op::RopeInPlace`]).
        inv_freqs: &'a B,
        /// Storage of the cached keys.
        k_format: KvFormat,
        /// Storage of the cached values.
        v_format: KvFormat,
        /// The key rows being written (`k_format.byte_at(n_tok × kv_heads × head_dim)` bytes),
        /// or the whole layer's keys with `cache_rows`.
        k_cache: &'a mut B,
        /// The value rows being written, or the whole layer's values with `cache_rows`.
        v_cache: &'a mut B,
        /// `None`: the caches are the rows being written. `Some(rows)`: they hold `rows` rows
        /// and each token goes to row `position % rows`.
        cache_rows: Option<usize>,
    },
    /// `x += y` over `n` f32 values (the residual add).
    AddInPlace {
        /// Values.
        n: usize,
        /// Accumulator.
        x: &'a mut B,
        /// Addend.
        y: &'a B,
    },
    /// `x[r · n_cols + c] += bias[c]` for `n_rows` rows of `n_cols` f32 values.
    AddBias {
        /// Rows (tokens).
        n_rows: usize,
        /// Values per row.
        n_cols: usize,
        /// Rows, in place.
        x: &'a mut B,
        /// `n_cols` f32 values.
        bias: &'a B,
    },
    /// `gate = silu(gate) · up` over `n` f32 values, in place (see [`crate::swiglu`]).
    SwiGluInPlace {
        /// Values.
        n: usize,
        /// Gate, replaced by the product.
        gate: &'a mut B,
        /// Up.
        up: &'a B,
    },
    /// `gate = gelu_tanh(gate) · up` over `n` f32 values, in place (GeGLU with the tanh GELU,
    /// see [`crate::geglu_tanh_in_place`]).
    GeGluTanhInPlace {
        /// Values.
        n: usize,
        /// Gate, replaced by the product.
        gate: &'a mut B,
        /// Up.
        up: &'a B,
    },
    /// `x *= s` over `n` f32 values (gemma's embedding scale).
    ScaleInPlace {
        /// Values.
        n: usize,
        /// The factor.
        s: f32,
        /// Values, scaled in place.
        x: &'a mut B,
    },
    /// `dst` row `k` = `src` row `rows[k]` for `n_rows` rows of `n_cols` f32 values (`rows`:
    /// `n_rows` u32 indices, each below `src_rows`): the tokens routed to one expert, gathered.
    GatherRows {
        /// Rows gathered.
        n_rows: usize,
        /// Values a row.
        n_cols: usize,
        /// Rows `src` holds; an index at or past it is refused (the CPU backend) or skipped
        /// (CUDA, which cannot read the indices before it runs).
        src_rows: usize,
        /// The row of `src` each row of `dst` takes (u32).
        rows: &'a B,
        /// Rows, `src_rows × n_cols` values.
        src: &'a B,
        /// Gathered rows, `n_rows × n_cols` values.
        dst: &'a mut B,
    },
    /// `dst` row `rows[k]` += `weights[k] · src` row `k` for `n_rows` rows of `n_cols` f32
    /// values, the product rounded before the sum (as `x *= s` then `x += y` would): an
    /// expert's output rows added into their tokens' sums. The indices are distinct, each below
    /// `dst_rows`.
    ScatterAddRows {
        /// Rows added.
        n_rows: usize,
        /// Values a row.
        n_cols: usize,
        /// Rows `dst` holds; an index at or past it is refused (the CPU backend) or skipped
        /// (CUDA).
        dst_rows: usize,
        /// The row of `dst` each row of `src` is added into (u32, distinct).
        rows: &'a B,
        /// Each row's factor (f32).
        weights: &'a B,
        /// Rows added, `n_rows × n_cols` values.
        src: &'a B,
        /// Sums, `dst_rows × n_cols` values.
        dst: &'a mut B,
    },
    /// Causal grouped-query attention of `n_q` queries at positions `start..start + n_q` over
    /// the keys of positions `0..start + n_q` of a KV cache: query `i` of head `h` meets keys
    /// `0..=start + i` of kv head `h / (n_heads / kv_heads)`, and
    /// `out = softmax(scale · q·kᵀ) · v`, with a running (online) softmax so no score matrix
    /// is held. Cache rows are `kv_heads × head_dim` values, token-major, stored as `k_format`
    /// and `v_format` (decoded as they are read: no decoded copy of the cache is made on a GPU);
    /// the key at position `p` is in row `p % cache_rows`.
    Attention {
        /// Storage of the cached keys.
        k_format: KvFormat,
        /// Storage of the cached values.
        v_format: KvFormat,
        /// Query heads.
        n_heads: usize,
        /// Key/value heads (a divisor of `n_heads`).
        kv_heads: usize,
        /// Values per head.
        head_dim: usize,
        /// Queries.
        n_q: usize,
        /// Position of the first query.
        start: usize,
        /// Multiplier of the scores (`1/√head_dim`).
        scale: f32,
        /// A sliding window (0: none): query `i` meets only the keys at positions above
        /// `start + i - window`.
        window: usize,
        /// Attention logit soft-capping (0: none): each scaled score `w` becomes
        /// `softcap · tanh(w / softcap)`.
        softcap: f32,
        /// Rows `k` and `v` hold: the key at position `p` is read from row `p % cache_rows`, a
        /// sliding-window layer's ring of its window and one chunk (weightlift-plan's
        /// `SlidingWindow::cells`). A cache of every position has at least `start + n_q` rows, so
        /// `p` is its row. A call whose queries see more positions than the ring holds
        /// (`start + n_q` less the first query's window start, above `cache_rows`) is refused: its
        /// own keys would overwrite keys it reads.
        cache_rows: usize,
        /// Keys folded into the running softmax at a time by the CPU backend (the engine's
        /// attention tile, so that this operation gives the host forward pass's bits); the
        /// CUDA kernel keeps its own order.
        tile: usize,
        /// Round each query and each attention weight to f16 before it meets the cache, as
        /// llama.cpp's CPU products do with an f16 cache.
        f16_operands: bool,
        /// Queries, `n_q × n_heads × head_dim` f32 (rotated).
        q: &'a B,
        /// Cached keys, `cache_rows` rows (or at least `start + n_q` when there are more).
        k: &'a B,
        /// Cached values, as many rows.
        v: &'a B,
        /// Output, `n_q × n_heads × head_dim` f32.
        out: &'a mut B,
        /// Room for the partial results of a call whose keys are split across thread blocks
        /// (the CUDA kernel's flash-decoding split; `weightlift-plan` reserves
        /// `n_heads × ATTENTION_MAX_SPLITS × (head_dim + 2)` f32 for it): the splits are cut
        /// to what it holds, and `None` runs the call unsplit. The CPU backend needs none.
        scratch: Option<&'a mut B>,
        /// The first query's position read from device memory instead of `start` (which is
        /// then not read), for a call a CUDA graph replays at every step (see [`StartAt`]).
        start_at: Option<StartAt<'a, B>>,
        /// The next op's products read `out` in Q8 mode (the engine's hint, as
        /// [`Op::AddRmsNorm`]'s): the CUDA backend then quantises it in the launch that writes
        /// it, where a split call's merge does. The other backends ignore it.
        q8_next: bool,
    },
}

/// Where an [`Op::Attention`] reads its first query's position: a replayed graph keeps the
/// arguments it was captured with, so a decode step's position must come from device memory.
/// CUDA then splits `span` keys from the first query's window start (a count that does not
/// follow the position, so the grid is the same at every step; the splits past the current
/// length exit at once), and refuses nothing it cannot see: a position whose queries see more
/// than `span` keys from there computes nothing.
/// The CPU backend reads the position from its buffer, refuses one past `span`, and gives the
/// bits of the call with that `start`.
#[derive(Debug)]
pub struct StartAt<'a, B> {
    /// i32 positions (those RoPE reads): the first is the first query's.
    pub positions: &'a B,
    /// The keys split, from the first query's window start (key 0 without a window): the
    /// queries see no more. `k` and `v` hold at least that many rows, or all `cache_rows` with
    /// a window. A decode step takes [`crate::sources::attention_decode_span`], cut to a
    /// sliding window's keys by [`crate::sources::attention_window_span`].
    pub span: usize,
}

/// One member of [`Op::MatmulShared`]: `rows × cols` weights of type `ty` and their output.
#[derive(Debug)]
pub struct Product<'a, B> {
    /// Weight type.
    pub ty: QuantType,
    /// Output rows.
    pub rows: usize,
    /// Weights.
    pub w: &'a B,
    /// Output, f32, `n_tok × rows`.
    pub y: &'a mut B,
}

impl<'a, B> Product<'a, B> {
    /// This member of an [`Op::MatmulShared`] of `x`, whose shared fields are `(mode, act,
    /// cols, n_tok, max_dq_size)`, as its own [`Op::Matmul`].
    pub fn alone(
        self,
        (mode, act, cols, n_tok, max_dq_size): (MatvecMode, FloatType, usize, usize, usize),
        x: &'a B,
    ) -> Op<'a, B> {
        Op::Matmul {
            ty: self.ty,
            mode,
            act,
            rows: self.rows,
            cols,
            n_tok,
            max_dq_size,
            w: self.w,
            x,
            y: self.y,
        }
    }
}

/// [`Op::MatmulShared`] as one [`Op::Matmul`] per member, each given to `run` (a backend's
/// own dispatch, which does not count them again), for a backend with nothing to share. Any
/// other op goes to `run` as it is.
pub fn matmul_each<'a, B>(
    op: Op<'a, B>,
    mut run: impl FnMut(Op<'a, B>) -> Result<()>,
) -> Result<()> {
    let Op::MatmulShared {
        mode,
        act,
        cols,
        n_tok,
        max_dq_size,
        x,
        products,
    } = op
    else {
        return run(op);
    };
    for p in products {
        run(p.alone((mode, act, cols, n_tok, max_dq_size), x))?;
    }
    Ok(())
}

/// [`Op::MatmulSwiGlu`] as the two operations it stands for, [`Op::MatmulShared`] of the gate
/// and up matrices and then [`Op::SwiGluInPlace`] on the gate's output, each given to `run` (a
/// backend's own dispatch). Any other op goes to `run` as it is.
pub fn matmul_swiglu_unfused<B>(
    op: Op<'_, B>,
    mut run: impl FnMut(Op<'_, B>) -> Result<()>,
) -> Result<()> {
    let Op::MatmulSwiGlu {
        mode,
        act,
        cols,
        n_tok,
        max_dq_size,
        x,
        gate,
        up,
    } = op
    else {
        return run(op);
    };
    let n = swiglu_values(gate.rows, up.rows, n_tok)?;
    let (gate_y, up_y) = (gate.y, up.y);
    run(Op::MatmulShared {
        mode,
        act,
        cols,
        n_tok,
        max_dq_size,
        x,
        products: vec![
            Product {
                ty: gate.ty,
                rows: gate.rows,
                w: gate.w,
                y: &mut *gate_y,
            },
            Product {
                ty: up.ty,
                rows: up.rows,
                w: up.w,
                y: &mut *up_y,
            },
        ],
    })?;
    run(Op::SwiGluInPlace {
        n,
        gate: gate_y,
        up: up_y,
    })
}

/// [`Op::RopeKvStore`] as the four operations it stands for, each given to `run` (a backend's
/// own dispatch): [`Op::RopeInPlace`] on the queries and on the keys, then [`Op::KvStore`] of
/// the keys and of the values. Any other op goes to `run` as it is.
pub fn rope_kv_store_unfused<B>(
    op: Op<'_, B>,
    mut run: impl FnMut(Op<'_, B>) -> Result<()>,
) -> Result<()> {
    let Op::RopeKvStore {
        params,
        n_tok,
        n_heads,
        kv_heads,
        q,
        k,
        v,
        positions,
        inv_freqs,
        k_format,
        v_format,
        k_cache,
        v_cache,
        cache_rows,
    } = op
    else {
        return run(op);
    };
    if let Some(rows) = cache_rows {
        // the rows form's views: only the backend knows where a position read from its own
        // memory lands
        return Err(KernelError::Unsupported {
            op: "rope_kv_store at the positions' rows",
            ty: format!(
                "keys stored as {} with values stored as {} ({rows} cache rows)",
                k_format.name(),
                v_format.name()
            ),
            supported: "the formats a cache dtype makes, on each backend's own path",
        });
    }
    let n = kv_values(n_tok, kv_heads, params.head_dim)?;
    run(Op::RopeInPlace {
        params,
        n_tok,
        n_heads,
        x: q,
        positions,
        inv_freqs,
    })?;
    run(Op::RopeInPlace {
        params,
        n_tok,
        n_heads: kv_heads,
        x: &mut *k,
        positions,
        inv_freqs,
    })?;
    run(Op::KvStore {
        format: k_format,
        n,
        src: k,
        dst: k_cache,
    })?;
    run(Op::KvStore {
        format: v_format,
        n,
        src: v,
        dst: v_cache,
    })
}

/// The key (or value) count of an [`Op::RopeKvStore`]: `n_tok × kv_heads × head_dim`.
pub(crate) fn kv_values(n_tok: usize, kv_heads: usize, head_dim: usize) -> Result<usize> {
    n_tok
        .checked_mul(kv_heads)
        .and_then(|v| v.checked_mul(head_dim))
        .ok_or_else(|| KernelError::Shape {
            op: "rope_kv_store",
            reason: format!("{n_tok} tokens × {kv_heads} heads × {head_dim} values overflow usize"),
        })
}

/// The values of an [`Op::MatmulSwiGlu`] output: `n_tok × rows`, when the gate and up matrices
/// have the same rows.
pub(crate) fn swiglu_values(gate_rows: usize, up_rows: usize, n_tok: usize) -> Result<usize> {
    if gate_rows != up_rows {
        return Err(KernelError::Shape {
            op: "matmul_swiglu",
            reason: format!(
                "the gate matrix has {gate_rows} rows and the up matrix {up_rows}; SwiGLU pairs \
                 them row by row"
            ),
        });
    }
    n_tok
        .checked_mul(gate_rows)
        .ok_or_else(|| KernelError::Shape {
            op: "matmul_swiglu",
            reason: format!("{n_tok} tokens × {gate_rows} rows overflow usize"),
        })
}

impl<B> Op<'_, B> {
    /// The operation's name, as [`OpCounter`] reports it.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Dequantize { .. } => "dequantize",
            Op::ConvertToF16 { .. } => "convert_to_f16",
            Op::Matmul { .. } => "matmul",
            Op::MatmulShared { .. } => "matmul_shared",
            Op::MatmulSwiGlu { .. } => "matmul_swiglu",
            Op::Int8Matmul { .. } => "int8_matmul",
            Op::RmsNorm { .. } => "rms_norm",
            Op::AddRmsNorm { .. } => "add_rms_norm",
            Op::Rope { .. } => "rope",
            Op::Softmax { .. } => "softmax",
            Op::SwiGlu { .. } => "swiglu",
            Op::Add { .. } => "add",
            Op::KvStore { .. } => "kv_store",
            Op::KvLoad { .. } => "kv_load",
            Op::RopeInPlace { .. } => "rope_in_place",
            Op::RopeKvStore { .. } => "rope_kv_store",
            Op::AddInPlace { .. } => "add_in_place",
            Op::AddBias { .. } => "add_bias",
            Op::SwiGluInPlace { .. } => "swiglu_in_place",
            Op::Attention { .. } => "attention",
            Op::GeGluTanhInPlace { .. } => "geglu_tanh_in_place",
            Op::ScaleInPlace { .. } => "scale_in_place",
            Op::GatherRows { .. } => "gather_rows",
            Op::ScatterAddRows { .. } => "scatter_add_rows",
        }
    }
}

/// Whether an [`OpCounter`] is alive; checked first, so counting costs one relaxed load when
/// off.
static COUNTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static COUNTS: std::sync::Mutex<Counts> = std::sync::Mutex::new(Counts {
    ops: BTreeMap::new(),
    uploads: Uploads {
        calls: 0,
        bytes: 0,
        waits: 0,
    },
});

/// What an [`OpCounter`] has seen.
struct Counts {
    ops: BTreeMap<&'static str, usize>,
    uploads: Uploads,
}

/// The copies of host bytes to a backend's memory ([`Backend::copy_from_host`]) an
/// [`OpCounter`] saw, and how often one made the host wait for an earlier copy first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Uploads {
    /// Calls of [`Backend::copy_from_host`].
    pub calls: usize,
    /// Bytes they copied.
    pub bytes: usize,
    /// Times the host waited for an earlier copy before it could stage the next (CUDA: a
    /// pinned staging buffer whose last copy was still in flight; the CPU backend never
    /// waits).
    pub waits: usize,
}

/// Counts the operations every backend runs in this process while it is alive, by
/// [`Op::name`], and the host bytes copied to backends ([`OpCounter::uploads`]). Each operation
/// is at least one kernel launch on a GPU, and each upload a copy the host queues, so a test
/// on the CPU backend (which runs the same sequence the CUDA backend would) pins how many a
/// decode step issues, and a change that adds launches or uploads shows without a GPU. Meant
/// for a test binary of its own: counters of concurrent tests would see each other's
/// operations.
pub struct OpCounter(());

impl OpCounter {
    /// Starts counting from zero.
    pub fn start() -> OpCounter {
        let mut c = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
        c.ops.clear();
        c.uploads = Uploads::default();
        COUNTING.store(true, std::sync::atomic::Ordering::SeqCst);
        OpCounter(())
    }

    /// The operations run since [`OpCounter::start`], by name.
    pub fn counts(&self) -> BTreeMap<&'static str, usize> {
        COUNTS.lock().unwrap_or_else(|e| e.into_inner()).ops.clone()
    }

    /// The uploads since [`OpCounter::start`].
    pub fn uploads(&self) -> Uploads {
        COUNTS.lock().unwrap_or_else(|e| e.into_inner()).uploads
    }
}

impl Drop for OpCounter {
    fn drop(&mut self) {
        COUNTING.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Called by every backend's [`Backend::run`] with the operation it is about to run.
pub(crate) fn record<B>(op: &Op<'_, B>) {
    if COUNTING.load(std::sync::atomic::Ordering::Relaxed) {
        *COUNTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ops
            .entry(op.name())
            .or_default() += 1;
    }
}

/// Called by every backend's [`Backend::copy_from_host`] with the bytes it copies.
pub(crate) fn record_upload(bytes: usize) {
    if COUNTING.load(std::sync::atomic::Ordering::Relaxed) {
        let mut c = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
        c.uploads.calls += 1;
        c.uploads.bytes += bytes;
    }
}

/// Called where the host waits for an earlier upload before it can stage the next.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn record_upload_wait() {
    if COUNTING.load(std::sync::atomic::Ordering::Relaxed) {
        COUNTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .uploads
            .waits += 1;
    }
}

/// A strided side of a 2-D copy ([`Backend::copy_2d`]): the first row's byte offset and the
/// bytes from one row to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Byte offset of the first row.
    pub offset: usize,
    /// Bytes from the start of one row to the start of the next (at least the row width when
    /// there is more than one row).
    pub pitch: usize,
}

/// What fills a window of a CUDA upload ([`crate::cuda::CudaBackend::upload_filled`]):
/// `fill(at, window)` writes bytes `at..at + window.len()` of the range, or fails with the
/// caller's own error.
pub type Fill<'a, E> = dyn FnMut(usize, &mut [u8]) -> std::result::Result<(), E> + 'a;

/// A compute device: memory plus the operations of this crate.
pub trait Backend: Send + Sync {
    /// A region of device memory.
    type Buffer: Send + Sync;

    /// A short name: `cpu`, `virtual:0`, `cuda:1`.
    fn name(&self) -> String;

    /// Allocates `bytes` zeroed bytes.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// The size of `buf` in bytes.
    fn len(&self, buf: &Self::Buffer) -> usize;

    /// Copies host bytes into `dst` at `offset`.
    fn copy_from_host(&self, src: &[u8], dst: &mut Self::Buffer, offset: usize) -> Result<()>;

    /// Copies `dst.len()` bytes of `src`, starting at `offset`, to the host. Blocks until done.
    fn copy_to_host(&self, src: &Self::Buffer, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Copies `bytes` bytes between two buffers of this device.
    fn copy(
        &self,
        src: &Self::Buffer,
        src_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()>;

    /// Copies `rows` rows of `width` bytes within this device: row `r` from `src` at
    /// `from.offset + r * from.pitch` to `dst` at `to.offset + r * to.pitch` (a block of columns
    /// of a row-major matrix packed into a matrix of its own, or unpacked back). Bounds are
    /// checked, and rows that would overlap (a pitch below `width`) are refused, with a typed
    /// error, before anything is copied.
    fn copy_2d(
        &self,
        src: &Self::Buffer,
        from: Rows,
        dst: &mut Self::Buffer,
        to: Rows,
        width: usize,
        rows: usize,
    ) -> Result<()>;

    /// Whether [`Backend::copy_peer`] from this device to `to` copies device to device: always
    /// between two CPU backends; on CUDA for the same device, or when the driver allows `to` to
    /// access this device's memory (`cuDeviceCanAccessPeer`), which is then enabled once
    /// (`cuCtxEnablePeerAccess`) and remembered per pair.
    fn peer_access(&self, to: &Self) -> bool;

    /// Copies `bytes` bytes of `src` (a buffer of this device) from `src_offset` into `dst` (a
    /// buffer of `to`) at `dst_offset`: device to device where [`Backend::peer_access`], through
    /// host memory otherwise. Ordered after the work queued on both devices before the call;
    /// work queued on either after the call sees it done.
    fn copy_peer(
        &self,
        src: &Self::Buffer,
        src_offset: usize,
        to: &Self,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()>;

    /// As [`Backend::copy_peer`], for `rows` rows of `width` bytes with each side strided as
    /// its [`Rows`] say (columns of a row-major matrix on either side). The default makes one
    /// copy where both sides are contiguous, else one per row.
    fn copy_peer_2d(
        &self,
        src: &Self::Buffer,
        from: Rows,
        to: &Self,
        dst: &mut Self::Buffer,
        to_rows: Rows,
        (width, rows): (usize, usize),
    ) -> Result<()>
    where
        Self: Sized,
    {
        copy_peer_by_rows(self, src, from, to, dst, to_rows, (width, rows))
    }

    /// Runs (or enqueues) an operation.
    fn run(&self, op: Op<'_, Self::Buffer>) -> Result<()>;

    /// The index of the first NaN/inf value in the first `bytes` bytes of `buf` (see
    /// [`crate::scan_non_finite`]). Blocks until done.
    fn scan_non_finite(
        &self,
        ty: QuantType,
        buf: &Self::Buffer,
        bytes: usize,
    ) -> Result<Option<usize>>;

    /// Quantise-on-load into this device's memory: whole rows of `src` (host bytes,
    /// little-endian `src_ty` values, `n_per_row` a row) into `ty` blocks in `dst` from byte
    /// `offset`, the bytes [`crate::quantize_rows_from`] writes. A NaN or inf in `src` is not an
    /// error here: its report ([`crate::cpu::quantize::non_finite_report`], the index counted
    /// from `first`, the position of `src`'s first value in the tensor) is merged into `found`,
    /// an 8-byte buffer of this backend allocated (zeroed) before the tensor's first chunk, which
    /// [`Backend::check_quantized`] reads once the tensor is done. CUDA uploads `src` and queues
    /// the kernel on the backend's stream: `src` may be reused when this returns. Shapes and
    /// types are checked as the CPU quantiser checks them.
    #[allow(clippy::too_many_arguments)]
    fn quantize_rows(
        &self,
        ty: QuantType,
        src_ty: FloatType,
        src: &[u8],
        n_per_row: usize,
        dst: &mut Self::Buffer,
        offset: usize,
        first: usize,
        found: &mut Self::Buffer,
    ) -> Result<()>;

    /// The error the CPU quantiser gives for the first non-finite value that
    /// [`Backend::quantize_rows`] calls merged into `found` (`Ok` when there was none). Blocks
    /// until the queued work is done.
    fn check_quantized(&self, found: &Self::Buffer) -> Result<()> {
        let mut word = [0u8; 8];
        self.copy_to_host(found, 0, &mut word)?;
        crate::cpu::quantize::check_non_finite_report(u64::from_le_bytes(word))
    }

    /// Waits for all queued work.
    fn synchronize(&self) -> Result<()>;

    /// `len` bytes of `buf` from byte `offset`, as a buffer of this backend that reads them in
    /// place (no copy; dropping it frees nothing).
    ///
    /// # Safety
    ///
    /// The view must be dropped before `buf` is written, moved or dropped, and nothing may be
    /// written through it (it is an input only).
    // A view borrows memory without a lifetime in its type (the buffer types have none), so the
    // caller must vouch for it.
    #[allow(unsafe_code)]
    unsafe fn view(&self, buf: &Self::Buffer, offset: usize, len: usize) -> Result<Self::Buffer>;

    /// Disjoint byte ranges `(offset, len)` of `buf`, each as a buffer of this backend that
    /// reads and writes them in place (no copy; dropping one frees nothing). Overlapping or
    /// out-of-bounds ranges are an error.
    ///
    /// # Safety
    ///
    /// Every part must be dropped before `buf` is used, moved or dropped again.
    #[allow(unsafe_code)]
    unsafe fn split(
        &self,
        buf: &mut Self::Buffer,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<Self::Buffer>>;
}

/// Checks that byte ranges `(offset, len)` lie within `len` bytes and do not overlap.
pub(crate) fn check_ranges(len: usize, ranges: &[(usize, usize)]) -> Result<()> {
    let mut sorted: Vec<(usize, usize)> = ranges.to_vec();
    sorted.sort_unstable();
    let mut end = 0;
    for &(o, l) in &sorted {
        check_range("split range bytes", len, o, l)?;
        if l > 0 && o < end {
            return Err(KernelError::Shape {
                op: "split",
                reason: format!("byte range {o}..{} overlaps one ending at {end}", o + l),
            });
        }
        end = end.max(o + l);
    }
    Ok(())
}

/// Checks that `[offset, offset + bytes)` lies within a buffer of `len` bytes.
pub(crate) fn check_range(
    what: &'static str,
    len: usize,
    offset: usize,
    bytes: usize,
) -> Result<()> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(()),
        _ => Err(KernelError::LengthMismatch {
            what,
            expected: offset.saturating_add(bytes),
            got: len,
        }),
    }
}

/// Checks one side of a 2-D copy of `rows` rows of `width` bytes against a buffer of `len`
/// bytes: the rows lie within it and do not overlap. Nothing is touched when `rows` or `width`
/// is 0.
/// [`Backend::copy_peer_2d`] as one [`Backend::copy_peer`] where both sides are contiguous,
/// else one per row.
pub(crate) fn copy_peer_by_rows<B: Backend>(
    b: &B,
    src: &B::Buffer,
    from: Rows,
    to: &B,
    dst: &mut B::Buffer,
    to_rows: Rows,
    (width, rows): (usize, usize),
) -> Result<()> {
    check_rows("copy_peer_2d source bytes", b.len(src), from, width, rows)?;
    check_rows(
        "copy_peer_2d destination bytes",
        to.len(dst),
        to_rows,
        width,
        rows,
    )?;
    if rows <= 1 || (from.pitch == width && to_rows.pitch == width) {
        let bytes = width.saturating_mul(rows);
        return b.copy_peer(src, from.offset, to, dst, to_rows.offset, bytes);
    }
    for r in 0..rows {
        let (s, d) = (
            from.offset + r * from.pitch,
            to_rows.offset + r * to_rows.pitch,
        );
        b.copy_peer(src, s, to, dst, d, width)?;
    }
    Ok(())
}

pub(crate) fn check_rows(
    what: &'static str,
    len: usize,
    side: Rows,
    width: usize,
    rows: usize,
) -> Result<()> {
    if rows == 0 || width == 0 {
        return Ok(());
    }
    if rows > 1 && side.pitch < width {
        return Err(KernelError::Shape {
            op: "copy_2d",
            reason: format!(
                "{what}: rows of {width} bytes at a pitch of {} bytes overlap; the pitch is the \
                 whole row of the matrix, not the part copied",
                side.pitch
            ),
        });
    }
    let end = (rows - 1)
        .checked_mul(side.pitch)
        .and_then(|last| last.checked_add(side.offset))
        .and_then(|last| last.checked_add(width));
    match end {
        Some(end) if end <= len => Ok(()),
        _ => Err(KernelError::LengthMismatch {
            what,
            expected: end.unwrap_or(usize::MAX),
            got: len,
        }),
    }
}

/// Bytes an operand of `n` values of `ty` needs.
pub(crate) fn quant_bytes(ty: QuantType, n: usize) -> Result<usize> {
    let bs = ty.block_size();
    if !n.is_multiple_of(bs) {
        return Err(KernelError::Shape {
            op: "dequantize",
            reason: format!("{n} values are not whole {ty} blocks of {bs}"),
        });
    }
    Ok(n / bs * ty.block_bytes())
}

/// Runs one test body on every backend present, as candle's `test_device!` does.
///
/// `test_device!(body)` expands to a module `body` with three `#[test]`s that call
/// `body(&backend) -> Result<()>`: `cpu` ([`CpuBackend`](crate::CpuBackend)), `virtual_device`
/// (a capped `CpuBackend`, the engine's `virtual:N`) and `cuda` (`CudaBackend::new(0)`). The
/// CUDA case prints why and passes when there is no GPU, no libcuda or no `cuda` feature; any
/// other error fails it.
#[macro_export]
macro_rules! test_device {
    ($body:ident) => {
        mod $body {
            #[test]
            fn cpu() -> $crate::Result<()> {
                super::$body(&$crate::CpuBackend::new())
            }

            #[test]
            fn virtual_device() -> $crate::Result<()> {
                super::$body(&$crate::CpuBackend::with_capacity("virtual:0", 256 << 20))
            }

            #[test]
            #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
            fn cuda() -> $crate::Result<()> {
                super::$body(&$crate::CudaBackend::new(0)?)
            }
        }
    };
}
