//! Carrying out a [`Placement`]: whole tensors through the streaming loader, split tensors cut
//! from the mmap (or quantised shard by shard) and copied to their devices, then the copies,
//! the scratch and the tensor-parallel context; on failure everything is freed.

use std::sync::{Arc, Mutex};

use weightlift_format::{DType, TensorInfo};

use super::{Held, Model, Placement, SplitSpec, State};
use crate::cache::Cache;
use crate::device::{Device, DeviceTensor};
use crate::error::{EngineError, Result, invalid};
use crate::loader::{LoadOptions, Progress, TensorTarget, load};

impl Model {
    /// Load by `placement`. A lazy `cache` is allocated layer by layer, on each layer's device,
    /// as the layer's weights land. Split tensors are then cut from the mmap and copied to their
    /// devices. On any failure or cancellation, everything allocated by this call (weights and
    /// cache layers) is freed before returning.
    pub fn load(
        &mut self,
        placement: &Placement,
        opts: &LoadOptions,
        cache: Option<&Arc<Cache>>,
        validate: bool,
        progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    ) -> Result<()> {
        self.unload();
        for d in self.inventory.all() {
            d.reset_peak();
        }
        let result = self.load_inner(placement, opts, cache, validate, progress);
        if result.is_err()
            && let Some(c) = cache
        {
            c.free();
        }
        result
    }

    fn load_inner(
        &mut self,
        placement: &Placement,
        opts: &LoadOptions,
        cache: Option<&Arc<Cache>>,
        validate: bool,
        progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    ) -> Result<()> {
        if let Some(spec) = self.source.spec() {
            crate::forward::check_runs(&spec.architecture)?;
        }
        crate::forward::check_rope(self.source.as_ref())?;
        let infos = self.source.tensors();
        if placement.tensors.len() != infos.len() {
            return Err(invalid(
                "placement",
                format!("{} tensors", infos.len()),
                placement.tensors.len(),
            ));
        }
        let mut warnings = if validate {
            crate::validate::validate(self.source.as_ref())?
        } else {
            Vec::new()
        };
        let layer_devs: Vec<Arc<Device>> = placement
            .layers
            .iter()
            .map(|n| self.resolve(n))
            .collect::<Result<_>>()?;
        let mut targets = Vec::with_capacity(infos.len());
        for (info, place) in infos.iter().zip(&placement.tensors) {
            if place.split.is_some() {
                // A ggml block type quantises shard by shard; LLM.int8's scales and outlier
                // columns span whole rows, and nothing else converts per shard.
                let per_shard =
                    place.dtype != DType::INT8 && crate::convert::quantizing(info, place.dtype);
                if place.dtype != info.dtype && !per_shard {
                    return Err(EngineError::Unsupported {
                        what: format!("converting split tensor '{}' to {}", info.name, place.dtype),
                        detail: "split tensors are held in their stored dtype, or quantised \
                                 shard by shard from a float matrix to a ggml block type"
                            .into(),
                    });
                }
                targets.push(None);
                continue;
            }
            if place.device == "disk" && place.dtype != info.dtype {
                return Err(invalid(
                    format!("tensor '{}' on disk", info.name),
                    format!("its stored dtype {}", info.dtype),
                    place.dtype,
                ));
            }
            targets.push(Some(TensorTarget {
                device: self.resolve(&place.device)?,
                dtype: place.dtype,
                // Weights left on disk stay views of the file whatever use_mmap says.
                mapped: place.device == "disk",
            }));
        }
        if let Some(c) = cache
            && c.n_layers() != layer_devs.len()
        {
            return Err(invalid(
                "cache",
                format!("{} layers", layer_devs.len()),
                c.n_layers(),
            ));
        }
        let bytes_total: u64 = infos.iter().map(|t| t.nbytes).sum::<u64>()
            + placement
                .copies
                .iter()
                .filter_map(|(i, _)| infos.get(*i))
                .map(|t| t.nbytes)
                .sum::<u64>();
        let cpu = Arc::clone(self.inventory.cpu());
        let tp = placement.forward.as_ref().and_then(|f| f.tp.as_ref());
        let mut done = 0u64;
        let loaded = load(
            &self.source,
            &targets,
            opts,
            &mut |p| {
                done = p.bytes_done;
                progress(&Progress { bytes_total, ..*p })
            },
            &mut |layer| match (cache, layer_devs.get(layer as usize)) {
                (Some(c), Some(d)) if tp.is_none() => c.allocate_layer(layer as usize, d, &cpu),
                _ => Ok(()),
            },
        )?;
        let rank = placement.forward.as_ref().and_then(|f| f.rank.as_ref());
        match (cache, tp, rank) {
            // Tensor parallelism: each device holds its kv heads of every layer.
            (Some(c), Some(t), None) => c.allocate_tp(&self.tp_cache_parts(t)?)?,
            // One rank of a multi-process run: its own kv heads.
            (Some(c), Some(t), Some(r)) => c.allocate_tp_rank(self.tp_cache_share(t, r)?)?,
            // Layers without tensors of their own (or all split) still get their cache slot.
            (Some(c), None, _) => {
                for (l, d) in layer_devs.iter().enumerate() {
                    c.allocate_layer(l, d, &cpu)?;
                }
            }
            (None, _, _) => {}
        }
        warnings.extend(loaded.warnings);
        let mut held = Vec::with_capacity(infos.len());
        let mut report = |done: &mut u64, name: &str, dev: &str, n: u64| -> Result<()> {
            *done += n;
            if progress(&Progress {
                bytes_done: *done,
                bytes_total,
                tensor: name,
                device: dev,
            }) {
                Ok(())
            } else {
                Err(EngineError::Cancelled {
                    bytes_done: *done,
                    bytes_total,
                })
            }
        };
        for ((i, t), place) in loaded
            .tensors
            .into_iter()
            .enumerate()
            .zip(&placement.tensors)
        {
            match (t, &place.split) {
                (Some(tensor), _) => held.push(Held::Whole {
                    tensor,
                    device: place.device.clone(),
                }),
                (None, Some(spec)) => {
                    let info = &infos[i];
                    held.push(self.load_split(i, spec, place.dtype)?);
                    report(&mut done, &info.name, &place.device, info.nbytes)?;
                }
                (None, None) => {
                    return Err(EngineError::Device {
                        device: place.device.clone(),
                        detail: format!("tensor '{}' was not loaded", infos[i].name),
                    });
                }
            }
        }
        let mut copies = Vec::new();
        for (i, place) in &placement.copies {
            let info = infos.get(*i).ok_or_else(|| {
                invalid(
                    "tensor copy",
                    format!("a tensor index below {}", infos.len()),
                    i,
                )
            })?;
            let copy = match &place.split {
                Some(spec) => self.load_split(*i, spec, place.dtype)?,
                None => {
                    let device = self.resolve(&place.device)?;
                    // A converted or quantised original is copied as held, so the copy has the
                    // type (and the bytes) the plan counted.
                    let converted = match held.get(*i) {
                        Some(Held::Whole { tensor, .. })
                            if place.dtype != info.dtype && tensor.dtype() == place.dtype =>
                        {
                            Some(tensor.to_host()?)
                        }
                        _ => None,
                    };
                    let (dtype, bytes) = match &converted {
                        Some(b) => (place.dtype, &b[..]),
                        None => (info.dtype, self.source.bytes(*i)),
                    };
                    let tensor =
                        DeviceTensor::from_host(&device, info.shape.clone(), dtype, bytes)?;
                    Held::Whole {
                        tensor,
                        device: place.device.clone(),
                    }
                }
            };
            copies.push((*i, copy));
            report(&mut done, &info.name, &place.device, info.nbytes)?;
        }
        let mut scratch = Vec::new();
        let tp_ctx = match (tp, &placement.forward) {
            (Some(t), Some(f)) => Some(self.tp_context(t, f, &placement.scratch)?),
            _ => None,
        };
        for (dev, bytes) in &placement.scratch {
            // Under tensor parallelism the context holds the accelerators' scratch and the
            // host's staging buffers; the host keeps the rest (the load's staging).
            let bytes = match &tp_ctx {
                Some(c) => bytes
                    .saturating_sub(c.memory().iter().find(|(n, _)| n == dev).map_or(0, |x| x.1)),
                None => *bytes,
            };
            if bytes > 0 && dev != "disk" {
                scratch.push(self.resolve(dev)?.alloc(bytes)?);
            }
        }
        let mut locked = crate::mlock::Locked::default();
        if opts.mlock {
            let mapped = held.iter().filter_map(|h| match h {
                Held::Whole { tensor, .. } if tensor.is_mapped() => tensor.host_bytes(),
                _ => None,
            });
            let (l, warning) = crate::mlock::Locked::lock(mapped);
            locked = l;
            warnings.extend(warning);
        }
        self.state = Some(State {
            locked,
            graph: None,
            forward: placement.forward.clone(),
            onload: placement.onload.clone(),
            tp: tp_ctx.map(|c| Arc::new(Mutex::new(c))),
            tp_graph: None,
            held,
            copies,
            scratch,
            layer_devices: placement.layers.clone(),
            cache: cache.cloned(),
            cache_made: false,
            sequences: Vec::new(),
            warnings,
        });
        Ok(())
    }

    /// Cut tensor `i` into `spec`'s shards, each held as `dtype`: its stored type, or a ggml
    /// block type each shard is quantised to from the stored rows.
    fn load_split(&self, i: usize, spec: &SplitSpec, dtype: DType) -> Result<Held> {
        let stored = &self.source.tensors()[i];
        let bytes = self.source.bytes(i);
        // A stacked `[experts, rows, columns]` tensor cut along its experts (expert
        // parallelism) is cut as the `[experts · rows, columns]` matrix it is in memory.
        let (flat, per) = match *stored.shape.as_slice() {
            [e, r, c] if spec.axis == 0 => (
                Some(TensorInfo {
                    shape: vec![e.saturating_mul(r), c],
                    ..stored.clone()
                }),
                r,
            ),
            _ => (None, 1),
        };
        let info = flat.as_ref().unwrap_or(stored);
        let mut parts = Vec::with_capacity(spec.shards.len());
        for (dev, a, b) in &spec.shards {
            let device = self.resolve(dev)?;
            let (a, b) = (&a.saturating_mul(per), &b.saturating_mul(per));
            let (shape, data) = match (spec.replicated, dtype == info.dtype) {
                (true, true) => (info.shape.clone(), bytes.to_vec()),
                (false, true) => slice_tensor(info, bytes, spec.axis, *a, *b)?,
                (true, false) => {
                    let rows = info.shape.first().copied().unwrap_or(0);
                    crate::convert::quantize_shard(info, bytes, 0, 0, rows, dtype)?
                }
                (false, false) => {
                    crate::convert::quantize_shard(info, bytes, spec.axis, *a, *b, dtype)?
                }
            };
            let shape = match (flat.is_some(), shape.as_slice()) {
                (true, &[rows, c]) => vec![rows / per.max(1), per, c],
                _ => shape,
            };
            parts.push(DeviceTensor::from_host(&device, shape, dtype, &data)?);
        }
        Ok(Held::Split {
            parts,
            spec: spec.clone(),
        })
    }
}

/// Rows (`axis` 0) or columns (`axis` 1) `start..end` of a 1-D or 2-D tensor. Column cuts of
/// block-quantised data must fall on block boundaries.
fn slice_tensor(
    info: &TensorInfo,
    bytes: &[u8],
    axis: u8,
    start: u64,
    end: u64,
) -> Result<(Vec<u64>, Vec<u8>)> {
    let bad = |what: &str| EngineError::Unsupported {
        what: format!(
            "splitting tensor '{}' ({}, shape {:?})",
            info.name, info.dtype, info.shape
        ),
        detail: what.to_owned(),
    };
    let (rows, cols, one_d) = match *info.shape.as_slice() {
        [r, c] => (r, c, false),
        [c] => (1, c, true),
        _ => return Err(bad("only 1-D and 2-D tensors split")),
    };
    let row_bytes = info
        .dtype
        .bytes_for(cols)
        .ok_or_else(|| bad("rows are not whole blocks"))? as usize;
    if axis == 0 && !one_d {
        let (r0, r1) = (start.min(rows), end.min(rows).max(start.min(rows)));
        return Ok((
            vec![r1 - r0, cols],
            bytes[r0 as usize * row_bytes..r1 as usize * row_bytes].to_vec(),
        ));
    }
    let (c0, c1) = (start.min(cols), end.min(cols).max(start.min(cols)));
    let bs = info.dtype.block_size();
    if c0 % bs != 0 || (c1 % bs != 0 && c1 != cols) {
        return Err(bad(&format!(
            "columns {c0}..{c1} do not fall on {bs}-element block boundaries"
        )));
    }
    let b0 = (c0 / bs * info.dtype.type_size()) as usize;
    let b1 = (c1.div_ceil(bs) * info.dtype.type_size()) as usize;
    let mut out = Vec::with_capacity(rows as usize * (b1 - b0));
    for r in 0..rows as usize {
        out.extend_from_slice(&bytes[r * row_bytes + b0..r * row_bytes + b1]);
    }
    let shape = if one_d {
        vec![c1 - c0]
    } else {
        vec![rows, c1 - c0]
    };
    Ok((shape, out))
}
