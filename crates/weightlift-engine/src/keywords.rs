//! The loads' own keywords, read by the planner's keyword grammar ([`Keywords`]) beside the
//! placement keywords it reads itself: how a load reads (`use_mmap`, ...), a model's settings
//! (`dtype`, `compute`, ...), llama-cpp-python's `Llama(...)` (`n_ctx`, `type_k`, ...) and
//! `embed`'s `pooling`; which of them each load call reads ([`LoadCall`]); and `plan()` and
//! `fit()` of a [`PlanSource`] by their keywords. A keyword not given takes the default of the
//! Python signature that declares it.

use std::sync::Arc;

use serde_json::Value;
use weightlift_plan::keywords::type_error;
use weightlift_plan::{FromKeyword, Keywords, Plan, PlanError, PlanOptions, PlanRequest};

use crate::cache::Cache;
use crate::embeddings::{POOLING_UNSPECIFIED, Pooling};
use crate::error::{Result, invalid};
use crate::llama_cpp::{CacheType, LlamaLoad, Seed};
use crate::loader::{LoadOptions, Progress};
use crate::model::Model;
use crate::planned::{PlanSource, plan_devices};
use crate::session::{LoadCache, Session, Settings};

impl FromKeyword for CacheType {
    /// A cache type name, or the ggml type number llama-cpp-python passes.
    fn from_keyword(v: &Value, key: &str) -> weightlift_plan::Result<Self> {
        match v {
            Value::String(name) => Ok(CacheType::Name(name.clone())),
            Value::Number(n) if n.is_u64() || n.is_i64() => {
                u32::from_keyword(v, key).map(CacheType::Ggml)
            }
            _ => Err(type_error(
                key,
                "a cache type name ('f16', 'q8_0', ...) or a ggml type number",
                v,
            )),
        }
    }
}

impl LoadOptions {
    /// `use_mmap`, `use_direct_io`, `check_tensors`, `staging_bytes` and `use_mlock`.
    pub fn from_keywords(kw: &Keywords) -> Result<LoadOptions> {
        let d = LoadOptions::default();
        Ok(LoadOptions {
            use_mmap: kw.get("use_mmap")?.unwrap_or(d.use_mmap),
            use_direct_io: kw.get("use_direct_io")?.unwrap_or(d.use_direct_io),
            check_tensors: kw.get("check_tensors")?.unwrap_or(d.check_tensors),
            staging_bytes: kw.get("staging_bytes")?.unwrap_or(d.staging_bytes),
            mlock: kw.get("use_mlock")?.unwrap_or(d.mlock),
        })
    }
}

impl Settings {
    /// `Model(dtype="auto", compute="fast", quantize=None, runtime=None, n_threads=None)`.
    pub fn from_keywords(kw: &Keywords) -> Result<Settings> {
        let name = |key: &str, default: &str| -> std::result::Result<String, PlanError> {
            Ok(kw.get(key)?.unwrap_or_else(|| default.to_owned()))
        };
        // llama.cpp takes a count of 0 or less as its default; 0 and -1 are the physical cores
        let n_threads = match kw.get::<i64>("n_threads")? {
            Some(-1) => Some(0),
            Some(n) => Some(usize::try_from(n).map_err(|_| {
                crate::error::invalid(
                    "n_threads",
                    "an int of at least 1, or 0 or -1 for the physical cores",
                    n,
                )
            })?),
            None => None,
        };
        Settings::parse(
            &name("dtype", "auto")?,
            &name("compute", "fast")?,
            kw.get::<String>("quantize")?.as_deref(),
            kw.get("runtime")?,
            n_threads,
        )
    }
}

impl LlamaLoad {
    /// `Llama(...)`'s load keywords, with llama-cpp-python's defaults.
    pub fn from_keywords(kw: &Keywords) -> Result<LlamaLoad> {
        let d = LlamaLoad::default();
        Ok(LlamaLoad {
            n_gpu_layers: kw.get("n_gpu_layers")?.unwrap_or(d.n_gpu_layers),
            split_mode: kw.get("split_mode")?.unwrap_or(d.split_mode),
            tensor_split: kw.get("tensor_split")?,
            main_gpu: kw.get("main_gpu")?.unwrap_or(d.main_gpu),
            n_ctx: kw.get("n_ctx")?.unwrap_or(d.n_ctx),
            n_batch: kw.get("n_batch")?.unwrap_or(d.n_batch),
            type_k: kw.get("type_k")?,
            type_v: kw.get("type_v")?,
            read: LoadOptions::from_keywords(kw)?,
            offload: kw.offload()?,
        })
    }
}

/// The load calls of a model, each reading its own keywords: `Model.load` (`"load"`),
/// exllamav2's `load_autosplit` (`"autosplit"`) and `load_tp` (`"tp"`), transformers'
/// `from_pretrained` (`"pretrained"`) and llama-cpp-python's `Llama(...)` (`"llama"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadCall {
    Load,
    Autosplit,
    TensorParallel,
    Pretrained,
    Llama,
}

impl LoadCall {
    /// The call of a name above.
    pub fn parse(name: &str) -> Result<LoadCall> {
        Ok(match name {
            "load" => LoadCall::Load,
            "autosplit" => LoadCall::Autosplit,
            "tp" => LoadCall::TensorParallel,
            "pretrained" => LoadCall::Pretrained,
            "llama" => LoadCall::Llama,
            _ => {
                return Err(invalid(
                    "load call",
                    "load, autosplit, tp, pretrained or llama",
                    name,
                ));
            }
        })
    }
}

/// `load_autosplit`'s `cache`, which only a `Cache` the caller made can be: the caller hands
/// that over itself, and any value of the keyword is refused by what it is.
struct CacheObject;

impl FromKeyword for CacheObject {
    fn from_keyword(v: &Value, key: &str) -> weightlift_plan::Result<Self> {
        Err(type_error(key, "a Cache made for this model", v))
    }
}

impl Session {
    /// `Llama(seed=None, spm_infill=False, chat_format=None)`, as [`Session::set_llama`].
    pub fn set_llama_keywords(&mut self, kw: &Keywords) -> Result<()> {
        let chat_format = kw.get::<String>("chat_format")?;
        let spm_infill = kw.get("spm_infill")?.unwrap_or_default();
        self.set_llama(kw.get::<Seed>("seed")?, spm_infill, chat_format.as_deref())
    }

    /// Load as `call` does with its keywords `kw`, and `cache`, a cache the caller made
    /// (`load` and `load_autosplit`; `load` also takes only its shape, as the `cache`
    /// keyword). `load_gguf`'s `vocab_only` takes its settings and loads nothing.
    pub fn load_keywords(
        &mut self,
        call: LoadCall,
        kw: &Keywords,
        cache: Option<Arc<Cache>>,
        progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    ) -> Result<()> {
        let given = cache.map_or(LoadCache::None, LoadCache::Given);
        let read = LoadOptions::default();
        match call {
            LoadCall::Load => {
                let cache = match given {
                    LoadCache::None => kw.get("cache")?.map_or(LoadCache::None, LoadCache::Shape),
                    given => given,
                };
                let (plan, options) = (kw.get("plan")?, kw.load_plan_options()?);
                self.load(
                    plan,
                    options,
                    cache,
                    &LoadOptions::from_keywords(kw)?,
                    progress,
                )
            }
            LoadCall::Autosplit => {
                if matches!(given, LoadCache::None) {
                    kw.get::<CacheObject>("cache")?;
                }
                self.load(None, kw.autosplit_options()?, given, &read, progress)
            }
            LoadCall::TensorParallel => {
                let options = kw.tensor_parallel_options()?;
                self.load(None, options, LoadCache::None, &read, progress)
            }
            LoadCall::Pretrained => {
                let options = kw.pretrained_options()?;
                self.load(None, options, LoadCache::None, &read, progress)
            }
            LoadCall::Llama => {
                self.set_llama_keywords(kw)?;
                if kw.get("vocab_only")? == Some(true) {
                    return Ok(());
                }
                let args = LlamaLoad::from_keywords(kw)?;
                self.load_llama(args, kw.get("runtime")?, progress)
            }
        }
    }
}

/// `embed`'s `pooling`: llama.cpp's number ([`POOLING_UNSPECIFIED`], -1, is the model's own)
/// or a name ([`Pooling::parse`]).
#[derive(Debug)]
enum PoolingArg {
    Llama(i64),
    Name(String),
}

impl FromKeyword for PoolingArg {
    fn from_keyword(v: &Value, key: &str) -> weightlift_plan::Result<Self> {
        match v {
            Value::String(name) => Ok(PoolingArg::Name(name.clone())),
            Value::Number(n) if n.is_i64() || n.is_u64() => {
                i64::from_keyword(v, key).map(PoolingArg::Llama)
            }
            _ => Err(type_error(
                key,
                "llama.cpp's pooling number or a name ('none', 'mean', 'cls', 'last')",
                v,
            )),
        }
    }
}

impl Model {
    /// `embed(ids, pooling=None, normalize=False)`: [`Model::embed`] by the pooling `pooling`
    /// names (the model's own when none), and that pooling.
    pub fn embed_keywords(
        &mut self,
        ids: &[u32],
        kw: &Keywords,
    ) -> Result<(Pooling, Vec<Vec<f32>>)> {
        let pooling = match kw.get("pooling")? {
            None => self.pooling_for(POOLING_UNSPECIFIED)?,
            Some(PoolingArg::Llama(n)) => self.pooling_for(
                i32::try_from(n).map_err(|_| invalid("pooling", "a llama.cpp pooling type", n))?,
            )?,
            Some(PoolingArg::Name(name)) => Pooling::parse(&name)?,
        };
        let normalize = kw.get("normalize")?.unwrap_or_default();
        Ok((pooling, self.embed(ids, pooling, normalize)?))
    }
}

impl PlanSource {
    /// `plan(source, **kw)`: the plan of this source with `plan()`'s keywords, on the devices
    /// `devices` names (this machine's when none, [`plan_devices`]).
    pub fn plan_keywords(self, kw: &Keywords) -> Result<Plan> {
        let req = self.keyword_request(kw, kw.plan_options()?)?;
        Ok(weightlift_plan::plan(&req)?)
    }

    /// `fit(source, **kw)`: the largest `target` that fits, with `fit()`'s keywords.
    pub fn fit_keywords(self, kw: &Keywords) -> Result<u64> {
        let (target, options) = kw.fit_options()?;
        Ok(weightlift_plan::fit(
            &self.keyword_request(kw, options)?,
            target,
        )?)
    }

    fn keyword_request(self, kw: &Keywords, options: PlanOptions) -> Result<PlanRequest> {
        let devices = plan_devices(kw.devices()?.as_deref())?;
        self.request(options, devices)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::forward::Compute;

    fn kw(v: Value) -> Keywords {
        Keywords::from_json(v).unwrap()
    }

    #[test]
    fn keywords_not_given_keep_the_signatures_defaults() {
        let empty = kw(json!({}));
        let read = LoadOptions::from_keywords(&empty).unwrap();
        assert!(read.use_mmap && !read.use_direct_io && !read.mlock);
        assert_eq!(read.staging_bytes, LoadOptions::default().staging_bytes);
        let llama = LlamaLoad::from_keywords(&empty).unwrap();
        assert_eq!(
            (llama.n_ctx, llama.n_batch, llama.n_gpu_layers),
            (512, 512, 0)
        );
        let s = Settings::from_keywords(&empty).unwrap();
        assert_eq!((s.compute, s.n_threads), (Compute::Fast, None));
    }

    #[test]
    fn load_keywords_are_read_by_name() {
        let k = kw(json!({
            "use_mmap": false, "use_mlock": true, "staging_bytes": 1 << 20,
            "n_ctx": 64, "type_k": "q8_0", "type_v": 8, "offload": "group",
            "blocks_per_group": 2, "compute": "exact", "runtime": {"max_input_len": 16},
        }));
        let llama = LlamaLoad::from_keywords(&k).unwrap();
        assert!(!llama.read.use_mmap && llama.read.mlock);
        assert_eq!(llama.read.staging_bytes, 1 << 20);
        assert_eq!(llama.n_ctx, 64);
        assert_eq!(llama.type_k, Some(CacheType::Name("q8_0".into())));
        assert_eq!(llama.type_v, Some(CacheType::Ggml(8)));
        assert!(llama.offload.is_some());
        let s = Settings::from_keywords(&k).unwrap();
        assert_eq!((s.compute, s.runtime.max_input_len), (Compute::Exact, 16));
    }

    #[test]
    fn pooling_is_a_llama_cpp_number_or_a_name() {
        let read = |v: Value| kw(json!({ "pooling": v })).get::<PoolingArg>("pooling");
        assert!(matches!(read(json!(-1)), Ok(Some(PoolingArg::Llama(-1)))));
        assert!(matches!(read(json!("mean")), Ok(Some(PoolingArg::Name(n))) if n == "mean"));
        let e = read(json!(2.5)).unwrap_err().to_string();
        assert!(
            e.starts_with("pooling: expected llama.cpp's pooling number"),
            "{e}"
        );
        assert!(e.ends_with("got float"), "{e}");
    }

    #[test]
    fn a_wrong_kind_is_named_by_its_keyword() {
        let e = LlamaLoad::from_keywords(&kw(json!({"type_k": 1.5}))).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with("type_k: expected a cache type name"),
            "{msg}"
        );
        assert!(msg.ends_with("got float"), "{msg}");
        let e = LoadOptions::from_keywords(&kw(json!({"use_mmap": "yes"}))).unwrap_err();
        assert_eq!(e.to_string(), "use_mmap: expected True or False, got str");
        let e = Settings::from_keywords(&kw(json!({"compute": "fastest"}))).unwrap_err();
        assert!(e.to_string().starts_with("compute: expected"), "{e}");
    }
}
