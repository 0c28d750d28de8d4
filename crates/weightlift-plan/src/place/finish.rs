//! The final assembly: an assignment becomes per-device usage (weights, KV or offload slots,
//! compute scratch, host staging, overhead, reserve), each device is checked against its
//! budget, and the result is a [`Plan`] with its host usage and warnings, or an out-of-memory
//! report naming every short device.

use weightlift_format::{DType, Role};

use super::{Assign, Ctx, Slots};
use crate::device::DeviceKind;
use crate::error::{OutOfMemory, PlanError, Result, Shortfall};
use crate::onload::{OnloadPlan, copied_to_slot};
use crate::plan::{DeviceUsage, HostUsage, Plan, Shard, TensorPlacement, TensorSplit, to_ranges};
use crate::request::Strategy;
use crate::size::fmt_bytes;

impl Ctx<'_> {
    /// The type and bytes tensor `i` is held in on device `d`: what `dtype=` and `quantize=`
    /// decided, except on `disk`, where a tensor stays a view of the file in its stored type
    /// (converting it would mean converting it again at every forward pass that streams it).
    fn held_type(&self, i: usize, d: usize) -> (weightlift_format::DType, u64) {
        let t = &self.req.tensors[i];
        if Some(d) == self.disk {
            (t.dtype, t.nbytes)
        } else {
            (self.dtypes[i], self.bytes[i])
        }
    }

    /// Device memory a quantising load takes on CUDA device `d` besides the tensors: the
    /// loader uploads each chunk of float rows (at most one staging size) to a scratch of its
    /// own size and quantises it there into the tensor, one chunk at a time. 0 on other kinds
    /// (their loads quantise on the host) and where no float tensor is quantised into a ggml
    /// block type on `d`.
    fn quantize_scratch(&self, a: &Assign, d: usize) -> u64 {
        if self.devs[d].kind != DeviceKind::Cuda {
            return 0;
        }
        self.req
            .tensors
            .iter()
            .enumerate()
            .filter(|&(i, t)| {
                let held = self.held_type(i, d).0;
                a.tensor_dev[i] == d
                    && matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16)
                    && held != DType::INT8
                    && held.block_size() > 1
            })
            .map(|(_, t)| t.nbytes.min(self.req.staging_bytes))
            .max()
            .unwrap_or(0)
    }

    /// Per-device usage, budget check, and the Plan.
    pub(super) fn finish(&self, a: &Assign) -> Result<Plan> {
        let nd = self.devs.len();
        let mut weights = vec![0u64; nd];
        let mut kv = vec![0u64; nd];
        let mut owned = 0u64;
        let mut mapped = 0u64;
        let mut placements = Vec::with_capacity(self.bytes.len());
        for (i, t) in self.tensors().iter().enumerate() {
            let d = a.tensor_dev[i];
            let (dtype, bytes) = self.held_type(i, d);
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
                    let b = bytes;
                    weights[d] = weights[d].saturating_add(b);
                    if d == self.host {
                        if self.req.use_mmap && dtype == t.dtype {
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
                dtype,
                bytes,
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
        let onload = self.onload(a)?;
        let onloaded = |l: usize| {
            onload
                .as_ref()
                .is_some_and(|(_, p)| p.groups.iter().flatten().any(|&x| x as usize == l))
        };
        let mut slots = vec![Slots::default(); nd];
        for (l, slices) in a.kv_dev.iter().enumerate() {
            for &(d, b) in slices {
                let d = match &onload {
                    Some((exec, _)) if onloaded(l) => *exec,
                    _ => self.exec_dev(d),
                };
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
        let mut hosts = self.computed_hosts(a);
        // Offloaded layers compute on the execution device; the host keeps no layer to run.
        if let Some((exec, p)) = &onload
            && !p.groups.is_empty()
        {
            hosts[*exec].layers = true;
            hosts[self.host].layers = false;
        }
        let disk_layers: Vec<u32> = match (self.disk, &onload) {
            (Some(dd), None) => (0..self.n_layers() as u32)
                .filter(|&l| a.layer_dev[l as usize] == dd)
                .collect(),
            _ => Vec::new(),
        };
        // Staging is charged whenever the inventory has an accelerator, sized by the largest
        // tensor of the model, so that giving a device more memory (and so more uploads) never
        // makes the host side fail; and whenever a tensor changes type on the way (a `dtype=`
        // conversion or a quantising load reads through the same buffers on the host too).
        let converts = self
            .req
            .tensors
            .iter()
            .enumerate()
            .any(|(i, t)| self.held_type(i, a.tensor_dev[i]).0 != t.dtype);
        let staging = if self.accel.is_empty() && !converts {
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
            let mut scratch = match &a.scratch {
                Some(s) => s.get(i).copied().unwrap_or(0),
                None if dev.kind == DeviceKind::Disk => 0,
                None => self.scratch.for_device(hosts[i], dev.kind),
            };
            if i == self.host {
                host_scratch = scratch;
                scratch = scratch.saturating_add(staging);
            }
            let onload_here = onload.as_ref().filter(|(e, p)| *e == i && p.slots > 0);
            if let Some((_, p)) = onload_here {
                scratch = scratch.saturating_add(p.bytes());
            }
            // A device that allocates anything (weights, kv, compute scratch or, on the host,
            // staging buffers) is checked against its budget and pays its fixed overhead.
            let active = weights[i] > 0 || kv[i] > 0 || scratch > 0;
            // a CUDA device's prompt products allocate their own tiles: scratch that the
            // engine's buffer does not hold
            let tiles = match &a.scratch {
                None if active => self.scratch.cuda_tiles(hosts[i], dev.kind),
                _ => 0,
            };
            // and a quantising load there quantises each chunk on the device from a scratch
            // copy of its source rows, never during a forward pass: the larger of the two
            let kernel_scratch = tiles.max(self.quantize_scratch(a, i));
            scratch = scratch.saturating_add(kernel_scratch);
            let (overhead, overhead_parts) = if active {
                (dev.overhead.total(), dev.overhead.parts().to_vec())
            } else {
                (0, Vec::new())
            };
            let mut holds = self.held_parts(a, i, &layer_sets[i]);
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
            if let Some((_, p)) = onload_here {
                let layers: Vec<u32> = p.groups.iter().flatten().copied().collect();
                holds.push(format!(
                    "{} onload slot(s) of {} for layers {} (offload={}, {} group(s))",
                    p.slots,
                    fmt_bytes(p.slot_bytes),
                    crate::plan::ranges(&to_ranges(layers.iter().copied())),
                    p.mode.name(),
                    p.groups.len()
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
                kernel_scratch,
                overhead,
                overhead_parts,
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
                let mut what = self.what(&usage, if i == self.host { staging } else { 0 });
                let without = used.saturating_sub(usage.overhead);
                if usage.overhead > 0 && without <= dev.limit {
                    what.push_str(&format!(
                        "; the fixed overhead is what does not fit: the rest takes {} of {}, and \
                         the device holds the overhead whatever is placed on it",
                        fmt_bytes(without),
                        fmt_bytes(dev.limit)
                    ));
                }
                shortfalls.push(Shortfall {
                    device: dev.name.clone(),
                    needed: used,
                    available: dev.limit,
                    what,
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
        warnings.extend(self.unmatched_overrides());
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
            quantize: self.req.quantize,
            cache: self.cache,
            runtime: self.runtime,
            tensors: placements,
            layers: a.layer_dev.iter().map(|&d| name(d)).collect(),
            embed_device: name(a.embed_dev),
            head_device: name(a.head_dev),
            tied_output: a.tied_copy.iter().map(|&(d, b)| (name(d), b)).collect(),
            tp: a.tp.clone(),
            devices,
            host,
            warnings,
            onload: onload.map(|(_, p)| p),
        })
    }

    /// Offloaded execution ([`crate::onload`]): the layers kept on cpu or disk, grouped, to
    /// execute on the first accelerator; `None` without `offload`.
    fn onload(&self, a: &Assign) -> Result<Option<(usize, OnloadPlan)>> {
        let Some(mode) = self.req.offload else {
            return Ok(None);
        };
        if a.tp.is_some() {
            return Err(PlanError::option(
                "offload",
                "a layer strategy (offloading moves whole layers)",
                "strategy='tensor_parallel'",
            ));
        }
        let Some(&exec) = self.accel.first() else {
            return Err(PlanError::option(
                "offload",
                "an accelerator to execute offloaded layers on (cuda:N or virtual:SIZE in \
                 devices); without one, leave offload=None and the cpu computes its layers",
                format!("offload='{}' with no accelerator", mode.name()),
            ));
        };
        let layers: Vec<u32> = (0..self.n_layers() as u32)
            .filter(|&l| {
                let d = a.layer_dev[l as usize];
                d == self.host || Some(d) == self.disk
            })
            .collect();
        let mut matrices = vec![0u64; self.n_layers()];
        for (i, t) in self.tensors().iter().enumerate() {
            if let Some(l) = t.layer
                && copied_to_slot(t)
                && let Some(m) = matrices.get_mut(l as usize)
            {
                *m = m.saturating_add(self.held_type(i, a.tensor_dev[i]).1);
            }
        }
        let name = self.devs[exec].name.clone();
        Ok(Some((
            exec,
            OnloadPlan::new(mode, name, &layers, &matrices),
        )))
    }

    /// The named non-layer parts device `i` holds, in the order explain() lists them: whole
    /// tensors by name, row slices as `rows A..B of NAME`, and for row split the layers whose
    /// matrices it holds slices of without holding the layer (`row slices of layers A-B`).
    fn held_parts(&self, a: &Assign, i: usize, layers_here: &[u32]) -> Vec<String> {
        let mut parts: Vec<String> = Vec::new();
        let mut add = |p: String| {
            if !parts.contains(&p) {
                parts.push(p);
            }
        };
        for (role, label) in [
            (Role::TokenEmbd, "token_embd"),
            (Role::OutputNorm, "output_norm"),
            (Role::Output, "output"),
        ] {
            for (t, ti) in self.tensors().iter().enumerate() {
                if self.roles[t] != Some(role) || ti.layer.is_some() {
                    continue;
                }
                match &a.splits[t] {
                    None if a.tensor_dev[t] == i => add(label.to_string()),
                    None => {}
                    Some((axis, replicated, shards)) => {
                        for &(_, start, end, _) in shards.iter().filter(|x| x.0 == i) {
                            add(if *replicated {
                                label.to_string()
                            } else {
                                let what = if *axis == 0 { "rows" } else { "columns" };
                                format!("{what} {start}..{end} of {label}")
                            });
                        }
                    }
                }
            }
        }
        let sliced: Vec<u32> = (0..self.n_layers() as u32)
            .filter(|l| !layers_here.contains(l))
            .filter(|&l| {
                self.tensors().iter().enumerate().any(|(t, ti)| {
                    ti.layer == Some(l)
                        && a.splits[t]
                            .as_ref()
                            .is_some_and(|(_, rep, shards)| !rep && shards.iter().any(|x| x.0 == i))
                })
            })
            .collect();
        if !sliced.is_empty() {
            add(format!(
                "row slices of layers {}",
                crate::plan::ranges(&to_ranges(sliced))
            ));
        }
        // llama.cpp's --n-cpu-moe and `-ot exps=cpu`: experts held here while their layer
        // computes elsewhere (they are computed where they are held, on the routed tokens)
        let experts: Vec<u32> = (0..self.n_layers() as u32)
            .filter(|l| a.layer_dev.get(*l as usize) != Some(&i))
            .filter(|&l| {
                self.tensors().iter().enumerate().any(|(t, ti)| {
                    ti.layer == Some(l)
                        && self.roles[t].is_some_and(Role::is_expert)
                        && a.splits[t].is_none()
                        && a.tensor_dev[t] == i
                })
            })
            .collect();
        if !experts.is_empty() {
            add(format!(
                "experts of layers {}",
                crate::plan::ranges(&to_ranges(experts))
            ));
        }
        parts
    }

    /// `"layers 12-29 + output: 3.10 GiB weights + 1.20 GiB kv at ctx 8192 (fp16) + 0.50 GiB
    /// scratch"`; a device that holds no part of the model says so and lists what it
    /// allocates anyway (`"no model weights, but 8.00 MiB host staging buffers ..."`).
    pub(super) fn what(&self, u: &DeviceUsage, staging: u64) -> String {
        let placed = !u.layers.is_empty() || !u.holds.is_empty() || u.weights > 0;
        let mut parts = Vec::new();
        if placed {
            parts.push(format!("{} weights", fmt_bytes(u.weights)));
        }
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
            parts.push(format!("{} kv{ctx}", fmt_bytes(u.kv)));
        }
        let compute = u.scratch.saturating_sub(staging);
        if compute > 0 {
            parts.push(format!("{} scratch", fmt_bytes(compute)));
        }
        if staging > 0 {
            parts.push(format!(
                "{} host staging buffers for uploads to the accelerators",
                fmt_bytes(staging)
            ));
        }
        if u.overhead > 0 {
            parts.push(format!(
                "{} fixed overhead ({})",
                fmt_bytes(u.overhead),
                crate::overhead::describe(&u.overhead_parts)
            ));
        }
        if u.reserve > 0 {
            parts.push(format!("{} reserve", fmt_bytes(u.reserve)));
        }
        match (placed, parts.is_empty()) {
            (true, _) => format!("{}: {}", crate::plan::describe_holds(u), parts.join(" + ")),
            (false, true) => "nothing placed yet".to_string(),
            (false, false) => format!("no model weights, but {}", parts.join(" + ")),
        }
    }
}

impl Ctx<'_> {
    /// A warning for each `-ot` rule the caller gave that matches no tensor: llama.cpp's
    /// `exps=CPU` habit on a safetensors folder, whose names are transformers', would otherwise
    /// change nothing without a word.
    fn unmatched_overrides(&self) -> Vec<String> {
        let rules = match &self.req.strategy {
            Strategy::Layers(o) => &o.overrides,
            Strategy::Map(m) => &m.overrides,
            _ => return Vec::new(),
        };
        let names = || self.tensors().iter().map(|t| t.name.as_str());
        let like = names().nth(self.tensors().len() / 2).unwrap_or_default();
        self.overrides(rules)
            .unwrap_or_default()
            .iter()
            .zip(rules)
            .filter(|((re, _), _)| !names().any(|n| re.is_match(n)))
            .map(|(_, (pattern, dev))| {
                format!(
                    "the override '{pattern}={dev}' matches no tensor of this checkpoint, whose \
                     names read like '{like}'"
                )
            })
            .collect()
    }
}
