//! Host memory page-locked in place for a device's copy engine (`cuMemHostRegister`), so that
//! uploads from it skip the pinned staging buffers: the DMA engine reads the bytes where they
//! are, at the link's rate, with no host copy first and no host wait. The engine pins the
//! weights an offloaded model copies to its GPU for every token (mapped from the checkpoint,
//! or converted copies), which staging caps at the speed of one host `memcpy`.
//!
//! Pinning is best effort: a span the driver refuses (a driver or kernel that cannot register
//! file-backed or read-only pages, a locked-memory limit) stays unpinned, and its uploads go
//! through staging as before. Spans are whole pages, ranges sharing a page merged into one,
//! because a page can be registered only once.

// The driver's registration calls are unsafe; each says why its arguments are sound.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};

use super::CudaBackend;

/// The unit registrations are rounded to. x86-64 Linux maps 4 KiB pages; where pages are
/// larger, a span rounded to 4 KiB still lies within the memory given, and the driver locks
/// the whole pages under it.
const PAGE: usize = 4096;

/// Page spans of host memory registered with one device's context, unregistered on drop
/// (after every stream of the context has finished, since queued copies read them).
pub struct HostPins {
    pub(super) ctx: Arc<CudaContext>,
    /// Registered spans `(first byte's address, bytes)`, sorted and disjoint.
    spans: Vec<(usize, usize)>,
    /// Bytes of the spans the driver refused, and its answer to the first.
    refused: (usize, Option<String>),
}

impl std::fmt::Debug for HostPins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPins")
            .field("pinned_bytes", &self.pinned_bytes())
            .field("refused_bytes", &self.refused.0)
            .finish()
    }
}

/// The page spans covering `ranges`, sorted, overlapping and touching ones merged.
fn page_spans(ranges: &[&[u8]]) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = ranges
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| {
            let start = r.as_ptr() as usize / PAGE * PAGE;
            let end = (r.as_ptr() as usize + r.len()).div_ceil(PAGE) * PAGE;
            (start, end)
        })
        .collect();
    spans.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for (start, end) in spans {
        match merged.last_mut() {
            Some((_, e)) if start <= *e => *e = (*e).max(end),
            _ => merged.push((start, end)),
        }
    }
    merged.into_iter().map(|(s, e)| (s, e - s)).collect()
}

impl HostPins {
    /// Bytes registered.
    pub fn pinned_bytes(&self) -> usize {
        self.spans.iter().map(|s| s.1).sum()
    }

    /// Bytes the driver refused to register (their uploads go through staging), and why.
    pub fn refused(&self) -> (usize, Option<&str>) {
        (self.refused.0, self.refused.1.as_deref())
    }

    /// Whether `src` lies wholly inside one registered span.
    pub(super) fn covers(&self, src: &[u8]) -> bool {
        let (a, b) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
        let i = self.spans.partition_point(|&(s, _)| s <= a);
        i > 0 && {
            let (s, len) = self.spans[i - 1];
            a >= s && b <= s + len
        }
    }
}

impl Drop for HostPins {
    fn drop(&mut self) {
        // Nothing to report to from a drop: a failed wait or unregistration leaves the pages
        // locked until the process ends, which is harmless, where unregistering them after a
        // failed wait could unlock pages a queued copy still reads.
        if !super::wait_in_drop(&self.ctx, || self.ctx.synchronize()) {
            return;
        }
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        for &(start, _) in &self.spans {
            // SAFETY: `start` is the address this value registered, and every copy that read
            // the span has finished (the context was synchronised above).
            let _ = unsafe { sys::cuMemHostUnregister(start as *mut std::ffi::c_void) };
        }
    }
}

impl CudaBackend {
    /// Page-locks the host memory of `ranges` for this device's copy engine (see the module
    /// docs): [`super::CopyStream::upload_from`] then copies from it directly. Spans the driver
    /// refuses stay unpinned; nothing fails.
    ///
    /// # Safety
    ///
    /// Every range must stay mapped, and unchanged, until the returned pins are dropped:
    /// uploads queued from them read the memory later, on the device's copy engine.
    pub unsafe fn pin_host(&self, ranges: &[&[u8]]) -> HostPins {
        let mut pins = HostPins {
            ctx: Arc::clone(&self.ctx),
            spans: Vec::new(),
            refused: (0, None),
        };
        let spans = page_spans(ranges);
        if let Err(e) = self.ctx.bind_to_thread() {
            pins.refused = (
                spans.iter().map(|s| s.1).sum(),
                Some(format!("binding the context: {e:?}")),
            );
            return pins;
        }
        // Read-only first: the device only reads these pages, and a read-only mapping of the
        // checkpoint can be registered only so; then plain, for drivers without read-only
        // registration (the pages of a writable buffer).
        let flags = [
            sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        ];
        for (start, len) in spans {
            let mut why = None;
            for f in flags {
                // SAFETY: the span is whole pages of memory the caller keeps mapped while the
                // pins live; the driver only locks it and records it.
                let r =
                    unsafe { sys::cuMemHostRegister_v2(start as *mut std::ffi::c_void, len, f) };
                if r == sys::CUresult::CUDA_SUCCESS {
                    why = None;
                    break;
                }
                why = Some(format!("cuMemHostRegister of {len} bytes: {r:?}"));
            }
            match why {
                None => pins.spans.push((start, len)),
                Some(w) => {
                    pins.refused.0 += len;
                    pins.refused.1.get_or_insert(w);
                }
            }
        }
        pins
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_become_whole_disjoint_pages() {
        let buf = vec![0u8; 6 * PAGE];
        let base = buf.as_ptr() as usize;
        let first = (base / PAGE + 1) * PAGE - base; // the first page boundary inside buf
        let at = |o: usize, n: usize| &buf[first + o..first + o + n];
        // two ranges in one page, one crossing into the next, one two pages on, an empty one
        let spans = page_spans(&[at(10, 20), at(100, PAGE), at(3 * PAGE + 1, 5), at(0, 0)]);
        let p0 = base + first;
        assert_eq!(spans, vec![(p0, 2 * PAGE), (p0 + 3 * PAGE, PAGE)]);
        // a range ending exactly at a page boundary takes no page more
        assert_eq!(page_spans(&[at(0, PAGE)]), vec![(p0, PAGE)]);
    }
}
