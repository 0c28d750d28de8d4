//! Read-only memory maps of checkpoint files.

// mmap is the one unsafe operation of this crate; see the SAFETY note below.
#![allow(unsafe_code)]

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{FormatError, Result};

/// A checkpoint file mapped read-only. Nothing is read until a byte is touched.
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    /// `None` for an empty file, which cannot be mapped.
    map: Option<Mmap>,
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| FormatError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the map is read-only and private to this process. Another process
            // truncating the file while it is mapped would turn reads into SIGBUS; that is the
            // documented contract of every mmap-based loader (llama.cpp, safetensors), and
            // checkpoints are not rewritten in place.
            Some(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }
}

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}
