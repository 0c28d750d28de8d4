//! The final assembly: an assignment becomes per-device usage (weights, KV or offload slots,
//! compute scratch, host staging, overhead, reserve), each device is checked against its
//! budget, and the result is a [`Plan`] with its host usage and warnings, or an out-of-memory
//! report naming every short device.

use weightlift_format::Role;

use super::{Assign, Ctx, Slots, union};
use crate::device::DeviceKind;
use crate::error::{OutOfMemory, PlanError, Result, Shortfall};
use crate::plan::{DeviceUsage, HostUsage, Plan, Shard, TensorPlacement, TensorSplit, to_ranges};
use crate::size::fmt_bytes;
use crate::workspace::Hosts;

impl Ctx<'_> {
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
    pub(super) fn what(&self, u: &DeviceUsage, staging: u64) -> String {
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
