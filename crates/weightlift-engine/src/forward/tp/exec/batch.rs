//! Several sequences in one tensor-parallel pass on the devices' backends, as the single-device
//! backend path batches them: on each device one product per linear over the rows of every
//! sequence (where [`Exec::shared_tokens`] keeps each token's bits, else one per run of
//! sequences), RoPE, the cache stores and attention per sequence on its own cache part, and the
//! head over the sequences' last rows. The collectives move all the rows at once, so a step's
//! copies are one sequence's, but for one logits download per head product where the rows go
//! one product each (exact mode), as on the host path. A rank of a multi-process group runs
//! the same batch on its own share, through its rank-level collectives (`rank.rs`).

use super::*;

/// One sequence of a batch: its cache, its tokens, its cache's parts and its first position.
pub(in crate::forward::tp) type BatchSeq<'a> = (&'a Arc<Cache>, &'a [u32], &'a [TpPart], usize);

impl TpGraph {
    /// [`TpGraph::forward_batch`] on the devices' backends (a rank of a multi-process group on
    /// its own device's, meeting the others in its collectives). `out` holds each sequence's
    /// logits of its last position, in order.
    pub(in crate::forward::tp) fn forward_backends_batch(
        &self,
        bg: &BackendGraph,
        (held, copies): (&[Held], &[(usize, Held)]),
        ctx: &mut TpContext,
        seqs: &[BatchSeq<'_>],
        modes: (Compute, f32),
        out: &mut [f32],
    ) -> Result<Copies> {
        if ctx.rank().is_some() {
            let job = super::rank::RankJob::Batch(seqs);
            return self.forward_rank(bg, (held, copies), ctx, job, modes, out);
        }
        let devices: Vec<Arc<Device>> = ctx.devices().to_vec();
        let allow_peer = ctx.peer_copies();
        let on = (&devices[..], allow_peer);
        match &bg.backends {
            Backends::Cpu(v) => {
                let bs: Vec<&CpuBackend> = v.iter().collect();
                self.run_batch_on(bg, bs, on, (held, copies), ctx, seqs, modes, out)
            }
            Backends::Cuda => {
                let bs = devices
                    .iter()
                    .map(|d| d.backend())
                    .collect::<Result<Vec<&CudaBackend>>>()?;
                self.run_batch_on(bg, bs, on, (held, copies), ctx, seqs, modes, out)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_batch_on<B: Exec>(
        &self,
        bg: &BackendGraph,
        bs: Vec<&B>,
        (devices, allow_peer): (&[Arc<Device>], bool),
        (held, copies): (&[Held], &[(usize, Held)]),
        ctx: &mut TpContext,
        seqs: &[BatchSeq<'_>],
        (compute, int8_threshold): (Compute, f32),
        out: &mut [f32],
    ) -> Result<Copies> {
        let s = &self.splits;
        let (mut coll, buffers) = ctx.lend_buffers()?;
        let cpu = Arc::clone(coll.staging_device());
        let pass = Pass::new(bs, devices, cpu, allow_peer);
        let mut ws = self.device_works(&pass, buffers)?;
        let c = self.consts(compute, int8_threshold);
        let counts: Vec<usize> = seqs.iter().map(|q| q.1.len()).collect();
        let cx = |d: usize| Ctx {
            c: &c,
            held,
            copies,
            device: devices[d].name(),
            slot: None,
            pieces: &counts,
        };
        let run = self.run(held, copies, compute);
        let (h, vocab) = (c.hidden, self.dims.vocab as usize);
        let n: usize = counts.iter().sum();
        let k = seqs.len();
        let mut buffer = 0usize;
        let mut flip = || {
            buffer ^= 1;
            buffer
        };
        let ids: Vec<u32> = seqs.iter().flat_map(|q| q.1.iter().copied()).collect();
        let (staged, moved) = coll.staging_and_copies(flip(), n, h)?;
        self.embed_rows(&run, &ids, staged)?;
        pass.scatter(moved, staged, &mut ws, &s.rs, (n, h))?;
        let at: Vec<(usize, usize)> = seqs.iter().map(|q| (q.3, q.1.len())).collect();
        let attend: Vec<(&[TpPart], usize, usize)> =
            seqs.iter().map(|q| (q.2, q.3, q.1.len())).collect();
        for (d, w) in ws.iter_mut().enumerate() {
            if let Some(w) = w {
                exec::positions_of(pass.bs[d], devices[d].name(), &at, &mut w.r)?;
            }
        }
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
        for &(cache, ids, _, pos) in seqs {
            cache.appended(pos as u64, ids)?;
        }
        // Every row to the vocab table's devices in one gather, each sequence's last row then
        // moved to row `i` there, for the head's products over them.
        pass.gather(&mut coll, flip(), &mut ws, (&s.rs, &s.vc), (0, n, h))?;
        let logit_rows = self.dims.logit_rows.max(1) as usize;
        for &(d, a, _) in &s.vc {
            let Some((norm, mat)) = bg.heads.get(d).and_then(Option::as_ref) else {
                continue;
            };
            let b = pass.bs[d];
            let w = work(&mut ws, d)?;
            exec::batch_rows(b, &cx(d), &counts, &mut w.r)?;
            self.out_norm(&pass, d, (norm, held), k, &mut w.r)?;
            // alone, each last row is one product of one row: rows go together only where the
            // backend gives each its own bits
            let one = Ctx {
                pieces: &[],
                ..cx(d)
            };
            let per = exec::head_shared_rows(b, &one, mat)?.min(logit_rows);
            let mut block = vec![0f32; per.min(k) * mat.rows];
            for r0 in (0..k).step_by(per) {
                let nr = per.min(k - r0);
                let xin =
                    view(b, &w.r.xn, r0 * h * 4, nr * h * 4).map_err(pass.err(d, &mat.name))?;
                one.linear(b, mat, &xin, nr, &mut w.r.logits)?;
                let got = &mut block[..nr * mat.rows];
                pass.download(&mut coll.copies, d, &w.r.logits, 0, got)?;
                for (i, row) in got.chunks_exact(mat.rows).enumerate() {
                    let at = (r0 + i) * vocab + a as usize;
                    out[at..at + mat.rows].copy_from_slice(row);
                }
            }
        }
        Ok(coll.copies)
    }
}
