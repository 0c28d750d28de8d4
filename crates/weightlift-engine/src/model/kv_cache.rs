//! The cache calls run on: one attached at load or by the caller, or one the model makes for
//! itself (as transformers' `generate` does) and grows when a call needs more.

use std::sync::Arc;

use super::Model;
use crate::cache::{Cache, CacheConfig, CacheDType, Ring};
use crate::device::Device;
use crate::error::{EngineError, Result, invalid};

impl Model {
    /// The cache that calls without one run on, with room for `tokens` positions: the one
    /// attached at load or by the caller, whatever its size; else, as transformers' `generate`
    /// makes its own cache, an fp16 cache of `tokens` positions rounded up to
    /// [`weightlift_plan::SEQ_STEP`], allocated beside the layers now and kept, and replaced
    /// by a larger one when a later call needs more. A model loaded tensor-parallel has its
    /// cache from `load_tp`.
    pub fn own_cache_for(&mut self, tokens: u64) -> Result<Arc<Cache>> {
        let state = self.state()?;
        if let Some(c) = &state.cache
            && (!state.cache_made || c.config().max_seq_len >= tokens)
        {
            return Ok(Arc::clone(c));
        }
        if state.tp.is_some() {
            return self.own_cache();
        }
        let step = weightlift_plan::SEQ_STEP;
        let max_seq_len = tokens.max(1).div_ceil(step) * step;
        let config = self.cache_config(max_seq_len, 1, CacheDType::Fp16, false)?;
        let cache = Arc::new(Cache::new(config)?);
        // The smaller one goes first, so both never need room at once.
        if let Some(s) = self.state.as_mut()
            && s.cache_made
            && let Some(old) = s.cache.take()
        {
            old.free();
        }
        self.attach_cache(&cache)?;
        if let Some(s) = self.state.as_mut() {
            s.cache_made = true;
        }
        Ok(cache)
    }

    /// The cache attached at load or by the caller (`Model.forward(cache=None)` and generation
    /// use it).
    pub fn own_cache(&self) -> Result<Arc<Cache>> {
        self.state
            .as_ref()
            .ok_or_else(|| EngineError::NotLoaded {
                what: "the model".into(),
            })?
            .cache
            .clone()
            .ok_or_else(|| EngineError::NotLoaded {
                what: "a KV cache for this model (pass cache=, load with one, or create \
                       Cache(model, max_seq_len=N))"
                    .into(),
            })
    }

    /// The cache shape of this model's architecture, its sliding-window layers kept as rings
    /// sized for the forward chunks of [`Model::runtime`].
    pub fn cache_config(
        &self,
        max_seq_len: u64,
        batch_size: u64,
        dtype: CacheDType,
        offload: bool,
    ) -> Result<CacheConfig> {
        self.cache_config_for((max_seq_len, batch_size), dtype, offload, &self.runtime())
    }

    /// [`Model::cache_config`] for the forward chunks of `runtime`: what a plan of that runtime
    /// counts for the cache.
    pub fn cache_config_for(
        &self,
        (max_seq_len, batch_size): (u64, u64),
        dtype: CacheDType,
        offload: bool,
        runtime: &weightlift_plan::RuntimeSpec,
    ) -> Result<CacheConfig> {
        let spec = self.source.spec().ok_or_else(|| EngineError::Unsupported {
            what: "a cache for this checkpoint".into(),
            detail: "its architecture (n_kv_heads, head_dim) could not be read".into(),
        })?;
        let ring = self
            .sliding_window()?
            .filter(weightlift_plan::SlidingWindow::any)
            .map(|window| Ring {
                window,
                ubatch: weightlift_plan::swa_ubatch(runtime, max_seq_len),
            });
        Ok(CacheConfig {
            max_seq_len,
            batch_size,
            dtype,
            n_kv_heads: (0..spec.n_layers).map(|l| spec.n_kv_heads_at(l)).collect(),
            head_dim: spec.head_dim,
            offload,
            ring,
        })
    }

    /// The model's sliding-window layers ([`crate::planned::sliding_window_of`]); `None` for a
    /// source that is not a checkpoint, or one without them.
    pub fn sliding_window(&self) -> Result<Option<weightlift_plan::SlidingWindow>> {
        match (self.source.checkpoint(), self.source.spec()) {
            (Some(ckpt), Some(spec)) => crate::planned::sliding_window_of(ckpt, spec),
            _ => Ok(None),
        }
    }

    /// The runtime limits the caches this model makes are sized for (their rings hold one
    /// forward chunk of its `max_input_len` past the window): the loaded plan's, else the one
    /// set with [`Model::set_runtime`] (the default runtime until then).
    pub fn runtime(&self) -> weightlift_plan::RuntimeSpec {
        self.state
            .as_ref()
            .and_then(|s| s.forward.as_ref())
            .map_or(self.runtime, |f| f.runtime)
    }

    /// The runtime the plans of this model take and its caches are sized for before a load
    /// (a [`crate::session::Session`] sets its defaults' here).
    pub fn set_runtime(&mut self, runtime: weightlift_plan::RuntimeSpec) {
        self.runtime = runtime;
    }

    /// A cache of the planner's `spec` (a plan's cache, or one a caller asked for) in this
    /// model's shape: lazy, allocated beside each layer as it loads or by
    /// [`Model::attach_cache`]. The inverse of [`crate::planned::cache_spec`].
    pub fn cache_for(&self, spec: &weightlift_plan::CacheSpec) -> Result<Cache> {
        Cache::new(self.cache_config(
            spec.max_seq_len,
            spec.batch_size,
            spec.dtype,
            spec.offload,
        )?)
    }

    /// exllamav2's `Cache(model, max_seq_len, batch_size)` arguments as [`Model::new_cache`]
    /// takes them: a `max_seq_len` of -1 (exllamav2's default) or `None` is the model's trained
    /// context length; any other negative, or a `batch_size` below 1, is refused by name.
    pub fn cache_shape_args(
        max_seq_len: Option<i64>,
        batch_size: i64,
    ) -> Result<(Option<u64>, u64)> {
        let max_seq_len = match max_seq_len {
            None | Some(-1) => None,
            Some(n) => Some(u64::try_from(n).map_err(|_| {
                crate::error::invalid(
                    "max_seq_len",
                    "an int of at least 1, or -1 (or None) for the model's trained context length",
                    n,
                )
            })?),
        };
        let batch_size = u64::try_from(batch_size)
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                crate::error::invalid("batch_size", "an int of at least 1", batch_size)
            })?;
        Ok((max_seq_len, batch_size))
    }

    /// A cache a caller asks for, exllamav2's `Cache(model, max_seq_len, batch_size, lazy)`:
    /// `max_seq_len` `None` is the model's trained context length (exllamav2's `-1`). On a
    /// loaded model it is allocated beside the layers at once; on one not loaded yet it is
    /// lazy, allocated by the load it is handed to, and a non-lazy one is refused.
    pub fn new_cache(
        &mut self,
        max_seq_len: Option<u64>,
        batch_size: u64,
        dtype: CacheDType,
        offload: bool,
        lazy: bool,
    ) -> Result<Arc<Cache>> {
        let max_seq_len = match max_seq_len {
            Some(n) => n,
            None => {
                let spec =
                    self.source()
                        .spec()
                        .ok_or_else(|| weightlift_format::FormatError::Spec {
                            key: "context_length".into(),
                            detail: "the architecture could not be read, so a cache without \
                                 max_seq_len has no length; pass max_seq_len"
                                .into(),
                        })?;
                spec.context_length
            }
        };
        if !lazy && !self.is_loaded() {
            return Err(EngineError::NotLoaded {
                what: "the model of a non-lazy cache (a non-lazy cache needs a loaded model; \
                       or pass lazy=True and hand the cache to load_autosplit())"
                    .into(),
            });
        }
        let spec =
            weightlift_plan::CacheSpec::new(max_seq_len, batch_size, dtype).with_offload(offload);
        let cache = Arc::new(self.cache_for(&spec)?);
        if self.is_loaded() {
            self.attach_cache(&cache)?;
        }
        Ok(cache)
    }

    /// Allocate `cache` as a load allocates its own ([`Model::sequence_cache`]'s rule) and count
    /// it in [`Model::memory`]; the model frees it on unload.
    pub fn attach_cache(&mut self, cache: &Arc<Cache>) -> Result<()> {
        if let Err(e) = self.allocate_as_loaded(cache) {
            cache.free();
            return Err(e);
        }
        if let Some(s) = self.state.as_mut() {
            // A cache made for calls without one is nobody else's: it goes.
            if let Some(made) = s.cache.take().filter(|_| s.cache_made) {
                made.free();
            }
            s.cache = Some(Arc::clone(cache));
            s.cache_made = false;
        }
        Ok(())
    }

    /// `cache` allocated as the loaded model runs it: beside each layer, or split by kv heads
    /// over the tensor-parallel devices (a rank-local load: its rank's heads), since the
    /// tensor-parallel pass takes only a split cache.
    fn allocate_as_loaded(&self, cache: &Cache) -> Result<()> {
        let forward = self.state()?.forward.as_ref();
        let tp = forward.and_then(|f| f.tp.as_ref());
        match (tp, forward.and_then(|f| f.rank.as_ref())) {
            (Some(t), None) => self
                .tp_cache_parts(t)
                .and_then(|parts| cache.allocate_tp(&parts)),
            (Some(t), Some(r)) => self
                .tp_cache_share(t, r)
                .and_then(|share| cache.allocate_tp_rank(share)),
            (None, _) => self.allocate_beside_layers(cache),
        }
    }

    /// Every layer of `cache` allocated on its layer's device (on the cpu when offloaded).
    fn allocate_beside_layers(&self, cache: &Cache) -> Result<()> {
        let cpu = Arc::clone(self.inventory.cpu());
        let devs: Vec<Arc<Device>> = self
            .layer_devices()?
            .iter()
            .map(|n| self.resolve(n))
            .collect::<Result<_>>()?;
        if cache.n_layers() != devs.len() {
            return Err(invalid(
                "cache",
                format!("{} layers", devs.len()),
                cache.n_layers(),
            ));
        }
        for (l, d) in devs.iter().enumerate() {
            cache.allocate_layer(l, d, &cpu)?;
        }
        Ok(())
    }

    /// The sequences beyond the own cache that the plan counted (a plan's cache of
    /// batch_size N: N − 1 caches of its length), for a [`crate::generate::batch::Batch`].
    pub fn planned_sequences(&self) -> Vec<Arc<Cache>> {
        self.state
            .as_ref()
            .map_or_else(Vec::new, |s| s.sequences.clone())
    }

    /// A cache of `tokens` positions for one more sequence, leaving the model's own cache
    /// alone (an embedding's scratch, a slot of a [`Model::forward_batch`]): the own cache's
    /// dtype and offload (fp16 on the layers' devices when there is none), allocated as a load
    /// allocates it: beside each layer, or split by kv heads over the tensor-parallel devices
    /// (a rank-local load: its rank's heads). Not attached: the caller frees it
    /// ([`Cache::free`]), or it is freed when the last handle goes.
    pub fn sequence_cache(&self, tokens: u64) -> Result<Arc<Cache>> {
        let state = self.state()?;
        let (dtype, offload) = state.cache.as_ref().map_or((CacheDType::Fp16, false), |c| {
            (c.config().dtype, c.config().offload)
        });
        let cache = Arc::new(Cache::new(self.cache_config(tokens, 1, dtype, offload)?)?);
        if let Err(e) = self.allocate_as_loaded(&cache) {
            cache.free();
            return Err(e);
        }
        Ok(cache)
    }
}
