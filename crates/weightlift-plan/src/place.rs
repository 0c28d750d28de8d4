//! The strategies. Each turns a prepared context into an assignment (device per tensor, per
//! layer, per KV slice); `finish` turns an assignment into a Plan or an out-of-memory report.

use std::collections::BTreeMap;

use regex::Regex;
use weightlift_format::{DType, Role, TensorInfo};

use crate::device::{DeviceKind, resolve_device};
use crate::error::{OutOfMemory, PlanError, Result, Shortfall};
use crate::memory::{CacheSpec, RuntimeSpec, ScratchModel};
use crate::plan::{DeviceUsage, HostUsage, Plan, Shard, TensorPlacement, TensorSplit, to_ranges};
use crate::request::{DeviceMap, LayerOptions, PlanRequest, SplitMode, Strategy, TpOptions};
use crate::size::fmt_bytes;
use crate::synth::converted;
use crate::tp::{TpInputs, TpSplit, define_split};
use crate::workspace::Hosts;

/// Variations of a request tried by `fit()` and the out-of-memory fix search, applied without
/// cloning the tensor table.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tweak {
    pub cache: Option<Option<CacheSpec>>,
    pub allow_disk: Option<bool>,
    /// Bytes taken off every device's reserve.
    pub reserve_cut: u64,
    pub n_gpu_layers: Option<i64>,
    pub runtime: Option<RuntimeSpec>,
}

#[derive(Debug, Clone)]
pub(crate) struct Dev {
    pub name: String,
    pub kind: DeviceKind,
    pub limit: u64,
    pub reserve: u64,
    pub overhead: u64,
    pub implicit: bool,
}

impl Dev {
    /// Bytes left for weights, kv and scratch.
    fn room(&self) -> u64 {
        if self.limit == u64::MAX {
            return u64::MAX;
        }
        self.limit
            .saturating_sub(self.reserve)
            .saturating_sub(self.overhead)
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
}

impl<'a> Ctx<'a> {
    pub fn new(req: &'a PlanRequest, tweak: Tweak) -> Result<Self> {
        let spec = &req.spec;
        if spec.n_layers == 0
            || spec.n_kv_heads.len() != spec.n_layers as usize
            || spec.head_dim == 0
        {
            return Err(PlanError::Spec {
                detail: format!(
                    "need n_layers > 0, head_dim > 0 and one n_kv_heads entry per layer; got {} layers, head_dim {}, {} kv-head entries",
                    spec.n_layers,
                    spec.head_dim,
                    spec.n_kv_heads.len()
                ),
            });
        }
        if req.tensors.is_empty() {
            return Err(PlanError::Spec {
                detail: "the tensor table is empty; pass a checkpoint's tensors or synthesize_tensors(spec, ...)".into(),
            });
        }
        let allow_disk = tweak.allow_disk.unwrap_or(req.allow_disk);
        let cache = tweak.cache.unwrap_or(req.cache);
        if let Some(c) = &cache
            && (c.max_seq_len == 0 || c.batch_size == 0)
        {
            return Err(PlanError::option(
                "cache",
                "max_seq_len and batch_size of at least 1",
                format!("max_seq_len {}, batch_size {}", c.max_seq_len, c.batch_size),
            ));
        }
        let mut warnings = Vec::new();

        // Devices.
        if req.devices.is_empty() {
            return Err(PlanError::option(
                "devices",
                "at least one device",
                "an empty list",
            ));
        }
        let mut devs: Vec<Dev> = Vec::with_capacity(req.devices.len() + 2);
        for d in &req.devices {
            if devs.iter().any(|o| o.name == d.name) {
                return Err(PlanError::option(
                    "devices",
                    "each device once",
                    format!("{} twice", d.name),
                ));
            }
            let cap = req.max_memory.get(&d.name).copied().unwrap_or(u64::MAX);
            devs.push(Dev {
                name: d.name.clone(),
                kind: d.kind,
                limit: d.capacity.min(cap),
                reserve: req
                    .reserve
                    .get(&d.name)
                    .copied()
                    .unwrap_or(d.reserve)
                    .saturating_sub(tweak.reserve_cut),
                overhead: req.overhead.get(&d.name).copied().unwrap_or(d.overhead),
                implicit: false,
            });
        }
        for (what, map) in [
            ("reserve", &req.reserve),
            ("max_memory", &req.max_memory),
            ("overhead", &req.overhead),
        ] {
            if let Some(k) = map.keys().find(|k| !devs.iter().any(|d| &d.name == *k)) {
                return Err(PlanError::UnknownDevice {
                    device: k.clone(),
                    context: what.to_string(),
                    known: devs
                        .iter()
                        .map(|d| d.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        let host = match devs.iter().position(|d| d.kind == DeviceKind::Cpu) {
            Some(i) => {
                if devs[i].limit == u64::MAX {
                    warnings.push("cpu capacity unknown: host RAM is not checked".to_string());
                }
                i
            }
            None => {
                devs.push(Dev {
                    name: "cpu".into(),
                    kind: DeviceKind::Cpu,
                    limit: u64::MAX,
                    reserve: 0,
                    overhead: 0,
                    implicit: true,
                });
                devs.len() - 1
            }
        };
        let mut disk = devs.iter().position(|d| d.kind == DeviceKind::Disk);
        if disk.is_none() && allow_disk {
            devs.push(Dev {
                name: "disk".into(),
                kind: DeviceKind::Disk,
                limit: u64::MAX,
                reserve: 0,
                overhead: 0,
                implicit: false,
            });
            disk = Some(devs.len() - 1);
        }
        let accel: Vec<usize> = (0..devs.len())
            .filter(|&i| devs[i].kind.is_accelerator())
            .collect();

        // Tensors and units.
        let n_layers = spec.n_layers as usize;
        let mut bytes = Vec::with_capacity(req.tensors.len());
        let mut dtypes = Vec::with_capacity(req.tensors.len());
        let mut embed = Unit {
            kind: UnitKind::Embed,
            tensors: vec![],
            weights: 0,
            kv: 0,
        };
        let mut layers: Vec<Unit> = (0..spec.n_layers)
            .map(|l| Unit {
                kind: UnitKind::Layer(l),
                tensors: vec![],
                weights: 0,
                kv: 0,
            })
            .collect();
        let mut norm = Unit {
            kind: UnitKind::Norm,
            tensors: vec![],
            weights: 0,
            kv: 0,
        };
        let mut output = Unit {
            kind: UnitKind::Output,
            tensors: vec![],
            weights: 0,
            kv: 0,
        };
        let mut embd_tensor = None;
        let mut has_output = false;
        for (i, t) in req.tensors.iter().enumerate() {
            let (dt, b) = converted(t, req.dtype);
            bytes.push(b);
            dtypes.push(dt);
            let unit = match (t.layer, t.role) {
                (Some(l), _) => {
                    let Some(u) = layers.get_mut(l as usize) else {
                        return Err(PlanError::Tensor {
                            tensor: t.name.clone(),
                            detail: format!(
                                "layer {l} is out of range for a model of {n_layers} layers"
                            ),
                        });
                    };
                    u
                }
                (None, Some(Role::TokenEmbd | Role::RopeFreqs)) => &mut embed,
                (None, Some(Role::Output)) => {
                    has_output = true;
                    &mut output
                }
                (None, Some(Role::OutputNorm)) => &mut norm,
                (None, _) if t.name.contains("embd") || t.name.contains("embed") => &mut embed,
                (None, _) => &mut norm,
            };
            if t.role == Some(Role::TokenEmbd) && embd_tensor.is_none() {
                embd_tensor = Some(i);
            }
            unit.tensors.push(i);
            unit.weights = unit.weights.saturating_add(b);
        }
        let tied_bytes = match (
            spec.tie_word_embeddings || !has_output,
            has_output,
            embd_tensor,
        ) {
            (true, false, Some(e)) => bytes[e],
            _ => 0,
        };
        let kv: Vec<u64> = (0..n_layers)
            .map(|l| cache.map_or(0, |c| c.layer_bytes(spec, l)))
            .collect();
        for (u, &k) in layers.iter_mut().zip(&kv) {
            u.kv = k;
        }
        let offload = cache.is_some_and(|c| c.offload);
        let offload_total = if offload {
            kv.iter().fold(0u64, |a, &b| a.saturating_add(b))
        } else {
            0
        };
        let mut units = Vec::with_capacity(n_layers + 3);
        units.push(embed);
        units.extend(layers);
        units.push(norm);
        units.push(output);

        let runtime = tweak.runtime.unwrap_or(req.runtime);
        let (seq, batch) = cache.map_or((runtime.max_input_len.max(1), 1), |c| {
            (c.max_seq_len, c.batch_size)
        });
        let scratch = ScratchModel::new(spec, &runtime, seq, batch);
        let staging_bound = 2 * req
            .staging_bytes
            .min(bytes.iter().copied().max().unwrap_or(0));
        Ok(Ctx {
            req,
            tweak,
            devs,
            host,
            accel,
            disk,
            bytes,
            dtypes,
            units,
            scratch,
            cache,
            offload,
            offload_total,
            tied_bytes,
            embd_tensor,
            staging_bound,
            warnings,
        })
    }

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

    pub fn run(&self) -> Result<Plan> {
        let strategy = &self.req.strategy;
        let assign = match strategy {
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
        };
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
                        Err(PlanError::OutOfMemory(Box::new(OutOfMemory {
                            strategy: strategy.name().to_string(),
                            shortfalls: vec![Shortfall {
                                device: d.name.clone(),
                                needed,
                                available: d.limit,
                                what: format!(
                                    "{} ({})",
                                    usage.map_or(String::new(), |u| {
                                        let staging = if assign.head_dev == self.host {
                                            p.host().staging
                                        } else {
                                            0
                                        };
                                        self.what(u, staging)
                                    }),
                                    note.0
                                ),
                            }],
                            fixes: Vec::new(),
                        })))
                    }
                }
            }
        }
    }

    /// accelerate `get_balanced_memory` caps (bytes for weights + kv) per device index;
    /// `None` means uncapped.
    fn balanced_caps(&self, low_zero: bool) -> Vec<Option<u64>> {
        let full = Hosts {
            layers: true,
            head: true,
            embed: true,
        };
        let max_memory: Vec<u64> = self
            .accel
            .iter()
            .map(|&d| {
                self.devs[d]
                    .room()
                    .saturating_sub(self.scratch.for_hosts(full))
            })
            .collect();
        let mut total: u64 = self
            .units
            .iter()
            .map(|u| u.weights.saturating_add(self.dev_kv(u)))
            .fold(0u64, u64::saturating_add);
        if self.offload {
            // Every accelerator that computes layers holds its prefetch slots.
            let slots = self.offload_slots_estimate();
            total = total.saturating_add(slots.saturating_mul(self.accel.len() as u64));
        }
        let no_split = self
            .units
            .iter()
            .find(|u| matches!(u.kind, UnitKind::Layer(_)))
            .map_or(0, |u| u.weights.saturating_add(self.dev_kv(u)));
        // accelerate's "final modules": one per weight/bias pair (q_proj, input_layernorm, ...).
        let mut modules: BTreeMap<&str, u64> = BTreeMap::new();
        for (t, b) in self.tensors().iter().zip(&self.bytes) {
            let m = t
                .name
                .strip_suffix(".weight")
                .or_else(|| t.name.strip_suffix(".bias"))
                .unwrap_or(&t.name);
            let e = modules.entry(m).or_default();
            *e = e.saturating_add(*b);
        }
        let mean_leaf = modules.values().fold(0u64, |a, &b| a.saturating_add(b))
            / (modules.len().max(1) as u64);
        let user_set = self
            .accel
            .iter()
            .any(|&d| self.req.max_memory.contains_key(&self.devs[d].name));
        let caps = balanced_max_memory(total, no_split, mean_leaf, &max_memory, low_zero, user_set);
        let mut out = vec![None; self.devs.len()];
        for (&d, c) in self.accel.iter().zip(caps) {
            out[d] = Some(c);
        }
        out
    }

    fn fill(
        &self,
        mode: FillMode,
        caps: &[Option<u64>],
    ) -> std::result::Result<Assign, Box<Overflow>> {
        let mut a = self.empty_assign();
        let mut order: Vec<usize> = self.accel.clone();
        if !self.devs[self.host].implicit {
            order.push(self.host);
        }
        if let Some(d) = self.disk {
            order.push(d);
        }
        let main: Vec<usize> = match mode {
            FillMode::Accelerate => {
                let mut m: Vec<usize> = self.accel.first().copied().into_iter().collect();
                if !self.devs[self.host].implicit {
                    m.push(self.host);
                }
                m
            }
            FillMode::Exl => Vec::new(),
        };
        let mut used = vec![0u64; self.devs.len()];
        let mut pos = 0usize;
        let n_units = self.units.len();
        // Largest remaining unit after index i (accelerate's max_layer_size).
        let mut max_after = vec![0u64; n_units + 1];
        // KV bytes and compute of the units from index i on: once the fill reaches the host,
        // every later unit lands on the host or on disk, and a disk layer's KV and compute
        // are the host's too.
        let mut kv_after = vec![0u64; n_units + 1];
        let mut hosts_after = vec![Hosts::default(); n_units + 1];
        // Offload: the layers from index i on, whose prefetch slots the host keeps room for
        // once the fill reaches it with disk allowed.
        let mut slots_after = vec![Slots::default(); n_units + 1];
        for i in (0..n_units).rev() {
            let u = &self.units[i];
            max_after[i] = max_after[i + 1].max(u.weights.saturating_add(self.dev_kv(u)));
            kv_after[i] = kv_after[i + 1].saturating_add(self.dev_kv(u));
            // The fill skips empty units, except exllamav2's tied head (a copy of the
            // embedding).
            let placed =
                !u.tensors.is_empty() || (u.kind == UnitKind::Output && mode == FillMode::Exl);
            hosts_after[i] = if placed {
                union(hosts_after[i + 1], u.hosts())
            } else {
                hosts_after[i + 1]
            };
            slots_after[i] = match u.kind {
                UnitKind::Layer(_) if placed && self.offload => slots_after[i + 1].with(u.kv),
                _ => slots_after[i + 1],
            };
        }
        // Offload: the layers placed on each device so far.
        let mut slots = vec![Slots::default(); self.devs.len()];
        for (ui, unit) in self.units.iter().enumerate() {
            if unit.tensors.is_empty() && !(unit.kind == UnitKind::Output && mode == FillMode::Exl)
            {
                continue;
            }
            // exllamav2 keeps the embedding on the CPU (`load_autosplit_gen`, module 0).
            if unit.kind == UnitKind::Embed && mode == FillMode::Exl {
                used[self.host] = used[self.host].saturating_add(unit.weights);
                self.put(&mut a, unit, self.host);
                continue;
            }
            let mut size = unit.weights.saturating_add(self.dev_kv(unit));
            // exllamav2 loads a tied head as its own copy of the embedding.
            let tied =
                unit.kind == UnitKind::Output && mode == FillMode::Exl && self.tied_bytes > 0;
            if tied {
                size = size.saturating_add(self.tied_bytes);
            }
            // accelerate keeps a tied lm_head with embed_tokens: that device computes the head.
            let tied_head =
                unit.kind == UnitKind::Embed && mode == FillMode::Accelerate && self.tied_bytes > 0;
            // The head computed where the embedding lives uses it as is: no copy there.
            let size_on = |d: usize, a: &Assign| {
                if tied && d == a.embed_dev {
                    size.saturating_sub(self.tied_bytes)
                } else {
                    size
                }
            };
            // Offload: how much this layer grows `d`'s prefetch slots.
            let is_layer = matches!(unit.kind, UnitKind::Layer(_));
            let slots_with = |d: usize| {
                if self.offload && is_layer {
                    slots[d].with(unit.kv)
                } else {
                    slots[d]
                }
            };
            let slot_growth = |d: usize| slots_with(d).bytes().saturating_sub(slots[d].bytes());
            let mut unit_hosts = unit.hosts();
            unit_hosts.head |= tied_head;
            // What the rules (balanced caps, accelerate's headroom) withheld on the last
            // device tried, beyond its raw room.
            let mut rule = Rule::default();
            loop {
                let Some(&d) = order.get(pos) else {
                    return Err(self.overflow(a, ui, &order, mode, rule));
                };
                let dev = &self.devs[d];
                if dev.kind == DeviceKind::Disk {
                    break;
                }
                let mut projected = union(a.hosts[d], unit_hosts);
                let mut later_kv = 0;
                if d == self.host && self.disk.is_some() {
                    projected = union(projected, hosts_after[ui]);
                    later_kv = kv_after[ui + 1];
                    if self.offload {
                        // Layers left on disk compute on the host, so do their slots.
                        let now = slots_with(d);
                        later_kv = now
                            .merge(slots_after[ui + 1])
                            .bytes()
                            .saturating_sub(now.bytes());
                    }
                }
                let mut avail = dev
                    .room()
                    .saturating_sub(self.scratch.for_hosts(projected))
                    .saturating_sub(later_kv);
                if d == self.host && !self.accel.is_empty() {
                    avail = avail.saturating_sub(self.staging_bound);
                }
                if d == self.host {
                    // An offloaded cache lives in host RAM whatever the layers' devices.
                    avail = avail.saturating_sub(self.offload_total);
                }
                rule = Rule::default();
                if let Some(Some(c)) = caps.get(d) {
                    rule.cap = avail.saturating_sub(*c);
                    avail = avail.min(*c);
                }
                if main.contains(&d) {
                    rule.headroom = max_after[ui + 1].min(avail);
                    avail = avail.saturating_sub(max_after[ui + 1]);
                }
                if used[d]
                    .saturating_add(size_on(d, &a))
                    .saturating_add(slot_growth(d))
                    <= avail
                {
                    break;
                }
                pos += 1;
            }
            let d = order[pos];
            used[d] = used[d]
                .saturating_add(size_on(d, &a))
                .saturating_add(slot_growth(d));
            slots[d] = slots_with(d);
            self.put(&mut a, unit, d);
            a.hosts[d] = union(a.hosts[d], unit_hosts);
            if tied && d != a.embed_dev {
                a.tied_copy = vec![(d, self.tied_bytes)];
            }
        }
        if mode == FillMode::Accelerate && self.tied_bytes > 0 {
            // accelerate keeps tied parameters together: lm_head is token_embd.
            a.head_dev = a.embed_dev;
            a.hosts[a.embed_dev].head = true;
        }
        Ok(a)
    }

    /// Everything from unit `from` on goes to the last non-disk device of the fill order, so
    /// the report shows how far over it would be.
    fn overflow(
        &self,
        mut a: Assign,
        from: usize,
        order: &[usize],
        mode: FillMode,
        rule: Rule,
    ) -> Box<Overflow> {
        let last = order
            .iter()
            .rev()
            .copied()
            .find(|&d| self.devs[d].kind != DeviceKind::Disk)
            .unwrap_or(self.host);
        for unit in &self.units[from..] {
            if unit.kind == UnitKind::Embed && mode == FillMode::Exl {
                self.put(&mut a, unit, self.host);
                continue;
            }
            self.put(&mut a, unit, last);
            if unit.kind == UnitKind::Output
                && mode == FillMode::Exl
                && self.tied_bytes > 0
                && last != a.embed_dev
            {
                a.tied_copy = vec![(last, self.tied_bytes)];
            }
        }
        // `head_dev` doubles as "the device the fill stopped on" for the report.
        let mut why = Vec::new();
        if rule.cap > 0 {
            why.push(format!(
                "the balanced split caps it {} below its room",
                fmt_bytes(rule.cap)
            ));
        }
        if rule.headroom > 0 {
            why.push(format!(
                "accelerate keeps {} free on its main devices for the largest remaining layer",
                fmt_bytes(rule.headroom)
            ));
        }
        let note = if why.is_empty() {
            ("the fill ran out of devices".to_string(), 0)
        } else {
            (why.join("; "), rule.cap.saturating_add(rule.headroom))
        };
        a.head_dev = last;
        Box::new(Overflow { assign: a, note })
    }

    /// llama.cpp `llama_model::load_tensors`: the last `n_gpu_layers` repeating layers (and the
    /// output layer when `n_gpu_layers > n_layer`) go to the GPUs; the input layer stays on the
    /// CPU.
    fn layers(&self, o: &LayerOptions) -> Result<Assign> {
        let n = self.n_layers() as i64;
        let ngl_raw = self.tweak.n_gpu_layers.unwrap_or(o.n_gpu_layers);
        let ngl = if ngl_raw < 0 {
            n + 1
        } else {
            ngl_raw.min(n + 1)
        };
        let i_gpu_start = (n - ngl).max(0);
        let act = if self.accel.is_empty() { 0 } else { ngl };
        if !self.accel.is_empty() && o.main_gpu >= self.accel.len() {
            return Err(PlanError::option(
                "main_gpu",
                &format!("an index below the number of GPUs ({})", self.accel.len()),
                o.main_gpu,
            ));
        }
        if o.tensor_split.len() > self.accel.len().max(1) {
            return Err(PlanError::option(
                "tensor_split",
                &format!("at most one weight per GPU ({})", self.accel.len()),
                format!("{} weights", o.tensor_split.len()),
            ));
        }
        if o.tensor_split.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(PlanError::option(
                "tensor_split",
                "finite non-negative weights",
                format!("{:?}", o.tensor_split),
            ));
        }
        let gpus: Vec<usize> = match o.split_mode {
            SplitMode::None if !self.accel.is_empty() => vec![self.accel[o.main_gpu]],
            _ => self.accel.clone(),
        };
        let main = self.accel.get(o.main_gpu).copied().unwrap_or(self.host);
        // Cumulative split fractions, in f32 as llama.cpp computes them.
        let splits = |devs: &[usize]| -> Vec<f32> {
            let mut w: Vec<f32> =
                if o.split_mode != SplitMode::None && o.tensor_split.iter().any(|&x| x > 0.0) {
                    (0..devs.len())
                        .map(|i| o.tensor_split.get(i).copied().unwrap_or(0.0))
                        .collect()
                } else {
                    devs.iter().map(|&d| self.devs[d].room() as f32).collect()
                };
            let mut sum = 0f32;
            for x in w.iter_mut() {
                sum += *x;
                *x = sum;
            }
            if sum > 0.0 {
                for x in w.iter_mut() {
                    *x /= sum;
                }
            }
            w
        };
        let cum = splits(&gpus);
        let dev_for = |il: i64| -> usize {
            if il < i_gpu_start || il - i_gpu_start >= act {
                return self.host;
            }
            if o.split_mode == SplitMode::Row {
                return main;
            }
            let frac = (il - i_gpu_start) as f32 / act as f32;
            let idx = cum.partition_point(|&s| s <= frac).min(gpus.len() - 1);
            gpus[idx]
        };
        let mut a = self.empty_assign();
        for unit in &self.units {
            let d = match unit.kind {
                UnitKind::Embed => self.host,
                UnitKind::Layer(l) => dev_for(i64::from(l)),
                UnitKind::Norm | UnitKind::Output => dev_for(n),
            };
            self.put(&mut a, unit, d);
        }
        a.head_dev = dev_for(n);
        a.hosts[a.head_dev].head = true;
        if self.tied_bytes > 0 && a.head_dev != a.embed_dev {
            a.tied_copy = vec![(a.head_dev, self.tied_bytes)];
        }
        if o.split_mode == SplitMode::Row && !self.accel.is_empty() {
            // ggml-cuda's split buffer: row boundaries at nrows × cumulative split, rounded down.
            let mut starts = vec![0f32];
            starts.extend(cum.iter().take(cum.len().saturating_sub(1)).copied());
            let round = o.row_rounding.max(1);
            for (i, t) in self.tensors().iter().enumerate() {
                if t.shape.len() != 2 || self.units_of_row_split(t, &a, i) {
                    continue;
                }
                let rows = t.shape[0];
                if rows == 0 {
                    continue;
                }
                let row_bytes = self.bytes[i] / rows;
                let mut shards = Vec::new();
                for (k, &g) in gpus.iter().enumerate() {
                    let bound = |x: f32| {
                        let r = (rows as f64 * f64::from(x)) as u64;
                        r - r % round
                    };
                    let lo = if k == 0 { 0 } else { bound(starts[k]) };
                    let hi = if k + 1 == gpus.len() {
                        rows
                    } else {
                        bound(starts[k + 1])
                    };
                    if hi > lo {
                        shards.push((g, lo, hi, (hi - lo) * row_bytes));
                    }
                }
                a.splits[i] = Some((0, false, shards));
            }
        }
        Ok(a)
    }

    /// True when tensor `i` is NOT a row-split candidate: only offloaded 2-D matrices of layers
    /// and the output matrix are split.
    fn units_of_row_split(&self, t: &TensorInfo, a: &Assign, i: usize) -> bool {
        let on_gpu = self.devs[a.tensor_dev[i]].kind.is_accelerator();
        let matrix = t.layer.is_some() || t.role == Some(Role::Output);
        !(on_gpu && matrix)
    }

    /// exllamav2 TPContext: split tables from `define_split`, tensors sharded by them.
    fn tensor_parallel(&self, o: &TpOptions) -> Result<Assign> {
        let spec = &self.req.spec;
        if self.accel.is_empty() {
            return Err(PlanError::option(
                "tensor_parallel",
                "at least one cuda or virtual device",
                "none",
            ));
        }
        let budgets = match &o.gpu_split_mib {
            Some(b) if b.len() == self.accel.len() => b.clone(),
            Some(b) => {
                return Err(PlanError::option(
                    "gpu_split",
                    &format!("one budget per accelerator ({})", self.accel.len()),
                    format!("{} budgets", b.len()),
                ));
            }
            None => self
                .accel
                .iter()
                .map(|&d| self.devs[d].room() >> 20)
                .collect(),
        };
        let nkv = spec.n_kv_heads[0];
        if spec.n_kv_heads.iter().any(|&k| k != nkv) {
            return Err(PlanError::option(
                "tensor_parallel",
                "the same number of kv heads in every layer (exllamav2 TP assumes it)",
                "per-layer kv head counts",
            ));
        }
        let attn_roles = |r: Option<Role>| {
            matches!(
                r,
                Some(
                    Role::AttnNorm
                        | Role::AttnQ
                        | Role::AttnK
                        | Role::AttnV
                        | Role::AttnOutput
                        | Role::AttnQBias
                        | Role::AttnKBias
                        | Role::AttnVBias
                        | Role::AttnOutputBias
                )
            )
        };
        let mut footprints = vec![0u64; self.n_layers()];
        for (t, &b) in self.tensors().iter().zip(&self.bytes) {
            if let (Some(l), true) = (t.layer, attn_roles(t.role)) {
                footprints[l as usize] = footprints[l as usize].saturating_add(b);
            }
        }
        let inputs = TpInputs {
            budgets_mib: budgets,
            n_kv_heads: u64::from(nkv),
            n_heads: u64::from(spec.n_heads),
            intermediate_size: spec.intermediate_size,
            hidden_size: spec.hidden_size,
            vocab_size: spec.vocab_size,
            // Offloaded, the devices hold only the prefetch slots of the cache.
            cache_bytes: if self.offload {
                self.offload_slots_estimate()
            } else {
                self.cache.map_or(0, |c| c.total_bytes(spec))
            },
            attn_footprints: footprints,
        };
        let tp = define_split(&inputs)?;
        let hd = u64::from(spec.head_dim);
        let acc = |i: usize| self.accel[i];
        let scale = |t: &[(usize, u64, u64)], m: u64| -> Vec<(usize, u64, u64)> {
            t.iter()
                .map(|&(d, a, b)| (acc(d), a.saturating_mul(m), b.saturating_mul(m)))
                .collect()
        };
        let q = scale(&tp.q, hd);
        let kv = scale(&tp.kv, hd);
        let id = scale(&tp.id, 1);
        let vc = scale(&tp.vc, 1);
        let mut all: Vec<usize> = q
            .iter()
            .chain(&kv)
            .chain(&id)
            .chain(&vc)
            .map(|x| x.0)
            .collect();
        all.sort_unstable();
        all.dedup();
        let first = all.first().copied().unwrap_or(self.accel[0]);
        let mut a = self.empty_assign();
        for (i, t) in self.tensors().iter().enumerate() {
            let b = self.bytes[i];
            let (table, axis): (&[(usize, u64, u64)], u8) = match t.role {
                Some(Role::AttnQ | Role::AttnQBias) => (&q, 0),
                Some(Role::AttnK | Role::AttnV | Role::AttnKBias | Role::AttnVBias) => (&kv, 0),
                Some(Role::AttnOutput) => (&q, 1),
                Some(Role::FfnGate | Role::FfnUp) => (&id, 0),
                Some(Role::FfnDown) => (&id, 1),
                Some(Role::Output) => (&vc, 0),
                Some(Role::TokenEmbd | Role::RopeFreqs) if t.layer.is_none() => {
                    a.tensor_dev[i] = self.host;
                    continue;
                }
                _ => {
                    // Norms and anything unrecognised are replicated on every TP device.
                    let shards = all.iter().map(|&d| (d, 0, 1, b)).collect();
                    a.tensor_dev[i] = first;
                    a.splits[i] = Some((0, true, shards));
                    continue;
                }
            };
            let dim = if axis == 0 {
                t.shape.first().copied().unwrap_or(0)
            } else {
                t.shape.last().copied().unwrap_or(0)
            };
            if dim == 0 || t.shape.len() > 2 {
                // Not a shape the tables describe: keep it whole on the first TP device.
                a.tensor_dev[i] = first;
                continue;
            }
            a.tensor_dev[i] = table.first().map_or(first, |x| x.0);
            a.splits[i] = Some((axis, false, shard_bytes(table, dim, b)));
        }
        for l in 0..self.n_layers() {
            a.layer_dev[l] = first;
            if let Some(c) = &self.cache {
                a.kv_dev[l] = tp
                    .kv
                    .iter()
                    .map(|&(d, s, e)| (acc(d), c.bytes_for_heads(spec, e - s)))
                    .collect();
            }
        }
        for &d in &all {
            a.hosts[d].layers = true;
        }
        a.shared_layers = all.clone();
        for &(d, _, _) in &vc {
            a.hosts[d].head = true;
        }
        a.embed_dev = self.host;
        a.hosts[self.host].embed = true;
        a.head_dev = vc.first().map_or(first, |x| x.0);
        if self.tied_bytes > 0 {
            let rows = spec.vocab_size;
            a.tied_copy = shard_bytes(&vc, rows, self.tied_bytes)
                .into_iter()
                .map(|(d, _, _, b)| (d, b))
                .collect();
        }
        a.tp = Some(tp);
        Ok(a)
    }

    /// An explicit device map with `-ot` style regex overrides.
    fn map(&self, m: &DeviceMap) -> Result<Assign> {
        if m.entries.is_empty() && m.overrides.is_empty() {
            return Err(PlanError::option(
                "device_map",
                "at least one entry, e.g. {\"\": \"cpu\"} or {\"blk.0-11\": \"cuda:0\"}",
                "an empty map",
            ));
        }
        let resolve = |d: &str| resolve_device_in(&self.devs, d);
        let mut overrides = Vec::with_capacity(m.overrides.len());
        for (pat, dev) in &m.overrides {
            let re = Regex::new(pat).map_err(|e| PlanError::Regex {
                pattern: pat.clone(),
                reason: e.to_string(),
            })?;
            overrides.push((re, resolve(dev)?));
        }
        let mut entries = Vec::with_capacity(m.entries.len());
        let mut default = None;
        for (pat, dev) in &m.entries {
            let d = resolve(dev)?;
            match Matcher::parse(pat) {
                Matcher::Default => default = Some(d),
                mt => entries.push((pat.as_str(), mt, d)),
            }
        }
        let mut a = self.empty_assign();
        let mut missing = Vec::new();
        for (i, t) in self.tensors().iter().enumerate() {
            if let Some((_, d)) = overrides.iter().find(|(re, _)| re.is_match(&t.name)) {
                a.tensor_dev[i] = *d;
                continue;
            }
            let mut hit: Option<(&str, usize)> = None;
            for (pat, mt, d) in &entries {
                if !mt.matches(t) {
                    continue;
                }
                match hit {
                    Some((p0, d0)) if d0 != *d => {
                        return Err(PlanError::MapConflict {
                            tensor: t.name.clone(),
                            first: p0.to_string(),
                            first_device: self.devs[d0].name.clone(),
                            second: pat.to_string(),
                            second_device: self.devs[*d].name.clone(),
                        });
                    }
                    Some(_) => {}
                    None => hit = Some((pat, *d)),
                }
            }
            match hit.map(|h| h.1).or(default) {
                Some(d) => a.tensor_dev[i] = d,
                None => missing.push(t.name.as_str()),
            }
        }
        if !missing.is_empty() {
            let shown: Vec<&str> = missing.iter().take(8).copied().collect();
            let more = if missing.len() > 8 {
                format!(" and {} more", missing.len() - 8)
            } else {
                String::new()
            };
            return Err(PlanError::MapIncomplete {
                count: missing.len(),
                tensors: format!("{}{more}", shown.join(", ")),
            });
        }
        // A layer lives where its attention (and so its KV) is.
        for unit in &self.units {
            if let UnitKind::Layer(l) = unit.kind {
                let pick = unit
                    .tensors
                    .iter()
                    .find(|&&t| self.tensors()[t].role == Some(Role::AttnK))
                    .or(unit.tensors.first())
                    .map(|&t| a.tensor_dev[t]);
                let d = pick.unwrap_or(self.host);
                a.layer_dev[l as usize] = d;
                if unit.kv > 0 {
                    a.kv_dev[l as usize] = vec![(d, unit.kv)];
                }
                a.hosts[d].layers = true;
            }
        }
        if let Some(e) = self.embd_tensor {
            a.embed_dev = a.tensor_dev[e];
            a.hosts[a.embed_dev].embed = true;
        }
        let out = self.units.iter().find(|u| u.kind == UnitKind::Output);
        a.head_dev = out
            .and_then(|u| u.tensors.first())
            .map_or(a.embed_dev, |&t| a.tensor_dev[t]);
        a.hosts[a.head_dev].head = true;
        Ok(a)
    }

    /// Per-device usage, budget check, and the Plan.
    fn finish(&self, a: &Assign) -> Result<Plan> {
        let nd = self.devs.len();
        let mut weights = vec![0u64; nd];
        let mut kv = vec![0u64; nd];
        let mut owned = 0u64;
        let mut mapped = 0u64;
        let mut placements = Vec::with_capacity(self.bytes.len());
        for (i, t) in self.tensors().iter().enumerate() {
            let d = a.tensor_dev[i];
            let split = a.splits[i].as_ref().map(|(axis, rep, shards)| TensorSplit {
                axis: *axis,
                replicated: *rep,
                shards: shards
                    .iter()
                    .map(|&(sd, s, e, b)| Shard {
                        device: self.devs[sd].name.clone(),
                        start: s,
                        end: e,
                        bytes: b,
                    })
                    .collect(),
            });
            match &a.splits[i] {
                Some((_, _, shards)) => {
                    for &(sd, _, _, b) in shards {
                        weights[sd] = weights[sd].saturating_add(b);
                    }
                }
                None => {
                    let b = self.bytes[i];
                    weights[d] = weights[d].saturating_add(b);
                    if d == self.host {
                        if self.req.use_mmap && self.dtypes[i] == t.dtype {
                            mapped = mapped.saturating_add(b);
                        } else {
                            owned = owned.saturating_add(b);
                        }
                    }
                }
            }
            placements.push(TensorPlacement {
                name: t.name.clone(),
                device: self.devs[d].name.clone(),
                dtype: self.dtypes[i],
                bytes: self.bytes[i],
                layer: t.layer,
                split,
            });
        }
        for &(d, b) in &a.tied_copy {
            weights[d] = weights[d].saturating_add(b);
            if d == self.host {
                owned = owned.saturating_add(b);
            }
        }
        // A layer left on disk is streamed and computed by the host: its KV cache lives in
        // host RAM (the engine allocates a layer's cache on its device, and resolves `disk` to
        // the cpu), and so does its compute scratch.
        //
        // An offloaded cache holds every layer (every slice, under tensor parallelism) on the
        // host, and each device that computes layers holds its prefetch slots: as many as it
        // computes layers, at most OFFLOAD_SLOTS, each the size of its largest layer (slice),
        // which is what the engine's offloaded cache allocates.
        let mut slots = vec![Slots::default(); nd];
        for slices in &a.kv_dev {
            for &(d, b) in slices {
                let d = self.exec_dev(d);
                if self.offload {
                    kv[self.host] = kv[self.host].saturating_add(b);
                    slots[d] = slots[d].with(b);
                } else {
                    kv[d] = kv[d].saturating_add(b);
                }
            }
        }
        for (k, s) in kv.iter_mut().zip(&slots) {
            *k = k.saturating_add(s.bytes());
        }
        let mut hosts = a.hosts.clone();
        if let Some(d) = self.disk {
            hosts[self.host] = union(hosts[self.host], hosts[d]);
            hosts[d] = Hosts::default();
        }
        let disk_layers: Vec<u32> = match self.disk {
            Some(dd) => (0..self.n_layers() as u32)
                .filter(|&l| a.layer_dev[l as usize] == dd)
                .collect(),
            None => Vec::new(),
        };
        // Staging is charged whenever the inventory has an accelerator, sized by the largest
        // tensor of the model, so that giving a device more memory (and so more uploads) never
        // makes the host side fail.
        let staging = if self.accel.is_empty() {
            0
        } else {
            self.staging_bound
        };
        let mut layer_sets: Vec<Vec<u32>> = vec![Vec::new(); nd];
        for (l, &d) in a.layer_dev.iter().enumerate() {
            layer_sets[d].push(l as u32);
            for &s in &a.shared_layers {
                if s != d {
                    layer_sets[s].push(l as u32);
                }
            }
        }
        let mut devices = Vec::with_capacity(nd);
        let mut shortfalls = Vec::new();
        let mut host_scratch = 0;
        for (i, dev) in self.devs.iter().enumerate() {
            let mut scratch = if dev.kind == DeviceKind::Disk {
                0
            } else {
                self.scratch.for_hosts(hosts[i])
            };
            if i == self.host {
                host_scratch = scratch;
                scratch = scratch.saturating_add(staging);
            }
            // A device that allocates anything (weights, kv, compute scratch or, on the host,
            // staging buffers) is checked against its budget and pays its fixed overhead.
            let active = weights[i] > 0 || kv[i] > 0 || scratch > 0;
            let overhead = if active { dev.overhead } else { 0 };
            let mut holds = Vec::new();
            let in_dev = |role: Role| {
                self.tensors().iter().enumerate().any(|(t, ti)| {
                    ti.role == Some(role)
                        && ti.layer.is_none()
                        && a.tensor_dev[t] == i
                        && a.splits[t].is_none()
                }) || self.tensors().iter().enumerate().any(|(t, ti)| {
                    ti.role == Some(role)
                        && ti.layer.is_none()
                        && a.splits[t]
                            .as_ref()
                            .is_some_and(|(_, _, s)| s.iter().any(|x| x.0 == i))
                })
            };
            for (role, label) in [
                (Role::TokenEmbd, "token_embd"),
                (Role::OutputNorm, "output_norm"),
                (Role::Output, "output"),
            ] {
                if in_dev(role) {
                    holds.push(label.to_string());
                }
            }
            if a.tied_copy.iter().any(|x| x.0 == i) {
                holds.push("output (tied copy)".to_string());
            }
            if self.offload && i == self.host {
                holds.push(format!(
                    "offloaded kv cache of all {} layers",
                    self.n_layers()
                ));
            }
            if slots[i].layers > 0 {
                holds.push(format!(
                    "{} kv prefetch slot(s) of {}",
                    slots[i].layers.min(crate::memory::OFFLOAD_SLOTS),
                    fmt_bytes(slots[i].largest)
                ));
            }
            if i == self.host && !disk_layers.is_empty() {
                holds.push(format!(
                    "kv and compute of disk layers {}",
                    crate::plan::ranges(&to_ranges(disk_layers.iter().copied()))
                ));
            }
            let usage = DeviceUsage {
                name: dev.name.clone(),
                kind: dev.kind,
                capacity: dev.limit,
                weights: weights[i],
                kv: kv[i],
                scratch,
                overhead,
                reserve: dev.reserve,
                free: 0,
                layers: to_ranges(layer_sets[i].iter().copied()),
                holds,
                implicit: dev.implicit,
            };
            let used = usage.used();
            let usage = DeviceUsage {
                free: if dev.limit == u64::MAX {
                    u64::MAX
                } else {
                    dev.limit.saturating_sub(used)
                },
                ..usage
            };
            if active && dev.limit != u64::MAX && used > dev.limit {
                shortfalls.push(Shortfall {
                    device: dev.name.clone(),
                    needed: used,
                    available: dev.limit,
                    what: self.what(&usage, if i == self.host { staging } else { 0 }),
                });
            }
            devices.push(usage);
        }
        if !shortfalls.is_empty() {
            return Err(PlanError::OutOfMemory(Box::new(OutOfMemory {
                strategy: self.req.strategy.name().to_string(),
                shortfalls,
                fixes: Vec::new(),
            })));
        }
        let mut warnings = self.warnings.clone();
        if self.devs[self.host].implicit {
            warnings.push("no cpu in the device list: the input layer is placed on the host, whose RAM is not checked".into());
        }
        if let Some(d) = self.disk
            && weights[d] > 0
        {
            warnings.push(format!(
                "{} of weights stay on disk and are streamed on every forward pass: expect it to be slow",
                fmt_bytes(weights[d])
            ));
        }
        if self.offload && self.devs[self.host].limit == u64::MAX {
            warnings.push(format!(
                "the offloaded kv cache ({}) lives in host RAM, whose size is not checked: give cpu a capacity (e.g. cpu:32GiB) to check it",
                fmt_bytes(self.offload_total)
            ));
        }
        if let Some(&(d, _)) = a.tied_copy.first() {
            warnings.push(format!(
                "output is tied to token_embd: {} holds a second copy of it for the head",
                self.devs[d].name
            ));
        }
        let disk_weights = self.disk.map_or(0, |d| weights[d]);
        let host_kv = kv[self.host];
        let peak_anon = staging
            .saturating_add(owned)
            .saturating_add(host_kv)
            .saturating_add(host_scratch);
        let host = HostUsage {
            staging,
            owned_weights: owned,
            mapped_weights: mapped,
            disk_weights,
            kv: host_kv,
            scratch: host_scratch,
            peak_anon,
            peak_total: peak_anon.saturating_add(mapped),
        };
        let name = |d: usize| self.devs[d].name.clone();
        Ok(Plan {
            strategy: self.req.strategy.name().to_string(),
            architecture: self.req.spec.architecture.clone(),
            n_layers: self.req.spec.n_layers,
            dtype: self.req.dtype.name().to_string(),
            cache: self.cache,
            runtime: self.tweak.runtime.unwrap_or(self.req.runtime),
            tensors: placements,
            layers: a.layer_dev.iter().map(|&d| name(d)).collect(),
            embed_device: name(a.embed_dev),
            head_device: name(a.head_dev),
            tied_output: a.tied_copy.iter().map(|&(d, b)| (name(d), b)).collect(),
            tp: a.tp.clone(),
            devices,
            host,
            warnings,
        })
    }

    /// `"layers 12-29 + output: 3.10 GiB weights + 1.20 GiB kv at ctx 8192 (fp16) + 0.50 GiB scratch"`.
    fn what(&self, u: &DeviceUsage, staging: u64) -> String {
        let mut s = format!(
            "{}: {} weights",
            crate::plan::describe_holds(u),
            fmt_bytes(u.weights)
        );
        if u.kv > 0 {
            let ctx = self.cache.map_or(String::new(), |c| {
                format!(
                    " at ctx {} × batch {} ({}{})",
                    c.max_seq_len,
                    c.batch_size,
                    c.dtype.name(),
                    if c.offload { ", offloaded" } else { "" }
                )
            });
            s.push_str(&format!(" + {} kv{ctx}", fmt_bytes(u.kv)));
        }
        let compute = u.scratch.saturating_sub(staging);
        if compute > 0 {
            s.push_str(&format!(" + {} scratch", fmt_bytes(compute)));
        }
        if staging > 0 {
            s.push_str(&format!(
                " + {} host staging buffers for uploads to the accelerators",
                fmt_bytes(staging)
            ));
        }
        if u.overhead > 0 {
            s.push_str(&format!(" + {} overhead", fmt_bytes(u.overhead)));
        }
        if u.reserve > 0 {
            s.push_str(&format!(" + {} reserve", fmt_bytes(u.reserve)));
        }
        s
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FillMode {
    /// exllamav2 autosplit: embedding on the CPU, tied head as its own copy, no headroom rule.
    Exl,
    /// accelerate `infer_auto_device_map`: the first GPU and the CPU keep room for the largest
    /// remaining layer.
    Accelerate,
}

/// Bytes a fill rule withheld from a device's raw room.
#[derive(Debug, Clone, Copy, Default)]
struct Rule {
    /// Cut by a balanced cap (accelerate `get_balanced_memory`).
    cap: u64,
    /// Kept free for the largest remaining layer (accelerate's main devices).
    headroom: u64,
}

struct Overflow {
    assign: Assign,
    /// Why the fill stopped, and the bytes the rules withheld (added to the report's need).
    note: (String, u64),
}

/// Shard `bytes` of a tensor whose split dimension has `dim` entries by `table`
/// (`(device, start, end)` in that dimension, possibly padded past `dim`). The last shard takes
/// any rounding remainder so the shards sum to `bytes`.
fn shard_bytes(table: &[(usize, u64, u64)], dim: u64, bytes: u64) -> Vec<ShardIdx> {
    let mut out = Vec::with_capacity(table.len());
    let mut given = 0u64;
    let live: Vec<&(usize, u64, u64)> = table.iter().filter(|x| x.1 < dim).collect();
    for (k, &&(d, s, e)) in live.iter().enumerate() {
        let e = e.min(dim);
        let b = if k + 1 == live.len() {
            bytes - given
        } else {
            (u128::from(bytes) * u128::from(e - s) / u128::from(dim.max(1))) as u64
        };
        given = given.saturating_add(b);
        out.push((d, s, e, b));
    }
    out
}

fn resolve_device_in(devs: &[Dev], name: &str) -> Result<usize> {
    let specs: Vec<crate::device::DeviceSpec> = devs
        .iter()
        .map(|d| crate::device::DeviceSpec::new(d.name.clone(), d.kind, d.limit))
        .collect();
    resolve_device(&specs, name, "device_map")
}

/// One device-map key.
enum Matcher {
    Default,
    Layers(u32, u32),
    Role(Role),
    Prefix(String),
}

impl Matcher {
    fn parse(p: &str) -> Matcher {
        let p = p.trim();
        if p.is_empty() || p == "*" {
            return Matcher::Default;
        }
        match p {
            "model.embed_tokens" | "embed_tokens" | "token_embd" => {
                return Matcher::Role(Role::TokenEmbd);
            }
            "model.norm" | "norm" | "output_norm" => return Matcher::Role(Role::OutputNorm),
            "lm_head" | "output" => return Matcher::Role(Role::Output),
            _ => {}
        }
        let body = p.strip_prefix("model.").unwrap_or(p);
        for pre in ["layers.", "blk."] {
            if let Some(rest) = body.strip_prefix(pre) {
                let (a, b) = match rest.split_once('-') {
                    Some((a, b)) => (a, b),
                    None => (rest, rest),
                };
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>())
                    && a <= b
                {
                    return Matcher::Layers(a, b);
                }
            }
        }
        Matcher::Prefix(p.to_string())
    }

    fn matches(&self, t: &TensorInfo) -> bool {
        match self {
            Matcher::Default => true,
            Matcher::Layers(a, b) => t.layer.is_some_and(|l| (*a..=*b).contains(&l)),
            Matcher::Role(r) => t.role == Some(*r) && t.layer.is_none(),
            Matcher::Prefix(p) => {
                t.name == *p
                    || (t.name.starts_with(p.as_str())
                        && t.name.as_bytes().get(p.len()) == Some(&b'.'))
            }
        }
    }
}

/// accelerate's `get_balanced_memory` on plain numbers: `max_memory` holds the GPUs' limits in
/// order; returns the balanced caps.
///
/// `per_gpu = total / n` (`n - 1` with `low_zero`) + `1.25 × max(no_split_block, mean_leaf)`;
/// every GPU but the last is capped at `per_gpu`; with `low_zero` GPU 0 gets only what the
/// others cannot hold. GPUs with a zero limit are not counted. With one GPU and no
/// user-given `max_memory`, accelerate keeps 10% free.
pub fn balanced_max_memory(
    total: u64,
    no_split: u64,
    mean_leaf: u64,
    max_memory: &[u64],
    low_zero: bool,
    user_set: bool,
) -> Vec<u64> {
    let mut mm = max_memory.to_vec();
    let gpus: Vec<usize> = (0..mm.len()).filter(|&i| mm[i] > 0).collect();
    let n = gpus.len() as u64;
    if n == 0 {
        return mm;
    }
    let mut low_zero = low_zero;
    if n == 1 {
        low_zero = false;
        if !user_set {
            mm[gpus[0]] = mm[gpus[0]] / 10 * 9 + (mm[gpus[0]] % 10) * 9 / 10;
        }
    }
    let per = total / if low_zero { n - 1 } else { n };
    let buffer = no_split.max(mean_leaf).saturating_mul(5) / 4;
    let per_gpu = per.saturating_add(buffer);
    let first = mm[0];
    for &i in &gpus[..gpus.len() - 1] {
        let v = if low_zero && i == 0 { first } else { per_gpu };
        mm[i] = v.min(mm[i]);
    }
    if low_zero {
        let others = (1..(n as usize).min(mm.len())).fold(0u64, |a, i| a.saturating_add(mm[i]));
        let min_zero = total.saturating_sub(others);
        mm[0] = min_zero.min(mm[0]);
    }
    mm
}
