//! The tensor info table: names, shapes, ggml types and offsets, each validated, then the
//! data section's start, every tensor's bounds within the file, and the check that no two
//! tensors overlap. GGUF stores no byte size: it is implied by type × shape.

use std::collections::HashSet;

use super::Parser;
use crate::gguf::{MAX_DIMS, MAX_KEY_LEN, invalid};
use crate::{DType, Result, TensorInfo, hint};

impl<'a> Parser<'a> {
    pub(super) fn read_tensors(
        &mut self,
        n_tensors: u64,
        alignment: u64,
    ) -> Result<(Vec<TensorInfo>, u64)> {
        let n = n_tensors as usize; // checked against the remaining bytes by the caller
        let mut tensors = Vec::with_capacity(n);
        let mut names: HashSet<&'a str> = HashSet::with_capacity(n);
        let mut rel_offsets = Vec::with_capacity(n);
        for i in 0..n {
            let at = self.pos;
            let name = self.string(MAX_KEY_LEN, &|| format!("tensor #{i} name"))?;
            if name.is_empty() {
                return Err(invalid(
                    self.path,
                    format!("tensor #{i} name (at offset {at})"),
                    "a non-empty name",
                    "an empty string",
                    hint::CORRUPT,
                ));
            }
            if !names.insert(name) {
                return Err(invalid(
                    self.path,
                    format!("tensor '{name}'"),
                    "each tensor name once",
                    format!("a second '{name}' (tensor #{i} at offset {at})"),
                    hint::CORRUPT,
                ));
            }
            let tw = |field: &str| format!("tensor '{name}' {field}");
            let n_dims = self.u32(|| tw("dimension count"))?;
            if !(1..=MAX_DIMS).contains(&n_dims) {
                return Err(invalid(
                    self.path,
                    tw("dimension count"),
                    format!("1 to {MAX_DIMS} dimensions"),
                    n_dims.to_string(),
                    hint::CORRUPT,
                ));
            }
            let mut ne = [1u64; MAX_DIMS as usize];
            for (d, slot) in ne.iter_mut().take(n_dims as usize).enumerate() {
                let v = self.u64(|| tw(&format!("ne[{d}]")))?;
                if v == 0 || v > i64::MAX as u64 {
                    return Err(invalid(
                        self.path,
                        tw(&format!("ne[{d}]")),
                        format!("a dimension in 1..={}", i64::MAX),
                        v.to_string(),
                        hint::CORRUPT,
                    ));
                }
                *slot = v;
            }
            let ne = &ne[..n_dims as usize];
            let type_at = self.pos;
            let type_id = self.u32(|| tw("type"))?;
            let Some(dtype) = DType::from_ggml_id(type_id) else {
                let detail = match type_id {
                    4 | 5 => " (Q4_2/Q4_3, removed from ggml in 2023)",
                    31..=33 => " (Q4_0_4_4/Q4_0_4_8/Q4_0_8_8, removed from ggml in 2024)",
                    _ => "",
                };
                return Err(invalid(
                    self.path,
                    tw(&format!("type (at offset {type_at})")),
                    "a ggml type id that llama.cpp defines",
                    format!("{type_id}{detail}"),
                    if detail.is_empty() {
                        hint::NEWER_WRITER
                    } else {
                        hint::OLD_GGUF
                    },
                ));
            };
            let offset = self.u64(|| tw("offset"))?;

            let shape_str = || format!("{dtype} with ne {ne:?}");
            let n_elements = ne
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64);
            let Some(n_elements) = n_elements else {
                return Err(invalid(
                    self.path,
                    tw("shape"),
                    format!("at most {} elements", i64::MAX),
                    format!("{} (overflows)", shape_str()),
                    hint::HOSTILE,
                ));
            };
            if ne[0] % dtype.block_size() != 0 {
                return Err(invalid(
                    self.path,
                    tw("row length ne[0]"),
                    format!("a multiple of {dtype}'s block size {}", dtype.block_size()),
                    ne[0].to_string(),
                    hint::CORRUPT,
                ));
            }
            let Some(nbytes) = dtype.bytes_for(n_elements) else {
                return Err(invalid(
                    self.path,
                    tw("size"),
                    "a byte size that fits 64 bits",
                    format!("{} (overflows)", shape_str()),
                    hint::HOSTILE,
                ));
            };
            if offset % alignment != 0 {
                return Err(invalid(
                    self.path,
                    tw("offset"),
                    format!("a multiple of the alignment {alignment}"),
                    offset.to_string(),
                    hint::CORRUPT,
                ));
            }
            rel_offsets.push(offset);
            tensors.push(TensorInfo {
                name: name.to_owned(),
                dtype,
                shape: ne.iter().rev().copied().collect(),
                nbytes,
                file: 0,
                offset: 0, // made absolute below, once the data section start is known
                layer: None,
                role: None,
            });
        }

        let end_of_infos = self.pos as u64;
        let data_offset = end_of_infos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| {
                invalid(
                    self.path,
                    "data section offset",
                    "an offset that fits 64 bits",
                    format!("{end_of_infos} rounded up to {alignment}"),
                    hint::HOSTILE,
                )
            })?;
        let file_len = self.bytes.len() as u64;
        for (t, rel) in tensors.iter_mut().zip(&rel_offsets) {
            let start = data_offset.checked_add(*rel);
            let end = start.and_then(|s| s.checked_add(t.nbytes));
            match (start, end) {
                (Some(start), Some(end)) if end <= file_len => t.offset = start,
                _ => {
                    return Err(invalid(
                        self.path,
                        format!("tensor '{}' data", t.name),
                        format!(
                            "{} bytes ({} × {:?}) at data offset {rel} (absolute {}) within the file of {file_len} bytes",
                            t.nbytes,
                            t.dtype,
                            t.shape,
                            data_offset.saturating_add(*rel)
                        ),
                        format!(
                            "data ending at {}, past the end of the file",
                            data_offset.saturating_add(*rel).saturating_add(t.nbytes)
                        ),
                        hint::TRUNCATED,
                    ));
                }
            }
        }

        // Overlap: in offset order, each tensor must start at or after the end of the previous.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_unstable_by_key(|&i| tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            let a_end = a.offset + a.nbytes; // in bounds, checked above
            if b.offset < a_end {
                return Err(invalid(
                    self.path,
                    format!("tensor '{}' offset", b.name),
                    format!(
                        "at least {} (after tensor '{}', which needs {} bytes for {} × {:?} from offset {})",
                        a_end - data_offset,
                        a.name,
                        a.nbytes,
                        a.dtype,
                        a.shape,
                        a.offset - data_offset
                    ),
                    format!("{} (the tensors overlap)", b.offset - data_offset),
                    hint::CORRUPT,
                ));
            }
        }
        Ok((tensors, data_offset))
    }
}
