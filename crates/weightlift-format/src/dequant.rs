//! Scalar reference dequantisation to f32: the oracle for the fast kernels.
