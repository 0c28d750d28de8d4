//! The matrix products: exact (in registers or dequantised chunks and the tiled GEMM), the
//! Q8-activation mode, and LLM.int8.

// cudarc's launch API is unsafe; each call says why its arguments are sound.
#![allow(unsafe_code)]

use super::launch::*;
use super::*;

/// The shape of one checked matmul: weight and activation types, `rows × cols` weights,
/// `n_tok` tokens (all buffers already checked against it).
#[derive(Clone, Copy)]
pub(super) struct MatShape {
    pub(super) ty: QuantType,
    pub(super) act: FloatType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) n_tok: usize,
}

impl MatShape {
    /// The shape of member `p` of a shared product of `n_tok` tokens of `cols` `act` values.
    pub(super) fn of(
        p: &crate::backend::Product<'_, CudaBuffer>,
        act: FloatType,
        cols: usize,
        n_tok: usize,
    ) -> MatShape {
        MatShape {
            ty: p.ty,
            act,
            rows: p.rows,
            cols,
            n_tok,
        }
    }
}

impl CudaBackend {
    /// The checks of one product before any launch: every buffer on this device, a weight
    /// type with a kernel in `mode`, f32 or f16 activations, and buffers large enough.
    pub(super) fn check_matmul(
        &self,
        mode: MatvecMode,
        m: MatShape,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &CudaBuffer,
    ) -> Result<()> {
        self.own(w)?;
        self.own(x)?;
        self.own(y)?;
        let supported = match mode {
            MatvecMode::Q8 => {
                CUDA_Q8_TYPES.contains(&m.ty) || CUDA_FAST_FLOAT_TYPES.contains(&m.ty)
            }
            MatvecMode::Exact => CUDA_EXACT_TYPES.contains(&m.ty),
        };
        let names = match mode {
            MatvecMode::Q8 => CUDA_FAST_NAMES,
            MatvecMode::Exact => CUDA_EXACT_NAMES,
        };
        if !supported {
            return Err(KernelError::Unsupported {
                op: match mode {
                    MatvecMode::Q8 => "matmul on cuda (q8 mode)",
                    MatvecMode::Exact => "matmul on cuda",
                },
                ty: m.ty.to_string(),
                supported: names,
            });
        }
        if m.act == FloatType::BF16 {
            return Err(KernelError::Unsupported {
                op: "matmul",
                ty: "bf16 activations".into(),
                supported: "f32, f16",
            });
        }
        need(
            "matmul weight bytes",
            w,
            mul(m.rows, quant_bytes(m.ty, m.cols)?),
        )?;
        need(
            "matmul activation bytes",
            x,
            mul(mul(m.n_tok, m.cols), m.act.size()),
        )?;
        need("matmul output bytes", y, mul(mul(m.n_tok, m.rows), 4))
    }

    /// Exact mode in registers: `matvec_{type}_{act}` / `matmul_{type}_{act}`. Quantised
    /// weights: one warp per (row, token), each weight decoded again per token. Float weights:
    /// [`float_row_threads`] threads a row, each weight chunk loaded once per pass of
    /// [`FLOAT_TOKENS_PER_PASS`] tokens.
    pub(super) fn matmul_exact(
        &self,
        m: MatShape,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let kind = if m.n_tok == 1 { "matvec" } else { "matmul" };
        let name = format!("{kind}_{}_{}", m.ty.name(), m.act.name());
        let cfg = if CUDA_FLOAT_TYPES.contains(&m.ty) {
            // `tpr` threads a row, 256 / tpr rows a block; token passes of
            // FLOAT_TOKENS_PER_PASS ride grid.y, which CUDA caps at 65535 (the kernel strides)
            let passes = if m.n_tok == 1 {
                1
            } else {
                m.n_tok.div_ceil(FLOAT_TOKENS_PER_PASS).min(MAX_GRID_YZ)
            };
            self.float_launch(m.ty, m.rows, m.cols, passes)?
        } else {
            // 8 warps of 32 per block, one row each; tokens ride grid.y, which CUDA caps at
            // 65535, and the kernel strides over the rest
            LaunchConfig {
                grid_dim: (
                    grid_for(m.rows, 8, "rows")?,
                    m.n_tok.min(MAX_GRID_YZ) as u32,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            }
        };
        let mut args = vec![
            KArg::In(&w.slice),
            KArg::In(&x.slice),
            KArg::Out(&mut y.slice),
            KArg::U64(m.rows as u64),
            KArg::U64(m.cols as u64),
        ];
        if m.n_tok > 1 {
            args.push(KArg::U64(m.n_tok as u64));
        }
        // SAFETY: the threads of a row read that weight row and the activation rows of their
        // tokens and write one output per token (a thread past the last row reads the last row
        // and writes nothing), all within the sizes the caller checked.
        unsafe { self.launch("matvec", &name, cfg, &mut args) }
    }

    /// The launch of a float-weight kernel (`matvec_`, `matmul_`, `matvec3_`, `swiglu_matvec_`)
    /// over `rows` rows of `cols` values of `ty` with `passes` token passes on grid.y:
    /// [`float_row_threads`] threads a row, `FLOAT_BLOCK_THREADS / tpr` rows a block. The
    /// threads a row set each row's sum order, so every kernel of one shape shares it.
    fn float_launch(
        &self,
        ty: QuantType,
        rows: usize,
        cols: usize,
        passes: usize,
    ) -> Result<LaunchConfig> {
        let tpr = float_row_threads(rows, cols, ty.block_bytes(), passes, self.sm_count);
        let per_block = FLOAT_BLOCK_THREADS / tpr;
        Ok(LaunchConfig {
            grid_dim: (grid_for(rows, per_block, "rows")?, passes as u32, 1),
            block_dim: (tpr as u32, per_block as u32, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Q8 mode: `q8_quantize_{act}` turns every token's activations into 40-byte blocks
    /// ([`CudaBackend::q8_activations`]), then `q8_matvec_{type}` (one token; or
    /// `q8_wide_matvec_{type}` where the backend's [`Q8Decode`] picks the wide lanes) or
    /// `q8_matmul_{type}` meets each weight group with them in integers (`q8_mma_{type}` on
    /// int8 tensor cores where [`CublasMinTokens::mma_takes`](crate::sources::CublasMinTokens::mma_takes)).
    pub(super) fn matmul_q8(
        &self,
        m: MatShape,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
        ready: Option<Q8Ready>,
    ) -> Result<()> {
        self.q8_activations(m, x, ready, |xq| self.q8_product(m, w, xq, y))
    }

    /// Quantises the `m.n_tok × m.cols` activations `x` into 40-byte blocks and gives them to
    /// `then`. Decode's few blocks go to a buffer the backend keeps (locked until `then`
    /// returns, so a thread sharing the backend cannot overwrite them between the two
    /// launches); a prompt's get a scratch buffer of their own, freed after. Where the op
    /// before quantised these very activations into the kept buffer (`ready`, taken as this op
    /// started: see [`Op::AddRmsNorm`]'s `q8_next`), `then` gets those blocks, the same bytes.
    pub(super) fn q8_activations<R>(
        &self,
        m: MatShape,
        x: &CudaBuffer,
        ready: Option<Q8Ready>,
        then: impl FnOnce(&CudaSlice<u8>) -> Result<R>,
    ) -> Result<R> {
        // cols is a whole number of weight blocks (checked by quant_bytes), so of 32 values
        let n_blocks = mul(m.n_tok, m.cols / 32);
        let bytes = n_blocks
            .checked_mul(Q8_BLOCK_BYTES)
            .ok_or_else(|| KernelError::Shape {
                op: "matmul on cuda (q8 mode)",
                reason: format!(
                    "{} tokens of {} values overflow the activation blocks",
                    m.n_tok, m.cols
                ),
            })?;
        let quantise = |xq: &mut CudaSlice<u8>| -> Result<()> {
            let name = format!("q8_quantize_{}", m.act.name());
            let mut args = [
                KArg::In(&x.slice),
                KArg::Out(xq),
                KArg::U64(n_blocks as u64),
            ];
            // SAFETY: one warp per block below n_blocks reads its 32 activations (n_tok * cols
            // were checked) and writes its 40 bytes of xq (which holds at least n_blocks).
            unsafe { self.launch("matvec", &name, elementwise(mul(n_blocks, 32))?, &mut args) }
        };
        let mut kept = self.lock_q8_kept();
        let here = Q8Ready {
            x: x.device_addr(),
            n_blocks,
        };
        if let (Some(xq), true) = (kept.as_ref(), ready == Some(here)) {
            return then(xq);
        }
        if bytes <= Q8_KEPT_BYTES
            && let Some(xq) = self.made_q8_kept(&mut kept)?
        {
            quantise(xq)?;
            return then(xq);
        }
        drop(kept);
        // SAFETY: q8_quantize writes all n_blocks blocks before the products (later on the
        // same stream) read them.
        let mut xq = unsafe { self.scratch(bytes) }?;
        quantise(&mut xq)?;
        then(&xq)
    }

    /// Decode's kept Q8 buffer, locked.
    pub(super) fn lock_q8_kept(&self) -> std::sync::MutexGuard<'_, Option<CudaSlice<u8>>> {
        self.q8_kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The kept Q8 buffer in `kept` (its lock held), made first where there is none, unless a
    /// graph is being recorded (what a recording allocates is the graph's own memory: see
    /// `capturing`); `None` then.
    pub(super) fn made_q8_kept<'k>(
        &self,
        kept: &'k mut Option<CudaSlice<u8>>,
    ) -> Result<Option<&'k mut CudaSlice<u8>>> {
        if kept.is_none() && !self.capturing()? {
            // SAFETY: every use quantises into it before a product reads it.
            *kept = Some(unsafe { self.scratch(Q8_KEPT_BYTES) }?);
        }
        Ok(kept.as_mut())
    }

    /// Runs `launch`, which quantises the activations at device address `x` into the first
    /// `n_blocks` blocks of the kept Q8 buffer it is given (as it writes them), and hands
    /// those blocks to the next op (see [`Op::AddRmsNorm`]'s `q8_next`). Returns false, having
    /// launched nothing, where they would not fit the kept buffer or it cannot be made yet.
    pub(super) fn quantise_ahead(
        &self,
        x: u64,
        n_blocks: usize,
        launch: impl FnOnce(&mut CudaSlice<u8>) -> Result<()>,
    ) -> Result<bool> {
        if mul(n_blocks, Q8_BLOCK_BYTES) > Q8_KEPT_BYTES {
            return Ok(false);
        }
        let mut kept = self.lock_q8_kept();
        let Some(xq) = self.made_q8_kept(&mut kept)? else {
            return Ok(false);
        };
        launch(xq)?;
        *self.lock_q8_ready() = Some(Q8Ready { x, n_blocks });
        Ok(true)
    }

    /// What the kept Q8 buffer holds for the next op, locked.
    pub(super) fn lock_q8_ready(&self) -> std::sync::MutexGuard<'_, Option<Q8Ready>> {
        self.q8_ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a product of `n_tok` tokens of `ty` in `mode` (`act` activations) runs decode's
    /// one-token kernel for each token ([`CudaBackend::q8_each_token`]): a few tokens of a type
    /// with the wide lanes, in Q8 mode, that cuBLAS does not take. The fused gate/up kernels
    /// then take the same tokens in one launch, each row's sums those of the products.
    pub(super) fn q8_each_token_takes(
        &self,
        mode: MatvecMode,
        ty: QuantType,
        n_tok: usize,
        act: FloatType,
    ) -> Result<bool> {
        Ok(mode == MatvecMode::Q8
            && CUDA_Q8_TYPES.contains(&ty)
            && n_tok > 1
            && self.q8_each_token_route(ty, n_tok)
            && !self.cublas_takes(ty, mode, n_tok, act)?)
    }

    /// Whether a Q8-mode product of `n_tok` tokens of `ty` that cuBLAS does not take runs
    /// decode's one-token kernel for each token: one token, or a few of a type with decode's
    /// wide lanes (see [`CudaBackend::q8_each_token`]).
    pub(super) fn q8_each_token_route(&self, ty: QuantType, n_tok: usize) -> bool {
        n_tok == 1 || (n_tok <= Q8_WIDE_ALONE_MAX_TOKENS && self.q8_decode.wide_for(ty))
    }

    /// One product of Q8 mode on activations `xq` already quantised (see
    /// [`CudaBackend::matmul_q8`]).
    pub(super) fn q8_product(
        &self,
        m: MatShape,
        w: &CudaBuffer,
        xq: &CudaSlice<u8>,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        if self.q8_each_token_route(m.ty, m.n_tok) {
            return self.q8_each_token(m, w, xq, y);
        }
        if self
            .cublas_min_tokens
            .mma_takes(m.ty, MatvecMode::Q8, m.n_tok, self.cc)
        {
            return self.q8_mma(m, w, xq, y);
        }
        // 8 threads per row, 32 rows per block of 256; 4 tokens per thread pass on grid.y
        let cfg = LaunchConfig {
            grid_dim: (
                grid_for(m.rows, 32, "rows")?,
                m.n_tok.div_ceil(4).min(MAX_GRID_YZ) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: each row group reads one weight row (rows were checked) and each token's
        // cols / 32 blocks of xq, and writes y[t * rows + r] below n_tok * rows (checked).
        unsafe { self.launch_q8_prompt("q8_matmul_", cfg, m, w, xq, y) }
    }

    /// Decode's one-token kernel ([`CudaBackend::q8_decode_launch`]) for each token, in one
    /// launch whose grid.y is the token (its blocks of `xq`, its row of `y`): one token, or a
    /// few of a type with decode's wide lanes ([`Q8Decode::wide_for`]). On an H200 the wide
    /// kernel took 8 µs for a 2,048² Q4_K matrix read from device memory, where
    /// `q8_matmul_q4_k` took 62 µs for two tokens and cuBLAS 35 (its weights dequantised
    /// first), so up to [`Q8_WIDE_ALONE_MAX_TOKENS`] tokens this costs less; and each token
    /// gets the bits it gets alone.
    fn q8_each_token(
        &self,
        m: MatShape,
        w: &CudaBuffer,
        xq: &CudaSlice<u8>,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let (cfg, family) = self.q8_decode_launch(m)?;
        let name = format!("{family}{}", m.ty.name());
        let mut args = [
            KArg::In(&w.slice),
            KArg::In(xq),
            KArg::Out(&mut y.slice),
            KArg::U64(m.rows as u64),
            KArg::U64(m.cols as u64),
        ];
        // SAFETY: each row's warps read one weight row (rows were checked; a row past the last
        // reads the last) and their token's cols / 32 blocks of xq (quantised for all n_tok
        // tokens), and write its y[t * rows + r] below n_tok * rows (checked).
        unsafe { self.launch("matvec", &name, cfg, &mut args) }
    }

    /// Decode's products of one input with three matrices (a layer's q, k and v) in one launch:
    /// `matvec3_{type}_{act}` in exact mode on activations `x`, or `q8_matvec3_{type}` /
    /// `q8_wide_matvec3_{type}` in Q8 mode on activations `x` quantised once (a grid row a
    /// token). Each member's rows get the blocks its own launch would give them (see
    /// `kernels/matvec.cu`), so every output has the bits of the member's own product. Taken
    /// for three members of one type, each with rows, whose own launches would have the same
    /// block shape; returns whether it ran (nothing ran otherwise). The caller has checked the
    /// buffers and chosen the route: one token's float kernels, or Q8 mode's
    /// [`CudaBackend::q8_each_token`].
    pub(super) fn grouped_decode(
        &self,
        mode: MatvecMode,
        (act, cols, n_tok): (FloatType, usize, usize),
        x: &CudaSlice<u8>,
        products: &mut [crate::backend::Product<'_, CudaBuffer>],
    ) -> Result<bool> {
        let [p0, p1, p2] = products else {
            return Ok(false);
        };
        let ty = p0.ty;
        if p1.ty != ty || p2.ty != ty || [p0.rows, p1.rows, p2.rows].contains(&0) {
            return Ok(false);
        }
        let shape = |rows: usize| MatShape {
            ty,
            act,
            rows,
            cols,
            n_tok,
        };
        // each member's own launch, and the kernel family
        let own = |rows: usize| -> Result<(LaunchConfig, String)> {
            match mode {
                MatvecMode::Q8 => {
                    let (cfg, family) = self.q8_decode_launch(shape(rows))?;
                    Ok((
                        cfg,
                        format!("{}3_{}", family.trim_end_matches('_'), ty.name()),
                    ))
                }
                MatvecMode::Exact => {
                    let cfg = self.float_launch(ty, rows, cols, 1)?;
                    Ok((cfg, format!("matvec3_{}_{}", ty.name(), act.name())))
                }
            }
        };
        if mode == MatvecMode::Exact && (n_tok != 1 || !CUDA_FLOAT_TYPES.contains(&ty)) {
            return Ok(false);
        }
        let (c0, name) = own(p0.rows)?;
        let (c1, _) = own(p1.rows)?;
        let (c2, _) = own(p2.rows)?;
        let same = |c: &LaunchConfig| c.block_dim == c0.block_dim && c.grid_dim.1 == c0.grid_dim.1;
        if !same(&c1) || !same(&c2) {
            return Ok(false);
        }
        let cfg = LaunchConfig {
            grid_dim: (
                c0.grid_dim.0 + c1.grid_dim.0 + c2.grid_dim.0,
                c0.grid_dim.1,
                1,
            ),
            ..c0
        };
        let mut args = [
            KArg::In(&p0.w.slice),
            KArg::In(&p1.w.slice),
            KArg::In(&p2.w.slice),
            KArg::In(x),
            KArg::Out(&mut p0.y.slice),
            KArg::Out(&mut p1.y.slice),
            KArg::Out(&mut p2.y.slice),
            KArg::U64(p0.rows as u64),
            KArg::U64(p1.rows as u64),
            KArg::U64(p2.rows as u64),
            KArg::U64(cols as u64),
        ];
        // SAFETY: a block of member m runs member m's own launch's block (the same shape, at
        // its block index within the member: see kernels/matvec.cu): it reads that member's
        // weight rows (rows × cols of each checked by the caller) and the token's activations
        // (checked, or quantised for all n_tok tokens earlier on this stream), and writes its
        // y[t * rows + r] below n_tok × rows (checked).
        unsafe { self.launch("matvec", &name, cfg, &mut args) }?;
        Ok(true)
    }

    /// Launches the prompt product kernel `{family}{type}` of `m` with `cfg`: weights `w`,
    /// quantised activations `xq`, output `y` (`n_tok × rows`).
    ///
    /// # Safety
    /// The kernel reads and writes only inside the shapes of `m` at the launch `cfg` gives it.
    unsafe fn launch_q8_prompt(
        &self,
        family: &str,
        cfg: LaunchConfig,
        m: MatShape,
        w: &CudaBuffer,
        xq: &CudaSlice<u8>,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let name = format!("{family}{}", m.ty.name());
        let mut args = [
            KArg::In(&w.slice),
            KArg::In(xq),
            KArg::Out(&mut y.slice),
            KArg::U64(m.rows as u64),
            KArg::U64(m.cols as u64),
            KArg::U64(m.n_tok as u64),
        ];
        // SAFETY: the caller's contract.
        unsafe { self.launch("matvec", &name, cfg, &mut args) }
    }

    /// A prompt's Q8 product on int8 tensor cores (`q8_mma_{type}`, compute capability 8.0
    /// and later): blocks of [`MMQ_THREADS`] threads, each [`MMQ_BLOCK_ROWS`] weight rows
    /// against tiles of [`MMQ_BLOCK_TOKENS`] tokens (grid.y, which CUDA caps at 65535; the
    /// kernel strides over the rest).
    fn q8_mma(
        &self,
        m: MatShape,
        w: &CudaBuffer,
        xq: &CudaSlice<u8>,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (
                grid_for(m.rows, MMQ_BLOCK_ROWS, "rows")?,
                m.n_tok.div_ceil(MMQ_BLOCK_TOKENS).min(MAX_GRID_YZ) as u32,
                1,
            ),
            block_dim: (MMQ_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: a block stages weight rows below rows (checked; rows past the end stage
        // zeros) and activation blocks of tokens below n_tok (cols / 32 each, quantised before
        // on this stream), and writes y[t * rows + r] for r below rows and t below n_tok.
        unsafe { self.launch_q8_prompt("q8_mma_", cfg, m, w, xq, y) }
    }

    /// The launch of decode's Q8 product of `m` (one token, or a few: a grid row each), and
    /// its kernel family:
    /// `q8_matvec_` with [`q8_matvec_warps`] warps a row, or, where this backend's
    /// [`Q8Decode`] picks the wide lanes for the type, `q8_wide_matvec_` with
    /// [`q8_wide_matvec_warps`]; `Q8_MATVEC_THREADS / (32 wpr)` rows a block either way. The
    /// fused gate/up kernels take the same launch (`swiglu_` + the family), so each row's sums
    /// are the family's own.
    fn q8_decode_launch(&self, m: MatShape) -> Result<(LaunchConfig, &'static str)> {
        let (wpr, family) = if self.q8_decode.wide_for(m.ty) {
            (
                q8_wide_matvec_warps(m.rows, m.cols, self.sm_count),
                "q8_wide_matvec_",
            )
        } else {
            (q8_matvec_warps(m.rows, m.cols, self.sm_count), "q8_matvec_")
        };
        let per_block = Q8_MATVEC_THREADS / (32 * wpr);
        // a token a grid row: decode's few (the caller keeps to Q8_WIDE_ALONE_MAX_TOKENS)
        let tokens = u32::try_from(m.n_tok)
            .ok()
            .filter(|&t| (1..=MAX_GRID_YZ as u32).contains(&t))
            .ok_or_else(|| KernelError::Shape {
                op: "q8 decode product on cuda",
                reason: format!("{} tokens in one launch (1 to {MAX_GRID_YZ})", m.n_tok),
            })?;
        let cfg = LaunchConfig {
            grid_dim: (grid_for(m.rows, per_block, "rows")?, tokens, 1),
            block_dim: ((32 * wpr) as u32, per_block as u32, 1),
            shared_mem_bytes: 0,
        };
        Ok((cfg, family))
    }

    /// [`Op::MatmulSwiGlu`] of one token in one launch (after the activations' quantisation
    /// in Q8 mode; a few tokens of a wide type too, a grid row each, see
    /// [`CudaBackend::q8_each_token_takes`]): `swiglu_matvec_{type}_{act}` with the threads a row of
    /// `matvec_{type}_{act}`, or `swiglu_q8_matvec_{type}` (`swiglu_q8_wide_matvec_{type}`)
    /// with the warps a row of `q8_matvec_{type}` (`q8_wide_matvec_{type}`: see
    /// [`CudaBackend::q8_decode_launch`]), so each row's gate and up sums are those kernels'
    /// sums and `y` gets the bits of the two products and `swiglu_inplace_f32`. `m` is the
    /// shape of either matrix (one type, one row count: the caller checked).
    pub(super) fn matvec_swiglu(
        &self,
        mode: MatvecMode,
        m: MatShape,
        [wg, wu]: [&CudaBuffer; 2],
        x: &CudaBuffer,
        y: &mut CudaBuffer,
        ready: Option<Q8Ready>,
    ) -> Result<()> {
        self.check_matmul(mode, m, wg, x, y)?;
        self.check_matmul(mode, m, wu, x, y)?;
        if m.rows == 0 {
            return Ok(());
        }
        let launch = |name: String,
                      cfg: LaunchConfig,
                      xin: &CudaSlice<u8>,
                      y: &mut CudaBuffer|
         -> Result<()> {
            let mut args = [
                KArg::In(&wg.slice),
                KArg::In(&wu.slice),
                KArg::In(xin),
                KArg::Out(&mut y.slice),
                KArg::U64(m.rows as u64),
                KArg::U64(m.cols as u64),
            ];
            // SAFETY: the threads of a row read that row of both weight matrices (rows × cols
            // of each checked; a row past the last reads the last) and their token's
            // activations (checked, or the cols / 32 quantised blocks of each of the n_tok
            // tokens written before on this stream), and write y[t * rows + r] below
            // n_tok * rows (checked).
            unsafe { self.launch("matvec", &name, cfg, &mut args) }
        };
        match mode {
            MatvecMode::Exact if m.n_tok != 1 => Err(KernelError::Shape {
                op: "swiglu matvec on cuda",
                reason: format!("the float kernels take one token, got {}", m.n_tok),
            }),
            MatvecMode::Exact => {
                let cfg = self.float_launch(m.ty, m.rows, m.cols, 1)?;
                let name = format!("swiglu_matvec_{}_{}", m.ty.name(), m.act.name());
                launch(name, cfg, &x.slice, y)
            }
            MatvecMode::Q8 => {
                let (cfg, family) = self.q8_decode_launch(m)?;
                let name = format!("swiglu_{family}{}", m.ty.name());
                self.q8_activations(m, x, ready, |xq| launch(name, cfg, xq, y))
            }
        }
    }

    /// Whether a prompt product of `ty` in `mode`, `n_tok` tokens of `act` activations, takes
    /// cuBLAS here (making the handle if there is none yet).
    pub(super) fn cublas_takes(
        &self,
        ty: QuantType,
        mode: MatvecMode,
        n_tok: usize,
        act: FloatType,
    ) -> Result<bool> {
        let route = self.cublas_min_tokens.route(ty, mode, n_tok, self.cc);
        if route != PromptRoute::Cublas || act != FloatType::F32 {
            return Ok(false);
        }
        Ok(self.with_cublas(|_| Ok(()))?.is_some())
    }

    /// Whether any of the products of `types` in `mode` takes cuBLAS (see
    /// [`CudaBackend::cublas_takes`]).
    pub(super) fn cublas_takes_any(
        &self,
        types: impl IntoIterator<Item = QuantType>,
        mode: MatvecMode,
        n_tok: usize,
        act: FloatType,
    ) -> Result<bool> {
        for ty in types {
            if self.cublas_takes(ty, mode, n_tok, act)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A prompt's product on cuBLAS (see [`crate::sources::CUBLAS_MIN_TOKENS`]), or `false`
    /// with nothing run when this one does not take it: too few tokens, f16 activations, no
    /// libcublas, a weight row longer than `max_dq_size` allows in one chunk, or an operand it
    /// reads in place at an address that is not a multiple of its element.
    ///
    /// - Exact mode: f32 weights as they are, the others dequantised to f32 `chunk` rows at a
    ///   time into a scratch of at most `max_dq_size` values ([`dq_chunk_rows`], the chunks of
    ///   the kernels' own path), each chunk one f32 GEMM with `CUBLAS_COMPUTE_32F_PEDANTIC`:
    ///   f32 products and sums, no TF32, so the results stay within exact mode's bound (the
    ///   sum order is cuBLAS's, not one FMA chain).
    /// - Fast mode ([`MatvecMode::Q8`]): the activations rounded once to f16 (to bf16 for bf16
    ///   weights) into a scratch of `n_tok × cols` values; f16 and bf16 weights multiplied as
    ///   they are, quantised ones dequantised to f16 chunk by chunk (half the exact chunk's
    ///   bytes); tensor cores with f32 accumulation (`CUBLAS_COMPUTE_32F`).
    ///
    /// The output is written in place: chunk `r0..r0 + nr` is the GEMM's `nr × n_tok` block at
    /// `y + r0` with leading dimension `rows`.
    pub(super) fn matmul_cublas(
        &self,
        mode: MatvecMode,
        m: MatShape,
        max_dq_size: usize,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<bool> {
        let Some(route) = self.cublas_route_for(mode, m, max_dq_size, w, x, y)? else {
            return Ok(false);
        };
        let rounded = route
            .convert
            .map(|name| self.rounded_activations(name, m, x))
            .transpose()?;
        self.cublas_product(&route, m, w, (x, rounded.as_ref()), y)?;
        Ok(true)
    }

    /// [`Op::MatmulShared`](crate::Op::MatmulShared) off the Q8 kernels' shared path: each
    /// member as its own [`Op::Matmul`](crate::Op::Matmul) would run, except that the
    /// activations are rounded once per operand type (f16 or bf16) for every member that takes
    /// cuBLAS with it, where each such product would round them again: the same kernel on the
    /// same values, so the same bits. `run` runs a member that does not take cuBLAS (the
    /// backend's own dispatch of its `Op::Matmul`).
    pub(super) fn matmul_shared_cublas(
        &self,
        (mode, act, cols, n_tok, max_dq_size): (MatvecMode, FloatType, usize, usize, usize),
        x: &CudaBuffer,
        products: Vec<crate::backend::Product<'_, CudaBuffer>>,
        mut run: impl FnMut(crate::backend::Product<'_, CudaBuffer>) -> Result<()>,
    ) -> Result<()> {
        // the activations rounded for cuBLAS, by the kernel that rounded them
        let mut rounded: Vec<(&'static str, CudaSlice<u8>)> = Vec::new();
        for p in products {
            let m = MatShape::of(&p, act, cols, n_tok);
            self.check_matmul(mode, m, p.w, x, p.y)?;
            let route = if n_tok == 0 {
                None
            } else {
                self.cublas_route_for(mode, m, max_dq_size, p.w, x, p.y)?
            };
            let Some(route) = route else {
                run(p)?;
                continue;
            };
            let xs = match route.convert {
                Some(name) => {
                    let i = match rounded.iter().position(|(k, _)| *k == name) {
                        Some(i) => i,
                        None => {
                            rounded.push((name, self.rounded_activations(name, m, x)?));
                            rounded.len() - 1
                        }
                    };
                    Some(&rounded[i].1)
                }
                None => None,
            };
            self.cublas_product(&route, m, p.w, (x, xs), p.y)?;
        }
        Ok(())
    }

    /// The cuBLAS route a prompt product of `m` in `mode` takes here (see
    /// [`CudaBackend::matmul_cublas`]), or `None`.
    fn cublas_route_for(
        &self,
        mode: MatvecMode,
        m: MatShape,
        max_dq_size: usize,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &CudaBuffer,
    ) -> Result<Option<CublasRoute>> {
        if m.rows == 0 || m.cols == 0 || !self.cublas_takes(m.ty, mode, m.n_tok, m.act)? {
            return Ok(None);
        }
        let fast = mode == MatvecMode::Q8;
        let Some(route) = cublas_route(fast, m.ty, m.rows, m.cols, max_dq_size) else {
            return Ok(None);
        };
        // cuBLAS reads whole elements: a view at an offset that is not a multiple of one (the
        // kernels' byte-by-byte path takes those) stays on the kernels
        let aligned = |b: &CudaBuffer, size: usize| {
            b.slice
                .device_ptr(&self.stream)
                .0
                .is_multiple_of(size as u64)
        };
        if !aligned(y, 4)
            || (route.convert.is_none() && !aligned(x, 4))
            || (route.dequantize.is_none() && !aligned(w, m.ty.block_bytes()))
        {
            return Ok(None);
        }
        Ok(Some(route))
    }

    /// The activations of `m` (`n_tok × cols` f32 in `x`) rounded once by the kernel `name`
    /// (a cuBLAS route's `convert`) into a scratch of 2-byte values, for fast mode's GEMMs.
    fn rounded_activations(
        &self,
        name: &'static str,
        m: MatShape,
        x: &CudaBuffer,
    ) -> Result<CudaSlice<u8>> {
        let n_x = mul(m.n_tok, m.cols);
        // SAFETY: the conversion below writes all n_x values before the GEMMs read them.
        let mut xs = unsafe { self.scratch(mul(n_x, 2)) }?;
        let mut args = [
            KArg::In(&x.slice),
            KArg::Out(&mut xs),
            KArg::U64(n_x as u64),
        ];
        // SAFETY: one thread per value below n_x; x holds n_tok × cols f32 (checked by the
        // caller) and xs n_x 2-byte values.
        unsafe { self.launch("convert", name, elementwise(n_x)?, &mut args) }?;
        Ok(xs)
    }

    /// The launches of [`CudaBackend::matmul_cublas`] along `route` (the buffers were checked
    /// against `m` by the caller): the GEMMs' B operand is `converted` (the activations
    /// rounded by `route.convert`, see [`CudaBackend::rounded_activations`]) or else `x` as it
    /// is. Only the GEMMs hold the cuBLAS handle's lock: the dequantise launches and the
    /// scratch need no handle, and every use of the handle's workspace is ordered on this
    /// backend's one stream, which the handle is bound to.
    fn cublas_product(
        &self,
        route: &CublasRoute,
        m: MatShape,
        w: &CudaBuffer,
        (x, converted): (&CudaBuffer, Option<&CudaSlice<u8>>),
        y: &mut CudaBuffer,
    ) -> Result<()> {
        use cudarc::cublas::sys::{cublasComputeType_t as Compute, cudaDataType as Dt};
        let row_bytes = quant_bytes(m.ty, m.cols)?;
        let chunk = route.chunk;
        let (ab, compute, elem) = match route.operands {
            "f32" => (Dt::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F_PEDANTIC, 4),
            "bf16" => (Dt::CUDA_R_16BF, Compute::CUBLAS_COMPUTE_32F, 2),
            _ => (Dt::CUDA_R_16F, Compute::CUBLAS_COMPUTE_32F, 2),
        };
        let x_ptr = match converted {
            Some(xs) => xs.device_ptr(&self.stream).0,
            None => x.slice.device_ptr(&self.stream).0,
        };
        let w_ptr = w.slice.device_ptr(&self.stream).0;
        let y_ptr = y.slice.device_ptr_mut(&self.stream).0;
        let gemm = |a: u64, r0: usize, nr: usize| cublas::Gemm {
            m: nr,
            n: m.n_tok,
            k: m.cols,
            a,
            lda: m.cols,
            b: x_ptr,
            ldb: m.cols,
            c: y_ptr + (r0 * 4) as u64,
            ldc: m.rows,
            ab,
            compute,
        };
        // one GEMM on the handle, under its lock
        let run = |g: cublas::Gemm| -> Result<()> {
            let ran = self.with_cublas(|h| {
                // SAFETY: `g` names the matrices the comment at each call gives, on this
                // backend's stream, which the handle is bound to.
                unsafe { h.gemm(&g) }
            })?;
            ran.ok_or_else(|| KernelError::Cuda {
                during: format!("a cuBLAS product on {}", self.name()),
                message: "the cuBLAS handle this product was routed to is gone".into(),
            })
        };
        let Some(dq_name) = &route.dequantize else {
            // A is the rows × cols weights (checked), B the n_tok × cols activations (checked,
            // or converted), C the n_tok × rows output (checked).
            return run(gemm(w_ptr, 0, m.rows));
        };
        // SAFETY: each chunk's dequantize launch writes the values its GEMM reads (chunk rows
        // or fewer, from the start), earlier on the same stream.
        let mut wd = unsafe { self.scratch(mul(mul(chunk, m.cols), elem)) }?;
        let wd_ptr = wd.device_ptr(&self.stream).0;
        let mut r0 = 0;
        while r0 < m.rows {
            let nr = chunk.min(m.rows - r0);
            let n = nr * m.cols;
            let view = w.slice.slice(r0 * row_bytes..(r0 + nr) * row_bytes);
            let mut args = [KArg::InView(view), KArg::Out(&mut wd), KArg::U64(n as u64)];
            // SAFETY: n values of nr whole weight rows, inside the checked weight bytes, into
            // the scratch of chunk × cols >= n values.
            unsafe { self.launch("dequant", dq_name, dequantize(n)?, &mut args) }?;
            // A is the nr × cols chunk just written, B as above, C the output rows r0..r0 + nr
            // of every token (ld rows, inside the checked n_tok × rows).
            run(gemm(wd_ptr, r0, nr))?;
            r0 += nr;
        }
        Ok(())
    }

    /// Exact mode for prompts: `chunk` weight rows at a time are dequantised to f32 into a
    /// scratch buffer of `chunk × cols` values (at most `max_dq_size`, see
    /// [`dq_chunk_rows`]), then `gemm_{act}` multiplies them with every token.
    pub(super) fn matmul_dq(
        &self,
        m: MatShape,
        chunk: usize,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let row_bytes = quant_bytes(m.ty, m.cols)?;
        // SAFETY: each chunk's dequantize launch writes the values its gemm launch reads
        // (chunk rows or fewer, from the start), earlier on the same stream.
        let mut wd = unsafe { self.scratch(mul(mul(chunk, m.cols), 4)) }?;
        let dq_name = format!("dequantize_{}_f32", m.ty.name());
        let gemm_name = format!("gemm_{}", m.act.name());
        let mut r0 = 0;
        while r0 < m.rows {
            let nr = chunk.min(m.rows - r0);
            let n = nr * m.cols;
            let view = w.slice.slice(r0 * row_bytes..(r0 + nr) * row_bytes);
            let mut args = [KArg::InView(view), KArg::Out(&mut wd), KArg::U64(n as u64)];
            // SAFETY: n values of nr whole weight rows, inside the checked weight bytes, into
            // the scratch of chunk * cols >= n values.
            unsafe { self.launch("dequant", &dq_name, dequantize(n)?, &mut args) }?;
            let cfg = LaunchConfig {
                grid_dim: (
                    grid_for(nr, GEMM_BLOCK_ROWS, "rows")?,
                    m.n_tok.div_ceil(GEMM_BLOCK_TOKENS).min(MAX_GRID_YZ) as u32,
                    1,
                ),
                block_dim: (GEMM_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = [
                KArg::In(&wd),
                KArg::In(&x.slice),
                KArg::Out(&mut y.slice),
                KArg::U64(nr as u64),
                KArg::U64(m.cols as u64),
                KArg::U64(m.n_tok as u64),
                KArg::U64(r0 as u64),
                KArg::U64(m.rows as u64),
            ];
            // SAFETY: the kernel reads nr rows of the scratch and n_tok activation rows, and
            // writes y[t * rows + r0 + r] for r < nr, t < n_tok, below n_tok * rows (checked).
            unsafe { self.launch("matvec", &gemm_name, cfg, &mut args) }?;
            r0 += nr;
        }
        Ok(())
    }
}

impl CudaBackend {
    /// LLM.int8 (`kernels/int8.cu`): `int8_outliers_f32` lists the outlier columns of `x`,
    /// `int8_quantize_f32` quantises every token with them zeroed, and `int8_matmul_f32` meets
    /// the int8 weights with the tokens in i32 (dp4a) and adds the outlier columns in f32, in
    /// the CPU kernel's order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn int8_matmul(
        &self,
        rows: usize,
        cols: usize,
        n_tok: usize,
        threshold: f32,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let shape = |reason: String| KernelError::Shape {
            op: "int8 matmul on cuda",
            reason,
        };
        if cols == 0 || cols > INT8_MAX_COLS {
            return Err(shape(format!(
                "rows of {cols} values; int8 needs 1..={INT8_MAX_COLS} (the i32 sums of longer \
                 rows could overflow)"
            )));
        }
        if threshold.is_nan() {
            return Err(shape(
                "the outlier threshold is NaN; give a number (6.0 is bitsandbytes' default, 0 \
                 turns the outlier path off)"
                    .into(),
            ));
        }
        let quants = rows
            .checked_mul(cols)
            .ok_or_else(|| shape(format!("{rows} × {cols} weights overflow usize")))?;
        let packed = int8_packed_bytes(rows, cols).unwrap_or(usize::MAX);
        need(
            "int8 weight bytes (quants, then a scale per row)",
            w,
            packed,
        )?;
        need("int8 matmul activation bytes", x, mul(mul(n_tok, cols), 4))?;
        need("int8 matmul output bytes", y, mul(mul(n_tok, rows), 4))?;
        if n_tok == 0 || rows == 0 {
            return Ok(());
        }
        // The kernel reads the scales as floats: copy them to an aligned scratch when they
        // start at an odd address (rows × cols not a multiple of 4, or a view at an odd
        // offset).
        let (base, record) = w.slice.device_ptr(&self.stream);
        drop(record);
        let scales_view = w.slice.slice(quants..quants + 4 * rows);
        let aligned_copy = if (base + quants as u64).is_multiple_of(4) {
            None
        } else {
            // SAFETY: the copy below writes all 4 × rows bytes before the matmul reads them.
            let mut s = unsafe { self.scratch(4 * rows) }?;
            self.stream
                .memcpy_dtod(&scales_view, &mut s)
                .map_err(drv("aligning the int8 scales"))?;
            Some(s)
        };
        // SAFETY (the three scratches): int8_outliers writes flags[c] for every column, the
        // count, and the first `count` column indices, which are all the matmul reads of them.
        let mut flags = unsafe { self.scratch(cols) }?;
        // SAFETY: as above.
        let mut out_cols = unsafe { self.scratch(mul(cols, 4)) }?;
        // SAFETY: as above.
        let mut n_out = unsafe { self.scratch(4) }?;
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = [
            KArg::In(&x.slice),
            KArg::Out(&mut flags),
            KArg::Out(&mut out_cols),
            KArg::Out(&mut n_out),
            KArg::U64(n_tok as u64),
            KArg::U64(cols as u64),
            KArg::F32(threshold),
        ];
        // SAFETY: one block walks the cols columns of n_tok × cols activations (checked above)
        // and writes cols flags, at most cols indices and one count into scratches of that size.
        unsafe { self.launch("int8", "int8_outliers_f32", one_block, &mut args) }?;
        // SAFETY: int8_quantize writes every token's cols quants and its scale (one block per
        // token) before the matmul, later on the same stream, reads them.
        let mut xq = unsafe { self.scratch(mul(n_tok, cols)) }?;
        // SAFETY: as above.
        let mut xs = unsafe { self.scratch(mul(n_tok, 4)) }?;
        let mut args = [
            KArg::In(&x.slice),
            KArg::In(&flags),
            KArg::Out(&mut xq),
            KArg::Out(&mut xs),
            KArg::U64(n_tok as u64),
            KArg::U64(cols as u64),
            KArg::F32(threshold),
        ];
        // SAFETY: block t reads token t's cols activations and cols flags and writes its cols
        // quants and one scale, all within the sizes checked or allocated above.
        unsafe { self.launch("int8", "int8_quantize_f32", per_row(n_tok)?, &mut args) }?;
        // one warp per (row, token): 8 rows per block of 256, tokens on grid.y (strided past
        // cuda's 65535)
        let cfg = LaunchConfig {
            grid_dim: (grid_for(rows, 8, "rows")?, n_tok.min(MAX_GRID_YZ) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let ws = match &aligned_copy {
            Some(s) => KArg::In(s),
            None => KArg::InView(scales_view),
        };
        let mut args = [
            KArg::InView(w.slice.slice(0..quants)),
            ws,
            KArg::In(&x.slice),
            KArg::In(&xq),
            KArg::In(&xs),
            KArg::In(&out_cols),
            KArg::In(&n_out),
            KArg::Out(&mut y.slice),
            KArg::U64(rows as u64),
            KArg::U64(cols as u64),
            KArg::U64(n_tok as u64),
        ];
        // SAFETY: warp (r, t) reads weight row r (rows × cols quants and rows scales checked),
        // token t's activations, quants and scale, at most `n_out` <= cols outlier indices,
        // and writes y[t * rows + r] below n_tok × rows (checked).
        unsafe { self.launch("int8", "int8_matmul_f32", cfg, &mut args) }
    }
}
