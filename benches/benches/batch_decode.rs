//! Aggregate decode throughput of several sequences: each decode step as one
//! `Model::forward_batch` call over every sequence, against the baseline of the same steps one
//! sequence at a time (`Model::forward` per sequence), in the same run. The demo model
//! (SmolLM2-135M Q4_1) on the cpu, fast mode, 2 threads, an f16 cache per sequence.
//!
//! Writes `benches/results/batch_decode.{json,md}`: medians of `ROUNDS` rounds, each a fresh
//! prompt for every sequence and then `STEPS` greedy decode steps, only the steps timed. A
//! round times both ways back to back, and the ratio is the median of the rounds' ratios.

#![allow(clippy::print_stdout)] // a bench reports on stdout

use std::sync::Arc;
use std::time::Instant;

use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{Cache, CacheDType, Inventory, LoadOptions, Model, Placement};

const ROUNDS: usize = 9;
const STEPS: usize = 32;
const THREADS: usize = 2;
const SEQUENCES: [usize; 3] = [1, 4, 8];

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn load() -> Model {
    let path = weightlift_testdata::demo_gguf();
    let src: Arc<dyn weightlift_engine::Source> = Arc::new(
        weightlift_format::Checkpoint::open(&path, weightlift_format::OpenOptions::default())
            .expect("the demo model (make demo-model)"),
    );
    let mut m = Model::new(Arc::clone(&src), Inventory::parse("cpu").expect("cpu"));
    let config = m
        .cache_config(256, 1, CacheDType::Fp16, false)
        .expect("config");
    let cache = Arc::new(Cache::new(config).expect("cache"));
    let placement = Placement::all_on(src.as_ref(), "cpu", m.n_layers());
    m.load(
        &placement,
        &LoadOptions::default(),
        Some(&cache),
        true,
        &mut |_| true,
    )
    .expect("load");
    m.set_threads(THREADS).expect("threads");
    m.set_compute(Compute::Fast);
    m
}

/// A prompt of 16 ids for sequence `s` (distinct per sequence, all below the vocabulary).
fn prompt(s: usize) -> Vec<u32> {
    (0..16).map(|t| (1000 + 37 * s + 11 * t) as u32).collect()
}

/// Seconds for `STEPS` decode steps of `n` sequences, together or one at a time.
fn round(m: &mut Model, n: usize, together: bool) -> f64 {
    let caches: Vec<Arc<Cache>> = (0..n)
        .map(|_| m.sequence_cache(256).expect("cache"))
        .collect();
    let mut next = Vec::with_capacity(n);
    let mut out = Vec::new();
    for (s, c) in caches.iter().enumerate() {
        m.forward(&prompt(s), Some(c), Logits::Last, &mut out)
            .expect("prompt");
        next.push(argmax(&out));
    }
    let t = Instant::now();
    for _ in 0..STEPS {
        if together {
            let ids: Vec<[u32; 1]> = next.iter().map(|&i| [i]).collect();
            let seqs: Vec<(&Arc<Cache>, &[u32])> =
                caches.iter().zip(&ids).map(|(c, i)| (c, &i[..])).collect();
            m.forward_batch(&seqs, &mut out).expect("batch");
            let vocab = out.len() / n;
            for (s, row) in out.chunks_exact(vocab).enumerate() {
                next[s] = argmax(row);
            }
        } else {
            for (s, c) in caches.iter().enumerate() {
                m.forward(&[next[s]], Some(c), Logits::Last, &mut out)
                    .expect("step");
                next[s] = argmax(&out);
            }
        }
    }
    t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut m = load();
    round(&mut m, 2, true); // warm the pool and the page cache
    let mut rows = Vec::new();
    for n in SEQUENCES {
        // each round times both ways back to back, so a slower stretch of the shared
        // machine weighs on both sides of its ratio
        let (mut alone, mut batch, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let (a, b) = (round(&mut m, n, false), round(&mut m, n, true));
            alone.push(a);
            batch.push(b);
            ratios.push(a / b);
        }
        let tps = |s: f64| (n * STEPS) as f64 / s;
        let (alone, batch, ratio) = (median(alone), median(batch), median(ratios));
        println!(
            "{n} sequences: one at a time {:.1} tok/s, batched {:.1} tok/s, ratio {ratio:.2}",
            tps(alone),
            tps(batch),
        );
        rows.push((n, tps(alone), tps(batch), ratio));
    }
    write(&rows);
}

fn write(rows: &[(usize, f64, f64, f64)]) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    let json: Vec<String> = rows
        .iter()
        .map(|(n, a, b, r)| {
            format!(
                "    {{\"sequences\": {n}, \"one_at_a_time_tok_s\": {a:.1}, \
                 \"batched_tok_s\": {b:.1}, \"ratio\": {r:.2}}}"
            )
        })
        .collect();
    let body = format!(
        "{{\n  \"model\": \"SmolLM2-135M-Instruct Q4_1\",\n  \"device\": \"cpu\",\n  \
         \"threads\": {THREADS},\n  \"compute\": \"fast\",\n  \"steps\": {STEPS},\n  \
         \"rounds\": {ROUNDS},\n  \"rows\": [\n{}\n  ]\n}}\n",
        json.join(",\n")
    );
    std::fs::write(dir.join("batch_decode.json"), body).expect("write json");
    let mut md = format!(
        "# Batched decode (`benches/benches/batch_decode.rs`)\n\nSmolLM2-135M-Instruct Q4_1 on \
         the cpu, fast mode, {THREADS} threads, an f16 cache per sequence; {STEPS} greedy decode \
         steps after a 16-token prompt per sequence; medians of {ROUNDS} rounds. Baseline: the \
         same steps one sequence at a time, in the same round (the ratio is the median of the \
         rounds' ratios).\n\n| sequences | one at a time, \
         tok/s | batched, tok/s | ratio |\n|---:|---:|---:|---:|\n"
    );
    for (n, a, b, r) in rows {
        md += &format!("| {n} | {a:.1} | {b:.1} | {r:.2} |\n");
    }
    std::fs::write(dir.join("batch_decode.md"), md).expect("write md");
}
