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
//! - A batch ([`RankJob::Batch`], every rank given the same sequences in the same order) is one
//!   step: the collectives move every sequence's rows at once, attention runs per sequence on
//!   its own cache part, and each sequence's last row is gathered for the head, so a step of
//!   several sequences makes the collectives of one. Each rank multiplies its head rows as its
//!   backend keeps each row's bits; the logits' gathers follow the plan's rows, alike on every
//!   rank.
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

    /// A batch's last rows (`counts` tokens a sequence, in order) of this rank's residual
    /// columns moved to row `i` for sequence `i`, through `sum`: the rows the head gathers.
    fn last_rows(&self, w: &mut DeviceWork<'_, B::Buffer>, counts: &[usize]) -> Result<()> {
        let (b, row) = (self.pass.bs[self.rank], self.rs.0[self.rank] * 4);
        if row == 0 {
            return Ok(());
        }
        let mut end = 0;
        for (i, &k) in counts.iter().enumerate() {
            end += k;
            b.copy(&w.residual, (end - 1) * row, &mut w.sum, i * row, row)
                .map_err(self.pass.err(self.rank, "a batch's last rows"))?;
        }
        b.copy(&w.sum, 0, &mut w.residual, 0, counts.len() * row)
            .map_err(self.pass.err(self.rank, "a batch's last rows"))
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

/// What a rank's pass runs. Every rank must be given the same: the steps, their token counts and
/// the collectives they make follow from it.
pub(in crate::forward::tp) enum RankJob<'s> {
    /// One sequence's tokens from `start` (cache, tokens, start, output): a step a prompt
    /// chunk, each writing the `output` rows it holds.
    One(&'s Arc<Cache>, &'s [u32], usize, Output),
    /// A batch's sequences in one step, each writing the logits of its last position.
    Batch(&'s [BatchSeq<'s>]),
}

impl TpGraph {
    /// [`TpGraph::forward`] or [`TpGraph::forward_batch`] for the one rank of a rank-local
    /// load, on its device's backend.
    pub(in crate::forward::tp) fn forward_rank(
        &self,
        bg: &BackendGraph,
        (held, copies): (&[Held], &[(usize, Held)]),
        ctx: &mut TpContext,
        job: RankJob<'_>,
        modes: (Compute, f32),
        out: &mut [f32],
    ) -> Result<Copies> {
        let devices: Vec<Arc<Device>> = ctx.devices().to_vec();
        let rank = ctx
            .rank()
            .ok_or_else(|| invalid("a rank's pass", "a rank-local load", "every device"))?;
        let on = (rank, &devices[..]);
        match &bg.backends {
            Backends::Cpu(v) => {
                self.run_rank(bg, &v[rank], on, (held, copies), ctx, job, modes, out)
            }
            Backends::Cuda => {
                let b = devices[rank].backend()?;
                self.run_rank(bg, b, on, (held, copies), ctx, job, modes, out)
            }
        }
    }

    /// [`TpGraph::forward_rank`] on the rank's backend `b`: one sequence in prompt chunks, or a
    /// batch in one step whose collectives move every sequence's rows at once.
    #[allow(clippy::too_many_arguments)]
    fn run_rank<B: Exec>(
        &self,
        bg: &BackendGraph,
        b: &B,
        (rank, devices): (usize, &[Arc<Device>]),
        (held, copies): (&[Held], &[(usize, Held)]),
        ctx: &mut TpContext,
        job: RankJob<'_>,
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
        let output = match job {
            RankJob::One(.., output) => output,
            RankJob::Batch(_) => Output::Logits(Logits::Last),
        };
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
        let one_parts: Vec<TpPart>;
        // The steps: a sequence's prompt chunks, one segment each, or a batch's one step.
        let steps: Vec<Vec<BatchSeq<'_>>> = match job {
            RankJob::One(cache, ids, start, _) => {
                one_parts = cache.tp_parts();
                let chunk = crate::forward::chunk_for(self.dims.tokens, cache);
                ids.chunks(chunk)
                    .enumerate()
                    .map(|(i, part)| vec![(cache, part, &one_parts[..], start + i * chunk)])
                    .collect()
            }
            RankJob::Batch(seqs) => vec![seqs.to_vec()],
        };
        let batch = matches!(job, RankJob::Batch(_));
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
        let logit_rows = self.dims.logit_rows.max(1) as usize;
        let total: usize = steps.iter().flatten().map(|q| q.1.len()).sum();
        let mut done = 0usize;
        for step in &steps {
            let counts: Vec<usize> = step.iter().map(|q| q.1.len()).collect();
            let n: usize = counts.iter().sum();
            let cx = Ctx {
                c: &c,
                held,
                copies,
                device: devices[rank].name(),
                slot: None,
                pieces: &counts,
            };
            {
                let ids: Vec<u32> = step.iter().flat_map(|q| q.1.iter().copied()).collect();
                let (staged, copies) = coll.staging_and_copies(flip(), n, h)?;
                self.embed_rows(&run, &ids, staged)?;
                let width = rp.rs.0[rank];
                if width > 0 {
                    let a = rp.rs.1[rank];
                    let block: Vec<f32> = (0..n)
                        .flat_map(|r| staged[r * h + a..r * h + a + width].iter().copied())
                        .collect();
                    pass.upload(copies, &block, rank, &mut w.residual, 0)?;
                }
            }
            let at: Vec<(usize, usize)> = step.iter().map(|q| (q.3, q.1.len())).collect();
            exec::positions_of(b, devices[rank].name(), &at, &mut w.r)?;
            let attend: Vec<(&[TpPart], usize, usize)> =
                step.iter().map(|q| (q.2, q.3, q.1.len())).collect();
            for (li, l) in bg.layers.iter().enumerate() {
                rp.gather(&mut coll, flip(), &mut w, (0, n, h), in_table(&s.kv))?;
                let attn = l.attn.get(rank).and_then(Option::as_ref);
                if let Some(a) = attn {
                    a.run_seqs((b, &cx), li, &attend, &mut w.r)?;
                }
                let o_bias = l.o_bias.get(rank).and_then(Option::as_ref);
                let post = l.post_norms[0].get(rank).and_then(Option::as_ref);
                if self.layers[li].post_norms[0].is_some() {
                    let done = (attn.is_some(), o_bias);
                    rp.post_normed(&mut coll, &mut flip, &mut w, (n, h), done, post, c.eps)?;
                } else {
                    rp.reduce(&mut coll, flip(), &mut w, (n, h), attn.is_some(), o_bias)?;
                }
                rp.gather(
                    &mut coll,
                    flip(),
                    &mut w,
                    (0, n, h),
                    in_table(l.mlp_table(s)),
                )?;
                let mlp = l.mlp.get(rank).and_then(Option::as_ref);
                let experts = l.experts.get(rank).and_then(Option::as_ref);
                if let Some(x) = experts {
                    let mut link = exec::HostLink {
                        rate: devices[rank].bandwidth(),
                        copies: &mut coll.copies,
                    };
                    // each sequence of a batch routed piece by piece, as alone
                    exec::experts_share(b, &cx, &x.norm, &x.moe, li, &counts, &mut w.r, &mut link)?;
                } else if let Some(m) = mlp {
                    let mats = [&m.gate, &m.up, &m.down];
                    exec::mlp(b, &cx, &m.norm, mats, li, n, &mut w.r)?;
                }
                let computed = mlp.is_some() || experts.is_some();
                let down_bias = l.down_bias.get(rank).and_then(Option::as_ref);
                let post = l.post_norms[1].get(rank).and_then(Option::as_ref);
                if self.layers[li].post_norms[1].is_some() {
                    let done = (computed, down_bias);
                    rp.post_normed(&mut coll, &mut flip, &mut w, (n, h), done, post, c.eps)?;
                } else {
                    rp.reduce(&mut coll, flip(), &mut w, (n, h), computed, down_bias)?;
                }
            }
            for &(cache, ids, _, pos) in step {
                cache.appended(pos as u64, ids)?;
            }
            let at = (bg, &cx);
            if batch {
                // Alone, each last row is one product of one row: this rank's products take
                // several only where its backend gives each its own bits. The gathers follow
                // the plan's rows, alike on every rank whatever its products.
                rp.last_rows(&mut w, &counts)?;
                let one = Ctx { pieces: &[], ..cx };
                let per = match bg.heads.get(rank).and_then(Option::as_ref) {
                    Some((_, mat)) => exec::head_shared_rows(b, &one, mat)?.min(logit_rows),
                    None => 1,
                };
                let rows = (0, counts.len(), per);
                self.rank_head(at, &mut rp, &mut coll, &mut flip, &mut w, rows, out)?;
                continue;
            }
            let width = output.width(&self.dims);
            let Some((first, rows_out)) = output.chunk_rows((done, n, total), width, out) else {
                done += n;
                continue;
            };
            let rows = (first, rows_out.len() / width);
            match output {
                Output::Logits(_) => {
                    let rows = (rows.0, rows.1, logit_rows);
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
    /// vocabulary rows, `per` rows a product, and they are all-gathered into `rows_out`
    /// (`need × vocab`), the plan's logit rows a gather (alike on every rank, whatever `per`).
    #[allow(clippy::too_many_arguments)]
    fn rank_head<B: Exec>(
        &self,
        (bg, cx): (&BackendGraph, &Ctx<'_>),
        rp: &mut RankPass<'_, '_, B>,
        coll: &mut Collectives<'_>,
        flip: &mut dyn FnMut() -> usize,
        w: &mut DeviceWork<'_, B::Buffer>,
        (first, need, per): (usize, usize, usize),
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
        // the head's products take their rows whole, whatever sequences they came from
        let one = Ctx { pieces: &[], ..*cx };
        let gathered = self.dims.logit_rows.max(1) as usize;
        let per = per.clamp(1, gathered);
        for r0 in (0..need).step_by(gathered) {
            let nr = gathered.min(need - r0);
            let counts: Vec<usize> = rows.iter().map(|x| x * nr).collect();
            let (own, mine) = (counts[..rank].iter().sum::<usize>(), counts[rank]);
            let buffer = flip();
            let since = {
                let (values, copies) = coll.staging_and_copies(buffer, nr, vocab)?;
                if let Some((_, mat)) = head {
                    let width = rows[rank];
                    for p0 in (0..nr).step_by(per) {
                        let np = per.min(nr - p0);
                        let xin = view(b, &w.r.xn, (r0 + p0) * h * 4, np * h * 4)
                            .map_err(rp.pass.err(rank, &mat.name))?;
                        one.linear(b, mat, &xin, np, &mut w.r.logits)?;
                        let at = own + p0 * width;
                        let dst = &mut values[at..at + np * width];
                        rp.pass.download(copies, rank, &w.r.logits, 0, dst)?;
                    }
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
