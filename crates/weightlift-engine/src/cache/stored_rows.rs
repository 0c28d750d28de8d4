//! A layer's rows as the cache stores them, read out and written back as bytes: what a saved
//! state and a copied prefix carry, so a quantised cache's groups come back bit for bit.
//!
//! The bytes of positions `start..end` are token-major whole rows (every kv head, in head
//! order) of sequence 0, whatever the cache's split: a row of a quantised format is whole
//! groups, and so is each part of a cache split by heads ([`Cache::new`] refuses a part whose
//! row is not), so a part's heads are one byte range of every row. A state saved from a split
//! cache therefore loads into one that is not, and the other way round.

use std::sync::atomic::Ordering;

use weightlift_kernels::KvFormat;

use super::{Cache, CacheDType, byte_runs, formats, held, held_mut, kernel};
use crate::error::{EngineError, Result, invalid};

/// K then V.
pub(super) type RowBytes = [Vec<u8>; 2];

impl Cache {
    /// Sequence 0's stored K and V bytes at positions `start..end` of `layer`.
    pub(super) fn stored_rows(&self, layer: usize, start: u64, end: u64) -> Result<RowBytes> {
        let n = end.saturating_sub(start);
        self.check_span(layer, start, n)?;
        self.check_whole_split("reading cache rows as stored")?;
        let row = self.config.row(layer) as usize;
        let halves = self.halves();
        let mut out = halves.map(|f| vec![0u8; f.byte_at(n as usize * row)]);
        let parts = self.tp_parts();
        if !parts.is_empty() {
            for p in &parts {
                let got = p.cache.stored_rows(layer, start, end)?;
                for ((out, got), f) in out.iter_mut().zip(&got).zip(halves) {
                    let (at, width) = self.part_span(layer, p.heads, f);
                    for (dst, src) in out.chunks_exact_mut(f.byte_at(row)).zip(got.chunks(width)) {
                        dst[at..at + width].copy_from_slice(src);
                    }
                }
            }
            return Ok(out);
        }
        self.join_prefetch();
        let layers = self.lock();
        let store = held(&layers, layer)?;
        for (t0, count, spans) in byte_runs(self.config.rows(layer), start, n, row, halves) {
            for (((out, f), buf), (b0, _)) in out
                .iter_mut()
                .zip(halves)
                .zip([&store.k, &store.v])
                .zip(spans)
            {
                buf.read(
                    b0,
                    &mut out[f.byte_at(t0 * row)..f.byte_at((t0 + count) * row)],
                )?;
            }
        }
        Ok(out)
    }

    /// Write `bytes` ([`Cache::stored_rows`]' layout, this cache's formats) at positions
    /// `start..start + n` of `layer`, as they are.
    pub(super) fn put_stored_rows(
        &self,
        layer: usize,
        start: u64,
        n: u64,
        bytes: &RowBytes,
    ) -> Result<()> {
        self.check_span(layer, start, n)?;
        self.check_whole_split("writing cache rows as stored")?;
        let row = self.config.row(layer) as usize;
        let halves = self.halves();
        for (i, (b, f)) in bytes.iter().zip(halves).enumerate() {
            let want = f.byte_at(n as usize * row);
            if b.len() != want {
                return Err(invalid(
                    format!("{} bytes for cache layer {layer}", ["k", "v"][i]),
                    format!("{want} ({n} rows of {row} values as {})", f.name()),
                    b.len(),
                ));
            }
        }
        self.join_prefetch();
        self.written.fetch_max(start + n, Ordering::AcqRel);
        let parts = self.tp_parts();
        if !parts.is_empty() {
            for p in &parts {
                let mine = [0, 1].map(|h| {
                    let (at, width) = self.part_span(layer, p.heads, halves[h]);
                    bytes[h]
                        .chunks_exact(halves[h].byte_at(row))
                        .flat_map(|r| &r[at..at + width])
                        .copied()
                        .collect::<Vec<u8>>()
                });
                p.cache.put_stored_rows(layer, start, n, &mine)?;
            }
            return Ok(());
        }
        let was = self
            .versions
            .get(layer)
            .map(|v| v.fetch_add(1, Ordering::AcqRel));
        let mut layers = self.lock();
        let store = held_mut(&mut layers, layer)?;
        let runs = byte_runs(self.config.rows(layer), start, n, row, halves);
        for &(t0, count, spans) in &runs {
            for (((src, f), buf), (b0, _)) in bytes
                .iter()
                .zip(halves)
                .zip([&mut store.k, &mut store.v])
                .zip(spans)
            {
                buf.write(b0, &src[f.byte_at(t0 * row)..f.byte_at((t0 + count) * row)])?;
            }
        }
        if let (true, Some(was)) = (self.config.offload, was) {
            let spans: Vec<[(usize, usize); 2]> = runs.iter().map(|r| r.2).collect();
            self.refresh_slots(layer, store, was, &spans)?;
        }
        Ok(())
    }

    /// How this cache stores keys and values.
    pub(super) fn halves(&self) -> [KvFormat; 2] {
        halves_of(self.config.dtype)
    }

    /// Where heads `a..b` of `layer` lie in one stored row of format `f`: first byte, bytes.
    fn part_span(&self, layer: usize, (a, b): (u32, u32), f: KvFormat) -> (usize, usize) {
        let hd = self.config.head_dim as usize;
        let (from, to) = (f.byte_at(a as usize * hd), f.byte_at(b as usize * hd));
        debug_assert!(self.config.n_kv_heads[layer] >= b);
        (from, to - from)
    }

    /// Refuses a rank's share of a multi-process run: the other ranks' heads are in their
    /// processes, so its rows are not whole here.
    pub(super) fn check_whole_split(&self, what: &str) -> Result<()> {
        if self.tp_rank.load(Ordering::Acquire) {
            return Err(EngineError::Unsupported {
                what: format!("{what} on one rank's share of a multi-process cache"),
                detail: "each rank holds some kv heads; save or copy in a single-process run"
                    .into(),
            });
        }
        Ok(())
    }
}

/// How a cache of `dtype` stores keys and values.
pub(super) fn halves_of(dtype: CacheDType) -> [KvFormat; 2] {
    let (k, v) = formats(dtype);
    [k, v]
}

/// Rows of `values` values a half stored as a cache of `from` stores them, stored as one of
/// `to` does instead: the same bytes where the formats agree, else decoded and encoded again
/// (within `to`'s bound of the values).
pub(super) fn recode(
    from: CacheDType,
    to: CacheDType,
    bytes: RowBytes,
    values: usize,
) -> Result<RowBytes> {
    let (from, to) = (halves_of(from), halves_of(to));
    let mut out = [Vec::new(), Vec::new()];
    for (h, bytes) in bytes.into_iter().enumerate() {
        out[h] = if from[h] == to[h] {
            bytes
        } else {
            let mut x = vec![0f32; values];
            weightlift_kernels::kv_decode(from[h], &bytes, &mut x).map_err(kernel)?;
            let mut again = vec![0u8; to[h].byte_at(values)];
            weightlift_kernels::kv_encode(to[h], &x, &mut again).map_err(kernel)?;
            again
        };
    }
    Ok(out)
}
