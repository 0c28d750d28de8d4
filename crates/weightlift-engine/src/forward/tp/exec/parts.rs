//! The tensor-parallel graph as the backends read it: each device's matrices as parts of the
//! split held tensors, and its norms and biases where it reads them.

use super::*;

/// The backends a tensor-parallel pass computes on.
#[derive(Debug)]
pub(crate) enum Backends {
    /// Host devices through the CPU backend, one per device.
    Cpu(Vec<CpuBackend>),
    /// Every device is `cuda:N` and computes on its own backend.
    Cuda,
}

#[derive(Debug)]
pub(super) struct AttnParts {
    pub(super) norm: Floats,
    pub(super) q: Linear,
    pub(super) k: Linear,
    pub(super) v: Linear,
    pub(super) o: Linear,
    pub(super) qk_norm: Option<[Floats; 2]>,
    pub(super) q_heads: usize,
    pub(super) kv_heads: usize,
    pub(super) cache_part: usize,
    /// The layer's sliding window (0: full attention).
    pub(super) window: usize,
    /// The layer's own RoPE angles, else the workspace's table.
    pub(super) rope: Option<Floats>,
}

impl AttnParts {
    /// This share's attention block for layer `li` on the tokens of `seqs` (one sequence, or a
    /// batch's), `(cache parts, first position, tokens)` each in row order: the products over
    /// all their rows (as `cx.pieces` allows), RoPE, the cache stores and attention per sequence
    /// on its own part of its cache. The partial sum of `o_proj` lands in `r.xn`.
    pub(super) fn run_seqs<B: Exec>(
        &self,
        (b, cx): (&B, &Ctx<'_>),
        li: usize,
        seqs: &[(&[crate::cache::TpPart], usize, usize)],
        r: &mut Regions<'_, B::Buffer>,
    ) -> Result<()> {
        let share = AttnShare {
            norm: &self.norm,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            o: &self.o,
            qk_norm: self.qk_norm.as_ref(),
            n_heads: self.q_heads,
            kv_heads: self.kv_heads,
            rope: self.rope.as_ref(),
            window: self.window,
        };
        let mut pieces = Vec::with_capacity(seqs.len());
        for &(parts, pos, n) in seqs {
            let part = parts.get(self.cache_part).ok_or_else(|| {
                invalid(
                    format!("tp cache part {}", self.cache_part),
                    "a part of the cache holding this device's kv heads",
                    format!("{} parts", parts.len()),
                )
            })?;
            pieces.push(crate::forward::layer::Piece {
                cache: &part.cache,
                pos,
                n,
            });
        }
        exec::attention(b, cx, &share, li, &pieces, r)
    }
}

#[derive(Debug)]
pub(super) struct MlpParts {
    pub(super) norm: Floats,
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
}

/// A layer's shares per device (by table index), the columns of the `o_proj`/`down` biases
/// each residual owner adds, and each owner's replicas of the attention and MLP post-norms.
#[derive(Debug)]
pub(super) struct LayerParts {
    pub(super) attn: Vec<Option<AttnParts>>,
    pub(super) mlp: Vec<Option<MlpParts>>,
    /// A mixture-of-experts layer's shares, the host graph's own (their norms placed on a GPU
    /// at build).
    pub(super) experts: Vec<Option<Arc<Experts>>>,
    pub(super) o_bias: Vec<Option<Floats>>,
    pub(super) down_bias: Vec<Option<Floats>>,
    pub(super) post_norms: [Vec<Option<Floats>>; 2],
}

impl LayerParts {
    /// The table its MLP follows: the expert table for a mixture-of-experts layer, else the
    /// intermediate one (as the host graph's layer says).
    pub(super) fn mlp_table<'s>(&self, s: &'s Splits) -> &'s SplitTable {
        if self.experts.iter().any(Option::is_some) {
            &s.ex
        } else {
            &s.id
        }
    }
}

/// The tensor-parallel graph as the backends read it: the host graph's shares, with their
/// norms and biases where each device reads them (on a GPU, copies made there at build).
#[derive(Debug)]
pub(crate) struct BackendGraph {
    pub(super) backends: Backends,
    pub(super) layers: Vec<LayerParts>,
    pub(super) heads: Vec<Option<(Floats, Linear)>>,
}

/// f32 parameters `values` of tensor `index` for `device`: copied there on a GPU.
pub(in crate::forward::tp) fn floats_on(
    values: &[f32],
    index: usize,
    name: &str,
    device: &Arc<Device>,
) -> Result<Floats> {
    let mut f = Floats {
        host: values.to_vec(),
        index,
        name: name.to_owned(),
        held_on_device: false,
        device: None,
        derived: false,
    };
    if device.kind() == DeviceKind::Cuda {
        place(&mut f, &[], device)?;
    }
    Ok(f)
}

/// A device's slice of a matrix as the backend path's [`Linear`].
pub(in crate::forward::tp) fn linear_of(m: &Mat, device: &Arc<Device>) -> Result<Linear> {
    let bias = match &m.bias {
        Some(b) => Some(floats_on(b, m.index, &m.name, device)?),
        None => None,
    };
    Ok(Linear {
        slot: if m.copy {
            Slot::Copy(m.index)
        } else {
            Slot::Tensor(m.index)
        },
        name: m.name.clone(),
        rows: m.rows,
        cols: m.cols,
        bias,
        onload_at: None,
        packed: None,
        part: Some(m.part),
        rows_of: None,
    })
}

impl BackendGraph {
    /// The backend form of `g` over `devices` (by table index).
    pub(in crate::forward::tp) fn new(
        g: &TpGraph,
        devices: &[Arc<Device>],
        backends: Backends,
    ) -> Result<BackendGraph> {
        let dev = |d: usize| {
            devices
                .get(d)
                .ok_or_else(|| invalid("tp device index", format!("below {}", devices.len()), d))
        };
        let mut layers = Vec::with_capacity(g.layers.len());
        for (li, l) in g.layers.iter().enumerate() {
            let mut attn = Vec::with_capacity(devices.len());
            let mut mlp = Vec::with_capacity(devices.len());
            for d in 0..devices.len() {
                let on = dev(d)?;
                attn.push(match l.attn.get(d).and_then(Option::as_ref) {
                    Some(a) => Some(AttnParts {
                        norm: floats_on(&a.norm, a.q.index, &format!("layer {li} attn_norm"), on)?,
                        q: linear_of(&a.q, on)?,
                        k: linear_of(&a.k, on)?,
                        v: linear_of(&a.v, on)?,
                        o: linear_of(&a.o, on)?,
                        qk_norm: match &a.qk_norm {
                            Some([qn, kn]) => Some([
                                floats_on(qn, a.q.index, &format!("layer {li} q_norm"), on)?,
                                floats_on(kn, a.k.index, &format!("layer {li} k_norm"), on)?,
                            ]),
                            None => None,
                        },
                        q_heads: a.q_heads,
                        kv_heads: a.kv_heads,
                        cache_part: a.cache_part,
                        window: a.window,
                        rope: match &a.rope {
                            Some(t) => Some(floats_on(
                                t,
                                usize::MAX,
                                &format!("layer {li} rope angles"),
                                on,
                            )?),
                            None => None,
                        },
                    }),
                    None => None,
                });
                mlp.push(match l.mlp.get(d).and_then(Option::as_ref) {
                    Some(m) => Some(MlpParts {
                        norm: floats_on(
                            &m.norm,
                            m.gate.index,
                            &format!("layer {li} ffn_norm"),
                            on,
                        )?,
                        gate: linear_of(&m.gate, on)?,
                        up: linear_of(&m.up, on)?,
                        down: linear_of(&m.down, on)?,
                    }),
                    None => None,
                });
            }
            let columns = |bias: &Option<Vec<f32>>, what: &str| -> Result<Vec<Option<Floats>>> {
                let mut out: Vec<Option<Floats>> = (0..devices.len()).map(|_| None).collect();
                if let Some(b) = bias {
                    for &(d, a, e) in &g.splits.rs {
                        let cols = b.get(a as usize..e as usize).ok_or_else(|| {
                            invalid(format!("layer {li} {what}"), format!("{e} values"), b.len())
                        })?;
                        out[d] = Some(floats_on(cols, 0, &format!("layer {li} {what}"), dev(d)?)?);
                    }
                }
                Ok(out)
            };
            // a device's experts run in its workspace's regions (see `check_moe_workspace`)
            for (d, x) in l.experts.iter().enumerate() {
                if let (Some(x), Some(w)) = (x, g.layouts.get(d)) {
                    exec::check_moe_workspace(dev(d)?, &w.base, &x.moe, li)?;
                }
            }
            let replicas = |norm: &Option<Vec<f32>>, what: &str| -> Result<Vec<Option<Floats>>> {
                let mut out: Vec<Option<Floats>> = (0..devices.len()).map(|_| None).collect();
                if let Some(w) = norm {
                    for &(d, _, _) in &g.splits.rs {
                        out[d] = Some(floats_on(
                            w,
                            usize::MAX,
                            &format!("layer {li} {what}"),
                            dev(d)?,
                        )?);
                    }
                }
                Ok(out)
            };
            let [attn_post, ffn_post] = &l.post_norms;
            layers.push(LayerParts {
                attn,
                mlp,
                experts: l.experts.clone(),
                o_bias: columns(&l.o_bias, "attn_output bias")?,
                down_bias: columns(&l.down_bias, "ffn_down bias")?,
                post_norms: [
                    replicas(attn_post, "post_attention_norm")?,
                    replicas(ffn_post, "post_ffw_norm")?,
                ],
            });
        }
        let mut heads = Vec::with_capacity(devices.len());
        for d in 0..devices.len() {
            heads.push(match g.heads.get(d).and_then(Option::as_ref) {
                Some(h) => {
                    let on = dev(d)?;
                    Some((
                        floats_on(&h.norm, h.mat.index, "output_norm", on)?,
                        linear_of(&h.mat, on)?,
                    ))
                }
                None => None,
            });
        }
        Ok(BackendGraph {
            backends,
            layers,
            heads,
        })
    }
}
