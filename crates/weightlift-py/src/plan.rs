//! Python bindings for weightlift-plan: `plan()`, `fit()`, `devices()`, `parse_devices()`,
//! `CacheSpec`, `RuntimeSpec` and `Plan`.

mod result;
mod source;
mod specs;

use pyo3::prelude::*;
// The real machine is read through the engine's probe (MemAvailable, and the CUDA driver in a
// build with the `cuda` feature); the planner itself does no I/O.
use weightlift_engine::planned;
use weightlift_plan as wp;

use crate::errors::{eng, enter, py_err};
use crate::options::{CacheArg, DeviceMapValue, DevicesSpec, Overrides, RuntimeArg, Sizes};
pub use result::{Device, DeviceUsage, Placement, Plan};
pub use specs::{CacheSpec, RuntimeSpec};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(fit, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(parse_devices, m)?)?;
    m.add_class::<CacheSpec>()?;
    m.add_class::<RuntimeSpec>()?;
    m.add_class::<Device>()?;
    m.add_class::<DeviceUsage>()?;
    m.add_class::<Placement>()?;
    m.add_class::<Plan>()?;
    Ok(())
}

/// `offload=` with `blocks_per_group` and `prefetch`, as the planner reads them.
pub(crate) fn offload_arg(
    offload: Option<String>,
    blocks_per_group: u32,
    prefetch: bool,
) -> PyResult<Option<wp::WeightOffload>> {
    wp::WeightOffload::parse(offload.as_deref(), blocks_per_group, prefetch).map_err(py_err)
}

/// The devices of `spec`, or this machine's ([`planned::plan_devices`]).
fn parse_device_arg(spec: Option<&DevicesSpec>) -> PyResult<Vec<wp::DeviceSpec>> {
    planned::plan_devices(spec.map(|s| s.0.as_str())).map_err(py_err)
}

/// Plan where every tensor and every layer's KV cache goes, by arithmetic, before a byte is read.
///
/// `source` is a Checkpoint, a path (checkpoint, HF config.json, or a folder holding only a
/// config.json), an HF config dict, or a ModelSpec. Config-only sources need `weight_dtype`
/// (`"bfloat16"`, `"float16"`, `"q8_0"`, `"q4_k_m"`, ...) unless the config names its
/// `torch_dtype`. `devices` is a spec string (`"virtual:2x8GiB,cpu,disk"`) or a list of them;
/// None (the default) is this machine's devices, every CUDA GPU then `cpu`, as
/// `Model(devices=None)` takes them.
///
/// `strategy` is `autosplit` (exllamav2), `sequential`, `balanced`, `balanced_low_0`
/// (accelerate), `layers` (llama.cpp: `n_gpu_layers`, `split_mode`, `tensor_split`,
/// `main_gpu`), `tensor_parallel` (exllamav2 TPContext: `gpu_split` in GB) or `map`
/// (`device_map` prefixes and llama.cpp `-ot` style `overrides`). Left at None, a `device_map`
/// preset names its strategy (`"auto"` = `balanced`), a `device_map` dict or `overrides` imply
/// `map`, the llama.cpp options imply `layers`, `gpu_split` implies `tensor_parallel`, and
/// otherwise it is `autosplit`.
///
/// `n_cpu_moe=N` (llama.cpp's `--n-cpu-moe`) keeps the experts of a mixture-of-experts model's
/// first N layers in host RAM, computed there on the tokens routed to them, and places the rest
/// of each layer as the strategy says (`layers`, which it implies): the same as `-ot` overrides
/// of those layers' expert tensors to `cpu`, added after any `overrides` given.
///
/// The two ways to ask for a balanced split give the maps of two libraries:
/// `device_map="auto" | "balanced" | "balanced_low_0" | "sequential"` gives transformers 5's
/// `from_pretrained(device_map=...)` (each GPU but the last gets its share of the model plus
/// 1.25 × the larger of the largest decoder layer and the largest module, usually the
/// embedding; with no `max_memory` at all, 90% of the cpu), as `from_pretrained` does;
/// `strategy="balanced"` (or `"balanced_low_0"`, `"sequential"`) without a preset gives
/// accelerate's `infer_auto_device_map(get_balanced_memory(...))` (the share plus 1.25 × the
/// larger of the first decoder layer and the mean module).
///
/// `reserve`, `max_memory` and `overhead` take one size for every accelerator, a list in
/// accelerator order, or a dict keyed by device name or accelerator index; sizes are ints or
/// strings such as `"512MiB"`. `cache` is a `CacheSpec`, a `Cache` or a dict; `runtime` a
/// `RuntimeSpec` or a dict. `cache_offload=True` offloads `cache` to host RAM (as
/// `CacheSpec(..., offload=True)`): the cpu's kv column holds the whole cache and each device
/// that computes layers two prefetch slots of its largest layer. `quantize` (`"int8"`,
/// `"q8_0"`, `"q4_k"`, `"q6_k"`) sizes a float checkpoint's linears as a quantising load will
/// hold them: the blocks' linears in that type (a ggml type falls back as llama.cpp does when a
/// row is not whole blocks: Q4_K to Q5_0, Q6_K to Q8_0), the embedding and head kept in full
/// precision under int8 (as transformers) and promoted to Q6_K (q4_k, q6_k) or Q8_0 (q8_0)
/// otherwise, norms and biases as they are. `offload="sequential"` or `"group"`
/// (`blocks_per_group`, `prefetch`) plans accelerate's and diffusers' offloaded execution: the
/// layers kept on cpu or disk computed on the first accelerator, their onload slots charged to
/// its scratch (see `Model.load`). `world` (`"host:gpus[,host:gpus...]"`, torchrun's rank
/// order) plans a multi-process tensor-parallel run: rank `r` stands for the `r`-th
/// accelerator of `devices`, and `explain()` lists each rank's host and device. Raises
/// `OutOfMemoryError` (with `.shortfalls` and `.fixes`) when it does not fit,
/// `CudaUnavailable` for a `cuda:N` without a size where CUDA cannot be used (as `Model()`
/// does; `cuda:N:24GiB` plans without the GPU), and `PlanError` for an invalid request.
#[pyfunction]
#[pyo3(signature = (
    source, *, devices = None, strategy = None, dtype = "auto", cache = None, runtime = None,
    reserve = None, max_memory = None, n_gpu_layers = None, split_mode = None,
    tensor_split = None, main_gpu = None, device_map = None, allow_disk = false,
    weight_dtype = None, overhead = None, overrides = None, gpu_split = None, use_mmap = true,
    cache_offload = false, quantize = None, offload = None, blocks_per_group = 1, prefetch = true,
    world = None, n_cpu_moe = None
))]
#[allow(clippy::too_many_arguments)]
fn plan(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    devices: Option<DevicesSpec>,
    strategy: Option<String>,
    dtype: &str,
    cache: Option<CacheArg>,
    runtime: Option<RuntimeArg>,
    reserve: Option<Sizes>,
    max_memory: Option<Sizes>,
    n_gpu_layers: Option<i64>,
    split_mode: Option<String>,
    tensor_split: Option<Vec<f32>>,
    main_gpu: Option<usize>,
    device_map: Option<DeviceMapValue>,
    allow_disk: bool,
    weight_dtype: Option<String>,
    overhead: Option<Sizes>,
    overrides: Option<Overrides>,
    gpu_split: Option<Vec<f64>>,
    use_mmap: bool,
    cache_offload: bool,
    quantize: Option<String>,
    offload: Option<String>,
    blocks_per_group: u32,
    prefetch: bool,
    world: Option<String>,
    n_cpu_moe: Option<u32>,
) -> PyResult<Plan> {
    let options = wp::PlanOptions {
        strategy,
        dtype: Some(dtype.to_owned()),
        weight_dtype,
        cache: cache.map(|c| c.0),
        cache_offload,
        runtime: runtime.map(|r| r.0),
        reserve: reserve.map(|s| s.0),
        max_memory: max_memory.map(|s| s.0),
        overhead: overhead.map(|s| s.0),
        n_gpu_layers,
        n_cpu_moe,
        split_mode,
        tensor_split,
        main_gpu,
        device_map: device_map.map(|d| d.0),
        overrides: overrides.map(|o| o.0).unwrap_or_default(),
        gpu_split,
        allow_disk: Some(allow_disk),
        use_mmap: Some(use_mmap),
        quantize,
        offload: offload_arg(offload, blocks_per_group, prefetch)?,
        world,
        ..wp::PlanOptions::default()
    };
    let req =
        eng(source::resolve(py, source)?.request(options, parse_device_arg(devices.as_ref())?))?;
    let inner = enter(py, || wp::plan(&req))?;
    Ok(Plan { inner })
}

/// The largest `target` that fits: `"max_seq_len"` (multiples of 256 up to the model's context
/// length), `"batch_size"`, or `"n_gpu_layers"` (strategy `layers`); or `"n_cpu_moe"`, the
/// fewest layers of a mixture-of-experts model whose experts must stay in host RAM for the rest
/// to fit the accelerators. Same options as `plan()`;
/// `cache` (or just `cache_dtype`) gives the cache dtype and batch (fp16, batch 1 without one);
/// `cache_offload=True` offloads that cache to host RAM; `devices` left at None is this
/// machine's, as for `plan()`. Raises `OutOfMemoryError` when even the smallest value does not
/// fit.
#[pyfunction]
#[pyo3(signature = (
    source, *, devices = None, target = "max_seq_len", strategy = None, dtype = "auto",
    cache = None, cache_dtype = None, runtime = None, reserve = None, max_memory = None, n_gpu_layers = None,
    split_mode = None, tensor_split = None, main_gpu = None, device_map = None, allow_disk = false,
    weight_dtype = None, overhead = None, overrides = None, gpu_split = None, use_mmap = true,
    cache_offload = false, quantize = None, offload = None, blocks_per_group = 1, prefetch = true,
    n_cpu_moe = None
))]
#[allow(clippy::too_many_arguments)]
fn fit(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    devices: Option<DevicesSpec>,
    target: &str,
    strategy: Option<String>,
    dtype: &str,
    cache: Option<CacheArg>,
    cache_dtype: Option<&str>,
    runtime: Option<RuntimeArg>,
    reserve: Option<Sizes>,
    max_memory: Option<Sizes>,
    n_gpu_layers: Option<i64>,
    split_mode: Option<String>,
    tensor_split: Option<Vec<f32>>,
    main_gpu: Option<usize>,
    device_map: Option<DeviceMapValue>,
    allow_disk: bool,
    weight_dtype: Option<String>,
    overhead: Option<Sizes>,
    overrides: Option<Overrides>,
    gpu_split: Option<Vec<f64>>,
    use_mmap: bool,
    cache_offload: bool,
    quantize: Option<String>,
    offload: Option<String>,
    blocks_per_group: u32,
    prefetch: bool,
    n_cpu_moe: Option<u32>,
) -> PyResult<u64> {
    let target = wp::FitTarget::parse(target).map_err(py_err)?;
    let options = wp::PlanOptions {
        strategy,
        dtype: Some(dtype.to_owned()),
        weight_dtype,
        cache: cache.map(|c| c.0),
        cache_offload,
        runtime: runtime.map(|r| r.0),
        reserve: reserve.map(|s| s.0),
        max_memory: max_memory.map(|s| s.0),
        overhead: overhead.map(|s| s.0),
        n_gpu_layers,
        n_cpu_moe,
        split_mode,
        tensor_split,
        main_gpu,
        device_map: device_map.map(|d| d.0),
        overrides: overrides.map(|o| o.0).unwrap_or_default(),
        gpu_split,
        allow_disk: Some(allow_disk),
        use_mmap: Some(use_mmap),
        quantize,
        offload: offload_arg(offload, blocks_per_group, prefetch)?,
        ..wp::PlanOptions::default()
    };
    let options = options.for_fit(target, cache_dtype).map_err(py_err)?;
    let req =
        eng(source::resolve(py, source)?.request(options, parse_device_arg(devices.as_ref())?))?;
    enter(py, || wp::fit(&req, target))
}

/// The real machine's devices: `cpu` with MemAvailable, then any CUDA GPUs the engine can see,
/// then `disk`.
#[pyfunction]
fn devices(py: Python<'_>) -> PyResult<Vec<Device>> {
    let list = enter(py, planned::machine_devices)?;
    Ok(list.into_iter().map(Device::from).collect())
}

/// Parse a device spec string (`"cpu"`, `"cuda:0:24GiB"`, `"virtual:2x24GiB"`,
/// `"virtual:24GiB,virtual:12GiB,cpu:64GiB,disk"`) into normalised devices. `cpu` without a
/// size is the machine's MemAvailable.
#[pyfunction]
fn parse_devices(spec: DevicesSpec) -> PyResult<Vec<Device>> {
    Ok(parse_device_arg(Some(&spec))?
        .into_iter()
        .map(Device::from)
        .collect())
}
