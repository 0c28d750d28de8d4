//! The rank-level collectives staged through host memory: the default bodies of
//! [`Collective::all_reduce_sum`] and its siblings. Every transfer between two ranks is one
//! [`Collective::copy_host`] between their memories (so simulated links take their time), and
//! sums are added in rank order, so every rank ends with the same bits.
//!
//! One process must drive every rank: with ranks in other processes there is no memory to copy
//! from, and only a transport with its own wire (NCCL) can run the collective.

use super::{Collective, RankSlice};
use crate::error::{Result, invalid};

/// `parts` sorted by rank, checked to be exactly ranks `0..world`.
fn whole_world(what: &str, parts: &mut [RankSlice<'_>], world: usize) -> Result<()> {
    parts.sort_by_key(|p| p.rank);
    let ranks: Vec<usize> = parts.iter().map(|p| p.rank).collect();
    if !ranks.iter().copied().eq(0..world) {
        return Err(invalid(
            format!("host-staged {what}"),
            format!("ranks 0..{world}, each once, all in this process"),
            format!(
                "ranks {ranks:?}; ranks in other processes need the nccl transport (feature `nccl`)"
            ),
        ));
    }
    Ok(())
}

fn same_len(what: &str, parts: &[RankSlice<'_>], len: usize) -> Result<()> {
    match parts.iter().find(|p| p.values.len() != len) {
        Some(p) => Err(invalid(
            format!("{what} buffer of rank {}", p.rank),
            format!("{len} values"),
            p.values.len(),
        )),
        None => Ok(()),
    }
}

/// Block offsets of `counts`, checked against `world`: `(start, end)` per rank.
pub(super) fn blocks(what: &str, counts: &[usize], world: usize) -> Result<Vec<(usize, usize)>> {
    if counts.len() != world {
        return Err(invalid(
            format!("{what} counts"),
            format!("one per rank ({world})"),
            counts.len(),
        ));
    }
    let mut out = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &c in counts {
        let end = at
            .checked_add(c)
            .ok_or_else(|| invalid(format!("{what} counts"), "a sum that fits", "an overflow"))?;
        out.push((at, end));
        at = end;
    }
    Ok(out)
}

/// Copy `src` (rank `from`'s values) into `dst` on `parts[to]`'s device, one transfer.
fn send<C: Collective + ?Sized>(
    c: &C,
    src: &[f32],
    from: &RankSlice<'_>,
    to: &RankSlice<'_>,
    dst: &mut [f32],
) -> Result<()> {
    c.copy_host(
        bytemuck::cast_slice(src),
        from.device,
        bytemuck::cast_slice_mut(dst),
        to.device,
    )
}

pub(super) fn all_reduce_sum<C: Collective + ?Sized>(
    c: &C,
    parts: &mut [RankSlice<'_>],
) -> Result<()> {
    let world = parts.len();
    whole_world("all-reduce", parts, world)?;
    let len = parts.first().map_or(0, |p| p.values.len());
    same_len("all-reduce", parts, len)?;
    // The inputs, before any rank's buffer is overwritten with the sum.
    let inputs: Vec<Vec<f32>> = parts.iter().map(|p| p.values.to_vec()).collect();
    let mut recv = vec![0f32; len];
    let mut sum = vec![0f32; len];
    for j in 0..world {
        for (r, input) in inputs.iter().enumerate() {
            let add: &[f32] = if r == j {
                input
            } else {
                send(c, input, &parts[r], &parts[j], &mut recv)?;
                &recv
            };
            if r == 0 {
                sum.copy_from_slice(add);
            } else {
                sum.iter_mut().zip(add).for_each(|(s, a)| *s += a);
            }
        }
        parts[j].values.copy_from_slice(&sum);
    }
    Ok(())
}

pub(super) fn broadcast_from<C: Collective + ?Sized>(
    c: &C,
    root: usize,
    parts: &mut [RankSlice<'_>],
) -> Result<()> {
    let world = parts.len();
    whole_world("broadcast", parts, world)?;
    if root >= world {
        return Err(invalid(
            "broadcast root",
            format!("a rank below {world}"),
            root,
        ));
    }
    let src = parts[root].values.to_vec();
    same_len("broadcast", parts, src.len())?;
    for j in (0..world).filter(|&j| j != root) {
        // Out of `parts` for the copy, so rank j's buffer and its metadata can both be lent.
        let dst = std::mem::take(&mut parts[j].values);
        let r = send(c, &src, &parts[root], &parts[j], dst);
        parts[j].values = dst;
        r?;
    }
    Ok(())
}

pub(super) fn all_gather<C: Collective + ?Sized>(
    c: &C,
    counts: &[usize],
    parts: &mut [RankSlice<'_>],
) -> Result<()> {
    let blocks = blocks("all-gather", counts, parts.len())?;
    whole_world("all-gather", parts, counts.len())?;
    let total = blocks.last().map_or(0, |b| b.1);
    same_len("all-gather", parts, total)?;
    let own: Vec<Vec<f32>> = parts
        .iter()
        .zip(&blocks)
        .map(|(p, &(a, b))| p.values[a..b].to_vec())
        .collect();
    for j in 0..parts.len() {
        for (r, &(a, b)) in blocks.iter().enumerate().filter(|&(r, _)| r != j) {
            let dst = std::mem::take(&mut parts[j].values);
            let res = send(c, &own[r], &parts[r], &parts[j], &mut dst[a..b]);
            parts[j].values = dst;
            res?;
        }
    }
    Ok(())
}

pub(super) fn reduce_scatter_sum<C: Collective + ?Sized>(
    c: &C,
    counts: &[usize],
    parts: &mut [RankSlice<'_>],
) -> Result<()> {
    let blocks = blocks("reduce-scatter", counts, parts.len())?;
    whole_world("reduce-scatter", parts, counts.len())?;
    let total = blocks.last().map_or(0, |b| b.1);
    same_len("reduce-scatter", parts, total)?;
    let inputs: Vec<Vec<f32>> = parts.iter().map(|p| p.values.to_vec()).collect();
    let mut recv = Vec::new();
    for (j, &(a, b)) in blocks.iter().enumerate() {
        let mut sum = vec![0f32; b - a];
        recv.resize(b - a, 0.0);
        for (r, input) in inputs.iter().enumerate() {
            let block = &input[a..b];
            let add: &[f32] = if r == j {
                block
            } else {
                send(c, block, &parts[r], &parts[j], &mut recv)?;
                &recv
            };
            if r == 0 {
                sum.copy_from_slice(add);
            } else {
                sum.iter_mut().zip(add).for_each(|(s, x)| *s += x);
            }
        }
        parts[j].values[a..b].copy_from_slice(&sum);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::device::Device;
    use crate::tp::HostStaged;

    fn devices(n: u32) -> Vec<Arc<Device>> {
        (0..n).map(|i| Device::virtual_device(i, 1 << 20)).collect()
    }

    fn slices<'a>(devs: &'a [Arc<Device>], bufs: &'a mut [Vec<f32>]) -> Vec<RankSlice<'a>> {
        devs.iter()
            .zip(bufs.iter_mut())
            .enumerate()
            .map(|(rank, (d, v))| RankSlice {
                rank,
                device: d,
                values: v,
            })
            .collect()
    }

    #[test]
    fn all_reduce_sums_every_rank() {
        let devs = devices(3);
        let mut bufs = vec![vec![1.0, 2.0], vec![10.0, 20.0], vec![100.0, 200.0]];
        let mut parts = slices(&devs, &mut bufs);
        // Given out of rank order: the collective sorts by rank.
        parts.reverse();
        HostStaged.all_reduce_sum(&mut parts).unwrap();
        drop(parts);
        assert_eq!(bufs, vec![vec![111.0, 222.0]; 3]);
    }

    #[test]
    fn broadcast_copies_the_roots_values() {
        let devs = devices(3);
        let mut bufs = vec![vec![0.0; 2], vec![4.0, 5.0], vec![9.0; 2]];
        HostStaged
            .broadcast_from(1, &mut slices(&devs, &mut bufs))
            .unwrap();
        assert_eq!(bufs, vec![vec![4.0, 5.0]; 3]);
    }

    #[test]
    fn all_gather_fills_uneven_blocks() {
        let devs = devices(3);
        // Rank 0 owns 2 values, rank 1 none (a device with no share), rank 2 one.
        let counts = [2, 0, 1];
        let mut bufs = vec![
            vec![1.0, 2.0, -1.0],
            vec![-1.0, -1.0, -1.0],
            vec![-1.0, -1.0, 3.0],
        ];
        HostStaged
            .all_gather(&counts, &mut slices(&devs, &mut bufs))
            .unwrap();
        assert_eq!(bufs, vec![vec![1.0, 2.0, 3.0]; 3]);
    }

    #[test]
    fn reduce_scatter_leaves_each_rank_its_summed_block() {
        let devs = devices(2);
        let counts = [1, 2];
        let mut bufs = vec![vec![1.0, 2.0, 3.0], vec![10.0, 20.0, 30.0]];
        HostStaged
            .reduce_scatter_sum(&counts, &mut slices(&devs, &mut bufs))
            .unwrap();
        assert_eq!(bufs, vec![vec![11.0, 2.0, 3.0], vec![10.0, 22.0, 33.0]]);
    }

    #[test]
    fn host_staged_refuses_a_partial_world() {
        let devs = devices(2);
        let mut bufs = vec![vec![1.0], vec![2.0]];
        let mut parts = slices(&devs, &mut bufs);
        parts.remove(0);
        let m = HostStaged
            .all_reduce_sum(&mut parts)
            .unwrap_err()
            .to_string();
        assert_eq!(
            m,
            "host-staged all-reduce: expected ranks 0..1, each once, all in this process, got \
             ranks [1]; ranks in other processes need the nccl transport (feature `nccl`)"
        );
        let m = HostStaged
            .all_gather(&[1, 1, 1], &mut slices(&devs, &mut bufs))
            .unwrap_err()
            .to_string();
        assert_eq!(m, "all-gather counts: expected one per rank (2), got 3");
        let mut short = vec![vec![1.0, 2.0], vec![3.0]];
        let m = HostStaged
            .all_reduce_sum(&mut slices(&devs, &mut short))
            .unwrap_err()
            .to_string();
        assert_eq!(m, "all-reduce buffer of rank 1: expected 2 values, got 1");
    }
}
