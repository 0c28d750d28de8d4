//! safetensors reader (file, folder, sharded index) over mmap, through the official crate.
