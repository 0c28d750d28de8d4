//! Character classes: the sets of code points a grammar's terminals match.

/// A set of code points: sorted, disjoint, non-adjacent inclusive ranges, or their complement.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct CharClass {
    pub(super) negated: bool,
    pub(super) ranges: Vec<(u32, u32)>,
}

impl CharClass {
    pub(super) fn new(negated: bool, mut ranges: Vec<(u32, u32)>) -> CharClass {
        // `[z-a]` matches nothing, as in llama.cpp.
        ranges.retain(|&(lo, hi)| lo <= hi);
        ranges.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
        for (lo, hi) in ranges {
            match merged.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        CharClass {
            negated,
            ranges: merged,
        }
    }

    /// `.`: every character.
    pub(super) fn any() -> CharClass {
        CharClass::new(true, Vec::new())
    }

    pub(super) fn contains(&self, c: u32) -> bool {
        let listed = self
            .ranges
            .binary_search_by(|&(lo, hi)| {
                if hi < c {
                    std::cmp::Ordering::Less
                } else if lo > c {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            })
            .is_ok();
        listed != self.negated
    }

    /// Whether some code point in `lo..=hi` is in the class.
    pub(super) fn intersects(&self, lo: u32, hi: u32) -> bool {
        if self.negated {
            // Some point of lo..=hi is outside every listed range: the ranges do not cover it.
            !self.ranges.iter().any(|&(a, b)| a <= lo && hi <= b)
        } else {
            self.ranges.iter().any(|&(a, b)| a <= hi && lo <= b)
        }
    }
}
