//! Embeddings: the hidden states of a decoder after its output norm, pooled per input as
//! llama.cpp pools them (`llama_pooling_type`) and optionally scaled to unit length, as
//! llama-cpp-python's `Llama.embed` returns them.
//!
//! - The rows come from [`Model::forward_hidden`]: llama.cpp's `result_norm`, the tensor its
//!   `t_embd` points at for a decoder, the head's input. Attention is causal, as llama.cpp
//!   runs a llama-family model in embedding mode; a GGUF whose `{arch}.attention.causal` is
//!   false (a bidirectional encoder) is refused rather than embedded wrongly.
//! - [`Pooling`] follows `llama_pooling_type`: `None` keeps one vector per token, `Mean`
//!   averages the rows, `Cls` takes the first, `Last` the last. Where the caller leaves it
//!   unspecified (llama.cpp's `-1`), the model's `{arch}.pooling_type` GGUF key decides, else
//!   `None` (llama.cpp's loader default).
//! - Normalising divides each vector by its L2 norm, leaving a zero vector as it is
//!   (llama-cpp-python's `normalize_embedding`).
//! - [`Model::embed`] runs on a cache of its own, so the model's cache (its rows, its `seq_len`
//!   and the token history generation reuses a prefix of) is untouched: a sequence the plan
//!   counted that no batch holds (`weightlift serve` plans one for its embeddings), else a
//!   scratch cache made for the call.

use std::sync::Arc;

use weightlift_format::{Format, MetaValue, Metadata};

use crate::Cache;
use crate::error::{EngineError, Result, invalid};
use crate::forward::{Output, check_ids};
use crate::model::Model;

/// How the hidden-state rows of one input become its embedding: llama.cpp's
/// `llama_pooling_type` (0 none, 1 mean, 2 cls, 3 last).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Pooling {
    /// One vector per token (`LLAMA_POOLING_TYPE_NONE`).
    #[default]
    None,
    /// The mean of the token rows (`LLAMA_POOLING_TYPE_MEAN`).
    Mean,
    /// The first token's row (`LLAMA_POOLING_TYPE_CLS`).
    Cls,
    /// The last token's row (`LLAMA_POOLING_TYPE_LAST`).
    Last,
}

/// llama.cpp's `LLAMA_POOLING_TYPE_UNSPECIFIED`: the model decides.
pub const POOLING_UNSPECIFIED: i32 = -1;

/// llama.cpp's `LLAMA_POOLING_TYPE_RANK`: a reranker's score through a classification head.
const POOLING_RANK: i64 = 4;

impl Pooling {
    /// `none`, `mean`, `cls` or `last` (llama.cpp's `--pooling` names).
    pub fn parse(s: &str) -> Result<Pooling> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Pooling::None),
            "mean" => Ok(Pooling::Mean),
            "cls" => Ok(Pooling::Cls),
            "last" => Ok(Pooling::Last),
            "rank" => Err(rank_unsupported()),
            _ => Err(invalid(
                "pooling",
                "'none', 'mean', 'cls' or 'last'",
                format!("'{s}'"),
            )),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Pooling::None => "none",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }

    /// llama.cpp's integer for this pooling.
    pub const fn llama_type(self) -> i32 {
        match self {
            Pooling::None => 0,
            Pooling::Mean => 1,
            Pooling::Cls => 2,
            Pooling::Last => 3,
        }
    }

    /// The pooling of llama.cpp's integer `pooling_type`; `None` for
    /// [`POOLING_UNSPECIFIED`] (the model's default applies: [`Model::pooling_for`]).
    pub fn from_llama_type(v: i32) -> Result<Option<Pooling>> {
        match i64::from(v) {
            -1 => Ok(None),
            v => pooling_of(v, "pooling_type"),
        }
    }

    /// The embeddings of one input from its hidden-state `rows` (`n × width`, row-major,
    /// `n ≥ 1`): every row for `None`, else the one pooled vector. The mean sums in f64 and
    /// rounds once.
    pub fn pool(self, rows: &[f32], width: usize) -> Vec<Vec<f32>> {
        let mut it = rows.chunks_exact(width.max(1));
        match self {
            Pooling::None => it.map(<[f32]>::to_vec).collect(),
            Pooling::Cls => it.next().map(<[f32]>::to_vec).into_iter().collect(),
            Pooling::Last => it.next_back().map(<[f32]>::to_vec).into_iter().collect(),
            Pooling::Mean => {
                let n = it.len();
                if n == 0 {
                    return Vec::new();
                }
                let mut sum = vec![0f64; width];
                for row in it {
                    sum.iter_mut()
                        .zip(row)
                        .for_each(|(s, &v)| *s += f64::from(v));
                }
                vec![sum.iter().map(|s| (s / n as f64) as f32).collect()]
            }
        }
    }
}

/// The reranking pooling, which needs a classification head this engine does not run.
fn rank_unsupported() -> EngineError {
    EngineError::Unsupported {
        what: "rank pooling (LLAMA_POOLING_TYPE_RANK)".into(),
        detail: "it scores through a reranker's classification head, which llama-family \
                 decoders do not have; use none, mean, cls or last"
            .into(),
    }
}

/// The pooling of llama.cpp's integer `v`, read from `what`.
fn pooling_of(v: i64, what: &str) -> Result<Option<Pooling>> {
    match v {
        0 => Ok(Some(Pooling::None)),
        1 => Ok(Some(Pooling::Mean)),
        2 => Ok(Some(Pooling::Cls)),
        3 => Ok(Some(Pooling::Last)),
        POOLING_RANK => Err(rank_unsupported()),
        _ => Err(invalid(
            what,
            "-1 (the model's default), 0 (none), 1 (mean), 2 (cls) or 3 (last)",
            v,
        )),
    }
}

/// The pooling a GGUF's metadata asks for (`{arch}.pooling_type`), `None` when it has no such
/// key (llama.cpp's loader default for a decoder).
pub fn pooling_in(metadata: &Metadata, arch: &str) -> Result<Pooling> {
    let key = format!("{arch}.pooling_type");
    let Some(value) = metadata.get(&key) else {
        return Ok(Pooling::None);
    };
    let v = match value {
        MetaValue::I8(v) => Some(i64::from(*v)),
        MetaValue::I16(v) => Some(i64::from(*v)),
        MetaValue::I32(v) => Some(i64::from(*v)),
        MetaValue::I64(v) => Some(*v),
        other => other.as_u64().and_then(|v| i64::try_from(v).ok()),
    };
    let Some(v) = v else {
        return Err(invalid(
            format!("metadata key '{key}'"),
            "an integer llama_pooling_type",
            format!("{value:?}; the file is corrupted or was written by another tool"),
        ));
    };
    if v == i64::from(POOLING_UNSPECIFIED) {
        return Ok(Pooling::None);
    }
    Ok(pooling_of(v, &format!("metadata key '{key}'"))?.unwrap_or(Pooling::None))
}

/// Whether a GGUF's metadata lets its attention be causal: `{arch}.attention.causal`, true when
/// absent (llama.cpp's loader default).
pub fn causal_in(metadata: &Metadata, arch: &str) -> Result<bool> {
    let key = format!("{arch}.attention.causal");
    match metadata.get(&key) {
        None => Ok(true),
        Some(v) => v.as_bool().ok_or_else(|| {
            invalid(
                format!("metadata key '{key}'"),
                "a bool",
                format!("{v:?}; the file is corrupted or was written by another tool"),
            )
        }),
    }
}

/// Divide `v` by its L2 norm (summed in f64); a zero vector stays as it is, as in
/// llama-cpp-python's `normalize_embedding`.
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
}

impl Model {
    /// The GGUF metadata and its architecture name, for a GGUF checkpoint.
    fn gguf_metadata(&self) -> Option<(&Metadata, String)> {
        let ckpt = self.source().checkpoint()?;
        if ckpt.format() != Format::Gguf {
            return None;
        }
        let meta = ckpt.metadata();
        let arch = match meta.get("general.architecture").and_then(MetaValue::as_str) {
            Some(a) => a.to_owned(),
            None => self.source().spec()?.architecture.clone(),
        };
        Some((meta, arch))
    }

    /// The pooling the checkpoint asks for: its GGUF `{arch}.pooling_type`, else
    /// [`Pooling::None`].
    pub fn default_pooling(&self) -> Result<Pooling> {
        match self.gguf_metadata() {
            Some((meta, arch)) => pooling_in(meta, &arch),
            None => Ok(Pooling::None),
        }
    }

    /// The pooling of llama.cpp's integer `pooling_type` (llama-cpp-python's `pooling_type=`):
    /// [`POOLING_UNSPECIFIED`] is the model's [`Model::default_pooling`].
    pub fn pooling_for(&self, llama_type: i32) -> Result<Pooling> {
        match Pooling::from_llama_type(llama_type)? {
            Some(p) => Ok(p),
            None => self.default_pooling(),
        }
    }

    /// Positions one sequence may hold: the model's own cache's (`n_ctx`), else the plan's,
    /// else the context length the checkpoint was trained for.
    pub fn context_len(&self) -> Result<u64> {
        let state = self.state.as_ref().ok_or_else(|| EngineError::NotLoaded {
            what: "the model".into(),
        })?;
        if let Some(c) = &state.cache {
            return Ok(c.config().max_seq_len);
        }
        if let Some(f) = &state.forward {
            return Ok(f.max_seq_len);
        }
        Ok(self.source().spec().map_or(0, |s| s.context_length))
    }

    /// The cache an embedding of `tokens` positions runs on, and whether it is a scratch
    /// cache to free after: a sequence the plan counted beside the own cache
    /// ([`Model::planned_sequences`]) that only the model holds (no batch took it) and that
    /// is long enough, emptied, so the embedding holds no memory beyond the plan's; else a
    /// new [`Model::sequence_cache`] of `tokens` positions.
    fn embedding_cache(&self, tokens: u64) -> Result<(Arc<Cache>, bool)> {
        let state = self.state.as_ref().ok_or_else(|| EngineError::NotLoaded {
            what: "the model".into(),
        })?;
        // One strong handle is the model's own: a batch holds a clone of each slot it took.
        let idle = (state.sequences.iter())
            .find(|c| Arc::strong_count(c) == 1 && c.config().max_seq_len >= tokens);
        if let Some(c) = idle {
            c.reset();
            return Ok((Arc::clone(c), false));
        }
        Ok((self.sequence_cache(tokens)?, true))
    }

    /// The embeddings of token `ids` (one input): [`Model::forward_hidden`]'s rows pooled by
    /// `pooling`, each vector divided by its L2 norm when `normalize`. `Pooling::None` gives
    /// one vector per token, the others one vector; each is `hidden_size` floats.
    ///
    /// The ids run in prompt chunks on a cache other than the model's own: a planned sequence
    /// nothing else holds, left empty after, else a scratch cache of `ids.len()` positions
    /// made for this call in the own cache's dtype and placement and freed after it. Another
    /// cache rather than saving and restoring the model's own: the own cache's rows, `seq_len`
    /// and token history stay exactly as they were (a quantised cache could not be restored
    /// bit for bit from its rows), and nothing of the whole context is copied; the cost of a
    /// scratch cache is a second cache of the input's length while the call runs (an
    /// out-of-memory error names the device).
    ///
    /// An empty input, or one longer than [`Model::context_len`], is an error before anything
    /// runs.
    pub fn embed(
        &mut self,
        ids: &[u32],
        pooling: Pooling,
        normalize: bool,
    ) -> Result<Vec<Vec<f32>>> {
        if ids.is_empty() {
            return Err(invalid(
                "embedding input",
                "at least one token",
                "an empty input",
            ));
        }
        let n_ctx = self.context_len()?;
        let tokens = ids.len() as u64;
        if tokens > n_ctx {
            return Err(EngineError::ContextFull {
                tokens,
                held: 0,
                max_seq_len: n_ctx,
            });
        }
        check_ids(ids, self.vocab_size()?)?;
        if let Some((meta, arch)) = self.gguf_metadata()
            && !causal_in(meta, &arch)?
        {
            return Err(EngineError::Unsupported {
                what: format!("embeddings of a '{arch}' model with non-causal attention"),
                detail: format!(
                    "its GGUF sets {arch}.attention.causal = false (a bidirectional encoder); \
                     the forward pass attends causally, as llama-family decoders do"
                ),
            });
        }
        let (cache, scratch) = self.embedding_cache(tokens)?;
        let mut rows = Vec::new();
        let ran = self.run_forward(ids, Some(&cache), Output::Hidden, &mut rows);
        if scratch {
            cache.free();
        } else {
            // a batch that takes this sequence later starts from an empty slot
            cache.reset();
        }
        ran?;
        let mut vectors = pooling.pool(&rows, rows.len() / ids.len());
        if normalize {
            vectors.iter_mut().for_each(|v| self::normalize(v));
        }
        Ok(vectors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three rows of width 2, worked by hand.
    const ROWS: [f32; 6] = [1.0, 2.0, 3.0, -4.0, 5.0, 8.0];

    #[test]
    fn pooling_takes_the_rows_llama_cpp_takes() {
        assert_eq!(
            Pooling::None.pool(&ROWS, 2),
            vec![vec![1.0, 2.0], vec![3.0, -4.0], vec![5.0, 8.0]]
        );
        assert_eq!(Pooling::Mean.pool(&ROWS, 2), vec![vec![3.0, 2.0]]);
        assert_eq!(Pooling::Cls.pool(&ROWS, 2), vec![vec![1.0, 2.0]]);
        assert_eq!(Pooling::Last.pool(&ROWS, 2), vec![vec![5.0, 8.0]]);
        // one row: every pooling is that row
        for p in [Pooling::None, Pooling::Mean, Pooling::Cls, Pooling::Last] {
            assert_eq!(p.pool(&ROWS[..2], 2), vec![vec![1.0, 2.0]], "{p:?}");
        }
    }

    #[test]
    fn the_mean_rounds_once() {
        // 0.1 three times: an f32 running sum rounds at each step, the f64 sum once
        let rows = [0.1f32; 3];
        let want = ((0.1f32 as f64 * 3.0) / 3.0) as f32;
        assert_eq!(Pooling::Mean.pool(&rows, 1), vec![vec![want]]);
    }

    #[test]
    fn normalize_divides_by_the_l2_norm() {
        let mut v = [3.0f32, -4.0];
        normalize(&mut v);
        assert_eq!(v, [0.6, -0.8]);
        let mut zero = [0.0f32; 4];
        normalize(&mut zero);
        assert_eq!(zero, [0.0; 4]);
        let mut one = [0.0f32, 2.5, 0.0];
        normalize(&mut one);
        assert_eq!(one, [0.0, 1.0, 0.0]);
    }

    #[test]
    fn names_and_llama_integers_round_trip() {
        for p in [Pooling::None, Pooling::Mean, Pooling::Cls, Pooling::Last] {
            assert_eq!(Pooling::parse(p.name()).unwrap(), p);
            assert_eq!(Pooling::from_llama_type(p.llama_type()).unwrap(), Some(p));
        }
        assert_eq!(Pooling::parse(" MEAN ").unwrap(), Pooling::Mean);
        assert_eq!(Pooling::from_llama_type(-1).unwrap(), None);
        let e = Pooling::parse("max").unwrap_err().to_string();
        assert_eq!(
            e,
            "pooling: expected 'none', 'mean', 'cls' or 'last', got 'max'"
        );
        let e = Pooling::from_llama_type(7).unwrap_err().to_string();
        assert!(
            e.starts_with("pooling_type: expected -1 (the model's default)"),
            "{e}"
        );
        assert!(e.ends_with("got 7"), "{e}");
        for e in [
            Pooling::from_llama_type(4).unwrap_err(),
            Pooling::parse("rank").unwrap_err(),
        ] {
            let e = e.to_string();
            assert!(e.starts_with("rank pooling"), "{e}");
            assert!(e.contains("classification head"), "{e}");
        }
    }

    #[test]
    fn the_gguf_key_decides_the_default() {
        let mut meta = Metadata::new();
        assert_eq!(pooling_in(&meta, "llama").unwrap(), Pooling::None);
        meta.insert("qwen2.pooling_type".into(), MetaValue::U32(3));
        assert_eq!(pooling_in(&meta, "qwen2").unwrap(), Pooling::Last);
        // another architecture's key is not this model's
        assert_eq!(pooling_in(&meta, "llama").unwrap(), Pooling::None);
        meta.insert("llama.pooling_type".into(), MetaValue::U32(9));
        let e = pooling_in(&meta, "llama").unwrap_err().to_string();
        assert!(
            e.starts_with("metadata key 'llama.pooling_type': expected -1") && e.ends_with("got 9"),
            "{e}"
        );
        meta.insert(
            "llama.pooling_type".into(),
            MetaValue::String("mean".into()),
        );
        let e = pooling_in(&meta, "llama").unwrap_err().to_string();
        assert!(e.contains("an integer llama_pooling_type"), "{e}");
        meta.insert("llama.pooling_type".into(), MetaValue::I32(-1));
        assert_eq!(pooling_in(&meta, "llama").unwrap(), Pooling::None);
    }

    #[test]
    fn attention_is_causal_unless_the_gguf_says_not() {
        let mut meta = Metadata::new();
        assert!(causal_in(&meta, "llama").unwrap());
        meta.insert("llama.attention.causal".into(), MetaValue::Bool(false));
        assert!(!causal_in(&meta, "llama").unwrap());
        assert!(causal_in(&meta, "qwen2").unwrap());
        meta.insert("llama.attention.causal".into(), MetaValue::U32(0));
        let e = causal_in(&meta, "llama").unwrap_err().to_string();
        assert!(
            e.starts_with("metadata key 'llama.attention.causal': expected a bool, got U32(0)"),
            "{e}"
        );
    }
}
