//! Placement planning as a pure function: (spec, tensor sizes, devices, cache, runtime) -> Plan.
//!
//! No I/O and no unsafe code: every part of weightlift can ask "what if" without touching a
//! file or a device. The planner answers arithmetically, before a byte is read:
//!
//! - [`plan`] places every tensor and every layer's KV cache under one of the strategies of
//!   exllamav2 (`autosplit`, `tensor_parallel`), accelerate (`sequential`, `balanced`,
//!   `balanced_low_0`), llama.cpp (`layers`: `n_gpu_layers`, `split_mode`, `tensor_split`) or an
//!   explicit device map with llama.cpp `-ot` style overrides;
//! - [`fit`] finds the largest context, batch or `n_gpu_layers` that fits;
//! - a plan that does not fit is a [`PlanError::OutOfMemory`] naming each short device and the
//!   cheapest fixes, each checked by re-planning.
//!
//! # Differences from the systems the strategies are named after
//!
//! - **autosplit** (exllamav2 `load_autosplit`): exllamav2 finds the split by loading and
//!   catching CUDA OOMs, holding a 256 MiB safety allocation while it does; we compute it. Like
//!   exllamav2 the embedding stays on the CPU, each layer's KV is allocated beside the layer, a
//!   tied head is loaded as its own copy, and devices fill in order and are never revisited.
//!   Unlike it, each device's compute scratch is our own forward pass's workspace
//!   ([`Workspace`], defined in `workspace.rs`) for what the device computes, sized by the
//!   [`RuntimeSpec`], not exllamav2's module scratch; and we spill to an explicitly listed
//!   `cpu`, then to `disk` when allowed, instead of failing.
//!   exllamav2's default `reserve_vram` (192 MiB on GPU 0, 64 MiB on others) is not applied
//!   implicitly: pass reserves explicitly.
//! - **sequential / balanced / balanced_low_0** (accelerate `infer_auto_device_map` after
//!   `get_balanced_memory`): the same greedy fill over `embed_tokens`, the decoder blocks (never
//!   split), `norm` and `lm_head`, with the first GPU and the CPU keeping room for the largest
//!   remaining block, tied `lm_head` kept with `embed_tokens`, spill to cpu then disk. Unlike
//!   accelerate we add each block's KV cache to the block's size and the device scratch to the
//!   device's cost, and charge the host the upload staging buffers; with no cache, a
//!   zero-scratch runtime and no staging the maps are accelerate's. A `device_map` preset
//!   sizes the balanced caps as transformers 5's `from_pretrained` does instead
//!   ([`BudgetRule`]: the largest decoder block and largest module rather than the first block
//!   and the mean module, and 90% of the cpu when no `max_memory` is given); both are checked
//!   against the libraries' own maps (tests/data/device_map_goldens).
//! - **layers** (llama.cpp): the last `n_gpu_layers` repeating layers go to the GPUs, the output
//!   layer too when `n_gpu_layers > n_layer`, the input layer (token_embd) always stays on the
//!   CPU, and layers are spread by llama.cpp's cumulative `tensor_split` with `upper_bound`.
//!   This is llama.cpp's rule, reproduced as is. `split_mode="row"` keeps every offloaded
//!   layer's norms and KV on `main_gpu` and splits each 2-D matrix's rows at
//!   `rows × cumulative tensor_split`, rounded down to `row_rounding` rows (ggml-cuda rounds to
//!   an architecture-dependent tile height; we default to 64). A row-split tensor lives on
//!   every device that holds a slice ([`Plan::device_of`] names them all). A tied output is
//!   loaded as a copy of `token_embd` on the output device, as llama.cpp's `TENSOR_DUPLICATED`
//!   does.
//! - **tensor_parallel** (exllamav2 `TPContext.define_split`): the five split tables exactly;
//!   a mixture-of-experts model, which exllamav2 does not split, gets an expert table in place
//!   of the ID table (whole experts per device, by the same budgets; see [`TpSplit::ex`]);
//!   each device's scratch is the full single-device workspace, although it computes only its
//!   slice of the heads and of the MLP, which over-estimates.
//!
//! - **low_mem** ([`RuntimeSpec::low_mem`]): caps `max_input_len` at 1024 and
//!   `max_attention_size` at 1024², as exllamav2's `set_low_mem()` sets them: from the defaults
//!   the input length is halved and the attention size QUARTERED, not halved. We take the
//!   minimum with the user's values (exllamav2 overwrites them), so it never adds scratch. In
//!   the workspace it caps the tokens per chunk at `1024 × batch`, and with them every
//!   per-token region, and each head's attention tile at 1024² weights.
//! - **fixed overhead** ([`overhead`]): every `cuda:N` that holds anything is charged its CUDA
//!   context and kernel modules (measured on the GPU, or a default for its compute
//!   capability), the cuBLAS workspace and graph memory, part by part. exllamav2 and accelerate
//!   count none of these (exllamav2's `reserve_vram` stands in for them); `overhead=` replaces
//!   them with one figure.
//! - **disk**: a layer left on disk is streamed and computed by the host (the engine runs it on
//!   the cpu), so its KV cache and compute scratch are charged to the cpu, never to `disk`;
//!   once a fill reaches the cpu with disk allowed, the cpu keeps room for the KV and compute
//!   of every later layer. accelerate computes disk-offloaded modules on its main device and
//!   ignores the cache; we charge the host because that is where weightlift runs them. The
//!   strategies that pin parts to the host (exllamav2's embedding, llama.cpp's input and
//!   non-offloaded layers) stream the fewest of them from disk when the host is too small,
//!   the embedding first (a lookup reads only a few rows), then the last layers.
//!
//! - **architectures without a role table** (anything but llama, mistral, qwen2, qwen3,
//!   phi3, gemma2, gemma3): planned with a warning that the engine cannot run them; the embedding and the
//!   head are recognised by name, and a head with no tensor of its own is tied to the
//!   embedding.
//! - **sliding-window layers** ([`SlidingWindow`], of any architecture) keep llama.cpp's SWA
//!   cache, `pad256(window + chunk)` cells ([`SlidingWindow::cells`], the chunk being
//!   [`swa_ubatch`]); the engine allocates those cells and keeps such a layer's cache as a ring
//!   over them.
//!
//! - **offloaded cache** ([`CacheSpec::offload`], transformers' `OffloadedCache`): every
//!   layer's K and V live in host RAM and are charged to `cpu` (its kv column holds the whole
//!   cache), and every device that computes layers holds [`OFFLOAD_SLOTS`] prefetch slots (the
//!   layer in use and the next one being copied in), each the size of the largest layer it
//!   computes, or one slot when it computes a single layer: `min(n, 2) × largest` in its kv
//!   column. The cpu keeps its slots too when it computes layers (the engine computes from a
//!   slot there as well). This is exactly what the engine's offloaded cache allocates. The fill
//!   strategies count the whole cache against the cpu before placing anything there and each
//!   device's slots as its layers arrive; a cpu that cannot hold the cache is an
//!   [`PlanError::OutOfMemory`] naming the cpu and the offloaded kv, with the checked fixes (a
//!   cheaper cache dtype, a shorter context, the cache beside the layers). Under tensor
//!   parallelism the slots are per layer slice; exllamav2's split budgets then lose only the
//!   slots, not the whole cache.
//!
//! Host RAM: staging buffers (two of `staging_bytes`, bounded by the largest tensor, charged to
//! the host whenever the inventory has an accelerator) and CPU-resident copies are anonymous
//! memory; mmap-backed CPU tensors cost page cache and are
//! reported apart ([`HostUsage`]), but still count against an explicit `cpu` capacity, since a
//! CPU layer whose pages are evicted thrashes.

mod device;
mod error;
pub mod keywords;
mod memory;
pub mod onload;
mod options;
pub mod overhead;
mod place;
mod plan;
pub mod quantize;
mod request;
mod size;
mod svg;
mod synth;
mod tp;
mod window;
mod workspace;

pub use device::{
    DeviceItem, DeviceKind, DeviceSpec, MemoryProbe, NoProbe, canonical_device_name,
    cuda_unavailable_fix, inventory, parse_device_items, parse_devices, parse_devices_with,
    resolve_device,
};
pub use error::{OutOfMemory, PlanError, Result, Shortfall};
pub use keywords::{DevicesArg, FromKeyword, Keywords};
pub use memory::{CacheDType, CacheSpec, OFFLOAD_SLOTS, RuntimeSpec};
pub use onload::{OnloadPlan, WeightOffload};
pub use options::{DeviceMapArg, ExpectCache, ModelSource, PerDevice, PlanOptions};
pub use overhead::{Capability, CudaOverhead, Overhead, OverheadPart};
pub use place::balanced_max_memory;
pub use plan::{DeviceUsage, HostUsage, Plan, Shard, TensorPlacement, TensorSplit};
pub use quantize::Quantize;
pub use request::{
    BudgetRule, DeviceMap, FitTarget, LayerOptions, PlanRequest, SplitMode, Strategy, TpOptions,
};
pub use size::{fmt_bytes, parse_size};
pub use synth::{
    DTypeChoice, QuantPreset, WeightType, converted, gguf_type, gguf_type_of, longrope_tensors,
    synthesize_tensors,
};
pub use tp::{
    MAX_TP_RANKS, SplitTable, TpInputs, TpKind, TpRank, TpShare, TpSplit, TpWorkspace, TpWorld,
    define_split, integer_split, to_table, tp_staging_bytes,
};
pub use window::{SWA_PAD, SlidingWindow, ubatch as swa_ubatch};
pub use workspace::{
    ALIGN, ATTENTION_SPLIT_KEYS, ATTENTION_SPLITS, DQ_CHUNK_VALUES, Dims, Hosts, KV_TILE,
    LOGIT_ROWS, Region, Workspace, cuda_product_tiles, has_dense_layers,
};

use place::{Ctx, Tweak};
use weightlift_format::Role;

/// Plan a model onto devices. On failure to fit, the error is [`PlanError::OutOfMemory`] with
/// every short device and the fixes that were checked to work.
pub fn plan(req: &PlanRequest) -> Result<Plan> {
    match plan_with(req, Tweak::default()) {
        Err(PlanError::OutOfMemory(mut oom)) => {
            oom.fixes = suggest_fixes(req, &oom);
            Err(PlanError::OutOfMemory(oom))
        }
        other => other,
    }
}

fn plan_with(req: &PlanRequest, tweak: Tweak) -> Result<Plan> {
    Ctx::new(req, tweak)?.run()
}

fn fits(req: &PlanRequest, tweak: Tweak) -> Result<bool> {
    match plan_with(req, tweak) {
        Ok(_) => Ok(true),
        Err(PlanError::OutOfMemory(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Cache length granularity of [`fit`]: exllamav2 allocates its cache in pages of 256 tokens.
pub const SEQ_STEP: u64 = 256;

/// The cache [`fit`] sizes when the request has none: one step of fp16 at batch 1.
pub(crate) const FIT_CACHE: CacheSpec = CacheSpec::new(SEQ_STEP, 1, CacheDType::Fp16);

/// The largest value of `target` for which [`plan`] succeeds, by monotone binary search over
/// the exact model (host RAM included, since the cpu is one of the devices):
///
/// - `MaxSeqLen`: multiples of 256 up to the model's `context_length` (returned itself when it
///   fits); the request's cache dtype and batch are kept (fp16, batch 1 without a cache);
/// - `BatchSize`: 1, 2, 3, ... at the request's cache length (256 tokens without a cache);
/// - `NGpuLayers`: 0..=n_layer+1 for the `layers` strategy, scanned from the top since host
///   RAM can make the answer non-monotone.
///
/// When even the smallest value does not fit, the error is that value's OutOfMemory.
pub fn fit(req: &PlanRequest, target: FitTarget) -> Result<u64> {
    match fit_inner(req, target) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(tweak)) => plan(&with_tweak(req, tweak)).map(|_| 0),
        Err(e) => Err(e),
    }
}

/// `Ok(Ok(best))`, or `Ok(Err(tweak))` for the smallest failing setting.
fn fit_inner(req: &PlanRequest, target: FitTarget) -> Result<std::result::Result<u64, Tweak>> {
    let base_cache = req.cache.unwrap_or(FIT_CACHE);
    let with_cache = |c: CacheSpec| Tweak {
        cache: Some(Some(c)),
        ..Tweak::default()
    };
    match target {
        FitTarget::MaxSeqLen => {
            let top = if req.spec.context_length > 0 {
                req.spec.context_length
            } else {
                1 << 20
            };
            let at = |s: u64| {
                with_cache(CacheSpec {
                    max_seq_len: s,
                    ..base_cache
                })
            };
            if fits(req, at(top))? {
                return Ok(Ok(top));
            }
            let steps = top / SEQ_STEP;
            if steps == 0 || !fits(req, at(SEQ_STEP))? {
                return Ok(Err(at(SEQ_STEP.min(top))));
            }
            // Invariant: lo fits, hi does not (hi may be steps + 1 meaning `top`).
            let (mut lo, mut hi) = (1u64, steps + 1);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if fits(req, at(mid * SEQ_STEP))? {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            Ok(Ok(lo * SEQ_STEP))
        }
        FitTarget::BatchSize => {
            let at = |b: u64| {
                with_cache(CacheSpec {
                    batch_size: b,
                    ..base_cache
                })
            };
            if !fits(req, at(1))? {
                return Ok(Err(at(1)));
            }
            let mut lo = 1u64;
            let mut hi = 2u64;
            while fits(req, at(hi))? {
                lo = hi;
                if hi >= 1 << 24 {
                    return Ok(Ok(hi));
                }
                hi *= 2;
            }
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if fits(req, at(mid))? {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            Ok(Ok(lo))
        }
        FitTarget::NGpuLayers => {
            if !matches!(req.strategy, Strategy::Layers(_)) {
                return Err(PlanError::option(
                    "fit target n_gpu_layers",
                    "the layers strategy (llama.cpp)",
                    format!("strategy {}", req.strategy.name()),
                ));
            }
            let n = i64::from(req.spec.n_layers);
            for ngl in (0..=n + 1).rev() {
                let t = Tweak {
                    n_gpu_layers: Some(ngl),
                    ..Tweak::default()
                };
                if fits(req, t)? {
                    return Ok(Ok(ngl as u64));
                }
            }
            Ok(Err(Tweak {
                n_gpu_layers: Some(0),
                ..Tweak::default()
            }))
        }
        FitTarget::NCpuMoe => {
            if !matches!(req.strategy, Strategy::Layers(_)) {
                return Err(PlanError::option(
                    "fit target n_cpu_moe",
                    "the layers strategy (llama.cpp)",
                    format!("strategy {}", req.strategy.name()),
                ));
            }
            if !req
                .tensors
                .iter()
                .any(|t| t.role.is_some_and(Role::is_expert))
            {
                return Err(PlanError::option(
                    "fit target n_cpu_moe",
                    "a mixture-of-experts model (expert tensors such as ffn_up_exps)",
                    format!("'{}' with no expert tensors", req.spec.architecture),
                ));
            }
            // more layers' experts on the host never needs more accelerator memory; scanned
            // from the bottom as host RAM can run out first
            let n = req.spec.n_layers;
            let at = |k: u32| Tweak {
                n_cpu_moe: Some(k),
                ..Tweak::default()
            };
            for k in 0..=n {
                if fits(req, at(k))? {
                    return Ok(Ok(u64::from(k)));
                }
            }
            Ok(Err(at(n)))
        }
    }
}

/// A request with a tweak applied (used only on the error path, so the clone is fine).
fn with_tweak(req: &PlanRequest, t: Tweak) -> PlanRequest {
    let mut r = req.clone();
    if let Some(c) = t.cache {
        r.cache = c;
    }
    if let Some(d) = t.allow_disk {
        r.allow_disk = d;
    }
    if let (Some(n), Strategy::Layers(o)) = (t.n_gpu_layers, &mut r.strategy) {
        o.n_gpu_layers = n;
    }
    if let (Some(n), Strategy::Layers(o)) = (t.n_cpu_moe, &mut r.strategy) {
        o.overrides.extend(PlanOptions::moe_overrides(n));
    }
    if let Some(rt) = t.runtime {
        r.runtime = rt;
    }
    r
}

/// Cheapest fixes first, each verified by re-planning.
fn suggest_fixes(req: &PlanRequest, oom: &OutOfMemory) -> Vec<String> {
    let mut fixes = Vec::new();
    let missing: u64 = oom
        .shortfalls
        .iter()
        .map(Shortfall::missing)
        .max()
        .unwrap_or(0);
    // 0. The host. Unlisted, it holds only the input embedding, which every strategy keeps
    // there; listing it lets the rest spill to host RAM.
    if !req.devices.iter().any(|d| d.kind == DeviceKind::Cpu) {
        let mut with_cpu = req.clone();
        with_cpu
            .devices
            .push(DeviceSpec::new("cpu", DeviceKind::Cpu, u64::MAX));
        if let Ok(p) = plan_with(&with_cpu, Tweak::default()) {
            let spilled = p
                .devices()
                .iter()
                .find(|d| d.name == "cpu")
                .map_or(0, DeviceUsage::used);
            fixes.push(format!(
                "add cpu to devices (e.g. \"...,cpu\"): fits with {} in host RAM",
                fmt_bytes(spilled)
            ));
        }
    }
    // 1. A cheaper cache.
    if let Some(c) = req.cache {
        let bytes = |c: &CacheSpec| window::total_cache_bytes(req, c, &req.runtime);
        let cur = bytes(&c);
        let mut cheaper: Vec<(u64, CacheDType)> = CacheDType::ALL
            .iter()
            .map(|&d| (bytes(&CacheSpec { dtype: d, ..c }), d))
            .filter(|&(b, _)| b < cur)
            .collect();
        cheaper.sort_by_key(|x| std::cmp::Reverse(x.0));
        let mut found = false;
        for &(b, d) in &cheaper {
            let t = Tweak {
                cache: Some(Some(CacheSpec { dtype: d, ..c })),
                ..Tweak::default()
            };
            if fits(req, t).unwrap_or(false) {
                fixes.push(format!(
                    "cache {} saves {} and fits",
                    d.name(),
                    fmt_bytes(cur - b)
                ));
                found = true;
                break;
            }
        }
        if !found && let Some(&(b, d)) = cheaper.last() {
            fixes.push(format!(
                "cache {} saves {} (not enough alone)",
                d.name(),
                fmt_bytes(cur - b)
            ));
        }
        // An offloaded cache that the host cannot hold may fit beside the layers.
        if c.offload {
            let t = Tweak {
                cache: Some(Some(c.with_offload(false))),
                ..Tweak::default()
            };
            if fits(req, t).unwrap_or(false) {
                fixes.push(format!(
                    "the cache beside the layers instead of offloaded (offload=False) fits and frees {} of host ram",
                    fmt_bytes(cur)
                ));
            }
        }
        // 2. A shorter context.
        if let Ok(Ok(ctx)) = fit_inner(req, FitTarget::MaxSeqLen)
            && ctx < c.max_seq_len
        {
            fixes.push(format!("ctx {ctx} fits"));
        }
        // 3. A smaller batch.
        if c.batch_size > 1
            && let Ok(Ok(b)) = fit_inner(req, FitTarget::BatchSize)
            && b < c.batch_size
        {
            fixes.push(format!("batch {b} fits"));
        }
    }
    // 4. Fewer offloaded layers (llama.cpp).
    if let Strategy::Layers(o) = &req.strategy
        && let Ok(Ok(n)) = fit_inner(req, FitTarget::NGpuLayers)
    {
        // llama.cpp counts the output layer as layer n_layer: all is n_layer + 1
        let n_layer = u64::from(req.spec.n_layers);
        let cur = if o.n_gpu_layers < 0 || o.n_gpu_layers as u64 > n_layer {
            format!(
                "{} (all {n_layer} repeating layers and the output layer)",
                o.n_gpu_layers
            )
        } else {
            o.n_gpu_layers.to_string()
        };
        let which = if n == n_layer {
            " (every repeating layer; the output layer on the host)".to_string()
        } else {
            String::new()
        };
        fixes.push(format!("n_gpu_layers {n}{which} fits (asked {cur})"));
    }
    // 5. Smaller reserves.
    let total_reserve: u64 = req
        .devices
        .iter()
        .map(|d| req.reserve.get(&d.name).copied().unwrap_or(d.reserve))
        .fold(0u64, u64::saturating_add);
    if total_reserve > 0 && missing > 0 {
        let cut = missing.div_ceil(1 << 20) << 20;
        let t = Tweak {
            reserve_cut: cut,
            ..Tweak::default()
        };
        if fits(req, t).unwrap_or(false) {
            fixes.push(format!(
                "reserve {} less on each device fits",
                fmt_bytes(cut)
            ));
        } else if fits(
            req,
            Tweak {
                reserve_cut: u64::MAX,
                ..Tweak::default()
            },
        )
        .unwrap_or(false)
        {
            fixes.push(format!(
                "dropping the reserves ({} in all) fits",
                fmt_bytes(total_reserve)
            ));
        }
    }
    // 6. Less compute scratch (the forward pass's workspace, `workspace.rs`): low_mem (which
    // caps max_input_len and max_attention_size as exllamav2's set_low_mem does), then shorter
    // input chunks.
    let rt = req.runtime;
    // What a fix saves is measured on the plan it gives: each device's scratch for what it
    // computes there, before and after.
    let saving = |to: RuntimeSpec| {
        let per_device = place::scratch_saving(req, rt, to);
        let total = per_device
            .iter()
            .fold(0u64, |a, (_, b)| a.saturating_add(*b));
        let each: Vec<String> = per_device
            .iter()
            .map(|(d, b)| format!("{} on {d}", fmt_bytes(*b)))
            .collect();
        format!("{} of scratch ({})", fmt_bytes(total), each.join(", "))
    };
    let runtime_fits = |r: RuntimeSpec| {
        fits(
            req,
            Tweak {
                runtime: Some(r),
                ..Tweak::default()
            },
        )
        .unwrap_or(false)
    };
    if rt.max_input_len > 0 {
        let low = RuntimeSpec {
            low_mem: true,
            ..rt
        };
        if !rt.low_mem && runtime_fits(low) {
            fixes.push(format!(
                "low_mem=True (exllamav2's set_low_mem: max_input_len {} and max_attention_size \
                 {}) fits and saves {}",
                low.effective().0,
                low.effective().1,
                saving(low)
            ));
        } else {
            // Halving max_input_len down to 16 tokens: the first that fits.
            let mut n = rt.max_input_len / 2;
            while n >= 16 {
                let r = RuntimeSpec {
                    max_input_len: n,
                    ..rt
                };
                if runtime_fits(r) {
                    fixes.push(format!("max_input_len {n} fits and saves {}", saving(r)));
                    break;
                }
                n /= 2;
            }
        }
    }
    // 7. Disk offload.
    let disk_listed = req.devices.iter().any(|d| d.kind == DeviceKind::Disk);
    if !req.allow_disk && !disk_listed {
        let t = Tweak {
            allow_disk: Some(true),
            ..Tweak::default()
        };
        if let Ok(p) = plan_with(req, t) {
            let on_disk = p.host().disk_weights;
            fixes.push(if on_disk > 0 || p.head_device() != "disk" {
                format!(
                    "add --allow-disk (allow_disk=True) fits with {} streamed from disk",
                    fmt_bytes(on_disk)
                )
            } else {
                // Only a tied head, which has no tensor of its own, went "to disk": the host
                // computes it from the embedding it holds.
                "add --allow-disk (allow_disk=True) fits: the host computes the output layer \
                 from the tied embedding, and no weights are streamed"
                    .to_string()
            });
        }
    }
    // 8. Last resort: the memory the short devices would need, checked by re-planning with
    // each short device grown to its need (rounded up to a MiB; max_memory caps lifted).
    if fixes.is_empty() && !oom.shortfalls.is_empty() {
        let mut r = req.clone();
        let mut asks = Vec::new();
        for s in &oom.shortfalls {
            let need = s.needed.div_ceil(1 << 20) << 20;
            if let Some(d) = r.devices.iter_mut().find(|d| d.name == s.device) {
                d.capacity = d.capacity.max(need);
                r.max_memory.remove(&s.device);
                asks.push(format!("{} with {}", s.device, fmt_bytes(need)));
            }
        }
        if !asks.is_empty() && plan_with(&r, Tweak::default()).is_ok() {
            fixes.push(format!("{} fits", asks.join(" and ")));
        }
    }
    fixes
}
