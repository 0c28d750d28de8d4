//! The forward call: a prompt in chunks of the workspace's tokens, each embedded, run through the
//! layers on the devices that hold them (the hidden state copied at each device boundary), and
//! the head for the rows whose logits are asked for (or, for hidden states, the output norm of
//! every row on the head's device, without the head).

use std::sync::Arc;

use super::Graph;
use weightlift_kernels::Backend;

use crate::cache::Cache;
use crate::device::{Buffer, Device};
use crate::error::Result;
use crate::forward::boundary::move_rows;
use crate::forward::embed::embed_rows;
use crate::forward::exec::{self, Ctx, kernel_on};
use crate::forward::layer::{Consts, Weights, run_layer};
use crate::forward::logits::{head_rows, hidden_rows};
use crate::forward::onload::{Copier, SlotMem, onload_group, prefetch_first, settle};
use crate::forward::work::{Work, on_site, site_works};
use crate::forward::{Compute, Copies, Output, check_tokens};
use crate::model::Held;

impl Graph {
    /// Run `ids` through the model, appending to `cache` at its `seq_len`, and write the
    /// `output` asked for into `out` (`rows × width`, row-major). Returns the copies made.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        held: &[Held],
        copies: &[(usize, Held)],
        scratch: &mut [Buffer],
        cache: &Arc<Cache>,
        ids: &[u32],
        output: Output,
        (compute, int8_threshold): (Compute, f32),
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        let width = output.width(&self.dims);
        let start = check_tokens(ids, self.dims.vocab, cache)? as usize;
        out.clear();
        out.resize(output.rows(ids.len()) * width, 0.0);
        let devs: Vec<Arc<Device>> = self.sites.iter().map(|s| Arc::clone(&s.device)).collect();

        let onload_site = self
            .onload
            .as_ref()
            .map(|o| (o.site, o.slot_bytes, o.slots()));
        let (mut works, mut slot_mem) = site_works(&mut self.sites, scratch, onload_site)?;

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
        };
        let freqs: &[u8] = bytemuck::cast_slice(&self.inv_freqs);
        for (i, w) in works.iter_mut().enumerate() {
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
        let cache_copies = cache.offload_copies();
        let chunk = self.dims.tokens as usize;
        let h = c.hidden;
        let mut done = 0usize;
        std::thread::scope(|scope| -> Result<()> {
            let mut copier: Option<Copier<'_, '_>> = None;
            for part in ids.chunks(chunk) {
                let n = part.len();
                let pos = start + done;
                // Embedding rows, dequantised into the embedding device's residual stream.
                let es = self.embed_site;
                on_site!(&mut works[es],
                v => {
                    embed_rows(held, copies, &self.embed, part, h, v.x)?;
                    if let Some(s) = embed_scale {
                        weightlift_kernels::scale_in_place(&mut v.x[..n * h], s);
                    }
                },
                (b, r) => {
                    exec::embed(*b, &cx(es), &self.embed, part, &mut r.x)?;
                    if let Some(s) = embed_scale {
                        exec::scale(*b, &cx(es), n * h, s, &mut r.x)?;
                    }
                });
                for (i, w) in works.iter_mut().enumerate() {
                    on_site!(w, _v => (), (b, r) => exec::positions(*b, devs[i].name(), pos, n, r)?);
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
                    let lcx = Ctx { slot, ..cx(at) };
                    let defer = self.layers.get(li + 1).is_some_and(|next| next.site == at);
                    on_site!(&mut works[at],
                    v => { run_layer(&c, layer, li, &wts, cache, pos, n, v)?; pending = false; },
                    (b, r) => {
                        exec::layer(*b, &lcx, layer, li, cache, pos, n, r, (pending, defer))?;
                        pending = defer;
                    });
                }
                if let Some(o) = self.onload.as_mut() {
                    prefetch_first(o, &self.layers, held, copies, &mut slot_mem, &mut copier)?;
                }
                cache.appended(pos as u64, part)?;
                // The head: only the rows asked for.
                let Some((first, rows_out)) = output.chunk_rows((done, n, ids.len()), width, out)
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
        // the offloaded cache's copies of this call (none is in flight after its last layer)
        let now = cache.offload_copies();
        copies_made.add(Copies {
            count: now.count - cache_copies.count,
            bytes: now.bytes - cache_copies.bytes,
            nanos: now.nanos - cache_copies.nanos,
        });
        Ok(copies_made)
    }
}
