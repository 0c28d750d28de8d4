//! Stop strings over streamed text.

/// Stop strings over streamed text, as llama-cpp-python's `create_completion(stop=[...],
/// stream=True)`: each [`push`](Self::push) returns the text that can no longer turn into a
/// stop string, holding back any tail that is the start of one; once a stop string appears,
/// the text before it is released and the stop string itself is dropped.
///
/// The earliest occurrence of any stop string wins (llama-cpp-python takes the first one in list
/// order that occurs, which can cut later in the text). Empty stop strings are ignored
/// (llama-cpp-python would stop at once with no text). Pieces are `&str`: bytes that do not yet
/// form a whole UTF-8 character must be held by the caller's detokenizer, as llama-cpp-python's
/// `multibyte_fix` does; held-back text is always cut at character boundaries.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings among them are dropped.
    pub fn new<I, S>(stops: I) -> StopMatcher
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        StopMatcher {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds the next piece of text; returns the text safe to emit now and whether a stop string
    /// has been seen. After a stop, every push returns `("", true)`.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(piece);
        let held = &self.held;
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| held.find(s.as_str()))
            .min()
        {
            self.held.truncate(at);
            self.stopped = true;
            return (std::mem::take(&mut self.held), true);
        }
        let hold = self
            .stops
            .iter()
            .map(|s| partial_stop_len(held, s))
            .max()
            .unwrap_or(0);
        // `held` ends with a whole-character prefix of a stop string, so this is a boundary.
        let rest = self.held.split_off(self.held.len() - hold);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// Whether a stop string has been seen.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The text still held back when generation ends without a stop string (empty after one).
    pub fn finish(self) -> String {
        self.held
    }
}

/// The length of the longest proper prefix of `stop`, cut at a character boundary, that `text`
/// ends with; 0 if none.
fn partial_stop_len(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .filter(|&l| stop.is_char_boundary(l))
        .find(|&l| text.ends_with(&stop[..l]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stream(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut m = StopMatcher::new(stops.iter().copied());
        let mut out = Vec::new();
        let mut stopped = false;
        for piece in pieces {
            let (text, stop) = m.push(piece);
            out.push(text);
            stopped = stop;
        }
        (out, stopped, m.finish())
    }

    #[test]
    fn stop_split_across_pieces_is_held_then_dropped() {
        let (out, stopped, rest) = stream(&["</s>"], &["Hello </", "s> more"]);
        assert_eq!(out, ["Hello ", ""]);
        assert!(stopped);
        assert_eq!(rest, "");
        // Held text that does not complete the stop is released with the next piece.
        let (out, stopped, rest) = stream(&["</s>"], &["a <", "/b>", " c"]);
        assert_eq!(out, ["a ", "</b>", " c"]);
        assert!(!stopped);
        assert_eq!(rest, "");
    }

    #[test]
    fn stop_at_the_very_start_emits_nothing() {
        let (out, stopped, _) = stream(&["Q:"], &["Q: what", "ever"]);
        assert_eq!(out, ["", ""]);
        assert!(stopped);
    }

    #[test]
    fn overlapping_prefixes_release_only_what_cannot_match() {
        let (out, stopped, _) = stream(&["ab"], &["a", "a", "b"]);
        assert_eq!(out, ["", "a", ""]);
        assert!(stopped);
        let (out, _, _) = stream(&["abab"], &["ab", "a", "bab"]);
        assert_eq!(out, ["", "", ""]);
        let (out, stopped, rest) = stream(&["aaa"], &["aa", "aa"]);
        assert_eq!(out, ["", ""]);
        assert!(stopped);
        assert_eq!(rest, "");
        let (out, stopped, _) = stream(&["aaa"], &["aa", "b", "aa"]);
        assert_eq!(out, ["", "aab", ""]);
        assert!(!stopped);
    }

    #[test]
    fn multi_byte_characters_are_never_split() {
        let (out, stopped, _) = stream(&["世界"], &["你好世", "界!"]);
        assert_eq!(out, ["你好", ""]);
        assert!(stopped);
        // "→" and "←" share their first two bytes; only whole characters can be held.
        let (out, _, _) = stream(&["←a"], &["→", "←", "b"]);
        assert_eq!(out, ["→", "", "←b"]);
        let (out, stopped, rest) = stream(&["é!"], &["café"]);
        assert_eq!(out, ["caf"]);
        assert!(!stopped);
        assert_eq!(rest, "é");
    }

    #[test]
    fn the_earliest_stop_wins_and_finish_releases_the_held_tail() {
        let (out, stopped, _) = stream(&["b", "a"], &["xab"]);
        assert_eq!(out, ["x"]);
        assert!(stopped);
        let (out, stopped, rest) = stream(&["###", ""], &["done #"]);
        assert_eq!(out, ["done "]);
        assert!(!stopped);
        assert_eq!(rest, "#");
        let mut m = StopMatcher::new(["x"]);
        assert_eq!(m.push("axb"), ("a".to_owned(), true));
        assert!(m.is_stopped());
        assert_eq!(m.push("more"), (String::new(), true));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn a_stop_completed_first_ends_generation_before_a_longer_one_can() {
        // "éab" starts before "a" but is still incomplete when "éa" arrives.
        let (out, stopped, _) = stream(&["a", "éab"], &["éa", "b"]);
        assert_eq!(out, ["é", ""]);
        assert!(stopped);
    }

    proptest! {
        #[test]
        fn streamed_text_is_the_text_before_the_first_stop(
            chars in prop::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '世', '→']), 0..40),
            cuts in prop::collection::vec(0usize..40, 0..10),
            stops in prop::collection::vec(
                prop::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '世']), 1..4), 1..3),
        ) {
            let text: String = chars.iter().collect();
            let stops: Vec<String> = stops.iter().map(|s| s.iter().collect()).collect();
            // Split the text at arbitrary character positions.
            let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(chars.len())).collect();
            bounds.push(0);
            bounds.push(chars.len());
            bounds.sort_unstable();
            let offsets: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let mut m = StopMatcher::new(stops.clone());
            let mut emitted = String::new();
            let mut stopped = false;
            for w in bounds.windows(2) {
                let (out, stop) = m.push(&text[offsets[w[0]]..offsets[w[1]]]);
                emitted.push_str(&out);
                stopped |= stop;
            }
            // Generation ends at the first piece that completes any stop string, and the text is
            // cut at the earliest stop found in what has arrived by then: a longer stop that
            // starts earlier but would complete later never gets the chance.
            let cut = bounds.windows(2).find_map(|w| {
                let seen = &text[..offsets[w[1]]];
                stops.iter().filter_map(|s| seen.find(s.as_str())).min()
            });
            if !stopped {
                emitted.push_str(&m.finish());
            }
            prop_assert_eq!(stopped, cut.is_some());
            prop_assert_eq!(emitted, &text[..cut.unwrap_or(text.len())]);
        }
    }
}
