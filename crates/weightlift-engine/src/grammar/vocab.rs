//! A vocabulary walked as a trie, and the [`Constraint`] that masks it with a grammar.

use std::collections::HashMap;
use std::sync::Arc;

use weightlift_text::Tokenizer;

use super::dfa::{DEAD, Dfa, StateId, UNKNOWN};
use super::{Grammar, GrammarError};

/// The tokens a grammar can match, sorted by their bytes, each with the length of the prefix it
/// shares with the token before it.
#[derive(Debug)]
struct Tokens {
    /// Every token's bytes, in sorted order, end to end.
    bytes: Vec<u8>,
    /// Where each sorted token's bytes end in `bytes` (they start where the previous end).
    ends: Vec<u32>,
    ids: Vec<u32>,
    /// Bytes shared with the previous sorted token.
    shared: Vec<u32>,
    /// Token id to its index in the sorted order, `u32::MAX` for a token the grammar can never
    /// take (end-of-generation, empty, led by NUL, or outside the tokenizer).
    slot: Vec<u32>,
    /// End-of-generation ids, allowed only where the grammar can end.
    eog: Vec<u32>,
    longest: usize,
}

impl Tokens {
    /// The tokens of `tokenizer` (ids below `n_vocab`, the logits' length) as llama.cpp's
    /// grammar sampler sees them: their bytes with special tokens as text.
    fn new(tokenizer: &Tokenizer, n_vocab: usize) -> Tokens {
        let mut pieces: Vec<(Vec<u8>, u32)> = Vec::with_capacity(n_vocab);
        let mut eog = Vec::new();
        for id in 0..n_vocab as u32 {
            if tokenizer.is_eog(id) {
                eog.push(id);
                continue;
            }
            match tokenizer.token_piece(id, true) {
                Ok(piece) if piece.first().is_some_and(|&b| b != 0) => pieces.push((piece, id)),
                // Empty, led by NUL, or an id the tokenizer does not have (a padded embedding):
                // never allowed.
                _ => {}
            }
        }
        pieces.sort_unstable();
        let mut tokens = Tokens {
            bytes: Vec::with_capacity(pieces.iter().map(|p| p.0.len()).sum()),
            ends: Vec::with_capacity(pieces.len()),
            ids: Vec::with_capacity(pieces.len()),
            shared: Vec::with_capacity(pieces.len()),
            slot: vec![u32::MAX; n_vocab],
            eog,
            longest: 0,
        };
        let mut prev: &[u8] = &[];
        for (i, (piece, id)) in pieces.iter().enumerate() {
            let shared = prev.iter().zip(piece).take_while(|(a, b)| a == b).count();
            tokens.bytes.extend_from_slice(piece);
            tokens.ends.push(tokens.bytes.len() as u32);
            tokens.ids.push(*id);
            tokens.shared.push(shared as u32);
            tokens.slot[*id as usize] = i as u32;
            tokens.longest = tokens.longest.max(piece.len());
            prev = piece;
        }
        tokens
    }

    fn piece(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.bytes[start..self.ends[i] as usize]
    }
}

/// One generation's walk through a grammar: which tokens may come next
/// ([`Constraint::mask`]), and the grammar's state after each token ([`Constraint::accept`]).
#[derive(Debug)]
pub struct Constraint {
    pub(super) dfa: Dfa,
    pub(super) state: StateId,
    tokens: Tokens,
    /// The automaton state after each depth of the current trie path.
    path: Vec<StateId>,
    /// Which tokens each recently seen state allows, a bit per token id: a state that comes
    /// back (inside a JSON string, under `.*`) is masked without walking the vocabulary.
    masks: HashMap<StateId, Vec<u64>>,
    /// Grammar positions with bounded repetition counts capped past the longest token, when
    /// the grammar has such long repetitions: inside `[^"]{1,200}` the states after 10 and
    /// after 11 characters then share their mask.
    pub(super) capped: Option<Vec<u32>>,
}

/// States whose masks are kept (6 KiB each for a 49k vocabulary).
const KEPT_MASKS: usize = 32;

impl Constraint {
    /// A constraint for `grammar` over the first `n_vocab` ids of `tokenizer` (the logits'
    /// length; ids past the tokenizer are never allowed).
    pub fn new(
        grammar: Arc<Grammar>,
        tokenizer: &Tokenizer,
        n_vocab: usize,
    ) -> Result<Constraint, GrammarError> {
        let tokens = Tokens::new(tokenizer, n_vocab);
        // A token has at most as many characters as bytes.
        let capped = grammar.capped_positions(tokens.longest + 1);
        let (dfa, state) = Dfa::new(grammar)?;
        let path = vec![DEAD; tokens.longest + 1];
        Ok(Constraint {
            dfa,
            state,
            tokens,
            path,
            masks: HashMap::new(),
            capped,
        })
    }

    /// Whether the grammar is complete here, so that an end-of-generation token may come.
    pub fn can_end(&self) -> bool {
        self.dfa.can_end(self.state)
    }

    /// Sets the logit of every token that cannot come next to −inf, as llama.cpp's grammar
    /// sampler does; returns how many tokens may. Fails when none may.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<usize, GrammarError> {
        if self.dfa.oversized() {
            let (dfa, state) = self.dfa.rebuilt(self.state)?;
            self.dfa = dfa;
            self.state = state;
            // State ids changed.
            self.masks.clear();
        }
        let key = match &self.capped {
            Some(map) => self.dfa.capped(self.state, map)?,
            None => self.state,
        };
        if !self.masks.contains_key(&key) {
            if self.masks.len() >= KEPT_MASKS {
                self.masks.clear();
            }
            let bits = self.walk(key)?;
            self.masks.insert(key, bits);
        }
        let t = &self.tokens;
        let bits = &self.masks[&key];
        let mut allowed = 0;
        for (w, &word) in bits.iter().enumerate() {
            allowed += word.count_ones() as usize;
            if word == u64::MAX {
                continue;
            }
            let base = w * 64;
            let end = (base + 64).min(t.slot.len());
            for id in base..end {
                if word & (1 << (id - base)) == 0 {
                    set_neg_inf(logits, id);
                }
            }
        }
        // Tokens past the vocabulary the table was built for.
        if let Some(extra) = logits.get_mut(t.slot.len()..) {
            extra.fill(f32::NEG_INFINITY);
        }
        if allowed == 0 {
            return Err(GrammarError::NoContinuation {
                vocab: t.slot.len(),
            });
        }
        Ok(allowed)
    }

    /// The tokens state `from` allows, a bit per id: one pass over the sorted vocabulary,
    /// stepping each prefix once, and the end-of-generation ids where the grammar can end.
    fn walk(&mut self, from: StateId) -> Result<Vec<u64>, GrammarError> {
        let t = &self.tokens;
        let mut bits = vec![0u64; t.slot.len().div_ceil(64)];
        self.path[0] = from;
        // The shortest depth at which the current path died; tokens sharing at least that much
        // of it die with it.
        let mut dead_at = usize::MAX;
        for i in 0..t.ids.len() {
            let shared = t.shared[i] as usize;
            if dead_at <= shared {
                continue;
            }
            dead_at = usize::MAX;
            let piece = t.piece(i);
            let mut s = self.path[shared];
            for (d, &b) in piece.iter().enumerate().skip(shared) {
                s = match self.dfa.cached(s, b) {
                    UNKNOWN => self.dfa.step_uncached(s, b)?,
                    next => next,
                };
                if s == DEAD {
                    dead_at = d + 1;
                    break;
                }
                self.path[d + 1] = s;
            }
            if s != DEAD {
                let id = t.ids[i] as usize;
                bits[id / 64] |= 1 << (id % 64);
            }
        }
        if self.dfa.can_end(from) {
            for &id in &t.eog {
                bits[id as usize / 64] |= 1 << (id % 64);
            }
        }
        Ok(bits)
    }

    /// Advances the grammar by `token`'s text; an end-of-generation token leaves it as it is (it
    /// is only allowed where the grammar can end). Fails for a token [`Constraint::mask`] would
    /// have forbidden.
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        let t = &self.tokens;
        if t.eog.binary_search(&token).is_ok() {
            return if self.can_end() {
                Ok(())
            } else {
                Err(GrammarError::Rejected { token })
            };
        }
        let slot = t.slot.get(token as usize).copied().unwrap_or(u32::MAX);
        if slot == u32::MAX {
            return Err(GrammarError::Rejected { token });
        }
        let mut s = self.state;
        let start = if slot == 0 {
            0
        } else {
            t.ends[slot as usize - 1]
        };
        for i in start..t.ends[slot as usize] {
            s = self.dfa.step(s, self.tokens.bytes[i as usize])?;
            if s == DEAD {
                return Err(GrammarError::Rejected { token });
            }
        }
        self.state = s;
        Ok(())
    }
}

fn set_neg_inf(logits: &mut [f32], id: usize) {
    if let Some(l) = logits.get_mut(id) {
        *l = f32::NEG_INFINITY;
    }
}
