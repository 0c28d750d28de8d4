// quantize_{type}_{src}: quantise-on-load of float rows (f32, f16 or bf16 bytes) into ggml
// blocks, one thread per block, each running the shared block quantiser of wl_quantize.cuh
// (the bytes of the CPU's quantize_rows_from, checked by the host twin).
//
// (src, dst, n_blocks, first, found): src holds n_blocks blocks' worth of source values, dst
// n_blocks blocks; `first` is the index of src's first value in the tensor, and a block with a
// NaN or +-inf leaves its report (wl_qz_report, first non-finite value, tensor index) in
// `*found` by atomicMax, which must hold 0 before the tensor's first launch.
//
// Bound: each call reads its source once and writes its blocks once, but arithmetic dominates:
// the legacy types and Q8_0 cost tens of float operations a value, Q4_K's 21-scale fits and
// Q6_K's 19 about 200, so a K-quant launch is compute-bound, far below the device's copy
// bandwidth (unmeasured: the e2e q4_k load time says whether it keeps up with the upload).
// One thread a block keeps every block's operations in the CPU's order; the blocks are
// independent, so a row is spread over as many threads as it has blocks.
#include "wl_quantize.cuh"

#define WL_QZ_THREADS 128

#define WL_QUANTIZE(NAME, TY, SRC_NAME, SRC)                                                    \
    extern "C" __global__ void __launch_bounds__(WL_QZ_THREADS)                                 \
        quantize_##NAME##_##SRC_NAME(const wl_u8* src, wl_u8* dst, wl_u64 n_blocks, wl_u64 first, \
                                     wl_u64* found) {                                           \
        wl_u64 b = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                               \
        if (b >= n_blocks) return;                                                              \
        wl_u64 report = wl_quantize_block(TY, SRC, src, dst, b, first);                         \
        if (report != 0) atomicMax(found, report);                                              \
    }

#define WL_QUANTIZE_FROM(NAME, TY)          \
    WL_QUANTIZE(NAME, TY, f32, WL_F32)      \
    WL_QUANTIZE(NAME, TY, f16, WL_F16)      \
    WL_QUANTIZE(NAME, TY, bf16, WL_BF16)

WL_QUANTIZE_FROM(q4_0, WL_Q4_0)
WL_QUANTIZE_FROM(q4_1, WL_Q4_1)
WL_QUANTIZE_FROM(q5_0, WL_Q5_0)
WL_QUANTIZE_FROM(q5_1, WL_Q5_1)
WL_QUANTIZE_FROM(q8_0, WL_Q8_0)
WL_QUANTIZE_FROM(q4_k, WL_Q4_K)
WL_QUANTIZE_FROM(q6_k, WL_Q6_K)
