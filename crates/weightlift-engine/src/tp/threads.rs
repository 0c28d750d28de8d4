//! Ranks run as threads of one process: a [`Collective`] whose rank-level operations meet in
//! a table of shared slots, so a pass written for one rank per process runs, and is checked
//! against the single-process one, without a second process or any network. Each member is one
//! rank; every rank must make the same sequence of calls, as with NCCL.
//!
//! A member that is dropped (its thread failed and unwound, or returned early) marks the group
//! as left: the others' waiting calls, and every later call, fail with an error naming it
//! instead of waiting for a rank that will never come.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::host::blocks;
use super::{Collective, RankSlice};
use crate::error::{EngineError, Result, invalid};

#[derive(Debug)]
struct Slots {
    /// Each rank's values for the operation in progress.
    values: Vec<Vec<f32>>,
    /// Ranks waiting at the current barrier.
    arrived: usize,
    /// Barriers passed so far: a waiter leaves when this moves on.
    generation: u64,
    /// The first member dropped, if any.
    left: Option<usize>,
}

#[derive(Debug)]
struct Shared {
    slots: Mutex<Slots>,
    turn: Condvar,
}

/// One rank of a group of threads (see the module docs).
#[derive(Debug)]
pub struct ThreadGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// One member per rank, `0..world_size`, to hand to one thread each.
    pub fn new(world_size: usize) -> Result<Vec<ThreadGroup>> {
        if world_size == 0 || world_size > super::MAX_WORLD_SIZE {
            return Err(invalid(
                "thread group size",
                format!("1 to {}", super::MAX_WORLD_SIZE),
                world_size,
            ));
        }
        let shared = Arc::new(Shared {
            slots: Mutex::new(Slots {
                values: vec![Vec::new(); world_size],
                arrived: 0,
                generation: 0,
                left: None,
            }),
            turn: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadGroup {
                rank,
                world: world_size,
                shared: Arc::clone(&shared),
            })
            .collect())
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        self.shared
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Wait until every rank has arrived here.
    fn barrier<'g>(
        &'g self,
        mut s: MutexGuard<'g, Slots>,
        what: &str,
    ) -> Result<MutexGuard<'g, Slots>> {
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.world {
            s.arrived = 0;
            s.generation += 1;
            self.shared.turn.notify_all();
            return Ok(s);
        }
        loop {
            if s.generation != generation {
                return Ok(s);
            }
            if let Some(r) = s.left {
                return Err(self.left(what, r));
            }
            s = self
                .shared
                .turn
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn left(&self, what: &str, r: usize) -> EngineError {
        EngineError::Device {
            device: format!("rank {}", self.rank),
            detail: format!(
                "thread-group {what}: rank {r} left the group (its thread failed or ended \
                 early), so the collective cannot complete"
            ),
        }
    }

    /// Put `values` in this rank's slot, wait for every rank's, then let `f` read them all
    /// into `values`; returns once every rank has read.
    fn exchange(
        &self,
        what: &str,
        values: &mut [f32],
        f: impl FnOnce(&[Vec<f32>], &mut [f32]),
    ) -> Result<()> {
        let mut s = self.lock();
        if let Some(r) = s.left {
            return Err(self.left(what, r));
        }
        s.values[self.rank].clear();
        s.values[self.rank].extend_from_slice(values);
        let s = self.barrier(s, what)?;
        // Every rank sees the same lengths, so every rank takes the same branch.
        let lens: Vec<usize> = s.values.iter().map(Vec::len).collect();
        let read = if lens.iter().all(|&l| l == values.len()) {
            f(&s.values, values);
            Ok(())
        } else {
            Err(invalid(
                format!("thread-group {what} buffers"),
                format!("{} values on every rank", values.len()),
                format!("{lens:?} by rank"),
            ))
        };
        drop(self.barrier(s, what)?);
        read
    }

    /// The one buffer of this rank in `parts`.
    fn own<'p, 'a>(&self, what: &str, parts: &'p mut [RankSlice<'a>]) -> Result<&'p mut [f32]> {
        let ranks: Vec<usize> = parts.iter().map(|p| p.rank).collect();
        match parts {
            [p] if p.rank == self.rank => Ok(&mut *p.values),
            _ => Err(invalid(
                format!("thread-group {what}"),
                format!("one buffer, for rank {}", self.rank),
                format!("ranks {ranks:?}"),
            )),
        }
    }
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        let mut s = self.lock();
        s.left.get_or_insert(self.rank);
        self.shared.turn.notify_all();
    }
}

/// `out = Σ_r slots[r][range]`, added in rank order (as the host-staged collectives add).
fn sum_in_rank_order(slots: &[Vec<f32>], (a, b): (usize, usize), out: &mut [f32]) {
    for (r, v) in slots.iter().enumerate() {
        if r == 0 {
            out.copy_from_slice(&v[a..b]);
        } else {
            out.iter_mut().zip(&v[a..b]).for_each(|(o, x)| *o += x);
        }
    }
}

impl Collective for ThreadGroup {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn joins_other_ranks(&self) -> bool {
        true
    }

    fn all_reduce_sum(&self, parts: &mut [RankSlice<'_>]) -> Result<()> {
        let values = self.own("all-reduce", parts)?;
        let len = values.len();
        self.exchange("all-reduce", values, |all, v| {
            sum_in_rank_order(all, (0, len), v);
        })
    }

    fn broadcast_from(&self, root: usize, parts: &mut [RankSlice<'_>]) -> Result<()> {
        if root >= self.world {
            return Err(invalid(
                "broadcast root",
                format!("a rank below {}", self.world),
                root,
            ));
        }
        let values = self.own("broadcast", parts)?;
        self.exchange("broadcast", values, |all, v| v.copy_from_slice(&all[root]))
    }

    fn all_gather(&self, counts: &[usize], parts: &mut [RankSlice<'_>]) -> Result<()> {
        let blocks = blocks("all-gather", counts, self.world)?;
        let values = self.own("all-gather", parts)?;
        let total = blocks.last().map_or(0, |b| b.1);
        if values.len() != total {
            return Err(invalid(
                format!("all-gather buffer of rank {}", self.rank),
                format!("{total} values"),
                values.len(),
            ));
        }
        self.exchange("all-gather", values, |all, v| {
            for (r, &(a, b)) in blocks.iter().enumerate() {
                v[a..b].copy_from_slice(&all[r][a..b]);
            }
        })
    }

    fn reduce_scatter_sum(&self, counts: &[usize], parts: &mut [RankSlice<'_>]) -> Result<()> {
        let blocks = blocks("reduce-scatter", counts, self.world)?;
        let values = self.own("reduce-scatter", parts)?;
        let total = blocks.last().map_or(0, |b| b.1);
        if values.len() != total {
            return Err(invalid(
                format!("reduce-scatter buffer of rank {}", self.rank),
                format!("{total} values"),
                values.len(),
            ));
        }
        let (a, b) = blocks[self.rank];
        self.exchange("reduce-scatter", values, |all, v| {
            sum_in_rank_order(all, (a, b), &mut v[a..b]);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::tp::HostStaged;

    /// Run `f(member, device)` on one thread per rank; the results in rank order.
    fn on_threads<T: Send>(world: usize, f: impl Fn(ThreadGroup, &Device) -> T + Sync) -> Vec<T> {
        let members = ThreadGroup::new(world).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .map(|m| {
                    let f = &f;
                    s.spawn(move || {
                        let dev = Device::virtual_device(m.rank() as u32, 1 << 20);
                        f(m, &dev)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn slice<'a>(rank: usize, device: &'a Device, values: &'a mut [f32]) -> [RankSlice<'a>; 1] {
        [RankSlice {
            rank,
            device,
            values,
        }]
    }

    #[test]
    fn ranks_on_threads_agree_with_the_host_staged_collectives() {
        // The same inputs through the host-staged collectives (every rank in one call) and
        // through three threads, one rank each, must give the same bits.
        let input = |r: usize| -> Vec<f32> { (0..5).map(|i| (r * 10 + i) as f32 * 0.1).collect() };
        let counts = [2, 0, 3];
        let devs: Vec<Arc<Device>> = (0..3).map(|i| Device::virtual_device(i, 1 << 20)).collect();
        let host = |op: &dyn Fn(&mut [RankSlice<'_>])| -> Vec<Vec<f32>> {
            let mut bufs: Vec<Vec<f32>> = (0..3).map(input).collect();
            let mut parts: Vec<RankSlice<'_>> = bufs
                .iter_mut()
                .zip(&devs)
                .enumerate()
                .map(|(rank, (values, d))| RankSlice {
                    rank,
                    device: d,
                    values,
                })
                .collect();
            op(&mut parts);
            drop(parts);
            bufs
        };
        let want = [
            host(&|p| HostStaged.all_reduce_sum(p).unwrap()),
            host(&|p| HostStaged.broadcast_from(2, p).unwrap()),
            host(&|p| HostStaged.all_gather(&counts, p).unwrap()),
            host(&|p| HostStaged.reduce_scatter_sum(&counts, p).unwrap()),
        ];
        let got = on_threads(3, |m, dev| {
            let r = m.rank();
            let mut out = Vec::new();
            let mut v = input(r);
            m.all_reduce_sum(&mut slice(r, dev, &mut v)).unwrap();
            out.push(v);
            let mut v = input(r);
            m.broadcast_from(2, &mut slice(r, dev, &mut v)).unwrap();
            out.push(v);
            let mut v = input(r);
            m.all_gather(&counts, &mut slice(r, dev, &mut v)).unwrap();
            out.push(v);
            let mut v = input(r);
            m.reduce_scatter_sum(&counts, &mut slice(r, dev, &mut v))
                .unwrap();
            out.push(v);
            out
        });
        for (op, w) in want.iter().enumerate() {
            for (r, g) in got.iter().enumerate() {
                let (a, b): (Vec<u32>, Vec<u32>) = (
                    w[r].iter().map(|x| x.to_bits()).collect(),
                    g[op].iter().map(|x| x.to_bits()).collect(),
                );
                assert_eq!(a, b, "operation {op}, rank {r}");
            }
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
        let errors = on_threads(3, |m, dev| {
            if m.rank() == 1 {
                drop(m);
                return None;
            }
            let mut v = vec![1.0; 4];
            let r = m.rank();
            Some(
                m.all_reduce_sum(&mut slice(r, dev, &mut v))
                    .unwrap_err()
                    .to_string(),
            )
        });
        for e in errors.into_iter().flatten() {
            assert!(
                e.contains("rank 1 left the group") && e.contains("thread-group all-reduce"),
                "{e}"
            );
        }
    }

    #[test]
    fn mismatched_buffers_fail_on_every_rank() {
        let errors = on_threads(2, |m, dev| {
            let r = m.rank();
            let mut v = vec![1.0; 2 + r];
            m.all_reduce_sum(&mut slice(r, dev, &mut v))
                .unwrap_err()
                .to_string()
        });
        assert_eq!(
            errors,
            [2, 3].map(|n| format!(
                "thread-group all-reduce buffers: expected {n} values on every rank, got [2, 3] \
                 by rank"
            ))
        );
        let m = ThreadGroup::new(2).unwrap();
        let dev = Device::virtual_device(0, 1);
        let mut v = vec![0.0; 3];
        let e = m[0]
            .all_gather(&[1, 1], &mut slice(0, &dev, &mut v))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "all-gather buffer of rank 0: expected 2 values, got 3");
        let e = m[0]
            .all_gather(&[1, 1], &mut slice(1, &dev, &mut v))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "thread-group all-gather: expected one buffer, for rank 0, got ranks [1]"
        );
    }
}
