//! The tensor-parallel pass through the kernels' [`Backend`](weightlift_kernels::Backend) trait: what `cuda:N` devices run,
//! and host devices when [`crate::Model::set_host_backend`] asks (the op sequence a GPU runs,
//! checked on any machine against the host path's bits).
//!
//! Each device runs the single-device backend path's attention and MLP blocks
//! ([`exec::attention`], [`exec::mlp`]) on its share, in its own workspace and cache part. The
//! collectives move the same values as the host path's, in the same order of addition:
//!
//! - **Peer route** (where every pair of devices can copy device to device, as
//!   [`Backend::peer_access`](weightlift_kernels::Backend::peer_access) says, and the context allows it): a residual slice goes straight
//!   into the columns of each receiver's hidden state, and each residual owner receives its
//!   columns of every other device's partial sum into its `recv` region, adding them into `sum`
//!   in source order. Nothing passes through host memory but the embedding and the logits (or
//!   the normed hidden states, which one device of the vocab table computes as the host path
//!   does).
//! - **Host route** (GPUs without peer access): every copy goes through the context's staging
//!   buffers in host memory, 0 and 1 in turn, as the host path's do.
//!
//! On CUDA every copy and kernel is queued on the devices' streams (peer copies ordered by
//! events between them); only the reads into host memory wait. A device's norms and biases are
//! read from f32 copies made on it at build (a few KiB per layer, outside the plan's weights);
//! its matrices are its parts of the split tensors, read in place.

use weightlift_kernels::{CpuBackend, CudaBackend, Op, Rows};

use super::super::exec::{self, AttnShare, Ctx, Exec, PartMut, Regions, kernel_on, view};
use super::super::layer::Consts;
use super::super::parts::{Floats, Linear, Slot, place};
use super::*;

mod batch;
mod collect;
mod parts;
mod rank;

use crate::device::{Buffer, Device, pace_link};
pub(super) use batch::BatchSeq;
use collect::Pass;
pub(super) use parts::{BackendGraph, Backends, floats_on, linear_of};

/// One device's workspace as buffers of its backend: the single-device regions, then the
/// residual slice it owns and the reduction's receive and sum buffers.
pub(super) struct DeviceWork<'a, T> {
    pub(super) r: Regions<'a, T>,
    pub(super) residual: PartMut<'a, T>,
    pub(super) recv: PartMut<'a, T>,
    pub(super) sum: PartMut<'a, T>,
}

fn carve_work<'a, B: Exec>(
    b: &B,
    buf: &'a mut Buffer,
    w: &TpWorkspace,
) -> Result<DeviceWork<'a, B::Buffer>> {
    if (buf.len() as u64) < w.bytes {
        return Err(invalid(
            "tp forward workspace",
            format!("{} bytes of scratch", w.bytes),
            format!(
                "{} bytes reserved; the model was loaded for another runtime or cache",
                buf.len()
            ),
        ));
    }
    let r = |r: weightlift_plan::Region| (r.offset as usize, r.len as usize * 4);
    let tail = [r(w.residual), r(w.recv), r(w.sum)];
    let (regions, parts) = Regions::with_tail(b, buf, &w.base, &tail)?;
    let Ok([residual, recv, sum]) = <[PartMut<'a, B::Buffer>; 3]>::try_from(parts) else {
        return Err(invalid("tp workspace regions", "3", "another count"));
    };
    Ok(DeviceWork {
        r: regions,
        residual,
        recv,
        sum,
    })
}

/// `(&v[s], &mut v[d])` for two different devices.
pub(super) fn pair<T>(v: &mut [Option<T>], s: usize, d: usize) -> Result<(&T, &mut T)> {
    let missing = |x: usize| invalid(format!("tp device {x}"), "a workspace", "none");
    if s == d || s.max(d) >= v.len() {
        return Err(invalid(
            "tp copy",
            "two devices with workspaces",
            format!("{s} and {d}"),
        ));
    }
    let (lo, hi) = v.split_at_mut(s.max(d));
    let (src, dst) = if s < d {
        (lo[s].as_ref(), hi[0].as_mut())
    } else {
        (hi[0].as_ref(), lo[d].as_mut())
    };
    Ok((
        src.ok_or_else(|| missing(s))?,
        dst.ok_or_else(|| missing(d))?,
    ))
}

pub(super) fn work<T>(v: &mut [Option<T>], d: usize) -> Result<&mut T> {
    v.get_mut(d)
        .and_then(Option::as_mut)
        .ok_or_else(|| invalid(format!("tp device {d}"), "a workspace", "none"))
}

impl TpGraph {
    /// Device `d`'s workspace in `buf`, laid out as the plan sized it, with the RoPE
    /// frequencies copied in.
    fn device_work<'a, B: Exec>(
        &self,
        pass: &Pass<'_, B>,
        d: usize,
        buf: &'a mut Buffer,
    ) -> Result<DeviceWork<'a, B::Buffer>> {
        let b = pass.bs[d];
        let mut w = carve_work(b, buf, &self.layouts[d])?;
        let freqs: &[u8] = bytemuck::cast_slice(&self.inv_freqs);
        if b.len(&w.r.freqs) >= freqs.len() {
            b.copy_from_host(freqs, &mut w.r.freqs, 0)
                .map_err(pass.err(d, "rope frequencies"))?;
        }
        Ok(w)
    }

    /// Every device's workspace in `buffers` ([`TpGraph::device_work`]), None for a device whose
    /// layout holds nothing.
    fn device_works<'w, B: Exec>(
        &self,
        pass: &Pass<'_, B>,
        buffers: Vec<Option<&'w mut Buffer>>,
    ) -> Result<Vec<Option<DeviceWork<'w, B::Buffer>>>> {
        buffers
            .into_iter()
            .enumerate()
            .map(|(d, buf)| match buf {
                Some(b) if self.layouts.get(d).is_some_and(|l| l.bytes > 0) => {
                    self.device_work(pass, d, b).map(Some)
                }
                _ => Ok(None),
            })
            .collect()
    }

    /// `xn = RMSNorm(x) · norm` over rows `0..need` of device `d`'s gathered hidden state: the
    /// head's input, for logits and hidden states alike.
    fn out_norm<B: Exec>(
        &self,
        pass: &Pass<'_, B>,
        d: usize,
        (norm, held): (&Floats, &[Held]),
        need: usize,
        r: &mut Regions<'_, B::Buffer>,
    ) -> Result<()> {
        let (b, h) = (pass.bs[d], self.dims.hidden as usize);
        let xs = view(b, &r.x, 0, need * h * 4).map_err(pass.err(d, "output_norm"))?;
        b.run(Op::RmsNorm {
            n_rows: need,
            n_cols: h,
            eps: self.eps,
            x: &xs,
            weight: &*b.floats(norm, held)?,
            out: &mut r.xn,
        })
        .map_err(pass.err(d, "output_norm"))
    }

    /// The constants of the backend op sequence for one forward call.
    pub(super) fn consts(&self, compute: Compute, int8_threshold: f32) -> Consts {
        Consts::new(
            &self.dims,
            (self.eps, self.rope, self.max_dq),
            (compute, int8_threshold),
        )
        .with_family(&self.family)
    }

    /// [`TpGraph::forward`] on the devices' backends.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_backends(
        &self,
        bg: &BackendGraph,
        held: &[Held],
        copies: &[(usize, Held)],
        ctx: &mut TpContext,
        cache: &Arc<Cache>,
        (ids, start, output): (&[u32], usize, Output),
        (compute, int8_threshold): (Compute, f32),
        out: &mut [f32],
    ) -> Result<Copies> {
        if ctx.rank().is_some() {
            let job = rank::RankJob::One(cache, ids, start, output);
            let modes = (compute, int8_threshold);
            return self.forward_rank(bg, (held, copies), ctx, job, modes, out);
        }
        let devices: Vec<Arc<Device>> = ctx.devices().to_vec();
        let allow_peer = ctx.peer_copies();
        // one call per backend type (the pass is generic over it)
        macro_rules! run_on {
            ($bs:expr) => {
                self.run_on(
                    bg,
                    $bs,
                    &devices,
                    allow_peer,
                    held,
                    copies,
                    ctx,
                    cache,
                    (ids, start, output),
                    (compute, int8_threshold),
                    out,
                )
            };
        }
        match &bg.backends {
            Backends::Cpu(v) => run_on!(v.iter().collect::<Vec<&CpuBackend>>()),
            Backends::Cuda => {
                let bs = devices
                    .iter()
                    .map(|d| d.backend())
                    .collect::<Result<Vec<&CudaBackend>>>()?;
                run_on!(bs)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_on<B: Exec>(
        &self,
        bg: &BackendGraph,
        bs: Vec<&B>,
        devices: &[Arc<Device>],
        allow_peer: bool,
        held: &[Held],
        copies: &[(usize, Held)],
        ctx: &mut TpContext,
        cache: &Arc<Cache>,
        (ids, start, output): (&[u32], usize, Output),
        (compute, int8_threshold): (Compute, f32),
        out: &mut [f32],
    ) -> Result<Copies> {
        let s = &self.splits;
        let parts = cache.tp_parts();
        let (mut coll, buffers) = ctx.lend_buffers()?;
        let cpu = Arc::clone(coll.staging_device());
        let pass = Pass::new(bs, devices, cpu, allow_peer);
        let mut ws = self.device_works(&pass, buffers)?;
        let c = self.consts(compute, int8_threshold);
        let cx = |d: usize| Ctx {
            c: &c,
            held,
            copies,
            device: devices[d].name(),
            slot: None,
            pieces: &[],
        };
        let run = self.run(held, copies, compute);
        let (h, vocab) = (c.hidden, self.dims.vocab as usize);
        let mut buffer = 0usize;
        let mut flip = || {
            buffer ^= 1;
            buffer
        };
        let mut done = 0usize;
        for part in ids.chunks(crate::forward::chunk_for(self.dims.tokens, cache)) {
            let n = part.len();
            let pos = start + done;
            let b = flip();
            let (staged, copies) = coll.staging_and_copies(b, n, h)?;
            self.embed_rows(&run, part, staged)?;
            pass.scatter(copies, staged, &mut ws, &s.rs, (n, h))?;
            for (d, w) in ws.iter_mut().enumerate() {
                if let Some(w) = w {
                    exec::positions(pass.bs[d], devices[d].name(), pos, n, &mut w.r)?;
                }
            }
            let attend = [(&parts[..], pos, n)];
            for (li, l) in bg.layers.iter().enumerate() {
                let layer = (s, l, li);
                pass.layer(
                    &mut coll,
                    &mut flip,
                    &mut ws,
                    layer,
                    &cx,
                    &attend,
                    (n, h, held),
                )?;
            }
            cache.appended(pos as u64, part)?;
            let width = output.width(&self.dims);
            let Some((first, rows_out)) = output.chunk_rows((done, n, ids.len()), width, out)
            else {
                done += n;
                continue;
            };
            let need = rows_out.len() / width;
            if output == Output::Hidden {
                // the rows to one device of the vocab table, normed there as the head norms them
                let entry = self.norm_entry()?;
                let d = entry.0;
                let Some((norm, _)) = bg.heads.get(d).and_then(Option::as_ref) else {
                    return Err(invalid("tp head", "a share of the head", "none"));
                };
                let one: SplitTable = vec![entry];
                pass.gather(&mut coll, flip(), &mut ws, (&s.rs, &one), (first, need, h))?;
                let w = work(&mut ws, d)?;
                self.out_norm(&pass, d, (norm, held), need, &mut w.r)?;
                pass.download(&mut coll.copies, d, &w.r.xn, 0, rows_out)?;
                done += n;
                continue;
            }
            pass.gather(&mut coll, flip(), &mut ws, (&s.rs, &s.vc), (first, need, h))?;
            let per = self.dims.logit_rows.max(1) as usize;
            for &(d, a, _) in &s.vc {
                let Some((norm, mat)) = bg.heads.get(d).and_then(Option::as_ref) else {
                    continue;
                };
                let b = pass.bs[d];
                let w = work(&mut ws, d)?;
                self.out_norm(&pass, d, (norm, held), need, &mut w.r)?;
                let mut block = vec![0f32; per.min(need) * mat.rows];
                for r0 in (0..need).step_by(per) {
                    let nr = per.min(need - r0);
                    let xin =
                        view(b, &w.r.xn, r0 * h * 4, nr * h * 4).map_err(pass.err(d, &mat.name))?;
                    cx(d).linear(b, mat, &xin, nr, &mut w.r.logits)?;
                    let got = &mut block[..nr * mat.rows];
                    pass.download(&mut coll.copies, d, &w.r.logits, 0, got)?;
                    for (i, row) in got.chunks_exact(mat.rows).enumerate() {
                        let at = (r0 + i) * vocab + a as usize;
                        rows_out[at..at + mat.rows].copy_from_slice(row);
                    }
                }
            }
            done += n;
        }
        Ok(coll.copies)
    }
}
