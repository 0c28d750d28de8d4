//! Split checkpoints (`name-0000N-of-0000M.gguf`, as llama.cpp's gguf-split writes them):
//! finding every part from any one of them, checking that the parts agree (`split.no`,
//! `split.count`, `split.tensors.count`, no tensor twice), and assembling one checkpoint whose
//! metadata is the first part's and whose tensors point at their own part. A single file is the
//! one-part case.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{GgufHeader, invalid, parse_backed, tokenizer_info};
use crate::checkpoint::Parsed;
use crate::mapped::MappedFile;
use crate::metadata::Backing;
use crate::{Metadata, Result, hint};

/// A split part's name, `{prefix}-{no:05}-of-{count:05}.gguf` (llama.cpp's `llama_split_path`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct SplitName {
    prefix: String,
    /// 1-based, as in the file name.
    no: u32,
    count: u32,
    /// Digits used for the numbers (5, or more for ≥ 100000 parts).
    width: usize,
}

impl SplitName {
    fn parse(path: &Path) -> Option<SplitName> {
        let name = path.file_name()?.to_str()?;
        let stem = name.strip_suffix(".gguf")?;
        let (head, count) = stem.rsplit_once("-of-")?;
        let (prefix, no) = head.rsplit_once('-')?;
        let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
        if prefix.is_empty() || !digits(no) || !digits(count) || no.len() != count.len() {
            return None;
        }
        Some(SplitName {
            prefix: prefix.to_owned(),
            no: no.parse().ok()?,
            count: count.parse().ok()?,
            width: no.len(),
        })
    }

    fn part_path(&self, dir: &Path, no: u32) -> PathBuf {
        let w = self.width;
        dir.join(format!(
            "{}-{no:0w$}-of-{:0w$}.gguf",
            self.prefix, self.count
        ))
    }
}

/// The split keys gguf-split writes into every part.
pub const SPLIT_NO_KEY: &str = "split.no";
pub const SPLIT_COUNT_KEY: &str = "split.count";
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// Most parts of one split checkpoint.
pub const MAX_SPLIT_PARTS: u32 = 9_999;

fn split_key(meta: &Metadata, key: &str, path: &Path) -> Result<Option<u64>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            invalid(
                path,
                format!("key '{key}'"),
                "a non-negative integer",
                format!("{v:?}"),
                hint::CORRUPT,
            )
        }),
    }
}

/// Open a GGUF checkpoint: one file, or every part of a split set when `path` names any part
/// (`name-00002-of-00003.gguf` opens parts 1 to 3).
///
/// With `vocab_only`, each part's header and key/value section are parsed and validated, the
/// tensor info section is skipped, and no tensor is returned; tensor data is never touched.
pub(crate) fn read(path: &Path, vocab_only: bool) -> Result<Parsed> {
    let parse_file = |file: &Arc<MappedFile>, path: &Path| {
        let src: Backing = file.clone();
        parse_backed(&src, path, !vocab_only)
    };
    let split = SplitName::parse(path).filter(|s| s.count > 1);

    let Some(split) = split else {
        let file = Arc::new(MappedFile::open(path)?);
        let header = parse_file(&file, path)?;
        if let Some(count) = split_key(&header.metadata, SPLIT_COUNT_KEY, path)?
            && count > 1
        {
            return Err(invalid(
                path,
                format!("key '{SPLIT_COUNT_KEY}'"),
                "a file name like name-00001-of-00003.gguf for a split checkpoint",
                format!("{count} parts, in a file named '{}'", path.display()),
                hint::SPLIT_NAMES,
            ));
        }
        return Ok(assemble(vec![file], vec![header], vocab_only));
    };

    if split.no == 0 || split.no > split.count || split.count > MAX_SPLIT_PARTS {
        return Err(invalid(
            path,
            "split file name",
            format!("part 1..={} of at most {MAX_SPLIT_PARTS}", split.count),
            format!("part {} of {}", split.no, split.count),
            hint::SPLIT_NAMES,
        ));
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut files = Vec::with_capacity(split.count as usize);
    let mut headers = Vec::with_capacity(split.count as usize);
    for no in 1..=split.count {
        let part = split.part_path(dir, no);
        if !part.exists() {
            return Err(invalid(
                &part,
                format!("split part {no} of {}", split.count),
                "the file to exist",
                "no such file",
                hint::SHARDS,
            ));
        }
        let file = Arc::new(MappedFile::open(&part)?);
        let header = parse_file(&file, &part)?;
        files.push(file);
        headers.push(header);
    }

    // Every part carries split.no (0-based), split.count and split.tensors.count.
    let mut total_claimed = None;
    let mut total_found = 0u64;
    for (i, (file, h)) in files.iter().zip(&headers).enumerate() {
        let p = file.path();
        let req = |key: &str| -> Result<u64> {
            split_key(&h.metadata, key, p)?.ok_or_else(|| {
                invalid(
                    p,
                    format!("key '{key}'"),
                    "the key in every part of a split checkpoint",
                    "no such key",
                    hint::SPLIT_NAMES,
                )
            })
        };
        let no = req(SPLIT_NO_KEY)?;
        if no != i as u64 {
            return Err(invalid(
                p,
                format!("key '{SPLIT_NO_KEY}'"),
                format!("{i} (0-based) for part {} of the file names", i + 1),
                no.to_string(),
                hint::SPLIT_NAMES,
            ));
        }
        let count = req(SPLIT_COUNT_KEY)?;
        if count != u64::from(split.count) {
            return Err(invalid(
                p,
                format!("key '{SPLIT_COUNT_KEY}'"),
                format!("{} as the file names say", split.count),
                count.to_string(),
                hint::SHARDS,
            ));
        }
        let claimed = req(SPLIT_TENSORS_COUNT_KEY)?;
        match total_claimed {
            None => total_claimed = Some(claimed),
            Some(first) if first != claimed => {
                return Err(invalid(
                    p,
                    format!("key '{SPLIT_TENSORS_COUNT_KEY}'"),
                    format!("{first}, as in part 1"),
                    claimed.to_string(),
                    hint::SHARDS,
                ));
            }
            Some(_) => {}
        }
        total_found = total_found.saturating_add(h.n_tensors);
    }
    if let Some(claimed) = total_claimed
        && claimed != total_found
    {
        return Err(invalid(
            files[0].path(),
            format!("key '{SPLIT_TENSORS_COUNT_KEY}'"),
            format!("{claimed} tensors over the {} parts", split.count),
            format!("{total_found} tensors in the parts' headers"),
            hint::SHARDS,
        ));
    }
    if !vocab_only {
        let mut seen: HashSet<&str> = HashSet::new();
        for (file, h) in files.iter().zip(&headers) {
            for t in &h.tensors {
                if !seen.insert(&t.name) {
                    return Err(invalid(
                        file.path(),
                        format!("tensor '{}'", t.name),
                        "each tensor name once over all split parts",
                        "a second copy in this part",
                        hint::SHARDS,
                    ));
                }
            }
        }
    }
    Ok(assemble(files, headers, vocab_only))
}

/// Metadata from the first part, tensors from every part (each pointing at its part).
fn assemble(files: Vec<Arc<MappedFile>>, headers: Vec<GgufHeader>, vocab_only: bool) -> Parsed {
    let mut headers = headers.into_iter();
    let first = headers.next();
    let (metadata, mut tensors) = match first {
        Some(h) => (h.metadata, h.tensors),
        None => (Metadata::new(), Vec::new()),
    };
    for (i, h) in headers.enumerate() {
        tensors.extend(h.tensors.into_iter().map(|mut t| {
            t.file = i + 1;
            t
        }));
    }
    if vocab_only {
        tensors.clear();
    }
    let tokenizer = tokenizer_info(&metadata);
    Parsed {
        files,
        metadata,
        tensors,
        config: None,
        tokenizer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        let s = SplitName::parse(Path::new("/m/llama-7b-00002-of-00003.gguf")).unwrap();
        assert_eq!(
            s,
            SplitName {
                prefix: "llama-7b".into(),
                no: 2,
                count: 3,
                width: 5
            }
        );
        assert_eq!(
            s.part_path(Path::new("/m"), 1),
            PathBuf::from("/m/llama-7b-00001-of-00003.gguf")
        );
        assert_eq!(SplitName::parse(Path::new("model.gguf")), None);
        assert_eq!(SplitName::parse(Path::new("m-1-of-3.gguf")), None);
        assert_eq!(SplitName::parse(Path::new("-00001-of-00003.gguf")), None);
    }
}
