//! Owned, aligned host memory: the backing store of `cpu` tensors, of `virtual` device arenas and
//! of the loader's staging buffers (O_DIRECT needs 4096-byte alignment).

// Aligned allocation needs `std::alloc`, which is unsafe; every use is commented below.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of every buffer: a page, so any buffer may be an O_DIRECT target.
pub const ALIGN: usize = 4096;

/// Buffers of at least this size that are not filled by `pread` at once (see
/// [`AlignedBuf::zeroed_with`]) are their own anonymous mapping. Fresh mappings are zero without
/// a zeroing pass (the allocator's `alloc_zeroed` writes every byte for an over-aligned layout)
/// and untouched pages cost no resident memory: a KV cache of a few hundred KiB a layer is
/// allocated in microseconds and takes memory as its rows are written, as a large one does.
/// Buffers a load fills at once stay on the heap below [`HUGE`]: they are written whole anyway,
/// and the heap hands a reload the pages an unload freed, already faulted in, where a fresh
/// mapping faults every page again (a reload of the demo model onto two virtual devices took
/// 42 ms from mappings against 25 ms from the heap).
const MAPPED: usize = 64 << 10;

/// Buffers of at least this size are also 2 MiB aligned and (unless the caller fills them with
/// `pread`, see [`AlignedBuf::zeroed_with`]) advised as huge-page candidates: with 2 MiB pages
/// first-touch faults stop dominating the fill from the page cache (Linux's default THP mode,
/// `madvise`, only backs advised ranges).
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
    /// as a huge-page candidate, and whether a mid-sized one is a lazy mapping ([`MAPPED`]).
    /// Leave it off for a buffer filled by `pread`: a huge-page fault inside the kernel's copy
    /// may stall on compaction (THP `defrag=madvise` compacts synchronously for advised
    /// ranges), which made such loads erratic.
    pub fn zeroed_with(len: usize, huge: bool) -> Option<Self> {
        if len == 0 {
            return Some(Self::empty());
        }
        if len >= HUGE || (huge && len >= MAPPED) {
            return Self::mapped(len, len >= HUGE, huge);
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

    /// A fresh anonymous mapping of `len` bytes: page-aligned, or when `large` 2 MiB aligned
    /// and, when `advise` too, advised as a huge-page candidate.
    fn mapped(len: usize, large: bool, advise: bool) -> Option<Self> {
        let align = if large { HUGE_ALIGN } else { ALIGN };
        let size = len.checked_next_multiple_of(align)?;
        // a page-aligned mapping needs no slack to trim; a 2 MiB aligned one is cut from a
        // mapping one alignment larger
        let total = if large {
            size.checked_add(HUGE_ALIGN)?
        } else {
            size
        };
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
        let aligned = b.next_multiple_of(align);
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
            if large && advise {
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

    /// Fault in every page of a mapped buffer now, split over up to `threads` threads, so that
    /// a copy into it afterwards runs at memcpy speed instead of taking one page fault per
    /// 4 KiB. Uses `MADV_POPULATE_WRITE` (Linux 5.14+), or rewrites one byte per page with its
    /// own value where the kernel lacks it; the contents never change.
    /// Heap buffers were already written by `alloc_zeroed`; nothing to do.
    ///
    /// Why: first-touch faults of fresh anonymous memory are the largest cost of filling a
    /// `virtual` arena from staging. For 2 GiB on the 2-core bench VM: ~0.75 s of page faults
    /// touching it from one thread (1.2 to 2.8 s when the hypervisor has taken the freed memory
    /// back), ~0.55 s populated by one `madvise`, ~0.43 s touched from two threads with both
    /// cores free; the copy into resident memory is ~0.4 s. The call is only a hint: where
    /// populating fails (ENOMEM, say), the later writes fault the pages in as before.
    pub fn populate(&mut self, threads: usize) {
        if self.mapped == 0 || self.len == 0 {
            return;
        }
        let len = self.len.next_multiple_of(ALIGN).min(self.mapped);
        let parts = threads.clamp(1, len.div_ceil(POPULATE_MIN_PART));
        let part = len.div_ceil(parts).next_multiple_of(ALIGN);
        let base = self.ptr.as_ptr() as usize;
        let one = move |k: usize| {
            let start = k * part;
            let n = part.min(len.saturating_sub(start));
            if n > 0 {
                // SAFETY: `[start, start + n)` lies inside the mapping this buffer owns (`len` is
                // at most `mapped`), and `&mut self` is held by the caller for the whole call,
                // so no other reference into it exists while the parts are populated.
                unsafe { populate_range((base + start) as *mut u8, n) };
            }
        };
        if parts == 1 {
            one(0);
            return;
        }
        std::thread::scope(|s| {
            for k in 1..parts {
                s.spawn(move || one(k));
            }
            one(0);
        });
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

/// Parts smaller than this are not worth a thread of their own.
const POPULATE_MIN_PART: usize = 2 << 20;

/// Fault in `[ptr, ptr + len)` for writing without changing its contents.
///
/// # Safety
/// The range must be page-aligned, lie inside a live private anonymous mapping, and not be
/// accessed by anyone else during the call.
unsafe fn populate_range(ptr: *mut u8, len: usize) {
    // SAFETY: the caller guarantees the range is a live mapping; MADV_POPULATE_WRITE only
    // installs page-table entries, it never changes the bytes.
    let r = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) };
    if r == 0 {
        return;
    }
    if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
        // ENOMEM, EFAULT, EINTR...: leave the pages to fault on first use.
        return;
    }
    // SAFETY: as this function's own contract.
    unsafe { touch_range(ptr, len) };
}

/// The fallback for kernels before 5.14: write each page's first byte back to itself (volatile,
/// so neither access is elided), which faults the page in writable and keeps the contents.
///
/// # Safety
/// As [`populate_range`]; the range must also be initialised memory.
unsafe fn touch_range(ptr: *mut u8, len: usize) {
    for off in (0..len).step_by(ALIGN) {
        // SAFETY: `off < len`, inside the range the caller owns exclusively, and initialised
        // (zero-filled or written).
        unsafe {
            let p = ptr.add(off);
            std::ptr::write_volatile(p, std::ptr::read_volatile(p));
        }
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

    /// A buffer of a few hundred KiB (a small model's KV cache layer) is a mapping too: zero,
    /// page-aligned, and not resident until written, so allocating it writes nothing.
    #[test]
    fn mid_sized_buffers_are_lazy_mappings() {
        let n = (192 << 10) + 5;
        let mut b = AlignedBuf::zeroed(n).unwrap();
        assert!(b.mapped >= n && b.mapped < n + ALIGN, "{}", b.mapped);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        assert_eq!(resident_pages(&b), 0, "nothing written, nothing resident");
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[n - 1] = 9;
        assert_eq!(b.as_slice()[n - 1], 9);
        assert_eq!(
            AlignedBuf::zeroed(MAPPED - 1).unwrap().mapped,
            0,
            "below it: the heap"
        );
    }

    /// How many of the pages of `b` are resident (mincore).
    fn resident_pages(b: &AlignedBuf) -> usize {
        let pages = b.len().div_ceil(ALIGN);
        let mut v = vec![0u8; pages];
        // SAFETY: the range is b's own live, page-aligned mapping; `v` has one byte per page.
        let r = unsafe { libc::mincore(b.ptr.as_ptr().cast(), b.len(), v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|&&x| x & 1 == 1).count()
    }

    #[test]
    fn populate_faults_pages_in_and_keeps_contents() {
        let n = (24 << 20) + 5;
        let mut b = AlignedBuf::zeroed_with(n, false).unwrap();
        b.as_mut_slice()[0] = 3;
        b.as_mut_slice()[(12 << 20) + 1] = 4;
        b.as_mut_slice()[n - 1] = 5;
        let pages = n.div_ceil(ALIGN);
        assert!(
            resident_pages(&b) < pages,
            "a fresh mapping is not all resident"
        );
        b.populate(3);
        assert_eq!(resident_pages(&b), pages);
        let s = b.as_slice();
        assert_eq!((s[0], s[(12 << 20) + 1], s[n - 1]), (3, 4, 5));
        assert_eq!(s.iter().map(|&x| u64::from(x)).sum::<u64>(), 12);

        // The fallback for kernels without MADV_POPULATE_WRITE keeps the contents too.
        let mut c = AlignedBuf::zeroed_with(8 << 20, false).unwrap();
        c.as_mut_slice()[4096 * 7] = 8;
        let p = c.as_mut_slice().as_mut_ptr();
        // SAFETY: the whole buffer, owned here and not otherwise borrowed during the call.
        unsafe { touch_range(p, 8 << 20) };
        assert_eq!(resident_pages(&c), (8 << 20) / ALIGN);
        assert_eq!(c.as_slice()[4096 * 7], 8);
        assert_eq!(c.as_slice().iter().map(|&x| u64::from(x)).sum::<u64>(), 8);

        // Heap buffers and empty ones: nothing to do, nothing breaks.
        let mut h = AlignedBuf::zeroed(10_000).unwrap();
        h.populate(2);
        assert!(h.as_slice().iter().all(|&x| x == 0));
        AlignedBuf::empty().populate(2);
    }
}
