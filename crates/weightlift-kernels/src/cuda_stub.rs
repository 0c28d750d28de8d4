//! The CUDA backend when the crate is built without the `cuda` feature: every constructor
//! returns [`KernelError::NotCompiledWithCuda`], so callers compile and test anywhere.

use crate::backend::{Backend, Op, Rows};
use crate::error::{KernelError, Result};
use crate::types::QuantType;

fn not_compiled(what: &str) -> KernelError {
    KernelError::NotCompiledWithCuda {
        what: what.to_string(),
    }
}

/// Stand-in for the CUDA backend; cannot be constructed.
#[derive(Debug)]
pub struct CudaBackend {
    _never: std::convert::Infallible,
}

/// Stand-in for a CUDA buffer; cannot be constructed.
#[derive(Debug)]
pub struct CudaBuffer {
    _never: std::convert::Infallible,
}

impl CudaBuffer {
    /// Never called: a stand-in buffer cannot be constructed.
    pub fn device_addr(&self) -> u64 {
        match self._never {}
    }
}

/// Stand-in for a CUDA device's copy stream; cannot be constructed.
#[derive(Debug, Clone)]
pub struct CopyStream {
    _never: std::convert::Infallible,
}

impl CopyStream {
    /// Never called: there is no copy stream without the `cuda` feature.
    pub fn upload(&self, _src: &[u8], _dst: &mut CudaBuffer, _offset: usize) -> Result<()> {
        match self._never {}
    }

    /// Never called: there is no copy stream without the `cuda` feature.
    pub fn upload_from(
        &self,
        _pins: &HostPins,
        _src: &[u8],
        _dst: &mut CudaBuffer,
        _offset: usize,
    ) -> Result<()> {
        match self._never {}
    }

    /// Never called: there is no copy stream without the `cuda` feature.
    pub fn after_compute(&self, _b: &CudaBackend) -> Result<()> {
        match self._never {}
    }

    /// Never called: there is no copy stream without the `cuda` feature.
    pub fn before_compute(&self, _b: &CudaBackend) -> Result<()> {
        match self._never {}
    }

    /// Never called: there is no copy stream without the `cuda` feature.
    pub fn synchronize(&self) -> Result<()> {
        match self._never {}
    }
}

/// Stand-in for page-locked host memory; cannot be constructed.
#[derive(Debug)]
pub struct HostPins {
    _never: std::convert::Infallible,
}

impl HostPins {
    /// Never called: there are no pins without the `cuda` feature.
    pub fn pinned_bytes(&self) -> usize {
        match self._never {}
    }

    /// Never called: there are no pins without the `cuda` feature.
    pub fn refused(&self) -> (usize, Option<&str>) {
        match self._never {}
    }
}

/// Stand-in for a captured CUDA graph; cannot be constructed.
#[derive(Debug)]
pub struct CudaStepGraph {
    _never: std::convert::Infallible,
}

impl CudaBackend {
    /// Never called: a stand-in backend cannot be constructed.
    pub fn copy_stream(&self) -> Result<CopyStream> {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    ///
    /// # Safety
    ///
    /// As the CUDA backend's `pin_host`.
    #[allow(unsafe_code)]
    pub unsafe fn pin_host(&self, _ranges: &[&[u8]]) -> HostPins {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn capture(
        &self,
        _record: impl FnOnce(&CudaBackend) -> Result<()>,
    ) -> Result<CudaStepGraph> {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    ///
    /// # Safety
    ///
    /// As the CUDA backend's `replay`.
    #[allow(unsafe_code)]
    pub unsafe fn replay(&self, _step: &mut CudaStepGraph) -> Result<()> {
        match self._never {}
    }

    /// Always [`KernelError::NotCompiledWithCuda`].
    pub fn new(ordinal: usize) -> Result<Self> {
        Err(not_compiled(&format!("cuda:{ordinal}")))
    }

    /// Always [`KernelError::NotCompiledWithCuda`].
    pub fn device_count() -> Result<usize> {
        Err(not_compiled("cuda devices"))
    }

    /// Why CUDA cannot be used here (for test skip messages).
    pub fn unavailable_reason() -> Option<String> {
        Some(not_compiled("cuda").to_string())
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn compute_capability(&self) -> (i32, i32) {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn context_bytes(&self) -> Result<u64> {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn upload_filled<E>(
        &self,
        _dst: &mut CudaBuffer,
        _offset: usize,
        _len: usize,
        _fill: &mut crate::backend::Fill<'_, E>,
    ) -> Result<std::result::Result<(), E>> {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn with_q8_decode(self, _q8: crate::sources::Q8Decode) -> Self {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn q8_decode(&self) -> crate::sources::Q8Decode {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn with_prefill_attention(self, _choice: crate::sources::PrefillAttention) -> Self {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn prefill_attention(&self) -> crate::sources::PrefillAttention {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn with_cublas_min_tokens(self, _min_tokens: crate::sources::CublasMinTokens) -> Self {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn cublas_ready(&self) -> Result<()> {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn cublas_min_tokens_for(&self, _ty: QuantType, _mode: crate::MatvecMode) -> usize {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn cublas_min_tokens_least(&self) -> usize {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn scratch_from_tokens(
        &self,
        _ty: QuantType,
        _mode: crate::MatvecMode,
        _cols: usize,
    ) -> usize {
        match self._never {}
    }

    /// Never called: a stand-in backend cannot be constructed.
    pub fn prompt_route(
        &self,
        _ty: QuantType,
        _mode: crate::MatvecMode,
        _n_tok: usize,
    ) -> crate::sources::PromptRoute {
        match self._never {}
    }
}

/// What this build offers for CUDA: nothing, and it says why.
pub fn report() -> crate::cuda_libs::CudaReport {
    let why = not_compiled("cuda").to_string();
    crate::cuda_libs::CudaReport {
        driver: Err(why.clone()),
        nvrtc: Err(why.clone()),
        cublas: Err(why),
        devices: Vec::new(),
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> String {
        match self._never {}
    }
    fn alloc(&self, _bytes: usize) -> Result<CudaBuffer> {
        match self._never {}
    }
    fn len(&self, _buf: &CudaBuffer) -> usize {
        match self._never {}
    }
    fn copy_from_host(&self, _src: &[u8], _dst: &mut CudaBuffer, _offset: usize) -> Result<()> {
        match self._never {}
    }
    fn copy_to_host(&self, _src: &CudaBuffer, _offset: usize, _dst: &mut [u8]) -> Result<()> {
        match self._never {}
    }
    fn copy(
        &self,
        _s: &CudaBuffer,
        _so: usize,
        _d: &mut CudaBuffer,
        _do: usize,
        _n: usize,
    ) -> Result<()> {
        match self._never {}
    }
    fn copy_2d(
        &self,
        _s: &CudaBuffer,
        _from: Rows,
        _d: &mut CudaBuffer,
        _to: Rows,
        _width: usize,
        _rows: usize,
    ) -> Result<()> {
        match self._never {}
    }
    fn peer_access(&self, _to: &CudaBackend) -> bool {
        match self._never {}
    }
    fn copy_peer(
        &self,
        _s: &CudaBuffer,
        _so: usize,
        _to: &CudaBackend,
        _d: &mut CudaBuffer,
        _do: usize,
        _n: usize,
    ) -> Result<()> {
        match self._never {}
    }
    fn run(&self, _op: Op<'_, CudaBuffer>) -> Result<()> {
        match self._never {}
    }
    fn scan_non_finite(
        &self,
        _ty: QuantType,
        _buf: &CudaBuffer,
        _bytes: usize,
    ) -> Result<Option<usize>> {
        match self._never {}
    }
    fn quantize_rows(
        &self,
        _ty: QuantType,
        _src_ty: crate::types::FloatType,
        _src: &[u8],
        _n_per_row: usize,
        _dst: &mut CudaBuffer,
        _offset: usize,
        _first: usize,
        _found: &mut CudaBuffer,
    ) -> Result<()> {
        Err(not_compiled("quantize_rows"))
    }

    fn synchronize(&self) -> Result<()> {
        match self._never {}
    }
    #[allow(unsafe_code)]
    unsafe fn view(&self, _buf: &CudaBuffer, _offset: usize, _len: usize) -> Result<CudaBuffer> {
        match self._never {}
    }
    #[allow(unsafe_code)]
    unsafe fn split(
        &self,
        _buf: &mut CudaBuffer,
        _ranges: &[(usize, usize)],
    ) -> Result<Vec<CudaBuffer>> {
        match self._never {}
    }
}
