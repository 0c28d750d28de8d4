//! `check_tensors`: a multi-threaded NaN/Inf scan.
