//! The convenience loaders: accelerate's `from_pretrained` and llama-cpp-python's `load_gguf`.

use pyo3::prelude::*;
use weightlift_engine::LoadOptions;
use weightlift_engine::llama_cpp::{CacheType, LlamaLoad};
use weightlift_engine::session::{LoadCache, Settings};
use weightlift_format as wf;
use weightlift_plan as wp;

use crate::errors::{Exc, eng, raise};
use crate::model::Model;
use crate::options::{DeviceMapValue, DevicesSpec, RuntimeArg, Sizes};
use crate::plan::offload_arg;
use crate::progress::Reporter;

/// accelerate style: open `path`, plan with `device_map` (`"auto"` = balanced, `"balanced"`,
/// `"balanced_low_0"`, `"sequential"`, a device name, or a dict of module/layer prefix ->
/// device, with `"re:PATTERN"` keys as llama.cpp `-ot` overrides) and `max_memory` (one size,
/// a list in accelerator order, or a dict by device name or index), and load. Returns the
/// loaded Model. The presets place as transformers 5's `from_pretrained` does: `balanced` caps
/// each GPU but the last at its share of the model plus 1.25 × the larger of the largest
/// decoder layer and the largest module (usually the embedding), not accelerate's first layer
/// and mean module (`weightlift.plan(strategy="balanced")`); with no `max_memory`, 90% of the
/// cpu. Unlike transformers, each device's budget also pays for the KV cache and scratch the
/// engine allocates there, and the cpu for the upload staging buffers. `quantize="int8"` is
/// transformers' `BitsAndBytesConfig(load_in_8bit=True)` (also `"q8_0"`, `"q4_k"`, `"q6_k"`;
/// see `Model`). `offload="sequential"` (or `"group"` with `blocks_per_group` and
/// `prefetch`) computes the layers the map leaves on cpu or disk on the first accelerator, as
/// accelerate's dispatch hooks do (see `Model.load`); None computes each where it is.
// The text signatures are spelled out because PyO3 renders `-1` and non-literal defaults as
// `...`, which `inspect.signature` (and mypy.stubtest against _native.pyi) would report.
#[pyfunction]
#[pyo3(
    signature = (path, *, device_map = None, max_memory = None, dtype = "auto", devices = None,
                 runtime = None, progress = false, callback = None, compute = "fast",
                 n_threads = None, quantize = None, offload = None, blocks_per_group = 1,
                 prefetch = true),
    text_signature = "(path, *, device_map='auto', max_memory=None, dtype='auto', devices=None, runtime=None, progress=False, callback=None, compute='fast', n_threads=None, quantize=None, offload=None, blocks_per_group=1, prefetch=True)"
)]
#[allow(clippy::too_many_arguments)]
pub fn from_pretrained(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    device_map: Option<DeviceMapValue>,
    max_memory: Option<Sizes>,
    dtype: &str,
    devices: Option<DevicesSpec>,
    runtime: Option<RuntimeArg>,
    progress: bool,
    callback: Option<Py<PyAny>>,
    compute: &str,
    n_threads: Option<usize>,
    quantize: Option<&str>,
    offload: Option<String>,
    blocks_per_group: u32,
    prefetch: bool,
) -> PyResult<Model> {
    let offload = offload_arg(offload, blocks_per_group, prefetch)?;
    let model = Model::new(path, devices, dtype, runtime, compute, n_threads, quantize)?;
    let options = wp::PlanOptions {
        offload,
        ..wp::PlanOptions::from_pretrained(device_map.map(|d| d.0), max_memory.map(|m| m.0))
    };
    model.run_load(py, Reporter::new(callback, progress), |s, p| {
        s.load(None, options, LoadCache::None, &LoadOptions::default(), p)
    })?;
    Ok(model)
}

/// llama.cpp style: `n_gpu_layers` (-1 all; the last N layers go to the accelerators, the
/// output too when N > n_layer), `split_mode` (`none`, `layer`, `row`), `tensor_split`,
/// `main_gpu`; `use_mmap`, `use_direct_io`, `check_tensors`. `progress_callback(fraction)` is
/// called with the fraction loaded, as in llama.cpp, and returning False cancels
/// (`LoadCancelled`). `vocab_only` opens the metadata and tokenizer only and loads no tensors.
/// `use_mlock` locks the memory-mapped tensors in RAM (a locked-memory limit that refuses is
/// reported in `Model.warnings`). As llama-cpp-python's `Llama`, the file may be given as
/// `model_path=`, and `verbose` is accepted (nothing is printed); `chat_format` names one of
/// llama-cpp-python's built-in chat formats (`"chatml"`, `"llama-2"`, `"llama-3"`,
/// `"mistral-instruct"`, `"gemma"`, `"zephyr"`, ...) used in place of the model's own chat
/// template, whose stop string then ends chat replies; None keeps the model's template.
/// `spm_infill` puts the suffix first in fill-in-the-middle prompts (`suffix=`).
#[pyfunction]
#[pyo3(signature = (path = None, *, n_gpu_layers = 0, split_mode = "layer", tensor_split = None, main_gpu = 0,
                    use_mmap = true, use_direct_io = false, use_mlock = false, check_tensors = false,
                    vocab_only = false, progress_callback = None, devices = None, runtime = None,
                    n_ctx = 512, n_batch = 512, type_k = None, type_v = None, n_threads = None,
                    compute = "fast", seed = None, callback = None, progress = false,
                    offload = None, blocks_per_group = 1, prefetch = true, model_path = None,
                    verbose = true, chat_format = None, spm_infill = false),
       text_signature = "(path=None, *, n_gpu_layers=0, split_mode='layer', tensor_split=None, main_gpu=0, use_mmap=True, use_direct_io=False, use_mlock=False, check_tensors=False, vocab_only=False, progress_callback=None, devices=None, runtime=None, n_ctx=512, n_batch=512, type_k='f16', type_v='f16', n_threads=None, compute='fast', seed=None, callback=None, progress=False, offload=None, blocks_per_group=1, prefetch=True, model_path=None, verbose=True, chat_format=None, spm_infill=False)")]
#[allow(clippy::too_many_arguments)]
pub fn load_gguf(
    py: Python<'_>,
    path: Option<&Bound<'_, PyAny>>,
    n_gpu_layers: i64,
    split_mode: &str,
    tensor_split: Option<Vec<f32>>,
    main_gpu: usize,
    use_mmap: bool,
    use_direct_io: bool,
    use_mlock: bool,
    check_tensors: bool,
    vocab_only: bool,
    progress_callback: Option<Py<PyAny>>,
    devices: Option<DevicesSpec>,
    runtime: Option<RuntimeArg>,
    n_ctx: u64,
    n_batch: u64,
    type_k: Option<&Bound<'_, PyAny>>,
    type_v: Option<&Bound<'_, PyAny>>,
    n_threads: Option<usize>,
    compute: &str,
    seed: Option<u64>,
    callback: Option<Py<PyAny>>,
    progress: bool,
    offload: Option<String>,
    blocks_per_group: u32,
    prefetch: bool,
    model_path: Option<&Bound<'_, PyAny>>,
    verbose: bool,
    chat_format: Option<&str>,
    spm_infill: bool,
) -> PyResult<Model> {
    let _ = verbose;
    let path = match (path, model_path) {
        (Some(p), None) | (None, Some(p)) => p,
        (Some(_), Some(_)) => {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "load_gguf: got both path and model_path; pass the GGUF once",
            ));
        }
        (None, None) => {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "load_gguf: missing the GGUF to load (path, or model_path=)",
            ));
        }
    };
    let offload = offload_arg(offload, blocks_per_group, prefetch)?;
    let open = wf::OpenOptions {
        check_tensors: false,
        vocab_only,
    };
    let given_runtime = runtime.map(|r| r.0);
    let ckpt = Model::open_source(path, open)?;
    let settings = eng(Settings::parse(
        "auto",
        compute,
        None,
        given_runtime,
        n_threads,
    ))?;
    let model = Model::with_checkpoint(ckpt, devices, settings)?;
    eng(model.lock()?.set_llama(seed, spm_infill, chat_format))?;
    if vocab_only {
        // the metadata and tokenizer only: no tensors to load
        return Ok(model);
    }
    let args = LlamaLoad {
        n_gpu_layers,
        split_mode: split_mode.to_owned(),
        tensor_split,
        main_gpu,
        n_ctx,
        n_batch,
        type_k: cache_type(type_k, "type_k")?,
        type_v: cache_type(type_v, "type_v")?,
        read: LoadOptions {
            use_mmap,
            use_direct_io,
            check_tensors,
            mlock: use_mlock,
            ..LoadOptions::default()
        },
        offload,
    };
    let mut reporter = Reporter::new(callback, progress);
    if let Some(f) = progress_callback {
        if reporter.has_callback() {
            return Err(raise(
                Exc::Plan,
                "load_gguf: got both callback and progress_callback; pass one (callback takes \
                 (bytes_done, bytes_total, tensor, device), progress_callback a fraction)",
            ));
        }
        reporter = Reporter::new(Some(f), false);
        reporter.fraction = true;
    }
    model.run_load(py, reporter, |s, p| s.load_llama(args, given_runtime, p))?;
    Ok(model)
}

/// `type_k` / `type_v`: a cache type name, or the ggml type number llama-cpp-python passes.
fn cache_type(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<CacheType>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    if let Ok(name) = obj.extract::<String>() {
        return Ok(Some(CacheType::Name(name)));
    }
    obj.extract()
        .map(|id| Some(CacheType::Ggml(id)))
        .map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "{what}: expected a cache type name ('f16', 'q8_0', ...) or a ggml type number"
            ))
        })
}
