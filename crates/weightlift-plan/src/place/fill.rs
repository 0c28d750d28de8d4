//! The greedy fill behind `autosplit` (exllamav2 `load_autosplit`) and `sequential` /
//! `balanced` / `balanced_low_0` (accelerate `infer_auto_device_map`): units in order, each on
//! the first device of the fill order with room for it, never revisiting a device. The two
//! differ only where [`FillMode`] says (the embedding on the CPU and a tied head's own copy for
//! exllamav2; the largest-remaining-layer headroom and tied parameters kept together for
//! accelerate), so they are one algorithm in two modes. A fill that runs out returns an
//! [`Overflow`] for `run` to report.

use super::{Assign, Ctx, Slots, UnitKind, union};
use crate::device::DeviceKind;
use crate::size::fmt_bytes;
use crate::workspace::Hosts;

impl Ctx<'_> {
    pub(super) fn fill(
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
            // exllamav2 keeps the embedding on the CPU (`load_autosplit_gen`, module 0). With a
            // disk to spill to, the layers come first and the embedding goes to disk at the end
            // if the host is then too small for it: a lookup reads only the rows of the tokens.
            if unit.kind == UnitKind::Embed && mode == FillMode::Exl {
                if self.disk.is_none() {
                    used[self.host] = used[self.host].saturating_add(unit.weights);
                }
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
                if tied && self.exec_dev(d) == self.exec_dev(a.embed_dev) {
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
                    return Err(self.overflow(a, ui, &order, mode, rule, size));
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
                    .saturating_sub(self.scratch.charged(projected, dev.kind))
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
            if tied && self.exec_dev(d) != self.exec_dev(a.embed_dev) {
                a.tied_copy = vec![(d, self.tied_bytes)];
            }
        }
        if mode == FillMode::Exl
            && let Some(e) = self.units.iter().position(|u| u.kind == UnitKind::Embed)
        {
            self.spill_host_to_disk(&mut a, &[e]);
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
        size: u64,
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
        let unit = match self.units[from].kind {
            UnitKind::Embed => "the input embedding".to_string(),
            UnitKind::Layer(l) => format!("layer {l}"),
            UnitKind::Norm => "the output norm".to_string(),
            UnitKind::Output => "the output layer".to_string(),
        };
        let stopped = format!("{unit} ({}) fits on no device left", fmt_bytes(size));
        let note = if why.is_empty() {
            (stopped, 0)
        } else {
            (
                format!("{stopped}: {}", why.join("; ")),
                rule.cap.saturating_add(rule.headroom),
            )
        };
        a.head_dev = last;
        Box::new(Overflow { assign: a, note })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FillMode {
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

pub(super) struct Overflow {
    pub(super) assign: Assign,
    /// Why the fill stopped, and the bytes the rules withheld (added to the report's need).
    pub(super) note: (String, u64),
}
