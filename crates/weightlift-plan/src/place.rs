//! The strategies. Each turns a prepared context into an assignment (device per tensor, per
//! layer, per KV slice); `finish` turns an assignment into a Plan or an out-of-memory report.
//!
//! This module holds what every strategy shares: the request's [`Tweak`]s, the devices with
//! their budgets ([`Dev`]), the units the fills move (embedding, each layer, norm, output), the
//! prepared context [`Ctx`] and the [`Assign`]ment a strategy answers with, and [`Ctx::run`],
//! which picks the strategy. The rest is one module per concern:
//!
//! - `prepare`: [`Ctx::new`], which validates the request and builds devices, units, KV sizes
//!   and the scratch model;
//! - `fill`: the greedy fill of exllamav2's `autosplit` and accelerate's `sequential`, one
//!   algorithm in two modes;
//! - `balanced`: accelerate's `get_balanced_memory` caps for `balanced` and `balanced_low_0`
//!   (then filled by `fill`);
//! - `layers`: llama.cpp's `n_gpu_layers` / `tensor_split`, with row split;
//! - `tensor_parallel`: exllamav2's TP split tables;
//! - `map`: an explicit device map with `-ot` style overrides;
//! - `finish`: per-device usage, the budget check, and the Plan.

mod balanced;
mod fill;
mod finish;
mod layers;
mod map;
mod prepare;
mod tensor_parallel;

use weightlift_format::{DType, Role, TensorInfo};

use crate::device::DeviceKind;
use crate::error::{OutOfMemory, PlanError, Result, Shortfall};
use crate::memory::{CacheSpec, RuntimeSpec, ScratchModel};
use crate::overhead::Overhead;
use crate::plan::Plan;
use crate::request::{PlanRequest, Strategy};
use crate::tp::TpSplit;
use crate::workspace::Hosts;

pub use balanced::balanced_max_memory;

/// Scratch that `to` saves over `from`, per device, on the placement `req` gets under `to`
/// (the one that fits): `(device, bytes)` for every device that saves anything. Empty when
/// `req` does not plan under `to`.
pub(crate) fn scratch_saving(
    req: &PlanRequest,
    from: RuntimeSpec,
    to: RuntimeSpec,
) -> Vec<(String, u64)> {
    let tweak = Tweak {
        runtime: Some(to),
        ..Tweak::default()
    };
    let Ok(ctx) = Ctx::new(req, tweak) else {
        return Vec::new();
    };
    let Ok(Ok(a)) = ctx.assign() else {
        return Vec::new();
    };
    let (seq, batch) = ctx.cache.map_or((from.max_input_len.max(1), 1), |c| {
        (c.max_seq_len, c.batch_size)
    });
    let before = ScratchModel::new(&req.spec, &req.tensors, req.moe.as_ref(), &from, seq, batch);
    ctx.computed_hosts(&a)
        .into_iter()
        .zip(&ctx.devs)
        .filter(|(_, d)| d.kind != DeviceKind::Disk)
        .map(|(h, d)| {
            let saved = before
                .charged(h, d.kind)
                .saturating_sub(ctx.scratch.charged(h, d.kind));
            (d.name.clone(), saved)
        })
        .filter(|&(_, b)| b > 0)
        .collect()
}
use fill::{FillMode, Overflow};

/// Variations of a request tried by `fit()` and the out-of-memory fix search, applied without
/// cloning the tensor table.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tweak {
    pub cache: Option<Option<CacheSpec>>,
    pub allow_disk: Option<bool>,
    /// Bytes taken off every device's reserve.
    pub reserve_cut: u64,
    pub n_gpu_layers: Option<i64>,
    /// llama.cpp `n_cpu_moe`, as `-ot` rules after the strategy's own.
    pub n_cpu_moe: Option<u32>,
    pub runtime: Option<RuntimeSpec>,
}

#[derive(Debug, Clone)]
pub(crate) struct Dev {
    pub name: String,
    pub kind: DeviceKind,
    pub limit: u64,
    pub reserve: u64,
    pub overhead: Overhead,
    pub implicit: bool,
    /// Bytes the fill strategies leave free for what offloaded execution adds afterwards
    /// (see [`Ctx::run`]).
    pub held_back: u64,
}

impl Dev {
    /// Bytes left for weights, kv and scratch.
    fn room(&self) -> u64 {
        match self.free_memory() {
            u64::MAX => u64::MAX,
            free => free.saturating_sub(self.overhead.total()),
        }
    }

    /// The device's free memory as llama.cpp weighs its default `tensor_split` by it: the
    /// capacity less reserve (and what offloaded execution holds back), not our fixed
    /// overhead. llama.cpp reads free memory with its own context already made, and a
    /// context costs about the same on every GPU of a split, so the proportions are the same.
    fn free_memory(&self) -> u64 {
        if self.limit == u64::MAX {
            return u64::MAX;
        }
        self.limit
            .saturating_sub(self.reserve)
            .saturating_sub(self.held_back)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnitKind {
    Embed,
    Layer(u32),
    Norm,
    Output,
}

#[derive(Debug, Clone)]
struct Unit {
    kind: UnitKind,
    tensors: Vec<usize>,
    weights: u64,
    kv: u64,
}

impl Unit {
    fn hosts(&self) -> Hosts {
        match self.kind {
            UnitKind::Embed => Hosts {
                embed: true,
                ..Hosts::default()
            },
            UnitKind::Layer(_) => Hosts {
                layers: true,
                ..Hosts::default()
            },
            UnitKind::Norm => Hosts::default(),
            UnitKind::Output => Hosts {
                head: true,
                ..Hosts::default()
            },
        }
    }
}

/// Offload: the layers one device computes, for its prefetch slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slots {
    /// Layers (or TP layer slices) computed on the device.
    layers: u64,
    /// Bytes of the largest of their caches.
    largest: u64,
}

impl Slots {
    fn with(self, kv: u64) -> Slots {
        Slots {
            layers: self.layers.saturating_add(1),
            largest: self.largest.max(kv),
        }
    }

    fn merge(self, o: Slots) -> Slots {
        Slots {
            layers: self.layers.saturating_add(o.layers),
            largest: self.largest.max(o.largest),
        }
    }

    fn bytes(self) -> u64 {
        if self.layers == 0 {
            0
        } else {
            CacheSpec::offload_slots_bytes(self.layers, self.largest)
        }
    }
}

fn union(a: Hosts, b: Hosts) -> Hosts {
    Hosts {
        layers: a.layers || b.layers,
        head: a.head || b.head,
        embed: a.embed || b.embed,
    }
}

pub(crate) struct Ctx<'a> {
    req: &'a PlanRequest,
    tweak: Tweak,
    pub devs: Vec<Dev>,
    host: usize,
    accel: Vec<usize>,
    disk: Option<usize>,
    bytes: Vec<u64>,
    dtypes: Vec<DType>,
    units: Vec<Unit>,
    scratch: ScratchModel,
    cache: Option<CacheSpec>,
    /// The cache is offloaded: every layer's KV on the host, prefetch slots on the devices
    /// that compute layers.
    offload: bool,
    /// Offload: bytes of the whole cache, all on the host.
    offload_total: u64,
    /// Bytes of `token_embd` when the output is tied to it and there is no output tensor.
    tied_bytes: u64,
    embd_tensor: Option<usize>,
    /// Each tensor's role: the checkpoint's, or for the embedding, output norm and head of an
    /// architecture without a role table, the one its name says.
    roles: Vec<Option<Role>>,
    /// The runtime after the tweak.
    runtime: RuntimeSpec,
    /// The sliding window the caches are cut to, if any.
    window: Option<&'a crate::window::SlidingWindow>,
    /// Upper bound of the host staging buffers: 2 × min(staging size, largest tensor).
    staging_bound: u64,
    warnings: Vec<String>,
}

/// `(device, start, end, bytes)` of one shard.
type ShardIdx = (usize, u64, u64, u64);
/// `(axis, replicated, shards)` of a split tensor.
type SplitIdx = (u8, bool, Vec<ShardIdx>);

/// A strategy's answer.
#[derive(Debug, Clone)]
struct Assign {
    tensor_dev: Vec<usize>,
    splits: Vec<Option<SplitIdx>>,
    layer_dev: Vec<usize>,
    kv_dev: Vec<Vec<(usize, u64)>>,
    embed_dev: usize,
    head_dev: usize,
    /// `(device, bytes)` of the tied output copy.
    tied_copy: Vec<(usize, u64)>,
    hosts: Vec<Hosts>,
    tp: Option<TpSplit>,
    /// Devices that hold a share of every layer (tensor parallelism).
    shared_layers: Vec<usize>,
    /// Per-device compute scratch when the strategy lays it out itself (tensor parallelism:
    /// [`crate::TpWorkspace`] and the host staging buffers), instead of [`crate::Workspace`].
    scratch: Option<Vec<u64>>,
}

impl Ctx<'_> {
    /// Offload: the slots of a device that computes every layer (the most any device holds).
    fn offload_slots_estimate(&self) -> u64 {
        let all = self
            .units
            .iter()
            .filter(|u| matches!(u.kind, UnitKind::Layer(_)))
            .fold(Slots::default(), |s, u| s.with(u.kv));
        all.bytes()
    }

    /// KV bytes a unit costs on the device that holds it: its cache, or 0 when the cache is
    /// offloaded (the host holds it; the device's prefetch slots are counted apart).
    fn dev_kv(&self, u: &Unit) -> u64 {
        if self.offload { 0 } else { u.kv }
    }

    /// The device that computes what `d` holds: the host for `disk`, else `d` itself.
    fn exec_dev(&self, d: usize) -> usize {
        if Some(d) == self.disk { self.host } else { d }
    }

    fn tensors(&self) -> &[TensorInfo] {
        &self.req.tensors
    }

    fn n_layers(&self) -> usize {
        self.req.spec.n_layers as usize
    }

    fn empty_assign(&self) -> Assign {
        Assign {
            tensor_dev: vec![self.host; self.bytes.len()],
            splits: vec![None; self.bytes.len()],
            layer_dev: vec![self.host; self.n_layers()],
            kv_dev: vec![Vec::new(); self.n_layers()],
            embed_dev: self.host,
            head_dev: self.host,
            tied_copy: Vec::new(),
            hosts: vec![Hosts::default(); self.devs.len()],
            tp: None,
            shared_layers: Vec::new(),
            scratch: None,
        }
    }

    /// Record `unit` on `dev`.
    fn put(&self, a: &mut Assign, unit: &Unit, dev: usize) {
        for &t in &unit.tensors {
            a.tensor_dev[t] = dev;
        }
        match unit.kind {
            UnitKind::Embed => a.embed_dev = dev,
            UnitKind::Layer(l) => {
                a.layer_dev[l as usize] = dev;
                if unit.kv > 0 {
                    a.kv_dev[l as usize] = vec![(dev, unit.kv)];
                }
            }
            UnitKind::Norm => {}
            UnitKind::Output => a.head_dev = dev,
        }
        a.hosts[dev] = union(a.hosts[dev], unit.hosts());
    }

    /// The tied head's own copy of the embedding, on the head's device, when the head is
    /// computed elsewhere than the embedding (the host computes what stays on disk, so the
    /// two count as one place).
    fn tie_head(&self, a: &mut Assign) {
        a.tied_copy =
            if self.tied_bytes > 0 && self.exec_dev(a.head_dev) != self.exec_dev(a.embed_dev) {
                vec![(a.head_dev, self.tied_bytes)]
            } else {
                Vec::new()
            };
    }

    /// With a disk to spill to, moves the fewest units of `order` (units on the host, in the
    /// order they should leave) to disk for the host to fit, or all of them when even that is
    /// not enough, so that a report shows what the host cannot hold on its own. A unit left on
    /// disk is still computed by the host (its kv and scratch stay there), so the host's
    /// charge only falls as units leave, and the fewest is found by bisection.
    fn spill_host_to_disk(&self, a: &mut Assign, order: &[usize]) {
        let Some(disk) = self.disk else {
            return;
        };
        let host = &self.devs[self.host].name;
        let host_fits = |a: &Assign| match self.finish(a) {
            Err(PlanError::OutOfMemory(o)) => !o.shortfalls.iter().any(|s| &s.device == host),
            _ => true,
        };
        if order.is_empty() || host_fits(a) {
            return;
        }
        let moved = |k: usize| {
            let mut b = a.clone();
            for &u in &order[..k] {
                self.put(&mut b, &self.units[u], disk);
            }
            self.tie_head(&mut b);
            b
        };
        // Invariant: `lo` units moved do not fit; `hi` fit, or are all of them.
        let (mut lo, mut hi) = (0, order.len());
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if host_fits(&moved(mid)) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        *a = moved(hi);
    }

    /// What each device computes for assignment `a`: the host also computes what stays on disk.
    fn computed_hosts(&self, a: &Assign) -> Vec<Hosts> {
        let mut hosts = a.hosts.clone();
        if let Some(d) = self.disk {
            hosts[self.host] = union(hosts[self.host], hosts[d]);
            hosts[d] = Hosts::default();
        }
        hosts
    }

    /// The strategy's assignment, or the fill's overflow.
    fn assign(&self) -> Result<std::result::Result<Assign, Box<Overflow>>> {
        Ok(match &self.req.strategy {
            Strategy::Autosplit => self.fill(FillMode::Exl, &[]),
            Strategy::Sequential => self.fill(FillMode::Accelerate, &[]),
            Strategy::Balanced => {
                let caps = self.balanced_caps(false);
                self.fill(FillMode::Accelerate, &caps)
            }
            Strategy::BalancedLow0 => {
                let caps = self.balanced_caps(true);
                self.fill(FillMode::Accelerate, &caps)
            }
            Strategy::Layers(o) => Ok(self.layers(o)?),
            Strategy::TensorParallel(o) => Ok(self.tensor_parallel(o)?),
            Strategy::Map(m) => Ok(self.map(m)?),
        })
    }

    /// The plan. Under `offload=`, the layers a fill strategy leaves on the host execute on
    /// the first accelerator, which then also holds their KV and the onload slots; the fill
    /// packs layers without knowing how many will be left, so when that device comes up short
    /// the fill runs again with the shortfall held back there, until the plan fits or the
    /// device holds no layer to give up.
    pub fn run(mut self) -> Result<Plan> {
        let refills = matches!(
            self.req.strategy,
            Strategy::Autosplit
                | Strategy::Sequential
                | Strategy::Balanced
                | Strategy::BalancedLow0
        );
        let exec = match (self.req.offload, self.accel.first()) {
            (Some(_), Some(&exec)) if refills => exec,
            _ => return self.run_once(),
        };
        // Each retry holds back at least the smallest layer, so the fill moves a layer off
        // every time or the device runs out of layers to give up.
        let step = self
            .units
            .iter()
            .filter(|u| matches!(u.kind, UnitKind::Layer(_)))
            .map(|u| u.weights)
            .min()
            .unwrap_or(0)
            .max(1);
        loop {
            let held_back = self.devs[exec].held_back;
            let out = self.run_once();
            let Err(PlanError::OutOfMemory(oom)) = &out else {
                return out;
            };
            let short = oom
                .shortfalls
                .iter()
                .find(|s| s.device == self.devs[exec].name)
                .map_or(0, |s| s.needed.saturating_sub(s.available));
            if short == 0 || held_back >= self.devs[exec].room().saturating_add(held_back) {
                return out;
            }
            self.devs[exec].held_back = held_back.saturating_add(short.max(step));
        }
    }

    fn run_once(&self) -> Result<Plan> {
        let strategy = &self.req.strategy;
        let assign = self.assign()?;
        match assign {
            Ok(a) => self.finish(&a),
            Err(of) => {
                let Overflow { assign, note } = *of;
                // Fill strategies that ran out: report the devices as they would be if the
                // rest went where the fill stopped.
                let plan_err = self.finish(&assign);
                match plan_err {
                    Err(e) => Err(e),
                    Ok(p) => {
                        // Nothing is over its raw capacity: the fill stopped on a rule
                        // (accelerate's largest-layer headroom on main devices).
                        let d = &self.devs[assign.head_dev];
                        let usage = p.devices.iter().find(|u| u.name == d.name);
                        let needed = usage.map_or(0, |u| u.used()).saturating_add(note.1);
                        let staging = if assign.head_dev == self.host {
                            p.host().staging
                        } else {
                            0
                        };
                        let held = usage.map_or_else(
                            || "nothing placed yet".to_string(),
                            |u| self.what(u, staging),
                        );
                        Err(PlanError::OutOfMemory(Box::new(OutOfMemory {
                            strategy: strategy.name().to_string(),
                            shortfalls: vec![Shortfall {
                                device: d.name.clone(),
                                needed,
                                available: d.limit,
                                what: format!("{held}; {}", note.0),
                            }],
                            fixes: Vec::new(),
                        })))
                    }
                }
            }
        }
    }
}
