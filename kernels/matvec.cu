// The products y[t * rows + r] = dot(W[r], x[t]), in four families:
// - matvec_{f16,bf16,f32}_{f32,f16} and matmul_{f16,bf16,f32}_{f32,f16}: float weights, exact
//   mode (f32 accumulation), written for memory bandwidth (below: WL_FV_KERNELS).
// - matvec_{type}_{f32,f16} and matmul_{type}_{f32,f16} for the quantised types: exact mode
//   (weights dequantised in registers, f32 accumulation). One warp per output value: each lane
//   sums a strided share of the row (wl_lane_dot_*, in wl_matvec.cuh, which the host twin
//   tests) and the 32 partial sums meet through an xor butterfly of warp shuffles. Launch with
//   blockDim.x a multiple of 32.
// - q8_quantize_{f32,f16}, q8_matmul_{type} and q8_matvec_{type}: the Q8-activation mode
//   (wl_q8.cuh), integer dot products per 32-value group with dp4a; q8_matmul in the CPU's
//   order, q8_matvec (decode, one token) in an order of its own made for bandwidth.
// - q8_mma_{type}: the Q8 mode's prompt product on int8 tensor cores (wl_mmq.cuh), the
//   groups' integer dots as m16n8k32 products, from compute capability 8.0.
// - swiglu_matvec_{f16,bf16,f32}_{f32,f16} and swiglu_q8_matvec_{type}: decode's gate and up
//   products with SwiGLU in one launch, each row's sums those of the matvec kernels above.
// - q8_wide_matvec_{q4_k,q6_k} and swiglu_q8_wide_matvec_{q4_k,q6_k}: the same two for Q4_K and
//   Q6_K with wide lanes (wl_q8w.cuh), the default for those types (WEIGHTLIFT_Q8V=narrow for
//   the others').
// - matvec3_{f16,bf16,f32}_{f32,f16}, q8_matvec3_{type} and q8_wide_matvec3_{type}: decode's
//   products of one input with up to three matrices (a layer's q, k and v) in one launch, each
//   row's sum its matrix's own launch's (WL_GROUP_MEMBER).
// - gemm_{f32,f16}: the exact mode's dequantised path for prompts, a tiled shared-memory f32
//   product of rows already dequantised (by dequantize_{type}_f32) into a chunk of scratch.
#include "wl_matvec.cuh"
#include "wl_q8.cuh"
#include "wl_q8w.cuh"
#include "wl_mmq.cuh"

__device__ __forceinline__ float wl_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// y[t * rows + r] = dot(W[r], x[t]); grid.x * (blockDim.x / 32) warps cover the rows, and
// grid.y (at most 65535) strides over the n_tok tokens. A warp whose row is out of range leaves
// as a whole, so the full-mask shuffles below always see 32 live lanes.
#define WL_MATMUL(NAME, ACT, ACT_T)                                                        \
    extern "C" __global__ void matmul_##NAME##_##ACT(const wl_u8* w, const ACT_T* x, float* y,     \
                                                     wl_u64 rows, wl_u64 cols, wl_u64 n_tok) {     \
        wl_u64 r = (wl_u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                      \
        int lane = threadIdx.x % 32;                                                               \
        if (r >= rows) return;                                                                     \
        const wl_u8* row = wl_row_##NAME(w, r, cols);                                              \
        for (wl_u64 t = blockIdx.y; t < n_tok; t += gridDim.y) {                                   \
            float acc = wl_warp_sum(wl_lane_dot_##NAME##_##ACT(row, x + t * cols, cols, lane));    \
            if (lane == 0) y[t * rows + r] = acc;                                                  \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void matvec_##NAME##_##ACT(const wl_u8* w, const ACT_T* x, float* y,     \
                                                     wl_u64 rows, wl_u64 cols) {                   \
        wl_u64 r = (wl_u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                      \
        int lane = threadIdx.x % 32;                                                               \
        if (r >= rows) return;                                                                     \
        const wl_u8* row = wl_row_##NAME(w, r, cols);                                              \
        float acc = wl_warp_sum(wl_lane_dot_##NAME##_##ACT(row, x, cols, lane));                   \
        if (lane == 0) y[r] = acc;                                                                 \
    }

// Block sizes and row strides come from wl_matvec.cuh's WL_LANE_DOT_BOTH list.
#define WL_MATMUL_BOTH(NAME)          \
    WL_MATMUL(NAME, f32, float)       \
    WL_MATMUL(NAME, f16, wl_u16)

WL_MATMUL_BOTH(q4_0)
WL_MATMUL_BOTH(q4_1)
WL_MATMUL_BOTH(q5_0)
WL_MATMUL_BOTH(q5_1)
WL_MATMUL_BOTH(q8_0)
WL_MATMUL_BOTH(q2_k)
WL_MATMUL_BOTH(q3_k)
WL_MATMUL_BOTH(q4_k)
WL_MATMUL_BOTH(q5_k)
WL_MATMUL_BOTH(q6_k)

// Float weights: decode is a read of every weight byte once, so these kernels are written for
// bandwidth. Bytes per call: rows * cols * (2 for f16 and bf16, 4 for f32) of weights, read once
// with 128-bit loads (the activations, n_tok * cols values, come from L1/L2 after the first
// block), plus n_tok * rows * 4 written. They should move those bytes at >= 70 % of a
// device-to-device copy's rate on 2048 x 2048 to 4096 x 14336 (about 3 TB/s on an H200; the
// bench prints the ratio). How:
// - A block of WL_FV_THREADS threads is blockDim.y rows of blockDim.x = tpr threads each
//   (16: two rows a warp, for rows of at most 32 chunks; 32: a warp a row; 64, 128, 256: several
//   warps a row for few, long rows). The host picks tpr (sources::float_row_threads) so that
//   the grid fills every SM while each thread keeps at least two chunks.
// - Each thread loads WL_FV_UNROLL 16-byte chunks before it uses any (wl_fv_lane_*), and a
//   warp's loads of one step are 512 contiguous bytes.
// - Each thread's FMA chains meet by xor shuffles within the warp (offsets tpr/2 .. 1, or
//   16 .. 1), then, for tpr > 32, the warps' sums are added in warp order through shared memory
//   (one float per warp and token: no bank conflict). The host shim replays this order.
// - matmul_* carries WL_FV_NT tokens per pass, so each weight chunk is loaded once for them;
//   grid.y (at most 65535) strides over the passes.
// A thread whose row is past the last computes the last row and stores nothing, so every thread
// reaches the shuffles and the barriers.
#define WL_FV_THREADS 256

// Decode's products of one input with up to three matrices in one launch (`matvec3_*`,
// `q8_matvec3_*`, `q8_wide_matvec3_*`: a layer's q, k and v), each member as its own launch
// would run it: grid.x holds member 0's ceil(rows0 / blockDim.y) row blocks, then member 1's,
// then member 2's (a member of no rows has none), and a block runs the body of the one-matrix
// kernel on its member's weights, output and rows, at its block index within the member. Rows
// of different members never share a block, so every row's sum is the one its member's own
// launch (the same block shape) gives. WL_GROUP_MEMBER declares `w`, `y`, `rows` and `blk` from
// the kernel's w0..w2, y0..y2 and rows0..rows2.
__device__ __forceinline__ int wl_group_member(wl_u64 b, wl_u64 per_block, wl_u64 rows0,
                                               wl_u64 rows1, wl_u64* blk) {
    const wl_u64 n0 = (rows0 + per_block - 1) / per_block;
    const wl_u64 n1 = (rows1 + per_block - 1) / per_block;
    if (b < n0) {
        *blk = b;
        return 0;
    }
    if (b < n0 + n1) {
        *blk = b - n0;
        return 1;
    }
    *blk = b - n0 - n1;
    return 2;
}

#define WL_GROUP_MEMBER(w, y, rows, blk)                                                  \
    wl_u64 blk;                                                                         \
    const int wl_member = wl_group_member(blockIdx.x, blockDim.y, rows0, rows1, &blk);  \
    const wl_u8* w = wl_member == 0 ? w0 : wl_member == 1 ? w1 : w2;                    \
    float* y = wl_member == 0 ? y0 : wl_member == 1 ? y1 : y2;                          \
    const wl_u64 rows = wl_member == 0 ? rows0 : wl_member == 1 ? rows1 : rows2

template <int NT, typename ACT_T,
          void (*LANE)(const wl_u8*, const ACT_T*, wl_u64, int, int, int, float*)>
__device__ __forceinline__ void wl_fv_rows(const wl_u8* w, const ACT_T* x, float* y, wl_u64 rows,
                                           wl_u64 cols, wl_u64 n_tok, wl_u64 row_bytes,
                                           wl_u64 blk) {
    __shared__ float part[WL_FV_THREADS / 32][WL_FV_NT];
    const int tpr = blockDim.x;
    const int lane = threadIdx.x;
    const int warp = (threadIdx.y * tpr + lane) / 32;
    wl_u64 r = blk * blockDim.y + threadIdx.y;
    const int live = r < rows;
    if (!live) r = rows - 1;
    const wl_u8* row = w + r * row_bytes;
    const int width = tpr < 32 ? tpr : 32;
    for (wl_u64 t0 = (wl_u64)blockIdx.y * NT; t0 < n_tok; t0 += (wl_u64)gridDim.y * NT) {
        const int nt = NT == 1 ? 1 : (n_tok - t0 < (wl_u64)NT ? (int)(n_tok - t0) : NT);
        float acc[WL_FV_NT];
        LANE(row, x + t0 * cols, cols, nt, lane, tpr, acc);
#pragma unroll
        for (int k = 0; k < NT; ++k) {
            for (int o = width / 2; o > 0; o >>= 1) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
        }
        if (tpr > 32) {
            if (lane % 32 == 0) {
#pragma unroll
                for (int k = 0; k < NT; ++k) part[warp][k] = acc[k];
            }
            __syncthreads();
            if (lane == 0) {
#pragma unroll
                for (int k = 0; k < NT; ++k) {
                    float v = part[warp][k];
                    for (int j = 1; j < tpr / 32; ++j) v += part[warp + j][k];
                    acc[k] = v;
                }
            }
            // the next pass writes `part` again
            __syncthreads();
        }
        if (live && lane == 0) {
#pragma unroll
            for (int k = 0; k < NT; ++k) {
                if (k < nt) y[(t0 + k) * rows + r] = acc[k];
            }
        }
    }
}

#define WL_FV_KERNEL(NAME, ES, ACT, ACT_T)                                                         \
    extern "C" __global__ void __launch_bounds__(WL_FV_THREADS, 4)                                 \
        matvec_##NAME##_##ACT(const wl_u8* w, const ACT_T* x, float* y, wl_u64 rows, wl_u64 cols) { \
        wl_fv_rows<1, ACT_T, wl_fv_lane_##NAME##_##ACT>(w, x, y, rows, cols, 1, cols * (ES),       \
                                                       blockIdx.x);                                \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(WL_FV_THREADS, 4)                                 \
        matvec3_##NAME##_##ACT(const wl_u8* w0, const wl_u8* w1, const wl_u8* w2, const ACT_T* x,  \
                               float* y0, float* y1, float* y2, wl_u64 rows0, wl_u64 rows1,         \
                               wl_u64 rows2, wl_u64 cols) {                                         \
        WL_GROUP_MEMBER(w, y, rows, blk);                                                          \
        wl_fv_rows<1, ACT_T, wl_fv_lane_##NAME##_##ACT>(w, x, y, rows, cols, 1, cols * (ES), blk); \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(WL_FV_THREADS, 4)                                 \
        matmul_##NAME##_##ACT(const wl_u8* w, const ACT_T* x, float* y, wl_u64 rows, wl_u64 cols,  \
                              wl_u64 n_tok) {                                                      \
        wl_fv_rows<WL_FV_NT, ACT_T, wl_fv_lane_##NAME##_##ACT>(w, x, y, rows, cols, n_tok,          \
                                                              cols * (ES), blockIdx.x);            \
    }

#define WL_FV_KERNELS(NAME, ES)          \
    WL_FV_KERNEL(NAME, ES, f32, float)   \
    WL_FV_KERNEL(NAME, ES, f16, wl_u16)

WL_FV_KERNELS(f16, 2)
WL_FV_KERNELS(bf16, 2)
WL_FV_KERNELS(f32, 4)

// swiglu_matvec_{f16,bf16,f32}_{f32,f16}(wg, wu, x, y, rows, cols): the gated MLP's first half
// for one token, y[r] = silu(dot(G[r], x)) * dot(U[r], x), in one launch where matvec_* twice
// and swiglu_inplace_f32 took three. Launched as matvec_{type}_{act} for the same rows and
// cols (the same threads a row), each row's two sums are that kernel's: each thread runs the
// gate row's chains and then the up row's (so both rows' loads are in flight before the first
// shuffle), the chains meet by the same xor shuffles, and the warps' sums are added in warp
// order through shared memory. WL_SILU_MUL then makes the product as swiglu_inplace_f32 does:
// the bits of the three launches, without the gate and up products in memory. Bytes per call:
// both weight matrices once (2 * rows * cols * element bytes), rows * 4 written.
template <typename ACT_T, void (*LANE)(const wl_u8*, const ACT_T*, wl_u64, int, int, int, float*)>
__device__ __forceinline__ void wl_fv_glu_rows(const wl_u8* wg, const wl_u8* wu, const ACT_T* x,
                                               float* y, wl_u64 rows, wl_u64 cols,
                                               wl_u64 row_bytes) {
    __shared__ float part[WL_FV_THREADS / 32][2];
    const int tpr = blockDim.x;
    const int lane = threadIdx.x;
    const int warp = (threadIdx.y * tpr + lane) / 32;
    wl_u64 r = (wl_u64)blockIdx.x * blockDim.y + threadIdx.y;
    const int live = r < rows;
    if (!live) r = rows - 1;
    const int width = tpr < 32 ? tpr : 32;
    float g[WL_FV_NT], u[WL_FV_NT];
    LANE(wg + r * row_bytes, x, cols, 1, lane, tpr, g);
    LANE(wu + r * row_bytes, x, cols, 1, lane, tpr, u);
    float a = g[0], b = u[0];
    for (int o = width / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    for (int o = width / 2; o > 0; o >>= 1) b += __shfl_xor_sync(0xffffffffu, b, o);
    if (tpr > 32) {
        if (lane % 32 == 0) {
            part[warp][0] = a;
            part[warp][1] = b;
        }
        __syncthreads();
        if (lane == 0) {
            a = part[warp][0];
            b = part[warp][1];
            for (int j = 1; j < tpr / 32; ++j) {
                a += part[warp + j][0];
                b += part[warp + j][1];
            }
        }
    }
    if (live && lane == 0) y[r] = WL_SILU_MUL(a, b);
}

#define WL_FV_GLU_KERNEL(NAME, ES, ACT, ACT_T)                                                     \
    extern "C" __global__ void __launch_bounds__(WL_FV_THREADS, 4)                                 \
        swiglu_matvec_##NAME##_##ACT(const wl_u8* wg, const wl_u8* wu, const ACT_T* x, float* y,   \
                                     wl_u64 rows, wl_u64 cols) {                                   \
        wl_fv_glu_rows<ACT_T, wl_fv_lane_##NAME##_##ACT>(wg, wu, x, y, rows, cols, cols * (ES));   \
    }

#define WL_FV_GLU_KERNELS(NAME, ES)          \
    WL_FV_GLU_KERNEL(NAME, ES, f32, float)   \
    WL_FV_GLU_KERNEL(NAME, ES, f16, wl_u16)

WL_FV_GLU_KERNELS(f16, 2)
WL_FV_GLU_KERNELS(bf16, 2)
WL_FV_GLU_KERNELS(f32, 4)

// q8_quantize_{f32,f16}: one warp per activation block of 32 values (lane i holds value i, so
// the loads and stores are contiguous), written as the 40-byte blocks of wl_q8.cuh (the CPU's
// Q8Block bytes): the same bytes as wl_q8_quantize_block, since neither the maximum nor the
// integer sum depends on the order. f16 inputs are widened first, as the CPU does. Launch with
// 32 threads per block of activations.
extern "C" __global__ void q8_quantize_f32(const float* x, wl_u8* out, wl_u64 n_blocks) {
    wl_u64 b = ((wl_u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (b >= n_blocks) return;  // a whole warp: b is the warp's
    int lane = threadIdx.x % 32;
    wl_q8_quantize_warp(x[b * 32 + lane], out + b * WL_Q8_BLOCK_BYTES, lane);
}

extern "C" __global__ void q8_quantize_f16(const wl_u16* x, wl_u8* out, wl_u64 n_blocks) {
    wl_u64 b = ((wl_u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (b >= n_blocks) return;
    int lane = threadIdx.x % 32;
    wl_q8_quantize_warp(wl_f16_to_f32(x[b * 32 + lane]), out + b * WL_Q8_BLOCK_BYTES, lane);
}

// Tokens one thread carries per pass: each decoded weight group meets this many activations.
#define WL_Q8_NT 4

// q8_matmul_{type}(w, xq, y, rows, cols, n_tok): y[t * rows + r] = the Q8-mode dot of weight
// row r with token t's cols / 32 quantised blocks (from q8_quantize_*). Eight threads per row,
// thread j being lane j of wl_q8.cuh (so each row's sum has the CPU's order), four rows per
// warp; grid.y (at most 65535) strides over the tokens, WL_Q8_NT at a time. A warp whose first
// row is out of range leaves as a whole; a group past the last row recomputes that row and
// stores nothing, so the shuffles always see 32 live lanes. Launch with blockDim.x a multiple
// of 32.
#define WL_Q8_MATMUL(NAME, BS, BB)                                                                 \
    extern "C" __global__ void q8_matmul_##NAME(const wl_u8* w, const wl_u8* xq, float* y,        \
                                                wl_u64 rows, wl_u64 cols, wl_u64 n_tok) {         \
        wl_u64 r = (wl_u64)blockIdx.x * (blockDim.x / 8) + threadIdx.x / 8;                        \
        int j = threadIdx.x % 8;                                                                   \
        if (r - (threadIdx.x % 32) / 8 >= rows) return;                                            \
        int live = r < rows;                                                                       \
        if (!live) r = rows - 1;                                                                   \
        const wl_u8* row = w + r * (cols / (BS)) * (BB);                                           \
        const int al = ((wl_u64)w & 3) == 0;                                                       \
        wl_u64 per_tok = cols / 32;                                                                \
        for (wl_u64 t0 = (wl_u64)blockIdx.y * WL_Q8_NT; t0 < n_tok; t0 += (wl_u64)gridDim.y * WL_Q8_NT) { \
            float acc[WL_Q8_NT], ext[WL_Q8_NT];                                                    \
            for (int k = 0; k < WL_Q8_NT; ++k) acc[k] = ext[k] = 0.0f;                             \
            for (wl_u64 b = 0; b < cols / (BS); ++b) {                                             \
                for (int g = 0; g < (BS) / 32; ++g) {                                              \
                    float dw, mw;                                                                  \
                    wl_u32 w4 = wl_q8w_##NAME(row + b * (BB), g, j, al, &dw, &mw);                 \
                    wl_u64 gi = b * ((BS) / 32) + (wl_u64)g;                                       \
                    for (int k = 0; k < WL_Q8_NT; ++k) {                                           \
                        if (t0 + k < n_tok) {                                                      \
                            const wl_u8* xb = xq + ((t0 + k) * per_tok + gi) * WL_Q8_BLOCK_BYTES;  \
                            wl_q8_step(w4, dw, mw, xb, j, WL_Q8_KIND_##NAME, &acc[k], &ext[k]);    \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int k = 0; k < WL_Q8_NT; ++k) {                                                   \
                /* the tree of wl_q8_finish: lane j + lane j^4, then ^2, then ^1 */                \
                float v = acc[k];                                                                  \
                v = WL_ADD(v, __shfl_xor_sync(0xffffffffu, v, 4));                                 \
                v = WL_ADD(v, __shfl_xor_sync(0xffffffffu, v, 2));                                 \
                v = WL_ADD(v, __shfl_xor_sync(0xffffffffu, v, 1));                                 \
                if (live && j == 0 && t0 + k < n_tok) y[(t0 + k) * rows + r] = WL_ADD(v, ext[k]);  \
            }                                                                                      \
        }                                                                                          \
    }

// q8_matvec_{type}(w, xq, y, rows, cols): decode's product, y[r] = the Q8-mode dot of weight
// row r with one token's quantised blocks, in the order of wl_q8v_lane_* (wl_q8.cuh): a block of
// WL_Q8V_THREADS threads is blockDim.y rows of blockDim.x = 32 * wpr threads (the host picks
// wpr: sources::q8_matvec_warps). Bytes per call: the weights once, which bound it (the
// activations, cols / 32 blocks of 40 bytes, are read by every row from L1/L2). A row past the
// last computes the last row and stores nothing, so every thread reaches the barrier.
#define WL_Q8V_THREADS 256

// One row's sum from its lanes' chains `a` (products) and `e` (extra terms) in the order above:
// each warp's xor butterflies, then the warps' sums added in warp order through `part` (two
// rows of WL_Q8V_THREADS / 32 floats: a block's warps), the extra sum last. Every thread of the
// block calls it (a barrier when wpr > 1); lane 0 of the row gets the row's value.
template <int KIND>
__device__ __forceinline__ float wl_q8v_row_sum(float a, float e,
                                                float (*part)[WL_Q8V_THREADS / 32]) {
    const int wpr = blockDim.x / 32, lane = threadIdx.x, warp = lane / 32;
    for (int o = 16; o > 0; o >>= 1) a = WL_ADD(a, __shfl_xor_sync(0xffffffffu, a, o));
    if (KIND != 0) {
        for (int o = 16; o > 0; o >>= 1) e = WL_ADD(e, __shfl_xor_sync(0xffffffffu, e, o));
    }
    if (wpr > 1) {
        const int slot = threadIdx.y * wpr + warp;
        if (lane % 32 == 0) {
            part[0][slot] = a;
            part[1][slot] = e;
        }
        __syncthreads();
        if (lane == 0) {
            for (int k = 1; k < wpr; ++k) {
                a = WL_ADD(a, part[0][slot + k]);
                e = WL_ADD(e, part[1][slot + k]);
            }
        }
    }
    if (KIND != 0) a = WL_ADD(a, e);
    return a;
}

// Decode's Q8 products for a few tokens in one launch: grid.y is the token, whose activation
// blocks and output row the block moves to; each token's sums are the one-token launch's (a
// few sequences' decode batch, see sources::Q8_WIDE_ALONE_MAX_TOKENS).
#define WL_Q8V_TOKEN(xq, y, rows, cols)                                 \
    xq += (wl_u64)blockIdx.y * ((cols) / 32) * WL_Q8_BLOCK_BYTES;      \
    y += (wl_u64)blockIdx.y * (rows)

#define WL_Q8_MATVEC(NAME, BS, BB)                                                                 \
    __device__ __forceinline__ void wl_q8v_rows_##NAME(const wl_u8* w, const wl_u8* xq, float* y,  \
                                                       wl_u64 rows, wl_u64 cols, wl_u64 blk) {     \
        __shared__ float part[2][WL_Q8V_THREADS / 32];                                             \
        const int wpr = blockDim.x / 32, lane = threadIdx.x;                                       \
        wl_u64 r = blk * blockDim.y + threadIdx.y;                                                 \
        const int live = r < rows;                                                                 \
        if (!live) r = rows - 1;                                                                   \
        WL_Q8V_TOKEN(xq, y, rows, cols);                                                           \
        const int al = (((wl_u64)w | (wl_u64)xq) & 3) == 0;                                        \
        float a, e;                                                                                \
        wl_q8v_lane_##NAME(w + r * (cols / (BS)) * (BB), xq, cols, lane, wpr, al, &a, &e);        \
        a = wl_q8v_row_sum<WL_Q8_KIND_##NAME>(a, e, part);                                         \
        if (live && lane == 0) y[r] = a;                                                           \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(WL_Q8V_THREADS)                                   \
        q8_matvec_##NAME(const wl_u8* w, const wl_u8* xq, float* y, wl_u64 rows, wl_u64 cols) {    \
        wl_q8v_rows_##NAME(w, xq, y, rows, cols, blockIdx.x);                                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(WL_Q8V_THREADS)                                   \
        q8_matvec3_##NAME(const wl_u8* w0, const wl_u8* w1, const wl_u8* w2, const wl_u8* xq,      \
                          float* y0, float* y1, float* y2, wl_u64 rows0, wl_u64 rows1,              \
                          wl_u64 rows2, wl_u64 cols) {                                              \
        WL_GROUP_MEMBER(w, y, rows, blk);                                                          \
        wl_q8v_rows_##NAME(w, xq, y, rows, cols, blk);                                             \
    }

// swiglu_q8_matvec_{type}(wg, wu, xq, y, rows, cols): the gated MLP's first half for one token
// in Q8 mode, y[r] = silu(gate row r . x) * (up row r . x), on activations quantised once
// (q8_quantize_*). Launched as q8_matvec_{type} for the same rows and cols (the same warps a
// row), each row's two sums are that kernel's (every lane runs its gate chains and then its up
// chains, so both rows' loads are in flight before the first shuffle); WL_SILU_MUL then makes
// the product as swiglu_inplace_f32 does. Bytes per call: both weight matrices once.
#define WL_Q8_GLU_MATVEC(NAME, BS, BB)                                                             \
    extern "C" __global__ void __launch_bounds__(WL_Q8V_THREADS)                                   \
        swiglu_q8_matvec_##NAME(const wl_u8* wg, const wl_u8* wu, const wl_u8* xq, float* y,       \
                                wl_u64 rows, wl_u64 cols) {                                        \
        __shared__ float part[2][2][WL_Q8V_THREADS / 32];                                          \
        const int wpr = blockDim.x / 32, lane = threadIdx.x;                                       \
        wl_u64 r = (wl_u64)blockIdx.x * blockDim.y + threadIdx.y;                                  \
        const int live = r < rows;                                                                 \
        if (!live) r = rows - 1;                                                                   \
        WL_Q8V_TOKEN(xq, y, rows, cols);                                                           \
        const int al = (((wl_u64)wg | (wl_u64)wu | (wl_u64)xq) & 3) == 0;                          \
        const wl_u64 off = r * (cols / (BS)) * (BB);                                               \
        float ga, ge, ua, ue;                                                                      \
        wl_q8v_lane_##NAME(wg + off, xq, cols, lane, wpr, al, &ga, &ge);                          \
        wl_q8v_lane_##NAME(wu + off, xq, cols, lane, wpr, al, &ua, &ue);                          \
        /* two shared arrays: no thread writes one while another reads it */                      \
        float g = wl_q8v_row_sum<WL_Q8_KIND_##NAME>(ga, ge, part[0]);                              \
        float u = wl_q8v_row_sum<WL_Q8_KIND_##NAME>(ua, ue, part[1]);                              \
        if (live && lane == 0) y[r] = WL_SILU_MUL(g, u);                                           \
    }

#define WL_Q8_KERNELS(NAME, BS, BB) \
    WL_Q8_MATMUL(NAME, BS, BB)      \
    WL_Q8_MATVEC(NAME, BS, BB)      \
    WL_Q8_GLU_MATVEC(NAME, BS, BB)

WL_Q8_KERNELS(q4_0, 32, 18)
WL_Q8_KERNELS(q4_1, 32, 20)
WL_Q8_KERNELS(q5_0, 32, 22)
WL_Q8_KERNELS(q5_1, 32, 24)
WL_Q8_KERNELS(q8_0, 32, 34)
WL_Q8_KERNELS(q4_k, 256, 144)
WL_Q8_KERNELS(q6_k, 256, 210)

// q8_wide_matvec_{q4_k,q6_k}(w, xq, y, rows, cols) and swiglu_q8_wide_matvec_{q4_k,q6_k}(wg,
// wu, xq, y, rows, cols): decode's product, and its gate and up with SwiGLU, with the wide lanes
// of wl_q8w.cuh (a lane takes 64 values of a block a step). Launched as q8_matvec_{type}:
// blockDim.x = 32 * wpr threads a row (the host picks wpr: sources::q8_wide_matvec_warps),
// blockDim.y rows a block of WL_Q8V_THREADS; the lanes' chains meet in wl_q8v_row_sum. The wide
// loads need the weights aligned to WL_Q8W_WALIGN_{type} + 1 bytes and the activation blocks to
// WL_Q8W_XALIGN_{type} + 1 (Q4_K: 16 and 16, so every 144-byte block is; Q6_K: 2 and 8, its
// quant words realigned on the device); a view at another offset reads byte by byte, the same
// words. Bytes per call: the weights once (both matrices for the fused kernel), rows * 4
// written.
#define WL_Q8W_WALIGN_q4_k 15
#define WL_Q8W_XALIGN_q4_k 15
#define WL_Q8W_WALIGN_q6_k 1
#define WL_Q8W_XALIGN_q6_k 7
#define WL_Q8W_AL(NAME, p, MASK) ((((wl_u64)(p)) & WL_Q8W_##MASK##_##NAME) == 0)

#define WL_Q8W_KERNELS(NAME, BS, BB)                                                               \
    __device__ __forceinline__ void wl_q8w_rows_##NAME(const wl_u8* w, const wl_u8* xq, float* y,  \
                                                       wl_u64 rows, wl_u64 cols, wl_u64 blk) {     \
        __shared__ float part[2][WL_Q8V_THREADS / 32];                                             \
        const int wpr = blockDim.x / 32, lane = threadIdx.x;                                       \
        wl_u64 r = blk * blockDim.y + threadIdx.y;                                                 \
        const int live = r < rows;                                                                 \
        if (!live) r = rows - 1;                                                                   \
        WL_Q8V_TOKEN(xq, y, rows, cols);                                                           \
        const int al = WL_Q8W_AL(NAME, w, WALIGN) && WL_Q8W_AL(NAME, xq, XALIGN);                  \
        float a, e;                                                                                \
        wl_q8w_lane_##NAME(w + r * (cols / (BS)) * (BB), xq, cols, lane, wpr, al, &a, &e);        \
        a = wl_q8v_row_sum<WL_Q8_KIND_##NAME>(a, e, part);                                         \
        if (live && lane == 0) y[r] = a;                                                           \
    }                                                                                              \
    extern "C" __global__ __launch_bounds__(WL_Q8V_THREADS) void q8_wide_matvec_##NAME(            \
        const wl_u8* w, const wl_u8* xq, float* y, wl_u64 rows, wl_u64 cols) {                     \
        wl_q8w_rows_##NAME(w, xq, y, rows, cols, blockIdx.x);                                      \
    }                                                                                              \
    extern "C" __global__ __launch_bounds__(WL_Q8V_THREADS) void q8_wide_matvec3_##NAME(           \
        const wl_u8* w0, const wl_u8* w1, const wl_u8* w2, const wl_u8* xq, float* y0, float* y1,  \
        float* y2, wl_u64 rows0, wl_u64 rows1, wl_u64 rows2, wl_u64 cols) {                        \
        WL_GROUP_MEMBER(w, y, rows, blk);                                                          \
        wl_q8w_rows_##NAME(w, xq, y, rows, cols, blk);                                             \
    }                                                                                              \
    extern "C" __global__ __launch_bounds__(WL_Q8V_THREADS) void swiglu_q8_wide_matvec_##NAME(     \
        const wl_u8* wg, const wl_u8* wu, const wl_u8* xq, float* y, wl_u64 rows, wl_u64 cols) {   \
        __shared__ float part[2][2][WL_Q8V_THREADS / 32];                                          \
        const int wpr = blockDim.x / 32, lane = threadIdx.x;                                       \
        wl_u64 r = (wl_u64)blockIdx.x * blockDim.y + threadIdx.y;                                  \
        const int live = r < rows;                                                                 \
        if (!live) r = rows - 1;                                                                   \
        WL_Q8V_TOKEN(xq, y, rows, cols);                                                           \
        const int al = WL_Q8W_AL(NAME, wg, WALIGN) && WL_Q8W_AL(NAME, wu, WALIGN) &&               \
                       WL_Q8W_AL(NAME, xq, XALIGN);                                                \
        const wl_u64 off = r * (cols / (BS)) * (BB);                                               \
        float ga, ge, ua, ue;                                                                      \
        wl_q8w_lane_##NAME(wg + off, xq, cols, lane, wpr, al, &ga, &ge);                          \
        wl_q8w_lane_##NAME(wu + off, xq, cols, lane, wpr, al, &ua, &ue);                          \
        /* two shared arrays: no thread writes one while another reads it */                      \
        float g = wl_q8v_row_sum<WL_Q8_KIND_##NAME>(ga, ge, part[0]);                              \
        float u = wl_q8v_row_sum<WL_Q8_KIND_##NAME>(ua, ue, part[1]);                              \
        if (live && lane == 0) y[r] = WL_SILU_MUL(g, u);                                           \
    }

WL_Q8W_KERNELS(q4_k, 256, 144)
WL_Q8W_KERNELS(q6_k, 256, 210)

// q8_mma_{type}(w, xq, y, rows, cols, n_tok): q8_matmul_{type}'s product, y[t * rows + r] =
// the Q8-mode dot of weight row r with token t's cols / 32 quantised blocks, on int8 tensor
// cores (compute capability 8.0 and later; below that, and on any architecture the module is
// compiled for before 8.0, the body is empty and the host never launches it). Each group's
// integer dot is one m16n8k32 s8 product of a warp (wl_mmq.cuh); the float epilogue adds the
// groups in order per (token, row): the CPU's prompt tiles' order (its bits past 16 tokens),
// not q8_matmul_'s 8-lane one (within the Q8 mode's bound of it). Grid: x = ceil(rows / 64) blocks of 64 rows,
// y (at most 65535) strides over tiles of 64 tokens; blocks of WL_MMQ_THREADS (four warps, 16
// rows each against all 64 tokens: eight n-blocks). Per pass of WL_MMQ_GROUPS groups the block
// stages the rows' weights unpacked to s8 words (wl_q8w_{type}, one word a thread) with their
// scales and mins, and the tokens' activation blocks, then each warp runs, per group, eight
// products (sixteen for Q6_K's two halves) and their epilogues from shared memory.
//
// Budget: shared memory 2 x 64 x 36 words of staged quants and up to 5 x 256 floats of scales
// (NVRTC's sm_90 build: 22 KiB a block, 24 for the types with a min term); registers: 32
// float chains a thread (8 n-blocks x 4 C registers), 64 with the min term's, and the
// fragments: 79 to 100 registers, 128 with the min term, no stack (the same build), so four
// blocks an SM. Bytes read per call: the weights once per 64-token
// tile, the activation blocks once per 64-row tile (L2 holds both for a layer's shapes). The
// bound it should reach: 2 x rows x cols x n_tok int8 operations on tensor cores (a 2,048 x
// 5,632 product of 512 tokens is 11.8 G: a few microseconds at the H200's int8 rate); the
// staging, one wl_q8w_{type} a word, is what it will wait on. Unmeasured: off by default
// (sources::MMQ_MIN_TOKENS_BY_TYPE).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// D = A B, one m16n8k32 product of s8 operands with s32 accumulators from zero.
__device__ __forceinline__ void wl_mma_16832_s8(int d[4], const wl_u32 a[4], const wl_u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

#define WL_Q8_MMA_BODY(NAME)                                                                       \
    __shared__ wl_u32 s_w[WL_MMQ_W_WORDS];                                                         \
    __shared__ wl_u32 s_x[WL_MMQ_X_WORDS];                                                         \
    __shared__ float s_dw[2 * WL_MMQ_W_GROUPS];                                                    \
    __shared__ float s_mw[WL_MMQ_W_GROUPS];                                                        \
    __shared__ float s_xd[WL_MMQ_X_GROUPS];                                                        \
    __shared__ int s_xs[WL_MMQ_X_GROUPS];                                                          \
    const int tid = (int)threadIdx.x, lane = tid % 32;                                             \
    const int row0 = (tid / 32) * WL_MMQ_WARP_ROWS;                                                \
    const wl_u64 r0 = (wl_u64)blockIdx.x * WL_MMQ_ROWS;                                            \
    const wl_u64 n_groups = cols / 32;                                                             \
    const int wal = ((wl_u64)w & 3) == 0, xal = ((wl_u64)xq & 3) == 0;                             \
    /* a warp whose rows all lie past the end stages its share and multiplies nothing */          \
    const bool live = r0 + (wl_u64)row0 < rows;                                                    \
    for (wl_u64 t0 = (wl_u64)blockIdx.y * WL_MMQ_TOKS; t0 < n_tok;                                 \
         t0 += (wl_u64)gridDim.y * WL_MMQ_TOKS) {                                                  \
        float acc[8][4], ext[8][4];                                                                \
        _Pragma("unroll") for (int nb = 0; nb < 8; nb++) {                                         \
            _Pragma("unroll") for (int reg = 0; reg < 4; reg++) acc[nb][reg] = ext[nb][reg] = 0.0f; \
        }                                                                                          \
        for (wl_u64 g0 = 0; g0 < n_groups; g0 += WL_MMQ_GROUPS) {                                  \
            /* the previous pass's readers are done before it is overwritten */                   \
            __syncthreads();                                                                       \
            for (int e = tid; e < WL_MMQ_ROWS * WL_MMQ_GROUPS * 8; e += WL_MMQ_THREADS) {          \
                wl_mmq_stage_w_##NAME(w, rows, cols, r0, g0, wal, e, s_w, s_dw, s_mw);             \
            }                                                                                      \
            for (int e = tid; e < WL_MMQ_TOKS * WL_MMQ_GROUPS * 10; e += WL_MMQ_THREADS) {         \
                wl_mmq_stage_x(xq, n_tok, n_groups, t0, g0, xal, e, s_x, s_xd, s_xs);              \
            }                                                                                      \
            __syncthreads();                                                                       \
            if (!live) continue;                                                                   \
            const int kn = n_groups - g0 < WL_MMQ_GROUPS ? (int)(n_groups - g0) : WL_MMQ_GROUPS;   \
            for (int kk = 0; kk < kn; kk++) {                                                      \
                _Pragma("unroll") for (int h = 0; h < WL_MMQ_HALVES_##NAME; h++) {                 \
                    wl_u32 a[4];                                                                   \
                    wl_mmq_a_frag(s_w, row0, kk, lane, WL_MMQ_HALVES_##NAME, h, a);                \
                    _Pragma("unroll") for (int nb = 0; nb < 8; nb++) {                             \
                        wl_u32 b[2];                                                               \
                        int c[4];                                                                  \
                        wl_mmq_b_frag(s_x, 8 * nb, kk, lane, b);                                   \
                        wl_mma_16832_s8(c, a, b);                                                  \
                        wl_mmq_epilogue(c, lane, row0, 8 * nb, kk, h, WL_Q8_KIND_##NAME, s_dw,     \
                                        s_mw, s_xd, s_xs, acc[nb], ext[nb]);                       \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        if (!live) continue;                                                                       \
        _Pragma("unroll") for (int nb = 0; nb < 8; nb++) {                                         \
            _Pragma("unroll") for (int reg = 0; reg < 4; reg++) {                                  \
                const wl_u64 r = r0 + (wl_u64)(row0 + wl_mma_c_row(lane, reg));                   \
                const wl_u64 t = t0 + (wl_u64)(8 * nb + wl_mma_c_col(lane, reg));                  \
                if (r < rows && t < n_tok) y[t * rows + r] = WL_ADD(acc[nb][reg], ext[nb][reg]);  \
            }                                                                                      \
        }                                                                                          \
    }
#else
#define WL_Q8_MMA_BODY(NAME)
#endif

#define WL_Q8_MMA(NAME)                                                                            \
    extern "C" __global__ __launch_bounds__(WL_MMQ_THREADS) void q8_mma_##NAME(                    \
        const wl_u8* w, const wl_u8* xq, float* y, wl_u64 rows, wl_u64 cols, wl_u64 n_tok) {       \
        WL_Q8_MMA_BODY(NAME)                                                                       \
    }

WL_Q8_MMA(q4_0)
WL_Q8_MMA(q4_1)
WL_Q8_MMA(q5_0)
WL_Q8_MMA(q5_1)
WL_Q8_MMA(q8_0)
WL_Q8_MMA(q4_k)
WL_Q8_MMA(q6_k)

// gemm_{f32,f16}(wd, x, y, n_rows, cols, n_tok, row0, rows): the dense product of the
// dequantised path. wd holds n_rows dequantised weight rows (f32, cols each: rows row0.. of the
// layer), x the n_tok activation rows; y[t * rows + row0 + r] = dot(wd[r], x[t]). Blocks of
// WL_GEMM_THREADS threads (1-D), each a WL_GEMM_BM x WL_GEMM_BN tile of outputs (the phases
// are in wl_matvec.cuh); grid.x covers the rows, grid.y (at most 65535) strides over token
// tiles.
#define WL_GEMM(ACT, ACT_T)                                                                       \
    extern "C" __global__ void gemm_##ACT(const float* wd, const ACT_T* x, float* y, wl_u64 n_rows, \
                                          wl_u64 cols, wl_u64 n_tok, wl_u64 row0, wl_u64 rows) {  \
        __shared__ float ws[WL_GEMM_BM * WL_GEMM_LD];                                             \
        __shared__ float xs[WL_GEMM_BN * WL_GEMM_LD];                                             \
        int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;                                      \
        wl_u64 rbase = (wl_u64)blockIdx.x * WL_GEMM_BM;                                           \
        for (wl_u64 tbase = (wl_u64)blockIdx.y * WL_GEMM_BN; tbase < n_tok;                       \
             tbase += (wl_u64)gridDim.y * WL_GEMM_BN) {                                           \
            float acc[16];                                                                        \
            WL_UNROLL                                                                             \
            for (int a = 0; a < 16; ++a) acc[a] = 0.0f;                                          \
            for (wl_u64 k0 = 0; k0 < cols; k0 += WL_GEMM_TILE) {                                  \
                int kl = cols - k0 < WL_GEMM_TILE ? (int)(cols - k0) : WL_GEMM_TILE;              \
                wl_gemm_stage_w(tid, ws, wd, n_rows, cols, rbase, k0, kl);                        \
                wl_gemm_stage_x_##ACT(tid, xs, x, n_tok, cols, tbase, k0, kl);                    \
                __syncthreads();                                                                  \
                wl_gemm_compute(tx, ty, ws, xs, kl, acc);                                         \
                __syncthreads();                                                                  \
            }                                                                                     \
            wl_gemm_store(tx, ty, acc, y, n_rows, n_tok, rbase, tbase, row0, rows);               \
        }                                                                                         \
    }

WL_GEMM(f32, float)
WL_GEMM(f16, wl_u16)
