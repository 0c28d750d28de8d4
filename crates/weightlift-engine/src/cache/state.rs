//! A cache's sequence saved and restored: llama-cpp-python's `save_state` / `load_state`.
//!
//! The state holds the token ids and every layer's K and V rows of the positions it holds up to
//! `seq_len`, as the saving cache stores them ([`Cache::stored_rows`]): all of them, or for a
//! sliding-window layer kept as a ring those from where its ring starts ([`Cache::held_from`];
//! its window is all the next token reads). Restored into a cache of the same dtype, the bytes
//! are written back as they are, so a quantised cache's groups come back bit for bit and the
//! next token's logits are those the saving cache gives. A cache of another dtype takes the
//! values they decode to, encoded again. Either way a state works on every device and layout a
//! cache has (host, CUDA, offloaded, split by heads, split or not alike) and can be restored
//! into any cache of the same model shape that can attend from it: a layer whose state starts
//! past the window its next token needs there is refused by name.
//!
//! [`Cache::copy_prefix_from`] moves a prefix from one cache to another (a batch's slots) the
//! same way: the stored bytes between caches of one dtype, so the rows are the donor's bit for
//! bit; otherwise decoded and encoded again.
//!
//! [`CacheState::to_bytes`] is a flat little-endian record (magic, version, shape, ids, each
//! layer's first position, the dtype's name, rows), and [`CacheState::from_bytes`] checks every
//! length against the bytes it has before it allocates, so a truncated or foreign blob is an
//! error, never a huge allocation. Records of versions 1 and 2 (before stored rows) hold f32 rows
//! head by head, and those of version 1 (before rings) every layer from position 0.

use weightlift_kernels::KvFormat;

use super::stored_rows::{halves_of, recode};
use super::{Cache, CacheDType};
use crate::error::{EngineError, Result, invalid};

const MAGIC: &[u8; 8] = b"WLKVSTAT";
const VERSION: u32 = 3;

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
    /// How `layers` are stored: the saving cache's dtype.
    pub dtype: CacheDType,
    /// Per layer, K then V bytes of positions `start..seq_len` as `dtype` stores them,
    /// token-major whole rows ([`Cache::stored_rows`]).
    pub layers: Vec<(Vec<u8>, Vec<u8>)>,
    /// A record of version 1 or 2: `layers` are f32 in `(n_kv_heads, tokens, head_dim)` order,
    /// turned token-major on load (the record does not say how a row splits into heads).
    pub heads_first: bool,
}

impl Cache {
    /// The tokens this cache holds, with their keys and values.
    pub fn save_state(&self) -> Result<CacheState> {
        self.check_one_sequence("save_state")?;
        self.check_whole_split("save_state")?;
        let seq_len = self.seq_len();
        let ids = self.ids();
        let starts: Vec<u64> = (0..self.n_layers())
            .map(|l| self.held_from(l).min(seq_len))
            .collect();
        let mut layers = Vec::with_capacity(self.n_layers());
        for (l, &start) in starts.iter().enumerate() {
            let [k, v] = self.stored_rows(l, start, seq_len)?;
            layers.push((k, v));
        }
        Ok(CacheState {
            seq_len,
            ids,
            rows: (0..self.n_layers()).map(|l| self.config.row(l)).collect(),
            starts,
            dtype: self.config.dtype,
            layers,
            heads_first: false,
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
        let saved = state.halves();
        for (l, (k, v)) in state.layers.iter().enumerate() {
            let values = (rows[l] * (state.seq_len - state.starts[l])) as usize;
            let want = saved.map(|f| f.byte_at(values));
            if [k.len(), v.len()] != want {
                return Err(invalid(
                    format!("cache state rows of layer {l}"),
                    format!("{} and {} bytes (K and V)", want[0], want[1]),
                    format!("{} and {}", k.len(), v.len()),
                ));
            }
        }
        self.check_whole_split("load_state")?;
        self.reset();
        let restored = state.layers.iter().enumerate().try_for_each(|(l, (k, v))| {
            let start = state.starts[l];
            self.set_floor(l, start);
            // a ring takes its last rows' positions (those before are never read)
            let from = start.max(state.seq_len.saturating_sub(self.config.rows(l)));
            if from == state.seq_len {
                return Ok(());
            }
            let (row, n) = (rows[l] as usize, (state.seq_len - from) as usize);
            let skip = (from - start) as usize * row;
            let kept = [(k, saved[0]), (v, saved[1])].map(|(half, f)| match state.heads_first {
                true => self.heads_first_to_rows(l, half, state.seq_len - start)[f.byte_at(skip)..]
                    .to_vec(),
                false => half[f.byte_at(skip)..].to_vec(),
            });
            let bytes = recode(state.dtype, self.config.dtype, kept, n * row)?;
            self.put_stored_rows(l, from, n as u64, &bytes)
        });
        if restored.is_err() {
            // rows written part way would hold the rings' positions past an empty sequence
            self.reset();
            return restored;
        }
        if state.ids.len() as u64 == state.seq_len {
            self.note_ids(0, &state.ids);
        }
        self.set_seq_len(state.seq_len)
    }

    /// A version-1/2 record's f32 rows of `layer` (`(heads, tokens, head_dim)`, of the length
    /// [`Cache::load_state`] checked), as f32 bytes token-major.
    fn heads_first_to_rows(&self, layer: usize, bytes: &[u8], tokens: u64) -> Vec<u8> {
        let heads = self.config.n_kv_heads[layer] as usize;
        let w = self.config.head_dim as usize * 4;
        let mut out = vec![0u8; bytes.len()];
        for (h, head) in bytes.chunks_exact((tokens as usize * w).max(1)).enumerate() {
            for (t, r) in head.chunks_exact(w.max(1)).enumerate() {
                let at = (t * heads + h) * w;
                out[at..at + w].copy_from_slice(r);
            }
        }
        out
    }

    /// Replace what this cache holds with the first `n` tokens `donor` holds, as if it had run
    /// them: their ids, the settings they were computed under and every layer's rows from where
    /// the donor's layer holds them (a ring's rows: the window the next token reads and what
    /// else it still holds). A prompt that starts with those ids then reuses them here.
    ///
    /// Where both caches store rows alike (the same dtype) their bytes are copied as they are,
    /// on any device and whatever either's split by heads; otherwise they are decoded and
    /// encoded again. The donor may be running a sequence past `n`: its rows below `n` stay
    /// what they are, and a ring that has since overwritten the window position `n` needs is
    /// refused by name, as a rewind of it would be. A rank's share of a multi-process run
    /// (whose ranks must all decide alike) is refused. A refused copy leaves this cache as it
    /// was; one that fails part way (a device error) leaves it empty.
    pub fn copy_prefix_from(&self, donor: &Cache, n: u64) -> Result<()> {
        self.check_one_sequence("copy_prefix_from")?;
        donor.check_one_sequence("copy_prefix_from")?;
        if std::ptr::eq(self, donor) {
            return self.truncate(n);
        }
        self.check_whole_split("copy_prefix_from")?;
        donor.check_whole_split("copy_prefix_from")?;
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
            self.copy_rows(donor, l, start, n)
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
        let rows = donor.stored_rows(layer, start, end)?;
        let values = (end - start) as usize * self.config.row(layer) as usize;
        let bytes = recode(donor.config.dtype, self.config.dtype, rows, values)?;
        self.put_stored_rows(layer, start, end - start, &bytes)
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
        let rows: usize = self.layers.iter().map(|(k, v)| k.len() + v.len()).sum();
        let mut out = Vec::with_capacity(36 + 4 * self.ids.len() + 16 * self.rows.len() + rows);
        out.extend_from_slice(MAGIC);
        let version = if self.heads_first { 2 } else { VERSION };
        out.extend_from_slice(&version.to_le_bytes());
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
        // a record read from an older version keeps its layout, and is written as one
        if !self.heads_first {
            // by its name in the one dtype grammar (`CacheDType::parse` reads it back)
            let name = self.dtype.name().as_bytes();
            out.push(name.len() as u8);
            out.extend_from_slice(name);
        }
        for (k, v) in &self.layers {
            out.extend_from_slice(k);
            out.extend_from_slice(v);
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
        let dtype = match version {
            3.. => {
                let [len] = r.array()?;
                let name = String::from_utf8_lossy(r.take(len.into())?).into_owned();
                CacheDType::parse(&name).map_err(|_| {
                    invalid(
                        "cache state dtype",
                        "a cache dtype's name",
                        format!("{name:?}; the record is corrupt"),
                    )
                })?
            }
            _ => CacheDType::F32,
        };
        let halves = halves_of(dtype);
        let mut layers = Vec::with_capacity(n_layers);
        for (&row, &start) in rows.iter().zip(&starts) {
            // every format takes more than half a byte a value: a count the record cannot
            // hold is refused before its bytes are computed
            let values = usize::try_from(row.saturating_mul(seq_len - start))
                .ok()
                .filter(|&v| v <= bytes.len().saturating_mul(2))
                .filter(|v| halves.iter().all(|f| v.is_multiple_of(f.granule())))
                .ok_or_else(|| {
                    invalid(
                        "cache state",
                        format!(
                            "rows of whole groups that its {} bytes can hold",
                            bytes.len()
                        ),
                        format!(
                            "{row} values × {} tokens; the record is corrupt",
                            seq_len - start
                        ),
                    )
                })?;
            let k = r.take(halves[0].byte_at(values))?.to_vec();
            let v = r.take(halves[1].byte_at(values))?.to_vec();
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
            dtype,
            layers,
            heads_first: version < 3,
        })
    }

    /// How `layers` are stored, K then V.
    fn halves(&self) -> [KvFormat; 2] {
        halves_of(self.dtype)
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(x: impl IntoIterator<Item = f32>) -> Vec<u8> {
        x.into_iter().flat_map(f32::to_le_bytes).collect()
    }

    fn sample() -> CacheState {
        CacheState {
            seq_len: 2,
            ids: vec![7, 9],
            rows: vec![4],
            starts: vec![0],
            dtype: CacheDType::F32,
            layers: vec![(f32_bytes((0..8).map(|x| x as f32)), f32_bytes([0.5; 8]))],
            heads_first: false,
        }
    }

    #[test]
    fn a_state_round_trips_through_bytes() {
        let s = sample();
        assert_eq!(CacheState::from_bytes(&s.to_bytes()).unwrap(), s);
        // a quantised cache's rows: a group of 32 values in 34 bytes (K and V of q8), or K in
        // 34 and V in 18 (q6)
        for (dtype, v_bytes) in [(CacheDType::Q8, 34), (CacheDType::Q6, 18)] {
            let q = CacheState {
                seq_len: 1,
                rows: vec![32],
                starts: vec![0],
                ids: vec![3],
                dtype,
                layers: vec![(vec![1; 34], vec![2; v_bytes])],
                heads_first: false,
            };
            assert_eq!(CacheState::from_bytes(&q.to_bytes()).unwrap(), q);
        }
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
            v1.extend_from_slice(k);
            v1.extend_from_slice(v);
        }
        // its f32 rows are head by head, as versions 1 and 2 wrote them; written again, it is a
        // record of version 2
        let old = CacheState {
            heads_first: true,
            ..s.clone()
        };
        assert_eq!(CacheState::from_bytes(&v1).unwrap(), old);
        let again = old.to_bytes();
        assert_eq!(u32::from_le_bytes(again[8..12].try_into().unwrap()), 2);
        assert_eq!(CacheState::from_bytes(&again).unwrap(), old);
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
        // so are rows longer than the record (a huge row width) and a dtype nobody wrote
        let rows_at = 36 + 4 * 2;
        let mut wide = b.clone();
        wide[rows_at..rows_at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        let e = CacheState::from_bytes(&wide).unwrap_err().to_string();
        assert!(e.contains("the record is corrupt"), "{e}");
        let name_at = rows_at + 16;
        assert_eq!(&b[name_at..name_at + 4], b"\x03f32");
        let mut foreign = b.clone();
        foreign[name_at + 1..name_at + 4].copy_from_slice(b"q9x");
        let e = CacheState::from_bytes(&foreign).unwrap_err().to_string();
        assert!(
            e.contains("cache state dtype") && e.contains("\"q9x\""),
            "{e}"
        );
        // a quantised record's rows must be whole groups of 32
        let partial = CacheState {
            dtype: CacheDType::Q8,
            ..sample()
        };
        let e = CacheState::from_bytes(&partial.to_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rows of whole groups"), "{e}");
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
