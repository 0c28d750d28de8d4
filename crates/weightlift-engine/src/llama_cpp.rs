//! llama.cpp's and llama-cpp-python's argument conventions: the KV cache's `type_k` / `type_v`
//! (names, or ggml type numbers), the seed that means "random", `n_batch`, and a load as
//! `Llama(...)` does it ([`LlamaLoad`]: a cache of `n_ctx` made first, the layers placed by
//! `n_gpu_layers` and its kin through [`PlanOptions::llama`]).

use std::sync::Arc;

use serde_json::Value;
use weightlift_format::DType;
use weightlift_plan::keywords::{FromKeyword, type_error};
use weightlift_plan::{CacheSpec, PlanError, PlanOptions, RuntimeSpec, WeightOffload};

use crate::cache::CacheDType;
use crate::error::{EngineError, Result};
use crate::loader::{LoadOptions, Progress};
use crate::session::{LoadCache, Session};

/// llama.cpp's `LLAMA_DEFAULT_SEED`: a seed of 0xFFFFFFFF asks for a random one.
pub const DEFAULT_SEED: u64 = 0xFFFF_FFFF;

/// A seed as a caller gives it: an int from 0 to 2^64 - 1, or -1 for a random one (llama.cpp's
/// `--seed -1`; llama-cpp-python documents "-1 for random" and hands -1 on to llama.cpp as
/// [`DEFAULT_SEED`]). Read alike as a load keyword and as a generation keyword.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seed {
    Random,
    Fixed(u64),
}

/// What a seed may be, in the words of its errors.
const SEED_RANGE: &str = "an int from 0 to 18446744073709551615, or -1 for a random seed";

impl Seed {
    /// The seed of an int, None when it is out of range.
    fn of(n: i128) -> Option<Seed> {
        match n {
            -1 => Some(Seed::Random),
            _ => u64::try_from(n).ok().map(Seed::Fixed),
        }
    }

    /// The seed of an int given as `key`, refused by name when out of range.
    pub fn read(n: i128, key: &str) -> Result<Seed> {
        Seed::of(n).ok_or_else(|| crate::error::invalid(key, SEED_RANGE, n))
    }

    /// The sampler's seed: None draws one at random.
    pub fn value(self) -> Option<u64> {
        match self {
            Seed::Random => None,
            Seed::Fixed(s) => Some(s),
        }
    }
}

impl FromKeyword for Seed {
    fn from_keyword(v: &Value, key: &str) -> weightlift_plan::Result<Self> {
        let Value::Number(n) = v else {
            return Err(type_error(key, SEED_RANGE, v));
        };
        let int = n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
        int.and_then(Seed::of)
            .ok_or_else(|| PlanError::option(key, SEED_RANGE, n))
    }
}

/// A seed as llama-cpp-python's `Llama(seed=...)` takes it: [`DEFAULT_SEED`] and -1 ask for a
/// random one, as no seed does.
pub fn seed(seed: Option<Seed>) -> Option<u64> {
    seed.and_then(Seed::value).filter(|&s| s != DEFAULT_SEED)
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

/// What `Llama(...)` says about a load, with llama-cpp-python's defaults.
#[derive(Debug, Clone)]
pub struct LlamaLoad {
    /// Layers on the accelerators, the last ones (-1: all); see [`PlanOptions::llama`].
    pub n_gpu_layers: i64,
    /// `"none"`, `"layer"` or `"row"`.
    pub split_mode: String,
    pub tensor_split: Option<Vec<f32>>,
    pub main_gpu: usize,
    /// Positions of the model's cache.
    pub n_ctx: u64,
    /// The longest prompt chunk of one forward call ([`runtime`]).
    pub n_batch: u64,
    pub type_k: Option<CacheType>,
    pub type_v: Option<CacheType>,
    /// `use_mmap`, `use_direct_io`, `use_mlock` (as `mlock`) and `check_tensors`.
    pub read: LoadOptions,
    /// accelerate's offloaded execution of the layers left on the cpu, which llama.cpp lacks.
    pub offload: Option<WeightOffload>,
}

impl Default for LlamaLoad {
    fn default() -> Self {
        LlamaLoad {
            n_gpu_layers: 0,
            split_mode: "layer".into(),
            tensor_split: None,
            main_gpu: 0,
            n_ctx: 512,
            n_batch: 512,
            type_k: None,
            type_v: None,
            read: LoadOptions::default(),
            offload: None,
        }
    }
}

impl Session {
    /// llama-cpp-python's settings of a model beside its load: `seed` ([`DEFAULT_SEED`] is a
    /// random one), `spm_infill` and `chat_format` (a built-in format in place of the
    /// checkpoint's template; see [`crate::Model::set_chat_format`]).
    pub fn set_llama(
        &mut self,
        seed_arg: Option<Seed>,
        spm_infill: bool,
        chat_format: Option<&str>,
    ) -> Result<()> {
        self.seed = seed(seed_arg);
        self.spm_infill = spm_infill;
        self.model.set_chat_format(chat_format)
    }

    /// Load as `Llama(...)` does: the cache of `n_ctx` positions in the dtype of `type_k` and
    /// `type_v` is made first and loaded beside the layers, `n_batch` sets the prompt chunk
    /// unless the model was given its own runtime (`given_runtime`), and the layers go where
    /// llama.cpp's placement options put them.
    pub fn load_llama(
        &mut self,
        args: LlamaLoad,
        given_runtime: Option<RuntimeSpec>,
        progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    ) -> Result<()> {
        let dtype = cache_dtype(args.type_k, args.type_v)?;
        if args.n_batch == 0 && given_runtime.is_none() {
            // refused here rather than by the first prompt, which would find no chunk to run
            return Err(crate::error::invalid(
                "n_batch",
                "at least 1 (the longest prompt chunk of one forward call; 512 by default)",
                0,
            ));
        }
        self.defaults.runtime = runtime(args.n_batch, given_runtime);
        self.model.set_runtime(self.defaults.runtime);
        // llama.cpp's n_ctx 0: the context the model was trained with (512 where the
        // architecture could not be read)
        let n_ctx = match args.n_ctx {
            0 => self.model.source().spec().map_or(512, |s| s.context_length),
            n => n,
        };
        let cache = self.model.cache_for(&CacheSpec::new(n_ctx, 1, dtype))?;
        let has_accelerator = !self.model.inventory().accelerators().is_empty();
        let options = PlanOptions {
            offload: args.offload,
            ..PlanOptions::llama(
                args.n_gpu_layers,
                &args.split_mode,
                args.tensor_split,
                args.main_gpu,
                has_accelerator,
            )
        };
        let cache = LoadCache::Given(Arc::new(cache));
        self.load(None, options, cache, &args.read, progress)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_seed_and_minus_one_are_random() {
        assert_eq!(seed(Some(Seed::Fixed(DEFAULT_SEED))), None);
        assert_eq!(seed(Some(Seed::Random)), None);
        assert_eq!(seed(Some(Seed::Fixed(5))), Some(5));
        assert_eq!(seed(None), None);
    }

    #[test]
    fn a_seed_is_an_unsigned_64_bit_int_or_minus_one() {
        let key = |v: Value| Seed::from_keyword(&v, "seed").map_err(|e| e.to_string());
        for (v, want) in [(-1, Seed::Random), (0, Seed::Fixed(0))] {
            assert_eq!(key(v.into()), Ok(want));
            assert_eq!(Seed::read(v.into(), "seed").unwrap(), want);
        }
        assert_eq!(key(u64::MAX.into()), Ok(Seed::Fixed(u64::MAX)));
        for bad in [-2, i64::MIN] {
            let e = key(bad.into()).unwrap_err();
            assert!(
                e.contains("seed") && e.contains("or -1 for a random seed"),
                "{e}"
            );
            assert!(e.contains(&bad.to_string()), "{e}");
        }
        for bad in [
            serde_json::json!(1.5),
            serde_json::json!("7"),
            serde_json::json!(true),
        ] {
            assert!(key(bad).unwrap_err().contains("or -1 for a random seed"));
        }
        let big = i128::from(u64::MAX) + 1;
        let e = Seed::read(big, "seed").unwrap_err().to_string();
        assert!(e.contains("seed") && e.contains(&big.to_string()), "{e}");
        assert!(Seed::read(-2, "seed").is_err());
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
