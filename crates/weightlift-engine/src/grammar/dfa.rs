//! The grammar as a lazily built byte automaton.
//!
//! A parse stack lists, innermost last, where matching goes on in each rule entered; its top is
//! always a character class (or it is empty: the grammar is complete). A grammar state is the
//! set of stacks still alive, and an automaton state is a grammar state plus the bytes of a
//! UTF-8 character seen only in part. Stacks are interned as linked lists sharing their tails,
//! sets as sorted lists of stack ids, and automaton states by (set, partial character); each
//! state's transitions on the 256 byte values are computed when first taken and then cached.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::{Elem, Grammar, GrammarError};

/// An automaton state id. [`DEAD`] is the state no input leaves.
pub(super) type StateId = u32;
pub(super) const DEAD: StateId = 0;
pub(super) const UNKNOWN: StateId = StateId::MAX;

/// The empty stack's id.
const EMPTY: u32 = 0;

/// Stacks alive at once: past this a grammar is too ambiguous to match in reasonable time.
pub(super) const MAX_STACKS: usize = 1 << 14;
/// Beyond these the caches are dropped and rebuilt from the current state, between tokens.
const MAX_INTERNED_STACKS: usize = 1 << 20;
const MAX_STATES: usize = 1 << 14;
/// States one token's mask may create (each holds a 1 KiB transition table): past it the grammar
/// is refused as too large to match.
pub(super) const HARD_MAX_STATES: usize = 1 << 16;

/// A UTF-8 character seen in part: the bits so far, how many continuation bytes are still to
/// come, and the character's whole length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
struct Partial {
    value: u32,
    remain: u8,
    len: u8,
}

#[derive(Debug, Clone, Copy)]
struct State {
    set: u32,
    partial: Partial,
}

/// The automaton and its caches.
#[derive(Debug)]
pub(super) struct Dfa {
    grammar: Arc<Grammar>,
    /// Stack id to (position in `grammar.elems` of its top, id of the rest); 0 is the empty
    /// stack.
    stacks: Vec<(u32, u32)>,
    stack_ids: HashMap<(u32, u32), u32>,
    sets: Vec<Box<[u32]>>,
    set_ids: HashMap<Box<[u32]>, u32>,
    /// The set no stack is in.
    empty_set: u32,
    /// Each state with its repetition counts capped (see [`Dfa::capped`]).
    capped_of: HashMap<StateId, StateId>,
    /// (set, which of its first 64 stacks take a character) to the set after that character.
    by_taken: HashMap<(u32, u64), u32>,
    states: Vec<State>,
    state_ids: HashMap<(u32, Partial), StateId>,
    /// Each state's transitions on the 256 byte values, state `s` at `s·256`, [`UNKNOWN`] where
    /// not yet computed: one load per cached step.
    trans: Vec<StateId>,
    /// Scratch for expanding stacks.
    todo: Vec<u32>,
    seen: HashSet<u32>,
}

impl Dfa {
    /// The automaton of `grammar` and its start state (every alternative of `root`).
    pub(super) fn new(grammar: Arc<Grammar>) -> Result<(Dfa, StateId), GrammarError> {
        let mut dfa = Dfa {
            grammar,
            stacks: vec![(u32::MAX, u32::MAX)],
            stack_ids: HashMap::new(),
            sets: Vec::new(),
            set_ids: HashMap::new(),
            empty_set: 0,
            capped_of: HashMap::new(),
            by_taken: HashMap::new(),
            states: Vec::new(),
            state_ids: HashMap::new(),
            trans: Vec::new(),
            todo: Vec::new(),
            seen: HashSet::new(),
        };
        // State 0 is DEAD: the empty set.
        dfa.empty_set = dfa.intern_set(Vec::new());
        dfa.intern_state(dfa.empty_set, Partial::default())?;
        let root = dfa.grammar.root;
        let mut start = Vec::new();
        dfa.expand_ref(root, EMPTY, &mut start);
        let set = dfa.finish_set(start)?;
        let s = dfa.intern_state(set, Partial::default())?;
        Ok((dfa, s))
    }

    /// Whether the grammar can end in state `s` (some stack is empty).
    pub(super) fn can_end(&self, s: StateId) -> bool {
        let st = self.states[s as usize];
        self.sets[st.set as usize].first() == Some(&EMPTY)
    }

    /// The state after byte `b` from state `s`; [`DEAD`] when no stack can take it.
    #[inline]
    pub(super) fn step(&mut self, s: StateId, b: u8) -> Result<StateId, GrammarError> {
        match self.cached(s, b) {
            UNKNOWN => self.step_uncached(s, b),
            next => Ok(next),
        }
    }

    /// The cached transition from `s` on `b`, or [`UNKNOWN`].
    #[inline(always)]
    pub(super) fn cached(&self, s: StateId, b: u8) -> StateId {
        self.trans[(s as usize) << 8 | b as usize]
    }

    /// Computes a transition and caches it.
    #[cold]
    #[inline(never)]
    pub(super) fn step_uncached(&mut self, s: StateId, b: u8) -> Result<StateId, GrammarError> {
        let next = self.compute(s, b)?;
        self.trans[(s as usize) << 8 | b as usize] = next;
        Ok(next)
    }

    /// State `s` with every stack position mapped through `map` (see the grammar's
    /// `capped_positions`): a state that stands for `s` when masking tokens.
    pub(super) fn capped(&mut self, s: StateId, map: &[u32]) -> Result<StateId, GrammarError> {
        if let Some(&c) = self.capped_of.get(&s) {
            return Ok(c);
        }
        let st = self.states[s as usize];
        let stacks = self.sets[st.set as usize].clone();
        let mut mapped = Vec::with_capacity(stacks.len());
        let mut tops = Vec::new();
        for &id in stacks.iter() {
            tops.clear();
            let mut cur = id;
            while cur != EMPTY {
                let (pos, rest) = self.stacks[cur as usize];
                tops.push(map[pos as usize]);
                cur = rest;
            }
            let mut new = EMPTY;
            for &pos in tops.iter().rev() {
                new = self.push(pos, new);
            }
            mapped.push(new);
        }
        let set = self.finish_set(mapped)?;
        let c = self.intern_state(set, st.partial)?;
        self.capped_of.insert(s, c);
        Ok(c)
    }

    /// Whether the caches have grown past their bounds (see [`Dfa::rebuilt`]).
    pub(super) fn oversized(&self) -> bool {
        self.stacks.len() > MAX_INTERNED_STACKS
            || self.states.len() > MAX_STATES
            || self.by_taken.len() > MAX_STATES
    }

    /// A fresh automaton holding only state `s`, and `s`'s id in it.
    pub(super) fn rebuilt(&self, s: StateId) -> Result<(Dfa, StateId), GrammarError> {
        let (mut fresh, _) = Dfa::new(Arc::clone(&self.grammar))?;
        let st = self.states[s as usize];
        let mut stacks = Vec::new();
        for &id in self.sets[st.set as usize].iter() {
            // Re-intern the stack from its bottom up.
            let mut tops = Vec::new();
            let mut cur = id;
            while cur != EMPTY {
                let (pos, rest) = self.stacks[cur as usize];
                tops.push(pos);
                cur = rest;
            }
            let mut new = EMPTY;
            for &pos in tops.iter().rev() {
                new = fresh.push(pos, new);
            }
            stacks.push(new);
        }
        let set = fresh.finish_set(stacks)?;
        let id = fresh.intern_state(set, st.partial)?;
        Ok((fresh, id))
    }

    fn push(&mut self, pos: u32, rest: u32) -> u32 {
        let next = self.stacks.len() as u32;
        let id = *self.stack_ids.entry((pos, rest)).or_insert(next);
        if id == next {
            self.stacks.push((pos, rest));
        }
        id
    }

    fn intern_set(&mut self, stacks: Vec<u32>) -> u32 {
        let key = stacks.into_boxed_slice();
        if let Some(&id) = self.set_ids.get(&key) {
            return id;
        }
        let id = self.sets.len() as u32;
        self.sets.push(key.clone());
        self.set_ids.insert(key, id);
        id
    }

    fn intern_state(&mut self, set: u32, partial: Partial) -> Result<StateId, GrammarError> {
        if let Some(&id) = self.state_ids.get(&(set, partial)) {
            return Ok(id);
        }
        if self.states.len() >= HARD_MAX_STATES {
            return Err(GrammarError::TooManyStates {
                limit: HARD_MAX_STATES,
            });
        }
        let id = self.states.len() as StateId;
        self.state_ids.insert((set, partial), id);
        self.states.push(State { set, partial });
        // DEAD (state 0) only ever leads to itself.
        let fill = if id == DEAD { DEAD } else { UNKNOWN };
        self.trans.resize(self.trans.len() + 256, fill);
        Ok(id)
    }

    fn finish_set(&mut self, mut stacks: Vec<u32>) -> Result<u32, GrammarError> {
        stacks.sort_unstable();
        stacks.dedup();
        if stacks.len() > MAX_STACKS {
            return Err(GrammarError::TooAmbiguous {
                limit: MAX_STACKS,
                got: stacks.len(),
            });
        }
        Ok(self.intern_set(stacks))
    }

    /// The stack `rest` with the element after `pos` on top, or `rest` when `pos` ends its
    /// alternative.
    fn after(&mut self, pos: u32, rest: u32) -> u32 {
        match self.grammar.elems[pos as usize + 1] {
            Elem::End => rest,
            _ => self.push(pos + 1, rest),
        }
    }

    /// Pushes the stacks that expanding a reference to `rule` over `rest` leads to, each with a
    /// character class on top or empty, onto `out`.
    fn expand_ref(&mut self, rule: u32, rest: u32, out: &mut Vec<u32>) {
        self.todo.clear();
        self.seen.clear();
        self.push_alternatives(rule, rest);
        self.drain(out);
    }

    fn push_alternatives(&mut self, rule: u32, rest: u32) {
        let grammar = Arc::clone(&self.grammar);
        for &alt in &grammar.rules[rule as usize] {
            let s = match grammar.elems[alt as usize] {
                Elem::End => rest,
                _ => self.push(alt, rest),
            };
            self.todo.push(s);
        }
    }

    /// Expands every stack in `todo` until its top is a class (or it is empty); left recursion
    /// was refused when the grammar was parsed, so this ends.
    fn drain(&mut self, out: &mut Vec<u32>) {
        while let Some(s) = self.todo.pop() {
            if !self.seen.insert(s) {
                continue;
            }
            if s == EMPTY {
                out.push(EMPTY);
                continue;
            }
            let (pos, rest) = self.stacks[s as usize];
            match self.grammar.elems[pos as usize] {
                Elem::Class(_) => out.push(s),
                Elem::Ref(rule) => {
                    let base = self.after(pos, rest);
                    self.push_alternatives(rule, base);
                }
                Elem::End => unreachable!("a stack's top is never the end of an alternative"),
            }
        }
    }

    /// The set after character `c` from `set`.
    fn advance(&mut self, set: u32, c: u32) -> Result<u32, GrammarError> {
        let stacks = &self.sets[set as usize];
        // Which stacks take `c`, as a bit per stack: characters the same stacks take lead to the
        // same set, so a set is advanced once per such group (most classes are wide).
        let mut taken = 0u64;
        let mut memo = stacks.len() <= 64;
        for (i, &s) in stacks.iter().enumerate() {
            if self.takes(s, c) {
                if i < 64 {
                    taken |= 1 << i;
                } else {
                    memo = false;
                }
            }
        }
        if memo {
            if taken == 0 {
                return Ok(self.empty_set);
            }
            if let Some(&next) = self.by_taken.get(&(set, taken)) {
                return Ok(next);
            }
        }
        self.todo.clear();
        self.seen.clear();
        let stacks = self.sets[set as usize].clone();
        for &s in stacks.iter() {
            if self.takes(s, c) {
                let (pos, rest) = self.stacks[s as usize];
                let next = self.after(pos, rest);
                self.todo.push(next);
            }
        }
        let mut out = Vec::new();
        self.drain(&mut out);
        let next = self.finish_set(out)?;
        if memo {
            self.by_taken.insert((set, taken), next);
        }
        Ok(next)
    }

    /// Whether stack `s` takes character `c` (its top class holds it).
    fn takes(&self, s: u32, c: u32) -> bool {
        if s == EMPTY {
            return false;
        }
        let (pos, _) = self.stacks[s as usize];
        match self.grammar.elems[pos as usize] {
            Elem::Class(class) => self.grammar.classes[class as usize].contains(c),
            _ => false,
        }
    }

    /// Whether some character starting with `partial` could be taken by a stack of `set`.
    fn partial_ok(&self, set: u32, partial: Partial) -> bool {
        let shift = 6 * u32::from(partial.remain);
        let lo = partial.value << shift;
        let hi = lo | ((1 << shift) - 1);
        // The lowest and highest characters of this length (no overlong forms), without the
        // surrogates' gap, which no class here tells apart from its neighbours.
        let (min, max) = match partial.len {
            2 => (0x80, 0x7FF),
            3 => (0x800, 0xFFFF),
            _ => (0x1_0000, 0x10_FFFF),
        };
        let (lo, hi) = (lo.max(min), hi.min(max));
        if lo > hi {
            return false;
        }
        self.sets[set as usize].iter().any(|&s| {
            if s == EMPTY {
                return false;
            }
            let (pos, _) = self.stacks[s as usize];
            match self.grammar.elems[pos as usize] {
                Elem::Class(class) => self.grammar.classes[class as usize].intersects(lo, hi),
                _ => false,
            }
        })
    }

    fn compute(&mut self, s: StateId, b: u8) -> Result<StateId, GrammarError> {
        let State { set, partial } = self.states[s as usize];
        if s == DEAD {
            return Ok(DEAD);
        }
        let c = if partial.remain == 0 {
            let (value, len) = match b {
                // NUL never continues a grammar: llama.cpp reads it as the end of the text.
                0 => return Ok(DEAD),
                0x01..=0x7F => (u32::from(b), 1),
                0xC2..=0xDF => (u32::from(b & 0x1F), 2),
                0xE0..=0xEF => (u32::from(b & 0x0F), 3),
                0xF0..=0xF4 => (u32::from(b & 0x07), 4),
                // A continuation byte with nothing to continue, or never valid UTF-8.
                _ => return Ok(DEAD),
            };
            if len == 1 {
                value
            } else {
                return self.partial_state(
                    set,
                    Partial {
                        value,
                        remain: len - 1,
                        len,
                    },
                );
            }
        } else {
            if b & 0xC0 != 0x80 {
                return Ok(DEAD);
            }
            let next = Partial {
                value: (partial.value << 6) | u32::from(b & 0x3F),
                remain: partial.remain - 1,
                len: partial.len,
            };
            if next.remain > 0 {
                return self.partial_state(set, next);
            }
            let c = next.value;
            let min = match partial.len {
                2 => 0x80,
                3 => 0x800,
                _ => 0x1_0000,
            };
            if c < min || c > 0x10_FFFF || (0xD800..=0xDFFF).contains(&c) {
                return Ok(DEAD);
            }
            c
        };
        let next = self.advance(set, c)?;
        if self.sets[next as usize].is_empty() {
            return Ok(DEAD);
        }
        self.intern_state(next, Partial::default())
    }

    fn partial_state(&mut self, set: u32, partial: Partial) -> Result<StateId, GrammarError> {
        if self.partial_ok(set, partial) {
            self.intern_state(set, partial)
        } else {
            Ok(DEAD)
        }
    }
}
