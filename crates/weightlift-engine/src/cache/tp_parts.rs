//! A cache split by kv heads for tensor parallelism, as exllamav2's TP cache: each device holds
//! every layer's K and V for its own kv heads, a cache of its own with `heads` per layer, in
//! that device's memory. The parent cache keeps the sequence (its `seq_len` and ids); the
//! forward pass writes and reads each device's rows in its part.

use std::sync::{Arc, MutexGuard};

use super::{Cache, CacheConfig};
use crate::device::Device;
use crate::error::{EngineError, Result, invalid};

/// One device's share of a split cache.
#[derive(Debug, Clone)]
pub struct TpPart {
    pub device: Arc<Device>,
    /// KV heads `start..end` of every layer.
    pub heads: (u32, u32),
    pub cache: Arc<Cache>,
}

impl Cache {
    pub(super) fn lock_tp(&self) -> MutexGuard<'_, Vec<TpPart>> {
        self.tp
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Split the cache by kv heads: `parts` are `(device, first head, end head)`, covering
    /// `0..n_kv_heads` in order; each part's layers are allocated on its device now. Every
    /// layer must have the same kv heads, and the cache must not be offloaded.
    pub fn allocate_tp(&self, parts: &[(Arc<Device>, u32, u32)]) -> Result<()> {
        let heads = self.tp_heads()?;
        let mut at = 0;
        for (d, a, b) in parts {
            if *a != at || b <= a {
                return Err(invalid(
                    format!("tp cache part on {}", d.name()),
                    format!("kv heads from {at}, at least one"),
                    format!("{a}..{b}"),
                ));
            }
            at = *b;
        }
        if at != heads {
            return Err(invalid(
                "tp cache parts",
                format!("kv heads 0..{heads}"),
                format!("0..{at}"),
            ));
        }
        self.fill_tp(parts, false)
    }

    /// The share of one rank of a multi-process run: kv heads `a..b` of every layer on
    /// `device`, or nothing where the rank holds no heads. The other ranks' heads live in
    /// their processes.
    pub fn allocate_tp_rank(&self, share: Option<(Arc<Device>, u32, u32)>) -> Result<()> {
        let heads = self.tp_heads()?;
        if let Some((d, a, b)) = &share
            && (b <= a || *b > heads)
        {
            return Err(invalid(
                format!("tp cache share on {}", d.name()),
                format!("at least one of kv heads 0..{heads}"),
                format!("{a}..{b}"),
            ));
        }
        self.fill_tp(share.as_slice(), true)
    }

    /// The kv heads every layer has, where the cache can be split.
    fn tp_heads(&self) -> Result<u32> {
        let c = &self.config;
        if c.offload {
            return Err(EngineError::Unsupported {
                what: "an offloaded cache under tensor parallelism".into(),
                detail: "each device holds its kv heads' slice of every layer; load the cache \
                         without offload"
                    .into(),
            });
        }
        let heads = c.n_kv_heads.first().copied().unwrap_or(0);
        if c.n_kv_heads.iter().any(|&h| h != heads) {
            return Err(EngineError::Unsupported {
                what: "a tensor-parallel cache with per-layer kv head counts".into(),
                detail: "the kv table splits one head count for every layer".into(),
            });
        }
        Ok(heads)
    }

    fn fill_tp(&self, parts: &[(Arc<Device>, u32, u32)], rank_share: bool) -> Result<()> {
        let c = &self.config;
        self.free();
        let mut made = Vec::with_capacity(parts.len());
        for (device, a, b) in parts {
            let cfg = CacheConfig {
                n_kv_heads: vec![b - a; c.n_kv_heads.len()],
                ..c.clone()
            };
            let part = Arc::new(Cache::new(cfg)?);
            for l in 0..part.n_layers() {
                part.allocate_layer(l, device, device)?;
            }
            made.push(TpPart {
                device: Arc::clone(device),
                heads: (*a, *b),
                cache: part,
            });
        }
        *self.lock_tp() = made;
        self.tp_rank
            .store(rank_share, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The parts of a split cache, in head order (empty when it is not split).
    pub fn tp_parts(&self) -> Vec<TpPart> {
        self.lock_tp().clone()
    }

    /// The devices of a split cache, joined by commas.
    pub(super) fn tp_devices(&self) -> Option<String> {
        let tp = self.lock_tp();
        (!tp.is_empty()).then(|| {
            tp.iter()
                .map(|p| p.device.name())
                .collect::<Vec<_>>()
                .join(",")
        })
    }

    /// What a split cache holds per device: each part's layers.
    pub(super) fn expected_memory_tp(&self) -> Option<Vec<(String, u64)>> {
        let tp = self.lock_tp();
        (!tp.is_empty()).then(|| {
            tp.iter()
                .map(|p| {
                    let c = p.cache.config();
                    let b = (0..p.cache.n_layers()).map(|l| c.layer_bytes(l)).sum();
                    (p.device.name().to_owned(), b)
                })
                .collect()
        })
    }

    /// [`Cache::read`] of a split cache: each part's heads, put back in head order.
    pub(super) fn read_tp(
        &self,
        layer: usize,
        start: u64,
        end: u64,
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        let parts = self.tp_parts();
        if parts.is_empty() {
            return Ok(None);
        }
        let c = &self.config;
        let (heads, hd) = (c.n_kv_heads[layer] as usize, c.head_dim as usize);
        let n = (end - start) as usize;
        let total = c.batch_size as usize * heads * n * hd;
        let (mut k, mut v) = (vec![0f32; total], vec![0f32; total]);
        for p in &parts {
            let (pk, pv) = p.cache.read(layer, start, end)?;
            let (a, b) = (p.heads.0 as usize, p.heads.1 as usize);
            let per = (b - a) * n * hd;
            for batch in 0..c.batch_size as usize {
                let to = (batch * heads + a) * n * hd;
                k[to..to + per].copy_from_slice(&pk[batch * per..(batch + 1) * per]);
                v[to..to + per].copy_from_slice(&pv[batch * per..(batch + 1) * per]);
            }
        }
        Ok(Some((k, v)))
    }
}
