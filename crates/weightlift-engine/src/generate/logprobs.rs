//! Log-probabilities of generated (and prompt) tokens, as llama-cpp-python reports them with
//! `logprobs=N`: the log-softmax of the model's raw logits (before temperature, penalties or
//! truncation touch them), the chosen token's value, and the N most likely tokens.
//!
//! llama-cpp-python computes these in f32 with numpy over the whole row and sorts the whole
//! vocabulary for the top N. Here the normaliser is a max-shifted log-sum-exp with f64
//! accumulation, and the top N come from one pass with a bounded heap, so asking for log
//! probabilities costs one extra read of the row per token.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// The normaliser of one row of logits: `logprob(x) = x - log(sum(exp(row)))`.
///
/// Non-finite logits have a defined meaning rather than poisoning the row: `-inf` is a token
/// that cannot occur (log-probability `-inf`), `NaN` is a token with no value (its own
/// log-probability is `NaN`, and it is left out of the sum), and `+inf` tokens, if any, share
/// all the probability equally. A row with no finite or `+inf` logit has no distribution: every
/// log-probability is `NaN`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogSoftmax {
    /// The largest finite logit (the shift that keeps `exp` in range).
    max: f32,
    /// `log(sum(exp(x - max)))` over the finite logits.
    log_sum: f64,
    /// How many logits are `+inf`.
    pos_inf: u64,
}

impl LogSoftmax {
    pub fn new(logits: &[f32]) -> LogSoftmax {
        let mut max = f32::NEG_INFINITY;
        let mut pos_inf = 0u64;
        for &x in logits {
            if x == f32::INFINITY {
                pos_inf += 1;
            } else if x > max {
                max = x;
            }
        }
        let mut sum = 0f64;
        if pos_inf == 0 && max.is_finite() {
            for &x in logits {
                if x.is_finite() {
                    // `x - max <= 0`, so the f32 exp cannot overflow; the f64 sum keeps the
                    // many tiny terms of a large vocabulary from rounding away.
                    sum += f64::from((x - max).exp());
                }
            }
        }
        LogSoftmax {
            max,
            log_sum: sum.ln(),
            pos_inf,
        }
    }

    /// The log-probability of a token whose logit is `logit`.
    pub fn logprob(&self, logit: f32) -> f64 {
        if logit.is_nan() {
            return f64::NAN;
        }
        if self.pos_inf > 0 {
            return if logit == f32::INFINITY {
                -(self.pos_inf as f64).ln()
            } else {
                f64::NEG_INFINITY
            };
        }
        if !self.max.is_finite() {
            return f64::NAN;
        }
        (f64::from(logit) - f64::from(self.max)) - self.log_sum
    }
}

/// A logit with its id, ordered by logit and then by id (`NaN` never enters).
#[derive(Debug, Clone, Copy)]
struct Ranked {
    logit: f32,
    id: u32,
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        self.logit
            .total_cmp(&other.logit)
            .then(self.id.cmp(&other.id))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

/// The `n` largest logits as `(id, logit)`, largest first; equal logits put the larger id first
/// (llama-cpp-python sorts `(logprob, id)` pairs in reverse). `NaN` logits are never chosen; `n`
/// past the row's length gives every other logit.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    // A min-heap of the best `n` so far: most logits lose to its root and cost one compare.
    let mut best: BinaryHeap<Reverse<Ranked>> = BinaryHeap::with_capacity(n + 1);
    for (id, &logit) in (0u32..).zip(logits) {
        if logit.is_nan() {
            continue;
        }
        let r = Ranked { logit, id };
        if best.len() < n {
            best.push(Reverse(r));
        } else if best.peek().is_some_and(|Reverse(worst)| r > *worst) {
            best.pop();
            best.push(Reverse(r));
        }
    }
    // Ascending `Reverse` order is descending rank.
    best.into_sorted_vec()
        .into_iter()
        .map(|Reverse(r)| (r.id, r.logit))
        .collect()
}

/// One token's log-probability and the most likely tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f64,
    /// `(id, logprob)`, most likely first; the chosen token appears only if it ranks.
    pub top: Vec<(u32, f64)>,
}

impl TokenLogprobs {
    /// `token` scored against the row of logits that predicted it, with the `n` most likely
    /// tokens of that row. A token outside the row scores `NaN`.
    pub fn of(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
        let norm = LogSoftmax::new(logits);
        let logprob = logits
            .get(token as usize)
            .map_or(f64::NAN, |&x| norm.logprob(x));
        let top = top_n(logits, n)
            .into_iter()
            .map(|(id, x)| (id, norm.logprob(x)))
            .collect();
        TokenLogprobs {
            token,
            logprob,
            top,
        }
    }
}

/// Text lengths as llama-cpp-python measures its `text_offset`s: the characters of the pieces so
/// far decoded as UTF-8 with invalid bytes dropped (Python's `errors="ignore"`), where a
/// character still split across pieces does not count yet.
#[derive(Debug, Clone, Default)]
pub struct TextOffsets {
    /// Bytes of a character not yet complete (at most three).
    pending: Vec<u8>,
    chars: usize,
}

impl TextOffsets {
    pub fn new() -> TextOffsets {
        TextOffsets::default()
    }

    /// Characters so far.
    pub fn chars(&self) -> usize {
        self.chars
    }

    /// Append the bytes of the next piece.
    pub fn push(&mut self, piece: &[u8]) {
        self.pending.extend_from_slice(piece);
        let text = utf8_ignoring_invalid(&self.pending, true);
        self.chars += text.valid.chars().count();
        self.pending.drain(..text.consumed);
    }
}

/// `bytes` as text with invalid UTF-8 dropped, as Python's `bytes.decode("utf-8", "ignore")`.
pub fn text_ignoring_invalid(bytes: &[u8]) -> String {
    utf8_ignoring_invalid(bytes, false).valid
}

struct Decoded {
    valid: String,
    /// Bytes decoded or dropped; the rest is an incomplete character kept when `keep_tail`.
    consumed: usize,
}

fn utf8_ignoring_invalid(bytes: &[u8], keep_tail: bool) -> Decoded {
    let mut valid = String::new();
    let mut at = 0;
    while at < bytes.len() {
        match std::str::from_utf8(&bytes[at..]) {
            Ok(s) => {
                valid.push_str(s);
                at = bytes.len();
            }
            Err(e) => {
                let good = e.valid_up_to();
                if let Ok(s) = std::str::from_utf8(&bytes[at..at + good]) {
                    valid.push_str(s);
                }
                match e.error_len() {
                    Some(bad) => at += good + bad,
                    // An incomplete character at the end: dropped, or kept for more bytes.
                    None if keep_tail => {
                        at += good;
                        break;
                    }
                    None => at = bytes.len(),
                }
            }
        }
    }
    Decoded {
        valid,
        consumed: at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logprobs(row: &[f32]) -> Vec<f64> {
        let n = LogSoftmax::new(row);
        row.iter().map(|&x| n.logprob(x)).collect()
    }

    #[test]
    fn probabilities_sum_to_one_and_match_the_definition() {
        let row: Vec<f32> = (0..50_000)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 9.0)
            .collect();
        let lp = logprobs(&row);
        let total: f64 = lp.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-9, "sum of probabilities {total}");
        // Against the textbook formula in f64, without a shift (the values are small).
        let z: f64 = row.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        for (&x, &l) in row.iter().zip(&lp).step_by(997) {
            assert!((l - (f64::from(x) - z)).abs() < 1e-9);
        }
    }

    #[test]
    fn a_shift_of_every_logit_changes_nothing() {
        let row = [1.0f32, -2.5, 3.25, 0.0, 7.5];
        let base = logprobs(&row);
        // Shifts that keep every logit exact in f32, so only the normaliser can differ.
        for shift in [-1024.0f32, -3.0, 64.0, 4096.0] {
            let moved: Vec<f32> = row.iter().map(|x| x + shift).collect();
            for (a, b) in base.iter().zip(logprobs(&moved)) {
                assert!((a - b).abs() < 1e-9, "{a} {b}");
            }
        }
        // Logits near f32::MAX do not overflow (an unshifted exp would give inf / inf).
        let big = logprobs(&[3.0e38, 3.0e38]);
        assert_eq!(big, vec![-(2f64.ln()); 2]);
    }

    #[test]
    fn non_finite_logits_have_defined_log_probabilities() {
        let lp = logprobs(&[0.0, f32::NEG_INFINITY, f32::NAN, 0.0]);
        assert!((lp[0] - (-(2f64.ln()))).abs() < 1e-12);
        assert_eq!(lp[1], f64::NEG_INFINITY);
        assert!(lp[2].is_nan());
        assert_eq!(lp[0], lp[3]);
        let lp = logprobs(&[f32::INFINITY, 5.0, f32::INFINITY, f32::NAN]);
        assert_eq!(lp[0], -(2f64.ln()));
        assert_eq!(lp[1], f64::NEG_INFINITY);
        assert!(lp[3].is_nan());
        assert!(
            logprobs(&[f32::NEG_INFINITY, f32::NAN])
                .iter()
                .all(|l| l.is_nan())
        );
        assert!(logprobs(&[]).is_empty());
    }

    #[test]
    fn top_n_is_the_head_of_a_full_sort() {
        let row: Vec<f32> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 20) as f32 / 64.0)
            .collect();
        let mut sorted: Vec<(u32, f32)> = (0u32..).zip(row.iter().copied()).collect();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(b.0.cmp(&a.0)));
        for n in [0, 1, 3, 40, 4999, 5000, 9000] {
            assert_eq!(top_n(&row, n), sorted[..n.min(5000)].to_vec(), "n = {n}");
        }
    }

    #[test]
    fn top_n_breaks_ties_by_larger_id_and_skips_nan() {
        let row = [2.0, f32::NAN, 5.0, 2.0, f32::NEG_INFINITY, 5.0];
        assert_eq!(top_n(&row, 3), vec![(5, 5.0), (2, 5.0), (3, 2.0)]);
        assert_eq!(top_n(&row, 10).len(), 5);
        assert_eq!(top_n(&row, 10).last(), Some(&(4, f32::NEG_INFINITY)));
    }

    #[test]
    fn token_logprobs_score_the_token_against_its_row() {
        let row = [0.5f32, 2.0, -1.0, 1.0];
        let t = TokenLogprobs::of(&row, 3, 2);
        let n = LogSoftmax::new(&row);
        assert_eq!(t.logprob, n.logprob(1.0));
        assert_eq!(t.top, vec![(1, n.logprob(2.0)), (3, n.logprob(1.0))]);
        assert!(TokenLogprobs::of(&row, 9, 1).logprob.is_nan());
    }

    #[test]
    fn text_offsets_count_characters_as_python_ignore_decoding() {
        let mut t = TextOffsets::new();
        t.push(b" caf");
        assert_eq!(t.chars(), 4);
        // "é" split across two pieces counts once, when complete.
        t.push(&[0xC3]);
        assert_eq!(t.chars(), 4);
        t.push(&[0xA9, b'!']);
        assert_eq!(t.chars(), 6);
        // A stray continuation byte is dropped.
        t.push(&[0x80, b'x']);
        assert_eq!(t.chars(), 7);
        assert_eq!(text_ignoring_invalid(b"a\xff\xc3\xa9b\xe2\x82"), "aéb");
        assert_eq!(text_ignoring_invalid(&[0xC3]), "");
    }
}
