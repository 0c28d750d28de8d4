//! A decode step on one CUDA device replayed as a CUDA graph.
//!
//! On a GPU a small model's decode step is a few hundred short kernels, and the host's launches
//! take longer than the kernels: the GPU waits. A graph records the step's launches once and
//! replays them with one launch. A replay repeats every launch with the arguments it was
//! recorded with, so the step may take from the host only what lands in device memory before
//! the replay: the new token's embedding row and the positions. Everything else a step reads
//! is at the same address with the same shape every time: the weights, the workspace (its RoPE
//! table written by the forward graph's first call and kept, so no step uploads it), the cache
//! layers, and the position-dependent parts (the cache row written, attention's length and
//! grid) come from the positions buffer (the ops' device-position forms, see
//! `exec::attend_piece`). The logits are copied to the host after the replay: the step's one
//! synchronisation.
//!
//! A step is captured only where all of it runs on one CUDA device with nothing from the host
//! in between (`Graph::step_eligible`): one token of each sequence (one, or a batch of no more
//! than the head's logit rows), the embedding, every layer and the head on that device, no
//! onloaded weights, no mixture-of-experts layer (their routing goes through the host), caches
//! held in place on that device, and fewer sequences than the fewest tokens from which one of
//! its products would take scratch memory ([`batch_scratch_from`]). A batch is keyed by its
//! caches in order, so a batch of other sequences (or another count) captures its own graph; the last [`KEPT`] graphs are kept, so
//! a server's batches that come and go replay theirs when they come back.
//! Tensor parallelism runs its own pass, without graphs. Everything else launches as before.
//!
//! The first eligible step of a [`StepKey`] runs its launches as usual (a warm-up: modules
//! loaded, decode's kept buffers made), the second is captured and replayed, and later ones
//! replay while the key holds. Another key (another cache or size, a new workspace, another
//! compute mode) warms up and captures its own; a graph whose key is not seen again is dropped
//! once [`KEPT`] newer ones exist. A graph is only ever replayed for a key equal to its own,
//! whose memory is then the memory it was captured on (the key holds each cache layer's rows
//! besides its addresses: a cache made at a freed one's addresses with other rings is another
//! key), so a stale graph is never launched on freed memory. Unloading the model or switching
//! the host backend drops the whole forward graph, these with it. `WEIGHTLIFT_CUDA_GRAPHS=0`
//! (or [`crate::Model::set_cuda_graphs`]) turns it off.

// A replay launches on buffers the graph recorded, which the caller must keep alive: the
// kernels' replay is unsafe, and the key below is what keeps it sound.
#![allow(unsafe_code)]

use weightlift_kernels::{Backend, CudaBackend, CudaStepGraph};

use crate::cache::{Cache, CacheConfig};
use crate::error::{EngineError, Result};
use crate::forward::Compute;

/// Captured steps kept per forward graph (and keys remembered as warmed up).
pub(crate) const KEPT: usize = 4;

/// Whether CUDA graphs are on by default: unless `WEIGHTLIFT_CUDA_GRAPHS` is `0`.
pub(crate) fn enabled_by_env() -> bool {
    std::env::var("WEIGHTLIFT_CUDA_GRAPHS").map_or(true, |v| v.trim() != "0")
}

/// What a captured step depends on besides the weights (which live as long as the forward graph
/// that holds the capture): equal keys mean the same launches on the same memory.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepKey {
    /// Each sequence's cache, in the batch's order (one for a single sequence).
    pub caches: Vec<CacheKey>,
    pub compute: Compute,
    /// The LLM.int8 outlier threshold's bits (a launch argument of its products).
    pub int8_threshold: u32,
    /// The workspace's residual stream and logits addresses.
    pub workspace: (u64, u64),
    /// The held tensors' table and their copies' (address and length of each): a reload
    /// makes others.
    pub held: [(usize, usize); 2],
}

/// One sequence's cache as a captured step sees it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CacheKey {
    /// Each layer's key and value addresses.
    pub layers: Vec<(u64, u64)>,
    /// Each layer's rows. A ring's are a launch argument of its store and its attention
    /// (position p in row p % rows), and its buffers are no larger: a cache with smaller rings
    /// made at a freed cache's addresses (another `ubatch`, at the same `max_seq_len` and so
    /// the same span) would have the freed cache's graph write past them.
    pub rows: Vec<u64>,
    /// The keys attention splits at this step's position (its grid follows them; see
    /// `weightlift_kernels::sources::attention_decode_span`; a sliding-window layer's are a
    /// function of these and its window, `attention_window_span`), and the cache's storage.
    pub span: usize,
    pub dtype: weightlift_plan::CacheDType,
}

impl CacheKey {
    /// The key of `cache` for a step of `n` tokens from position `pos`, when every layer of it
    /// is on a CUDA device.
    pub(crate) fn of(cache: &Cache, pos: usize, n: usize) -> Option<CacheKey> {
        let layers = cache.cuda_addrs().into_iter().collect::<Option<_>>()?;
        Some(CacheKey::at(layers, cache.config(), pos, n))
    }

    /// The key of a cache shaped as `config` whose layers are at `layers`.
    fn at(layers: Vec<(u64, u64)>, config: &CacheConfig, pos: usize, n: usize) -> CacheKey {
        CacheKey {
            layers,
            rows: (0..config.n_kv_heads.len())
                .map(|l| config.rows(l))
                .collect(),
            // as `exec::attend_piece` takes it
            span: weightlift_kernels::sources::attention_decode_span(
                pos + n,
                config.max_seq_len as usize,
            ),
            dtype: config.dtype,
        }
    }
}

/// The captured steps of one forward graph, and how often steps were captured and replayed.
#[derive(Debug, Default)]
pub(crate) struct StepGraphs {
    /// The keys whose step ran once with plain launches: the next step of one is captured.
    warm: Vec<StepKey>,
    /// The captured steps, the last used last.
    graphs: Vec<(StepKey, CudaStepGraph)>,
    /// A key whose capture failed, and why: its steps keep to plain launches.
    refused: Option<(StepKey, String)>,
    /// Per compute mode, the fewest sequences whose step takes scratch memory (see
    /// [`StepGraphs::run`]), found at the first batch in that mode.
    scratch_from: Vec<(Compute, usize)>,
    pub captures: u64,
    pub replays: u64,
}

impl StepGraphs {
    /// Runs `step` (a decode step's launches between the uploads and the logits' copy) on `b`
    /// for `key`: replayed from the graph of `key`, captured then replayed when `key` has
    /// warmed up, else launched as usual. `scratch_from` gives the fewest sequences whose step
    /// takes scratch memory ([`batch_scratch_from`]); it is asked once per compute mode.
    pub(crate) fn run(
        &mut self,
        b: &CudaBackend,
        key: StepKey,
        scratch_from: impl FnOnce() -> Result<usize>,
        mut step: impl FnMut(&CudaBackend) -> Result<()>,
    ) -> Result<()> {
        if self.refused.as_ref().is_some_and(|(k, _)| *k == key) {
            return step(b);
        }
        // A batch of as many sequences as some product's scratch count runs that product on
        // cuBLAS or the dequantised path, or quantises its activations past the kept buffer,
        // each into scratch: recorded, that scratch would be the graph's memory for as long as
        // the graph is kept, which no plan charges. Such a step launches as usual (its
        // launches are few beside its work). One sequence is always recorded, as before
        // batches were (a product's scratch at one token is its own business).
        if key.caches.len() > 1 {
            let from = match self.scratch_from.iter().find(|(c, _)| *c == key.compute) {
                Some(&(_, n)) => n,
                None => {
                    let n = scratch_from()?;
                    self.scratch_from.push((key.compute, n));
                    n
                }
            };
            if key.caches.len() >= from {
                return step(b);
            }
        }
        if let Some(i) = self.graphs.iter().position(|(k, _)| *k == key) {
            let g = self.graphs.remove(i);
            self.graphs.push(g);
        } else {
            let Some(w) = self.warm.iter().position(|k| *k == key) else {
                step(b)?;
                if self.warm.len() == KEPT {
                    self.warm.remove(0);
                }
                self.warm.push(key);
                return Ok(());
            };
            self.warm.remove(w);
            // the step's error while it was recorded: the refusal's reason, if the launched
            // step runs
            let mut failed: Option<EngineError> = None;
            let captured = b.capture(|b| {
                step(b).map_err(|e| {
                    let message = e.to_string();
                    failed = Some(e);
                    weightlift_kernels::KernelError::Cuda {
                        during: "recording a decode step".into(),
                        message,
                    }
                })
            });
            match captured {
                Ok(g) => {
                    self.captures += 1;
                    if self.graphs.len() == KEPT {
                        self.graphs.remove(0);
                    }
                    self.graphs.push((key, g));
                }
                Err(e) => {
                    // Nothing of the step ran while it was recorded, so it is launched as
                    // usual. The step's error is not always its own: a call the driver refuses
                    // inside a capture (and not outside) fails the step too. An error the step
                    // makes launched is its own, and is returned; when the launched step runs,
                    // the capture was refused, and this key keeps to plain launches.
                    step(b)?;
                    let why = failed.map_or_else(|| e.to_string(), |f| f.to_string());
                    self.refused = Some((key, why));
                    return Ok(());
                }
            }
        }
        let Some((_, g)) = self.graphs.last_mut() else {
            return step(b);
        };
        // SAFETY: the graph's key equals `key`: the cache layers, the workspace and the held
        // tensors' table are the buffers it was captured with, and the weights and the forward
        // graph's own copies live as long as this `StepGraphs` (a field of that graph). Every
        // launch of the step is ordered on this backend's one stream, as the replay is.
        unsafe { b.replay(g) }.map_err(|e| {
            crate::forward::exec::kernel_on(&b.name(), "replaying a decode step", e)
        })?;
        self.replays += 1;
        Ok(())
    }

    /// Why the last capture was refused by the driver, if one was.
    pub(crate) fn refused(&self) -> Option<&str> {
        self.refused.as_ref().map(|(_, why)| why.as_str())
    }
}

/// The fewest sequences from which a decode batch through `layers` and `head` on `b` (weights
/// read as `cx` reads them) takes scratch memory: the least of its products'
/// [`CudaBackend::scratch_from_tokens`], a batch's sequences being a product's tokens where
/// the mode shares products between sequences ([`Exec::shared_tokens`]; exact mode runs
/// each sequence's own). A product the kernels route elsewhere (LLM.int8's) counts from its
/// second token, as every batch did before this count.
pub(crate) fn batch_scratch_from(
    b: &CudaBackend,
    cx: &crate::forward::exec::Ctx<'_>,
    layers: &[crate::forward::parts::Layer],
    head: &crate::forward::parts::Linear,
) -> Result<usize> {
    use crate::forward::exec::Exec;
    let mut from = usize::MAX;
    let linears = layers.iter().flat_map(|l| l.linears()).chain([head]);
    for l in linears {
        let n = match cx.weight(b, l)?.1 {
            crate::forward::weights::Packing::Blocks(ty) => {
                let mode = cx.mode::<CudaBackend>(ty);
                let tokens = b.scratch_from_tokens(ty, mode, l.cols);
                if tokens > CudaBackend::shared_tokens(cx.c.compute, mode) {
                    usize::MAX
                } else {
                    tokens
                }
            }
            crate::forward::weights::Packing::Int8 => 2,
        };
        from = from.min(n);
    }
    Ok(from.max(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Ring;
    use weightlift_plan::{CacheDType, SlidingWindow};

    fn config(ring: Option<u64>) -> CacheConfig {
        CacheConfig {
            max_seq_len: 8192,
            batch_size: 1,
            dtype: CacheDType::Fp16,
            n_kv_heads: vec![4, 4],
            head_dim: 64,
            offload: false,
            ring: ring.map(|ubatch| Ring {
                window: SlidingWindow {
                    window: 1024,
                    layers: vec![true, false],
                },
                ubatch,
            }),
        }
    }

    #[test]
    fn a_cache_with_other_rings_at_the_same_addresses_is_another_key() {
        // Caches of one max_seq_len whose layers were made at the same addresses: the same
        // span at every position, so only their rows tell a graph recorded on one (each ring
        // store and attention a launch with its rows) from the other, whose rings are smaller.
        let layers = vec![(0x7000_0000, 0x7100_0000), (0x7200_0000, 0x7300_0000)];
        let (wide, narrow, full) = (config(Some(512)), config(Some(256)), config(None));
        assert!(narrow.rows(0) < wide.rows(0) && wide.rows(0) < full.rows(0));
        for pos in [0, 1100, 1400, 5000] {
            let key = |c: &CacheConfig| CacheKey::at(layers.clone(), c, pos, 1);
            let (w, n, f) = (key(&wide), key(&narrow), key(&full));
            assert_eq!((w.span, n.span), (f.span, f.span), "position {pos}");
            assert_eq!(w, key(&wide));
            assert_ne!(w, n, "position {pos}");
            assert_ne!(w, f, "position {pos}");
            assert_eq!(w.rows, [wide.rows(0), 8192]);
        }
    }
}
