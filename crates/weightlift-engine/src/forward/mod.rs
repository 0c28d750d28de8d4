//! The forward pass of the llama family (llama, mistral, qwen2, qwen3, phi3) and of gemma2 and
//! gemma3, carried out where the plan put every layer.
//!
//! - Each layer computes on the device that holds it. `cpu`, `disk` (computed by the host) and
//!   `virtual:N` run the CPU kernels on host memory; `cuda:N` runs the same layer as a sequence
//!   of the kernels' `Backend` operations on its `CudaBackend` (`exec.rs`), with an fp16 or f32
//!   cache. The activations, the new keys and values and the attention tiles live in that
//!   device's [`Workspace`], carved out of the scratch the plan reserved there (the planner and
//!   this module share the one layout, so the plan's scratch column is what a forward pass
//!   holds). At a device boundary the hidden state is copied from one workspace to the next (a
//!   memcpy between host memories, through the host to and from CUDA memory), and the copy is
//!   counted ([`Copies`]).
//! - The backend path also runs on host devices over the same memory through the
//!   `CpuBackend` when [`crate::Model::set_host_backend`] asks, so the op sequence a GPU runs
//!   is tested without one: it gives the host path's logits bit for bit.
//! - The KV cache is the [`Cache`], written in place at the sequence position.
//! - Prompts run in chunks of the workspace's `tokens` (`max_input_len`); attention is tiled
//!   (`max_attention_size` weights per head at most) with an online softmax; logits are
//!   computed only for the rows asked for, [`LOGIT_ROWS`](weightlift_plan::LOGIT_ROWS) at a time.
//!   [`crate::Model::forward_hidden`] returns every row's hidden state after the output norm
//!   instead (the head's input, what embeddings are pooled from): the same norm on the head's
//!   device, each chunk's rows out of the workspace's `xn`, and no head product.
//! - [`Compute::Fast`] multiplies quantised weights with 8-bit-quantised activations, as
//!   llama.cpp's CPU backend does (for the types its scheme covers; other types run exactly);
//!   [`Compute::Exact`] multiplies f32 activations with weights dequantised in registers.
//!   LLM.int8 weights run bitsandbytes' mixed int8 product in both modes, and GPTQ linears are
//!   dequantised by chunks of rows into f32 products in both (`weights.rs`).
//!
//! Placement never changes results: every device runs the same kernels on the same shapes.

mod attention;
mod boundary;
mod embed;
mod exec;
mod experts;
mod family;
mod graph;
mod layer;
mod logits;
mod onload;
mod parts;
mod rope;
mod tp;
mod weights;
mod work;

use std::sync::Arc;

use weightlift_format::DType;
use weightlift_kernels::{CpuBackend, INT8_DEFAULT_THRESHOLD, Isa, MatvecMode, QuantType};
use weightlift_plan::{Region, Workspace};

use crate::cache::Cache;
use crate::device::{Buffer, Device};
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;

pub(crate) use graph::Graph;
pub use graph::check_runs;
pub use rope::{RopeScaling, check_rope, rope_scaling_of};
pub(crate) use tp::TpGraph;

/// How the matrix products treat activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Compute {
    /// Quantised weights × 8-bit-quantised activations, as llama.cpp.
    #[default]
    Fast,
    /// f32 activations × weights dequantised in registers: the mode checked against
    /// transformers.
    Exact,
}

/// The settings of the forward pass that change the KV rows it writes: a cache records them
/// ([`Cache::computing_under`]), and a prefix is reused only under the same
/// ([`Cache::common_prefix_under`]), so a reused prefix holds what the current settings compute.
/// (The cache's dtype is fixed when it is made; the host backend and CUDA graphs give the same
/// bits, so they are not among them.)
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvSettings {
    pub compute: Compute,
    /// LLM.int8's outlier threshold, which moves the rows of int8 products.
    pub int8_threshold: f32,
}

impl Compute {
    pub fn parse(s: &str) -> Result<Compute> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fast" => Ok(Compute::Fast),
            "exact" => Ok(Compute::Exact),
            _ => Err(invalid("compute", "'fast' or 'exact'", format!("'{s}'"))),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Compute::Fast => "fast",
            Compute::Exact => "exact",
        }
    }

    /// Whether attention rounds its queries and weights to f16 before they meet a cache of
    /// `dtype`: in fast mode over an fp16 cache, as llama.cpp's CPU products do.
    pub(crate) fn f16_operands(self, dtype: crate::cache::CacheDType) -> bool {
        self == Compute::Fast && dtype == crate::cache::CacheDType::Fp16
    }

    pub(crate) fn mode(self, ty: QuantType) -> MatvecMode {
        if self == Compute::Fast && weightlift_kernels::cpu::matvec::q8_supports(ty) {
            MatvecMode::Q8
        } else {
            MatvecMode::Exact
        }
    }
}

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Logits {
    /// The last position only (llama.cpp's default).
    #[default]
    Last,
    /// Every position (llama.cpp's `logits_all`).
    All,
}

impl Logits {
    pub fn parse(s: &str) -> Result<Logits> {
        match s.trim().to_ascii_lowercase().as_str() {
            "last" => Ok(Logits::Last),
            "all" => Ok(Logits::All),
            _ => Err(invalid("logits", "'last' or 'all'", format!("'{s}'"))),
        }
    }

    /// Rows of logits a forward call of `n` ids writes.
    pub fn n_rows(self, n: usize) -> usize {
        match self {
            Logits::Last => 1,
            Logits::All => n,
        }
    }

    /// For the `n` rows of a chunk starting at token `done` (of `total`): the first whose
    /// logits are asked for, and the rows of `out` (`vocab` values each) they fill; `None` when
    /// the chunk has none (every chunk but the last, for `Last`).
    pub(crate) fn rows(
        self,
        (done, n, total): (usize, usize, usize),
        vocab: usize,
        out: &mut [f32],
    ) -> Option<(usize, &mut [f32])> {
        let (first, rows) = match self {
            Logits::Last if done + n < total => return None,
            Logits::Last => (n - 1, 0..1),
            Logits::All => (0, done..done + n),
        };
        Some((first, &mut out[rows.start * vocab..rows.end * vocab]))
    }
}

/// What one forward call writes: logits, or the hidden states the head would read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Output {
    /// The rows [`Logits`] asks for, `vocab` floats a row.
    Logits(Logits),
    /// Every position's hidden state after the output norm, `hidden` floats a row: the head's
    /// input (llama.cpp's `result_norm`, the `t_embd` its embeddings are pooled from). No head
    /// product runs.
    Hidden,
}

impl Output {
    /// Rows written for a call of `n` ids.
    pub(crate) fn rows(self, n: usize) -> usize {
        match self {
            Output::Logits(Logits::Last) => 1,
            Output::Logits(Logits::All) | Output::Hidden => n,
        }
    }

    /// Floats a row: the vocabulary's for logits, the hidden size's for hidden states.
    pub(crate) fn width(self, d: &weightlift_plan::Dims) -> usize {
        match self {
            Output::Logits(_) => d.vocab as usize,
            Output::Hidden => d.hidden as usize,
        }
    }

    /// [`Logits::rows`] for rows `width` floats wide: hidden states are written for every row.
    pub(crate) fn chunk_rows(
        self,
        chunk: (usize, usize, usize),
        width: usize,
        out: &mut [f32],
    ) -> Option<(usize, &mut [f32])> {
        match self {
            Output::Logits(l) => l.rows(chunk, width, out),
            Output::Hidden => Logits::All.rows(chunk, width, out),
        }
    }
}

/// Copies between devices during one forward call: how many, their bytes, and the wall time
/// spent in them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Copies {
    pub count: u64,
    pub bytes: u64,
    pub nanos: u64,
}

impl Copies {
    pub fn seconds(&self) -> f64 {
        self.nanos as f64 * 1e-9
    }

    pub(crate) fn add(&mut self, o: Copies) {
        self.count += o.count;
        self.bytes += o.bytes;
        self.nanos += o.nanos;
    }

    /// Count one copy of `bytes` that started at `since`.
    pub(crate) fn note(&mut self, bytes: u64, since: std::time::Instant) {
        self.count += 1;
        self.bytes += bytes;
        self.nanos += u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    }
}

/// One device's workspace: the buffer it lives in and its layout.
#[derive(Debug)]
pub(crate) struct Site {
    pub device: Arc<Device>,
    pub layout: Workspace,
    /// The workspace's own buffer, when the load reserved no scratch on the device.
    pub own: Option<Buffer>,
    /// Index of the device's scratch buffer in the model state, when it did.
    pub scratch: Option<usize>,
    /// How the device computes.
    pub exec: SiteExec,
    /// Whether the workspace holds the model's RoPE frequencies: written by the first forward
    /// call, and kept, since nothing else writes that region and the workspace is this graph's
    /// for as long as the graph lives (a reload or another host backend builds a new graph).
    pub rope_table: bool,
}

/// How a device computes its parts of the model.
#[derive(Debug)]
pub(crate) enum SiteExec {
    /// The CPU kernels called on slices of host memory (`cpu`, `disk`, `virtual:N`).
    Host,
    /// The backend op sequence on the CPU backend, over the same host memory.
    Cpu(CpuBackend),
    /// The backend op sequence on the device's CUDA backend.
    Cuda,
}

/// Mutable f32 views of one workspace's regions.
pub(crate) struct Views<'a> {
    pub x: &'a mut [f32],
    pub xn: &'a mut [f32],
    pub q: &'a mut [f32],
    pub att: &'a mut [f32],
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
    pub gate: &'a mut [f32],
    pub up: &'a mut [f32],
    pub kt: &'a mut [f32],
    pub vt: &'a mut [f32],
    pub scores: &'a mut [f32],
    pub stats: &'a mut [f32],
    pub pos: &'a mut [i32],
    pub freqs: &'a mut [f32],
    pub logits: &'a mut [f32],
}

/// Split a workspace buffer into its regions (laid out in this order by [`Workspace::new`]).
pub(crate) fn carve<'a>(bytes: &'a mut [u8], w: &Workspace) -> Result<Views<'a>> {
    if (bytes.len() as u64) < w.bytes {
        return Err(invalid(
            "forward workspace",
            format!("{} bytes of scratch", w.bytes),
            format!(
                "{} bytes reserved; the model was loaded for another runtime or cache",
                bytes.len()
            ),
        ));
    }
    let floats: &mut [f32] = bytemuck::try_cast_slice_mut(&mut bytes[..w.bytes as usize])
        .map_err(|e| invalid("forward workspace alignment", "4-byte aligned", e))?;
    let mut rest = floats;
    let mut at = 0u64;
    let mut take = |r: Region| -> &'a mut [f32] {
        if r.len == 0 {
            return &mut [];
        }
        let skip = (r.offset / 4 - at) as usize;
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(skip.min(tail.len()));
        let (head, tail) = tail.split_at_mut((r.len as usize).min(tail.len()));
        rest = tail;
        at = r.offset / 4 + r.len;
        head
    };
    Ok(Views {
        x: take(w.x),
        xn: take(w.xn),
        q: take(w.q),
        att: take(w.att),
        k: take(w.k),
        v: take(w.v),
        gate: take(w.gate),
        up: take(w.up),
        kt: take(w.kt),
        vt: take(w.vt),
        scores: take(w.scores),
        stats: take(w.stats),
        pos: bytemuck::cast_slice_mut(take(w.pos)),
        freqs: take(w.freqs),
        logits: take(w.logits),
    })
}

/// The bytes and kernel type of a held tensor computed on by the host.
pub(crate) fn host_weight<'a>(held: &'a Held, name: &str) -> Result<(&'a [u8], QuantType)> {
    let (bytes, dtype) = host_bytes(held, name)?;
    Ok((bytes, exec::kernel_type(name, dtype)?))
}

/// The bytes and dtype of a held tensor computed on by the host.
pub(crate) fn host_bytes<'a>(held: &'a Held, name: &str) -> Result<(&'a [u8], DType)> {
    let Held::Whole { tensor, device } = held else {
        return Err(EngineError::Unsupported {
            what: format!("a forward pass over split tensor '{name}'"),
            detail: "tensor-parallel and row-split layers do not run yet; load with a layer \
                     split (autosplit, layers, balanced)"
                .into(),
        });
    };
    let bytes = tensor.host_bytes().ok_or_else(|| EngineError::Device {
        device: device.clone(),
        detail: format!(
            "tensor '{name}' is not in host memory, and the host forward pass reads it there"
        ),
    })?;
    Ok((bytes, tensor.dtype()))
}

/// The instruction set the kernels use, detected once.
pub(crate) fn isa() -> Isa {
    Isa::detect()
}

/// Token ids must be at least one, each below the vocabulary size.
pub(crate) fn check_ids(ids: &[u32], vocab: u64) -> Result<()> {
    if ids.is_empty() {
        return Err(invalid(
            "token ids",
            "at least one token",
            "an empty prompt",
        ));
    }
    if let Some((i, id)) = ids
        .iter()
        .enumerate()
        .find(|(_, id)| u64::from(**id) >= vocab)
    {
        return Err(invalid(
            format!("token id at position {i}"),
            format!("below the vocabulary size {vocab}"),
            id,
        ));
    }
    Ok(())
}

/// Validate token ids and the cache room for a forward call of `n` ids at `start`.
pub(crate) fn check_tokens(ids: &[u32], vocab: u64, cache: &Cache) -> Result<u64> {
    check_ids(ids, vocab)?;
    let start = cache.seq_len();
    let max = cache.config().max_seq_len;
    let end = start + ids.len() as u64;
    if end > max {
        return Err(EngineError::ContextFull {
            tokens: ids.len() as u64,
            held: start,
            max_seq_len: max,
        });
    }
    Ok(start)
}

/// How a model runs: its thread pool and compute mode. One persistent pool serves every
/// forward call, so no thread is created per token.
#[derive(Debug)]
pub struct Runner {
    threads: usize,
    pool: Option<Arc<rayon::ThreadPool>>,
    compute: Compute,
    host_backend: bool,
    int8_threshold: f32,
    last_copies: Copies,
    /// Whether decode steps on one CUDA device replay a captured graph.
    cuda_graphs: bool,
}

impl Default for Runner {
    fn default() -> Self {
        Runner {
            threads: 0,
            pool: None,
            compute: Compute::default(),
            host_backend: false,
            int8_threshold: INT8_DEFAULT_THRESHOLD,
            last_copies: Copies::default(),
            cuda_graphs: graph::cuda_graphs_by_env(),
        }
    }
}

/// Logical CPUs this process may run on (its affinity mask and cgroup quota), read once per
/// process: the standard library reads the cgroup files on every call, a measurable part of a
/// millisecond-long load.
pub fn logical_cpus() -> usize {
    static LOGICAL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LOGICAL.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Physical cores this process may run on (the `n_threads` default, as llama.cpp's), from the
/// CPU topology in sysfs; the logical count where that cannot be read. Read once per process.
pub fn physical_cores() -> usize {
    static PHYSICAL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PHYSICAL.get_or_init(|| {
        let logical = logical_cpus();
        let read = |p: String| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
        let mut cores = std::collections::BTreeSet::new();
        for cpu in 0..logical.max(1) * 4 {
            let base = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
            let (Some(pkg), Some(core)) = (
                read(format!("{base}/physical_package_id")),
                read(format!("{base}/core_id")),
            ) else {
                continue;
            };
            cores.insert((pkg, core));
        }
        if cores.is_empty() {
            logical
        } else {
            cores.len().min(logical)
        }
    })
}

impl crate::Model {
    /// Threads the forward pass runs on (0 until set: physical cores).
    pub fn n_threads(&self) -> usize {
        if self.runner.threads == 0 {
            physical_cores()
        } else {
            self.runner.threads
        }
    }

    /// Run the forward pass on `threads` threads (0: physical cores), at most the logical CPUs
    /// the process may run on: threads beyond those only wait for each other, and thousands of
    /// them turned a token into minutes. The pool is made once.
    pub fn set_threads(&mut self, threads: usize) -> Result<()> {
        let n = if threads == 0 {
            physical_cores()
        } else {
            threads.min(logical_cpus())
        };
        if self.runner.pool.is_none() || self.runner.threads != n {
            let pool = weightlift_kernels::thread_pool(n).map_err(|e| EngineError::Device {
                device: "cpu".into(),
                detail: format!("starting {n} threads: {e}"),
            })?;
            self.runner.pool = Some(Arc::new(pool));
            self.runner.threads = n;
        }
        Ok(())
    }

    pub fn compute(&self) -> Compute {
        self.runner.compute
    }

    pub fn set_compute(&mut self, compute: Compute) {
        self.runner.compute = compute;
    }

    /// The settings the next forward call computes KV rows under.
    pub fn kv_settings(&self) -> KvSettings {
        KvSettings {
            compute: self.runner.compute,
            int8_threshold: self.runner.int8_threshold,
        }
    }

    /// The outlier threshold of LLM.int8 ([`DType::INT8`]) products: input columns where some
    /// token has `|x| ≥ threshold` are multiplied in f32 (transformers' `llm_int8_threshold`,
    /// default [`INT8_DEFAULT_THRESHOLD`], 6.0).
    pub fn int8_threshold(&self) -> f32 {
        self.runner.int8_threshold
    }

    /// Set the LLM.int8 outlier threshold: a finite value, at least 0 (0 quantises every
    /// column, bitsandbytes' `threshold=0.0`). It applies from the next forward call.
    pub fn set_int8_threshold(&mut self, threshold: f32) -> Result<()> {
        if !threshold.is_finite() || threshold < 0.0 {
            return Err(invalid(
                "int8_threshold",
                "a finite value of at least 0 (6.0 is transformers' llm_int8_threshold; 0 \
                 turns the outlier columns off)",
                threshold,
            ));
        }
        self.runner.int8_threshold = threshold;
        Ok(())
    }

    /// Whether host devices (`cpu`, `disk`, `virtual:N`) compute through the backend op
    /// sequence that `cuda:N` devices run, on the CPU backend, instead of the host path.
    pub fn host_backend(&self) -> bool {
        self.runner.host_backend
    }

    /// Run host devices through the backend op sequence (`true`) or the host path (`false`, the
    /// default: the same kernels, called directly on slices, tuned for decode). Both give the
    /// same logits bit for bit; the backend path is what `cuda:N` layers run, so this checks its
    /// op sequence on any machine. The fp16 and f32 caches only; the next forward call rebuilds
    /// the graph.
    pub fn set_host_backend(&mut self, on: bool) {
        if self.runner.host_backend != on {
            self.runner.host_backend = on;
            if let Some(s) = self.state.as_mut() {
                s.graph = None;
                s.tp_graph = None;
            }
        }
    }

    /// Whether a decode step (one token of one sequence) that runs whole on one CUDA device is
    /// captured once as a CUDA graph and replayed (one launch instead of a few hundred). On by
    /// default; `WEIGHTLIFT_CUDA_GRAPHS=0` in the environment turns it off for the process.
    pub fn cuda_graphs(&self) -> bool {
        self.runner.cuda_graphs
    }

    /// Turn CUDA graph replay of decode steps on or off from the next forward call. Both run
    /// the same kernels on the same memory, so the logits are the same bits either way.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.runner.cuda_graphs = on;
    }

    /// Decode steps captured as CUDA graphs and replayed since the forward graph was built
    /// (loading, or switching the host backend, builds it anew), and why the driver refused
    /// the last capture, if it did: `(captures, replays, refused)`.
    pub fn cuda_graph_counts(&self) -> (u64, u64, Option<String>) {
        self.state
            .as_ref()
            .and_then(|s| s.graph.as_ref())
            .map_or((0, 0, None), Graph::cuda_graph_counts)
    }

    /// Run `ids` through the model. With `cache` the tokens are appended at its `seq_len`;
    /// without, the model's own cache (attached at load) is reset and used from position 0.
    /// `out` receives `rows × vocab` logits (row-major): the last position, or every one.
    pub fn forward(
        &mut self,
        ids: &[u32],
        cache: Option<&Arc<Cache>>,
        logits: Logits,
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        self.run_forward(ids, cache, Output::Logits(logits), out)
    }

    /// [`Model::forward`], writing every position's hidden state after the output norm instead
    /// of logits: `out` receives `ids.len() × hidden` floats (row-major), the rows the head
    /// would multiply (llama.cpp's `result_norm`, which its embeddings pool). The head product
    /// does not run. The cache is used as by [`Model::forward`].
    pub fn forward_hidden(
        &mut self,
        ids: &[u32],
        cache: Option<&Arc<Cache>>,
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        self.run_forward(ids, cache, Output::Hidden, out)
    }

    /// Run several sequences in one call, each appended to its own cache at its `seq_len`:
    /// `out` receives the logits of each sequence's last position, `seqs.len() × vocab`
    /// (row-major, in order). New prompts and single decode tokens mix freely (continuous
    /// batching).
    ///
    /// On the host path each sequence attends to its own cache, and its logits are the bits it
    /// gets alone: in [`Compute::Fast`] the sequences of up to 16 tokens share the block products
    /// (which give every token its own matrix–vector bits), and in [`Compute::Exact`] each
    /// sequence keeps its own products (see `layer::linear_pieces`); an offloaded cache's layer
    /// rows are fetched as its sequence attends. The backend op sequence (`cuda:N`, or host
    /// devices through the CPU backend) batches too, its products shared as each backend
    /// allows (`exec::Exec::shared_tokens`). Tensor parallelism batches the same way, on the
    /// host path and through the backends, each device's products shared over the sequences and
    /// attention per sequence on its own cache parts (`tp::TpGraph::forward_batch`), and so do
    /// the ranks of a multi-process group when every rank is given the same sequences in the
    /// same order (one step of collectives for the batch); sequences whose tokens overflow a
    /// chunk run one at a time, with the same results.
    pub fn forward_batch(
        &mut self,
        seqs: &[(&Arc<Cache>, &[u32])],
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        if seqs.is_empty() {
            return Err(invalid("a forward batch", "at least one sequence", "none"));
        }
        // Every sequence is checked before any runs, so a bad one leaves every cache as it was.
        let vocab = self.vocab_size()?;
        for (i, (cache, ids)) in seqs.iter().enumerate() {
            if seqs[..i].iter().any(|(c, _)| Arc::ptr_eq(c, cache)) {
                return Err(invalid(
                    format!("the cache of sequence {i} in a batch"),
                    "a cache of its own for each sequence",
                    "a cache that an earlier sequence of the batch also appends to",
                ));
            }
            check_tokens(ids, vocab, cache)?;
        }
        self.run_seqs(seqs, Output::Logits(Logits::Last), out)
    }

    /// The forward call of [`Model::forward`] and [`Model::forward_hidden`].
    pub(crate) fn run_forward(
        &mut self,
        ids: &[u32],
        cache: Option<&Arc<Cache>>,
        output: Output,
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        let cache = match cache {
            Some(c) => Arc::clone(c),
            None => {
                let c = self.own_cache_for(ids.len() as u64)?;
                c.reset();
                c
            }
        };
        self.run_seqs(&[(&cache, ids)], output, out)
    }

    /// Sequences through the model: together while they fit a chunk, else one at a time.
    fn run_seqs(
        &mut self,
        seqs: &[(&Arc<Cache>, &[u32])],
        output: Output,
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        if self.runner.pool.is_none() {
            self.set_threads(self.runner.threads)?;
        }
        let spec = self
            .source()
            .spec()
            .cloned()
            .ok_or_else(|| EngineError::Unsupported {
                what: "running this checkpoint".into(),
                detail: "its architecture could not be read from the metadata or config.json"
                    .into(),
            })?;
        let source = Arc::clone(self.source());
        let inventory = self.inventory().clone();
        let compute = self.runner.compute;
        let int8_threshold = self.runner.int8_threshold;
        let host_backend = self.runner.host_backend;
        let cuda_graphs = self.runner.cuda_graphs;
        let pool = self.runner.pool.clone();
        let state = self.state.as_mut().ok_or_else(|| EngineError::NotLoaded {
            what: "the model".into(),
        })?;
        for (cache, _) in seqs {
            check_cache(cache, &spec)?;
        }
        let under = KvSettings {
            compute,
            int8_threshold,
        };
        for (cache, _) in seqs {
            cache.computing_under(under);
        }
        if let Some(tp) = state.tp.clone() {
            let made = tp::run(
                state,
                &tp,
                (source.as_ref(), &inventory),
                &spec,
                seqs,
                (output, out),
                (compute, int8_threshold, host_backend),
                pool,
            )?;
            self.runner.last_copies = made;
            return Ok(made);
        }
        if state.graph.is_none() {
            // Sized for the context the model was loaded for: its plan, else its own cache (a
            // call on another cache, such as an embedding's scratch cache, must not shrink the
            // prompt chunks of every later call).
            let sized = state.cache.as_ref().unwrap_or(seqs[0].0).config();
            let plan = state.forward.clone().unwrap_or(crate::model::ForwardPlan {
                runtime: weightlift_plan::RuntimeSpec::default(),
                max_seq_len: sized.max_seq_len,
                batch: sized.batch_size,
                tp: None,
                rank: None,
            });
            let resolve = |name: &str| crate::model::resolve_in(&inventory, name);
            let loaded = graph::Loaded {
                source: source.as_ref(),
                held: &state.held,
                copies: &state.copies,
                scratch: &state.scratch,
                layer_devices: &state.layer_devices,
                onload: state.onload.as_ref(),
                resolve: &resolve,
            };
            let mut graph = Graph::build(
                &loaded,
                &spec,
                &plan.runtime,
                (plan.max_seq_len, plan.batch),
                host_backend,
            )?;
            state.warnings.extend(graph.take_warnings());
            state.graph = Some(graph);
        }
        let crate::model::State {
            graph,
            held,
            copies,
            scratch,
            ..
        } = state;
        let Some(graph) = graph.as_mut() else {
            return Err(EngineError::NotLoaded {
                what: "the forward graph".into(),
            });
        };
        let rounds = rounds(graph, seqs);
        let mut run = || -> Result<Copies> {
            let mut made = Copies::default();
            let mut rows = Vec::new();
            out.clear();
            for round in &rounds {
                let at = &seqs[round.clone()];
                let c = (compute, int8_threshold, cuda_graphs);
                made.add(graph.forward(held, copies, scratch, at, output, c, &mut rows)?);
                out.extend_from_slice(&rows);
            }
            Ok(made)
        };
        let made = match pool {
            Some(p) => p.install(run),
            None => run(),
        }?;
        self.runner.last_copies = made;
        Ok(made)
    }

    /// The copies between devices of the last forward call.
    pub fn transfer_stats(&self) -> Copies {
        self.runner.last_copies
    }

    /// Bytes of each device's forward workspace (after the first forward call).
    pub fn workspaces(&self) -> Vec<(String, u64)> {
        self.state
            .as_ref()
            .and_then(|s| s.graph.as_ref())
            .map_or_else(Vec::new, Graph::workspaces)
    }
}

/// The tokens of one sequence a forward chunk of `chunk` tokens takes on `cache`: at most what
/// its sliding-window rings hold room for past their windows ([`crate::CacheConfig::max_chunk`]).
pub(crate) fn chunk_for(chunk: u64, cache: &Cache) -> usize {
    chunk.min(cache.config().max_chunk()).max(1) as usize
}

/// The calls a batch of sequences takes, as ranges of `seqs`: consecutive sequences together
/// while their tokens fit one chunk (each within its cache's, [`chunk_for`]), else one a call.
fn rounds(graph: &Graph, seqs: &[(&Arc<Cache>, &[u32])]) -> Vec<std::ops::Range<usize>> {
    let chunk = graph.chunk_tokens();
    let mut rounds: Vec<std::ops::Range<usize>> = Vec::new();
    let mut tokens = 0;
    // whether the last round may take more: not when its sequence runs in chunks of its own
    let mut open = false;
    for (i, (cache, ids)) in seqs.iter().enumerate() {
        let fits = ids.len() <= chunk_for(chunk as u64, cache);
        match rounds.last_mut() {
            Some(r) if open && fits && tokens + ids.len() <= chunk => {
                r.end = i + 1;
                tokens += ids.len();
            }
            _ => {
                rounds.push(i..i + 1);
                tokens = ids.len();
                open = fits;
            }
        }
    }
    rounds
}

/// A cache must have this model's shape and be allocated.
fn check_cache(cache: &Cache, spec: &weightlift_format::ModelSpec) -> Result<()> {
    let c = cache.config();
    let heads: Vec<u32> = (0..spec.n_layers).map(|l| spec.n_kv_heads_at(l)).collect();
    if c.n_kv_heads != heads || c.head_dim != spec.head_dim {
        return Err(invalid(
            "cache",
            format!(
                "one built for this model ({} layers, {} kv heads of {})",
                spec.n_layers,
                heads.first().copied().unwrap_or(0),
                spec.head_dim
            ),
            format!(
                "{} layers, {} kv heads of {}; it was built for another model",
                c.n_kv_heads.len(),
                c.n_kv_heads.first().copied().unwrap_or(0),
                c.head_dim
            ),
        ));
    }
    if c.batch_size != 1 {
        return Err(EngineError::Unsupported {
            what: format!("a forward pass with a cache of batch_size {}", c.batch_size),
            detail: "the forward pass runs one sequence; use batch_size=1".into(),
        });
    }
    if !cache.is_allocated() {
        return Err(EngineError::NotLoaded {
            what: "the cache (load the model with it first)".into(),
        });
    }
    Ok(())
}
