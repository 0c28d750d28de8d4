//! The forward call: a prompt in chunks of the workspace's tokens, each embedded, run through the
//! layers on the devices that hold them (the hidden state copied at each device boundary), and
//! the head for the rows whose logits are asked for (or, for hidden states, the output norm of
//! every row on the head's device, without the head).

use std::sync::Arc;

use super::Graph;
use super::step::{self, CacheKey, StepKey};
use weightlift_kernels::{Backend, CudaBackend};

use crate::cache::Cache;
use crate::device::{Buffer, Device};
use crate::error::Result;
use crate::error::invalid;
use crate::forward::SiteExec;
use crate::forward::boundary::move_rows;
use crate::forward::embed::embed_rows;
use crate::forward::exec::{self, Ctx, kernel_on};
use crate::forward::layer::{Consts, Piece, Weights, run_layer, shares_rows, tokens};
use crate::forward::logits::{head_rows, hidden_rows};
use crate::forward::onload::{Copier, SlotMem, onload_group, prefetch_first, settle};
use crate::forward::parts::Ffn;
use crate::forward::work::{Work, on_site, site_works};
use crate::forward::{Compute, Copies, Logits, Output, check_tokens};
use crate::model::Held;
use weightlift_kernels::cpu::matvec::Q8_BATCH_MAX_TOKENS;

/// One sequence of a forward call: the cache its ids are appended to, and the ids.
pub(crate) type Seq<'a> = (&'a Arc<Cache>, &'a [u32]);

/// One chunk of a forward call: `(sequence, position, ids)` for each sequence it holds.
type Chunk<'a> = Vec<(usize, usize, &'a [u32])>;

impl Graph {
    /// The chunks of a forward call: one sequence's ids in pieces of at most `chunk` tokens, or
    /// several sequences' ids together in one chunk (their logits: the last row of each).
    fn chunks<'a>(&self, seqs: &[Seq<'a>], output: Output, chunk: usize) -> Result<Vec<Chunk<'a>>> {
        let mut starts = Vec::with_capacity(seqs.len());
        for (cache, ids) in seqs {
            starts.push(check_tokens(ids, self.dims.vocab, cache)? as usize);
        }
        match seqs {
            [] => Err(invalid("a forward batch", "at least one sequence", "none")),
            // no more of a sequence than its rings hold room for
            [(cache, ids)] => Ok(ids
                .chunks(crate::forward::chunk_for(chunk as u64, cache))
                .scan(starts[0], |pos, part| {
                    let at = *pos;
                    *pos += part.len();
                    Some(vec![(0, at, part)])
                })
                .collect()),
            _ => {
                let n: usize = seqs.iter().map(|(_, ids)| ids.len()).sum();
                let fits = seqs
                    .iter()
                    .all(|(c, ids)| ids.len() <= crate::forward::chunk_for(chunk as u64, c));
                if output != Output::Logits(Logits::Last) || n > chunk || !fits {
                    return Err(invalid(
                        "a forward batch of several sequences",
                        format!("the last logits of each, for {chunk} tokens in all at most"),
                        format!("{n} tokens, {output:?}"),
                    ));
                }
                Ok(vec![
                    seqs.iter()
                        .zip(&starts)
                        .enumerate()
                        .map(|(i, ((_, ids), &pos))| (i, pos, *ids))
                        .collect(),
                ])
            }
        }
    }

    /// Whether a call of `seqs` for `output` may replay a decode step captured as a CUDA graph
    /// (see `step`): one token of each sequence (a batch's no more than the head's logit rows,
    /// so every row's logits stay on the device until the one copy), each on a cache held in
    /// place, with every layer (dense, none onloaded) and the head on one CUDA device, and the
    /// embedding there or in host memory (where every plan keeps it: its rows are then copied
    /// to the device before the replay, as the positions are). Anything else takes the host's
    /// launches: onloaded weights and mixture-of-experts routing go through the host in
    /// mid-step, and a prompt is not a decode step.
    fn step_eligible(&self, seqs: &[Seq<'_>], output: Output) -> bool {
        let at = self.head_site;
        let exec = |site: usize| self.sites.get(site).map(|s| &s.exec);
        !seqs.is_empty()
            && seqs.len() <= self.dims.logit_rows as usize
            && seqs
                .iter()
                .all(|(cache, ids)| ids.len() == 1 && !cache.is_offloaded())
            && matches!(output, Output::Logits(_))
            && matches!(exec(at), Some(SiteExec::Cuda))
            && (self.embed_site == at
                || matches!(
                    exec(self.embed_site),
                    Some(SiteExec::Host | SiteExec::Cpu(_))
                ))
            && self.onload.is_none()
            && self
                .layers
                .iter()
                .all(|l| l.site == at && l.group.is_none() && matches!(l.ffn, Ffn::Dense { .. }))
    }

    /// The tokens of one chunk: a call's prompt runs in chunks of this many.
    pub fn chunk_tokens(&self) -> usize {
        self.dims.tokens as usize
    }

    /// Run each sequence's ids through the model, appending to its cache at its `seq_len`, and
    /// write the `output` asked for into `out` (`rows × width`, row-major). Several sequences
    /// run as one chunk (see [`Graph::batches`]) and write the logits of their last positions,
    /// a row each, in order. Returns the copies made. With `cuda_graphs`, a decode step that
    /// runs whole on one CUDA device is replayed from a captured graph (see `step`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        held: &[Held],
        copies: &[(usize, Held)],
        scratch: &mut [Buffer],
        seqs: &[Seq<'_>],
        output: Output,
        (compute, int8_threshold, cuda_graphs): (Compute, f32, bool),
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        let graphable = cuda_graphs && self.step_eligible(seqs, output);
        let width = output.width(&self.dims);
        let chunk = self.dims.tokens as usize;
        let plan = self.chunks(seqs, output, chunk)?;
        let total = seqs[0].1.len();
        out.clear();
        let rows = if seqs.len() > 1 {
            seqs.len()
        } else {
            output.rows(total)
        };
        out.resize(rows * width, 0.0);
        let devs: Vec<Arc<Device>> = self.sites.iter().map(|s| Arc::clone(&s.device)).collect();

        let onload_site = self
            .onload
            .as_ref()
            .map(|o| (o.site, o.slot_bytes, o.slots()));
        // the workspaces still without the RoPE table: only a graph's first call writes it, so
        // a decode step's uploads are its own positions (and a captured step's replay reads
        // the table the first call left)
        let rope_fresh: Vec<bool> = self.sites.iter().map(|s| !s.rope_table).collect();
        let (mut works, mut slot_mem) = site_works(&mut self.sites, scratch, onload_site)?;
        if let Some(pins) = self.onload.as_ref().and_then(|o| o.pins.as_ref()) {
            for m in slot_mem.iter_mut().flatten() {
                m.use_pins(pins);
            }
        }

        let c = Consts::new(
            &self.dims,
            (self.eps, self.rope, self.max_dq),
            (compute, int8_threshold),
        )
        .with_family(&self.family);
        let embed_scale = self.family.embed_scale;
        let final_softcap = self.family.final_softcap;
        let cx = |site: usize| Ctx {
            c: &c,
            held,
            copies,
            device: devs[site].name(),
            slot: None,
            pieces: &[],
        };
        let freqs: &[u8] = bytemuck::cast_slice(&self.inv_freqs);
        for (i, w) in works.iter_mut().enumerate().filter(|(i, _)| rope_fresh[*i]) {
            on_site!(w, v => {
                let len = self.inv_freqs.len().min(v.freqs.len());
                let f = &mut v.freqs[..len];
                f.copy_from_slice(&self.inv_freqs[..f.len()]);
            }, (b, r) => {
                // only the sites that compute layers hold the table
                if b.len(&r.freqs) >= freqs.len() {
                    b.copy_from_host(freqs, &mut r.freqs, 0)
                        .map_err(|e| kernel_on(devs[i].name(), "rope frequencies", e))?;
                }
            });
        }
        let mut copies_made = Copies::default();
        let offload_copies = || {
            seqs.iter().fold(Copies::default(), |mut all, (cache, _)| {
                all.add(cache.offload_copies());
                all
            })
        };
        let cache_copies = offload_copies();
        let h = c.hidden;
        let mut done = 0usize;
        std::thread::scope(|scope| -> Result<()> {
            let mut copier: Option<Copier<'_, '_>> = None;
            for part in &plan {
                let pieces: Vec<Piece<'_>> = part
                    .iter()
                    .map(|&(s, pos, ids)| Piece {
                        cache: seqs[s].0,
                        pos,
                        n: ids.len(),
                    })
                    .collect();
                let n = tokens(&pieces);
                let counts: Vec<usize> = pieces.iter().map(|p| p.n).collect();
                let spans: Vec<(usize, usize)> = pieces.iter().map(|p| (p.pos, p.n)).collect();
                let ids: std::borrow::Cow<'_, [u32]> = match part.as_slice() {
                    [(_, _, ids)] => (*ids).into(),
                    _ => part
                        .iter()
                        .flat_map(|(_, _, ids)| ids.iter().copied())
                        .collect(),
                };
                // Embedding rows, dequantised into the embedding device's residual stream.
                let es = self.embed_site;
                on_site!(&mut works[es],
                v => {
                    embed_rows(held, copies, &self.embed, &ids, h, v.x)?;
                    if let Some(s) = embed_scale {
                        weightlift_kernels::scale_in_place(&mut v.x[..n * h], s);
                    }
                },
                (b, r) => {
                    exec::embed(*b, &cx(es), &self.embed, &ids, &mut r.x)?;
                    if let Some(s) = embed_scale {
                        exec::scale(*b, &cx(es), n * h, s, &mut r.x)?;
                    }
                });
                for (i, w) in works.iter_mut().enumerate() {
                    on_site!(w, _v => (), (b, r) => exec::positions_of(*b, devs[i].name(), &spans, r)?);
                }
                // a graph step's device: its layers' and head's (step_eligible)
                let gs = self.head_site;
                // every sequence's cache layers on the device, or no graph
                let caches: Option<Vec<CacheKey>> =
                    if graphable && matches!(works[gs], Work::Cuda(..)) {
                        pieces
                            .iter()
                            .map(|p| CacheKey::of(p.cache, p.pos, p.n))
                            .collect()
                    } else {
                        None
                    };
                if caches.is_some() && self.embed_site != gs {
                    // the embedding rows from host memory into the step's residual stream,
                    // before the replay (the rows stay where they were: the launched path
                    // below, were it taken, copies them again)
                    let es = self.embed_site;
                    move_rows(&mut works, &devs, es, gs, 0, n * h, &mut copies_made)?;
                }
                if let (Some(caches), Work::Cuda(b, r)) = (caches, &mut works[gs]) {
                    // the layers and the head on one CUDA device, between the uploads above
                    // and the logits' copy below: replayed from a captured graph
                    let b: &CudaBackend = b;
                    // the head's rows a product, as the launched path below takes them
                    let logit_rows = self.dims.logit_rows as usize;
                    let per = if pieces.len() > 1 {
                        exec::head_shared_rows(b, &cx(gs), &self.head)?.min(logit_rows)
                    } else {
                        logit_rows
                    };
                    let key = StepKey {
                        caches,
                        compute,
                        int8_threshold: int8_threshold.to_bits(),
                        workspace: (r.x.device_addr(), r.logits.device_addr()),
                        held: [
                            (held.as_ptr() as usize, held.len()),
                            (copies.as_ptr() as usize, copies.len()),
                        ],
                    };
                    let (layers, norm, head) = (&self.layers, &self.out_norm, &self.head);
                    let ccx = cx(gs);
                    let scratch_from = || step::batch_scratch_from(b, &ccx, layers, head);
                    self.steps.run(b, key, scratch_from, |b| {
                        let mut none = Copies::default();
                        let mut pending = false;
                        for (li, layer) in layers.iter().enumerate() {
                            let lcx = Ctx {
                                pieces: &counts,
                                ..ccx
                            };
                            let defer = li + 1 < layers.len();
                            let mut link = exec::HostLink {
                                rate: None,
                                copies: &mut none,
                            };
                            exec::layer(
                                b,
                                &lcx,
                                layer,
                                li,
                                &pieces,
                                r,
                                (pending, defer),
                                &mut link,
                            )?;
                            pending = defer;
                        }
                        // a batch's last rows are its rows (one token each): nothing to move
                        exec::head_products(b, &ccx, (norm, head), (n, per), r)
                    })?;
                    let dst = bytemuck::cast_slice_mut(&mut out[..n * width]);
                    b.copy_to_host(&r.logits, 0, dst)
                        .map_err(|e| kernel_on(devs[gs].name(), "copying logits to the host", e))?;
                    for &(s, pos, ids) in part {
                        seqs[s].0.appended(pos as u64, ids)?;
                    }
                    if final_softcap > 0.0 {
                        weightlift_kernels::softcap_in_place(out, final_softcap);
                    }
                    done += n;
                    continue;
                }
                let mut at = self.embed_site;
                // whether the last layer left its MLP output in the workspace, not yet added
                // to the residual stream (see exec::layer)
                let mut pending = false;
                for (li, layer) in self.layers.iter().enumerate() {
                    if layer.site != at {
                        move_rows(
                            &mut works,
                            &devs,
                            at,
                            layer.site,
                            0,
                            n * h,
                            &mut copies_made,
                        )?;
                        at = layer.site;
                    }
                    let slot = match (layer.group, self.onload.as_mut()) {
                        (Some(g), Some(o)) => {
                            let si = onload_group(
                                o,
                                g,
                                &self.layers,
                                held,
                                copies,
                                &mut slot_mem,
                                &mut copier,
                                scope,
                                &mut copies_made,
                            )?;
                            slot_mem[si].as_ref()
                        }
                        _ => None,
                    };
                    let wts = Weights {
                        held,
                        copies,
                        slot: slot.and_then(SlotMem::host),
                    };
                    let lcx = Ctx {
                        slot,
                        pieces: &counts,
                        ..cx(at)
                    };
                    let defer = self.layers.get(li + 1).is_some_and(|next| next.site == at);
                    on_site!(&mut works[at],
                    v => { run_layer(&c, layer, li, &wts, &pieces, v)?; pending = false; },
                    (b, r) => {
                        let mut link = exec::HostLink {
                            rate: devs[at].bandwidth(),
                            copies: &mut copies_made,
                        };
                        exec::layer(*b, &lcx, layer, li, &pieces, r, (pending, defer), &mut link)?;
                        pending = defer;
                    });
                }
                if let Some(o) = self.onload.as_mut() {
                    prefetch_first(o, &self.layers, held, copies, &mut slot_mem, &mut copier)?;
                }
                for &(s, pos, ids) in part {
                    seqs[s].0.appended(pos as u64, ids)?;
                }
                if pieces.len() > 1 {
                    // each sequence's last row, then the head for those rows
                    on_site!(&mut works[at],
                        v => batch_rows(&pieces, h, v),
                        (b, r) => exec::batch_rows(*b, &cx(at), &counts, r)?);
                    let n_rows = pieces.len();
                    if self.head_site != at {
                        move_rows(
                            &mut works,
                            &devs,
                            at,
                            self.head_site,
                            0,
                            n_rows * h,
                            &mut copies_made,
                        )?;
                    }
                    let hs = self.head_site;
                    let norm = &self.out_norm;
                    let hw = Weights {
                        held,
                        copies,
                        slot: None,
                    };
                    // Rows share the head's products where that keeps each row's bits (see
                    // layer::linear_pieces and Exec::shared_tokens), else a row at a time, as
                    // each sequence runs alone.
                    let logit_rows = self.dims.logit_rows as usize;
                    on_site!(&mut works[hs], w => {
                        let per = if shares_rows(&c, &hw, &self.head)? {
                            logit_rows.min(Q8_BATCH_MAX_TOKENS)
                        } else {
                            1
                        };
                        for (k, rows) in out.chunks_mut(per * width).enumerate() {
                            head_rows(&c, &hw, norm, &self.head, k * per, per, rows, w)?;
                        }
                    }, (b, r) => {
                        let per = exec::head_shared_rows(*b, &cx(hs), &self.head)?.min(logit_rows);
                        exec::head(*b, &cx(hs), norm, &self.head, 0, per, out, r)?;
                    });
                    if final_softcap > 0.0 {
                        weightlift_kernels::softcap_in_place(out, final_softcap);
                    }
                    continue;
                }
                // The head: only the rows asked for.
                let Some((first, rows_out)) = output.chunk_rows((done, n, total), width, out)
                else {
                    done += n;
                    continue;
                };
                let need = rows_out.len() / width;
                if self.head_site != at {
                    move_rows(
                        &mut works,
                        &devs,
                        at,
                        self.head_site,
                        first * h,
                        need * h,
                        &mut copies_made,
                    )?;
                }
                let per = self.dims.logit_rows as usize;
                let hs = self.head_site;
                let norm = &self.out_norm;
                match output {
                    Output::Logits(_) => on_site!(&mut works[hs], w => {
                        let hw = Weights { held, copies, slot: None };
                        head_rows(&c, &hw, norm, &self.head, first, per, rows_out, w)?;
                    }, (b, r) => exec::head(*b, &cx(hs), norm, &self.head, first, per, rows_out, r)?),
                    Output::Hidden => on_site!(&mut works[hs],
                        w => hidden_rows(&c, norm, first, rows_out, w)?,
                        (b, r) => exec::hidden(*b, &cx(hs), norm, first, rows_out, r)?),
                }
                // gemma2's final soft-cap, on the host rows every path wrote
                if final_softcap > 0.0 && matches!(output, Output::Logits(_)) {
                    weightlift_kernels::softcap_in_place(rows_out, final_softcap);
                }
                done += n;
            }
            if let Some(o) = self.onload.as_mut() {
                settle(o, &mut slot_mem, &mut copier, &mut copies_made)?;
            }
            Ok(())
        })?;
        // the workspaces are lent no more: their tables are marked written (a call that fails
        // before here writes its table again next time, which is harmless)
        drop(slot_mem);
        drop(works);
        for (s, fresh) in self.sites.iter_mut().zip(rope_fresh) {
            s.rope_table |= fresh;
        }
        // the offloaded caches' copies of this call (none is in flight after its last layer)
        let now = offload_copies();
        copies_made.add(Copies {
            count: now.count - cache_copies.count,
            bytes: now.bytes - cache_copies.bytes,
            nanos: now.nanos - cache_copies.nanos,
        });
        Ok(copies_made)
    }
}

/// Each piece's last row of the residual stream, moved to row `i` for piece `i`: the rows the
/// head reads. A piece's last row is at or after its index, so no row is overwritten before it
/// is moved.
fn batch_rows(pieces: &[Piece<'_>], h: usize, v: &mut crate::forward::Views<'_>) {
    let mut end = 0;
    for (i, p) in pieces.iter().enumerate() {
        end += p.n;
        v.x.copy_within((end - 1) * h..end * h, i * h);
    }
}
