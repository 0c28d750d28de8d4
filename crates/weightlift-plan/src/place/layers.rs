//! llama.cpp's `layers` strategy: the last `n_gpu_layers` repeating layers (and the output
//! layer when `n_gpu_layers > n_layer`) on the GPUs, spread by the cumulative `tensor_split`
//! with `upper_bound`; the input layer stays on the CPU. `split_mode="row"` keeps each
//! offloaded layer on `main_gpu` and splits its 2-D matrices' rows across the GPUs. With disk
//! allowed, a host too small for its share streams part of it from disk.

use weightlift_format::{Role, TensorInfo};

use super::{Assign, Ctx, UnitKind};
use crate::error::{PlanError, Result};
use crate::request::{LayerOptions, SplitMode};

impl Ctx<'_> {
    /// llama.cpp `llama_model::load_tensors`: the last `n_gpu_layers` repeating layers (and the
    /// output layer when `n_gpu_layers > n_layer`) go to the GPUs; the input layer stays on the
    /// CPU.
    pub(super) fn layers(&self, o: &LayerOptions) -> Result<Assign> {
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
                    devs.iter()
                        .map(|&d| self.devs[d].free_memory() as f32)
                        .collect()
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
        self.tie_head(&mut a);
        // `-ot` rules move single tensors after the layers are placed, as llama.cpp applies
        // them over -ngl's buffer types.
        let mut rules = o.overrides.clone();
        if let Some(n) = self.tweak.n_cpu_moe {
            rules.extend(crate::PlanOptions::moe_overrides(n));
        }
        let overrides = self.overrides(&rules)?;
        for (i, t) in self.tensors().iter().enumerate() {
            if let Some((_, d)) = overrides.iter().find(|(re, _)| re.is_match(&t.name)) {
                a.tensor_dev[i] = *d;
            }
        }
        if o.split_mode == SplitMode::Row && !self.accel.is_empty() {
            // ggml-cuda's split buffer: row boundaries at nrows × cumulative split, rounded down.
            let mut starts = vec![0f32];
            starts.extend(cum.iter().take(cum.len().saturating_sub(1)).copied());
            let round = o.row_rounding.max(1);
            for (i, t) in self.tensors().iter().enumerate() {
                if !self.splits_by_rows(t, &a, i) {
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
        // The host's share, in the order it goes to disk when the host is short: the input
        // embedding first (a lookup reads only the rows of the tokens), then the host's other
        // units from the last, as accelerate leaves the last modules on disk.
        let on_host = |u: usize| {
            let unit = &self.units[u];
            !unit.tensors.is_empty() && unit.tensors.iter().all(|&t| a.tensor_dev[t] == self.host)
        };
        let embed = self.units.iter().position(|u| u.kind == UnitKind::Embed);
        let spill: Vec<usize> = embed
            .into_iter()
            .chain((0..self.units.len()).rev().filter(|&u| Some(u) != embed))
            .filter(|&u| on_host(u))
            .collect();
        self.spill_host_to_disk(&mut a, &spill);
        Ok(a)
    }

    /// Whether row split cuts tensor `i` across the GPUs: a 2-D matrix of an offloaded layer,
    /// or the offloaded output matrix. Norms, biases and host tensors stay whole.
    fn splits_by_rows(&self, t: &TensorInfo, a: &Assign, i: usize) -> bool {
        let on_gpu = self.devs[a.tensor_dev[i]].kind.is_accelerator();
        let matrix = t.layer.is_some() || self.roles[i] == Some(Role::Output);
        on_gpu && matrix && t.shape.len() == 2
    }
}
