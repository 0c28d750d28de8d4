//! Where this process sits in a multi-process run: its rank, the world size and its local
//! device, read from the variables a launcher sets (torchrun's `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), and the NCCL unique id that rank 0 makes and the
//! launcher hands to every other rank.
//!
//! Nothing here opens a socket: the ranks meet through NCCL's own bootstrap, which needs only
//! the unique id. How the id travels (a shared file, an environment variable the job script
//! fills in) is the launcher's business.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{EngineError, Result, invalid};

/// More ranks than any NCCL job runs: a guard against a garbled `WORLD_SIZE` turning into a
/// huge rank table.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_ID_BYTES: usize = 128;

/// The environment variable holding the unique id as hex.
pub const NCCL_ID_VAR: &str = "WEIGHTLIFT_NCCL_ID";
/// The environment variable naming a file that holds the unique id as hex.
pub const NCCL_ID_FILE_VAR: &str = "WEIGHTLIFT_NCCL_ID_FILE";

/// This process's place in a run of `world_size` processes, one per GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    /// This process's global rank, `0..world_size`.
    pub rank: usize,
    pub world_size: usize,
    /// The rank on this node, which is also the CUDA ordinal this process drives.
    pub local_rank: usize,
    /// Processes on this node (`None` where the launcher does not say, as `srun` does not).
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR:MASTER_PORT`, kept only to name the rendezvous in messages: NCCL meets
    /// through the unique id, not through this address.
    pub master: Option<String>,
}

impl World {
    /// One process holding every rank (the single-machine case).
    pub fn single() -> World {
        World {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            master: None,
        }
    }

    /// Read torchrun's variables from the process environment.
    pub fn from_env() -> Result<World> {
        World::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`World::from_env`], with `var` standing in for the environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<World> {
        let world_size = number(&var, "WORLD_SIZE", "an integer from 1")?;
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(env_invalid(
                "WORLD_SIZE",
                format!("an integer from 1 to {MAX_WORLD_SIZE}"),
                world_size,
            ));
        }
        let rank = number(&var, "RANK", "an integer")?;
        if rank >= world_size {
            return Err(env_invalid(
                "RANK",
                format!("below WORLD_SIZE ({world_size})"),
                rank,
            ));
        }
        let local_world_size = match var("LOCAL_WORLD_SIZE") {
            None => None,
            Some(_) => {
                let n = number(&var, "LOCAL_WORLD_SIZE", "an integer")?;
                if n == 0 || n > world_size {
                    return Err(env_invalid(
                        "LOCAL_WORLD_SIZE",
                        format!("an integer from 1 to WORLD_SIZE ({world_size})"),
                        n,
                    ));
                }
                Some(n)
            }
        };
        let local_rank = number(&var, "LOCAL_RANK", "an integer")?;
        if let Some(n) = local_world_size
            && local_rank >= n
        {
            return Err(env_invalid(
                "LOCAL_RANK",
                format!("below LOCAL_WORLD_SIZE ({n})"),
                local_rank,
            ));
        }
        let master = match (var("MASTER_ADDR"), var("MASTER_PORT")) {
            (Some(a), Some(p)) => Some(format!("{a}:{p}")),
            (Some(a), None) => Some(a),
            _ => None,
        };
        Ok(World {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master,
        })
    }

    /// The node this rank runs on, where every node runs the same number of processes (as
    /// torchrun's `--nproc-per-node` makes them): `rank / local_world_size`.
    pub fn node(&self) -> Option<usize> {
        self.local_world_size.map(|n| self.rank / n)
    }
}

fn env_invalid(name: &str, expected: String, got: impl std::fmt::Display) -> EngineError {
    invalid(
        format!("environment variable {name}"),
        format!("{expected} (a launcher such as torchrun sets it)"),
        got,
    )
}

/// A non-negative integer variable that must be set.
fn number(var: &impl Fn(&str) -> Option<String>, name: &str, expected: &str) -> Result<usize> {
    let Some(raw) = var(name) else {
        return Err(env_invalid(name, expected.to_owned(), "unset"));
    };
    raw.trim()
        .parse::<usize>()
        .map_err(|_| env_invalid(name, expected.to_owned(), format!("{raw:?}")))
}

/// An NCCL unique id: made by rank 0 (`ncclGetUniqueId`), read by every rank before the
/// communicator is built.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId(pub [u8; NCCL_ID_BYTES]);

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId({}…)", &self.to_hex()[..16])
    }
}

impl NcclUniqueId {
    /// Lower-case hex, 256 characters.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parse 256 hex characters (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<NcclUniqueId> {
        let text = text.trim();
        let bad = |got: String| {
            invalid(
                "nccl unique id",
                format!(
                    "{} hex characters, as rank 0 writes them",
                    NCCL_ID_BYTES * 2
                ),
                got,
            )
        };
        if text.len() != NCCL_ID_BYTES * 2 || !text.is_ascii() {
            return Err(bad(format!("{} characters", text.len())));
        }
        let mut out = [0u8; NCCL_ID_BYTES];
        for (i, byte) in out.iter_mut().enumerate() {
            let pair = &text[2 * i..2 * i + 2];
            *byte = u8::from_str_radix(pair, 16)
                .map_err(|_| bad(format!("{pair:?} at character {}", 2 * i)))?;
        }
        Ok(NcclUniqueId(out))
    }

    /// The id from `WEIGHTLIFT_NCCL_ID` (hex), or else from the file `WEIGHTLIFT_NCCL_ID_FILE`
    /// names, waiting up to `wait` for rank 0 to write it.
    pub fn from_env(wait: Duration) -> Result<NcclUniqueId> {
        if let Ok(hex) = std::env::var(NCCL_ID_VAR) {
            return NcclUniqueId::from_hex(&hex);
        }
        match std::env::var(NCCL_ID_FILE_VAR) {
            Ok(path) => NcclUniqueId::from_file(Path::new(&path), wait),
            Err(_) => Err(invalid(
                "nccl unique id",
                format!("{NCCL_ID_VAR} (hex) or {NCCL_ID_FILE_VAR} (a path) in the environment"),
                "neither set; rank 0 makes the id and the launcher must share it",
            )),
        }
    }

    /// Read the id from `path`, polling until it holds a whole id or `wait` has passed (the
    /// other ranks may start before rank 0 has written it).
    pub fn from_file(path: &Path, wait: Duration) -> Result<NcclUniqueId> {
        let since = Instant::now();
        loop {
            // A few bytes at most: the id and a newline. Anything longer is not an id.
            let got = std::fs::read(path).ok().filter(|b| b.len() <= 4096);
            if let Some(text) = got.as_deref().and_then(|b| std::str::from_utf8(b).ok())
                && text.trim().len() >= NCCL_ID_BYTES * 2
            {
                return NcclUniqueId::from_hex(text);
            }
            if since.elapsed() >= wait {
                return Err(invalid(
                    format!("nccl unique id file {}", path.display()),
                    format!("{} hex characters", NCCL_ID_BYTES * 2),
                    format!(
                        "no complete id after {:.1} s; rank 0 has not written it, or the path \
                         is not on a file system every node shares",
                        wait.as_secs_f64()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Write the id to `path` as hex, through a temporary file renamed into place so a reader
    /// never sees half of it.
    pub fn write_file(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("partial");
        let io = |e: std::io::Error| EngineError::Device {
            device: "nccl".into(),
            detail: format!("writing the unique id to {}: {e}", path.display()),
        };
        std::fs::write(&tmp, self.to_hex()).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            owned
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn reads_torchruns_variables() {
        let w = World::from_vars(vars(TORCHRUN)).unwrap();
        assert_eq!(
            w,
            World {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: Some(4),
                master: Some("node0:29500".into()),
            }
        );
        assert_eq!(w.node(), Some(1));
    }

    fn without(name: &str) -> Vec<(&'static str, &'static str)> {
        TORCHRUN
            .iter()
            .copied()
            .filter(|(k, _)| *k != name)
            .collect()
    }

    fn with(name: &str, value: &'static str) -> Vec<(&'static str, &'static str)> {
        let mut v = without(name);
        let key = TORCHRUN.iter().find(|(k, _)| *k == name).unwrap().0;
        v.push((key, value));
        v
    }

    fn message(pairs: &[(&str, &str)]) -> String {
        World::from_vars(vars(pairs)).unwrap_err().to_string()
    }

    #[test]
    fn a_missing_variable_is_named() {
        for name in ["RANK", "WORLD_SIZE", "LOCAL_RANK"] {
            let m = message(&without(name));
            assert!(m.starts_with(&format!("environment variable {name}: expected")));
            assert!(m.ends_with("got unset"), "{m}");
            assert!(m.contains("torchrun sets it"), "{m}");
        }
        // srun and mpirun set no LOCAL_WORLD_SIZE: the world is still whole, the node unknown.
        let w = World::from_vars(vars(&without("LOCAL_WORLD_SIZE"))).unwrap();
        assert_eq!((w.local_world_size, w.node()), (None, None));
    }

    #[test]
    fn an_invalid_variable_says_expected_and_got() {
        assert_eq!(
            message(&with("RANK", "8")),
            "environment variable RANK: expected below WORLD_SIZE (8) \
             (a launcher such as torchrun sets it), got 8"
        );
        assert_eq!(
            message(&with("WORLD_SIZE", "eight")),
            "environment variable WORLD_SIZE: expected an integer from 1 \
             (a launcher such as torchrun sets it), got \"eight\""
        );
        assert!(message(&with("WORLD_SIZE", "0")).contains("from 1 to 65536"));
        assert!(message(&with("WORLD_SIZE", "-1")).ends_with("got \"-1\""));
        assert!(message(&with("LOCAL_RANK", "4")).contains("below LOCAL_WORLD_SIZE (4)"));
        assert!(message(&with("LOCAL_WORLD_SIZE", "9")).contains("from 1 to WORLD_SIZE (8)"));
    }

    #[test]
    fn unique_id_hex_round_trips_and_rejects_bad_text() {
        let mut bytes = [0u8; NCCL_ID_BYTES];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let id = NcclUniqueId(bytes);
        let hex = id.to_hex();
        assert_eq!(&hex[..8], "00010203");
        assert_eq!(NcclUniqueId::from_hex(&format!("{hex}\n")).unwrap(), id);
        let short = NcclUniqueId::from_hex("abcd").unwrap_err().to_string();
        assert_eq!(
            short,
            "nccl unique id: expected 256 hex characters, as rank 0 writes them, got 4 characters"
        );
        let bad = format!("zz{}", &hex[2..]);
        let m = NcclUniqueId::from_hex(&bad).unwrap_err().to_string();
        assert!(m.ends_with("got \"zz\" at character 0"), "{m}");
    }

    #[test]
    fn unique_id_file_is_read_and_a_missing_one_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nccl.id");
        let id = NcclUniqueId([7u8; NCCL_ID_BYTES]);
        id.write_file(&path).unwrap();
        assert_eq!(NcclUniqueId::from_file(&path, Duration::ZERO).unwrap(), id);
        let missing = dir.path().join("absent.id");
        let m = NcclUniqueId::from_file(&missing, Duration::from_millis(60))
            .unwrap_err()
            .to_string();
        assert!(m.contains("rank 0 has not written it"), "{m}");
    }
}
