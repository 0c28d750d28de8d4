//! One rank of a multi-process tensor-parallel pass: this process holds and computes only its
//! table device's shares, and meets the other ranks through the transport's rank-level
//! collectives (NCCL across processes and machines, [`crate::tp::ThreadGroup`] for ranks run as
//! threads). Every rank makes the same sequence of calls, whatever its shares:
//!
//! - The embedding rows are looked up by every rank (the embedding is whole on each host);
//!   each keeps its residual columns.
//! - Before attention, the MLP and the head, the residual is all-gathered: rank `r`
//!   contributes its columns of every row as block `r`, and every rank lays the blocks out
//!   as whole rows.
//! - After attention and the MLP, each rank's partial sum (zeros where it has no share) is cut
//!   into the residual owners' column blocks and reduce-scattered: each owner receives its
//!   block summed over the ranks in rank order, the order the single-process pass adds them
//!   in, adds it to its residual and then its columns of the bias.
//! - The logits' vocabulary rows are all-gathered, so every rank returns every logit. Hidden
//!   states instead of logits: the rows are all-gathered to every rank, each norms them with
//!   its replica of the output norm, and every rank returns the same rows.
//!
//! The collectives run on host f32 values: the pass copies the device's slices out and back
//! around each one (NCCL stages them on its own device).

use super::*;
use crate::tp::{Collective, RankSlice};

/// Per rank: how many of `table`'s `0..limit` it owns (0 for a rank the table leaves out).
fn widths(table: &SplitTable, world: usize, limit: u64) -> Vec<usize> {
    let mut w = vec![0usize; world];
    for &(d, a, b) in table {
        if let Some(x) = w.get_mut(d) {
            *x = (b.min(limit) - a.min(limit)) as usize;
        }
    }
    w
}

/// `table`'s start of rank `r`'s range (cut at `limit`), where it has one.
fn start_of(table: &SplitTable, r: usize, limit: u64) -> Option<usize> {
    table
        .iter()
        .find(|e| e.0 == r)
        .map(|e| e.1.min(limit) as usize)
}

/// This rank's place in one pass: its backend (through [`Pass`], indexed by the rank), the
/// transport, and a host buffer the collectives' blocks are laid out through.
struct RankPass<'p, 'a, B> {
    pass: &'p Pass<'a, B>,
    rank: usize,
    world: usize,
    transport: &'p dyn Collective,
    held: &'p [Held],
    /// Residual columns per rank, and where each rank's columns start.
    rs: (Vec<usize>, Vec<usize>),
    host: Vec<f32>,
}

impl<B: Exec> RankPass<'_, '_, B> {
    fn slice<'v>(&'v self, values: &'v mut [f32]) -> [RankSlice<'v>; 1] {
        [RankSlice {
            rank: self.rank,
            device: &self.pass.devices[self.rank],
            values,
        }]
    }

    /// Every rank's residual rows `first..first + n` into `x` (when `into_x`), as whole rows.
    fn gather(
        &mut self,
        coll: &mut Collectives<'_>,
        buffer: usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        rows: (usize, usize, usize),
        into_x: bool,
    ) -> Result<()> {
        self.gather_columns(coll, buffer, w, rows, into_x, false)
    }

    /// [`RankPass::gather`] of the ranks' residual columns, or (`sums`) of the sums
    /// [`RankPass::reduce_sums`] kept apart.
    fn gather_columns(
        &mut self,
        coll: &mut Collectives<'_>,
        buffer: usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        (first, n, h): (usize, usize, usize),
        into_x: bool,
        sums: bool,
    ) -> Result<()> {
        let counts: Vec<usize> = self.rs.0.iter().map(|c| c * n).collect();
        let own: usize = counts[..self.rank].iter().sum();
        let mine = counts[self.rank];
        let since = {
            let (values, copies) = coll.staging_and_copies(buffer, n, h)?;
            if mine > 0 {
                let at = first * self.rs.0[self.rank] * 4;
                let dst = &mut values[own..own + mine];
                let src = if sums { &w.sum } else { &w.residual };
                self.pass.download(copies, self.rank, src, at, dst)?;
            }
            let since = std::time::Instant::now();
            self.transport
                .all_gather(&counts, &mut self.slice(values))?;
            since
        };
        // The other ranks' blocks, as one transfer.
        coll.copies.note(((n * h - mine) * 4) as u64, since);
        if !into_x {
            return Ok(());
        }
        let (staged, copies) = coll.staging_and_copies(buffer, n, h)?;
        self.host.resize(n * h, 0.0);
        let mut at = 0;
        for (r, &width) in self.rs.0.iter().enumerate() {
            let a = self.rs.1[r];
            for row in 0..n {
                self.host[row * h + a..row * h + a + width]
                    .copy_from_slice(&staged[at + row * width..at + (row + 1) * width]);
            }
            at += width * n;
        }
        self.pass
            .upload(copies, &self.host, self.rank, &mut w.r.x, 0)
    }

    /// The ranks' partial sums (this rank's in `xn` when `computed`, else zeros) reduced into
    /// the residual owners' columns, then this rank's columns of `bias` added.
    fn reduce(
        &mut self,
        coll: &mut Collectives<'_>,
        buffer: usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        rows: (usize, usize),
        computed: bool,
        bias: Option<&Floats>,
    ) -> Result<()> {
        self.reduce_sums(coll, buffer, w, rows, (computed, bias), false)
    }

    /// A block's partial sums into the residual through a norm of its whole output (gemma's
    /// post-norms): reduced and kept apart ([`RankPass::reduce_sums`]), all-gathered as whole
    /// rows, normed, and this rank's columns added to its residual (`Pass::add_normed`).
    #[allow(clippy::too_many_arguments)]
    fn post_normed(
        &mut self,
        coll: &mut Collectives<'_>,
        flip: &mut dyn FnMut() -> usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        (n, h): (usize, usize),
        (computed, bias): (bool, Option<&Floats>),
        norm: Option<&Floats>,
        eps: f32,
    ) -> Result<()> {
        self.reduce_sums(coll, flip(), w, (n, h), (computed, bias), true)?;
        let (rank, mine) = (self.rank, self.rs.0[self.rank]);
        self.gather_columns(coll, flip(), w, (0, n, h), mine > 0, true)?;
        if mine == 0 {
            return Ok(());
        }
        let norm = norm.ok_or_else(|| {
            invalid(
                format!("tp rank {rank}"),
                "a replica of the post-norm",
                "none",
            )
        })?;
        let cols = (self.rs.1[rank], mine);
        self.pass
            .add_normed(rank, w, (n, h, cols), (norm, eps), self.held)
    }

    /// [`RankPass::reduce`], or kept `apart`: this rank's block of the sum (and its columns of
    /// `bias`) stays in its `sum` instead of joining its residual.
    fn reduce_sums(
        &mut self,
        coll: &mut Collectives<'_>,
        buffer: usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        (n, h): (usize, usize),
        (computed, bias): (bool, Option<&Floats>),
        apart: bool,
    ) -> Result<()> {
        let counts: Vec<usize> = self.rs.0.iter().map(|c| c * n).collect();
        let own: usize = counts[..self.rank].iter().sum();
        let mine = counts[self.rank];
        self.host.resize(n * h, 0.0);
        if computed {
            let (pass, rank) = (self.pass, self.rank);
            pass.download(&mut coll.copies, rank, &w.r.xn, 0, &mut self.host)?;
        }
        let since = std::time::Instant::now();
        {
            let values = coll.staging(buffer, n, h)?;
            let mut at = 0;
            for (r, &width) in self.rs.0.iter().enumerate() {
                let a = self.rs.1[r];
                for row in 0..n {
                    let dst = &mut values[at + row * width..at + (row + 1) * width];
                    if computed {
                        dst.copy_from_slice(&self.host[row * h + a..row * h + a + width]);
                    } else {
                        dst.fill(0.0);
                    }
                }
                at += width * n;
            }
            self.transport
                .reduce_scatter_sum(&counts, &mut self.slice(values))?;
        }
        coll.copies.note(((n * h - mine) * 4) as u64, since);
        if mine == 0 {
            return Ok(());
        }
        let (staged, copies) = coll.staging_and_copies(buffer, n, h)?;
        let (b, rank) = (self.pass.bs[self.rank], self.rank);
        self.pass
            .upload(copies, &staged[own..own + mine], rank, &mut w.sum, 0)?;
        if !apart {
            b.run(Op::AddInPlace {
                n: mine,
                x: &mut w.residual,
                y: &w.sum,
            })
            .map_err(self.pass.err(rank, "tp residual"))?;
        }
        let to = if apart { &mut w.sum } else { &mut w.residual };
        if let Some(f) = bias {
            b.run(Op::AddBias {
                n_rows: n,
                n_cols: self.rs.0[rank],
                x: to,
                bias: &*b.floats(f, self.held)?,
            })
            .map_err(self.pass.err(rank, "tp bias"))?;
        }
        Ok(())
    }
}

impl TpGraph {
    /// [`TpGraph::forward`] for the one rank of a rank-local load, on its backend `b`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_rank<B: Exec>(
        &self,
        bg: &BackendGraph,
        b: &B,
        (rank, devices): (usize, &[Arc<Device>]),
        held: &[Held],
        copies: &[(usize, Held)],
        ctx: &mut TpContext,
        cache: &Arc<Cache>,
        (ids, start, output): (&[u32], usize, Output),
        (compute, int8_threshold): (Compute, f32),
        out: &mut [f32],
    ) -> Result<Copies> {
        let s = &self.splits;
        let world = devices.len();
        // Decided alike on every rank (the layouts come from the shared tables), so no rank
        // waits in a collective for one that refused.
        if let Some(r) = self.layouts.iter().position(|l| l.bytes == 0) {
            return Err(EngineError::Unsupported {
                what: format!("a multi-process tensor-parallel pass where rank {r} has no share"),
                detail: "every rank joins every collective with its workspace; give each rank \
                         a share of the split (gpu_split)"
                    .into(),
            });
        }
        // Decided from the shared tables, alike on every rank.
        let vocab = self.dims.vocab;
        if output == Output::Hidden
            && let Some(r) = widths(&s.vc, world, vocab).iter().position(|&w| w == 0)
        {
            return Err(EngineError::Unsupported {
                what: format!(
                    "hidden states from a multi-process tensor-parallel pass where rank {r} \
                     holds no rows of the head"
                ),
                detail: "each rank norms the hidden states with its replica of the output norm, \
                         which comes with its rows of the head; split the vocabulary over every \
                         rank"
                    .into(),
            });
        }
        let parts = cache.tp_parts();
        let (mut coll, mut buffers) = ctx.lend_buffers()?;
        let transport = coll.transport();
        if !transport.joins_other_ranks() {
            return Err(EngineError::Unsupported {
                what: format!(
                    "a rank-local tensor-parallel pass through the {} collectives",
                    transport.name()
                ),
                detail: "the other ranks' values live in other processes: give the TPContext \
                         a transport that reaches them (TpContext::set_collective with \
                         tp::Nccl::for_rank, or a tp::ThreadGroup member)"
                    .into(),
            });
        }
        let pass = Pass {
            bs: vec![b; world],
            devices,
            cpu: Arc::clone(coll.staging_device()),
            peer: false,
        };
        let buf = buffers
            .get_mut(rank)
            .and_then(Option::take)
            .ok_or_else(|| invalid(format!("tp rank {rank}"), "a workspace", "none"))?;
        let mut w = self.device_work(&pass, rank, buf)?;
        let c = self.consts(compute, int8_threshold);
        let cx = Ctx {
            c: &c,
            held,
            copies,
            device: devices[rank].name(),
            slot: None,
            pieces: &[],
        };
        let run = self.run(held, copies, compute);
        let h = c.hidden;
        let rs_start = (0..world)
            .map(|r| start_of(&s.rs, r, h as u64).unwrap_or(0))
            .collect();
        let mut rp = RankPass {
            pass: &pass,
            rank,
            world,
            transport,
            held,
            rs: (widths(&s.rs, world, h as u64), rs_start),
            host: Vec::new(),
        };
        let in_table = |t: &SplitTable| t.iter().any(|e| e.0 == rank);
        let mut buffer = 0usize;
        let mut flip = || {
            buffer ^= 1;
            buffer
        };
        let mut done = 0usize;
        for part in ids.chunks(crate::forward::chunk_for(self.dims.tokens, cache)) {
            let n = part.len();
            let pos = start + done;
            {
                let (staged, copies) = coll.staging_and_copies(flip(), n, h)?;
                self.embed_rows(&run, part, staged)?;
                let width = rp.rs.0[rank];
                if width > 0 {
                    let a = rp.rs.1[rank];
                    let block: Vec<f32> = (0..n)
                        .flat_map(|r| staged[r * h + a..r * h + a + width].iter().copied())
                        .collect();
                    pass.upload(copies, &block, rank, &mut w.residual, 0)?;
                }
            }
            exec::positions(b, devices[rank].name(), pos, n, &mut w.r)?;
            for (li, l) in bg.layers.iter().enumerate() {
                rp.gather(&mut coll, flip(), &mut w, (0, n, h), in_table(&s.kv))?;
                let attn = l.attn.get(rank).and_then(Option::as_ref);
                if let Some(a) = attn {
                    a.run((b, &cx), &parts, (li, pos, n), &mut w.r)?;
                }
                let o_bias = l.o_bias.get(rank).and_then(Option::as_ref);
                let post = l.post_norms[0].get(rank).and_then(Option::as_ref);
                if self.layers[li].post_norms[0].is_some() {
                    let done = (attn.is_some(), o_bias);
                    rp.post_normed(&mut coll, &mut flip, &mut w, (n, h), done, post, c.eps)?;
                } else {
                    rp.reduce(&mut coll, flip(), &mut w, (n, h), attn.is_some(), o_bias)?;
                }
                rp.gather(&mut coll, flip(), &mut w, (0, n, h), in_table(&s.id))?;
                let mlp = l.mlp.get(rank).and_then(Option::as_ref);
                if let Some(m) = mlp {
                    let mats = [&m.gate, &m.up, &m.down];
                    exec::mlp(b, &cx, &m.norm, mats, li, n, &mut w.r)?;
                }
                let down_bias = l.down_bias.get(rank).and_then(Option::as_ref);
                let post = l.post_norms[1].get(rank).and_then(Option::as_ref);
                if self.layers[li].post_norms[1].is_some() {
                    let done = (mlp.is_some(), down_bias);
                    rp.post_normed(&mut coll, &mut flip, &mut w, (n, h), done, post, c.eps)?;
                } else {
                    rp.reduce(&mut coll, flip(), &mut w, (n, h), mlp.is_some(), down_bias)?;
                }
            }
            cache.appended(pos as u64, part)?;
            let width = output.width(&self.dims);
            let Some((first, rows_out)) = output.chunk_rows((done, n, ids.len()), width, out)
            else {
                done += n;
                continue;
            };
            let rows = (first, rows_out.len() / width);
            let at = (bg, &cx);
            match output {
                Output::Logits(_) => {
                    self.rank_head(at, &mut rp, &mut coll, &mut flip, &mut w, rows, rows_out)?;
                }
                Output::Hidden => {
                    self.rank_hidden(at, &mut rp, &mut coll, &mut flip, &mut w, rows, rows_out)?;
                }
            }
            done += n;
        }
        Ok(coll.copies)
    }

    /// Logits of residual rows `first..first + need` on every rank: each computes its
    /// vocabulary rows, and they are all-gathered into `rows_out` (`need × vocab`).
    #[allow(clippy::too_many_arguments)]
    fn rank_head<B: Exec>(
        &self,
        (bg, cx): (&BackendGraph, &Ctx<'_>),
        rp: &mut RankPass<'_, '_, B>,
        coll: &mut Collectives<'_>,
        flip: &mut dyn FnMut() -> usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        (first, need): (usize, usize),
        rows_out: &mut [f32],
    ) -> Result<()> {
        let (h, vocab) = (self.dims.hidden as usize, self.dims.vocab as usize);
        let (rank, world) = (rp.rank, rp.world);
        let head = bg.heads.get(rank).and_then(Option::as_ref);
        rp.gather(coll, flip(), w, (first, need, h), head.is_some())?;
        let b = rp.pass.bs[rank];
        if let Some((norm, _)) = head {
            self.out_norm(rp.pass, rank, (norm, cx.held), need, &mut w.r)?;
        }
        let rows = widths(&self.splits.vc, world, vocab as u64);
        let starts: Vec<usize> = (0..world)
            .map(|r| start_of(&self.splits.vc, r, vocab as u64).unwrap_or(0))
            .collect();
        let per = self.dims.logit_rows.max(1) as usize;
        for r0 in (0..need).step_by(per) {
            let nr = per.min(need - r0);
            let counts: Vec<usize> = rows.iter().map(|x| x * nr).collect();
            let (own, mine) = (counts[..rank].iter().sum::<usize>(), counts[rank]);
            let buffer = flip();
            let since = {
                let (values, copies) = coll.staging_and_copies(buffer, nr, vocab)?;
                if let Some((_, mat)) = head {
                    let xin = view(b, &w.r.xn, r0 * h * 4, nr * h * 4)
                        .map_err(rp.pass.err(rank, &mat.name))?;
                    cx.linear(b, mat, &xin, nr, &mut w.r.logits)?;
                    let dst = &mut values[own..own + mine];
                    rp.pass.download(copies, rank, &w.r.logits, 0, dst)?;
                }
                let since = std::time::Instant::now();
                rp.transport.all_gather(&counts, &mut rp.slice(values))?;
                since
            };
            coll.copies.note(((nr * vocab - mine) * 4) as u64, since);
            let (staged, _) = coll.staging_and_copies(buffer, nr, vocab)?;
            let mut at = 0;
            for (&width, &a) in rows.iter().zip(&starts) {
                for i in 0..nr {
                    let o = (r0 + i) * vocab + a;
                    rows_out[o..o + width]
                        .copy_from_slice(&staged[at + i * width..at + (i + 1) * width]);
                }
                at += width * nr;
            }
        }
        Ok(())
    }

    /// The output norm of residual rows `first..first + need` on every rank: the rows
    /// all-gathered into each rank's hidden state, normed with its replica of the norm (as
    /// [`TpGraph::rank_head`] norms them), and read back into `rows_out` (`need × hidden`).
    #[allow(clippy::too_many_arguments)]
    fn rank_hidden<B: Exec>(
        &self,
        (bg, cx): (&BackendGraph, &Ctx<'_>),
        rp: &mut RankPass<'_, '_, B>,
        coll: &mut Collectives<'_>,
        flip: &mut dyn FnMut() -> usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        (first, need): (usize, usize),
        rows_out: &mut [f32],
    ) -> Result<()> {
        let rank = rp.rank;
        rp.gather(
            coll,
            flip(),
            w,
            (first, need, self.dims.hidden as usize),
            true,
        )?;
        let Some((norm, _)) = bg.heads.get(rank).and_then(Option::as_ref) else {
            return Err(invalid(
                format!("tp rank {rank}"),
                "a share of the head",
                "none",
            ));
        };
        self.out_norm(rp.pass, rank, (norm, cx.held), need, &mut w.r)?;
        rp.pass
            .download(&mut coll.copies, rank, &w.r.xn, 0, rows_out)
    }
}
