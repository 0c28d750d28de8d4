//! The hidden state crossing a device boundary: copied from one site's residual stream to the
//! next, between host memories or through the host to and from CUDA memory.

use std::sync::Arc;

use weightlift_kernels::Backend;

use super::Copies;
use super::exec::kernel_on;
use super::work::Work;
use crate::device::{Device, pace_link};
use crate::error::{Result, invalid};

/// The residual stream of a site as host bytes, where it is host memory.
fn x_host<'w>(w: &'w Work<'_>) -> Option<&'w [u8]> {
    match w {
        Work::Host(v) => Some(bytemuck::cast_slice(&*v.x)),
        Work::Cpu(_, r) => Some(r.x.as_bytes()),
        Work::Cuda(..) => None,
    }
}

/// As [`x_host`], mutably.
fn x_host_mut<'w>(w: &'w mut Work<'_>) -> Option<&'w mut [u8]> {
    match w {
        Work::Host(v) => Some(bytemuck::cast_slice_mut(&mut *v.x)),
        Work::Cpu(_, r) => Some(r.x.as_bytes_mut()),
        Work::Cuda(..) => None,
    }
}

/// Copies `dst.len()` bytes of a device's residual stream at byte `offset` to the host.
fn read_x(w: &Work<'_>, name: &str, offset: usize, dst: &mut [u8]) -> Result<()> {
    match w {
        Work::Cuda(b, r) => b
            .copy_to_host(&r.x, offset, dst)
            .map_err(|e| kernel_on(name, "copying the hidden state out", e)),
        _ => {
            let src = x_host(w).and_then(|x| x.get(offset..offset + dst.len()));
            let src = src.ok_or_else(|| invalid("hidden state copy", "in range", offset))?;
            dst.copy_from_slice(src);
            Ok(())
        }
    }
}

/// Copies host bytes into a device's residual stream at byte `offset`.
fn write_x(w: &mut Work<'_>, name: &str, offset: usize, src: &[u8]) -> Result<()> {
    match w {
        Work::Cuda(b, r) => b
            .copy_from_host(src, &mut r.x, offset)
            .map_err(|e| kernel_on(name, "copying the hidden state in", e)),
        _ => {
            let dst = x_host_mut(w).and_then(|x| x.get_mut(offset..offset + src.len()));
            let dst = dst.ok_or_else(|| invalid("hidden state copy", "in range", offset))?;
            dst.copy_from_slice(src);
            Ok(())
        }
    }
}

/// Copy `len` values of the residual stream at `offset` from site `from` to site `to`: a
/// memcpy between host memories, or through the CUDA backend's copies to and from the host.
pub(super) fn move_rows(
    works: &mut [Work<'_>],
    devs: &[Arc<Device>],
    from: usize,
    to: usize,
    offset: usize,
    len: usize,
    copies: &mut Copies,
) -> Result<()> {
    let (src, dst) = if from < to {
        let (a, b) = works.split_at_mut(to);
        (&a[from], &mut b[0])
    } else {
        let (a, b) = works.split_at_mut(from);
        (&b[0], &mut a[to])
    };
    let since = std::time::Instant::now();
    let (at, bytes) = (offset * 4, len * 4);
    let (sn, dn) = (devs[from].name(), devs[to].name());
    if let Some(s) = x_host(src) {
        let s = s
            .get(at..at + bytes)
            .ok_or_else(|| invalid("hidden state copy", "in range", at))?;
        write_x(dst, dn, at, s)?;
    } else if let Some(d) = x_host_mut(dst) {
        let d = d
            .get_mut(at..at + bytes)
            .ok_or_else(|| invalid("hidden state copy", "in range", at))?;
        read_x(src, sn, at, d)?;
    } else {
        let mut tmp = vec![0u8; bytes];
        read_x(src, sn, at, &mut tmp)?;
        write_x(dst, dn, at, &tmp)?;
    }
    pace_link(&devs[from], &devs[to], bytes as u64, since);
    copies.note(bytes as u64, since);
    Ok(())
}
