//! Tensor checks shared by the schemes: a tensor with its bytes, and errors that name it.

use std::path::{Path, PathBuf};

use crate::error::hint;
use crate::{Checkpoint, DType, FormatError, Result, TensorInfo};

/// A tensor and its bytes, with errors that name it.
pub(crate) struct Part<'c> {
    pub info: &'c TensorInfo,
    pub bytes: &'c [u8],
    file: &'c Path,
}

impl<'c> Part<'c> {
    pub(crate) fn new(ckpt: &'c Checkpoint, info: &'c TensorInfo) -> Part<'c> {
        Part {
            info,
            bytes: ckpt.bytes(info),
            file: ckpt.files().nth(info.file).unwrap_or(ckpt.path()),
        }
    }

    /// Look a tensor up again at dequantisation time and check it still has the dtype and
    /// shape the linear was validated with (a linear may come from another checkpoint).
    pub(crate) fn sized(
        ckpt: &'c Checkpoint,
        name: &str,
        dtypes: &[DType],
        shape: &[usize],
    ) -> Result<Part<'c>> {
        let part = Part::new(ckpt, ckpt.tensor(name)?);
        expect_dtype(&part, dtypes)?;
        expect_shape(&part, shape, || {
            "what the quantised linear was opened with".into()
        })?;
        Ok(part)
    }

    pub(crate) fn path(&self) -> PathBuf {
        self.file.to_path_buf()
    }

    pub(crate) fn invalid(&self, expected: String, got: String, hint: &'static str) -> FormatError {
        FormatError::Invalid {
            path: self.path(),
            what: format!("tensor '{}'", self.info.name),
            expected,
            got,
            hint,
        }
    }

    fn dims(&self) -> Option<Vec<usize>> {
        self.info
            .shape
            .iter()
            .map(|&d| usize::try_from(d).ok())
            .collect()
    }

    /// The shape of a 2-D tensor.
    pub(crate) fn matrix(&self) -> Result<[usize; 2]> {
        match self.dims().as_deref() {
            Some(&[r, c]) => Ok([r, c]),
            _ => Err(self.invalid(
                "a 2-D tensor".into(),
                format!("shape {:?}", self.info.shape),
                hint::QUANT_TENSORS,
            )),
        }
    }

    /// The length of a 1-D tensor.
    pub(crate) fn vector(&self) -> Result<usize> {
        match self.dims().as_deref() {
            Some(&[n]) => Ok(n),
            _ => Err(self.invalid(
                "a 1-D tensor".into(),
                format!("shape {:?}", self.info.shape),
                hint::QUANT_TENSORS,
            )),
        }
    }
}

/// `<prefix>.<part>`, which a quantised linear must have.
pub(crate) fn lookup<'c>(ckpt: &'c Checkpoint, prefix: &str, part: &str) -> Result<Part<'c>> {
    let name = format!("{prefix}.{part}");
    match ckpt.tensor(&name) {
        Ok(info) => Ok(Part::new(ckpt, info)),
        Err(_) => Err(FormatError::Invalid {
            path: ckpt.path().to_path_buf(),
            what: format!("tensor '{name}'"),
            expected: format!("the {part} of quantised linear '{prefix}'"),
            got: "no such tensor".into(),
            hint: hint::QUANT_TENSORS,
        }),
    }
}

pub(crate) fn expect_dtype(part: &Part<'_>, dtypes: &[DType]) -> Result<()> {
    if dtypes.contains(&part.info.dtype) {
        return Ok(());
    }
    let names: Vec<String> = dtypes.iter().map(|d| d.to_string()).collect();
    Err(part.invalid(
        format!("dtype {}", names.join(" or ")),
        part.info.dtype.to_string(),
        hint::QUANT_TENSORS,
    ))
}

pub(crate) fn expect_shape(
    part: &Part<'_>,
    shape: &[usize],
    why: impl FnOnce() -> String,
) -> Result<()> {
    if part.dims().as_deref() == Some(shape) {
        return Ok(());
    }
    Err(part.invalid(
        format!("shape {shape:?} ({})", why()),
        format!("{:?}", part.info.shape),
        hint::QUANT_CONFIG,
    ))
}
