//! The loads' own keywords, read by the planner's keyword grammar ([`Keywords`]) beside the
//! placement keywords it reads itself: how a load reads (`use_mmap`, ...), a model's settings
//! (`dtype`, `compute`, ...) and llama-cpp-python's `Llama(...)` (`n_ctx`, `type_k`, ...). A
//! keyword not given takes the default of the Python signature that declares it.

use serde_json::Value;
use weightlift_plan::keywords::type_error;
use weightlift_plan::{FromKeyword, Keywords, PlanError};

use crate::error::Result;
use crate::llama_cpp::{CacheType, LlamaLoad};
use crate::loader::LoadOptions;
use crate::session::{Session, Settings};

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
        Settings::parse(
            &name("dtype", "auto")?,
            &name("compute", "fast")?,
            kw.get::<String>("quantize")?.as_deref(),
            kw.get("runtime")?,
            kw.get("n_threads")?,
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

impl Session {
    /// `Llama(seed=None, spm_infill=False, chat_format=None)`, as [`Session::set_llama`].
    pub fn set_llama_keywords(&mut self, kw: &Keywords) -> Result<()> {
        let chat_format = kw.get::<String>("chat_format")?;
        let spm_infill = kw.get("spm_infill")?.unwrap_or_default();
        self.set_llama(kw.get("seed")?, spm_infill, chat_format.as_deref())
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
