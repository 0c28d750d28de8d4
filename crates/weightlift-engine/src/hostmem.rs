//! Owned, aligned host memory: the backing store of `cpu` tensors, of `virtual` device arenas and
//! of the loader's staging buffers (O_DIRECT needs 4096-byte alignment).

// Aligned allocation needs `std::alloc`, which is unsafe; every use is commented below.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of every buffer: a page, so any buffer may be an O_DIRECT target.
pub const ALIGN: usize = 4096;

/// Buffers of at least this size are their own anonymous mapping, 2 MiB aligned and (unless the
/// caller fills them with `pread`, see [`AlignedBuf::zeroed_with`]) advised as huge-page
/// candidates. Fresh mappings are zero without a zeroing pass (the allocator's
/// `alloc_zeroed` would write every byte for an over-aligned layout), untouched pages cost no
/// resident memory, and with 2 MiB pages first-touch faults stop dominating the fill from the
/// page cache (Linux's default THP mode, `madvise`, only backs advised ranges).
const HUGE: usize = 4 << 20;
const HUGE_ALIGN: usize = 2 << 20;

/// A zero-initialised, page-aligned allocation of exactly `len` bytes (heap for small buffers, an
/// anonymous mapping for large ones).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// For a mapping: the mapped length (`len` rounded up to 2 MiB); 0 for a heap allocation.
    mapped: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like Vec<u8>); no aliasing handles exist.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// No memory at all.
    pub fn empty() -> Self {
        AlignedBuf {
            ptr: NonNull::dangling(),
            len: 0,
            mapped: 0,
        }
    }

    /// Allocate `len` zeroed bytes; `None` when the system refuses (or `len` overflows a layout).
    /// A large buffer is advised as a huge-page candidate.
    pub fn zeroed(len: usize) -> Option<Self> {
        Self::zeroed_with(len, true)
    }

    /// As [`AlignedBuf::zeroed`]; `huge` says whether a large buffer (its own mapping) is advised
    /// as a huge-page candidate. Leave it off for a buffer filled by `pread`: a huge-page fault
    /// inside the kernel's copy may stall on compaction (THP `defrag=madvise` compacts
    /// synchronously for advised ranges), which made such loads erratic.
    pub fn zeroed_with(len: usize, huge: bool) -> Option<Self> {
        if len == 0 {
            return Some(Self::empty());
        }
        if len >= HUGE {
            return Self::mapped(len, huge);
        }
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size (checked above) and a valid power-of-two
        // alignment. Zeroed memory is a valid `[u8]`.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(AlignedBuf {
            ptr,
            len,
            mapped: 0,
        })
    }

    fn mapped(len: usize, huge: bool) -> Option<Self> {
        let size = len.checked_next_multiple_of(HUGE_ALIGN)?;
        let total = size.checked_add(HUGE_ALIGN)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let b = base as usize;
        let aligned = b.next_multiple_of(HUGE_ALIGN);
        let (head, tail) = (aligned - b, total - (aligned - b) - size);
        // SAFETY: trimming the unaligned head and the tail of the mapping made above; the kept
        // range [aligned, aligned + size) is untouched. Advice failures (THP disabled) are
        // harmless, so its result is ignored.
        unsafe {
            if head > 0 {
                libc::munmap(base, head);
            }
            if tail > 0 {
                libc::munmap((aligned + size) as *mut libc::c_void, tail);
            }
            if huge {
                libc::madvise(aligned as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
            }
        }
        NonNull::new(aligned as *mut u8).map(|ptr| AlignedBuf {
            ptr,
            len,
            mapped: size,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr points to `len` initialised (zeroed or written) bytes owned by self, or is
        // dangling with len 0, which is valid for an empty slice.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        if self.mapped > 0 {
            // SAFETY: exactly the range kept by `mapped()`, unmapped once.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.mapped);
            }
            return;
        }
        // SAFETY: the pointer came from `alloc_zeroed` with exactly this layout (the layout was
        // valid then, so it is valid now).
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            );
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::zeroed(10_000).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        assert_eq!(AlignedBuf::zeroed(0).unwrap().len(), 0);
    }

    #[test]
    fn large_buffers_are_mappings() {
        let n = (9 << 20) + 123;
        let mut b = AlignedBuf::zeroed(n).unwrap();
        assert_eq!(b.len(), n);
        assert_eq!(b.as_slice().as_ptr() as usize % HUGE_ALIGN, 0);
        assert!(b.as_slice().iter().step_by(4096).all(|&x| x == 0));
        b.as_mut_slice()[n - 1] = 9;
        assert_eq!(b.as_slice()[n - 1], 9);
    }
}
