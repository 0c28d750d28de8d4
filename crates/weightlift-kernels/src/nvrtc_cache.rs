//! A disk cache of the images NVRTC compiles for a device, so that only the first process on a
//! machine pays for a kernel module's compile (ptxas takes 14 to 36 s of one core for one of
//! the attention modules' sm_90 CUBIN; a cached image is a file read).
//!
//! - **Where:** `$WEIGHTLIFT_KERNEL_CACHE` (a directory; `0`, `off` or an empty value turn the
//!   cache off), else `$XDG_CACHE_HOME/weightlift/kernels`, else `$HOME/.cache/weightlift/kernels`.
//! - **Key:** the sha256 of everything that decides the image: this crate's version, NVRTC's
//!   version, the architecture, the compile options and the module's name and source. A changed
//!   kernel or another NVRTC gets a new entry; nothing is ever reused across them.
//! - **Entry:** one file per key, `<module>-<arch>-<key prefix>.bin`: a magic, the whole key,
//!   the image's kind, length and sha256, then the image. An entry that does not check out
//!   (truncated, foreign, corrupted) is a miss, and the fresh compile replaces it. Entries are
//!   written to a temporary file and renamed into place, so a reader never sees half of one.
//! - **Failures never fail a load:** an unwritable or missing directory only means the next
//!   process compiles again. The caller drops an entry whose image the driver refuses
//!   ([`forget`]) and compiles afresh.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The first bytes of every entry (the format's version is its last byte).
const MAGIC: &[u8; 8] = b"WLKIMG01";
/// Magic, key, kind, length and the image's sha256.
const HEADER_BYTES: usize = 8 + 32 + 1 + 8 + 32;

/// A compiled image, as the driver loads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// PTX text, for a virtual architecture (`compute_XY`).
    Ptx(String),
    /// A CUBIN, for a real one (`sm_XY`).
    Cubin(Vec<u8>),
}

impl Image {
    fn kind(&self) -> u8 {
        match self {
            Image::Ptx(_) => 0,
            Image::Cubin(_) => 1,
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Image::Ptx(s) => s.as_bytes(),
            Image::Cubin(b) => b,
        }
    }
}

/// The cache's directory from the values of `WEIGHTLIFT_KERNEL_CACHE`, `XDG_CACHE_HOME` and
/// `HOME` (see the module documentation); `None` when it is turned off or nothing names one.
pub fn dir_from(explicit: Option<&str>, xdg: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    if let Some(e) = explicit {
        return match e.trim() {
            "" | "0" | "off" => None,
            d => Some(PathBuf::from(d)),
        };
    }
    let nonempty = |v: Option<&str>| v.filter(|s| !s.is_empty()).map(PathBuf::from);
    nonempty(xdg)
        .or_else(|| nonempty(home).map(|h| h.join(".cache")))
        .map(|base| base.join("weightlift").join("kernels"))
}

/// The cache's directory for this process's environment.
pub fn dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var(k).ok();
    dir_from(
        var("WEIGHTLIFT_KERNEL_CACHE").as_deref(),
        var("XDG_CACHE_HOME").as_deref(),
        var("HOME").as_deref(),
    )
}

/// The key of module `name`'s image for `arch`, compiled with `options` by NVRTC `nvrtc`.
pub fn key(name: &str, src: &str, arch: &str, options: &[String], nvrtc: (i32, i32)) -> [u8; 32] {
    let mut h = Sha256::new();
    // each part length-prefixed, so no two different lists of parts hash alike
    let mut part = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(env!("CARGO_PKG_VERSION").as_bytes());
    part(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    part(arch.as_bytes());
    for o in options {
        part(o.as_bytes());
    }
    part(name.as_bytes());
    part(src.as_bytes());
    h.finalize().into()
}

/// The file of entry `key` (module `name`, `arch`) in `dir`.
pub fn entry_path(dir: &Path, name: &str, arch: &str, key: &[u8; 32]) -> PathBuf {
    let prefix: String = key[..8].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("{name}-{arch}-{prefix}.bin"))
}

/// The image entry `key` holds in `dir`, or `None` when there is none or it does not check out.
pub fn read(dir: &Path, name: &str, arch: &str, key: &[u8; 32]) -> Option<Image> {
    let bytes = std::fs::read(entry_path(dir, name, arch, key)).ok()?;
    let (head, body) = bytes.split_at_checked(HEADER_BYTES)?;
    let len = u64::from_le_bytes(head[41..49].try_into().ok()?);
    let sum: [u8; 32] = Sha256::digest(body).into();
    if &head[..8] != MAGIC
        || head[8..40] != key[..]
        || len != body.len() as u64
        || head[49..81] != sum[..]
    {
        return None;
    }
    match head[40] {
        0 => String::from_utf8(body.to_vec()).ok().map(Image::Ptx),
        1 => Some(Image::Cubin(body.to_vec())),
        _ => None,
    }
}

/// Writes `image` as entry `key` into `dir` (made if missing). Whether it was written: a cache
/// that cannot be written is not an error, only a compile the next process does again.
pub fn write(dir: &Path, name: &str, arch: &str, key: &[u8; 32], image: &Image) -> bool {
    let body = image.bytes();
    let mut head = Vec::with_capacity(HEADER_BYTES);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(key);
    head.push(image.kind());
    head.extend_from_slice(&(body.len() as u64).to_le_bytes());
    head.extend_from_slice(&Sha256::digest(body));
    let path = entry_path(dir, name, arch, key);
    // a name of its own per process and call, so two writers never share a temporary file
    let tmp = path.with_extension(format!(
        "tmp{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let written = std::fs::create_dir_all(dir).is_ok()
        && std::fs::File::create(&tmp)
            .and_then(|mut f| {
                f.write_all(&head)?;
                f.write_all(body)?;
                f.sync_all()
            })
            .is_ok()
        && std::fs::rename(&tmp, &path).is_ok();
    if !written {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Removes entry `key` from `dir` (the driver refused its image); a missing entry is fine.
pub fn forget(dir: &Path, name: &str, arch: &str, key: &[u8; 32]) {
    let _ = std::fs::remove_file(entry_path(dir, name, arch, key));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of its own under the system's temporary directory, removed at the end.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            let d = std::env::temp_dir().join(format!(
                "weightlift-kernel-cache-{tag}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&d);
            TempDir(d)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_directory_follows_the_environment() {
        let d = |e, x, h| dir_from(e, x, h);
        assert_eq!(d(Some("/c"), Some("/x"), Some("/h")), Some("/c".into()));
        for off in ["", "0", "off", " off "] {
            assert_eq!(d(Some(off), Some("/x"), Some("/h")), None, "{off:?}");
        }
        assert_eq!(
            d(None, Some("/x"), Some("/h")),
            Some("/x/weightlift/kernels".into())
        );
        assert_eq!(
            d(None, Some(""), Some("/h")),
            Some("/h/.cache/weightlift/kernels".into())
        );
        assert_eq!(d(None, None, None), None);
    }

    #[test]
    fn every_part_of_the_key_makes_a_new_key() {
        let opts = vec!["--std=c++17".to_string()];
        let base = key("m", "src", "sm_90", &opts, (12, 8));
        assert_eq!(base, key("m", "src", "sm_90", &opts, (12, 8)));
        let others = [
            key("n", "src", "sm_90", &opts, (12, 8)),
            key("m", "src2", "sm_90", &opts, (12, 8)),
            key("m", "src", "sm_80", &opts, (12, 8)),
            key("m", "src", "sm_90", &[], (12, 8)),
            key("m", "src", "sm_90", &opts, (13, 0)),
            // the same bytes split otherwise between name and source
            key("ms", "rc", "sm_90", &opts, (12, 8)),
        ];
        for (i, k) in others.iter().enumerate() {
            assert_ne!(*k, base, "variant {i}");
        }
    }

    #[test]
    fn an_entry_reads_back_and_a_damaged_one_is_a_miss() {
        let tmp = TempDir::new("entries");
        let k = key("attention", "src", "sm_90", &[], (12, 8));
        assert_eq!(read(&tmp.0, "attention", "sm_90", &k), None, "empty");
        for image in [
            Image::Cubin((0..5000u32).map(|i| (i * 7) as u8).collect()),
            Image::Ptx(".version 8.0\n.target sm_90\n".into()),
        ] {
            assert!(write(&tmp.0, "attention", "sm_90", &k, &image));
            assert_eq!(read(&tmp.0, "attention", "sm_90", &k), Some(image.clone()));
            let path = entry_path(&tmp.0, "attention", "sm_90", &k);
            let good = std::fs::read(&path).unwrap();
            let mut flipped = good.clone();
            *flipped.last_mut().unwrap() ^= 1;
            let mut foreign = good.clone();
            foreign[0] = b'X';
            let mut other_key = good.clone();
            other_key[8] ^= 1;
            for (what, bytes) in [
                ("a flipped image bit", flipped),
                ("a foreign magic", foreign),
                ("another key", other_key),
                ("a truncated image", good[..good.len() - 1].to_vec()),
                ("a truncated header", good[..HEADER_BYTES - 1].to_vec()),
            ] {
                std::fs::write(&path, bytes).unwrap();
                assert_eq!(read(&tmp.0, "attention", "sm_90", &k), None, "{what}");
            }
            forget(&tmp.0, "attention", "sm_90", &k);
            assert!(!path.exists());
        }
        // no temporary files are left behind
        let left: Vec<_> = std::fs::read_dir(&tmp.0).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn an_unwritable_directory_is_no_error() {
        let tmp = TempDir::new("unwritable");
        // a file where the directory should be
        std::fs::write(&tmp.0, b"not a directory").unwrap();
        let k = key("m", "src", "sm_90", &[], (12, 8));
        assert!(!write(
            &tmp.0,
            "m",
            "sm_90",
            &k,
            &Image::Cubin(vec![1, 2, 3])
        ));
        assert_eq!(read(&tmp.0, "m", "sm_90", &k), None);
        let _ = std::fs::remove_file(&tmp.0);
    }
}
