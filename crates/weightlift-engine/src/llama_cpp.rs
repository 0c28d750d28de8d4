//! llama.cpp's and llama-cpp-python's argument conventions that are not a placement: the KV
//! cache's `type_k` / `type_v` (names, or ggml type numbers) and the seed that means "random".

use weightlift_format::DType;

use weightlift_plan::RuntimeSpec;

use crate::cache::CacheDType;
use crate::error::{EngineError, Result};

/// llama.cpp's `LLAMA_DEFAULT_SEED`: a seed of 0xFFFFFFFF asks for a random one.
pub const DEFAULT_SEED: u64 = 0xFFFF_FFFF;

/// A seed as llama-cpp-python's `Llama(seed=...)` takes it: [`DEFAULT_SEED`] is no seed.
pub fn seed(seed: Option<u64>) -> Option<u64> {
    seed.filter(|&s| s != DEFAULT_SEED)
}

/// The runtime limits of a `Llama(n_batch=...)` model: llama.cpp's `n_batch` is the longest
/// prompt chunk of one forward call, our `max_input_len`, unless the caller gave its own
/// `runtime`.
pub fn runtime(n_batch: u64, given: Option<RuntimeSpec>) -> RuntimeSpec {
    given.unwrap_or(RuntimeSpec {
        max_input_len: n_batch,
        ..RuntimeSpec::default()
    })
}

/// A `type_k` or `type_v` as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheType {
    /// A cache dtype name (`"f16"`, `"q8_0"`, ...).
    Name(String),
    /// A ggml type number, as llama-cpp-python passes `GGML_TYPE_*`.
    Ggml(u32),
}

impl CacheType {
    /// The name, with a ggml number named by the format crate's type table; `what` names the
    /// argument when the ggml type is not one the cache stores.
    fn name(&self, what: &str) -> Result<String> {
        let id = match self {
            CacheType::Name(n) => return Ok(n.clone()),
            CacheType::Ggml(id) => *id,
        };
        let name = DType::from_ggml_id(id).map(|t| t.name().to_ascii_lowercase());
        match name {
            Some(n) if CacheDType::parse(&n).is_ok() => Ok(n),
            other => Err(EngineError::Unsupported {
                what: format!(
                    "{what}={id} ({})",
                    other.unwrap_or_else(|| "not a ggml type".into())
                ),
                detail: "the KV cache stores f32 (0), f16 (1), q4_0 (2), q8_0 (8) or bf16 (30)"
                    .into(),
            }),
        }
    }
}

/// The cache dtype of llama.cpp's `type_k` / `type_v` pair (`None` is llama.cpp's default,
/// f16): equal types, or q8_0 keys with q4_0 values (the q6 cache).
pub fn cache_dtype(type_k: Option<CacheType>, type_v: Option<CacheType>) -> Result<CacheDType> {
    let f16 = || CacheType::Name("f16".into());
    let k = type_k.unwrap_or_else(f16).name("type_k")?;
    let v = type_v.unwrap_or_else(f16).name("type_v")?;
    CacheDType::from_llama_types(&k, &v)?.ok_or_else(|| EngineError::Unsupported {
        what: format!("cache type_k={k}, type_v={v}"),
        detail: "expected equal types (f32, f16, bf16, q8_0, q4_0) or type_k=q8_0 with \
                 type_v=q4_0"
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_seed_is_random() {
        assert_eq!(seed(Some(DEFAULT_SEED)), None);
        assert_eq!(seed(Some(5)), Some(5));
        assert_eq!(seed(None), None);
    }

    #[test]
    fn n_batch_is_the_prompt_chunk_unless_a_runtime_is_given() {
        assert_eq!(runtime(64, None).max_input_len, 64);
        assert_eq!(
            runtime(64, None).max_dq_size,
            RuntimeSpec::default().max_dq_size
        );
        let given = RuntimeSpec {
            max_input_len: 7,
            ..RuntimeSpec::default()
        };
        assert_eq!(runtime(64, Some(given)), given);
    }

    #[test]
    fn cache_types_by_name_or_ggml_number() {
        // ggml's numbering: 0 f32, 1 f16, 2 q4_0, 8 q8_0, 30 bf16; 12 is q4_k.
        assert_eq!(cache_dtype(None, None).unwrap(), CacheDType::Fp16);
        let g = |n| Some(CacheType::Ggml(n));
        assert_eq!(cache_dtype(g(8), g(8)).unwrap(), CacheDType::Q8);
        assert_eq!(cache_dtype(g(8), g(2)).unwrap(), CacheDType::Q6);
        assert_eq!(cache_dtype(g(30), g(30)).unwrap(), CacheDType::Bf16);
        let named = cache_dtype(Some(CacheType::Name("q8_0".into())), g(8)).unwrap();
        assert_eq!(named, CacheDType::Q8);
        let e = cache_dtype(g(12), None).unwrap_err().to_string();
        assert!(e.starts_with("type_k=12 (q4_k) is not supported"), "{e}");
        let e = cache_dtype(None, g(9999)).unwrap_err().to_string();
        assert!(e.contains("type_v=9999 (not a ggml type)"), "{e}");
        let e = cache_dtype(g(1), g(8)).unwrap_err().to_string();
        assert!(
            e.starts_with("cache type_k=f16, type_v=q8_0 is not supported"),
            "{e}"
        );
    }
}
