//! `use_mlock`: pin memory-mapped tensors in RAM (llama.cpp's `--mlock`), so the kernel cannot
//! evict them under memory pressure.

// mlock/munlock are libc calls; each use is commented below.
#![allow(unsafe_code)]

/// Ranges locked by one load, unlocked on drop.
#[derive(Debug, Default)]
pub struct Locked {
    ranges: Vec<(usize, usize)>,
}

impl Locked {
    /// Lock each of `ranges`. Returns the locked set and, when some failed (usually
    /// RLIMIT_MEMLOCK), a warning naming how many bytes stayed unlocked.
    pub fn lock<'a>(ranges: impl IntoIterator<Item = &'a [u8]>) -> (Locked, Option<String>) {
        let mut locked = Locked::default();
        let (mut failed, mut err) = (0u64, None);
        for r in ranges {
            if r.is_empty() {
                continue;
            }
            // SAFETY: the range is a live slice of a read-only mapping owned by the model; mlock
            // only changes residency, never contents, and the range stays mapped until unlock
            // (the model drops its Locked before the tensors that own the mapping).
            let rc = unsafe { libc::mlock(r.as_ptr().cast(), r.len()) };
            if rc == 0 {
                locked.ranges.push((r.as_ptr() as usize, r.len()));
            } else {
                failed += r.len() as u64;
                err = Some(std::io::Error::last_os_error());
            }
        }
        let warning = err.map(|e| {
            format!(
                "use_mlock: {failed} bytes could not be locked ({e}); raise the locked-memory limit (ulimit -l) \
                 or the pages may be evicted under memory pressure"
            )
        });
        (locked, warning)
    }

    /// Bytes locked.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.1 as u64).sum()
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        for &(ptr, len) in &self.ranges {
            // SAFETY: exactly a range locked above, still mapped (see `lock`).
            unsafe {
                libc::munlock(ptr as *const libc::c_void, len);
            }
        }
    }
}
