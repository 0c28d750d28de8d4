//! The offloaded cache's prefetch thread: one per cache, started on the first fetch and kept
//! for the cache's life, so a decode step creates no thread (it used to spawn one per layer
//! fetched, about 30 a token). At most one prefetch is in flight: each fetch waits for the
//! previous one before it lends a slot and asks for the next layer.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::Cache;
use crate::error::{EngineError, Result};

/// The worker's ends of its two channels, and whether a prefetch was asked for and not yet
/// waited for.
struct Worker {
    ask: Sender<usize>,
    done: Receiver<Result<()>>,
    pending: bool,
}

/// The prefetch thread of one cache (none until the first prefetch).
#[derive(Default)]
pub(super) struct Prefetcher {
    worker: Mutex<Option<Worker>>,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher")
            .field("pending", &self.pending())
            .finish()
    }
}

impl Prefetcher {
    fn lock(&self) -> MutexGuard<'_, Option<Worker>> {
        self.worker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Asks the thread (started now if there is none) to copy `layer` into a free slot of its
    /// device. The caller has waited for the previous prefetch.
    pub(super) fn start(&self, cache: &Arc<Cache>, layer: usize) -> Result<()> {
        let mut w = self.lock();
        if w.is_none() {
            *w = Some(spawn(Arc::downgrade(cache))?);
        }
        let Some(worker) = w.as_mut() else {
            return Ok(());
        };
        if worker.ask.send(layer).is_ok() {
            worker.pending = true;
        } else {
            // the thread is gone (it panicked): the next prefetch starts a new one
            *w = None;
        }
        Ok(())
    }

    /// Waits for the prefetch in flight, if any. A failed prefetch only costs the copy the
    /// fetch then makes; a thread that died is an error, and the next prefetch starts a new
    /// one.
    pub(super) fn wait(&self) -> Result<()> {
        let mut w = self.lock();
        let Some(worker) = w.as_mut().filter(|w| w.pending) else {
            return Ok(());
        };
        worker.pending = false;
        if worker.done.recv().is_err() {
            *w = None;
            return Err(EngineError::Device {
                device: "cpu".into(),
                detail: "the cache prefetch thread panicked".into(),
            });
        }
        Ok(())
    }

    /// Whether a prefetch was asked for and not yet waited for.
    pub(super) fn pending(&self) -> bool {
        self.lock().as_ref().is_some_and(|w| w.pending)
    }
}

/// The thread: it holds the cache weakly, so it never keeps a dropped cache alive, and ends
/// when the cache (its asking end) is dropped.
fn spawn(cache: Weak<Cache>) -> Result<Worker> {
    let (ask, asked) = channel::<usize>();
    let (tell, done) = channel();
    std::thread::Builder::new()
        .name("weightlift-kv-prefetch".into())
        .spawn(move || {
            while let Ok(layer) = asked.recv() {
                let Some(c) = cache.upgrade() else {
                    let _ = tell.send(Ok(()));
                    continue;
                };
                let r = c.prefetch_into_slot(layer);
                // Told before the cache is let go: if this was its last owner, its drop waits
                // for this answer on this thread.
                let _ = tell.send(r);
                drop(c);
            }
        })
        .map_err(|e| EngineError::Device {
            device: "cpu".into(),
            detail: format!("starting the cache prefetch thread: {e}"),
        })?;
    Ok(Worker {
        ask,
        done,
        pending: false,
    })
}
