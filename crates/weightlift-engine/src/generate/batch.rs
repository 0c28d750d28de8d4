//! Several generations on one model at once (continuous batching), each in a slot: a cache of
//! its own, kept between requests so that a prompt sharing a prefix with the slot's last one
//! runs only the rest. A prompt whose prefix another slot holds (a free one, or one whose
//! generation is running) gets that slot's rows of it copied into its own
//! ([`Cache::copy_prefix_from`]) and runs only the rest too, so the same system prompt is
//! prefilled once per batch. Copied rows are the rows prefilling would write: the donor
//! computed them from the same ids at the same positions under the same settings, and only
//! rows computed under the model's current [`KvSettings`] are shared. Either way the reused
//! tokens are the generation's `reused_tokens` (llama.cpp's server's `cache_n`).
//!
//! A [`Batch`] takes new generations between steps and drops finished ones; every
//! [`Batch::step`] is one [`step_batch`] over the running generations, so a sequence's tokens
//! are those it gets alone. Each step returns what every generation has to say as [`Event`]s,
//! already in its response shape (llama-cpp-python's chunks, or the whole response at the
//! end), which is what a server hands to its clients.

use std::sync::Arc;

use super::respond::{Kind, Responder, ResponseOptions};
use super::{GenerateOptions, Generation, Piece, Timings, step_batch};
use crate::cache::Cache;
use crate::error::{EngineError, Result, invalid};
use crate::forward::KvSettings;
use crate::generate::openai::{Response, Usage};
use crate::model::Model;

/// What a generation of a batch said during one step.
#[derive(Debug)]
pub enum Event {
    /// A piece of text (a generation with no response shape).
    Text(String),
    /// A chunk of a streamed response.
    Chunk(Response),
    /// The whole response of a generation that is not streamed; it has ended.
    Whole(Response, Timings),
    /// The generation has ended (after its last chunk or piece): its token counts, as a whole
    /// response's `usage`, and its timings.
    End(Usage, Timings),
    /// The generation failed and has ended; its slot is free again.
    Failed(EngineError),
}

/// How a generation of a batch answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Text pieces, as they come.
    Text,
    /// Response chunks of this kind, as they come.
    Stream(Kind, ResponseOptions),
    /// One response of this kind at the end.
    Whole(Kind, ResponseOptions),
}

struct Job {
    id: u64,
    slot: usize,
    generation: Generation,
    responder: Option<Responder>,
    stream: bool,
    text: String,
}

/// Slots of one model and the generations running in them.
pub struct Batch {
    slots: Vec<Arc<Cache>>,
    /// When each slot was last taken (a step count): among slots holding no useful prefix, the
    /// one unused longest goes first, so every slot's prefix gets its chance to be reused.
    taken: Vec<u64>,
    clock: u64,
    jobs: Vec<Job>,
    next_id: u64,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("slots", &self.slots.len())
            .field("running", &self.jobs.len())
            .finish_non_exhaustive()
    }
}

impl Batch {
    /// `parallel` slots of the model's context length: the model's own cache, the sequences
    /// its plan counted beside it ([`Model::planned_sequences`]), and as many more as that
    /// leaves short, made like it ([`Model::sequence_cache`]).
    pub fn new(model: &Model, parallel: usize) -> Result<Batch> {
        if parallel == 0 {
            return Err(invalid(
                "parallel",
                "at least 1 sequence at a time",
                "0".to_owned(),
            ));
        }
        let own = model.own_cache()?;
        let n_ctx = own.config().max_seq_len;
        let mut slots = vec![own];
        slots.extend(model.planned_sequences().into_iter().take(parallel - 1));
        while slots.len() < parallel {
            slots.push(model.sequence_cache(n_ctx)?);
        }
        Ok(Batch {
            taken: vec![0; slots.len()],
            slots,
            clock: 0,
            jobs: Vec::new(),
            next_id: 0,
        })
    }

    /// Slots in all.
    pub fn parallel(&self) -> usize {
        self.slots.len()
    }

    /// Generations running.
    pub fn running(&self) -> usize {
        self.jobs.len()
    }

    /// Positions of each slot.
    pub fn n_ctx(&self) -> u64 {
        self.slots[0].config().max_seq_len
    }

    /// Start a generation of `prompt` in the free slot holding the longest prefix of it, after
    /// copying in a longer prefix another slot holds ([`Batch::share_prefix`]); it runs from the
    /// next [`Batch::step`]. Returns its id. Fails, starting nothing, when every slot is busy or
    /// the prompt does not fit a slot.
    pub fn start(
        &mut self,
        model: &Model,
        prompt: &[u32],
        options: GenerateOptions,
        answer: Answer,
    ) -> Result<u64> {
        let under = model.kv_settings();
        let slot = self.free_slot(prompt, under).ok_or_else(|| {
            invalid(
                "a batch slot",
                format!("a free one of the {}", self.slots.len()),
                "every slot busy; wait for a generation to end".to_owned(),
            )
        })?;
        self.share_prefix(slot, prompt, &options, under);
        let generation = Generation::in_slot(model, prompt, &self.slots[slot], options)?;
        let (responder, stream) = match answer {
            Answer::Text => (None, true),
            Answer::Stream(kind, o) => (Some(Responder::new(kind, &generation, o)), true),
            Answer::Whole(kind, o) => (Some(Responder::new(kind, &generation, o)), false),
        };
        self.clock += 1;
        self.taken[slot] = self.clock;
        let id = self.next_id;
        self.next_id += 1;
        self.jobs.push(Job {
            id,
            slot,
            generation,
            responder,
            stream,
            text: String::new(),
        });
        Ok(id)
    }

    /// The free slot whose cache holds the longest prefix of `prompt`; on a tie the one
    /// unused longest. Only rows computed `under` the current settings count as held.
    fn free_slot(&self, prompt: &[u32], under: KvSettings) -> Option<usize> {
        (0..self.slots.len())
            .filter(|&i| self.jobs.iter().all(|j| j.slot != i))
            .max_by_key(|&i| {
                let held = self.slots[i].common_prefix_under(prompt, under);
                (held, std::cmp::Reverse(self.taken[i]))
            })
    }

    /// Copy into `slot` the longest prefix of `prompt` another slot holds, free or running (the
    /// batch steps on this thread, and a running generation's rows below its length stay as
    /// they are), when it is longer than what `slot` holds. As [`Generation::in_slot`] reuses,
    /// the prefix leaves at least the prompt's last token to run, and a prompt that is scored
    /// reuses nothing. A copy that cannot be made is no error of the request: refused (caches
    /// split by heads unlike each other) it leaves the slot as it was, failed part way it
    /// leaves it empty, and the prompt runs as it would without the copy.
    fn share_prefix(
        &self,
        slot: usize,
        prompt: &[u32],
        options: &GenerateOptions,
        under: KvSettings,
    ) {
        let cache = &self.slots[slot];
        let Some((_, head)) = prompt.split_last() else {
            return;
        };
        if options.scores_prompt() || prompt.len() as u64 > cache.config().max_seq_len {
            return;
        }
        let own = cache.common_prefix_under(head, under);
        let donor = (0..self.slots.len())
            .filter(|&i| i != slot)
            .map(|i| (self.slots[i].common_prefix_under(head, under), i))
            .max();
        if let Some((n, i)) = donor.filter(|&(n, _)| n > own) {
            // the request runs either way (see above); only its prefill is longer
            let _ = cache.copy_prefix_from(&self.slots[i], n);
        }
    }

    /// End generation `id` now (its client left); its slot is free for the next start. False
    /// when no such generation runs.
    pub fn cancel(&mut self, id: u64) -> bool {
        match self.jobs.iter().position(|j| j.id == id) {
            Some(i) => {
                self.jobs.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// One step of every running generation, their forward calls as one. Returns each one's
    /// events in order; a generation that ends (or fails) leaves the batch and frees its slot.
    /// When the shared forward call fails (a device out of memory), every running generation
    /// ends and the error is returned; the slots stay usable.
    pub fn step(&mut self, model: &mut Model) -> Result<Vec<(u64, Event)>> {
        let mut events = Vec::new();
        for job in &mut self.jobs {
            job.opening(&mut events);
        }
        let pieces = {
            let mut gens: Vec<&mut Generation> =
                self.jobs.iter_mut().map(|j| &mut j.generation).collect();
            step_batch(model, &mut gens)
        };
        let pieces = match pieces {
            Ok(p) => p,
            Err(e) => {
                self.jobs.clear();
                return Err(e);
            }
        };
        let mut ended = Vec::new();
        for (i, (job, piece)) in self.jobs.iter_mut().zip(pieces).enumerate() {
            if job.answer(piece, &mut events) {
                ended.push(i);
            }
        }
        for i in ended.into_iter().rev() {
            self.jobs.swap_remove(i);
        }
        Ok(events)
    }
}

impl Job {
    /// A stream's opening chunk (the chat role, an echoed prompt), before its first step.
    fn opening(&mut self, events: &mut Vec<(u64, Event)>) {
        if let (true, Some(r)) = (self.stream, self.responder.as_mut())
            && let Some(chunk) = r.ready()
        {
            events.push((self.id, Event::Chunk(chunk)));
        }
    }

    /// This step's events for `piece`; true when the generation has ended.
    fn answer(&mut self, piece: Result<Option<Piece>>, events: &mut Vec<(u64, Event)>) -> bool {
        let id = self.id;
        let piece = match piece {
            Ok(Some(p)) => p,
            Ok(None) => {
                events.push((id, self.end()));
                return true;
            }
            Err(e) => {
                events.push((id, Event::Failed(e)));
                return true;
            }
        };
        let said = match (&mut self.responder, self.stream) {
            (None, _) => {
                if !piece.text.is_empty() {
                    events.push((id, Event::Text(piece.text.clone())));
                }
                Ok(())
            }
            (Some(_), false) => {
                self.text.push_str(&piece.text);
                Ok(())
            }
            (Some(r), true) => r.chunk(&self.generation, &piece).map(|chunk| {
                events.extend(chunk.map(|c| (id, Event::Chunk(c))));
                // a finish reason may leave a closing chunk of its own
                events.extend(r.ready().map(|c| (id, Event::Chunk(c))));
            }),
        };
        if let Err(e) = said {
            events.push((id, Event::Failed(e)));
            return true;
        }
        if piece.finish.is_some() {
            events.push((id, self.end()));
            return true;
        }
        false
    }

    /// The closing event of a generation that has ended.
    fn end(&self) -> Event {
        let timings = self.generation.timings();
        match (&self.responder, self.stream) {
            (Some(r), false) => match r.whole(&self.generation, &self.text) {
                Ok(whole) => Event::Whole(whole, timings),
                Err(e) => Event::Failed(e),
            },
            _ => Event::End(
                Usage::new(
                    self.generation.prompt_tokens(),
                    self.generation.tokens().len() as u64,
                ),
                timings,
            ),
        }
    }
}

/// `n` generations of `options` (transformers' `num_return_sequences`): their seeds are
/// `seed`, `seed + 1`, ..., so each samples its own text and a seeded call repeats; without a
/// seed each draws its own.
pub fn seeded(options: &GenerateOptions, n: usize) -> Vec<GenerateOptions> {
    (0..n as u64)
        .map(|i| {
            let mut o = options.clone();
            o.sampling.seed = o.sampling.seed.map(|s| s.wrapping_add(i));
            o
        })
        .collect()
}

/// Generate from `prompt` once per entry of `each` (transformers' `num_return_sequences`), all
/// at once in a [`Batch`] of that many slots, and return their texts in order. The model's own
/// cache is made (or grown) first for the prompt and the longest generation, as
/// [`Generation::start`] makes it; the other slots are made like it.
pub fn generate_each(
    model: &mut Model,
    prompt: &[u32],
    each: Vec<GenerateOptions>,
) -> Result<Vec<String>> {
    let asked = each
        .iter()
        .map(|o| o.max_tokens.unwrap_or(weightlift_plan::SEQ_STEP))
        .max()
        .unwrap_or(0);
    model.own_cache_for((prompt.len() as u64).saturating_add(asked))?;
    let mut batch = Batch::new(model, each.len())?;
    let ids = each
        .into_iter()
        .map(|o| batch.start(model, prompt, o, Answer::Text))
        .collect::<Result<Vec<u64>>>()?;
    let mut texts = vec![String::new(); ids.len()];
    while batch.running() > 0 {
        for (id, event) in batch.step(model)? {
            match event {
                Event::Text(t) => {
                    if let Some(i) = ids.iter().position(|&j| j == id) {
                        texts[i].push_str(&t);
                    }
                }
                Event::Failed(e) => return Err(e),
                _ => {}
            }
        }
    }
    Ok(texts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_take_consecutive_seeds_and_unseeded_ones_stay_unseeded() {
        let mut o = GenerateOptions::default();
        o.sampling.seed = Some(u64::MAX);
        let seeds: Vec<_> = seeded(&o, 3).iter().map(|o| o.sampling.seed).collect();
        assert_eq!(seeds, [Some(u64::MAX), Some(0), Some(1)]);
        o.sampling.seed = None;
        let each = seeded(&o, 2);
        assert_eq!(each.len(), 2);
        assert!(each.iter().all(|o| o.sampling.seed.is_none()));
    }
}
