//! The token passes of the batched Q8-mode products (`matvec`'s `q8_matmul_batch`): a
//! product's tokens quantised once and laid out for its row kernels.
//!
//! The passes are built by runs of blocks, each run quantising its part of every token and
//! laying it out at once, the runs in parallel. Built serially, a product's passes were about
//! a tenth of a decode step of eight sequences on two threads, with the other threads waiting.

use rayon::prelude::*;

use super::Isa;
use super::matvec::{BATCH_PASS_MAX, Q8Block, TokenScales, quantize_q8_blocks, quantize_q8_into};
use crate::types::QuantType;

/// Blocks a run quantises at most (its blocks live on the stack).
const RUN_MAX_BLOCKS: usize = 64;

/// Token blocks a run holds at least: fewer are not worth handing to another thread.
const RUN_MIN_TOKEN_BLOCKS: usize = 64;

/// What a product's token passes depend on besides its input.
#[derive(Clone, Copy)]
pub(super) struct PassKey {
    pub isa: Isa,
    pub ty: QuantType,
    /// Whether the row-pair kernel takes the weights (its own layout of the tokens).
    pub paired: bool,
    /// Tokens per pass.
    pub pass: usize,
    /// Blocks of 32 values a token.
    pub per_tok: usize,
    /// The VNNI kernels' quant offset for `ty` (`vnni_offset`), 0 for none.
    pub offset: i32,
}

/// One pass of the batched Q8-mode row kernels: up to [`BATCH_PASS_MAX`] tokens' quantised
/// activations (`xs[t]`, the scalar path's view), and for the SIMD kernels the same blocks
/// interleaved by block (`qs[i · n + t]`, the quants of token `t`'s block `i`), their VNNI lane
/// offsets alike (empty without an offset) and their [`TokenScales`].
pub(super) struct TokenPass {
    /// How many tokens the pass holds.
    pub tokens: usize,
    pub xs: Vec<Vec<Q8Block>>,
    pub qs: Vec<[i8; 32]>,
    pub bias: Vec<[i32; 8]>,
    pub scales: Vec<TokenScales>,
    /// The same tokens as the row-pair kernel takes them, where the key says so.
    #[cfg(target_arch = "x86_64")]
    pub pairs: Option<super::x86_matvec512::PairTokens>,
}

/// The passes of the tokens of `x` (each `key.per_tok` blocks long) for a product of `key`:
/// tokens `j · key.pass..` in pass `j`.
pub(super) fn token_passes(key: PassKey, x: &[f32]) -> Vec<TokenPass> {
    let cols = key.per_tok * 32;
    let n_tok = x.len() / cols.max(1);
    let tokens = |t0: usize| t0..(t0 + key.pass).min(n_tok);
    if !key.isa.has_avx2() {
        // the scalar kernels read each token's blocks as they are
        return (0..n_tok)
            .step_by(key.pass.max(1))
            .map(|t0| TokenPass {
                tokens: tokens(t0).len(),
                xs: tokens(t0)
                    .map(|t| quantize_q8_blocks(&x[t * cols..(t + 1) * cols]))
                    .collect(),
                qs: Vec::new(),
                bias: Vec::new(),
                scales: Vec::new(),
                #[cfg(target_arch = "x86_64")]
                pairs: None,
            })
            .collect();
    }
    let nb = key.per_tok;
    let mut passes: Vec<TokenPass> = (0..n_tok)
        .step_by(key.pass.max(1))
        .map(|t0| {
            let n = tokens(t0).len();
            let zero = TokenScales {
                d: [0.0; BATCH_PASS_MAX],
                s: [0.0; BATCH_PASS_MAX],
                lo: [0.0; BATCH_PASS_MAX],
            };
            TokenPass {
                tokens: n,
                xs: Vec::new(),
                qs: vec![[0; 32]; nb * n],
                bias: vec![[0; 8]; if key.offset != 0 { nb * n } else { 0 }],
                scales: vec![zero; nb],
                #[cfg(target_arch = "x86_64")]
                pairs: key
                    .paired
                    .then(|| super::x86_matvec512::PairTokens::zeroed(key.ty, n, nb)),
            }
        })
        .collect();
    let mut runs = Vec::new();
    for (j, pass) in passes.iter_mut().enumerate() {
        let n = pass.tokens;
        // about one run per thread, none too small or too large
        let size = nb
            .div_ceil(rayon::current_num_threads())
            .max(RUN_MIN_TOKEN_BLOCKS.div_ceil(n))
            .clamp(1, RUN_MAX_BLOCKS);
        let mut rest = RunOut {
            qs: &mut pass.qs,
            bias: &mut pass.bias,
            scales: &mut pass.scales,
            #[cfg(target_arch = "x86_64")]
            pairs: pass.pairs.as_mut().map(|p| p.blocks()),
        };
        for i0 in (0..nb).step_by(size) {
            let count = size.min(nb - i0);
            let first = j * key.pass;
            runs.push((first, n, i0, count, rest.split_front(count, n)));
        }
    }
    runs.into_par_iter()
        .for_each(|(first, n, i0, count, mut out)| {
            let zero = Q8Block {
                d: 0.0,
                sum: 0,
                qs: [0; 32],
            };
            let mut q = [zero; RUN_MAX_BLOCKS];
            let mut lanes = [[0i32; 8]; RUN_MAX_BLOCKS];
            let lanes = &mut lanes[..if key.offset != 0 { count } else { 0 }];
            let mut lo = [0i32; RUN_MAX_BLOCKS];
            for t in 0..n {
                let start = (first + t) * cols + i0 * 32;
                let xt = &x[start..start + count * 32];
                quantize_q8_into(
                    key.isa,
                    xt,
                    key.offset,
                    &mut q[..count],
                    lanes,
                    &mut lo[..count],
                );
                for (i, b) in q[..count].iter().enumerate() {
                    out.set(i, n, t, (b, lo[i]), lanes.get(i));
                }
            }
        });
    passes
}

/// A run of blocks of one pass, to fill.
struct RunOut<'a> {
    qs: &'a mut [[i8; 32]],
    bias: &'a mut [[i32; 8]],
    scales: &'a mut [TokenScales],
    #[cfg(target_arch = "x86_64")]
    pairs: Option<super::x86_matvec512::PairBlocks<'a>>,
}

impl<'a> RunOut<'a> {
    /// The first `count` blocks (of `n` tokens each), taken off the front.
    fn split_front(&mut self, count: usize, n: usize) -> RunOut<'a> {
        let (qs, qs_rest) = std::mem::take(&mut self.qs).split_at_mut(count * n);
        let with_bias = if self.bias.is_empty() { 0 } else { count * n };
        let (bias, bias_rest) = std::mem::take(&mut self.bias).split_at_mut(with_bias);
        let (scales, scales_rest) = std::mem::take(&mut self.scales).split_at_mut(count);
        (self.qs, self.bias, self.scales) = (qs_rest, bias_rest, scales_rest);
        RunOut {
            qs,
            bias,
            scales,
            #[cfg(target_arch = "x86_64")]
            pairs: self.pairs.as_mut().map(|p| p.split_front(count, n)),
        }
    }

    /// Token `t` (of `n`) of the run's block `i` is `b`, with the sum of its first 16 quants
    /// `lo` and its lane offsets `lanes`.
    fn set(
        &mut self,
        i: usize,
        n: usize,
        t: usize,
        (b, lo): (&Q8Block, i32),
        lanes: Option<&[i32; 8]>,
    ) {
        self.qs[i * n + t] = b.qs;
        if let Some(l) = lanes {
            self.bias[i * n + t] = *l;
        }
        self.scales[i].d[t] = b.d;
        self.scales[i].s[t] = b.sum as f32;
        self.scales[i].lo[t] = lo as f32;
        #[cfg(target_arch = "x86_64")]
        if let Some(p) = &mut self.pairs {
            p.set(i, n, t, b);
        }
    }
}
