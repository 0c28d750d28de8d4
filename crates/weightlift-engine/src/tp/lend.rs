//! The collectives of the tensor-parallel forward pass, over f32 rows in the devices' own
//! memory: what [`TpContext::lend`] hands the forward pass for one call. Every transfer between
//! two devices is one [`Collective::copy_host`] (a real copy between the two memories) and is
//! counted; host-side assembly goes through the context's two staging buffers, the caller
//! naming which (exllamav2 alternates buffer 0 and 1 between consecutive collectives, so one
//! can be read while the next fills).
//!
//! Rows are token-major: a tensor of table `t` on device `(d, a, b)` is `n × (b - a)` values,
//! the whole tensor `n × end` values (`end` the table's last bound, cut at `total` where the
//! table is padded past the real width, as the vocab table is).

use std::sync::Arc;
use std::time::Instant;

use super::{Collective, SplitTable, TpContext};
use crate::device::{Buffer, Device};
use crate::error::{Result, invalid};
use crate::forward::Copies;

/// The collectives of one forward call, with the copies they made.
pub struct Collectives<'a> {
    collective: &'a dyn Collective,
    devices: &'a [Arc<Device>],
    cpu: &'a Arc<Device>,
    staging: [&'a mut [f32]; 2],
    pub copies: Copies,
}

/// Per-device scratch bytes lent with the collectives (`None` where none was reserved).
pub type ScratchViews<'a> = Vec<Option<&'a mut [u8]>>;

impl TpContext {
    /// Lend the collectives and every device's scratch (by table device index) for one forward
    /// call. Needs [`TpContext::finalize`] first, and host-addressable staging and scratch.
    pub fn lend(&mut self) -> Result<(Collectives<'_>, ScratchViews<'_>)> {
        let (coll, buffers) = self.lend_buffers()?;
        let scratch = buffers
            .into_iter()
            .map(|b| b.and_then(Buffer::host_mut))
            .collect();
        Ok((coll, scratch))
    }

    /// As [`TpContext::lend`], with each device's scratch as the buffer it is (device memory
    /// on a GPU): what the pass through the kernels' backends computes in.
    pub fn lend_buffers(&mut self) -> Result<(Collectives<'_>, Vec<Option<&mut Buffer>>)> {
        let cpu = self
            .staging_device
            .as_ref()
            .ok_or_else(|| crate::EngineError::NotLoaded {
                what: "the tp staging buffers (finalize the TPContext first)".into(),
            })?;
        let [a, b] = self.staging.as_mut_slice() else {
            return Err(crate::EngineError::NotLoaded {
                what: "the tp staging buffers (finalize the TPContext first)".into(),
            });
        };
        let staging = [
            f32s(a.host_mut(), "staging")?,
            f32s(b.host_mut(), "staging")?,
        ];
        let scratch = self.scratch.iter_mut().map(|s| s.buffer.as_mut()).collect();
        Ok((
            Collectives {
                collective: self.collective.as_ref(),
                devices: &self.devices,
                cpu,
                staging,
                copies: Copies::default(),
            },
            scratch,
        ))
    }
}

fn f32s<'a>(b: Option<&'a mut [u8]>, what: &str) -> Result<&'a mut [f32]> {
    let b =
        b.ok_or_else(|| invalid(format!("tp {what} buffer"), "host memory", "device memory"))?;
    bytemuck::try_cast_slice_mut(b)
        .map_err(|e| invalid(format!("tp {what} buffer"), "4-byte aligned", e))
}

/// Column range `a..b` of table entry, cut at `total`.
fn cols(a: u64, b: u64, total: usize) -> (usize, usize) {
    ((a as usize).min(total), (b as usize).min(total))
}

impl<'a> Collectives<'a> {
    /// The transport, for the rank-level collectives of a multi-process pass.
    pub fn transport(&self) -> &'a dyn Collective {
        self.collective
    }

    /// The device the staging buffers live on (host memory).
    pub fn staging_device(&self) -> &Arc<Device> {
        self.cpu
    }

    fn device(&self, d: usize) -> Result<&Arc<Device>> {
        self.devices.get(d).ok_or_else(|| {
            invalid(
                "tp device index",
                format!("below {}", self.devices.len()),
                d,
            )
        })
    }

    /// Copy `src` (on `from`) into `dst` (on `to`), counted as one transfer.
    fn copy(&mut self, src: &[f32], from: &Device, dst: &mut [f32], to: &Device) -> Result<()> {
        let since = Instant::now();
        self.collective.copy_host(
            bytemuck::cast_slice(src),
            from,
            bytemuck::cast_slice_mut(dst),
            to,
        )?;
        self.copies.note(std::mem::size_of_val(src) as u64, since);
        Ok(())
    }

    /// Staging buffer `buffer` as `n × total` values (the caller writes the whole of it).
    pub fn staging(&mut self, buffer: usize, n: usize, total: usize) -> Result<&mut [f32]> {
        self.staging_and_copies(buffer, n, total).map(|(s, _)| s)
    }

    /// [`Collectives::staging`] with the copy count beside it, to copy out of the buffer and
    /// count those copies without a copy of the buffer.
    pub fn staging_and_copies(
        &mut self,
        buffer: usize,
        n: usize,
        total: usize,
    ) -> Result<(&mut [f32], &mut Copies)> {
        let len = self.staging.get(buffer).map_or(0, |s| s.len());
        let staged = self
            .staging
            .get_mut(buffer)
            .and_then(|s| s.get_mut(..n * total))
            .ok_or_else(|| {
                invalid(
                    format!("tp staging buffer {buffer}"),
                    format!("{} values", n * total),
                    format!("{len}; the model was loaded for another runtime"),
                )
            })?;
        Ok((staged, &mut self.copies))
    }

    /// Copy each device's columns of staging buffer `buffer` (`n × total`, host memory) into
    /// `dsts` (one per entry of `table`, `n × (b - a)` each).
    pub fn scatter(
        &mut self,
        buffer: usize,
        n: usize,
        total: usize,
        table: &SplitTable,
        dsts: &mut [&mut [f32]],
    ) -> Result<()> {
        check_len("scatter", table, dsts.len())?;
        let mut block = Vec::new();
        for (&(d, a, b), dst) in table.iter().zip(dsts.iter_mut()) {
            let (a, b) = cols(a, b, total);
            let w = b - a;
            let src = self.staging(buffer, n, total)?;
            // One transfer per device: the slice's rows, packed on the host side first.
            block.clear();
            for r in 0..n {
                block.extend_from_slice(&src[r * total + a..r * total + b]);
            }
            let to = Arc::clone(self.device(d)?);
            let cpu = Arc::clone(self.cpu);
            self.copy(&block, &cpu, &mut dst[..n * w], &to)?;
        }
        Ok(())
    }

    /// Gather `srcs` (one per entry of `table`, `n × (b - a)` each, on its device) into
    /// staging buffer `buffer` as `n × total` values, and return that buffer.
    pub fn gather(
        &mut self,
        buffer: usize,
        n: usize,
        total: usize,
        table: &SplitTable,
        srcs: &[&[f32]],
    ) -> Result<&[f32]> {
        check_len("gather", table, srcs.len())?;
        let mut block = Vec::new();
        for (&(d, a, b), src) in table.iter().zip(srcs) {
            let (a, b) = cols(a, b, total);
            let w = b - a;
            block.clear();
            block.resize(n * w, 0.0);
            let from = Arc::clone(self.device(d)?);
            let cpu = Arc::clone(self.cpu);
            self.copy(&src[..n * w], &from, &mut block, &cpu)?;
            let dst = self.staging(buffer, n, total)?;
            for r in 0..n {
                dst[r * total + a..r * total + b].copy_from_slice(&block[r * w..(r + 1) * w]);
            }
        }
        Ok(self.staging(buffer, n, total)?)
    }

    /// Gather `srcs` over `tg` into staging buffer `buffer`, then copy the whole `n × total`
    /// to every device of `tb` (`dsts`, one per entry).
    #[allow(clippy::too_many_arguments)]
    pub fn allgather(
        &mut self,
        buffer: usize,
        n: usize,
        total: usize,
        tg: &SplitTable,
        srcs: &[&[f32]],
        tb: &SplitTable,
        dsts: &mut [&mut [f32]],
    ) -> Result<()> {
        check_len("allgather", tb, dsts.len())?;
        self.gather(buffer, n, total, tg, srcs)?;
        let cpu = Arc::clone(self.cpu);
        for (&(d, _, _), dst) in tb.iter().zip(dsts.iter_mut()) {
            let to = Arc::clone(self.device(d)?);
            let len = n * total;
            let staged = std::mem::take(&mut self.staging[buffer]);
            let r = self.copy(&staged[..len], &cpu, &mut dst[..len], &to);
            self.staging[buffer] = staged;
            r?;
        }
        Ok(())
    }

    /// Reduce the partial sums `srcs` (`(device, n × total values)` each) into the residual
    /// stream held by `table` (`residual`, one per entry, `n × (b - a)`): each residual device
    /// receives its columns of every other device's partial into its `recv` buffer (one copy
    /// per pair), sums the partials in source order into `sum`, and adds that to its residual
    /// once, as a single device adds its whole product.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter(
        &mut self,
        n: usize,
        total: usize,
        srcs: &[(usize, &[f32])],
        table: &SplitTable,
        residual: &mut [&mut [f32]],
        recv: &mut [&mut [f32]],
        sums: &mut [&mut [f32]],
    ) -> Result<()> {
        check_len("reduce", table, residual.len())?;
        check_len("reduce", table, recv.len())?;
        check_len("reduce", table, sums.len())?;
        let mut block = Vec::new();
        let entries = table.iter().zip(residual.iter_mut()).zip(recv.iter_mut());
        for (((&(d, a, b), res), rcv), sum) in entries.zip(sums.iter_mut()) {
            let (a, b) = cols(a, b, total);
            let w = b - a;
            let to = Arc::clone(self.device(d)?);
            let sum = &mut sum[..n * w];
            for (k, &(s, part)) in srcs.iter().enumerate() {
                // The source device packs its columns; another device's come in one copy.
                block.clear();
                for r in 0..n {
                    block.extend_from_slice(&part[r * total + a..r * total + b]);
                }
                let add: &[f32] = if s == d {
                    &block
                } else {
                    let from = Arc::clone(self.device(s)?);
                    self.copy(&block, &from, &mut rcv[..n * w], &to)?;
                    &rcv[..n * w]
                };
                if k == 0 {
                    sum.copy_from_slice(add);
                } else {
                    sum.iter_mut().zip(add).for_each(|(x, y)| *x += y);
                }
            }
            if !srcs.is_empty() {
                res[..n * w]
                    .iter_mut()
                    .zip(&*sum)
                    .for_each(|(x, y)| *x += y);
            }
        }
        Ok(())
    }
}

fn check_len(what: &str, table: &SplitTable, got: usize) -> Result<()> {
    if table.len() != got {
        return Err(invalid(
            format!("tp {what}"),
            format!("{} tensors, one per device of the table", table.len()),
            got,
        ));
    }
    Ok(())
}
