//! The collectives of the tensor-parallel pass on the devices' backends: the peer route
//! (device to device) and the host route (through the staging buffers), with every copy
//! counted and paced as the host path's are.

use super::*;

/// One forward call's devices, backends and route.
pub(super) struct Pass<'a, B> {
    pub(super) bs: Vec<&'a B>,
    pub(super) devices: &'a [Arc<Device>],
    pub(super) cpu: Arc<Device>,
    pub(super) peer: bool,
}

impl<'a, B: Exec> Pass<'a, B> {
    /// A pass over the backends `bs` of `devices`, staging through `cpu`; device-to-device
    /// copies when `allow_peer` and every pair of backends can reach each other.
    pub(super) fn new(
        bs: Vec<&'a B>,
        devices: &'a [Arc<Device>],
        cpu: Arc<Device>,
        allow_peer: bool,
    ) -> Self {
        let peer = allow_peer
            && bs.iter().enumerate().all(|(i, a)| {
                bs.iter()
                    .enumerate()
                    .all(|(j, b)| i == j || a.peer_access(b))
            });
        Pass {
            bs,
            devices,
            cpu,
            peer,
        }
    }

    pub(super) fn err(
        &self,
        d: usize,
        what: &str,
    ) -> impl FnOnce(weightlift_kernels::KernelError) -> EngineError {
        let device = self.devices.get(d).map_or("?", |x| x.name()).to_owned();
        let what = what.to_owned();
        move |e| kernel_on(&device, &what, e)
    }

    /// Decoder layer `li` over `n` residual rows on every device: the rows gathered to the
    /// attention devices, attention (each of `seqs`, `(cache parts, first position, tokens)`,
    /// on its own rows and cache part), the partial outputs reduced into the residual, then
    /// the same for the MLP. `flip` gives each gather its staging buffer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer<'c>(
        &self,
        coll: &mut Collectives<'_>,
        flip: &mut impl FnMut() -> usize,
        ws: &mut [Option<DeviceWork<'_, B::Buffer>>],
        (s, l, li): (&Splits, &parts::LayerParts, usize),
        cx: &impl Fn(usize) -> Ctx<'c>,
        seqs: &[(&[crate::cache::TpPart], usize, usize)],
        (n, h, held): (usize, usize, &[Held]),
    ) -> Result<()> {
        self.gather(coll, flip(), ws, (&s.rs, &s.kv), (0, n, h))?;
        for &(d, _, _) in &s.kv {
            let Some(a) = l.attn.get(d).and_then(Option::as_ref) else {
                continue;
            };
            let w = work(ws, d)?;
            a.run_seqs((self.bs[d], &cx(d)), li, seqs, &mut w.r)?;
        }
        let attn_out = (&l.o_bias[..], &l.post_norms[0][..]);
        self.reduce_block(coll, flip, ws, (&s.kv, &s.rs), (n, h), attn_out, cx, held)?;
        let table = l.mlp_table(s);
        self.gather(coll, flip(), ws, (&s.rs, table), (0, n, h))?;
        let lens: Vec<usize> = seqs.iter().map(|q| q.2).collect();
        for &(d, _, _) in table {
            let w = work(ws, d)?;
            if let Some(x) = l.experts.get(d).and_then(Option::as_ref) {
                let mut link = exec::HostLink {
                    rate: self.devices[d].bandwidth(),
                    copies: &mut coll.copies,
                };
                let on = (&x.norm, &x.moe);
                exec::experts_share(
                    self.bs[d],
                    &cx(d),
                    on.0,
                    on.1,
                    li,
                    &lens,
                    &mut w.r,
                    &mut link,
                )?;
                continue;
            }
            let Some(m) = l.mlp.get(d).and_then(Option::as_ref) else {
                continue;
            };
            let mats = [&m.gate, &m.up, &m.down];
            exec::mlp(self.bs[d], &cx(d), &m.norm, mats, li, n, &mut w.r)?;
        }
        let mlp_out = (&l.down_bias[..], &l.post_norms[1][..]);
        self.reduce_block(coll, flip, ws, (table, &s.rs), (n, h), mlp_out, cx, held)
    }

    /// A block's partial sums into the residual: [`Pass::reduce`], or where the block's output
    /// is normed first (gemma's post-norms, `norms` by device), which needs whole rows: the
    /// sum kept apart in each owner's `sum`, all-gathered as whole rows into every owner's
    /// `x`, normed there into `xn`, and each owner's columns of it added to its residual.
    #[allow(clippy::too_many_arguments)]
    fn reduce_block<'c>(
        &self,
        coll: &mut Collectives<'_>,
        flip: &mut impl FnMut() -> usize,
        ws: &mut [Option<DeviceWork<'_, B::Buffer>>],
        (from, rs): (&SplitTable, &SplitTable),
        (n, h): (usize, usize),
        (bias, norms): (&[Option<Floats>], &[Option<Floats>]),
        cx: &impl Fn(usize) -> Ctx<'c>,
        held: &[Held],
    ) -> Result<()> {
        if norms.iter().all(Option::is_none) {
            return self.reduce(coll, ws, (from, rs), (n, h), bias, held);
        }
        self.reduce_sums(coll, ws, (from, rs), (n, h), bias, held, true)?;
        self.gather_columns(coll, flip(), ws, (rs, rs), (0, n, h), true)?;
        for &(d, a, e) in rs {
            let norm = norms.get(d).and_then(Option::as_ref).ok_or_else(|| {
                invalid(
                    format!("tp device {d}"),
                    "a replica of the post-norm",
                    "none",
                )
            })?;
            let cols = (a as usize, (e - a) as usize);
            self.add_normed(d, work(ws, d)?, (n, h, cols), (norm, cx(d).c.eps), held)?;
        }
        Ok(())
    }

    /// Device `d`'s columns `a..a + w` of `RMSNorm(x) · norm` over rows `0..n` of its whole
    /// rows in `x` (normed into `xn`), added to its residual.
    pub(super) fn add_normed(
        &self,
        d: usize,
        dw: &mut DeviceWork<'_, B::Buffer>,
        (n, h, (a, w)): (usize, usize, (usize, usize)),
        (norm, eps): (&Floats, f32),
        held: &[Held],
    ) -> Result<()> {
        let b = self.bs[d];
        let DeviceWork {
            r, residual, recv, ..
        } = dw;
        let xs = view(b, &r.x, 0, n * h * 4).map_err(self.err(d, &norm.name))?;
        b.run(Op::RmsNorm {
            n_rows: n,
            n_cols: h,
            eps,
            x: &xs,
            weight: &*b.floats(norm, held)?,
            out: &mut r.xn,
        })
        .map_err(self.err(d, &norm.name))?;
        let cols = Rows {
            offset: a * 4,
            pitch: h * 4,
        };
        let packed = Rows {
            offset: 0,
            pitch: w * 4,
        };
        b.copy_2d(&r.xn, cols, recv, packed, w * 4, n)
            .map_err(self.err(d, "tp post-norm columns"))?;
        b.run(Op::AddInPlace {
            n: n * w,
            x: residual,
            y: recv,
        })
        .map_err(self.err(d, "tp residual"))
    }

    /// Rows of `width` bytes from device `s` to device `d` (peer route), counted and paced as
    /// one transfer.
    #[allow(clippy::too_many_arguments)]
    fn peer_rows(
        &self,
        copies: &mut Copies,
        (s, src, from): (usize, &B::Buffer, Rows),
        (d, dst, to): (usize, &mut B::Buffer, Rows),
        width: usize,
        rows: usize,
    ) -> Result<()> {
        let since = std::time::Instant::now();
        let (bs, bd) = (self.bs[s], self.bs[d]);
        bs.copy_peer_2d(src, from, bd, dst, to, (width, rows))
            .map_err(self.err(d, "tp peer copy"))?;
        pace_link(
            &self.devices[s],
            &self.devices[d],
            (width * rows) as u64,
            since,
        );
        copies.note((width * rows) as u64, since);
        Ok(())
    }

    /// Host bytes into device `d`'s `dst` at byte `at`, counted and paced as one transfer.
    pub(super) fn upload(
        &self,
        copies: &mut Copies,
        src: &[f32],
        d: usize,
        dst: &mut B::Buffer,
        at: usize,
    ) -> Result<()> {
        let since = std::time::Instant::now();
        self.bs[d]
            .copy_from_host(bytemuck::cast_slice(src), dst, at)
            .map_err(self.err(d, "tp copy from the host"))?;
        pace_link(
            &self.cpu,
            &self.devices[d],
            std::mem::size_of_val(src) as u64,
            since,
        );
        copies.note(std::mem::size_of_val(src) as u64, since);
        Ok(())
    }

    /// Device `s`'s `src` from byte `at` into host `dst`, counted and paced as one transfer.
    pub(super) fn download(
        &self,
        copies: &mut Copies,
        s: usize,
        src: &B::Buffer,
        at: usize,
        dst: &mut [f32],
    ) -> Result<()> {
        let since = std::time::Instant::now();
        self.bs[s]
            .copy_to_host(src, at, bytemuck::cast_slice_mut(dst))
            .map_err(self.err(s, "tp copy to the host"))?;
        pace_link(
            &self.devices[s],
            &self.cpu,
            std::mem::size_of_val(dst) as u64,
            since,
        );
        copies.note(std::mem::size_of_val(dst) as u64, since);
        Ok(())
    }

    /// Host staging `staged` (`n × total`) into the residual slices of the devices of `rs`.
    pub(super) fn scatter(
        &self,
        copies: &mut Copies,
        staged: &[f32],
        ws: &mut [Option<DeviceWork<'_, B::Buffer>>],
        rs: &SplitTable,
        (n, total): (usize, usize),
    ) -> Result<()> {
        let mut block = Vec::new();
        for &(d, a, b) in rs {
            let (a, b) = (a as usize, b as usize);
            block.clear();
            for r in 0..n {
                block.extend_from_slice(&staged[r * total + a..r * total + b]);
            }
            let w = work(ws, d)?;
            self.upload(copies, &block, d, &mut w.residual, 0)?;
        }
        Ok(())
    }

    /// Residual rows `first..first + n` (over `rs`) into rows `0..n` of `x` on every device of
    /// `tb`.
    pub(super) fn gather(
        &self,
        coll: &mut Collectives<'_>,
        buffer: usize,
        ws: &mut [Option<DeviceWork<'_, B::Buffer>>],
        tables: (&SplitTable, &SplitTable),
        rows: (usize, usize, usize),
    ) -> Result<()> {
        self.gather_columns(coll, buffer, ws, tables, rows, false)
    }

    /// [`Pass::gather`] of the owners' residual columns, or (`sums`) of the sums
    /// [`Pass::reduce_sums`] kept apart.
    fn gather_columns(
        &self,
        coll: &mut Collectives<'_>,
        buffer: usize,
        ws: &mut [Option<DeviceWork<'_, B::Buffer>>],
        (rs, tb): (&SplitTable, &SplitTable),
        (first, n, h): (usize, usize, usize),
        sums: bool,
    ) -> Result<()> {
        if self.peer {
            for &(d, _, _) in tb {
                for &(s, a, b) in rs {
                    let w = (b - a) as usize;
                    if w == 0 {
                        continue;
                    }
                    let from = Rows {
                        offset: first * w * 4,
                        pitch: w * 4,
                    };
                    let to = Rows {
                        offset: a as usize * 4,
                        pitch: h * 4,
                    };
                    if s == d {
                        let DeviceWork {
                            r, residual, sum, ..
                        } = work(ws, d)?;
                        let src = if sums { sum } else { residual };
                        self.bs[d]
                            .copy_2d(src, from, &mut r.x, to, w * 4, n)
                            .map_err(self.err(d, "tp residual gather"))?;
                    } else {
                        let (src, dst) = pair(ws, s, d)?;
                        let dst = &mut dst.r.x;
                        let src = if sums { &src.sum } else { &src.residual };
                        self.peer_rows(&mut coll.copies, (s, src, from), (d, dst, to), w * 4, n)?;
                    }
                }
            }
            return Ok(());
        }
        let mut block = Vec::new();
        for &(s, a, b) in rs {
            let w = (b - a) as usize;
            block.clear();
            block.resize(n * w, 0.0);
            let owner = work(ws, s)?;
            let src = if sums { &owner.sum } else { &owner.residual };
            self.download(&mut coll.copies, s, src, first * w * 4, &mut block)?;
            let staged = coll.staging(buffer, n, h)?;
            for r in 0..n {
                staged[r * h + a as usize..r * h + b as usize]
                    .copy_from_slice(&block[r * w..(r + 1) * w]);
            }
        }
        let (staged, copies) = coll.staging_and_copies(buffer, n, h)?;
        for &(d, _, _) in tb {
            let x = &mut work(ws, d)?.r.x;
            self.upload(copies, staged, d, x, 0)?;
        }
        Ok(())
    }

    /// The partial sums in `xn` of the devices of `from` reduced into the residual slices of
    /// `rs`: each owner sums its columns of every partial in source order, adds the sum to
    /// its residual, then its columns of `bias` (by device).
    pub(super) fn reduce(
        &self,
        coll: &mut Collectives<'_>,
        ws: &mut [Option<DeviceWork<'_, B::Buffer>>],
        tables: (&SplitTable, &SplitTable),
        rows: (usize, usize),
        bias: &[Option<Floats>],
        held: &[Held],
    ) -> Result<()> {
        self.reduce_sums(coll, ws, tables, rows, bias, held, false)
    }

    /// [`Pass::reduce`], or kept `apart`: each owner's sum (and its columns of `bias`) stays in
    /// its `sum` instead of joining its residual.
    #[allow(clippy::too_many_arguments)]
    fn reduce_sums(
        &self,
        coll: &mut Collectives<'_>,
        ws: &mut [Option<DeviceWork<'_, B::Buffer>>],
        (from, rs): (&SplitTable, &SplitTable),
        (n, h): (usize, usize),
        bias: &[Option<Floats>],
        held: &[Held],
        apart: bool,
    ) -> Result<()> {
        // host route: each source's partial, read once
        let mut partials: Vec<Option<Vec<f32>>> = vec![None; ws.len()];
        for &(d, a, b) in rs {
            let (a, w) = (a as usize, (b - a) as usize);
            if w == 0 {
                continue;
            }
            let src_cols = Rows {
                offset: a * 4,
                pitch: h * 4,
            };
            let packed = Rows {
                offset: 0,
                pitch: w * 4,
            };
            for (k, &(s, _, _)) in from.iter().enumerate() {
                if s == d {
                    let DeviceWork { r, recv, sum, .. } = work(ws, d)?;
                    let dst = if k == 0 { sum } else { recv };
                    self.bs[d]
                        .copy_2d(&r.xn, src_cols, dst, packed, w * 4, n)
                        .map_err(self.err(d, "tp partial sum"))?;
                } else if self.peer {
                    let (src, dst) = pair(ws, s, d)?;
                    let dst = if k == 0 { &mut dst.sum } else { &mut dst.recv };
                    self.peer_rows(
                        &mut coll.copies,
                        (s, &src.r.xn, src_cols),
                        (d, dst, packed),
                        w * 4,
                        n,
                    )?;
                } else {
                    if partials[s].is_none() {
                        let mut all = vec![0f32; n * h];
                        let src = &work(ws, s)?.r.xn;
                        self.download(&mut coll.copies, s, src, 0, &mut all)?;
                        partials[s] = Some(all);
                    }
                    let all = partials[s].as_deref().unwrap_or_default();
                    let block: Vec<f32> = (0..n)
                        .flat_map(|r| all[r * h + a..r * h + a + w].iter().copied())
                        .collect();
                    let DeviceWork { recv, sum, .. } = work(ws, d)?;
                    let dst = if k == 0 { sum } else { recv };
                    self.upload(&mut coll.copies, &block, d, dst, 0)?;
                }
                if k > 0 {
                    let DeviceWork { recv, sum, .. } = work(ws, d)?;
                    self.bs[d]
                        .run(Op::AddInPlace {
                            n: n * w,
                            x: sum,
                            y: recv,
                        })
                        .map_err(self.err(d, "tp partial sum"))?;
                }
            }
            let b = self.bs[d];
            let DeviceWork { residual, sum, .. } = work(ws, d)?;
            if !from.is_empty() && !apart {
                b.run(Op::AddInPlace {
                    n: n * w,
                    x: &mut *residual,
                    y: &*sum,
                })
                .map_err(self.err(d, "tp residual"))?;
            }
            let to = if apart { sum } else { residual };
            if let Some(f) = bias.get(d).and_then(Option::as_ref) {
                b.run(Op::AddBias {
                    n_rows: n,
                    n_cols: w,
                    x: to,
                    bias: &*b.floats(f, held)?,
                })
                .map_err(self.err(d, "tp bias"))?;
            }
        }
        Ok(())
    }
}
