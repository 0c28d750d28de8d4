//! CPU kernels (rayon + std::arch SIMD, scalar fallback) and the CUDA backend, behind one Backend trait.
