//! What the loader reads from: a tensor table, the files it points into, and zero-copy views of
//! the mapped bytes. `weightlift_format::Checkpoint` is the real implementation.

use std::path::{Path, PathBuf};

use weightlift_format::{Checkpoint, ModelSpec, TensorInfo};

/// A checkpoint as the loader sees it.
pub trait Source: Send + Sync + 'static {
    /// The path the user opened (used in messages).
    fn path(&self) -> &Path;
    /// The tensor table; `TensorInfo::file` indexes [`Source::files`].
    fn tensors(&self) -> &[TensorInfo];
    /// The data files, in order.
    fn files(&self) -> Vec<PathBuf>;
    /// The mapped bytes of tensor `index` (validated against the file bounds by the reader).
    fn bytes(&self, index: usize) -> &[u8];
    /// The architecture, when the checkpoint states one.
    fn spec(&self) -> Option<&ModelSpec>;
    /// The checkpoint itself (format, metadata, config.json), when this source is one.
    fn checkpoint(&self) -> Option<&Checkpoint> {
        None
    }
}

impl Source for Checkpoint {
    fn path(&self) -> &Path {
        Checkpoint::path(self)
    }

    fn tensors(&self) -> &[TensorInfo] {
        Checkpoint::tensors(self)
    }

    fn files(&self) -> Vec<PathBuf> {
        Checkpoint::files(self).map(Path::to_path_buf).collect()
    }

    fn bytes(&self, index: usize) -> &[u8] {
        match Checkpoint::tensors(self).get(index) {
            Some(info) => Checkpoint::bytes(self, info),
            None => &[],
        }
    }

    fn spec(&self) -> Option<&ModelSpec> {
        Checkpoint::spec(self).ok()
    }

    fn checkpoint(&self) -> Option<&Checkpoint> {
        Some(self)
    }
}
