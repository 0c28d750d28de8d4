//! What a model holds per device (weights, cache, scratch, the TP context's buffers) and the
//! devices' own accounting of what is allocated now and at peak.

use std::sync::Arc;

use super::{Held, Model};
use crate::device::{Device, DeviceKind};

impl Model {
    /// Bytes held per device name, every device of the inventory listed (and `disk` when used):
    /// weights (mmap views count on `cpu`, as page cache), cache layers and reserved scratch.
    pub fn memory(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .inventory
            .all()
            .iter()
            .map(|d| (d.name().to_owned(), 0))
            .collect();
        let mut add = |name: &str, b: u64| match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v += b,
            None => out.push((name.to_owned(), b)),
        };
        if let Some(s) = &self.state {
            for h in &s.held {
                match h {
                    Held::Whole { tensor, device } => add(device, tensor.nbytes()),
                    Held::Split { parts, .. } => parts
                        .iter()
                        .for_each(|t| add(t.device().name(), t.nbytes())),
                }
            }
            for (_, h) in &s.copies {
                match h {
                    Held::Whole { tensor, .. } => add(tensor.device().name(), tensor.nbytes()),
                    Held::Split { parts, .. } => parts
                        .iter()
                        .for_each(|t| add(t.device().name(), t.nbytes())),
                }
            }
            for b in &s.scratch {
                add(b.device().name(), b.len() as u64);
            }
            if let Some(tp) = &s.tp {
                let tp = tp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for (n, b) in tp.memory() {
                    add(&n, b);
                }
            }
            for c in s.cache.iter().chain(&s.sequences) {
                for (n, b) in c.memory() {
                    add(&n, b);
                }
            }
        }
        out
    }

    /// Anonymous bytes currently held per device (arena/heap accounting, no mmap views).
    pub fn device_usage(&self) -> Vec<(String, u64)> {
        self.inventory
            .all()
            .iter()
            .map(|d| (d.name().to_owned(), d.used()))
            .collect()
    }

    /// The most anonymous bytes held at once per device since the last load began (weights,
    /// cache, scratch and anything a forward pass allocated): what the plan's columns promise.
    pub fn peak_memory(&self) -> Vec<(String, u64)> {
        self.inventory
            .all()
            .iter()
            .map(|d| (d.name().to_owned(), d.peak()))
            .collect()
    }

    /// The accelerators (in order) and cpu, as devices.
    pub fn devices(&self) -> Vec<Arc<Device>> {
        self.inventory.all()
    }

    /// True when every device is an accelerator of kind `kind`.
    pub fn has_kind(&self, kind: DeviceKind) -> bool {
        self.inventory
            .accelerators()
            .iter()
            .any(|d| d.kind() == kind)
    }
}
