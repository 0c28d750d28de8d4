//! The offloaded cache: every layer's K and V live in host RAM, and each layer device keeps
//! [`SLOTS`] slots for the layer in use and the next one, prefetched on the cache's own thread
//! (see the parent module's notes on memory).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::{Cache, LayerStore, SLOTS, byte_runs, decode_span, formats, held, held_mut, read_len};
use crate::device::{Buffer, Device, pace_link};
use crate::error::{EngineError, Result};
use crate::forward::Copies;

/// A device-resident copy of one layer for the caller to compute with. For an offloaded cache it
/// is one of its device's slots, lent until dropped; otherwise a fresh copy.
#[derive(Debug)]
pub struct Resident {
    pub layer: usize,
    pub k: Buffer,
    pub v: Buffer,
    /// The lending cache and its allocation generation (offload only).
    home: Option<(Weak<Cache>, u64)>,
    /// The layer's write version when the copy was made.
    version: u64,
}

impl Drop for Resident {
    fn drop(&mut self) {
        let Some((home, generation)) = self.home.take() else {
            return;
        };
        let Some(cache) = home.upgrade() else { return };
        // Hand the slot's buffers back to the pool (empty placeholders take their place).
        let k = std::mem::replace(&mut self.k, Buffer::empty());
        let v = std::mem::replace(&mut self.v, Buffer::empty());
        cache.give_back(
            generation,
            Slot {
                k,
                v,
                holds: Some((self.layer, self.version)),
            },
        );
    }
}

/// Offload: one slot of a layer device, and the layer (with its write version) it holds.
#[derive(Debug)]
pub(super) struct Slot {
    pub(super) k: Buffer,
    pub(super) v: Buffer,
    pub(super) holds: Option<(usize, u64)>,
}

/// Offload: the slots of one layer device.
#[derive(Debug)]
pub(super) struct Pool {
    pub(super) device: Arc<Device>,
    /// Slots in the pool now (the rest are lent to [`Resident`]s).
    pub(super) free: Vec<Slot>,
    /// Slots this pool owns, lent or not.
    pub(super) owned: usize,
    /// Bytes of each slot's K and V.
    pub(super) k_bytes: u64,
    pub(super) v_bytes: u64,
    /// The layers that compute on this device.
    pub(super) layers: Vec<usize>,
}

impl Cache {
    /// Offload: count `layer` on `device`'s pool and make its slots at least `kb` + `vb` bytes,
    /// [`SLOTS`] of them (one while the device computes a single layer).
    pub(super) fn ensure_pool(
        &self,
        layer: usize,
        device: &Arc<Device>,
        kb: u64,
        vb: u64,
    ) -> Result<()> {
        let mut pools = self.lock_pools();
        for p in pools.iter_mut() {
            p.layers.retain(|&l| l != layer);
        }
        let i = match pools.iter().position(|p| Arc::ptr_eq(&p.device, device)) {
            Some(i) => i,
            None => {
                pools.push(Pool {
                    device: Arc::clone(device),
                    free: Vec::new(),
                    owned: 0,
                    k_bytes: 0,
                    v_bytes: 0,
                    layers: Vec::new(),
                });
                pools.len() - 1
            }
        };
        let p = &mut pools[i];
        p.layers.push(layer);
        let want = p.layers.len().min(SLOTS);
        if kb > p.k_bytes || vb > p.v_bytes {
            // Larger slots: drop the free ones; lent ones are dropped when handed back.
            p.owned -= p.free.len();
            p.free.clear();
            p.k_bytes = p.k_bytes.max(kb);
            p.v_bytes = p.v_bytes.max(vb);
        }
        while p.owned < want {
            let k = device.alloc(p.k_bytes)?;
            let v = device.alloc(p.v_bytes)?;
            p.free.push(Slot { k, v, holds: None });
            p.owned += 1;
        }
        Ok(())
    }

    /// A lent slot comes back (from [`Resident`]'s drop).
    fn give_back(&self, generation: u64, slot: Slot) {
        if generation != self.generation.load(Ordering::Acquire) {
            return;
        }
        let mut pools = self.lock_pools();
        if let Some(p) = pools
            .iter_mut()
            .find(|p| Arc::ptr_eq(&p.device, slot.k.device()))
        {
            if slot.k.len() as u64 == p.k_bytes && slot.v.len() as u64 == p.v_bytes {
                p.free.push(slot);
            } else {
                // The pool grew while this slot was lent: it is replaced on the next allocate.
                p.owned = p.owned.saturating_sub(1);
            }
        }
    }

    /// Offload: a free slot that held `layer` as it was before a write (version `was`) gets the
    /// written bytes (`spans` of K and V: one pair per run of rows, two where the positions
    /// wrap past a ring's end) too and stays current. Each forward pass writes a layer's new
    /// rows just before it fetches the layer, so without this the prefetched copy would always
    /// be stale and the whole layer copied again.
    pub(super) fn refresh_slots(
        &self,
        layer: usize,
        store: &LayerStore,
        was: u64,
        spans: &[[(usize, usize); 2]],
    ) -> Result<()> {
        let mut pools = self.lock_pools();
        let Some(p) = pools
            .iter_mut()
            .find(|p| Arc::ptr_eq(&p.device, &store.device))
        else {
            return Ok(());
        };
        let now = self.version(layer);
        for slot in p.free.iter_mut().filter(|s| s.holds == Some((layer, was))) {
            slot.holds = None;
            for [ks, vs] in spans {
                for (src, dst, (b0, b1)) in
                    [(&store.k, &mut slot.k, *ks), (&store.v, &mut slot.v, *vs)]
                {
                    let host = src.host().ok_or_else(|| not_in_host_ram(&store.device))?;
                    // a few rows: not paced (a sleep that short costs more than the copy would)
                    let since = std::time::Instant::now();
                    dst.write(b0, &host[b0..b1])?;
                    self.tally((b1 - b0) as u64, since);
                }
            }
            slot.holds = Some((layer, now));
        }
        Ok(())
    }

    /// Offload: as [`Cache::with_layer`] for an offloaded cache. `layer` is fetched to its
    /// device (from the prefetched slot when it holds it), lent to `f`, which writes rows
    /// `pos..pos + n` of sequence 0 there and reads the layer in place, and those rows are then
    /// copied back to the layer's home in host RAM, so the slot stays a current copy.
    pub(crate) fn with_fetched<R>(
        self: &Arc<Self>,
        layer: usize,
        pos: u64,
        n: u64,
        f: impl FnOnce(&mut Buffer, &mut Buffer) -> Result<R>,
    ) -> Result<R> {
        self.check_span(layer, pos, n)?;
        let mut r = self.fetch(layer)?;
        let out = f(&mut r.k, &mut r.v)?;
        self.written.fetch_max(pos + n, Ordering::AcqRel);
        let was = self.version(layer);
        if let Some(ver) = self.versions.get(layer) {
            ver.fetch_add(1, Ordering::AcqRel);
        }
        let row = self.config.n_kv_heads[layer] as usize * self.config.head_dim as usize;
        let (hk, hv) = formats(self.config.dtype);
        let spans: Vec<[(usize, usize); 2]> =
            byte_runs(self.config.rows(layer), pos, n, row, [hk, hv])
                .into_iter()
                .map(|s| s.2)
                .collect();
        let mut layers = self.lock();
        let store = held_mut(&mut layers, layer)?;
        for [ks, vs] in &spans {
            for (src, dst, (b0, b1)) in [(&r.k, &mut store.k, *ks), (&r.v, &mut store.v, *vs)] {
                let home = dst
                    .host_mut()
                    .ok_or_else(|| not_in_host_ram(&store.device))?;
                // the new rows only: not paced, as in `refresh_slots`
                let since = std::time::Instant::now();
                src.read(b0, &mut home[b0..b1])?;
                self.tally((b1 - b0) as u64, since);
            }
        }
        r.version = self.version(layer);
        self.refresh_slots(layer, store, was, &spans)?;
        Ok(out)
    }

    /// A device-resident copy of `layer` for the caller to compute with. Offloaded: one of its
    /// device's slots, lent until the [`Resident`] is dropped (no copy when the second thread
    /// already prefetched the layer into it; otherwise filled from host RAM now), and the
    /// prefetch of the next layer into a free slot of its device started on a second thread.
    /// With both slots of the device lent, a fresh copy is allocated on it. For a cache that is
    /// not offloaded this is a plain copy on the layer's device.
    pub fn fetch(self: &Arc<Self>, layer: usize) -> Result<Resident> {
        self.check_layer(layer)?;
        self.prefetch.wait()?;
        let resident = match self.lend(layer)? {
            Some(r) => r,
            None => self.copy(layer)?,
        };
        let next = layer + 1;
        if self.config.offload && next < self.n_layers() {
            self.prefetch.start(self, next)?;
        }
        let (mut r, generation) = resident;
        r.home = generation.map(|g| (Arc::downgrade(self), g));
        Ok(r)
    }

    /// Whether a prefetch is in flight or finished and not yet taken.
    pub fn prefetch_pending(&self) -> bool {
        self.prefetch.pending()
    }

    /// The current (not since written) layers held by the free slots of `device` (offload).
    pub fn prefetched(&self, device: &str) -> Vec<usize> {
        self.join_prefetch();
        let pools = self.lock_pools();
        let mut out: Vec<usize> = pools
            .iter()
            .filter(|p| p.device.name() == device)
            .flat_map(|p| p.free.iter())
            .filter_map(|s| s.holds)
            .filter(|&(l, v)| v == self.version(l))
            .map(|(l, _)| l)
            .collect();
        out.sort_unstable();
        out
    }

    /// Offload: take a slot of `layer`'s device out of its pool, holding `layer`.
    fn lend(&self, layer: usize) -> Result<Option<(Resident, Option<u64>)>> {
        if !self.config.offload {
            return Ok(None);
        }
        let layers = self.lock();
        let s = held(&layers, layer)?;
        let mut pools = self.lock_pools();
        let Some(p) = pools.iter_mut().find(|p| Arc::ptr_eq(&p.device, &s.device)) else {
            return Ok(None);
        };
        let current = Some((layer, self.version(layer)));
        let at = p
            .free
            .iter()
            .position(|x| x.holds == current)
            .or_else(|| p.free.iter().position(|x| x.holds.is_none()))
            .or_else(|| p.free.iter().position(|_| true));
        let Some(at) = at else { return Ok(None) };
        let mut slot = p.free.swap_remove(at);
        if slot.holds != current {
            slot.holds = None;
            self.fill(layer, s, &mut slot)?;
        }
        let generation = self.generation.load(Ordering::Acquire);
        Ok(Some((
            Resident {
                layer,
                k: slot.k,
                v: slot.v,
                home: None,
                version: self.version(layer),
            },
            Some(generation),
        )))
    }

    /// A fresh copy of `layer` on its compute device.
    fn copy(&self, layer: usize) -> Result<(Resident, Option<u64>)> {
        let layers = self.lock();
        let s = held(&layers, layer)?;
        let mut k = s.device.alloc(s.k.len() as u64)?;
        let mut v = s.device.alloc(s.v.len() as u64)?;
        s.k.copy_into(&mut k)?;
        s.v.copy_into(&mut v)?;
        Ok((
            Resident {
                layer,
                k,
                v,
                home: None,
                version: self.version(layer),
            },
            None,
        ))
    }

    /// Copy `layer` from host RAM into a free slot of its device (one not holding a current
    /// layer if possible).
    pub(super) fn prefetch_into_slot(&self, layer: usize) -> Result<()> {
        let layers = self.lock();
        let s = held(&layers, layer)?;
        let mut pools = self.lock_pools();
        let Some(p) = pools.iter_mut().find(|p| Arc::ptr_eq(&p.device, &s.device)) else {
            return Ok(());
        };
        let current = Some((layer, self.version(layer)));
        if p.free.iter().any(|x| x.holds == current) {
            return Ok(());
        }
        let stale = |x: &Slot| x.holds.is_none_or(|(l, v)| v != self.version(l));
        let at = p
            .free
            .iter()
            .position(stale)
            .or((!p.free.is_empty()).then_some(0));
        let Some(slot) = at.and_then(|i| p.free.get_mut(i)) else {
            return Ok(());
        };
        slot.holds = None;
        self.fill(layer, s, slot)?;
        slot.holds = current;
        Ok(())
    }

    /// Copy `layer`'s K and V from host RAM into `slot`: for each sequence only the rows
    /// written so far (a decode step at position p of a long context copies p rows, not
    /// `max_seq_len`; a ring that positions wrapped around, all its rows); the rest of the slot
    /// is never read.
    fn fill(&self, layer: usize, s: &LayerStore, slot: &mut Slot) -> Result<()> {
        let c = &self.config;
        let rows = c.rows(layer) as usize;
        let used = self
            .written
            .load(Ordering::Acquire)
            .max(self.seq_len())
            .min(rows as u64) as usize;
        let row = c.n_kv_heads[layer] as usize * c.head_dim as usize;
        let (fk, fv) = formats(c.dtype);
        let since = std::time::Instant::now();
        let mut bytes = 0u64;
        for (format, src, dst) in [(fk, &s.k, &mut slot.k), (fv, &s.v, &mut slot.v)] {
            let host = src.host().ok_or_else(|| not_in_host_ram(&s.device))?;
            for b in 0..c.batch_size as usize {
                let first = b * rows * row;
                let (b0, b1) = (format.byte_at(first), format.byte_at(first + used * row));
                dst.write(b0, &host[b0..b1])?;
                bytes += (b1 - b0) as u64;
            }
        }
        // a virtual device's link rate: the copy costs what it would over PCIe
        pace_link(s.k.device(), slot.k.device(), bytes, since);
        self.tally(bytes, since);
        Ok(())
    }

    fn tally(&self, bytes: u64, since: std::time::Instant) {
        let nanos = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        for (a, v) in self.copied.iter().zip([1, bytes, nanos]) {
            a.fetch_add(v, Ordering::Relaxed);
        }
    }

    /// Offload: the copies between host RAM and the device slots so far: slot fills, new rows
    /// added to a slot, rows written back to host RAM. The forward pass reports its share in
    /// its copies.
    pub fn offload_copies(&self) -> Copies {
        let [count, bytes, nanos] = self.copied.each_ref().map(|a| a.load(Ordering::Relaxed));
        Copies {
            count,
            bytes,
            nanos,
        }
    }

    pub(super) fn join_prefetch(&self) {
        // a failed prefetch leaves its slot unfilled; the fetch that needs it copies instead
        let _ = self.prefetch.wait();
    }

    /// Decode positions of a resident copy (see [`Cache::fetch`]).
    pub fn read_resident(
        &self,
        r: &Resident,
        start: u64,
        end: u64,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n_tokens = read_len(start, end)?;
        self.check_span(r.layer, start, n_tokens)?;
        decode_span(&self.config, r.layer, start, n_tokens, &r.k, &r.v)
    }
}

/// An offloaded layer whose home is not host memory (the cache allocates it there, so this is
/// a bug, reported rather than a panic).
fn not_in_host_ram(device: &Device) -> EngineError {
    EngineError::Device {
        device: device.name().into(),
        detail: "an offloaded cache layer is not in host memory".into(),
    }
}
