//! KV cache: exact sizes (the bytes per element in `cache.rs`'s table), round-trip error bounds per dtype, offload.

use std::sync::Arc;

use weightlift_engine::cache::{Cache, CacheConfig, CacheDType, CacheState};
use weightlift_engine::{EngineError, Inventory};

fn config(dtype: CacheDType, offload: bool) -> CacheConfig {
    CacheConfig {
        max_seq_len: 64,
        batch_size: 2,
        dtype,
        n_kv_heads: vec![3, 2],
        head_dim: 64,
        offload,
        ring: None,
    }
}

/// A deterministic spread of values over several magnitudes (xorshift).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            u * [0.01f32, 1.0, 30.0, 200.0][i / 64 % 4]
        })
        .collect()
}

/// Held by the tests that start prefetch threads, so that one can count them.
static PREFETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn prefetching() -> std::sync::MutexGuard<'static, ()> {
    PREFETCHING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

const ALL: [CacheDType; 7] = [
    CacheDType::F32,
    CacheDType::Fp16,
    CacheDType::Bf16,
    CacheDType::Fp8,
    CacheDType::Q8,
    CacheDType::Q6,
    CacheDType::Q4,
];

#[test]
fn byte_sizes_follow_the_design_table() {
    // 2 × n_kv_heads × head_dim × max_seq_len × batch elements times bytes per element
    // (fp16 and bf16 2, fp8 1, q8 8.5/8, q6 8.5/8 for K and 4.5/8 for V, q4 4.5/8).
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    for dtype in ALL {
        let cache = Cache::new(config(dtype, false)).unwrap();
        for l in 0..2 {
            cache.allocate_layer(l, &dev, inv.cpu()).unwrap();
        }
        let per = |heads: f64| heads * 64.0 * 64.0 * 2.0;
        let (k, v) = match dtype {
            CacheDType::F32 => (4.0, 4.0),
            CacheDType::Fp16 | CacheDType::Bf16 => (2.0, 2.0),
            CacheDType::Fp8 => (1.0, 1.0),
            CacheDType::Q8 => (8.5 / 8.0, 8.5 / 8.0),
            CacheDType::Q6 => (8.5 / 8.0, 4.5 / 8.0),
            CacheDType::Q4 => (4.5 / 8.0, 4.5 / 8.0),
        };
        let want = (per(3.0) + per(2.0)) * (k + v);
        assert_eq!(dev.used() as f64, want, "{dtype:?}");
        assert_eq!(cache.memory(), vec![("virtual:0".to_owned(), want as u64)]);
        cache.free();
        assert_eq!(dev.used(), 0);
    }
}

#[test]
fn round_trip_within_documented_bounds() {
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    for dtype in ALL {
        let cache = Cache::new(config(dtype, false)).unwrap();
        for l in 0..2 {
            cache.allocate_layer(l, &dev, inv.cpu()).unwrap();
        }
        let (heads, n_tokens, pos) = (3usize, 7usize, 50u64);
        let n = 2 * heads * n_tokens * 64;
        let k = values(n, 1);
        let v = values(n, 2);
        cache.write(0, pos, n_tokens as u64, &k, &v).unwrap();
        let (k2, v2) = cache.read(0, pos, pos + n_tokens as u64).unwrap();
        let mut worst = [0f32; 2];
        for (is_v, (a, b)) in [(false, (&k, &k2)), (true, (&v, &v2))] {
            // Groups are 32 consecutive values of one head of one token; in this
            // (batch, head, token, dim) order they are 32 consecutive values too.
            for (ga, gb) in a.chunks(32).zip(b.chunks(32)) {
                let absmax = ga.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in ga.iter().zip(gb) {
                    let bound = dtype.error_bound(is_v, *x, ga);
                    assert!(
                        (x - y).abs() <= bound,
                        "{dtype:?} v={is_v}: {x} -> {y}, bound {bound}"
                    );
                    worst[usize::from(is_v)] =
                        worst[usize::from(is_v)].max((x - y).abs() / absmax.max(1e-30));
                }
            }
        }
        if dtype == CacheDType::Fp16 {
            // fp16 is exactly IEEE round-to-nearest (the half crate, which nobody here wrote).
            assert!(
                k.iter()
                    .zip(&k2)
                    .all(|(x, y)| half::f16::from_f32(*x).to_f32() == *y)
            );
        }
        if dtype == CacheDType::Bf16 {
            // bf16 likewise, at 8 bits of precision
            assert!(
                k.iter()
                    .zip(&k2)
                    .all(|(x, y)| half::bf16::from_f32(*x).to_f32() == *y)
            );
        }
        // Neighbouring positions were not touched.
        let (k3, _) = cache.read(0, 0, pos).unwrap();
        assert!(k3.iter().all(|&x| x == 0.0));
        // f32 is exact; every other dtype rounds.
        assert_eq!(worst[0] > 0.0, dtype != CacheDType::F32, "{dtype:?}");
    }
}

#[test]
fn bad_positions_and_shapes_are_refused() {
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let cache = Cache::new(config(CacheDType::Q4, false)).unwrap();
    let e = cache.read(0, 0, 1).unwrap_err();
    assert!(matches!(e, EngineError::NotLoaded { .. }), "{e}");
    cache
        .allocate_layer(0, &inv.accelerators()[0], inv.cpu())
        .unwrap();
    let e = cache.read(0, 60, 70).unwrap_err().to_string();
    assert!(
        e.contains("within max_seq_len 64") && e.contains("60..70"),
        "{e}"
    );
    let e = cache
        .write(0, 0, 1, &[0.0; 10], &[0.0; 10])
        .unwrap_err()
        .to_string();
    assert!(e.contains("384 values"), "{e}");
    let e = Cache::new(CacheConfig {
        head_dim: 10,
        n_kv_heads: vec![1],
        ..config(CacheDType::Q8, false)
    })
    .unwrap_err();
    assert!(e.to_string().contains("multiple of 32"), "{e}");
}

#[test]
fn oom_on_a_small_device() {
    let inv = Inventory::parse("virtual:1x64KiB").unwrap();
    let cache = Cache::new(config(CacheDType::Fp16, false)).unwrap();
    let e = cache
        .allocate_layer(0, &inv.accelerators()[0], inv.cpu())
        .unwrap_err();
    assert!(e.to_string().contains("out of memory on virtual:0"), "{e}");
    assert_eq!(inv.accelerators()[0].used(), 0);
}

#[test]
fn offloaded_cache_lives_on_the_host_and_prefetches() {
    let _serial = prefetching();
    let inv = Inventory::parse("virtual:2x64MiB").unwrap();
    let [a, b] = inv.accelerators() else { panic!() };
    let cfg = CacheConfig {
        n_kv_heads: vec![3, 2, 2],
        ..config(CacheDType::Q8, true)
    };
    let cache = Arc::new(Cache::new(cfg.clone()).unwrap());
    cache.allocate_layer(0, a, inv.cpu()).unwrap();
    cache.allocate_layer(1, a, inv.cpu()).unwrap();
    cache.allocate_layer(2, b, inv.cpu()).unwrap();
    assert_eq!(cache.device_of(1).unwrap(), "virtual:0");
    // Every layer in host RAM; two slots of the largest layer on a device computing two
    // layers (the one in use and the one prefetched), one slot on a device computing one.
    let [l0, l1, l2] = [0, 1, 2].map(|l| cfg.layer_bytes(l));
    assert!(l0 > l1);
    assert_eq!(
        inv.cpu().used(),
        l0 + l1 + l2,
        "offloaded layers live in host RAM"
    );
    assert_eq!((a.used(), b.used()), (2 * l0, l2));
    let devs = ["virtual:0", "virtual:0", "virtual:1"].map(str::to_owned);
    let mut want = cfg.expected_memory(&devs);
    let mut got = cache.memory();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    assert_eq!(cache.expected_memory().unwrap().len(), 3);
    assert_eq!(
        want,
        [
            ("cpu".to_owned(), l0 + l1 + l2),
            ("virtual:0".to_owned(), 2 * l0),
            ("virtual:1".to_owned(), l2)
        ]
    );
    let n = 2 * 2 * 2 * 64;
    let (k, v) = (values(n, 3), values(n, 4));
    cache.write(1, 10, 2, &k, &v).unwrap();
    // fetch(0) lends a slot and prefetches layer 1 into the other one, on a second thread.
    let r0 = cache.fetch(0).unwrap();
    assert_eq!(r0.k.device().name(), "virtual:0");
    assert!(cache.prefetch_pending(), "layer 1 is being prefetched");
    assert_eq!(cache.prefetched("virtual:0"), [1]);
    assert_eq!(
        a.used(),
        2 * l0,
        "a lent slot is the cache's memory, not a copy"
    );
    drop(r0);
    assert_eq!(cache.prefetched("virtual:0"), [0, 1]);
    let r1 = cache.fetch(1).unwrap();
    assert_eq!(cache.prefetched("virtual:1"), [2]);
    assert_eq!(
        cache.read_resident(&r1, 10, 12).unwrap(),
        cache.read(1, 10, 12).unwrap()
    );
    // A write makes copies of the layer stale: the next fetch fills the slot again.
    cache.write(1, 20, 2, &v, &k).unwrap();
    drop(r1);
    assert_eq!(cache.prefetched("virtual:0"), [0]);
    let r1 = cache.fetch(1).unwrap();
    assert_eq!(
        cache.read_resident(&r1, 20, 22).unwrap(),
        cache.read(1, 20, 22).unwrap()
    );
    // Both slots lent: a third fetch on the device is a fresh copy, freed when dropped.
    let r0 = cache.fetch(0).unwrap();
    let extra = cache.fetch(0).unwrap();
    assert_eq!(a.used(), 2 * l0 + l0);
    drop(extra);
    assert_eq!(a.used(), 2 * l0);
    // Freeing with slots still lent: they are freed when their Residents drop.
    cache.free();
    assert_eq!((inv.cpu().used(), b.used()), (0, 0));
    drop((r0, r1));
    assert_eq!(a.used(), 0);
    assert_eq!(cache.memory(), []);
}

/// A forward pass writes a layer's new rows just before it fetches the layer: the write reaches
/// the prefetched copy too, so that copy stays current (no second copy of the whole layer) and
/// reads back as the host's rows. A write of another layer's rows leaves it alone.
#[test]
fn row_writes_keep_the_prefetched_copy_of_an_offloaded_layer_current() {
    let _serial = prefetching();
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let [a] = inv.accelerators() else { panic!() };
    for dtype in [CacheDType::Q4, CacheDType::Fp16] {
        let cfg = CacheConfig {
            batch_size: 1,
            n_kv_heads: vec![2, 2, 2],
            ..config(dtype, true)
        };
        let cache = Arc::new(Cache::new(cfg).unwrap());
        for l in 0..3 {
            cache.allocate_layer(l, a, inv.cpu()).unwrap();
        }
        let row = 2 * 64;
        let (k, v) = (values(4 * row, 5), values(4 * row, 6));
        cache
            .write_rows(1, 0, &k[..2 * row], &v[..2 * row])
            .unwrap();
        drop(cache.fetch(0).unwrap());
        assert_eq!(cache.prefetched("virtual:0"), [0, 1], "{}", dtype.name());
        cache
            .write_rows(1, 2, &k[2 * row..], &v[2 * row..])
            .unwrap();
        cache.write_rows(2, 0, &k[..row], &v[..row]).unwrap();
        assert_eq!(
            cache.prefetched("virtual:0"),
            [0, 1],
            "{}: layer 1's copy took its new rows",
            dtype.name()
        );
        let r1 = cache.fetch(1).unwrap();
        assert_eq!(
            cache.read_resident(&r1, 0, 4).unwrap(),
            cache.read(1, 0, 4).unwrap(),
            "{}",
            dtype.name()
        );
    }
}

/// The threads of this process whose name starts with `prefix` (Linux keeps 15 bytes of it).
#[cfg(target_os = "linux")]
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// An offloaded cache prefetches on one thread of its own, kept across fetches (a decode step
/// fetches every layer), and the thread ends when the cache is dropped.
#[cfg(target_os = "linux")]
#[test]
fn an_offloaded_cache_prefetches_on_one_thread_for_its_life() {
    let _serial = prefetching();
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let [a] = inv.accelerators() else { panic!() };
    let cfg = CacheConfig {
        batch_size: 1,
        n_kv_heads: vec![2, 2, 2, 2],
        ..config(CacheDType::Fp16, true)
    };
    let name = "weightlift-kv-p";
    let before = threads_named(name);
    let cache = Arc::new(Cache::new(cfg).unwrap());
    for l in 0..4 {
        cache.allocate_layer(l, a, inv.cpu()).unwrap();
    }
    for _step in 0..5 {
        for l in 0..4 {
            drop(cache.fetch(l).unwrap());
        }
    }
    // A new thread takes its name once it runs, so the count may lag its start a little.
    let started = (0..200).any(|_| {
        let n = threads_named(name);
        assert!(n <= before + 1, "{n} prefetch threads, expected one");
        std::thread::sleep(std::time::Duration::from_millis(5));
        n == before + 1
    });
    assert!(started, "no prefetch thread");
    drop(cache);
    let ended = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(5));
        threads_named(name) == before
    });
    assert!(ended, "the prefetch thread outlived its cache");
}

/// Filling an offloaded layer's slot copies the rows written so far, not `max_seq_len` rows:
/// after 3 rows of a 64-row cache, a slot fill moves 3 rows of K and V.
#[test]
fn filling_a_slot_copies_only_the_rows_written() {
    let _serial = prefetching();
    let inv = Inventory::parse("virtual:1x64MiB").unwrap();
    let [a] = inv.accelerators() else { panic!() };
    let cfg = CacheConfig {
        batch_size: 1,
        n_kv_heads: vec![2, 2, 2],
        ..config(CacheDType::Fp16, true)
    };
    let cache = Arc::new(Cache::new(cfg.clone()).unwrap());
    for l in 0..3 {
        cache.allocate_layer(l, a, inv.cpu()).unwrap();
    }
    let row = 2 * 64;
    let (k, v) = (values(3 * row, 7), values(3 * row, 8));
    for l in 0..3 {
        cache.write_rows(l, 0, &k, &v).unwrap();
    }
    let before = cache.offload_copies().bytes;
    // layer 2 is in no slot yet: its fetch fills one (layer 0's fetch prefetches 1 too)
    let r = cache.fetch(2).unwrap();
    let per_fill = 3 * row as u64 * 2 * 2; // 3 rows of K and V, 2 bytes a value
    assert_eq!(cache.offload_copies().bytes - before, per_fill);
    assert_eq!(
        cache.read_resident(&r, 0, 3).unwrap(),
        cache.read(2, 0, 3).unwrap()
    );
    assert!(per_fill < cfg.layer_bytes(2) / 16);
}

#[test]
fn truncate_keeps_at_most_what_is_held() {
    let cache = Cache::new(config(CacheDType::Fp16, false)).unwrap();
    cache.set_seq_len(5).unwrap();
    cache.truncate(3).unwrap();
    assert_eq!(cache.seq_len(), 3);
    let e = cache.truncate(4).unwrap_err().to_string();
    assert!(e.contains("at most the 3 tokens held"), "{e}");
}

/// A cache of one sequence of 64 positions over two layers, its rows written directly (no
/// model) with `ids` noted at their positions.
fn filled(
    dtype: CacheDType,
    ids: &[u32],
    dev: &Arc<weightlift_engine::Device>,
    cpu: &Arc<weightlift_engine::Device>,
) -> Cache {
    let cache = Cache::new(CacheConfig {
        batch_size: 1,
        ..config(dtype, false)
    })
    .unwrap();
    let n = ids.len() as u64;
    for l in 0..2 {
        cache.allocate_layer(l, dev, cpu).unwrap();
        let heads = [3, 2][l];
        let x = values(heads * ids.len() * 64, 7 + l as u64);
        let y = values(heads * ids.len() * 64, 19 + l as u64);
        cache.write(l, 0, n, &x, &y).unwrap();
    }
    cache.note_ids(0, ids);
    cache.set_seq_len(n).unwrap();
    cache
}

/// A prefix copied between caches of one dtype holds the donor's rows bit for bit (their
/// stored bytes, from a virtual device to the cpu); between dtypes it is the donor's values
/// encoded again. What cannot be copied (past the ids the donor knows, from another model's
/// cache) is refused by name, leaving the cache as it was; a copy that fails part way leaves
/// it empty.
#[test]
fn a_prefix_copied_between_caches_holds_the_donors_rows() {
    let inv = Inventory::parse("virtual:1x64MiB,cpu").unwrap();
    let (dev, cpu) = (&inv.accelerators()[0], inv.cpu());
    let ids: Vec<u32> = (100..140).collect();
    for dtype in ALL {
        let donor = filled(dtype, &ids, dev, cpu);
        let copy = Cache::new(donor.config().clone()).unwrap();
        for l in 0..2 {
            copy.allocate_layer(l, cpu, cpu).unwrap();
        }
        copy.copy_prefix_from(&donor, 30).unwrap();
        assert_eq!((copy.seq_len(), copy.ids()), (30, ids[..30].to_vec()));
        assert_eq!(copy.common_prefix(&ids), 30);
        for l in 0..2 {
            assert_eq!(
                copy.read(l, 0, 30).unwrap(),
                donor.read(l, 0, 30).unwrap(),
                "{dtype:?}"
            );
        }
        // through f32 and back: the values decoded, encoded again; f32 and the floating
        // types give them back bit for bit, a quantised type within its bound of them (its
        // Walsh-Hadamard turn rounds, which can move a group's scale)
        let wide = filled(CacheDType::F32, &ids[..1], cpu, cpu);
        wide.copy_prefix_from(&donor, 30).unwrap();
        let back = filled(dtype, &ids[..1], cpu, cpu);
        back.copy_prefix_from(&wide, 30).unwrap();
        for l in 0..2 {
            let (got, want) = (back.read(l, 0, 30).unwrap(), donor.read(l, 0, 30).unwrap());
            for (is_v, (a, b)) in [(false, (&got.0, &want.0)), (true, (&got.1, &want.1))] {
                if matches!(dtype, CacheDType::Q8 | CacheDType::Q6 | CacheDType::Q4) {
                    for (ga, gb) in a.chunks(32).zip(b.chunks(32)) {
                        for (x, y) in ga.iter().zip(gb) {
                            let bound = dtype.error_bound(is_v, *y, gb);
                            assert!((x - y).abs() <= bound, "{dtype:?}: {y} -> {x}, {bound}");
                        }
                    }
                } else {
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{dtype:?} layer {l}"
                    );
                }
            }
        }
    }
    let donor = filled(CacheDType::Q4, &ids, dev, cpu);
    let copy = filled(CacheDType::Q4, &ids[..3], cpu, cpu);
    let e = copy.copy_prefix_from(&donor, 41).unwrap_err().to_string();
    assert!(
        e.contains("at most the 40 tokens whose ids the donor knows"),
        "{e}"
    );
    let other = Cache::new(CacheConfig {
        batch_size: 1,
        n_kv_heads: vec![3],
        ..config(CacheDType::Q4, false)
    })
    .unwrap();
    let e = other.copy_prefix_from(&donor, 4).unwrap_err().to_string();
    assert!(e.contains("2 layers; it is another model's"), "{e}");
    assert_eq!((copy.seq_len(), copy.ids()), (3, ids[..3].to_vec()));
    // a copy that fails part way (the donor's layer 1 is not allocated) leaves the cache empty
    let half = Cache::new(donor.config().clone()).unwrap();
    half.allocate_layer(0, cpu, cpu).unwrap();
    let (k, v) = donor.read(0, 0, 10).unwrap();
    half.write(0, 0, 10, &k, &v).unwrap();
    half.note_ids(0, &ids[..10]);
    half.set_seq_len(10).unwrap();
    let e = copy.copy_prefix_from(&half, 8).unwrap_err().to_string();
    assert!(e.contains("cache layer 1"), "{e}");
    assert_eq!(
        (copy.seq_len(), copy.ids(), copy.held_from(0)),
        (0, vec![], 0)
    );
}

/// Two layers of 2 kv heads × 64, one sequence: a shape a cache split by heads takes.
fn two_heads(dtype: CacheDType) -> CacheConfig {
    CacheConfig {
        batch_size: 1,
        n_kv_heads: vec![2, 2],
        ..config(dtype, false)
    }
}

fn same_rows(a: &Cache, b: &Cache, n: u64) -> bool {
    (0..2).all(|l| {
        let (x, y) = (a.read(l, 0, n).unwrap(), b.read(l, 0, n).unwrap());
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        bits(&x.0) == bits(&y.0) && bits(&x.1) == bits(&y.1)
    })
}

/// A saved state, like a copied prefix, carries the rows as the cache stores them: restored
/// into a cache of its dtype they are the saving cache's bytes (a quantised cache's groups
/// included), whether either cache is split by heads over devices or not; restored into f32
/// they are the values the rows decode to. A record of version 2 (f32 rows head by head) still
/// loads.
#[test]
fn a_state_keeps_the_stored_bytes_across_devices_and_splits() {
    let inv = Inventory::parse("virtual:2x64MiB,cpu").unwrap();
    let (devs, cpu) = (inv.accelerators(), inv.cpu());
    let ids: Vec<u32> = (100..130).collect();
    let plain = |dtype, dev: &Arc<weightlift_engine::Device>| {
        let c = Cache::new(two_heads(dtype)).unwrap();
        for l in 0..2 {
            c.allocate_layer(l, dev, cpu).unwrap();
        }
        c
    };
    let split = |dtype| {
        let c = Cache::new(two_heads(dtype)).unwrap();
        c.allocate_tp(&[(Arc::clone(&devs[0]), 0, 1), (Arc::clone(&devs[1]), 1, 2)])
            .unwrap();
        c
    };
    for dtype in ALL {
        let donor = plain(dtype, &devs[0]);
        for l in 0..2 {
            let (x, y) = (values(2 * 30 * 64, 3 + l), values(2 * 30 * 64, 11 + l));
            donor.write(l as usize, 0, 30, &x, &y).unwrap();
        }
        donor.note_ids(0, &ids);
        donor.set_seq_len(30).unwrap();
        let state = CacheState::from_bytes(&donor.save_state().unwrap().to_bytes()).unwrap();
        assert_eq!((state.dtype, state.heads_first), (dtype, false));
        for (what, into) in [("plain", plain(dtype, cpu)), ("split", split(dtype))] {
            into.load_state(&state).unwrap();
            // (compared whole: a failure would print every byte)
            assert!(into.save_state().unwrap() == state, "{dtype:?} into {what}");
            assert!(same_rows(&into, &donor, 30), "{dtype:?} into {what}");
            assert_eq!(into.ids(), ids);
        }
        // a split cache's state loads into a plain cache; prefixes copy either way
        let parted = split(dtype);
        parted.load_state(&state).unwrap();
        let back = plain(dtype, cpu);
        back.load_state(&parted.save_state().unwrap()).unwrap();
        assert!(back.save_state().unwrap() == state, "{dtype:?}");
        let copied = plain(dtype, &devs[1]);
        copied.copy_prefix_from(&parted, 20).unwrap();
        assert!(same_rows(&copied, &donor, 20), "{dtype:?}");
        let copied = split(dtype);
        copied.copy_prefix_from(&donor, 20).unwrap();
        assert!(same_rows(&copied, &donor, 20), "{dtype:?}");
        // into f32: the values the rows decode to
        let wide = plain(CacheDType::F32, cpu);
        wide.load_state(&state).unwrap();
        assert!(same_rows(&wide, &donor, 30), "{dtype:?} into f32");
    }
    // version 2: f32 rows head by head, every layer from position 0
    let donor = filled(CacheDType::Q4, &ids, cpu, cpu);
    let mut v2 = Vec::new();
    v2.extend_from_slice(b"WLKVSTAT");
    v2.extend_from_slice(&2u32.to_le_bytes());
    for n in [30u64, 30, 2] {
        v2.extend_from_slice(&n.to_le_bytes());
    }
    ids.iter()
        .for_each(|i| v2.extend_from_slice(&i.to_le_bytes()));
    for n in [3u64 * 64, 2 * 64, 0, 0] {
        v2.extend_from_slice(&n.to_le_bytes());
    }
    for l in 0..2 {
        let (k, v) = donor.read(l, 0, 30).unwrap();
        k.iter()
            .chain(&v)
            .for_each(|x| v2.extend_from_slice(&x.to_le_bytes()));
    }
    let old = CacheState::from_bytes(&v2).unwrap();
    assert!(old.heads_first);
    let wide = Cache::new(CacheConfig {
        batch_size: 1,
        ..config(CacheDType::F32, false)
    })
    .unwrap();
    for l in 0..2 {
        wide.allocate_layer(l, cpu, cpu).unwrap();
    }
    wide.load_state(&old).unwrap();
    assert!(same_rows(&wide, &donor, 30));
    // a state whose rows are short for its shape is refused, and the cache keeps its tokens
    let mut short = old;
    short.layers[1].1.pop();
    let e = wide.load_state(&short).unwrap_err().to_string();
    assert!(e.contains("cache state rows of layer 1"), "{e}");
    assert_eq!(wide.seq_len(), 30);
}
