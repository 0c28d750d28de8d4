//! A cache's sequence saved and restored: llama-cpp-python's `save_state` / `load_state`.
//!
//! The state holds the token ids and every layer's K and V rows of the positions it holds up to
//! `seq_len` as f32: all of them, or for a sliding-window layer kept as a ring those from where
//! its ring starts ([`Cache::held_from`]; its window is all the next token reads). They are read
//! through [`Cache::read`] and written back through [`Cache::write`], so a state works on every
//! device and layout the cache has (host, CUDA, offloaded, split by heads) and can be restored
//! into any cache of the same model shape, whatever its dtype, that can attend from it: a layer
//! whose state starts past the window its next token needs there is refused by name. A
//! quantised cache's rows come back as the values it decodes to; encoding those again stays
//! within the dtype's bound of them but need not give the same groups (turning a group by the
//! Walsh-Hadamard transform and back rounds).
//!
//! [`Cache::copy_prefix_from`] moves a prefix from one cache to another (a batch's slots):
//! between caches of one dtype it copies the stored bytes as they are, so the rows are the
//! donor's bit for bit; otherwise it decodes and encodes them as a state does.
//!
//! [`CacheState::to_bytes`] is a flat little-endian record (magic, version, shape, ids, rows,
//! each layer's first position), and [`CacheState::from_bytes`] checks every length against the
//! bytes it has before it allocates, so a truncated or foreign blob is an error, never a huge
//! allocation. Records of version 1 (before rings) hold every layer from position 0.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use weightlift_kernels::KvFormat;

use super::{Cache, formats, held, held_mut};
use crate::error::{EngineError, Result, invalid};

const MAGIC: &[u8; 8] = b"WLKVSTAT";
const VERSION: u32 = 2;

/// The tokens and K/V rows a cache held when [`Cache::save_state`] ran.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheState {
    /// Positions held.
    pub seq_len: u64,
    /// The ids at those positions; empty when the cache did not know them all.
    pub ids: Vec<u32>,
    /// Values per position of each layer (`n_kv_heads × head_dim`).
    pub rows: Vec<u64>,
    /// Per layer, the first position it holds (0, or where a ring's rows start).
    pub starts: Vec<u64>,
    /// Per layer, K then V in `(1, n_kv_heads, seq_len - start, head_dim)` order.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Cache {
    /// The tokens this cache holds, with their keys and values.
    pub fn save_state(&self) -> Result<CacheState> {
        self.check_one_sequence("save_state")?;
        let seq_len = self.seq_len();
        let ids = self.ids();
        let starts: Vec<u64> = (0..self.n_layers())
            .map(|l| self.held_from(l).min(seq_len))
            .collect();
        let mut layers = Vec::with_capacity(self.n_layers());
        for (l, &start) in starts.iter().enumerate() {
            layers.push(if start == seq_len {
                (Vec::new(), Vec::new())
            } else {
                self.read(l, start, seq_len)?
            });
        }
        Ok(CacheState {
            seq_len,
            ids,
            rows: (0..self.n_layers()).map(|l| self.config.row(l)).collect(),
            starts,
            layers,
        })
    }

    /// Replace what this cache holds with `state`: afterwards it holds `state.seq_len` tokens,
    /// and a prompt that starts with `state.ids` reuses them.
    pub fn load_state(&self, state: &CacheState) -> Result<()> {
        self.check_one_sequence("load_state")?;
        let rows: Vec<u64> = (0..self.n_layers()).map(|l| self.config.row(l)).collect();
        if rows != state.rows {
            return Err(invalid(
                "cache state",
                format!(
                    "one saved from a cache of this model ({} layers)",
                    rows.len()
                ),
                format!(
                    "{} layers; it was saved from another model",
                    state.rows.len()
                ),
            ));
        }
        if state.starts.len() != rows.len() || state.layers.len() != rows.len() {
            return Err(invalid(
                "cache state",
                format!(
                    "a first position and rows for each of its {} layers",
                    rows.len()
                ),
                format!("{} and {}", state.starts.len(), state.layers.len()),
            ));
        }
        if state.seq_len > self.config.max_seq_len {
            return Err(EngineError::ContextFull {
                tokens: state.seq_len,
                held: 0,
                max_seq_len: self.config.max_seq_len,
            });
        }
        // every layer holds what its next token attends to
        for (l, &start) in state.starts.iter().enumerate() {
            let needed = if state.seq_len == 0 {
                0
            } else {
                super::first_seen(self.config.window(l), state.seq_len)
            };
            if start > needed {
                return Err(EngineError::OutsideWindow {
                    what: format!(
                        "loading a state of {} tokens whose layer {l} starts at position {start}",
                        state.seq_len
                    ),
                    layer: l,
                    window: self.config.window(l),
                    rows: self.config.rows(l),
                    held_from: start,
                    needed,
                    fix: "load it into a cache of the same model and runtime (its sliding \
                          windows and chunk size) as the one that saved it"
                        .into(),
                });
            }
        }
        self.reset();
        for (l, (k, v)) in state.layers.iter().enumerate() {
            let start = state.starts[l];
            self.set_floor(l, start);
            // a ring takes its last rows' positions (those before are never read)
            let from = start.max(state.seq_len.saturating_sub(self.config.rows(l)));
            if from < state.seq_len {
                let heads = self.config.n_kv_heads[l] as usize;
                let (k, v) = (
                    tokens_from(k, heads, state.seq_len - start, from - start),
                    tokens_from(v, heads, state.seq_len - start, from - start),
                );
                self.write(l, from, state.seq_len - from, &k, &v)?;
            }
        }
        if state.ids.len() as u64 == state.seq_len {
            self.note_ids(0, &state.ids);
        }
        self.set_seq_len(state.seq_len)
    }

    /// Replace what this cache holds with the first `n` tokens `donor` holds, as if it had run
    /// them: their ids, the settings they were computed under and every layer's rows from where
    /// the donor's layer holds them (a ring's rows: the window the next token reads and what
    /// else it still holds). A prompt that starts with those ids then reuses them here.
    ///
    /// Where both caches store rows alike (the same dtype) their bytes are copied as they are,
    /// on any device; otherwise they are decoded and encoded again ([`Cache::read`],
    /// [`Cache::write`]). The donor may be running a sequence past `n`: its rows below `n` stay
    /// what they are, and a ring that has since overwritten the window position `n` needs is
    /// refused by name, as a rewind of it would be. Caches split by heads alike copy part to
    /// part; any other split (a rank's share of a multi-process run included, whose ranks must
    /// all decide alike) is refused. A refused copy leaves this cache as it was; one that fails
    /// part way (a device error) leaves it empty.
    pub fn copy_prefix_from(&self, donor: &Cache, n: u64) -> Result<()> {
        self.check_one_sequence("copy_prefix_from")?;
        donor.check_one_sequence("copy_prefix_from")?;
        if std::ptr::eq(self, donor) {
            return self.truncate(n);
        }
        // a cache split by heads keeps the sequence and its parts the rows: part to part
        let parts: Vec<(Arc<Cache>, Arc<Cache>)> = {
            let (mine, theirs) = (self.tp_parts(), donor.tp_parts());
            let rank = |c: &Cache| c.tp_rank.load(Ordering::Acquire);
            let alike = mine.len() == theirs.len()
                && mine.iter().zip(&theirs).all(|(a, b)| a.heads == b.heads);
            if rank(self) || rank(donor) || !alike {
                return Err(EngineError::Unsupported {
                    what: "copy_prefix_from between caches split by heads differently (or by \
                           the ranks of a multi-process run)"
                        .into(),
                    detail: "copy between caches of one model and split; or run the prompt in \
                             this cache instead"
                        .into(),
                });
            }
            mine.into_iter()
                .zip(theirs)
                .map(|(a, b)| (a.cache, b.cache))
                .collect()
        };
        let rows: Vec<u64> = (0..self.n_layers()).map(|l| self.config.row(l)).collect();
        let donor_rows: Vec<u64> = (0..donor.n_layers()).map(|l| donor.config.row(l)).collect();
        if rows != donor_rows {
            return Err(invalid(
                "prefix donor",
                format!("a cache of this model ({} layers)", rows.len()),
                format!("{} layers; it is another model's", donor_rows.len()),
            ));
        }
        let ids = donor.ids();
        if n > donor.seq_len() || (ids.len() as u64) < n {
            return Err(invalid(
                "prefix to copy",
                format!("at most the {} tokens whose ids the donor knows", ids.len()),
                n,
            ));
        }
        if n > self.config.max_seq_len {
            return Err(EngineError::ContextFull {
                tokens: n,
                held: 0,
                max_seq_len: self.config.max_seq_len,
            });
        }
        donor.check_rewind(n, "copying a prefix")?;
        // the donor's rows of layer l from here on (what a saved state of its first n would
        // start at), at most the last rows this cache's ring keeps
        let starts: Vec<u64> = (0..self.n_layers())
            .map(|l| {
                donor
                    .held_from(l)
                    .max(n.saturating_sub(self.config.rows(l)))
                    .min(n)
            })
            .collect();
        for (l, &start) in starts.iter().enumerate() {
            let needed = super::first_seen(self.config.window(l), n);
            if n > 0 && start > needed {
                return Err(self.outside(
                    format!("copying a prefix of {n} tokens whose layer {l} starts at {start}"),
                    l,
                    needed,
                    "copy into a cache of the same model and runtime as the donor".into(),
                ));
            }
        }
        let under = *donor.lock_under();
        self.join_prefetch();
        donor.join_prefetch();
        self.reset();
        let copied = starts.iter().enumerate().try_for_each(|(l, &start)| {
            self.set_floor(l, start);
            if start == n {
                return Ok(());
            }
            if parts.is_empty() {
                return self.copy_rows(donor, l, start, n);
            }
            self.written.fetch_max(n, Ordering::AcqRel);
            parts.iter().try_for_each(|(mine, theirs)| {
                mine.set_floor(l, start);
                mine.copy_rows(theirs, l, start, n)
            })
        });
        if copied.is_err() {
            // rows written part way would hold the rings' positions past an empty sequence
            self.reset();
            return copied;
        }
        self.note_ids(0, &ids[..n as usize]);
        self.set_seq_len(n)?;
        *self.lock_under() = under;
        Ok(())
    }

    /// Positions `start..end` of `layer` from `donor`'s rows into this cache's: their bytes
    /// where both store them alike, else decoded and encoded again.
    fn copy_rows(&self, donor: &Cache, layer: usize, start: u64, end: u64) -> Result<()> {
        if donor.config.dtype != self.config.dtype {
            let (k, v) = donor.read(layer, start, end)?;
            return self.write(layer, start, end - start, &k, &v);
        }
        self.check_span(layer, start, end - start)?;
        donor.check_span(layer, start, end - start)?;
        let row = self.config.row(layer) as usize;
        let (hk, hv) = formats(self.config.dtype);
        // runs of positions that wrap past neither cache's last row: (donor row, row, count)
        let (from_rows, to_rows) = (donor.config.rows(layer), self.config.rows(layer));
        let mut runs = Vec::new();
        let mut p = start;
        while p < end {
            let (a, b) = (p % from_rows, p % to_rows);
            let count = (end - p).min(from_rows - a).min(to_rows - b);
            runs.push((a as usize, b as usize, count as usize));
            p += count;
        }
        let span = |f: KvFormat, r: usize, count: usize| {
            (f.byte_at(r * row), f.byte_at((r + count) * row))
        };
        let mut bytes = Vec::with_capacity(runs.len());
        {
            let layers = donor.lock();
            let store = held(&layers, layer)?;
            for &(a, _, count) in &runs {
                let (mut k, mut v) = (Vec::new(), Vec::new());
                for (out, f, buf) in [(&mut k, hk, &store.k), (&mut v, hv, &store.v)] {
                    let (b0, b1) = span(f, a, count);
                    out.resize(b1 - b0, 0);
                    buf.read(b0, out)?;
                }
                bytes.push([k, v]);
            }
        }
        self.written.fetch_max(end, Ordering::AcqRel);
        let was = self
            .versions
            .get(layer)
            .map(|v| v.fetch_add(1, Ordering::AcqRel));
        let mut layers = self.lock();
        let store = held_mut(&mut layers, layer)?;
        let mut spans = Vec::with_capacity(runs.len());
        for (&(_, b, count), [k, v]) in runs.iter().zip(&bytes) {
            let (ks, vs) = (span(hk, b, count), span(hv, b, count));
            store.k.write(ks.0, k)?;
            store.v.write(vs.0, v)?;
            spans.push([ks, vs]);
        }
        if let (true, Some(was)) = (self.config.offload, was) {
            self.refresh_slots(layer, store, was, &spans)?;
        }
        Ok(())
    }

    /// The ids at positions `0..seq_len`, or none when some position's id is unknown (rows
    /// written directly with [`Cache::write`]).
    pub fn ids(&self) -> Vec<u32> {
        let ids = self.lock_ids();
        if ids.len() as u64 == self.seq_len() {
            ids.clone()
        } else {
            Vec::new()
        }
    }

    fn check_one_sequence(&self, what: &str) -> Result<()> {
        if self.config.batch_size != 1 {
            return Err(EngineError::Unsupported {
                what: format!("{what} on a cache of batch_size {}", self.config.batch_size),
                detail: "a state holds one sequence; use a cache of batch_size 1".into(),
            });
        }
        Ok(())
    }
}

impl CacheState {
    /// The state as one flat record, for pickling or a file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let floats: usize = self.layers.iter().map(|(k, v)| k.len() + v.len()).sum();
        let mut out =
            Vec::with_capacity(32 + 4 * self.ids.len() + 8 * self.rows.len() + 4 * floats);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.seq_len.to_le_bytes());
        out.extend_from_slice(&(self.ids.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.rows.len() as u64).to_le_bytes());
        self.ids
            .iter()
            .for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
        self.rows
            .iter()
            .for_each(|r| out.extend_from_slice(&r.to_le_bytes()));
        self.starts
            .iter()
            .for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
        for (k, v) in &self.layers {
            k.iter()
                .chain(v)
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        out
    }

    /// Read a record [`CacheState::to_bytes`] wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<CacheState> {
        let mut r = Reader { bytes, at: 0 };
        let magic = r.take(MAGIC.len())?;
        if magic != MAGIC {
            return Err(invalid(
                "cache state",
                "bytes that save_state() returned (magic WLKVSTAT)",
                format!("a record starting {:02x?}", &magic[..magic.len().min(8)]),
            ));
        }
        let version = u32::from_le_bytes(r.array()?);
        if !(1..=VERSION).contains(&version) {
            return Err(invalid(
                "cache state version",
                format!("1 to {VERSION}"),
                version,
            ));
        }
        let seq_len = r.u64()?;
        let n_ids = r.count(4)?;
        let n_layers = r.count(8)?;
        let ids = (0..n_ids)
            .map(|_| r.array().map(u32::from_le_bytes))
            .collect::<Result<Vec<_>>>()?;
        let rows = (0..n_layers).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
        let starts = if version >= 2 {
            let starts = (0..n_layers).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
            if let Some(s) = starts.iter().find(|&&s| s > seq_len) {
                return Err(invalid(
                    "cache state",
                    format!("layers starting at most at its {seq_len} tokens"),
                    format!("a layer starting at {s}; the record is corrupt"),
                ));
            }
            starts
        } else {
            vec![0; n_layers]
        };
        let mut layers = Vec::with_capacity(n_layers);
        for (&row, &start) in rows.iter().zip(&starts) {
            let n = usize::try_from(row.saturating_mul(seq_len - start)).unwrap_or(usize::MAX);
            let k = r.floats(n)?;
            let v = r.floats(n)?;
            layers.push((k, v));
        }
        if r.at != bytes.len() {
            return Err(invalid(
                "cache state",
                format!("{} bytes", r.at),
                format!("{} (trailing bytes)", bytes.len()),
            ));
        }
        Ok(CacheState {
            seq_len,
            ids,
            rows,
            starts,
            layers,
        })
    }
}

/// The tokens from `skip` on of values in `(heads, tokens, head_dim)` order (one sequence),
/// each head's rows cut alike.
fn tokens_from(x: &[f32], heads: usize, tokens: u64, skip: u64) -> Vec<f32> {
    let (tokens, skip) = (tokens as usize, skip as usize);
    if skip == 0 || heads == 0 || tokens == 0 {
        return x.to_vec();
    }
    let per_head = x.len() / heads;
    let hd = per_head / tokens;
    x.chunks_exact(per_head)
        .flat_map(|h| &h[skip * hd..])
        .copied()
        .collect()
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let left = self.bytes.len() - self.at;
        if n > left {
            return Err(invalid(
                "cache state",
                format!("{n} more bytes at offset {}", self.at),
                format!("{left}; the record is truncated"),
            ));
        }
        self.at += n;
        Ok(&self.bytes[self.at - n..self.at])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// A count of items of `size` bytes each that the remaining bytes can hold.
    fn count(&mut self, size: usize) -> Result<usize> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.at) / size;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| {
                invalid(
                    "cache state",
                    format!("at most {left} items at offset {}", self.at),
                    format!("{n}; the record is truncated or corrupt"),
                )
            })
    }

    fn floats(&mut self, n: usize) -> Result<Vec<f32>> {
        let b = self.take(n.saturating_mul(4))?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CacheState {
        CacheState {
            seq_len: 2,
            ids: vec![7, 9],
            rows: vec![4],
            starts: vec![0],
            layers: vec![((0..8).map(|x| x as f32).collect(), vec![0.5; 8])],
        }
    }

    #[test]
    fn a_state_round_trips_through_bytes() {
        let s = sample();
        assert_eq!(CacheState::from_bytes(&s.to_bytes()).unwrap(), s);
    }

    #[test]
    fn a_record_of_version_1_holds_every_layer_from_position_0() {
        let s = sample();
        let mut v1 = Vec::new();
        v1.extend_from_slice(MAGIC);
        v1.extend_from_slice(&1u32.to_le_bytes());
        for n in [s.seq_len, s.ids.len() as u64, s.rows.len() as u64] {
            v1.extend_from_slice(&n.to_le_bytes());
        }
        s.ids
            .iter()
            .for_each(|i| v1.extend_from_slice(&i.to_le_bytes()));
        s.rows
            .iter()
            .for_each(|r| v1.extend_from_slice(&r.to_le_bytes()));
        for (k, v) in &s.layers {
            k.iter()
                .chain(v)
                .for_each(|x| v1.extend_from_slice(&x.to_le_bytes()));
        }
        assert_eq!(CacheState::from_bytes(&v1).unwrap(), s);
        // a layer that starts past the tokens held is refused
        let mut late = s.clone();
        late.starts = vec![3];
        late.layers = vec![(Vec::new(), Vec::new())];
        let e = CacheState::from_bytes(&late.to_bytes())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a layer starting at 3; the record is corrupt"),
            "{e}"
        );
    }

    #[test]
    fn truncated_or_foreign_bytes_are_errors_naming_the_cause() {
        let b = sample().to_bytes();
        for cut in [0, 7, 20, b.len() - 1] {
            let e = CacheState::from_bytes(&b[..cut]).unwrap_err().to_string();
            assert!(e.contains("cache state"), "{e}");
        }
        let mut bad = b.clone();
        bad[0] = b'X';
        let e = CacheState::from_bytes(&bad).unwrap_err().to_string();
        assert!(e.contains("WLKVSTAT"), "{e}");
        // A huge id count is refused before anything is allocated.
        let mut huge = b.clone();
        huge[20..28].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = CacheState::from_bytes(&huge).unwrap_err().to_string();
        assert!(e.contains("truncated or corrupt"), "{e}");
        let mut extra = b;
        extra.push(0);
        assert!(
            CacheState::from_bytes(&extra)
                .unwrap_err()
                .to_string()
                .contains("trailing")
        );
    }
}
