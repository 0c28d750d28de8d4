//! The KV cache: one K and one V region per layer, on that layer's device.
//!
//! Layout per layer: `(batch, max_seq_len, n_kv_heads, head_dim)`, so one token of one sequence
//! is a contiguous row of `n_kv_heads × head_dim` values (exllamav2's layout). Quantised caches
//! group each row in runs of 32 values with one f16 scale per group, stored after the data.
//! Bytes per element (the planner predicts exactly these):
//!
//! | dtype | K | V | round-trip error bound, per value `x` of group `g` |
//! |---|---|---|---|
//! | fp16 | 2 | 2 | `|x|·2⁻¹¹ + 2⁻²⁵` for `|x| ≤ 65504` |
//! | bf16 | 2 | 2 | `|x|·2⁻⁸ + 2⁻¹³³` (f32's range) |
//! | fp8 (e4m3) | 1 | 1 | `|x|·2⁻⁴ + 2⁻¹⁰` for `|x| ≤ 448` (saturates above) |
//! | q8 | 8.5/8 | 8.5/8 | `√32·‖g‖/254·(1+2⁻⁹) + 2⁻¹⁷` |
//! | q6 | 8.5/8 (8-bit) | 4.5/8 (4-bit) | K as q8, V as q4 (exllamav2's Q6 cache) |
//! | q4 | 4.5/8 | 4.5/8 | `√32·‖g‖/14·(1+2⁻⁹) + 2⁻¹⁷` |
//!
//! Rows are encoded and decoded by the kernels crate's one cache codec
//! ([`weightlift_kernels::KvFormat`]), which the CPU backend calls and the CUDA kernels mirror
//! bit for bit, so layers computed on either path read the same cache. q8 and q4 are its KV
//! quantisers: symmetric absmax, the scale `d = absmax/127` (levels −127…127) or
//! `absmax/7` (levels −7…7) rounded *up* to f16, one 34- or 18-byte group per 32 values (scale
//! first). The kernels guarantee `|x − x̂| ≤ d·(1/2 + 2⁻¹⁶)`; with the upward f16 rounding of `d`
//! (relative 2⁻¹⁰, or 2⁻²⁴ absolute for subnormal scales) that bounds the error of each stored
//! value. Before quantising, each group is turned by the orthonormal Walsh-Hadamard transform
//! (and turned back after dequantising), as exllamav2's quantised caches do: keys have outlier
//! channels, and without the turn one outlier sets the scale of 31 small values. On SmolLM2 it
//! halves the q4 cache's logit error and keeps every argmax whose margin is above 0.5 (see
//! `tests/forward.rs`). The per-value bounds above follow: the turned group's largest value is
//! at most `‖g‖`, and turning back mixes the 32 roundings.
//!
//! A sliding-window layer (gemma2 and gemma3's local layers, mistral's and qwen2's windowed
//! ones: the plan crate's [`SlidingWindow`]) keeps a ring of [`CacheConfig::rows`] rows: the
//! window and one forward chunk of `ubatch` tokens, padded to 256, as llama.cpp's SWA cache
//! (`SlidingWindow::cells`, the function the plan sizes the cache with, so the plan's kv column
//! is what the cache holds). Position `p` lives in row `p % rows`; a full-attention layer has
//! `max_seq_len` rows, where that is `p` itself. A chunk's keys are written before its queries
//! attend, and the ring's room past the window is what keeps them from overwriting a key one of
//! those queries still reads, so the forward pass cuts prompts into chunks of at most
//! [`CacheConfig::max_chunk`] tokens and a call whose keys would not fit is refused
//! ([`EngineError::OutsideWindow`]) before anything is written. What a ring no longer holds is
//! refused by name too: reading positions before its window, rewinding ([`Cache::truncate`],
//! prefix reuse through [`Cache::common_prefix`]) to a length whose window is gone; a saved
//! state holds each layer's rows from where its ring starts.
//!
//! A lazy cache is allocated layer by layer during the load, on each layer's device. An offloaded
//! cache keeps every layer in host RAM and, as transformers' `OffloadedCache` does, copies a
//! layer to its device when it is used while the next layer is prefetched on a second thread
//! (one per cache, kept for its life).
//!
//! Memory of an offloaded cache (what [`Cache::memory`] reports, and what
//! [`CacheConfig::expected_memory`] predicts from the layer devices): every layer's K and V on
//! `cpu`, plus, on each layer device, two slots sized for the largest layer it computes (one
//! when it computes a single layer): the layer in use and the next one being prefetched, the
//! pair transformers' `OffloadedCache` keeps on the GPU. [`Cache::fetch`] lends a slot to the
//! caller (no copy when the layer was prefetched into it) and the slot returns to the cache when
//! the [`Resident`] is dropped. The planner charges exactly these bytes for a cache request with
//! `offload` set (`weightlift_plan::CacheSpec::offload`; [`SLOTS`] is its `OFFLOAD_SLOTS`): the
//! whole cache in the cpu's kv column and the slots in each layer device's, so a plan's kv
//! column equals what an offloaded cache holds (`crate::planned::cache_spec` builds the
//! request).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use weightlift_kernels::KvFormat;
use weightlift_plan::SlidingWindow;

use crate::device::{Buffer, Device};
use crate::error::{EngineError, Result, invalid};
use crate::forward::KvSettings;

mod offload;
mod prefetch;
mod state;
mod stored_rows;
mod tp_parts;
use offload::Pool;
pub use offload::Resident;
use prefetch::Prefetcher;
pub use state::CacheState;
pub use tp_parts::TpPart;

/// Values per quantisation group.
pub const GROUP: usize = 32;

/// The element type of a cache: the planner's, so that one grammar and one size table serve
/// both.
pub use weightlift_plan::CacheDType;

/// How K and V of a cache dtype are stored (the kernels' one cache codec, which the CUDA kernels
/// and the CPU backend share).
pub(crate) fn formats(d: CacheDType) -> (KvFormat, KvFormat) {
    match d {
        CacheDType::F32 => (KvFormat::F32, KvFormat::F32),
        CacheDType::Fp16 => (KvFormat::F16, KvFormat::F16),
        CacheDType::Bf16 => (KvFormat::BF16, KvFormat::BF16),
        CacheDType::Fp8 => (KvFormat::E4M3, KvFormat::E4M3),
        CacheDType::Q8 => (KvFormat::Q8, KvFormat::Q8),
        CacheDType::Q6 => (KvFormat::Q8, KvFormat::Q4),
        CacheDType::Q4 => (KvFormat::Q4, KvFormat::Q4),
    }
}

/// The shape of a cache.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    pub max_seq_len: u64,
    pub batch_size: u64,
    pub dtype: CacheDType,
    /// KV heads per layer.
    pub n_kv_heads: Vec<u32>,
    pub head_dim: u32,
    pub offload: bool,
    /// The sliding-window layers kept as rings (see the module documentation); `None` keeps
    /// every position of every layer.
    pub ring: Option<Ring>,
}

/// How a cache keeps its sliding-window layers: each a ring of
/// [`SlidingWindow::cells`]`(layer, max_seq_len, ubatch)` rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    /// The model's sliding-window layers and the tokens they attend to.
    pub window: SlidingWindow,
    /// Tokens of one sequence in a forward chunk (llama.cpp's micro-batch): the room past the
    /// window a chunk's keys take ([`weightlift_plan::swa_ubatch`] of the runtime the cache is
    /// made for).
    pub ubatch: u64,
}

impl CacheConfig {
    /// Rows per sequence of `layer`: a sliding-window layer's ring, else `max_seq_len`.
    pub fn rows(&self, layer: usize) -> u64 {
        self.ring.as_ref().map_or(self.max_seq_len, |r| {
            r.window.cells(layer, self.max_seq_len, r.ubatch)
        })
    }

    /// The window `layer` attends to (0: every position), as the ring keeps it.
    pub fn window(&self, layer: usize) -> u64 {
        match &self.ring {
            Some(r) if r.window.is_sliding(layer) => r.window.window,
            _ => 0,
        }
    }

    /// Whether `layer` is kept as a ring that positions wrap around: fewer rows than
    /// `max_seq_len`.
    pub fn is_ring(&self, layer: usize) -> bool {
        self.rows(layer) < self.max_seq_len
    }

    /// The most tokens of one sequence a forward chunk may hold: with a window of `w` and `r`
    /// rows, a chunk of `n` tokens reads the keys of `n + w - 1` positions once its own are
    /// written, which the ring holds while `n <= r + 1 - w`. `max_seq_len` without a ring.
    pub fn max_chunk(&self) -> u64 {
        (0..self.n_kv_heads.len())
            .filter(|&l| self.is_ring(l))
            .map(|l| (self.rows(l) + 1).saturating_sub(self.window(l)).max(1))
            .min()
            .unwrap_or(self.max_seq_len)
    }

    /// The shape of `n_tokens` positions of `layer`'s keys, and of its values, as
    /// [`Cache::write`] takes them and [`Cache::read`] gives them: `(batch_size, n_kv_heads,
    /// n_tokens, head_dim)`, with no heads for a layer the model does not have.
    pub fn kv_shape(&self, layer: usize, n_tokens: u64) -> [u64; 4] {
        let heads = self.n_kv_heads.get(layer).copied().unwrap_or(0);
        [
            self.batch_size,
            u64::from(heads),
            n_tokens,
            u64::from(self.head_dim),
        ]
    }

    /// The positions `k` and `v` of shapes `k_shape` and `v_shape` hold for [`Cache::write`]
    /// into `layer`: both must be [`CacheConfig::kv_shape`] of some count of positions.
    pub fn positions_of(&self, layer: usize, k_shape: &[u64], v_shape: &[u64]) -> Result<u64> {
        let n_tokens = k_shape.get(2).copied().unwrap_or(0);
        let [batch, heads, _, head_dim] = self.kv_shape(layer, n_tokens);
        if k_shape != [batch, heads, n_tokens, head_dim] || v_shape != k_shape {
            return Err(invalid(
                "k and v",
                format!("float32 arrays both ({batch}, {heads}, n_tokens, {head_dim})"),
                format!("{k_shape:?} and {v_shape:?}"),
            ));
        }
        Ok(n_tokens)
    }

    fn row(&self, layer: usize) -> u64 {
        u64::from(self.n_kv_heads[layer]) * u64::from(self.head_dim)
    }

    /// Values of K (or of V) in one layer.
    pub fn values(&self, layer: usize) -> u64 {
        self.row(layer) * self.rows(layer) * self.batch_size
    }

    /// Bytes of K and V of one layer.
    pub fn layer_bytes(&self, layer: usize) -> u64 {
        let (k, v) = self.dtype.kv_bytes(self.values(layer));
        k + v
    }

    /// The bytes this cache holds per device once allocated beside `layer_devices` (one name
    /// per layer): each layer on its device; or, offloaded, every layer on `cpu` plus
    /// [`SLOTS`] slots per layer device (one when it computes a single layer), each the
    /// largest K and the largest V of its layers.
    pub fn expected_memory(&self, layer_devices: &[String]) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = Vec::new();
        let mut add = |name: &str, b: u64| match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v += b,
            None => out.push((name.to_owned(), b)),
        };
        if !self.offload {
            for (l, d) in layer_devices.iter().enumerate().take(self.n_kv_heads.len()) {
                add(d, self.layer_bytes(l));
            }
            return out;
        }
        let mut slots: Vec<(&str, u64, u64, u64)> = Vec::new();
        for (l, d) in layer_devices.iter().enumerate().take(self.n_kv_heads.len()) {
            add("cpu", self.layer_bytes(l));
            let (k, v) = self.dtype.kv_bytes(self.values(l));
            match slots.iter_mut().find(|(n, _, _, _)| n == d) {
                Some((_, mk, mv, n)) => {
                    *mk = (*mk).max(k);
                    *mv = (*mv).max(v);
                    *n += 1;
                }
                None => slots.push((d, k, v, 1)),
            }
        }
        for (d, k, v, n) in slots {
            add(d, n.min(SLOTS as u64) * (k + v));
        }
        out
    }
}

/// One layer's K and V, in host-addressable memory on `store` (the layer's device, or `cpu` for
/// an offloaded cache).
#[derive(Debug)]
struct LayerStore {
    /// The device the layer computes on (and `device_of` reports).
    device: Arc<Device>,
    k: Buffer,
    v: Buffer,
}

/// Slots per layer device of an offloaded cache: the layer in use and the one being prefetched.
/// The planner's constant, so that plans charge what the cache allocates.
pub const SLOTS: usize = weightlift_plan::OFFLOAD_SLOTS as usize;

/// A KV cache. Shared (`Arc`) between its owner and the model that allocates it lazily.
#[derive(Debug)]
pub struct Cache {
    config: CacheConfig,
    layers: Mutex<Vec<Option<LayerStore>>>,
    /// Offload: the slots of each layer device.
    pools: Mutex<Vec<Pool>>,
    /// Offload: bumped on every `free`, so a slot lent before it is not taken back after.
    generation: AtomicU64,
    /// Per layer: bumped on every write, so a slot holding an older copy is refilled.
    versions: Vec<AtomicU64>,
    /// Offload: the prefetch of the next layer into a free slot, on the cache's own thread.
    prefetch: Prefetcher,
    /// Tokens of sequence 0 the forward pass has written (`Cache.seq_len` in Python).
    seq_len: AtomicU64,
    /// Rows of each sequence written since the last reset (the largest written position + 1):
    /// filling an offloaded layer's slot copies these, not the whole `max_seq_len`.
    written: AtomicU64,
    /// Per layer: the first position a loaded state held ([`Cache::load_state`]; 0 after a
    /// reset): the rows before it were never written since.
    floors: Vec<AtomicU64>,
    /// Offload: the copies between host RAM and the device slots since the cache was made
    /// (count, bytes, nanoseconds).
    copied: [AtomicU64; 3],
    /// The ids at positions `0..seq_len`, while every one came through [`Cache::note_ids`]: a new
    /// prompt then reuses the longest common prefix, as llama-cpp-python's `generate` does.
    ids: Mutex<Vec<u32>>,
    /// The forward settings the rows at `0..seq_len` were computed under; `None` when no
    /// forward call wrote them (a new, reset or loaded cache, whose rows are taken as they are).
    computed_under: Mutex<Option<KvSettings>>,
    /// Tensor parallelism: the layers split by kv heads, one part per device
    /// ([`Cache::allocate_tp`]); the parent keeps the sequence and these hold the rows.
    tp: Mutex<Vec<TpPart>>,
    /// Split for one rank of a multi-process run ([`Cache::allocate_tp_rank`]): allocated even
    /// with no parts, where the rank holds no kv heads.
    tp_rank: std::sync::atomic::AtomicBool,
}

impl Cache {
    pub fn new(config: CacheConfig) -> Result<Cache> {
        if config.max_seq_len == 0 || config.batch_size == 0 {
            return Err(invalid(
                "cache size",
                "max_seq_len and batch_size above 0",
                format!("{} × {}", config.max_seq_len, config.batch_size),
            ));
        }
        let (k, v) = formats(config.dtype);
        for (l, &h) in config.n_kv_heads.iter().enumerate() {
            let row = u64::from(h) * u64::from(config.head_dim);
            if (k.quant().is_some() || v.quant().is_some()) && row % GROUP as u64 != 0 {
                return Err(invalid(
                    format!("{} cache, layer {l}", config.dtype.name()),
                    format!("n_kv_heads × head_dim a multiple of {GROUP}"),
                    row,
                ));
            }
        }
        let n = config.n_kv_heads.len();
        if let Some(r) = &config.ring
            && r.window.layers.len() != n
        {
            return Err(invalid(
                "cache ring",
                format!("a window flag for each of the {n} layers"),
                format!("{} flags", r.window.layers.len()),
            ));
        }
        Ok(Cache {
            config,
            layers: Mutex::new((0..n).map(|_| None).collect()),
            pools: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            versions: (0..n).map(|_| AtomicU64::new(0)).collect(),
            prefetch: Prefetcher::default(),
            seq_len: AtomicU64::new(0),
            written: AtomicU64::new(0),
            floors: (0..n).map(|_| AtomicU64::new(0)).collect(),
            copied: Default::default(),
            ids: Mutex::new(Vec::new()),
            computed_under: Mutex::new(None),
            tp: Mutex::new(Vec::new()),
            tp_rank: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub fn n_layers(&self) -> usize {
        self.config.n_kv_heads.len()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Option<LayerStore>>> {
        self.layers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_under(&self) -> MutexGuard<'_, Option<KvSettings>> {
        self.computed_under
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_ids(&self) -> MutexGuard<'_, Vec<u32>> {
        self.ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_pools(&self) -> MutexGuard<'_, Vec<Pool>> {
        self.pools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn version(&self, layer: usize) -> u64 {
        self.versions
            .get(layer)
            .map_or(0, |v| v.load(Ordering::Acquire))
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.n_layers() {
            return Err(invalid(
                "cache layer",
                format!("below {}", self.n_layers()),
                layer,
            ));
        }
        Ok(())
    }

    /// Allocate `layer` for compute on `device`; its memory goes on `device`, or on `cpu` when
    /// the cache is offloaded. Reallocates if the layer already lives elsewhere.
    pub fn allocate_layer(
        &self,
        layer: usize,
        device: &Arc<Device>,
        cpu: &Arc<Device>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let store = if self.config.offload { cpu } else { device };
        let (kb, vb) = self.config.dtype.kv_bytes(self.config.values(layer));
        let mut layers = self.lock();
        if let Some(s) = &layers[layer]
            && Arc::ptr_eq(&s.device, device)
            && Arc::ptr_eq(s.k.device(), store)
        {
            return Ok(());
        }
        layers[layer] = None;
        let k = store.alloc(kb)?;
        let v = store.alloc(vb)?;
        if self.config.offload {
            self.ensure_pool(layer, device, kb, vb)?;
        }
        layers[layer] = Some(LayerStore {
            device: Arc::clone(device),
            k,
            v,
        });
        Ok(())
    }

    /// Free every layer and slot (slots lent to a [`Resident`] are freed when it is dropped).
    pub fn free(&self) {
        self.join_prefetch();
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.lock().iter_mut().for_each(|l| *l = None);
        self.lock_pools().clear();
        self.lock_tp().clear();
        self.tp_rank.store(false, Ordering::Release);
    }

    pub fn is_allocated(&self) -> bool {
        let tp = self.lock_tp();
        if !tp.is_empty() || self.tp_rank.load(Ordering::Acquire) {
            return tp.iter().all(|p| p.cache.is_allocated());
        }
        drop(tp);
        self.lock().iter().all(Option::is_some)
    }

    /// The device layer `layer` computes on, once allocated.
    pub fn device_of(&self, layer: usize) -> Result<String> {
        self.check_layer(layer)?;
        if let Some(names) = self.tp_devices() {
            return Ok(names);
        }
        held(&self.lock(), layer).map(|s| s.device.name().to_owned())
    }

    /// What [`Cache::memory`] should report for the devices the layers were allocated for
    /// ([`CacheConfig::expected_memory`]); errors before every layer is allocated.
    pub fn expected_memory(&self) -> Result<Vec<(String, u64)>> {
        if let Some(m) = self.expected_memory_tp() {
            return Ok(m);
        }
        let devs = (0..self.n_layers())
            .map(|l| self.device_of(l))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.config.expected_memory(&devs))
    }

    /// Bytes held per device name: the layers, and an offloaded cache's prefetch slots.
    pub fn memory(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = Vec::new();
        let mut add = |name: &str, bytes: u64| match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, b)) => *b += bytes,
            None => out.push((name.to_owned(), bytes)),
        };
        for s in self.lock().iter().flatten() {
            add(s.k.device().name(), (s.k.len() + s.v.len()) as u64);
        }
        for p in self.lock_pools().iter() {
            add(p.device.name(), p.owned as u64 * (p.k_bytes + p.v_bytes));
        }
        for p in self.lock_tp().iter() {
            for (n, b) in p.cache.memory() {
                add(&n, b);
            }
        }
        out
    }

    /// Positions `start..start + n_tokens` of `layer` within `max_seq_len`, and no more at once
    /// than the layer's rows (a ring's rows hold that many positions).
    fn check_span(&self, layer: usize, start: u64, n_tokens: u64) -> Result<()> {
        self.check_layer(layer)?;
        let end = start.checked_add(n_tokens);
        if end.is_none_or(|e| e > self.config.max_seq_len) {
            return Err(invalid(
                format!("cache positions of layer {layer}"),
                format!("within max_seq_len {}", self.config.max_seq_len),
                format!("{start}..{}", start.saturating_add(n_tokens)),
            ));
        }
        let rows = self.config.rows(layer);
        if n_tokens > rows {
            return Err(invalid(
                format!("cache positions of layer {layer}"),
                format!(
                    "at most {rows} at once (the layer keeps its sliding window of {} tokens and \
                     one chunk)",
                    self.config.window(layer)
                ),
                format!("{start}..{}", start.saturating_add(n_tokens)),
            ));
        }
        Ok(())
    }

    /// The first position `layer` still holds: a ring's rows hold the last `rows` positions
    /// written since the last reset; a layer of every position holds them all, from where a
    /// loaded state started it.
    pub fn held_from(&self, layer: usize) -> u64 {
        let floor = self
            .floors
            .get(layer)
            .map_or(0, |f| f.load(Ordering::Acquire));
        self.written
            .load(Ordering::Acquire)
            .saturating_sub(self.config.rows(layer))
            .max(floor)
    }

    /// A loaded state holds `layer` from position `first` on.
    pub(super) fn set_floor(&self, layer: usize, first: u64) {
        if let Some(f) = self.floors.get(layer) {
            f.store(first, Ordering::Release);
        }
        // a split cache's parts hold the rows, and read them from their own floors
        for p in self.lock_tp().iter() {
            p.cache.set_floor(layer, first);
        }
    }

    /// The error for position `needed` of `layer`, which its ring no longer holds, by `what`
    /// (the call refused) with a `fix`.
    fn outside(&self, what: String, layer: usize, needed: u64, fix: String) -> EngineError {
        EngineError::OutsideWindow {
            what,
            layer,
            window: self.config.window(layer),
            rows: self.config.rows(layer),
            held_from: self.held_from(layer),
            needed,
            fix,
        }
    }

    /// Refuses a forward chunk of `n` tokens at `start` on `layer`, attending to a sliding
    /// `window` (0: every position), whose queries read a key the layer's ring no longer holds
    /// once the chunk's own keys are written: checked before anything is written, so a refused
    /// call leaves the cache as it was.
    pub(crate) fn check_attend(
        &self,
        layer: usize,
        window: usize,
        start: u64,
        n: u64,
    ) -> Result<()> {
        self.check_span(layer, start, n)?;
        if !self.config.is_ring(layer) {
            return Ok(());
        }
        let own = self.config.window(layer);
        if window as u64 != own {
            return Err(invalid(
                format!("cache layer {layer}"),
                format!(
                    "a cache made for this model (its layer attends to {})",
                    match window {
                        0 => "every position".to_owned(),
                        w => format!("a window of {w} tokens"),
                    }
                ),
                format!("a ring for a window of {own} tokens; it was made for another model"),
            ));
        }
        let rows = self.config.rows(layer);
        let low = self
            .written
            .load(Ordering::Acquire)
            .max(start + n)
            .saturating_sub(rows);
        let needed = first_seen(own, start);
        if needed < low {
            return Err(EngineError::OutsideWindow {
                what: format!("a forward chunk of {n} tokens at position {start}"),
                layer,
                window: own,
                rows,
                held_from: low,
                needed,
                fix: format!(
                    "run at most {} tokens of a sequence a call (the cache's rings were sized \
                     for chunks of {})",
                    self.config.max_chunk(),
                    self.config.ring.as_ref().map_or(0, |r| r.ubatch)
                ),
            });
        }
        Ok(())
    }

    /// Refuses to go back to `n` tokens where a layer no longer holds the window the next
    /// token attends to (0 is always allowed: nothing before it is read).
    fn check_rewind(&self, n: u64, what: &str) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        for l in 0..self.n_layers() {
            let (w, from) = (self.config.window(l), self.held_from(l));
            let needed = first_seen(w, n);
            if needed < from {
                return Err(self.outside(
                    format!("{what} to {n} tokens"),
                    l,
                    needed,
                    format!(
                        "keep at least {} tokens, or reset the cache and run the prompt again",
                        from + w.saturating_sub(1)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Write `n_tokens` tokens at position `pos`: `k` and `v` are f32 in
    /// `(batch, n_kv_heads, n_tokens, head_dim)` order.
    pub fn write(&self, layer: usize, pos: u64, n_tokens: u64, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_span(layer, pos, n_tokens)?;
        let c = &self.config;
        let heads = c.n_kv_heads[layer] as usize;
        let hd = c.head_dim as usize;
        let want = c.batch_size as usize * heads * n_tokens as usize * hd;
        if k.len() != want || v.len() != want {
            return Err(invalid(
                format!("k and v for cache layer {layer}"),
                format!(
                    "{want} values ({} × {heads} × {n_tokens} × {hd})",
                    c.batch_size
                ),
                format!("{} and {}", k.len(), v.len()),
            ));
        }
        self.join_prefetch();
        self.written.fetch_max(pos + n_tokens, Ordering::AcqRel);
        // A prefetched copy of this layer is stale from now on.
        if let Some(v) = self.versions.get(layer) {
            v.fetch_add(1, Ordering::AcqRel);
        }
        let (hk, hv) = formats(c.dtype);
        let mut layers = self.lock();
        let store = held_mut(&mut layers, layer)?;
        let row_len = heads * hd;
        let n = n_tokens as usize;
        let rows = c.rows(layer);
        let mut row = vec![0f32; row_len];
        // One batch's positions pos..pos + n are one run of contiguous rows, or two where they
        // wrap past a ring's end: encode each into its byte range (in place on host memory,
        // through a host buffer for CUDA memory).
        let mut tmp: Vec<u8> = Vec::new();
        for b in 0..c.batch_size as usize {
            for (r0, t0, count) in row_runs(rows, pos, n_tokens) {
                let first = (b * rows as usize + r0) * row_len;
                for (src, format, buf) in [(k, hk, &mut store.k), (v, hv, &mut store.v)] {
                    let (b0, b1) = (
                        format.byte_at(first),
                        format.byte_at(first + count * row_len),
                    );
                    let mut encode = |span: &mut [u8]| -> Result<()> {
                        for t in 0..count {
                            for h in 0..heads {
                                let from = ((b * heads + h) * n + t0 + t) * hd;
                                row[h * hd..(h + 1) * hd].copy_from_slice(&src[from..from + hd]);
                            }
                            encode_row(format, t * row_len, &row, span)?;
                        }
                        Ok(())
                    };
                    match buf.host_mut() {
                        Some(h) => encode(&mut h[b0..b1])?,
                        None => {
                            tmp.clear();
                            tmp.resize(b1 - b0, 0);
                            encode(&mut tmp)?;
                            buf.write(b0, &tmp)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Tokens held for sequence 0: where the next forward pass appends.
    pub fn seq_len(&self) -> u64 {
        self.seq_len.load(Ordering::Acquire)
    }

    /// Set the number of tokens held (after a forward pass wrote them, or to rewind: only
    /// to a length whose window every ring still holds, see [`Cache::truncate`]).
    pub fn set_seq_len(&self, n: u64) -> Result<()> {
        if n > self.config.max_seq_len {
            return Err(invalid(
                "cache seq_len",
                format!("at most max_seq_len {}", self.config.max_seq_len),
                n,
            ));
        }
        if n < self.seq_len() {
            self.check_rewind(n, "rewinding the cache")?;
        }
        self.seq_len.store(n, Ordering::Release);
        let mut ids = self.lock_ids();
        if n as usize <= ids.len() {
            ids.truncate(n as usize);
        } else {
            // Positions whose ids nobody told us: no prefix can be trusted.
            ids.clear();
        }
        Ok(())
    }

    /// Keep the first `n` tokens, at most those held, and forget the rest. A sliding-window
    /// layer's ring keeps only its last rows, so `n` must leave the window the next token
    /// attends to in it (or be 0): a shorter length is refused, naming the layer and the
    /// shortest length allowed.
    pub fn truncate(&self, n: u64) -> Result<()> {
        let held = self.seq_len();
        if n > held {
            return Err(invalid(
                "cache truncate",
                format!("at most the {held} tokens held"),
                n,
            ));
        }
        self.check_rewind(n, "cache truncate")?;
        self.set_seq_len(n)
    }

    /// Forget every token: the next forward pass starts at position 0. No memory is freed.
    pub fn reset(&self) {
        self.seq_len.store(0, Ordering::Release);
        self.written.store(0, Ordering::Release);
        self.floors
            .iter()
            .for_each(|f| f.store(0, Ordering::Release));
        self.lock_ids().clear();
        *self.lock_under() = None;
        // a split cache's parts hold the rows (and their rings' positions)
        for p in self.lock_tp().iter() {
            p.cache.reset();
        }
    }

    /// Record that positions `start..start + ids.len()` now hold `ids` (the forward pass calls
    /// this after writing them). A gap makes the record unusable until the next reset.
    pub fn note_ids(&self, start: u64, new: &[u32]) {
        let mut ids = self.lock_ids();
        if ids.len() as u64 == start {
            ids.extend_from_slice(new);
        } else {
            ids.clear();
        }
    }

    /// A forward pass has written `ids` at positions `start..`: record them, and hold
    /// `start + ids.len()` tokens.
    pub(crate) fn appended(&self, start: u64, ids: &[u32]) -> Result<()> {
        let end = start + ids.len() as u64;
        // a split cache's rows went to its parts: the parent keeps what its rings hold
        self.written.fetch_max(end, Ordering::AcqRel);
        self.note_ids(start, ids);
        self.set_seq_len(end)
    }

    /// A forward call is about to append rows computed under `under`. Rows held from other
    /// settings make a mix no single setting computes: the ids are forgotten, so no prefix of
    /// it is reused until the next reset.
    pub fn computing_under(&self, under: KvSettings) {
        let mut held = self.lock_under();
        if self.seq_len() > 0 && held.is_some_and(|h| h != under) {
            self.lock_ids().clear();
        }
        *held = Some(under);
    }

    /// [`Cache::common_prefix`] for a forward pass under `under`: 0 when the rows held were
    /// computed under other settings (another compute mode or int8 threshold), whose KV the
    /// current settings would not compute (see [`Cache::held_under`]).
    pub fn common_prefix_under(&self, prompt: &[u32], under: KvSettings) -> u64 {
        if !self.held_under(under) {
            return 0;
        }
        self.common_prefix(prompt)
    }

    /// Whether the rows held may be reused by a forward pass under `under`: they were computed
    /// under it, or their settings are unknown (a loaded state).
    pub fn held_under(&self, under: KvSettings) -> bool {
        self.lock_under().is_none_or(|h| h == under)
    }

    /// How many leading ids of `prompt` the cache already holds at positions `0..`, when its
    /// positions all have known ids, and it can go back to that many (every ring still holds
    /// the window the next token attends to, see [`Cache::truncate`]); 0 otherwise.
    pub fn common_prefix(&self, prompt: &[u32]) -> u64 {
        let n = {
            let ids = self.lock_ids();
            if ids.len() as u64 != self.seq_len() {
                return 0;
            }
            ids.iter().zip(prompt).take_while(|(a, b)| a == b).count() as u64
        };
        if self.check_rewind(n, "reusing a prefix").is_err() {
            return 0;
        }
        n
    }

    /// `(values per row, rows)` of `k` and `v` slices for `layer`: whole rows, as many of each.
    fn whole_rows(&self, layer: usize, k: usize, v: usize) -> Result<(usize, usize)> {
        self.check_layer(layer)?;
        let row = self.config.row(layer) as usize;
        let n = k.checked_div(row).unwrap_or(0);
        if row == 0 || k != n * row || v != k {
            return Err(invalid(
                format!("k and v rows of cache layer {layer}"),
                format!("whole rows of {row} values, as many of v as of k"),
                format!("{k} and {v}"),
            ));
        }
        Ok((row, n))
    }

    /// Write token-major rows of sequence 0 at `pos`: `k` and `v` hold `n × n_kv_heads ×
    /// head_dim` f32 values each, the cache's own row layout, so each row is encoded in place.
    pub fn write_rows(&self, layer: usize, pos: u64, k: &[f32], v: &[f32]) -> Result<()> {
        let (row, n) = self.whole_rows(layer, k.len(), v.len())?;
        self.check_span(layer, pos, n as u64)?;
        self.join_prefetch();
        self.written.fetch_max(pos + n as u64, Ordering::AcqRel);
        let was = self
            .versions
            .get(layer)
            .map(|v| v.fetch_add(1, Ordering::AcqRel));
        let (hk, hv) = formats(self.config.dtype);
        let mut layers = self.lock();
        let store = held_mut(&mut layers, layer)?;
        let spans = byte_runs(self.config.rows(layer), pos, n as u64, row, [hk, hv]);
        for (t0, count, [ks, vs]) in &spans {
            for (src, format, buf, (b0, b1)) in
                [(k, hk, &mut store.k, *ks), (v, hv, &mut store.v, *vs)]
            {
                let Some(h) = buf.host_mut() else {
                    return Err(EngineError::Unsupported {
                        what: format!("writing cache rows on {}", store.device.name()),
                        detail: "the host forward pass writes host memory only".into(),
                    });
                };
                let span = &mut h[b0..b1];
                let rows = &src[t0 * row..(t0 + count) * row];
                for (t, r) in rows.chunks_exact(row).enumerate() {
                    encode_row(format, t * row, r, span)?;
                }
            }
        }
        if let (true, Some(was)) = (self.config.offload, was) {
            let spans: Vec<[(usize, usize); 2]> = spans.iter().map(|s| s.2).collect();
            self.refresh_slots(layer, store, was, &spans)?;
        }
        Ok(())
    }

    /// Lends the K and V storage of `layer` (on the layer's device) to `f`, which writes rows
    /// `pos..pos + n` of sequence 0 in the cache's own layout (position `p` in row
    /// `p % rows`) and reads them back in place: the forward pass through the kernels' backends
    /// (cuda layers) does both on the device. The layer's write version is bumped first, as
    /// [`Cache::write_rows`] does. An offloaded cache keeps its layers in host RAM and lends
    /// device copies through [`Cache::fetch`] instead, so it is refused here.
    pub(crate) fn with_layer<R>(
        &self,
        layer: usize,
        (pos, n): (u64, u64),
        f: impl FnOnce(&mut Buffer, &mut Buffer) -> Result<R>,
    ) -> Result<R> {
        self.check_span(layer, pos, n)?;
        if self.config.offload {
            return Err(EngineError::Unsupported {
                what: format!("lending offloaded cache layer {layer} in place"),
                detail: "an offloaded cache lives in host RAM; load without offload".into(),
            });
        }
        self.join_prefetch();
        self.written.fetch_max(pos + n, Ordering::AcqRel);
        if let Some(ver) = self.versions.get(layer) {
            ver.fetch_add(1, Ordering::AcqRel);
        }
        let mut layers = self.lock();
        let store = held_mut(&mut layers, layer)?;
        f(&mut store.k, &mut store.v)
    }

    /// The device address of every layer's keys and values on a CUDA device, in layer order
    /// (`None` for a layer held anywhere else): what a captured CUDA graph of a decode step
    /// writes and reads, so the graph is replayed only while these stay the same.
    pub(crate) fn cuda_addrs(&self) -> Vec<Option<(u64, u64)>> {
        self.lock()
            .iter()
            .map(|l| {
                let s = l.as_ref()?;
                Some((s.k.cuda()?.device_addr(), s.v.cuda()?.device_addr()))
            })
            .collect()
    }

    /// Decode rows `start..start + k.len() / row` of sequence 0 of `layer` into `k` and `v`
    /// (token-major f32), from `resident` when given (an offloaded layer lent by
    /// [`Cache::fetch`]), else from the layer's store.
    pub fn decode_rows(
        &self,
        layer: usize,
        resident: Option<&Resident>,
        start: u64,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<()> {
        let (row, n) = self.whole_rows(layer, k.len(), v.len())?;
        self.check_span(layer, start, n as u64)?;
        let (hk, hv) = formats(self.config.dtype);
        let spans = byte_runs(self.config.rows(layer), start, n as u64, row, [hk, hv]);
        // A run of rows is one contiguous span of whole rows in each format (every format
        // encodes a row on its own), so it decodes in one call; keys and values decode side by
        // side once a run is big enough to pay for the second thread.
        let decode = |dst: &mut [f32], format: KvFormat, buf: &Buffer, (b0, b1): (usize, usize)| {
            let Some(h) = buf.host() else {
                return Err(EngineError::Unsupported {
                    what: format!("reading cache rows on {}", buf.device().name()),
                    detail: "the host forward pass reads host memory only".into(),
                });
            };
            weightlift_kernels::kv_decode(format, &h[b0..b1], dst).map_err(kernel)
        };
        let mut go = |kb: &Buffer, vb: &Buffer| -> Result<()> {
            for &(t0, count, [ks, vs]) in &spans {
                let values = t0 * row..(t0 + count) * row;
                let (kd, vd) = (&mut k[values.clone()], &mut v[values]);
                if kd.len() >= PARALLEL_DECODE_VALUES {
                    let (a, b) = rayon::join(|| decode(kd, hk, kb, ks), || decode(vd, hv, vb, vs));
                    a.and(b)?;
                } else {
                    decode(kd, hk, kb, ks)?;
                    decode(vd, hv, vb, vs)?;
                }
            }
            Ok(())
        };
        match resident {
            Some(r) => go(&r.k, &r.v),
            None => {
                let layers = self.lock();
                let store = held(&layers, layer)?;
                go(&store.k, &store.v)
            }
        }
    }

    /// `f` of the f16 bits of positions `start..start + n` of `layer`, keys then values
    /// (token-major, as [`Cache::decode_rows`] lays them out), read in place while the cache's
    /// lock is held; `None`, without calling `f`, where they are not one run of f16 rows in
    /// host memory: another dtype, an offloaded cache, a ring that wraps between them.
    pub fn with_f16_rows<R>(
        &self,
        layer: usize,
        start: u64,
        n: usize,
        f: impl FnOnce(&[u16], &[u16]) -> Result<R>,
    ) -> Result<Option<R>> {
        if self.config.dtype != CacheDType::Fp16 || self.config.offload {
            return Ok(None);
        }
        self.check_span(layer, start, n as u64)?;
        let row = self.config.row(layer) as usize;
        let spans = byte_runs(
            self.config.rows(layer),
            start,
            n as u64,
            row,
            [KvFormat::F16; 2],
        );
        let [(_, count, [ks, vs])] = spans[..] else {
            return Ok(None);
        };
        let layers = self.lock();
        let store = held(&layers, layer)?;
        fn words(buf: &Buffer, (b0, b1): (usize, usize)) -> Option<&[u16]> {
            buf.host()
                .and_then(|h| bytemuck::try_cast_slice::<u8, u16>(&h[b0..b1]).ok())
        }
        match (count == n, words(&store.k, ks), words(&store.v, vs)) {
            (true, Some(k), Some(v)) if cfg!(target_endian = "little") => f(k, v).map(Some),
            _ => Ok(None),
        }
    }

    /// Whether the cache is offloaded to host RAM (layers are lent by [`Cache::fetch`]).
    pub fn is_offloaded(&self) -> bool {
        self.config.offload
    }

    /// Read positions `start..end` back as f32 `(batch, n_kv_heads, end - start, head_dim)`.
    /// A sliding-window layer's ring holds its last rows only: positions before
    /// [`Cache::held_from`] are refused, naming the window.
    pub fn read(&self, layer: usize, start: u64, end: u64) -> Result<(Vec<f32>, Vec<f32>)> {
        let n_tokens = read_len(start, end)?;
        self.check_span(layer, start, n_tokens)?;
        let from = self.held_from(layer);
        if n_tokens > 0 && start < from {
            return Err(self.outside(
                format!("reading cache positions {start}..{end}"),
                layer,
                start,
                format!("read from position {from} on"),
            ));
        }
        if let Some(kv) = self.read_tp(layer, start, end)? {
            return Ok(kv);
        }
        self.join_prefetch();
        let layers = self.lock();
        let store = held(&layers, layer)?;
        decode_span(&self.config, layer, start, n_tokens, &store.k, &store.v)
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.join_prefetch();
    }
}

/// Decode positions `start..start + n_tokens` of both halves; each batch's run of rows (two
/// where the positions wrap past a ring's end) is read as one contiguous byte range (a view of
/// host memory, or copied back from CUDA memory).
fn decode_span(
    c: &CacheConfig,
    layer: usize,
    start: u64,
    n_tokens: u64,
    kb: &Buffer,
    vb: &Buffer,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let heads = c.n_kv_heads[layer] as usize;
    let hd = c.head_dim as usize;
    let n = n_tokens as usize;
    let row_len = heads * hd;
    let rows = c.rows(layer);
    let (hk, hv) = formats(c.dtype);
    let total = c.batch_size as usize * heads * n * hd;
    let mut k = vec![0f32; total];
    let mut v = vec![0f32; total];
    let mut row = vec![0f32; row_len];
    let mut tmp: Vec<u8> = Vec::new();
    for b in 0..c.batch_size as usize {
        for (r0, t0, count) in row_runs(rows, start, n_tokens) {
            let first = (b * rows as usize + r0) * row_len;
            for (format, src, dst) in [(hk, kb, &mut k), (hv, vb, &mut v)] {
                let (b0, b1) = (
                    format.byte_at(first),
                    format.byte_at(first + count * row_len),
                );
                let span: &[u8] = match src.host() {
                    Some(h) => &h[b0..b1],
                    None => {
                        tmp.clear();
                        tmp.resize(b1 - b0, 0);
                        src.read(b0, &mut tmp)?;
                        &tmp
                    }
                };
                for t in 0..count {
                    decode_row(format, t * row_len, span, &mut row)?;
                    for h in 0..heads {
                        let to = ((b * heads + h) * n + t0 + t) * hd;
                        dst[to..to + hd].copy_from_slice(&row[h * hd..(h + 1) * hd]);
                    }
                }
            }
        }
    }
    Ok((k, v))
}

/// The runs of rows that hold positions `pos..pos + n` of one sequence of a layer of `rows`
/// rows (position `p` in row `p % rows`), as `(first row, first of the n tokens, tokens)`: one
/// run, or two where the positions wrap past a ring's last row. `n` is at most `rows`
/// ([`Cache::check_span`]).
fn row_runs(rows: u64, pos: u64, n: u64) -> impl Iterator<Item = (usize, usize, usize)> {
    let r0 = pos % rows.max(1);
    let first = n.min(rows - r0);
    [(r0, 0, first), (0, first, n - first)]
        .into_iter()
        .filter(|r| r.2 > 0)
        .map(|(r, t, c)| (r as usize, t as usize, c as usize))
}

/// One run of [`byte_runs`]: its first token, its tokens, and its byte ranges in K and in V.
type ByteRun = (usize, usize, [(usize, usize); 2]);

/// [`row_runs`] of sequence 0 as byte ranges, rows of `row` values stored as `formats`.
fn byte_runs(rows: u64, pos: u64, n: u64, row: usize, formats: [KvFormat; 2]) -> Vec<ByteRun> {
    row_runs(rows, pos, n)
        .map(|(r0, t0, count)| {
            let (a, b) = (r0 * row, (r0 + count) * row);
            (t0, count, formats.map(|f| (f.byte_at(a), f.byte_at(b))))
        })
        .collect()
}

/// The first position a query at position `p` sees through a sliding `window` (0: every
/// position, from 0).
fn first_seen(window: u64, p: u64) -> u64 {
    match window {
        0 => 0,
        w => (p + 1).saturating_sub(w),
    }
}

/// `layer`'s store, or the error for a layer not allocated yet.
fn held(layers: &[Option<LayerStore>], layer: usize) -> Result<&LayerStore> {
    layers
        .get(layer)
        .and_then(Option::as_ref)
        .ok_or_else(|| EngineError::NotLoaded {
            what: format!("cache layer {layer}"),
        })
}

/// As [`held`], to write.
fn held_mut(layers: &mut [Option<LayerStore>], layer: usize) -> Result<&mut LayerStore> {
    layers
        .get_mut(layer)
        .and_then(Option::as_mut)
        .ok_or_else(|| EngineError::NotLoaded {
            what: format!("cache layer {layer}"),
        })
}

/// The tokens of a read of positions `start..end`.
fn read_len(start: u64, end: u64) -> Result<u64> {
    end.checked_sub(start).ok_or_else(|| {
        invalid(
            "cache read range",
            "start <= end",
            format!("{start}..{end}"),
        )
    })
}

/// Encode `row` at value index `slot` of `buf` (a multiple of the group size for quantised
/// formats).
fn encode_row(format: KvFormat, slot: usize, row: &[f32], buf: &mut [u8]) -> Result<()> {
    let span = &mut buf[format.byte_at(slot)..format.byte_at(slot + row.len())];
    weightlift_kernels::kv_encode(format, row, span).map_err(kernel)
}

/// Decode the values at `slot..slot + row.len()` of `buf` into `row`.
/// Key values from which [`Cache::decode_rows`] decodes keys and values on two threads (below
/// it the second thread costs more than it saves).
const PARALLEL_DECODE_VALUES: usize = 16 * 1024;

fn decode_row(format: KvFormat, slot: usize, buf: &[u8], row: &mut [f32]) -> Result<()> {
    let span = &buf[format.byte_at(slot)..format.byte_at(slot + row.len())];
    weightlift_kernels::kv_decode(format, span, row).map_err(kernel)
}

fn kernel(e: weightlift_kernels::KernelError) -> EngineError {
    EngineError::Device {
        device: "cpu".into(),
        detail: format!("kv cache kernel: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_shapes_are_batch_heads_tokens_head_dim() {
        let cfg = CacheConfig {
            max_seq_len: 64,
            batch_size: 2,
            dtype: CacheDType::Fp16,
            n_kv_heads: vec![3, 1],
            head_dim: 8,
            offload: false,
            ring: None,
        };
        assert_eq!(cfg.kv_shape(0, 5), [2, 3, 5, 8]);
        assert_eq!(cfg.kv_shape(1, 0), [2, 1, 0, 8]);
        assert_eq!(cfg.kv_shape(2, 5), [2, 0, 5, 8]);
        assert_eq!(
            cfg.positions_of(0, &[2, 3, 5, 8], &[2, 3, 5, 8]).unwrap(),
            5
        );
        for (k, v) in [([2, 3, 5, 8], [2, 3, 4, 8]), ([1, 3, 5, 8], [1, 3, 5, 8])] {
            let e = cfg.positions_of(0, &k, &v).unwrap_err().to_string();
            assert!(
                e.starts_with("k and v: expected float32 arrays both (2, 3, n_tokens, 8), got"),
                "{e}"
            );
        }
    }

    #[test]
    fn sizes_match_the_design_table() {
        let n = 4096u64;
        assert_eq!(CacheDType::Fp16.kv_bytes(n), (8192, 8192));
        assert_eq!(CacheDType::Fp8.kv_bytes(n), (4096, 4096));
        assert_eq!(CacheDType::Q8.kv_bytes(n), (n * 85 / 80, n * 85 / 80));
        assert_eq!(CacheDType::Q6.kv_bytes(n), (n * 85 / 80, n * 45 / 80));
        assert_eq!(CacheDType::Q4.kv_bytes(n), (n * 45 / 80, n * 45 / 80));
    }
}
