//! The KV cache: one K and one V region per layer, on that layer's device.
//!
//! Layout per layer: `(batch, max_seq_len, n_kv_heads, head_dim)`, so one token of one sequence
//! is a contiguous row of `n_kv_heads × head_dim` values (exllamav2's layout). Quantised caches
//! group each row in runs of 32 values with one f16 scale per group, stored after the data.
//! Bytes per element (DESIGN.md's table; the planner predicts exactly these):
//!
//! | dtype | K | V | round-trip error bound, per value `x` of group `g` |
//! |---|---|---|---|
//! | fp16 | 2 | 2 | `|x|·2⁻¹¹ + 2⁻²⁵` for `|x| ≤ 65504` |
//! | fp8 (e4m3) | 1 | 1 | `|x|·2⁻⁴ + 2⁻¹⁰` for `|x| ≤ 448` (saturates above) |
//! | q8 | 8.5/8 | 8.5/8 | `absmax(g)/254·(1+2⁻⁹) + 2⁻¹⁷` |
//! | q6 | 8.5/8 (8-bit) | 4.5/8 (4-bit) | K as q8, V as q4 (exllamav2's Q6 cache) |
//! | q4 | 4.5/8 | 4.5/8 | `absmax(g)/14·(1+2⁻⁹) + 2⁻¹⁷` |
//!
//! q8 and q4 are the kernels crate's KV quantisers (`weightlift_kernels::kv_quantize`, whose CUDA
//! twin is the same maths): symmetric absmax, the scale `d = absmax/127` (levels −127…127) or
//! `absmax/7` (levels −7…7) rounded *up* to f16, one 34- or 18-byte group per 32 values (scale
//! first). The kernels guarantee `|x − x̂| ≤ d·(1/2 + 2⁻¹⁶)`; with the upward f16 rounding of `d`
//! (relative 2⁻¹⁰, or 2⁻²⁴ absolute for subnormal scales) that gives the bounds above.
//!
//! A lazy cache is allocated layer by layer during the load, on each layer's device. An offloaded
//! cache keeps every layer in host RAM and, as exllamav2/transformers' `OffloadedCache` do, copies
//! a layer to its device when it is used while the next layer is prefetched on a second thread.

use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use half::f16;

use crate::device::{Buffer, Device};
use crate::error::{EngineError, Result, invalid};

/// Values per quantisation group.
pub const GROUP: usize = 32;

/// The element type of a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheDType {
    Fp16,
    Fp8,
    Q8,
    Q6,
    Q4,
}

/// How one of K or V is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    F16,
    E4M3,
    Q8,
    Q4,
}

impl Half {
    /// Bytes for `n` values (`n` a multiple of [`GROUP`] for the quantised kinds).
    fn bytes(self, n: u64) -> u64 {
        match self {
            Half::F16 => 2 * n,
            Half::E4M3 => n,
            Half::Q8 => n + n / GROUP as u64 * 2,
            Half::Q4 => n / 2 + n / GROUP as u64 * 2,
        }
    }

    fn quantised(self) -> bool {
        matches!(self, Half::Q8 | Half::Q4)
    }
}

impl CacheDType {
    pub fn parse(s: &str) -> Result<CacheDType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "fp16" | "f16" | "float16" => CacheDType::Fp16,
            "fp8" | "f8" | "e4m3" => CacheDType::Fp8,
            "q8" => CacheDType::Q8,
            "q6" => CacheDType::Q6,
            "q4" => CacheDType::Q4,
            _ => {
                return Err(invalid(
                    "cache dtype",
                    "fp16, fp8, q8, q6 or q4",
                    format!("'{s}'"),
                ));
            }
        })
    }

    pub const fn name(self) -> &'static str {
        match self {
            CacheDType::Fp16 => "fp16",
            CacheDType::Fp8 => "fp8",
            CacheDType::Q8 => "q8",
            CacheDType::Q6 => "q6",
            CacheDType::Q4 => "q4",
        }
    }

    fn halves(self) -> (Half, Half) {
        match self {
            CacheDType::Fp16 => (Half::F16, Half::F16),
            CacheDType::Fp8 => (Half::E4M3, Half::E4M3),
            CacheDType::Q8 => (Half::Q8, Half::Q8),
            CacheDType::Q6 => (Half::Q8, Half::Q4),
            CacheDType::Q4 => (Half::Q4, Half::Q4),
        }
    }

    /// Bytes of K and of V for `n` values each.
    pub fn kv_bytes(self, n: u64) -> (u64, u64) {
        let (k, v) = self.halves();
        (k.bytes(n), v.bytes(n))
    }

    /// The documented round-trip bound for one value `x` whose group absmax is `absmax`, in K
    /// (`is_v = false`) or V.
    pub fn error_bound(self, is_v: bool, x: f32, absmax: f32) -> f32 {
        let (k, v) = self.halves();
        match if is_v { v } else { k } {
            Half::F16 => x.abs() * 2f32.powi(-11) + 2f32.powi(-25),
            Half::E4M3 => x.abs() * 2f32.powi(-4) + 2f32.powi(-10),
            Half::Q8 => absmax / 254.0 * (1.0 + 2f32.powi(-9)) + 2f32.powi(-17),
            Half::Q4 => absmax / 14.0 * (1.0 + 2f32.powi(-9)) + 2f32.powi(-17),
        }
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
}

impl CacheConfig {
    fn row(&self, layer: usize) -> u64 {
        u64::from(self.n_kv_heads[layer]) * u64::from(self.head_dim)
    }

    /// Values of K (or of V) in one layer.
    pub fn values(&self, layer: usize) -> u64 {
        self.row(layer) * self.max_seq_len * self.batch_size
    }

    /// Bytes of K and V of one layer.
    pub fn layer_bytes(&self, layer: usize) -> u64 {
        let (k, v) = self.dtype.kv_bytes(self.values(layer));
        k + v
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

/// A device-resident copy of an offloaded layer.
#[derive(Debug)]
pub struct Resident {
    pub layer: usize,
    pub k: Buffer,
    pub v: Buffer,
}

/// A KV cache. Shared (`Arc`) between its owner and the model that allocates it lazily.
#[derive(Debug)]
pub struct Cache {
    config: CacheConfig,
    layers: Mutex<Vec<Option<LayerStore>>>,
    /// Offload: the layer prefetched by the second thread.
    prefetch: Mutex<Option<JoinHandle<Result<Resident>>>>,
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
        let (k, v) = config.dtype.halves();
        for (l, &h) in config.n_kv_heads.iter().enumerate() {
            let row = u64::from(h) * u64::from(config.head_dim);
            if (k.quantised() || v.quantised()) && row % GROUP as u64 != 0 {
                return Err(invalid(
                    format!("{} cache, layer {l}", config.dtype.name()),
                    format!("n_kv_heads × head_dim a multiple of {GROUP}"),
                    row,
                ));
            }
        }
        let n = config.n_kv_heads.len();
        Ok(Cache {
            config,
            layers: Mutex::new((0..n).map(|_| None).collect()),
            prefetch: Mutex::new(None),
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
        layers[layer] = Some(LayerStore {
            device: Arc::clone(device),
            k,
            v,
        });
        Ok(())
    }

    /// Free every layer.
    pub fn free(&self) {
        self.join_prefetch();
        self.lock().iter_mut().for_each(|l| *l = None);
    }

    pub fn is_allocated(&self) -> bool {
        self.lock().iter().all(Option::is_some)
    }

    /// The device layer `layer` computes on, once allocated.
    pub fn device_of(&self, layer: usize) -> Result<String> {
        self.check_layer(layer)?;
        self.lock()[layer]
            .as_ref()
            .map(|s| s.device.name().to_owned())
            .ok_or_else(|| EngineError::NotLoaded {
                what: format!("cache layer {layer}"),
            })
    }

    /// Bytes held per device name.
    pub fn memory(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = Vec::new();
        for s in self.lock().iter().flatten() {
            let name = s.k.device().name();
            let bytes = (s.k.len() + s.v.len()) as u64;
            match out.iter_mut().find(|(n, _)| n == name) {
                Some((_, b)) => *b += bytes,
                None => out.push((name.to_owned(), bytes)),
            }
        }
        out
    }

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
        let (hk, hv) = c.dtype.halves();
        let mut layers = self.lock();
        let store = layers[layer]
            .as_mut()
            .ok_or_else(|| EngineError::NotLoaded {
                what: format!("cache layer {layer}"),
            })?;
        let mut row = vec![0f32; heads * hd];
        for b in 0..c.batch_size as usize {
            for t in 0..n_tokens as usize {
                let slot = (b * c.max_seq_len as usize + pos as usize + t) * heads * hd;
                for (src, half, buf) in [(k, hk, &mut store.k), (v, hv, &mut store.v)] {
                    for h in 0..heads {
                        let from = ((b * heads + h) * n_tokens as usize + t) * hd;
                        row[h * hd..(h + 1) * hd].copy_from_slice(&src[from..from + hd]);
                    }
                    encode_row(half, slot, &row, buf.as_mut_slice())?;
                }
            }
        }
        Ok(())
    }

    /// Read positions `start..end` back as f32 `(batch, n_kv_heads, end - start, head_dim)`.
    pub fn read(&self, layer: usize, start: u64, end: u64) -> Result<(Vec<f32>, Vec<f32>)> {
        let n_tokens = end.checked_sub(start).ok_or_else(|| {
            invalid(
                "cache read range",
                "start <= end",
                format!("{start}..{end}"),
            )
        })?;
        self.check_span(layer, start, n_tokens)?;
        self.join_prefetch();
        let layers = self.lock();
        let store = layers[layer]
            .as_ref()
            .ok_or_else(|| EngineError::NotLoaded {
                what: format!("cache layer {layer}"),
            })?;
        decode_span(
            &self.config,
            layer,
            start,
            n_tokens,
            store.k.as_slice(),
            store.v.as_slice(),
        )
    }

    /// Offload: a device-resident copy of `layer` (taken from the prefetch thread when it already
    /// fetched it), and the prefetch of the next layer started on a second thread. For a cache
    /// that is not offloaded this is a plain copy on the layer's device.
    pub fn fetch(self: &Arc<Self>, layer: usize) -> Result<Resident> {
        self.check_layer(layer)?;
        let pending = self
            .prefetch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let mut got = None;
        if let Some(h) = pending {
            let r = h.join().map_err(|_| EngineError::Device {
                device: "cpu".into(),
                detail: "the cache prefetch thread panicked".into(),
            })?;
            if let Ok(r) = r
                && r.layer == layer
            {
                got = Some(r);
            }
        }
        let resident = match got {
            Some(r) => r,
            None => self.copy_to_device(layer)?,
        };
        let next = layer + 1;
        if next < self.n_layers() {
            let me = Arc::clone(self);
            let h = std::thread::spawn(move || me.copy_to_device(next));
            *self
                .prefetch
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(h);
        }
        Ok(resident)
    }

    /// Whether a prefetch is in flight or finished and not yet taken.
    pub fn prefetch_pending(&self) -> bool {
        self.prefetch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    fn copy_to_device(&self, layer: usize) -> Result<Resident> {
        let layers = self.lock();
        let s = layers[layer]
            .as_ref()
            .ok_or_else(|| EngineError::NotLoaded {
                what: format!("cache layer {layer}"),
            })?;
        let mut k = s.device.alloc(s.k.len() as u64)?;
        let mut v = s.device.alloc(s.v.len() as u64)?;
        k.as_mut_slice().copy_from_slice(s.k.as_slice());
        v.as_mut_slice().copy_from_slice(s.v.as_slice());
        Ok(Resident { layer, k, v })
    }

    fn join_prefetch(&self) {
        let h = self
            .prefetch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }

    /// Decode positions of a resident copy (see [`Cache::fetch`]).
    pub fn read_resident(
        &self,
        r: &Resident,
        start: u64,
        end: u64,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n_tokens = end.checked_sub(start).ok_or_else(|| {
            invalid(
                "cache read range",
                "start <= end",
                format!("{start}..{end}"),
            )
        })?;
        self.check_span(r.layer, start, n_tokens)?;
        decode_span(
            &self.config,
            r.layer,
            start,
            n_tokens,
            r.k.as_slice(),
            r.v.as_slice(),
        )
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.join_prefetch();
    }
}

fn decode_span(
    c: &CacheConfig,
    layer: usize,
    start: u64,
    n_tokens: u64,
    kb: &[u8],
    vb: &[u8],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let heads = c.n_kv_heads[layer] as usize;
    let hd = c.head_dim as usize;
    let n = n_tokens as usize;
    let (hk, hv) = c.dtype.halves();
    let total = c.batch_size as usize * heads * n * hd;
    let mut k = vec![0f32; total];
    let mut v = vec![0f32; total];
    let mut row = vec![0f32; heads * hd];
    for b in 0..c.batch_size as usize {
        for t in 0..n {
            let slot = (b * c.max_seq_len as usize + start as usize + t) * heads * hd;
            for (half, src, dst) in [(hk, kb, &mut k), (hv, vb, &mut v)] {
                decode_row(half, slot, src, &mut row)?;
                for h in 0..heads {
                    let to = ((b * heads + h) * n + t) * hd;
                    dst[to..to + hd].copy_from_slice(&row[h * hd..(h + 1) * hd]);
                }
            }
        }
    }
    Ok((k, v))
}

fn kv_type(half: Half) -> weightlift_kernels::KvType {
    if half == Half::Q8 {
        weightlift_kernels::KvType::Q8
    } else {
        weightlift_kernels::KvType::Q4
    }
}

/// Encode `row` at value index `slot` (a multiple of the group size for quantised kinds).
fn encode_row(half: Half, slot: usize, row: &[f32], buf: &mut [u8]) -> Result<()> {
    match half {
        Half::F16 => {
            let mut words = vec![0u16; row.len()];
            if weightlift_kernels::f32_to_f16_slice(row, &mut words).is_err() {
                words
                    .iter_mut()
                    .zip(row)
                    .for_each(|(w, x)| *w = f16::from_f32(*x).to_bits());
            }
            buf[slot * 2..(slot + row.len()) * 2].copy_from_slice(bytemuck::cast_slice(&words));
        }
        Half::E4M3 => {
            for (i, &x) in row.iter().enumerate() {
                buf[slot + i] = e4m3::encode(x);
            }
        }
        Half::Q8 | Half::Q4 => {
            let kt = kv_type(half);
            let at = slot / GROUP * kt.group_bytes();
            let dst = &mut buf[at..at + kt.bytes_for(row.len())];
            weightlift_kernels::kv_quantize(kt, row, dst).map_err(kernel)?;
        }
    }
    Ok(())
}

fn kernel(e: weightlift_kernels::KernelError) -> EngineError {
    EngineError::Device {
        device: "cpu".into(),
        detail: format!("kv cache kernel: {e}"),
    }
}

fn decode_row(half: Half, slot: usize, buf: &[u8], row: &mut [f32]) -> Result<()> {
    match half {
        Half::F16 => {
            for (i, x) in row.iter_mut().enumerate() {
                let o = (slot + i) * 2;
                *x = f16::from_bits(u16::from_le_bytes([buf[o], buf[o + 1]])).to_f32();
            }
        }
        Half::E4M3 => {
            for (i, x) in row.iter_mut().enumerate() {
                *x = e4m3::decode(buf[slot + i]);
            }
        }
        Half::Q8 | Half::Q4 => {
            let kt = kv_type(half);
            let at = slot / GROUP * kt.group_bytes();
            weightlift_kernels::kv_dequantize(kt, &buf[at..at + kt.bytes_for(row.len())], row)
                .map_err(kernel)?;
        }
    }
    Ok(())
}

/// OCP FP8 E4M3 (bias 7, no infinities, 0x7F/0xFF NaN, max 448), as CUDA's `__nv_fp8_e4m3`.
pub mod e4m3 {
    /// Decode one byte.
    pub fn decode(b: u8) -> f32 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((b >> 3) & 0x0F);
        let m = f32::from(b & 0x07);
        if e == 0x0F && b & 0x07 == 0x07 {
            return f32::NAN;
        }
        let mag = if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        };
        sign * mag
    }

    /// Encode with round-to-nearest-even, saturating at ±448 (CUDA's `__NV_SATFINITE`).
    pub fn encode(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        // Codes 0x00..=0x7E are the finite non-negative values, in increasing order.
        let (mut lo, mut hi) = (0u8, 0x7Eu8);
        if a >= decode(hi) {
            return sign | hi;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if decode(mid) <= a { lo = mid } else { hi = mid }
        }
        let (dl, dh) = (a - decode(lo), decode(hi) - a);
        let code = if dl < dh || (dl == dh && lo % 2 == 0) {
            lo
        } else {
            hi
        };
        sign | code
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3::decode(0x7E), 448.0);
        assert_eq!(e4m3::decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3::decode(0x38), 1.0);
        assert_eq!(e4m3::encode(1.0), 0x38);
        assert_eq!(e4m3::encode(1e6), 0x7E);
        assert_eq!(e4m3::encode(-1.0), 0xB8);
        // 1.0625 lies halfway between 1.0 (0x38, even) and 1.125 (0x39).
        assert_eq!(e4m3::encode(1.0625), 0x38);
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
