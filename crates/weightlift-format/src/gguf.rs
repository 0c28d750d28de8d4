//! GGUF v2/v3 reader over mmap (single and split files).
