// Shared by the CUDA kernels and the host C++ test shim: fixed-width types, f16/bf16 by bit
// manipulation (no cuda_fp16.h), and float arithmetic that is never contracted into FMA, so the
// device, the host compiler and the Rust CPU kernels round identically.
#pragma once

typedef unsigned char wl_u8;
typedef signed char wl_i8;
typedef unsigned short wl_u16;
typedef unsigned int wl_u32;
typedef int wl_i32;
typedef unsigned long long wl_u64;

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define WL_HD __host__ __device__ __forceinline__
#else
#define WL_HD static inline
#endif

// Round-to-nearest multiply/add/subtract that the compiler may not fuse.
#if defined(__CUDA_ARCH__)
#define WL_MUL(a, b) __fmul_rn((a), (b))
#define WL_ADD(a, b) __fadd_rn((a), (b))
#define WL_SUB(a, b) __fsub_rn((a), (b))
#else
#define WL_MUL(a, b) ((a) * (b))
#define WL_ADD(a, b) ((a) + (b))
#define WL_SUB(a, b) ((a) - (b))
#endif

// SwiGLU's product silu(g) * u, silu(g) = g / (1 + e^-g): the one expression of the in-place
// kernel (ops.cu) and of the fused gate/up kernels (matvec.cu), so a device gives them the same
// bits for the same sums. The add is kept apart from the exponential's last step (WL_ADD), so
// no contraction differs between kernels or from the host twin; expf is the device's and the
// host's own (within 2 ulp of each other).
#define WL_SILU_MUL(g, u) WL_MUL((g) / WL_ADD(1.0f, expf(-(g))), (u))

WL_HD float wl_bits_to_f32(wl_u32 u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    union { wl_u32 u; float f; } v;
    v.u = u;
    return v.f;
#endif
}

WL_HD wl_u32 wl_f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    union { wl_u32 u; float f; } v;
    v.f = f;
    return v.u;
#endif
}

// IEEE binary16 bits -> f32, exact (subnormals, infinities, NaN payloads).
WL_HD float wl_f16_to_f32(wl_u16 h) {
    wl_u32 sign = ((wl_u32)(h & 0x8000u)) << 16;
    wl_u32 exp = (h >> 10) & 0x1fu;
    wl_u32 man = h & 0x3ffu;
    if (exp == 0x1fu) {
        return wl_bits_to_f32(sign | 0x7f800000u | (man << 13));
    }
    if (exp == 0u) {
        float v = (float)man * (1.0f / 16777216.0f);  // man * 2^-24, exact
        return wl_bits_to_f32(sign | wl_f32_to_bits(v));
    }
    return wl_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// f16 bits -> f32, exact: the hardware conversion on the device (a float kernel widens every
// weight, and the bit-by-bit form costs several instructions a value), the bit manipulation on
// the host. The two agree on every finite value and infinity; a NaN stays a NaN.
WL_HD float wl_f16_to_f32_fast(wl_u16 h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return wl_f16_to_f32(h);
#endif
}

// f32 -> IEEE binary16 bits, round to nearest even; overflow gives inf, NaN stays NaN.
WL_HD wl_u16 wl_f32_to_f16(float f) {
    wl_u32 x = wl_f32_to_bits(f);
    wl_u32 sign = (x >> 16) & 0x8000u;
    wl_u32 exp = (x >> 23) & 0xffu;
    wl_u32 man = x & 0x7fffffu;
    if (exp == 0xffu) {
        return (wl_u16)(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0u));
    }
    int e = (int)exp - 127 + 15;
    if (e >= 31) {
        return (wl_u16)(sign | 0x7c00u);
    }
    if (e <= 0) {
        if (e < -10) {
            return (wl_u16)sign;  // rounds to zero
        }
        man |= 0x800000u;
        wl_u32 shift = (wl_u32)(14 - e);
        wl_u32 half_m = man >> shift;
        wl_u32 rem = man & ((1u << shift) - 1u);
        wl_u32 halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (half_m & 1u))) {
            half_m += 1u;
        }
        return (wl_u16)(sign | half_m);
    }
    wl_u32 h = sign | ((wl_u32)e << 10) | (man >> 13);
    wl_u32 rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) {
        h += 1u;  // may carry into the exponent, which is the correct rounding
    }
    return (wl_u16)h;
}

WL_HD float wl_bf16_to_f32(wl_u16 h) { return wl_bits_to_f32(((wl_u32)h) << 16); }

// f32 -> bf16 bits, round to nearest even (adding 0x7fff plus the kept half's lowest bit
// carries exactly at the ties that round up); overflow gives inf, and NaN stays a quiet NaN
// (a signalling NaN's payload may lie wholly in the dropped half). The Rust `f32_to_bf16`.
WL_HD wl_u16 wl_f32_to_bf16(float f) {
    wl_u32 x = wl_f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (wl_u16)((x >> 16) | 0x0040u);
    }
    return (wl_u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Little-endian loads from byte pointers. Blocks of 18, 20, 22 or 34 bytes leave their f16
// fields at odd or 2-mod-4 addresses, and a misaligned wide load faults on the GPU (while x86
// forgives it), so every multi-byte field of a block is read a byte at a time.
WL_HD wl_u16 wl_rd_u16(const wl_u8* p) { return (wl_u16)(p[0] | (p[1] << 8)); }

WL_HD float wl_rd_f16(const wl_u8* p) { return wl_f16_to_f32(wl_rd_u16(p)); }

// Whether an f16 bit pattern is NaN or +-inf (all five exponent bits set).
WL_HD int wl_f16_bits_non_finite(wl_u16 h) { return (h & 0x7c00u) == 0x7c00u; }

// The accumulator (C and D) of an m16n8 mma.sync, whatever its k (f16 k16, s8 k32): the row
// and column that register `reg` (0-3) of lane `lane` holds, as the PTX ISA lays them out.
WL_HD int wl_mma_c_row(int lane, int reg) { return lane / 4 + 8 * (reg >> 1); }
WL_HD int wl_mma_c_col(int lane, int reg) { return 2 * (lane % 4) + (reg & 1); }
