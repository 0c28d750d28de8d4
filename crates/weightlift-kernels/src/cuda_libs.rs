//! Where the CUDA user-space libraries are found at run time: the one place that searches.
//!
//! `libcuda` comes with the NVIDIA driver, which installs it on the system loader's path, so it
//! is opened by name. NVRTC and cuBLAS come with a CUDA
//! toolkit or from pip's `nvidia-*` wheels, and often sits where the loader does not look: a
//! toolkit's `lib64` is neither on `LD_LIBRARY_PATH` nor in the loader cache unless someone
//! put it there, and a pip wheel's `site-packages/nvidia/*/lib` never is. So
//! [`open_first`] tries, in order:
//!
//! 1. the loader's own search by name ([`loader_names`]: `LD_LIBRARY_PATH`, the loader cache,
//!    the system folders), so an explicit `LD_LIBRARY_PATH` still wins;
//! 2. [`search_dirs`]: `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`,
//!    `/usr/local/cuda-*/lib64` (newest version first), then `nvidia/*/lib` in every site
//!    folder: those the host program registered ([`add_site_dirs`]; the Python package passes
//!    its `sys.path`), and the `site-packages` of `$VIRTUAL_ENV` and `$CONDA_PREFIX`.
//!
//! In a folder, an unversioned `libNAME.so` (a toolkit's link) is taken first, then the
//! highest `libNAME.so.N` (pip's wheels carry only versioned names such as `libnvrtc.so.12`).
//! The file found is opened by its path, so its version need not be one the loader's names
//! list (cudarc 0.19 asks for `.so.12` and older, never `.so.13`): that is why NVRTC is called
//! through our own tables of their functions (`nvrtc.rs`, `cuda/cublas.rs`), not through
//! cudarc's loaders, which open names only (`.so.12` and older) and panic on a missing symbol.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::ser::{Serialize, SerializeMap, Serializer};

/// Site folders registered by the host program, searched after the toolkit folders.
static SITE_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Adds folders to search for pip's `nvidia/*/lib` (Python's `sys.path`: the Python package
/// registers it at import). Entries that are not folders are skipped when searching.
pub fn add_site_dirs(dirs: impl IntoIterator<Item = PathBuf>) {
    let mut known = SITE_DIRS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for d in dirs {
        if !known.contains(&d) {
            known.push(d);
        }
    }
}

/// The names tried through the system loader before any folder is searched: the unversioned
/// link, then the versions we know of, newest first.
pub fn loader_names(lib: &str) -> Vec<String> {
    let mut names = vec![format!("lib{lib}.so")];
    names.extend(["13", "12", "11"].map(|v| format!("lib{lib}.so.{v}")));
    names
}

/// `prefix/lib/python3.*/site-packages` (a virtual environment's or a conda prefix's).
pub fn site_packages_of(prefix: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = ["lib", "lib64"]
        .iter()
        .filter_map(|lib| std::fs::read_dir(prefix.join(lib)).ok())
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages"))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out
}

/// The folders [`open_first`] searches after the loader, in order (see the module docs): toolkit
/// folders from `env`, `/usr/local/cuda*`, then pip's `nvidia/*/lib` under `sites`.
pub fn dirs_for(env: &dyn Fn(&str) -> Option<String>, sites: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| env(v))
        .filter(|v| !v.is_empty())
        .map(|v| Path::new(&v).join("lib64"))
        .collect();
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.extend(versioned_toolkits(Path::new("/usr/local")));
    let mut sites = sites.to_vec();
    for prefix in ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| env(v))
    {
        sites.extend(site_packages_of(Path::new(&prefix)));
    }
    for site in &sites {
        dirs.extend(nvidia_lib_dirs(site));
    }
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let new = !seen.contains(d);
        seen.push(d.clone());
        new
    });
    dirs
}

/// [`dirs_for`] with this process's environment and registered site folders.
pub fn search_dirs() -> Vec<PathBuf> {
    let sites = SITE_DIRS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    dirs_for(&|v| std::env::var(v).ok(), &sites)
}

/// `/usr/local/cuda-X.Y/lib64`, newest version first.
fn versioned_toolkits(root: &Path) -> Vec<PathBuf> {
    let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let version = name.strip_prefix("cuda-")?;
            let v: Vec<u32> = version
                .split('.')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            Some((v, e.path().join("lib64")))
        })
        .collect();
    found.sort_by(|a, b| b.0.cmp(&a.0));
    found.into_iter().map(|(_, p)| p).collect()
}

/// `site/nvidia/*/lib`, in name order (`cu13`, `cublas`, `cuda_nvrtc`, ...).
fn nvidia_lib_dirs(site: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(site.join("nvidia"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("lib"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// The version suffix of `libNAME.so.X.Y` as numbers (`[]` for `libNAME.so`), or `None` when
/// the file is another library (`libnvrtc-builtins.so.12`, `libnvrtc.alt.so.12`).
fn version_of(file: &str, lib: &str) -> Option<Vec<u32>> {
    let rest = file.strip_prefix(&format!("lib{lib}.so"))?;
    if rest.is_empty() {
        return Some(Vec::new());
    }
    rest.strip_prefix('.')?
        .split('.')
        .map(|p| p.parse().ok())
        .collect()
}

/// `libNAME.so` in `dir`, else its highest `libNAME.so.N`.
pub fn find_in_dir(lib: &str, dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let v = version_of(&e.file_name().to_string_lossy(), lib)?;
            Some((v, e.path()))
        })
        .filter(|(_, p)| p.is_file())
        .collect();
    // the unversioned link first (an empty version sorts lowest), then the newest
    found.sort_by(|a, b| match (a.0.is_empty(), b.0.is_empty()) {
        (true, false) => std::cmp::Ordering::Less,
        (false, true) => std::cmp::Ordering::Greater,
        _ => b.0.cmp(&a.0),
    });
    found.into_iter().next().map(|(_, p)| p)
}

/// The first folder of `dirs` holding `libNAME.so[.N]`, and the file in it.
pub fn find_in(lib: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().find_map(|d| find_in_dir(lib, d))
}

/// Opens library `lib` (`"nvrtc"`, `"cublas"`) with `open` from the first place that works:
/// a name the system loader resolves ([`loader_names`]), else the file [`find_in_dir`] gives
/// in each of [`search_dirs`] in turn. `open` answers why a candidate would not load.
pub fn open_first<T>(
    lib: &str,
    open: &dyn Fn(&std::ffi::OsStr) -> Result<T, String>,
) -> Result<(T, Located), NotFound> {
    for name in loader_names(lib) {
        if let Ok(t) = open(name.as_ref()) {
            return Ok((t, Located::Loader(name)));
        }
    }
    let searched = search_dirs();
    let mut failed = Vec::new();
    for dir in &searched {
        if let Some(path) = find_in_dir(lib, dir) {
            match open(path.as_os_str()) {
                Ok(t) => return Ok((t, Located::File(path))),
                Err(e) => failed.push((path, e)),
            }
        }
    }
    Err(NotFound {
        library: format!("lib{lib}"),
        searched,
        failed,
    })
}

/// A library [`open_first`] could not open: every folder it searched, and every file it found
/// that would not load (a wrong architecture, a missing dependency).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotFound {
    pub library: String,
    pub searched: Vec<PathBuf>,
    pub failed: Vec<(PathBuf, String)>,
}

impl NotFound {
    /// [`KernelError::LibraryNotFound`], with `fix` saying what to install.
    pub fn into_error(self, fix: &str) -> crate::KernelError {
        let mut detail = format!(
            "; looked on the loader's path (LD_LIBRARY_PATH, the loader cache) and in {}",
            self.searched
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (path, why) in &self.failed {
            detail.push_str(&format!("; {} would not load: {why}", path.display()));
        }
        crate::KernelError::LibraryNotFound {
            library: self.library,
            fix: fix.to_owned(),
            detail,
        }
    }
}

/// Where a library was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Located {
    /// A name the system loader resolves (`LD_LIBRARY_PATH`, the loader cache).
    Loader(String),
    /// A file found in one of the searched folders.
    File(PathBuf),
}

/// The file a library of this process was mapped from (`/proc/self/maps`), e.g. where the
/// loader found `libcuda.so.1`; `None` where it is not loaded or there is no procfs.
pub fn loaded_path(file_prefix: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with(file_prefix))
        })
        .map(PathBuf::from)
}

/// What this machine offers for CUDA (`weightlift devices`): the driver, NVRTC and each
/// device. Each part is `Err` with the reason when it is missing.
#[derive(Debug, Clone)]
pub struct CudaReport {
    /// The libcuda file the loader found, and the CUDA version the driver supports.
    pub driver: Result<(PathBuf, (i32, i32)), String>,
    /// The libnvrtc file found, and its version.
    pub nvrtc: Result<(PathBuf, (i32, i32)), String>,
    /// The libcublas file found, and its version (prompts run without it, more slowly).
    pub cublas: Result<(PathBuf, (i32, i32)), String>,
    pub devices: Vec<CudaDeviceReport>,
}

/// One CUDA device as [`CudaReport`] lists it.
#[derive(Debug, Clone)]
pub struct CudaDeviceReport {
    pub ordinal: usize,
    /// The driver's name for it (`"NVIDIA H200"`).
    pub name: String,
    pub capability: (i32, i32),
    /// Free and total memory, in bytes, read inside this process's context.
    pub free: u64,
    pub total: u64,
    /// Bytes one context takes on it (`CudaBackend::context_bytes`), or why it was not measured.
    pub context: Result<u64, String>,
}

/// As `weightlift devices --json` prints it: `driver` (`path` and `cuda_version`, or `error`),
/// `nvrtc` and `cublas` (`path` and `version`, or `error`) and `devices`, one map per GPU.
impl Serialize for CudaReport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(4))?;
        map.serialize_entry("driver", &Found(&self.driver, "cuda_version"))?;
        map.serialize_entry("nvrtc", &Found(&self.nvrtc, "version"))?;
        map.serialize_entry("cublas", &Found(&self.cublas, "version"))?;
        map.serialize_entry("devices", &self.devices)?;
        map.end()
    }
}

/// A library as found (`path`, and its version under the key given) or missing (`error`).
struct Found<'a>(&'a Result<(PathBuf, (i32, i32)), String>, &'static str);

impl Serialize for Found<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        match self.0 {
            Ok((path, (major, minor))) => {
                map.serialize_entry("path", &path.display().to_string())?;
                map.serialize_entry(self.1, &format!("{major}.{minor}"))?;
            }
            Err(e) => map.serialize_entry("error", e)?,
        }
        map.end()
    }
}

/// `name` (`"cuda:0"`), `model` (the driver's name), `capability` (`"sm_90"`), `free` and
/// `total` bytes, and `context`: the bytes of one context, or none when it was not measured.
impl Serialize for CudaDeviceReport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (major, minor) = self.capability;
        let mut map = s.serialize_map(Some(6))?;
        map.serialize_entry("name", &format!("cuda:{}", self.ordinal))?;
        map.serialize_entry("model", &self.name)?;
        map.serialize_entry("capability", &format!("sm_{major}{minor}"))?;
        map.serialize_entry("free", &self.free)?;
        map.serialize_entry("total", &self.total)?;
        map.serialize_entry("context", &self.context.as_ref().ok())?;
        map.end()
    }
}

/// Registers the repository's `.venv` site folders (where `make venv` puts pip's NVRTC), so the
/// crate's own tests find it without `LD_LIBRARY_PATH`.
#[cfg(all(test, feature = "nvrtc-check"))]
pub(crate) fn use_repo_venv() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv");
    add_site_dirs(site_packages_of(&root));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_serialises_as_weightlift_devices_prints_it() {
        let report = CudaReport {
            driver: Ok(("/usr/lib/libcuda.so.1".into(), (12, 8))),
            nvrtc: Ok(("/venv/nvidia/cuda_nvrtc/lib/libnvrtc.so.12".into(), (12, 9))),
            cublas: Err("libcublas not found".into()),
            devices: vec![CudaDeviceReport {
                ordinal: 1,
                name: "NVIDIA H200".into(),
                capability: (9, 0),
                free: 100,
                total: 200,
                context: Err("not measured".into()),
            }],
        };
        let expected = serde_json::json!({
            "driver": {"path": "/usr/lib/libcuda.so.1", "cuda_version": "12.8"},
            "nvrtc": {"path": "/venv/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "version": "12.9"},
            "cublas": {"error": "libcublas not found"},
            "devices": [{"name": "cuda:1", "model": "NVIDIA H200", "capability": "sm_90",
                         "free": 100, "total": 200, "context": null}],
        });
        assert_eq!(serde_json::to_value(&report).unwrap(), expected);
    }

    fn touch(dir: &Path, name: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), b"not really a library").unwrap();
    }

    #[test]
    fn a_folder_gives_its_link_else_its_newest_version() {
        let tmp = tempfile::tempdir().unwrap();
        let pip = tmp.path().join("pip");
        // pip's nvrtc wheel: only versioned names, beside libraries that are not nvrtc
        for f in [
            "libnvrtc.so.12",
            "libnvrtc-builtins.so.12.9",
            "libnvrtc.alt.so.12",
            "libnvrtc.so.12.backup",
        ] {
            touch(&pip, f);
        }
        assert_eq!(find_in_dir("nvrtc", &pip), Some(pip.join("libnvrtc.so.12")));
        touch(&pip, "libnvrtc.so.13");
        assert_eq!(find_in_dir("nvrtc", &pip), Some(pip.join("libnvrtc.so.13")));
        // a toolkit: the unversioned link wins over its versions
        let kit = tmp.path().join("kit");
        for f in ["libnvrtc.so.13.0.88", "libnvrtc.so.13", "libnvrtc.so"] {
            touch(&kit, f);
        }
        assert_eq!(find_in_dir("nvrtc", &kit), Some(kit.join("libnvrtc.so")));
        assert_eq!(find_in_dir("cublas", &kit), None);
        assert_eq!(find_in_dir("nvrtc", &tmp.path().join("absent")), None);
        // the first folder that has one wins
        let dirs = [tmp.path().join("absent"), pip.clone(), kit.clone()];
        assert_eq!(find_in("nvrtc", &dirs), Some(pip.join("libnvrtc.so.13")));
    }

    #[test]
    fn the_search_covers_toolkits_and_every_site_folders_nvidia_wheels() {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("toolkit");
        let site = tmp.path().join("site-packages");
        let venv = tmp.path().join("venv");
        let venv_site = venv.join("lib/python3.12/site-packages");
        touch(&site.join("nvidia/cu13/lib"), "libnvrtc.so.13");
        touch(&site.join("nvidia/cublas/lib"), "libcublas.so.12");
        touch(&site.join("nvidia/no_lib_folder"), "readme");
        touch(&venv_site.join("nvidia/cuda_nvrtc/lib"), "libnvrtc.so.12");
        let env = |v: &str| match v {
            "CUDA_HOME" => Some(home.to_string_lossy().into_owned()),
            "CUDA_PATH" => Some(String::new()),
            "VIRTUAL_ENV" => Some(venv.to_string_lossy().into_owned()),
            _ => None,
        };
        let dirs = dirs_for(&env, std::slice::from_ref(&site));
        assert_eq!(dirs[0], home.join("lib64"), "$CUDA_HOME first");
        assert_eq!(dirs[1], PathBuf::from("/usr/local/cuda/lib64"));
        let pos = |p: PathBuf| dirs.iter().position(|d| *d == p);
        let cu13 = pos(site.join("nvidia/cu13/lib")).expect("the registered site folder");
        let cublas = pos(site.join("nvidia/cublas/lib")).expect("every nvidia wheel");
        let venv_nvrtc =
            pos(venv_site.join("nvidia/cuda_nvrtc/lib")).expect("$VIRTUAL_ENV's site-packages");
        assert!(cu13 < cublas && cublas < venv_nvrtc, "{dirs:?}");
        assert!(pos(site.join("nvidia/no_lib_folder/lib")).is_none());
        // a toolkit in $CUDA_HOME wins over the wheels; without it, the registered site's
        // (the machine's own /usr/local/cuda* folders are left out of these lookups)
        let ours: Vec<PathBuf> = dirs
            .iter()
            .filter(|d| d.starts_with(tmp.path()))
            .cloned()
            .collect();
        touch(&home.join("lib64"), "libnvrtc.so.13");
        assert_eq!(
            find_in("nvrtc", &ours),
            Some(home.join("lib64/libnvrtc.so.13"))
        );
        std::fs::remove_file(home.join("lib64/libnvrtc.so.13")).unwrap();
        assert_eq!(
            find_in("nvrtc", &ours),
            Some(site.join("nvidia/cu13/lib/libnvrtc.so.13"))
        );
        assert_eq!(
            find_in("cublas", &ours),
            Some(site.join("nvidia/cublas/lib/libcublas.so.12"))
        );
    }

    #[test]
    fn toolkit_folders_are_newest_first() {
        let tmp = tempfile::tempdir().unwrap();
        for v in ["cuda-12.9", "cuda-13.0", "cuda-12.10", "cuda-x", "cudnn"] {
            std::fs::create_dir_all(tmp.path().join(v)).unwrap();
        }
        let found = versioned_toolkits(tmp.path());
        let names: Vec<_> = found
            .iter()
            .map(|p| {
                p.parent()
                    .unwrap()
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(names, ["cuda-13.0", "cuda-12.10", "cuda-12.9"]);
        assert!(found.iter().all(|p| p.ends_with("lib64")));
    }

    #[test]
    fn loader_names_try_the_link_then_known_versions() {
        assert_eq!(
            loader_names("nvrtc"),
            [
                "libnvrtc.so",
                "libnvrtc.so.13",
                "libnvrtc.so.12",
                "libnvrtc.so.11"
            ]
        );
        let opens = |n: &std::ffi::OsStr| {
            (n == "libnvrtc.so.12")
                .then_some(7)
                .ok_or_else(|| "no".to_string())
        };
        let (seven, located) = open_first("nvrtc", &opens).unwrap();
        assert_eq!(
            (seven, located),
            (7, Located::Loader("libnvrtc.so.12".into()))
        );
        // nothing opens: the error names the library, the folders and what to install
        let e = open_first("nvrtc", &|_| Err::<(), _>("bad".to_string()))
            .unwrap_err()
            .into_error("install it");
        let msg = e.to_string();
        assert!(
            msg.starts_with("libnvrtc not found: install it; looked on the loader's path"),
            "{msg}"
        );
        assert!(msg.contains("/usr/local/cuda/lib64"), "{msg}");
    }
}
