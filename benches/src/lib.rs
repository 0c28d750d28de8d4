//! Criterion benches for weightlift; see `benches/` beside this file.
