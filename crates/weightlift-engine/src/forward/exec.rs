//! The forward pass through the kernels' [`Backend`] trait: the embedding lookup, one decoder
//! layer and the head as [`Op`]s on buffers of the device that computes them.
//!
//! Layers (and the embedding or head) on `cuda:N` run here on the device's `CudaBackend`: the
//! weights, the cache and the workspace are the device memory the loader and the plan put there,
//! viewed in place. `cpu`, `disk` and `virtual:N` run the host path of `graph.rs` (the same CPU
//! kernels called on slices, tuned for decode), or run here on the `CpuBackend` over the same
//! host memory when [`crate::Model::set_host_backend`] asks: the op sequence a GPU runs is then
//! checked on any machine, and it gives the host path's bits (the tests compare them).
//!
//! The cache is read and written in its own storage (f32, fp16, fp8 or the quantised q8/q6/q4
//! groups) through the kernels' one cache codec: the attention operation decodes rows as it
//! reads them, so no decoded copy of the cache is made. An offloaded cache lends each layer's
//! device slot (prefetched while the previous layer computes); the new rows are written there
//! and copied back to host RAM.

// A backend buffer has no lifetime in its type, so a view of memory the engine owns (a region
// of a workspace, a weight, a cache layer) is made through the kernels' unsafe view
// constructors. Each is wrapped at once in a `Part`/`PartMut` guard that borrows the memory it
// views, so the borrow checker keeps the memory alive and untouched while the view lives. A
// guard's inner buffer must never be moved out (no `mem::swap`/`replace` through a `&mut` from
// a `PartMut`): it would outlive the memory. Nothing does; the guards are private to this
// module and `graph.rs`.
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use weightlift_format::DType;
use weightlift_kernels::{
    Backend, CpuBackend, CpuBuffer, CudaBackend, CudaBuffer, FloatType, KernelError, KvFormat,
    MatvecMode, Op, QuantType, sources,
};
use weightlift_plan::Workspace;

use super::layer::{Consts, Piece, Weights, tokens};
use super::onload::SlotMem;
use super::parts::{Ffn, Floats, Layer, Linear, Moe, Slot};
use super::weights::Packing;
use super::{Compute, Copies};
use crate::device::{Buffer, DeviceTensor, Storage};
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;

mod backends;

/// A buffer of a backend, read only, for as long as `'a` borrows what it shows: a whole buffer,
/// or a view of part of one (or of engine memory) that frees nothing.
pub(crate) enum Part<'a, T> {
    Whole(&'a T),
    View(T, PhantomData<&'a T>),
}

impl<T> Deref for Part<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Part::Whole(t) => t,
            Part::View(t, _) => t,
        }
    }
}

/// As [`Part`], read and written.
pub(crate) enum PartMut<'a, T> {
    Whole(&'a mut T),
    View(T, PhantomData<&'a mut T>),
}

impl<T> Deref for PartMut<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            PartMut::Whole(t) => t,
            PartMut::View(t, _) => t,
        }
    }
}

impl<T> DerefMut for PartMut<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        match self {
            PartMut::Whole(t) => t,
            PartMut::View(t, _) => t,
        }
    }
}

/// `len` bytes of `buf` from `offset`, read only.
pub(crate) fn view<'a, B: Backend>(
    b: &B,
    buf: &'a B::Buffer,
    offset: usize,
    len: usize,
) -> weightlift_kernels::Result<Part<'a, B::Buffer>> {
    // SAFETY: the view lives in a guard that borrows `buf` for 'a, so `buf` outlives it and is
    // not written meanwhile; a `Part` only reads.
    let v = unsafe { b.view(buf, offset, len) }?;
    Ok(Part::View(v, PhantomData))
}

/// `len` bytes of `part` from `offset`, read only, for as long as the part's memory lives.
pub(crate) fn narrow<'a, B: Backend>(
    b: &B,
    part: Part<'a, B::Buffer>,
    offset: usize,
    len: usize,
) -> weightlift_kernels::Result<Part<'a, B::Buffer>> {
    match part {
        Part::Whole(t) => view(b, t, offset, len),
        Part::View(t, _) => {
            // SAFETY: `t` shows memory that 'a keeps alive and nothing writes; the narrower view
            // shows part of that same memory, and dropping `t` (a view) frees nothing.
            let v = unsafe { b.view(&t, offset, len) }?;
            Ok(Part::View(v, PhantomData))
        }
    }
}

/// Disjoint byte ranges of `buf`, read and written in place.
pub(crate) fn split<'a, B: Backend>(
    b: &B,
    buf: &'a mut B::Buffer,
    ranges: &[(usize, usize)],
) -> weightlift_kernels::Result<Vec<PartMut<'a, B::Buffer>>> {
    // SAFETY: the parts live in guards that borrow `buf` mutably for 'a, so `buf` is neither
    // used nor dropped while any part lives.
    let parts = unsafe { b.split(buf, ranges) }?;
    Ok(parts
        .into_iter()
        .map(|p| PartMut::View(p, PhantomData))
        .collect())
}

/// A backend the forward pass runs on, with the way it sees engine memory.
pub(crate) trait Exec: Backend + Sized {
    /// Whether [`MatvecMode::Q8`] multiplies weights of `ty` on this backend.
    fn q8_supports(ty: QuantType) -> bool;

    /// Whether the ops' `q8_next` hints reach anything here (the backend quantises an op's
    /// output for the next op's products); where not, the forward pass does not work them out.
    const QUANTISES_AHEAD: bool = false;

    /// The most tokens of several sequences one product of `mode` may take in `compute`
    /// (0: one product per sequence). A batch must give each sequence the bits it gets alone
    /// in exact mode, and stay within the activation quantisation's bound in fast mode; see
    /// each backend for which products keep that.
    fn shared_tokens(compute: Compute, mode: MatvecMode) -> usize;

    /// A held tensor's bytes, read in place.
    fn tensor<'a>(&self, t: &'a DeviceTensor) -> Result<Part<'a, Self::Buffer>>;

    /// f32 parameters (a norm's weight, a bias) where this backend reads them.
    fn floats<'a>(&self, f: &'a Floats, held: &'a [Held]) -> Result<Part<'a, Self::Buffer>>;

    /// An engine buffer of this device, read and written in place.
    fn whole_mut<'a>(&self, b: &'a mut Buffer) -> Result<PartMut<'a, Self::Buffer>>;

    /// Disjoint byte ranges of an engine buffer of this device, each read and written in place.
    fn regions<'a>(
        &self,
        b: &'a mut Buffer,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<PartMut<'a, Self::Buffer>>>;

    /// `len` bytes of an onload slot of this device from byte `at`, read in place.
    fn slot_view<'a>(
        &self,
        slot: &'a SlotMem<'_>,
        at: usize,
        len: usize,
    ) -> Result<Part<'a, Self::Buffer>>;
}

/// A kernel error on `device` during `what`.
pub(crate) fn kernel_on(device: &str, what: &str, e: KernelError) -> EngineError {
    EngineError::Device {
        device: device.to_owned(),
        detail: format!("{what}: {e}"),
    }
}

/// One device's workspace as buffers of its backend, region by region (the plan's layout; the
/// attention tiles of the host path are not used here, the split attention's partial results
/// are).
pub(crate) struct Regions<'a, T> {
    pub x: PartMut<'a, T>,
    pub xn: PartMut<'a, T>,
    pub q: PartMut<'a, T>,
    pub att: PartMut<'a, T>,
    pub k: PartMut<'a, T>,
    pub v: PartMut<'a, T>,
    pub gate: PartMut<'a, T>,
    pub up: PartMut<'a, T>,
    pub parts: PartMut<'a, T>,
    pub pos: PartMut<'a, T>,
    pub freqs: PartMut<'a, T>,
    pub logits: PartMut<'a, T>,
}

impl<'a, T> Regions<'a, T> {
    /// The regions of `buf`, laid out as `w`, and `slots` onload slots of `per` bytes each
    /// after the workspace (`slots` is 0 where no layer is onloaded).
    pub(crate) fn new<B: Exec<Buffer = T>>(
        b: &B,
        buf: &'a mut Buffer,
        w: &Workspace,
        (per, slots): (usize, usize),
    ) -> Result<(Self, Vec<PartMut<'a, T>>)> {
        let need = (w.bytes as usize).saturating_add(per.saturating_mul(slots));
        if buf.len() < need {
            return Err(invalid(
                "forward workspace",
                format!("{need} bytes of scratch (workspace and {slots} onload slot(s))"),
                format!(
                    "{} bytes reserved; the model was loaded for another runtime or cache",
                    buf.len()
                ),
            ));
        }
        let tail: Vec<(usize, usize)> = (0..slots)
            .map(|i| (w.bytes as usize + i * per, per))
            .collect();
        Self::with_tail(b, buf, w, &tail)
    }

    /// The regions of `buf`, laid out as `w`, and the byte ranges `tail` (outside them) as
    /// further parts, in order.
    pub(crate) fn with_tail<B: Exec<Buffer = T>>(
        b: &B,
        buf: &'a mut Buffer,
        w: &Workspace,
        tail: &[(usize, usize)],
    ) -> Result<(Self, Vec<PartMut<'a, T>>)> {
        let r = |r: weightlift_plan::Region| (r.offset as usize, r.len as usize * 4);
        let mut ranges = vec![
            r(w.x),
            r(w.xn),
            r(w.q),
            r(w.att),
            r(w.k),
            r(w.v),
            r(w.gate),
            r(w.up),
            r(w.parts),
            r(w.pos),
            r(w.freqs),
            r(w.logits),
        ];
        ranges.extend_from_slice(tail);
        let mut parts = b.regions(buf, &ranges)?;
        let tail_parts = parts.split_off(12);
        let Ok([x, xn, q, att, k, v, gate, up, split, pos, freqs, logits]) =
            <[PartMut<'a, T>; 12]>::try_from(parts)
        else {
            return Err(invalid("workspace regions", "12", "another count"));
        };
        let regions = Regions {
            x,
            xn,
            q,
            att,
            k,
            v,
            gate,
            up,
            parts: split,
            pos,
            freqs,
            logits,
        };
        Ok((regions, tail_parts))
    }
}

/// What one forward call lends the backend path.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub c: &'a Consts,
    pub held: &'a [Held],
    pub copies: &'a [(usize, Held)],
    /// The computing device's name, for errors.
    pub device: &'a str,
    /// The onload slot holding the matrices of the layer being computed, when it is offloaded.
    pub slot: Option<&'a SlotMem<'a>>,
    /// The tokens of each sequence of a batch, in row order: the products of several run in
    /// [`Ctx::runs`]. Empty (or one): every product takes all its rows at once.
    pub pieces: &'a [usize],
}

impl<'a> Ctx<'a> {
    fn err(&self, what: impl Into<String>) -> impl FnOnce(KernelError) -> EngineError + 'a {
        let what = what.into();
        let device = self.device;
        move |e| kernel_on(device, &what, e)
    }

    /// A matrix's held tensor, read in place, with how it is multiplied.
    pub(crate) fn weight<B: Exec>(
        &self,
        b: &B,
        l: &Linear,
    ) -> Result<(Part<'a, B::Buffer>, Packing)> {
        if let Some(scheme) = l.packed() {
            return Err(EngineError::Unsupported {
                what: format!("{scheme} linear '{}' on {}", l.name, self.device),
                detail: format!("{scheme} linears run on the host path only"),
            });
        }
        let held = match l.slot {
            Slot::Tensor(i) => self.held.get(i),
            Slot::Copy(c) => self.copies.get(c).map(|(_, h)| h),
        };
        let tensor = match (held, l.part) {
            (Some(Held::Whole { tensor, .. }), None) => tensor,
            (Some(Held::Split { parts, .. }), Some(p)) if p < parts.len() => &parts[p],
            _ => {
                return Err(EngineError::Unsupported {
                    what: format!("a forward pass over split tensor '{}'", l.name),
                    detail: "a split tensor runs in the tensor-parallel pass (load_tp); row \
                             splits do not run; load with a layer split (autosplit, layers, \
                             balanced)"
                        .into(),
                });
            }
        };
        let packing = Packing::of(&l.name, tensor.dtype())?;
        let (from, len) = l.byte_range(tensor.nbytes() as usize);
        if let (Some(slot), Some(at)) = (self.slot, l.onload_at) {
            return Ok((b.slot_view(slot, at, len)?, packing));
        }
        let whole = b.tensor(tensor)?;
        if l.rows_of.is_none() {
            return Ok((whole, packing));
        }
        let rows = narrow(b, whole, from, len).map_err(self.err(l.name.clone()))?;
        Ok((rows, packing))
    }

    /// Whether the products of `linears`, taken next on the same activations, read them in
    /// Q8 mode: every one a block type (not a float type, whose fast mode rounds rather than
    /// quantises) in Q8 mode here. A matrix this backend cannot multiply says no (its product
    /// reports why).
    fn q8_reads<B: Exec>(&self, b: &B, linears: &[&Linear]) -> bool {
        B::QUANTISES_AHEAD
            && self.c.compute == Compute::Fast
            && !linears.is_empty()
            && linears.iter().all(|l| match self.weight(b, l) {
                Ok((_, Packing::Blocks(ty))) => {
                    ty.block_size() > 1 && self.mode::<B>(ty) == MatvecMode::Q8
                }
                _ => false,
            })
    }

    /// The matvec mode of a `ty` product on this backend.
    pub(crate) fn mode<B: Exec>(&self, ty: QuantType) -> MatvecMode {
        if self.c.compute == Compute::Fast && B::q8_supports(ty) {
            MatvecMode::Q8
        } else {
            MatvecMode::Exact
        }
    }

    /// The row ranges `(first, count)` a batch's product of `mode` runs in: consecutive
    /// sequences together while their tokens fit [`Exec::shared_tokens`], a longer one alone.
    fn runs<B: Exec>(&self, mode: Option<MatvecMode>, n: usize) -> Result<Vec<(usize, usize)>> {
        if self.pieces.iter().sum::<usize>() != n {
            return Err(invalid(
                "a batch's product",
                format!("{n} rows, the batch's tokens"),
                format!("sequences of {:?} tokens", self.pieces),
            ));
        }
        let limit = mode.map_or(0, |m| B::shared_tokens(self.c.compute, m));
        let mut runs: Vec<(usize, usize)> = Vec::with_capacity(self.pieces.len());
        let mut at = 0;
        for &k in self.pieces {
            match runs.last_mut() {
                Some((_, m)) if *m + k <= limit => *m += k,
                _ => runs.push((at, k)),
            }
            at += k;
        }
        Ok(runs)
    }

    /// The runs a product of `l` over `n` rows splits into, or None when one product takes
    /// them all (no batch, or a batch whose rows the backend shares). The weight is looked at
    /// only for a batch, so a single sequence's products cost nothing more.
    fn split_runs<B: Exec>(
        &self,
        b: &B,
        l: &Linear,
        n: usize,
    ) -> Result<Option<Vec<(usize, usize)>>> {
        if self.pieces.len() < 2 {
            return Ok(None);
        }
        let runs = self.runs::<B>(self.mode_of(b, l)?, n)?;
        Ok((runs.len() > 1).then_some(runs))
    }

    /// This context for one run of rows: its products take them all.
    fn one_run(&self) -> Ctx<'a> {
        Ctx {
            pieces: &[],
            ..*self
        }
    }

    /// The matvec mode a product of `l` takes (None: not a block or float matrix).
    fn mode_of<B: Exec>(&self, b: &B, l: &Linear) -> Result<Option<MatvecMode>> {
        Ok(match self.weight(b, l)?.1 {
            Packing::Blocks(ty) => Some(self.mode::<B>(ty)),
            Packing::Int8 => None,
        })
    }

    /// `y_i = W_i x (+ bias_i)` for `n` tokens and several matrices of the same input (a
    /// layer's q, k and v; its gate and up), in one [`Op::MatmulShared`] when they are all
    /// block or float matrices in one mode (CUDA then quantises `x` once), else one by one;
    /// a batch's rows in its [`Ctx::runs`].
    pub(crate) fn linears<B: Exec>(
        &self,
        b: &B,
        x: &B::Buffer,
        n: usize,
        mut outs: Vec<(&Linear, &mut B::Buffer)>,
    ) -> Result<()> {
        let Some(&(first, _)) = outs.first() else {
            return Ok(());
        };
        let Some(runs) = self.split_runs(b, first, n)? else {
            return self.linears_all(b, x, n, outs);
        };
        let cols = first.cols;
        for (start, k) in runs {
            let what = || first.name.clone();
            let xv = view(b, x, start * cols * 4, k * cols * 4).map_err(self.err(what()))?;
            let mut parts = Vec::with_capacity(outs.len());
            for (l, y) in outs.iter_mut() {
                let range = [(start * l.rows * 4, k * l.rows * 4)];
                let part = split(b, &mut **y, &range).map_err(self.err(l.name.clone()))?;
                parts.push((*l, part));
            }
            let outs_k = parts
                .iter_mut()
                .flat_map(|(l, p)| p.iter_mut().map(move |y| (*l, &mut **y)))
                .collect();
            self.one_run().linears_all(b, &xv, k, outs_k)?;
        }
        Ok(())
    }

    /// [`Ctx::linears`] on all `n` rows at once.
    fn linears_all<B: Exec>(
        &self,
        b: &B,
        x: &B::Buffer,
        n: usize,
        outs: Vec<(&Linear, &mut B::Buffer)>,
    ) -> Result<()> {
        let mut held = Vec::with_capacity(outs.len());
        for (l, _) in &outs {
            held.push(self.weight(b, l)?);
        }
        // one op when every member is a block or float matrix of the same width and mode
        let types: Option<Vec<QuantType>> = held
            .iter()
            .map(|(_, p)| match p {
                Packing::Blocks(ty) => Some(*ty),
                Packing::Int8 => None,
            })
            .collect();
        let mode = types
            .as_deref()
            .and_then(|t| t.first())
            .map(|ty| self.mode::<B>(*ty));
        let (Some(types), Some(mode)) = (types, mode) else {
            return self.linears_each(b, x, n, outs);
        };
        let cols = outs[0].0.cols;
        if outs.len() < 2
            || types.iter().any(|ty| self.mode::<B>(*ty) != mode)
            || outs.iter().any(|(l, _)| l.cols != cols)
        {
            return self.linears_each(b, x, n, outs);
        }
        let mut outs = outs;
        let products = outs
            .iter_mut()
            .zip(held.iter().zip(types))
            .map(|((l, y), ((w, _), ty))| weightlift_kernels::Product {
                ty,
                rows: l.rows,
                w: &**w,
                y: &mut **y,
            })
            .collect();
        b.run(Op::MatmulShared {
            mode,
            act: FloatType::F32,
            cols,
            n_tok: n,
            max_dq_size: self.c.max_dq,
            x,
            products,
        })
        .map_err(|e| {
            let names: Vec<&str> = outs.iter().map(|(l, _)| l.name.as_str()).collect();
            kernel_on(self.device, &names.join(", "), e)
        })?;
        for (l, y) in outs {
            if let Some(bias) = &l.bias {
                self.add_bias(b, l, bias, n, y)?;
            }
        }
        Ok(())
    }

    /// `gy = silu(W_gate x) · (W_up x)` for `n` tokens in one [`Op::MatmulSwiGlu`] (`uy` is
    /// its scratch), when the gate and up are block or float matrices of one shape and mode
    /// without a bias (CUDA then writes the product in one launch for a decode step). `false`,
    /// with nothing run, when they are not: the caller runs the products and SwiGLU apart.
    fn swiglu<B: Exec>(
        &self,
        b: &B,
        x: &B::Buffer,
        n: usize,
        [gate, up]: [&Linear; 2],
        [gy, uy]: [&mut B::Buffer; 2],
    ) -> Result<bool> {
        if gate.bias.is_some() || up.bias.is_some() || gate.rows != up.rows || gate.cols != up.cols
        {
            return Ok(false);
        }
        // a batch whose products split into runs takes the separate products, which run so
        if self.split_runs(b, gate, n)?.is_some() {
            return Ok(false);
        }
        let ((gw, gp), (uw, up_p)) = (self.weight(b, gate)?, self.weight(b, up)?);
        let (Packing::Blocks(gty), Packing::Blocks(uty)) = (gp, up_p) else {
            return Ok(false);
        };
        let mode = self.mode::<B>(gty);
        if self.mode::<B>(uty) != mode {
            return Ok(false);
        }
        b.run(Op::MatmulSwiGlu {
            mode,
            act: FloatType::F32,
            cols: gate.cols,
            n_tok: n,
            max_dq_size: self.c.max_dq,
            x,
            gate: weightlift_kernels::Product {
                ty: gty,
                rows: gate.rows,
                w: &gw,
                y: gy,
            },
            up: weightlift_kernels::Product {
                ty: uty,
                rows: up.rows,
                w: &uw,
                y: uy,
            },
        })
        .map_err(|e| kernel_on(self.device, &format!("{}, {}", gate.name, up.name), e))?;
        Ok(true)
    }

    /// [`Ctx::linears`] one matrix at a time.
    fn linears_each<B: Exec>(
        &self,
        b: &B,
        x: &B::Buffer,
        n: usize,
        outs: Vec<(&Linear, &mut B::Buffer)>,
    ) -> Result<()> {
        for (l, y) in outs {
            self.linear_all(b, l, x, n, y)?;
        }
        Ok(())
    }

    /// `y = W x (+ bias)` for `n` tokens (a batch's rows in its [`Ctx::runs`]).
    pub(crate) fn linear<B: Exec>(
        &self,
        b: &B,
        l: &Linear,
        x: &B::Buffer,
        n: usize,
        y: &mut B::Buffer,
    ) -> Result<()> {
        let Some(runs) = self.split_runs(b, l, n)? else {
            return self.linear_all(b, l, x, n, y);
        };
        for (start, k) in runs {
            let xv =
                view(b, x, start * l.cols * 4, k * l.cols * 4).map_err(self.err(l.name.clone()))?;
            let mut yv = split(b, y, &[(start * l.rows * 4, k * l.rows * 4)])
                .map_err(self.err(l.name.clone()))?;
            self.one_run().linear_all(b, l, &xv, k, &mut yv[0])?;
        }
        Ok(())
    }

    /// [`Ctx::linear`] on all `n` rows at once.
    fn linear_all<B: Exec>(
        &self,
        b: &B,
        l: &Linear,
        x: &B::Buffer,
        n: usize,
        y: &mut B::Buffer,
    ) -> Result<()> {
        let (w, packing) = self.weight(b, l)?;
        let op = match packing {
            Packing::Blocks(ty) => Op::Matmul {
                ty,
                mode: self.mode::<B>(ty),
                act: FloatType::F32,
                rows: l.rows,
                cols: l.cols,
                n_tok: n,
                max_dq_size: self.c.max_dq,
                w: &*w,
                x,
                y: &mut *y,
            },
            Packing::Int8 => Op::Int8Matmul {
                rows: l.rows,
                cols: l.cols,
                n_tok: n,
                threshold: self.c.int8_threshold,
                w: &*w,
                x,
                y: &mut *y,
            },
        };
        b.run(op).map_err(self.err(l.name.clone()))?;
        if let Some(bias) = &l.bias {
            self.add_bias(b, l, bias, n, y)?;
        }
        Ok(())
    }

    /// `y += bias` on each of `n` rows of `l`'s output.
    fn add_bias<B: Exec>(
        &self,
        b: &B,
        l: &Linear,
        bias: &Floats,
        n: usize,
        y: &mut B::Buffer,
    ) -> Result<()> {
        b.run(Op::AddBias {
            n_rows: n,
            n_cols: l.rows,
            x: y,
            bias: &*b.floats(bias, self.held)?,
        })
        .map_err(self.err(format!("bias of {}", l.name)))
    }
}

/// The refusal of a mixture-of-experts layer computed on `device` through the backend op
/// sequence whose experts are neither all in host memory nor all on `device`: expert `name` is
/// held on `held_on`.
pub(crate) fn experts_split(li: usize, name: &str, held_on: &str, device: &str) -> EngineError {
    EngineError::Unsupported {
        what: format!(
            "expert '{name}' of layer {li} held on {held_on} while the layer computes on {device} \
             through the backend op sequence"
        ),
        detail: format!(
            "a mixture-of-experts layer's experts run all on the host, from host RAM or the \
             mapped file, or all on the device that computes the layer; keep them together: all \
             on the host with n_cpu_moe=N (llama.cpp's --n-cpu-moe) for the first N layers, or \
             an override such as {{\"exps\": \"cpu\"}} for GGUF names ({{\"experts\": \"cpu\"}} \
             for transformers' names), or all on {device} with the rest of the layer"
        ),
    }
}

/// Whether the workspace of `device` (laid out as `w`) holds what a mixture-of-experts block
/// computes there for `m`, a chunk's tokens at a time. With the experts on the host
/// ([`moe_on_host`]): the router's scores in the gate region. On the device
/// ([`moe_on_device`]): the gathered rows of one expert and its down product in the query
/// region, its gate and up products in the MLP's regions, the router's scores in the up
/// region, the routed rows' indices and weights in the key and value regions, and the block's
/// sums in the attention output's region. [`weightlift_plan::Dims::with_experts`] sizes them
/// all for this (the MLP regions for an expert and the expert count, the query and attention
/// output regions at least hidden-wide, the key and value regions at least as wide as the
/// experts a token uses); a workspace laid out otherwise is refused by name, before any token
/// runs.
pub(crate) fn check_moe_workspace(
    device: &crate::device::Device,
    w: &Workspace,
    m: &Moe,
    li: usize,
) -> Result<()> {
    let h = m.router.cols as u64;
    let rows = w.x.len / h.max(1);
    let widest = m.experts.iter().map(|[g, _, _]| g.rows).max().unwrap_or(0) as u64;
    let n_experts = m.n_experts() as u64;
    let needs: &[(&str, u64, u64)] = if m.experts_on_host {
        &[("MLP gate", w.gate.len, rows * n_experts)]
    } else {
        &[
            ("queries", w.q.len, rows * h),
            ("attention output", w.att.len, rows * h),
            ("MLP gate", w.gate.len, rows * widest),
            ("MLP up", w.up.len, rows * widest.max(n_experts)),
            ("keys", w.k.len, rows * m.n_used as u64),
            ("values", w.v.len, rows * m.n_used as u64),
        ]
    };
    let (side, fix) = if m.experts_on_host {
        (
            "with its experts on the host",
            "place the layer on the host",
        )
    } else {
        (
            "with its experts on the device",
            "keep the experts on the host with n_cpu_moe or an exps override",
        )
    };
    for &(region, has, need) in needs {
        if has < need {
            return Err(EngineError::Unsupported {
                what: format!(
                    "the mixture-of-experts block of layer {li} computed on {} {side} through \
                     the backend op sequence",
                    device.name()
                ),
                detail: format!(
                    "the workspace's {region} region holds {has} values and the block needs \
                     {need} ({rows} tokens); {fix}"
                ),
            });
        }
    }
    Ok(())
}

/// The host's side of the layers whose routed experts the host computes (see
/// [`moe_on_host`]): the simulated link between the computing device and host memory (a
/// virtual device's rate; `None`: no wait), and the count of the copies across it.
pub(crate) struct HostLink<'a> {
    pub rate: Option<u64>,
    pub copies: &'a mut Copies,
}

impl HostLink<'_> {
    /// A copy of `bytes` across the link, begun at `since`: paced, then counted.
    fn crossed(&mut self, bytes: usize, since: std::time::Instant) {
        crate::device::pace(self.rate, bytes as u64, since);
        self.copies.note(bytes as u64, since);
    }
}

/// The kernels' type of a weight.
pub(crate) fn kernel_type(name: &str, dtype: DType) -> Result<QuantType> {
    QuantType::from_name(dtype.name()).ok_or_else(|| EngineError::Unsupported {
        what: format!("tensor '{name}' of type {dtype}"),
        detail: "the kernels have no matrix product for it".into(),
    })
}

/// The embedding rows of `ids`, dequantised into the residual stream `x`.
pub(crate) fn embed<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    e: &Linear,
    ids: &[u32],
    x: &mut B::Buffer,
) -> Result<()> {
    let (table, ty) = match cx.weight(b, e)? {
        (t, Packing::Blocks(ty)) => (t, ty),
        (_, Packing::Int8) => {
            return Err(invalid(
                format!("embedding '{}'", e.name),
                "float or ggml rows",
                "int8 rows",
            ));
        }
    };
    let h = e.cols;
    if !h.is_multiple_of(ty.block_size()) {
        return Err(invalid(
            format!("tensor '{}'", e.name),
            format!("rows of whole {ty} blocks of {}", ty.block_size()),
            format!("rows of {h} values"),
        ));
    }
    let row_bytes = h / ty.block_size() * ty.block_bytes();
    let ranges: Vec<(usize, usize)> = (0..ids.len()).map(|t| (t * h * 4, h * 4)).collect();
    let mut rows = split(b, x, &ranges).map_err(cx.err("embedding rows"))?;
    for (row, id) in rows.iter_mut().zip(ids) {
        let src = view(b, &table, *id as usize * row_bytes, row_bytes).map_err(cx.err(&e.name))?;
        b.run(Op::Dequantize {
            ty,
            out: FloatType::F32,
            n: h,
            src: &src,
            dst: row,
        })
        .map_err(cx.err(e.name.clone()))?;
    }
    Ok(())
}

/// The cache bytes of values `at..at + n` of a cache half stored as `format` (whole groups of
/// the quantised formats: the cache's rows are), read and written in place: the rows a step
/// writes.
fn cache_rows<'a, B: Backend>(
    b: &B,
    format: KvFormat,
    cache: &'a mut B::Buffer,
    at: usize,
    n: usize,
) -> weightlift_kernels::Result<PartMut<'a, B::Buffer>> {
    format.check_values("kv store", at, n)?;
    let (b0, b1) = (format.byte_at(at), format.byte_at(at + n));
    let mut rows = split(b, cache, &[(b0, b1 - b0)])?;
    Ok(rows.remove(0))
}

/// Writes the positions `pos..pos + n` into the workspace of a device that computes layers
/// (once per chunk: every layer there reads them).
pub(crate) fn positions<B: Backend>(
    b: &B,
    device: &str,
    pos: usize,
    n: usize,
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    positions_of(b, device, &[(pos, n)], r)
}

/// [`positions`] of several sequences, `(first position, tokens)` each, one after the other.
pub(crate) fn positions_of<B: Backend>(
    b: &B,
    device: &str,
    seqs: &[(usize, usize)],
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    let n: usize = seqs.iter().map(|s| s.1).sum();
    if b.len(&r.pos) < n * 4 {
        return Ok(());
    }
    let positions = seqs
        .iter()
        .flat_map(|&(pos, n)| pos..pos + n)
        .map(|p| i32::try_from(p).map_err(|_| invalid("position", "below 2^31", p)))
        .collect::<Result<Vec<i32>>>()?;
    b.copy_from_host(bytemuck::cast_slice(&positions), &mut r.pos, 0)
        .map_err(|e| kernel_on(device, "positions", e))
}

/// One decoder layer on the tokens of `pieces` (one sequence, or a batch's, each at its own
/// positions, already in `r.pos`, see [`positions`]), in place on `r.x`: the op sequence of
/// `graph.rs`'s host `run_layer`, through the backend (`cx.pieces` holds the pieces' token
/// counts, for the products' runs). Each block's residual add is fused with the norm after it: always the
/// attention block's with the MLP norm; the MLP's with the next layer's attention norm when
/// `defer` (the next layer runs on this device right after, and is called with `pending`:
/// `r.xn` then holds this layer's MLP output, not yet added to `r.x`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    l: &Layer,
    li: usize,
    pieces: &[Piece<'_>],
    r: &mut Regions<'_, B::Buffer>,
    (pending, defer): (bool, bool),
    link: &mut HostLink<'_>,
) -> Result<()> {
    let h = cx.c.hidden;
    let n = tokens(pieces);
    let attn = AttnShare {
        norm: &l.attn_norm,
        q: &l.q,
        k: &l.k,
        v: &l.v,
        o: &l.o,
        qk_norm: l.qk_norm.as_ref(),
        n_heads: cx.c.n_heads,
        kv_heads: l.kv_heads,
        rope: l.rope.as_ref(),
        window: l.window,
    };
    if pending {
        // the previous layer's MLP residual and this layer's attention norm in one op
        add_norm(
            b,
            cx,
            &l.attn_norm,
            n,
            r,
            &[&l.q, &l.k, &l.v],
            format!("layer {li} residual and attn_norm"),
        )?;
        attention_normed(b, cx, &attn, li, pieces, r)?;
    } else {
        attention(b, cx, &attn, li, pieces, r)?;
    }
    if let Some(f) = &l.post_attn_norm {
        post_norm(b, cx, f, n, r, format!("layer {li} post_attention_norm"))?;
    }
    // the attention block's residual and the MLP's norm in one op
    // the gate and up products read the normed rows next (a dense MLP's)
    let ffn_in: Vec<&Linear> = match &l.ffn {
        Ffn::Dense { gate, up, .. } => vec![gate, up],
        Ffn::Moe(_) => Vec::new(),
    };
    add_norm(
        b,
        cx,
        &l.ffn_norm,
        n,
        r,
        &ffn_in,
        format!("layer {li} residual and ffn_norm"),
    )?;
    match &l.ffn {
        Ffn::Dense { gate, up, down } => mlp_normed(b, cx, [gate, up, down], li, n, r)?,
        Ffn::Moe(m) => {
            let lens: Vec<usize> = pieces.iter().map(|p| p.n).collect();
            moe_normed(b, cx, m, li, &lens, r, link)?;
        }
    }
    if let Some(f) = &l.post_ffn_norm {
        post_norm(b, cx, f, n, r, format!("layer {li} post_ffw_norm"))?;
    }
    if defer {
        return Ok(());
    }
    residual(b, cx, li, n * h, r)
}

/// A device's share of a mixture-of-experts block under tensor parallelism on the rows of
/// `r.x` (pieces of `lens` tokens): the MLP norm, then the block as a layer split runs it,
/// with only the experts `m` holds, so that `r.xn` gets this device's partial sum.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_share<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm_w: &Floats,
    m: &Moe,
    li: usize,
    lens: &[usize],
    r: &mut Regions<'_, B::Buffer>,
    link: &mut HostLink<'_>,
) -> Result<()> {
    let n = lens.iter().sum::<usize>();
    norm(b, cx, norm_w, n, r, format!("layer {li} ffn_norm"))?;
    moe_normed(b, cx, m, li, lens, r, link)
}

/// A mixture-of-experts block on the normed rows in `r.xn`: its experts on the host or on the
/// device, where the graph found them.
fn moe_normed<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    m: &Moe,
    li: usize,
    lens: &[usize],
    r: &mut Regions<'_, B::Buffer>,
    link: &mut HostLink<'_>,
) -> Result<()> {
    if m.experts_on_host {
        moe_on_host(b, cx, m, li, lens, r, link)
    } else {
        moe_on_device(b, cx, m, li, lens, r, link)
    }
}

/// The router's scores of `n` normed rows (`n_experts` a row), multiplied on the device into
/// the front of `region` (a workspace region the block does not otherwise use; the graph
/// checked its size, see [`check_moe_workspace`]) and copied to the host.
fn router_scores<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    m: &Moe,
    li: usize,
    n: usize,
    (xn, region): (&B::Buffer, &mut B::Buffer),
    link: &mut HostLink<'_>,
) -> Result<Vec<f32>> {
    let at = |what: &str| format!("layer {li} {what}");
    let mut scores = vec![0f32; n * m.n_experts()];
    let mut on_device =
        split(b, region, &[(0, scores.len() * 4)]).map_err(cx.err(at("router scores")))?;
    cx.linear(b, &m.router, xn, n, &mut on_device[0])?;
    let since = std::time::Instant::now();
    b.copy_to_host(&on_device[0], 0, bytemuck::cast_slice_mut(&mut scores))
        .map_err(cx.err(at("copying the router scores to the host")))?;
    link.crossed(scores.len() * 4, since);
    Ok(scores)
}

/// A mixture-of-experts block on the normed rows (pieces of `lens` tokens) in `r.xn`, its
/// output written back there, with its routed experts computed on the host.
///
/// The router multiplies here, on the device: the plan keeps it beside the layer's other
/// matrices (`n_cpu_moe`'s rules, like llama.cpp's `exps` pattern, move the expert projections
/// only), it is small, and reading it here means only the rows and their scores cross to the
/// host, never the router's bytes. Its scores land in the MLP's gate region, which the block
/// does not otherwise use (the graph checked its size at build). The normed rows and the
/// scores are then copied to the host, which routes each token and runs only its experts with
/// the host path's own code ([`experts::experts`](super::experts::experts)), reading them where the model holds them (host
/// RAM or the mapped file; the graph checked that at build); the output rows come back. No
/// expert byte travels to the device.
#[allow(clippy::too_many_arguments)]
fn moe_on_host<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    m: &Moe,
    li: usize,
    lens: &[usize],
    r: &mut Regions<'_, B::Buffer>,
    link: &mut HostLink<'_>,
) -> Result<()> {
    let (h, n) = (cx.c.hidden, lens.iter().sum::<usize>());
    let at = |what: &str| format!("layer {li} {what}");
    let scores = router_scores(b, cx, m, li, n, (&r.xn, &mut r.gate), link)?;
    let mut rows = vec![0f32; n * h];
    let since = std::time::Instant::now();
    b.copy_to_host(&r.xn, 0, bytemuck::cast_slice_mut(&mut rows))
        .map_err(cx.err(at("copying the normed rows to the host")))?;
    link.crossed(rows.len() * 4, since);
    let wts = Weights {
        held: cx.held,
        copies: cx.copies,
        slot: None,
    };
    super::experts::experts(cx.c, m, li, &wts, lens, &scores, &mut rows)?;
    let since = std::time::Instant::now();
    b.copy_from_host(bytemuck::cast_slice(&rows), &mut r.xn, 0)
        .map_err(cx.err(at("copying the experts' output to the device")))?;
    link.crossed(rows.len() * 4, since);
    Ok(())
}

/// A mixture-of-experts block on the normed rows (pieces of `lens` tokens) in `r.xn`, its
/// output written back there, with its experts on this device.
///
/// The router multiplies here and only its scores (`n_experts` floats a token) go to the host,
/// which routes each token with the host path's own [`experts::route`](super::experts::route) and sends back, in one
/// copy each, the routed rows' token indices (into the key region) and weights (into the
/// value region), grouped piece by piece and expert by expert in the host path's order
/// ([`experts::experts`](super::experts::experts)). Then for each group the expert's rows are gathered into the query
/// region ([`Op::GatherRows`]), its gated product runs as a dense MLP's does (gate and up into
/// the MLP's regions, the down product back into the query region), and its output rows are
/// added, scaled by their weights, into their tokens' sums in the attention output's region
/// ([`Op::ScatterAddRows`]; zeroed first), which replaces `r.xn` at the end. An offloaded
/// layer's experts are read from its onload slot. On the CPU backend this gives the host path's
/// bits. A routed expert costs a gather, its products and a scatter-add, whatever its tokens.
#[allow(clippy::too_many_arguments)]
fn moe_on_device<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    m: &Moe,
    li: usize,
    lens: &[usize],
    r: &mut Regions<'_, B::Buffer>,
    link: &mut HostLink<'_>,
) -> Result<()> {
    let (h, n) = (cx.c.hidden, lens.iter().sum::<usize>());
    let at = |what: &str| format!("layer {li} {what}");
    let scores = router_scores(b, cx, m, li, n, (&r.xn, &mut r.up), link)?;
    // the routed rows, grouped by piece then expert: (expert, first entry, entries)
    let mut groups: Vec<(usize, usize, usize)> = Vec::new();
    let (mut index, mut weight) = (Vec::with_capacity(n * m.n_used), Vec::new());
    super::experts::for_each_routed(m, lens, &scores, |e, routed| {
        groups.push((e, index.len(), routed.len()));
        for &(t, wt) in routed {
            index.push(t as u32);
            weight.push(wt);
        }
        Ok(())
    })?;
    let zeros = vec![0u8; n * h * 4];
    for (bytes, region, what) in [
        (
            bytemuck::cast_slice::<u32, u8>(&index),
            &mut r.k,
            "routed rows",
        ),
        (
            bytemuck::cast_slice::<f32, u8>(&weight),
            &mut r.v,
            "routing weights",
        ),
        (&zeros[..], &mut r.att, "experts' sums, zeroed"),
    ] {
        let since = std::time::Instant::now();
        b.copy_from_host(bytes, region, 0)
            .map_err(cx.err(at(&format!("copying the {what} to the device"))))?;
        link.crossed(bytes.len(), since);
    }
    // each expert's products take its rows at once, as on the host
    let one = cx.one_run();
    for (e, start, cnt) in groups {
        let [gate, up, down] = super::experts::held_expert(m, li, e)?;
        let expert = |what: &str| at(&format!("expert {e} {what}"));
        let rows = view(b, &r.k, start * 4, cnt * 4).map_err(cx.err(expert("rows")))?;
        b.run(Op::GatherRows {
            n_rows: cnt,
            n_cols: h,
            src_rows: n,
            rows: &rows,
            src: &r.xn,
            dst: &mut r.q,
        })
        .map_err(cx.err(expert("rows")))?;
        {
            let xs = view(b, &r.q, 0, cnt * h * 4).map_err(cx.err(expert("rows")))?;
            gated(b, &one, [gate, up], li, &xs, cnt, [&mut r.gate, &mut r.up])?;
        }
        one.linear(b, down, &r.gate, cnt, &mut r.q)?;
        let weights = view(b, &r.v, start * 4, cnt * 4).map_err(cx.err(expert("weights")))?;
        b.run(Op::ScatterAddRows {
            n_rows: cnt,
            n_cols: h,
            dst_rows: n,
            rows: &rows,
            weights: &weights,
            src: &r.q,
            dst: &mut r.att,
        })
        .map_err(cx.err(expert("weighted sum")))?;
    }
    b.copy(&r.att, 0, &mut r.xn, 0, n * h * 4)
        .map_err(cx.err(at("experts' sums")))
}

/// `xn = RMSNorm(x) · norm` over `n` tokens.
fn norm<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    n: usize,
    r: &mut Regions<'_, B::Buffer>,
    what: String,
) -> Result<()> {
    b.run(Op::RmsNorm {
        n_rows: n,
        n_cols: cx.c.hidden,
        eps: cx.c.eps,
        x: &r.x,
        weight: &*b.floats(norm, cx.held)?,
        out: &mut r.xn,
    })
    .map_err(cx.err(what))
}

/// `x += xn`, then `xn = RMSNorm(x) · norm`, over `n` tokens. `next`: the matrices whose
/// products read `xn` right after (the backend may quantise it for them in the same launch:
/// see [`Ctx::q8_reads`]).
fn add_norm<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    n: usize,
    r: &mut Regions<'_, B::Buffer>,
    next: &[&Linear],
    what: String,
) -> Result<()> {
    let q8_next = cx.q8_reads(b, next);
    b.run(Op::AddRmsNorm {
        n_rows: n,
        n_cols: cx.c.hidden,
        eps: cx.c.eps,
        x: &mut r.x,
        h: &mut r.xn,
        weight: &*b.floats(norm, cx.held)?,
        q8_next,
    })
    .map_err(cx.err(what))
}

/// `xn = RMSNorm(xn) · norm` over `n` tokens (a block's post-norm), through the gate region
/// (free between the blocks; the graph checked it holds a hidden row per token).
fn post_norm<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    n: usize,
    r: &mut Regions<'_, B::Buffer>,
    what: String,
) -> Result<()> {
    head_norm(
        b,
        cx,
        norm,
        (n, cx.c.hidden),
        (&mut r.xn, &mut r.gate),
        what,
    )
}

/// `x = RMSNorm(x) · norm` over `rows` rows of `cols` values, in place through `tmp` (which
/// holds at least as many values).
fn head_norm<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    (rows, cols): (usize, usize),
    (x, tmp): (&mut B::Buffer, &mut B::Buffer),
    what: String,
) -> Result<()> {
    b.run(Op::RmsNorm {
        n_rows: rows,
        n_cols: cols,
        eps: cx.c.eps,
        x: &*x,
        weight: &*b.floats(norm, cx.held)?,
        out: &mut *tmp,
    })
    .map_err(cx.err(what.clone()))?;
    b.copy(&*tmp, 0, x, 0, rows * cols * 4)
        .map_err(cx.err(what))
}

/// `x *= s` over `n` values (the embedding scale).
pub(crate) fn scale<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    n: usize,
    s: f32,
    x: &mut B::Buffer,
) -> Result<()> {
    b.run(Op::ScaleInPlace { n, s, x })
        .map_err(cx.err("embedding scale"))
}

/// `x += xn` over `n` values: a block's output added to the residual stream.
fn residual<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    li: usize,
    n: usize,
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    b.run(Op::AddInPlace {
        n,
        x: &mut r.x,
        y: &r.xn,
    })
    .map_err(cx.err(format!("layer {li} residual")))
}

/// The heads one device computes of an attention block: all of them on a single device, its
/// share of them under tensor parallelism.
pub(crate) struct AttnShare<'a> {
    pub norm: &'a Floats,
    pub q: &'a Linear,
    pub k: &'a Linear,
    pub v: &'a Linear,
    pub o: &'a Linear,
    /// Per-head RMSNorm weights of the queries and keys, when the layers have them.
    pub qk_norm: Option<&'a [Floats; 2]>,
    pub n_heads: usize,
    pub kv_heads: usize,
    /// The layer's own RoPE angles (else the workspace's table).
    pub rope: Option<&'a Floats>,
    /// The sliding window (0: none).
    pub window: usize,
}

/// An attention block's heads of `a` on the tokens of `pieces` (each sequence at its own
/// positions, in `r.pos`), their rows written to each piece's cache: `o_proj` of the attended
/// heads lands in `r.xn` (the whole block's output on one device, a partial sum of it under
/// tensor parallelism).
pub(crate) fn attention<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    a: &AttnShare<'_>,
    li: usize,
    pieces: &[Piece<'_>],
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    norm(
        b,
        cx,
        a.norm,
        tokens(pieces),
        r,
        format!("layer {li} attn_norm"),
    )?;
    attention_normed(b, cx, a, li, pieces, r)
}

/// [`attention`] on activations already normed into `r.xn`. The products take every piece's
/// rows (see [`Ctx::runs`]); RoPE, the cache store and attention run piece by piece, each on
/// its own rows and cache.
pub(crate) fn attention_normed<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    a: &AttnShare<'_>,
    li: usize,
    pieces: &[Piece<'_>],
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    let c = cx.c;
    let (hd, nh) = (c.head_dim, a.n_heads);
    let kvd = a.kv_heads * hd;
    let n = tokens(pieces);
    let at = |what: &str| format!("layer {li} {what}");
    cx.linears(
        b,
        &r.xn,
        n,
        vec![(a.q, &mut r.q), (a.k, &mut r.k), (a.v, &mut r.v)],
    )?;
    if let Some([qn, kn]) = a.qk_norm {
        // normed into the attention output's region (free until attention writes it), then
        // copied back where RoPE and the cache read them
        head_norm(
            b,
            cx,
            qn,
            (n * nh, hd),
            (&mut r.q, &mut r.att),
            at("q_norm"),
        )?;
        head_norm(
            b,
            cx,
            kn,
            (n * a.kv_heads, hd),
            (&mut r.k, &mut r.att),
            at("k_norm"),
        )?;
    }
    let own = match a.rope {
        Some(f) => Some(b.floats(f, cx.held)?),
        None => None,
    };
    let freqs = own.as_deref().unwrap_or(&r.freqs);
    if let [p] = pieces {
        let rows = PieceRows {
            q: &mut *r.q,
            k: &mut *r.k,
            v: &*r.v,
            pos: &*r.pos,
            att: &mut *r.att,
            parts: &mut *r.parts,
        };
        // the output projection reads the attention rows next (one piece: all of them)
        let q8_next = cx.q8_reads(b, &[a.o]);
        attend_piece(b, cx, a, li, p, rows, freqs, q8_next)?;
    } else {
        let mut t0 = 0;
        for p in pieces {
            let bytes = |per: usize| (t0 * per * 4, p.n * per * 4);
            let (qb, kb, pb) = (bytes(nh * hd), bytes(kvd), bytes(1));
            let mut q = split(b, &mut r.q, &[qb]).map_err(cx.err(at("queries")))?;
            let mut k = split(b, &mut r.k, &[kb]).map_err(cx.err(at("keys")))?;
            let v = view(b, &r.v, kb.0, kb.1).map_err(cx.err(at("values")))?;
            let pos = view(b, &r.pos, pb.0, pb.1).map_err(cx.err(at("positions")))?;
            let mut att = split(b, &mut r.att, &[qb]).map_err(cx.err(at("attention rows")))?;
            let rows = PieceRows {
                q: &mut *q[0],
                k: &mut *k[0],
                v: &*v,
                pos: &*pos,
                att: &mut *att[0],
                parts: &mut *r.parts,
            };
            attend_piece(b, cx, a, li, p, rows, freqs, false)?;
            t0 += p.n;
        }
    }
    cx.linear(b, a.o, &r.att, n, &mut r.xn)
}

/// One sequence's rows of an attention block's buffers: its queries, keys and values (after
/// the products), positions and attention output, and the split attention's partial results.
struct PieceRows<'r, T> {
    q: &'r mut T,
    k: &'r mut T,
    v: &'r T,
    pos: &'r T,
    att: &'r mut T,
    parts: &'r mut T,
}

/// RoPE on one sequence's queries and keys with its new rows stored in its cache (one op),
/// then its attention over that cache.
///
/// A decode step (one token) on a cache held in place takes the ops' device-position forms: the
/// row written and attention's position come from the positions buffer, the cache is passed
/// whole, and CUDA splits the keys over a span of the cache's rows that changes only at powers of
/// two (`attention_decode_span`), and for a sliding-window layer over its window's keys once the
/// window is full (`attention_window_span`, a function of the step's span and the window, so
/// still one per span). Nothing of the step's position is then a launch argument, so
/// a captured CUDA graph replays it (see `graph::run`), and graphs on or off run the same
/// kernels. Prompts, and offloaded caches (whose device slot holds the
/// layer only while it is lent), pass the rows and the position from the host; a prompt whose
/// rows wrap past a sliding-window layer's ring takes the whole-layer store (each token at its
/// position's row). Attention reads the key at position `p` from row `p % rows` of the layer.
/// `q8_next`: the output projection reads the attention rows next (see `Op::Attention`).
#[allow(clippy::too_many_arguments)]
fn attend_piece<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    a: &AttnShare<'_>,
    li: usize,
    p: &Piece<'_>,
    rows: PieceRows<'_, B::Buffer>,
    freqs: &B::Buffer,
    q8_next: bool,
) -> Result<()> {
    let c = cx.c;
    let (hd, nh) = (c.head_dim, a.n_heads);
    let kvd = a.kv_heads * hd;
    let (pos, n, cache) = (p.pos, p.n, p.cache);
    let (k_format, v_format) = crate::cache::formats(cache.config().dtype);
    let at = |what: &str| format!("layer {li} {what}");
    let PieceRows {
        q,
        k,
        v,
        pos: positions,
        att,
        parts,
    } = rows;
    let on_device = n == 1 && !cache.is_offloaded();
    let capacity = cache.config().max_seq_len as usize;
    // the layer's rows: a sliding-window layer's ring keeps position p in row p % rows
    let ring = cache.config().rows(li) as usize;
    cache.check_attend(li, a.window, pos as u64, n as u64)?;
    // a chunk whose rows wrap past the ring's end is stored at its positions' rows
    let wraps = pos % ring + n > ring;
    // the keys attention splits: one span for many positions (a captured step's key holds it),
    // a sliding layer's only its window's (its splits start at the window's first key)
    let span = weightlift_kernels::sources::attention_window_span(
        weightlift_kernels::sources::attention_decode_span(pos + n, capacity),
        a.window,
        n,
    );
    let attend = |kb: &mut Buffer, vb: &mut Buffer| -> Result<()> {
        let mut kc = b.whole_mut(kb)?;
        let mut vc = b.whole_mut(vb)?;
        // RoPE on q and k and the new cache rows in one op: into the whole layers at the
        // position's row read on the device, or into views of the rows at `pos`
        let mut store = |k_cache: &mut B::Buffer, v_cache: &mut B::Buffer, cache_rows| {
            b.run(Op::RopeKvStore {
                params: c.rope,
                n_tok: n,
                n_heads: nh,
                kv_heads: a.kv_heads,
                q: &mut *q,
                k: &mut *k,
                v,
                positions,
                inv_freqs: freqs,
                k_format,
                v_format,
                k_cache,
                v_cache,
                cache_rows,
            })
            .map_err(cx.err(at("rope and cache store")))
        };
        if on_device || wraps {
            store(&mut kc, &mut vc, Some(ring))?;
        } else {
            let row = pos % ring;
            let mut k_rows = cache_rows(b, k_format, &mut kc, row * kvd, n * kvd)
                .map_err(cx.err(at("cache keys")))?;
            let mut v_rows = cache_rows(b, v_format, &mut vc, row * kvd, n * kvd)
                .map_err(cx.err(at("cache values")))?;
            store(&mut k_rows, &mut v_rows, None)?;
        }
        b.run(Op::Attention {
            k_format,
            v_format,
            n_heads: nh,
            kv_heads: a.kv_heads,
            head_dim: hd,
            n_q: n,
            start: pos,
            scale: c.attn_scale,
            window: a.window,
            softcap: c.attn_softcap,
            cache_rows: ring,
            tile: c.kv_tile,
            f16_operands: c.compute.f16_operands(cache.config().dtype),
            q: &*q,
            k: &kc,
            v: &vc,
            out: &mut *att,
            scratch: Some(&mut *parts),
            start_at: on_device.then_some(weightlift_kernels::StartAt { positions, span }),
            q8_next,
        })
        .map_err(cx.err(at("attention")))
    };
    if cache.is_offloaded() {
        cache.with_fetched(li, pos as u64, n as u64, attend)
    } else {
        cache.with_layer(li, (pos as u64, n as u64), attend)
    }
}

/// An MLP's rows `[gate, up, down]` (all of them, or a device's share under tensor parallelism)
/// on `n` tokens of `r.x`: `down` of the gated product lands in `r.xn`.
pub(crate) fn mlp<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    [gate, up, down]: [&Linear; 3],
    li: usize,
    n: usize,
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    self::norm(b, cx, norm, n, r, format!("layer {li} ffn_norm"))?;
    mlp_normed(b, cx, [gate, up, down], li, n, r)
}

/// [`mlp`] on activations already normed into `r.xn`.
pub(crate) fn mlp_normed<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    [gate, up, down]: [&Linear; 3],
    li: usize,
    n: usize,
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    gated(b, cx, [gate, up], li, &r.xn, n, [&mut r.gate, &mut r.up])?;
    cx.linear(b, down, &r.gate, n, &mut r.xn)
}

/// `g = act(W_gate x) · (W_up x)` for `n` tokens of `x` (the family's gated activation; `u`
/// holds the up product): SwiGLU fused with its products where [`Ctx::swiglu`] can, else the
/// products and the activation apart.
fn gated<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    [gate, up]: [&Linear; 2],
    li: usize,
    x: &B::Buffer,
    n: usize,
    [g, u]: [&mut B::Buffer; 2],
) -> Result<()> {
    let fused = cx.c.gate == super::family::Gate::Silu && cx.swiglu(b, x, n, [gate, up], [g, u])?;
    if fused {
        return Ok(());
    }
    cx.linears(b, x, n, vec![(gate, &mut *g), (up, &mut *u)])?;
    let op = match cx.c.gate {
        super::family::Gate::Silu => Op::SwiGluInPlace {
            n: n * gate.rows,
            gate: g,
            up: u,
        },
        super::family::Gate::GeluTanh => Op::GeGluTanhInPlace {
            n: n * gate.rows,
            gate: g,
            up: u,
        },
    };
    b.run(op)
        .map_err(cx.err(format!("layer {li} gated activation")))
}

/// `xn = RMSNorm(x) · norm` for rows `first..first + need` of the residual stream, into rows
/// `0..need` of `r.xn`: the head's input.
fn out_norm<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    (first, need): (usize, usize),
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    let h = cx.c.hidden;
    let xs = view(b, &r.x, first * h * 4, need * h * 4).map_err(cx.err("output_norm"))?;
    b.run(Op::RmsNorm {
        n_rows: need,
        n_cols: h,
        eps: cx.c.eps,
        x: &xs,
        weight: &*b.floats(norm, cx.held)?,
        out: &mut r.xn,
    })
    .map_err(cx.err("output_norm"))
}

/// The output norm and head for rows `first..first + out.len() / vocab` of the residual stream,
/// `rows` logit rows at a time through the workspace, into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    head: &Linear,
    first: usize,
    rows: usize,
    out: &mut [f32],
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    let h = cx.c.hidden;
    let vocab = head.rows;
    let need = out.len() / vocab;
    out_norm(b, cx, norm, (first, need), r)?;
    for r0 in (0..need).step_by(rows.max(1)) {
        let nr = rows.max(1).min(need - r0);
        let xin = view(b, &r.xn, r0 * h * 4, nr * h * 4).map_err(cx.err(&head.name))?;
        cx.linear(b, head, &xin, nr, &mut r.logits)?;
        let dst = bytemuck::cast_slice_mut(&mut out[r0 * vocab..(r0 + nr) * vocab]);
        b.copy_to_host(&r.logits, 0, dst)
            .map_err(cx.err("copying logits to the host"))?;
    }
    Ok(())
}

/// The output norm and head of rows `0..rows` of the residual stream into the workspace's
/// logits, `per` rows a product, each product's rows where they belong (the logits region
/// holds them all): what [`head`] runs for a decode step's rows, without the copies to the host
/// (so a CUDA graph can record it; the caller copies the `rows × vocab` values once).
pub(crate) fn head_products<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    (norm, head): (&Floats, &Linear),
    (rows, per): (usize, usize),
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    let (h, vocab) = (cx.c.hidden, head.rows);
    out_norm(b, cx, norm, (0, rows), r)?;
    for r0 in (0..rows).step_by(per.max(1)) {
        let nr = per.max(1).min(rows - r0);
        let xin = view(b, &r.xn, r0 * h * 4, nr * h * 4).map_err(cx.err(&head.name))?;
        let range = [(r0 * vocab * 4, nr * vocab * 4)];
        let mut y = split(b, &mut r.logits, &range).map_err(cx.err(&head.name))?;
        cx.linear(b, head, &xin, nr, &mut y[0])?;
    }
    Ok(())
}

/// Each sequence's last row of the residual stream `r.x` (`counts` tokens a sequence, in
/// order), moved to row `i` for sequence `i` through `r.xn`: the rows a batch's head reads.
pub(crate) fn batch_rows<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    counts: &[usize],
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    let row = cx.c.hidden * 4;
    let mut end = 0;
    for (i, &k) in counts.iter().enumerate() {
        end += k;
        b.copy(&r.x, (end - 1) * row, &mut r.xn, i * row, row)
            .map_err(cx.err("a batch's last rows"))?;
    }
    b.copy(&r.xn, 0, &mut r.x, 0, counts.len() * row)
        .map_err(cx.err("a batch's last rows"))
}

/// The rows one product of a batch's head takes: those the backend shares in its mode (see
/// [`Exec::shared_tokens`]), at least one.
pub(crate) fn head_shared_rows<B: Exec>(b: &B, cx: &Ctx<'_>, head: &Linear) -> Result<usize> {
    Ok(cx
        .mode_of(b, head)?
        .map_or(1, |m| B::shared_tokens(cx.c.compute, m).max(1)))
}

/// The output norm of rows `first..first + out.len() / hidden` of the residual stream, copied
/// into `out`: the rows [`head`] would multiply by the head.
pub(crate) fn hidden<B: Exec>(
    b: &B,
    cx: &Ctx<'_>,
    norm: &Floats,
    first: usize,
    out: &mut [f32],
    r: &mut Regions<'_, B::Buffer>,
) -> Result<()> {
    let need = out.len() / cx.c.hidden;
    out_norm(b, cx, norm, (first, need), r)?;
    b.copy_to_host(&r.xn, 0, bytemuck::cast_slice_mut(out))
        .map_err(cx.err("copying hidden states to the host"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use weightlift_plan::Region;

    fn linear(rows: usize, cols: usize) -> Linear {
        Linear {
            slot: Slot::Tensor(0),
            name: format!("{rows} × {cols}"),
            rows,
            cols,
            bias: None,
            onload_at: None,
            packed: None,
            part: None,
            rows_of: None,
        }
    }

    /// A block of 4 tokens of hidden size 8 with 16 experts 6 wide, 2 used: the workspace's
    /// regions must hold what the block computes there. With the experts on the host, the 64
    /// router scores in the gate region; on the device, the queries and attention output a
    /// hidden row a token, the MLP regions an expert's rows a token, the up region the scores,
    /// and the keys and values the routed rows' indices and weights. A region a value short is refused by name, before any token runs.
    #[test]
    fn a_moe_block_needs_its_workspace_regions() {
        let region = |len: u64| Region { offset: 0, len };
        let fits = Workspace {
            x: region(4 * 8),
            q: region(4 * 8),
            att: region(4 * 8),
            k: region(4 * 2),
            v: region(4 * 2),
            gate: region(4 * 16),
            up: region(4 * 16),
            ..Workspace::default()
        };
        let device = Device::virtual_device(0, 1 << 20);
        for on_host in [true, false] {
            let m = Moe {
                router: linear(16, 8),
                experts: (0..16)
                    .map(|_| [linear(6, 8), linear(6, 8), linear(8, 6)])
                    .collect(),
                first: 0,
                n_used: 2,
                norm_topk_prob: true,
                experts_on_host: on_host,
            };
            assert!(check_moe_workspace(&device, &fits, &m, 3).is_ok());
            // the scores: in the gate region with the experts on the host, else in the up one
            let (short, named) = if on_host {
                let w = Workspace {
                    gate: region(4 * 16 - 1),
                    ..fits
                };
                (w, "MLP gate region holds 63 values")
            } else {
                let w = Workspace {
                    up: region(4 * 16 - 1),
                    ..fits
                };
                (w, "MLP up region holds 63 values")
            };
            let e = check_moe_workspace(&device, &short, &m, 3)
                .unwrap_err()
                .to_string();
            assert!(e.contains("layer 3 computed on virtual:0"), "{e}");
            assert!(e.contains(named) && e.contains("needs 64"), "{e}");
            for short in [
                Workspace {
                    q: region(4 * 8 - 1),
                    ..fits
                },
                Workspace {
                    v: region(4 * 2 - 1),
                    ..fits
                },
            ] {
                assert_eq!(check_moe_workspace(&device, &short, &m, 3).is_ok(), on_host);
            }
        }
    }
}
