//! The copy primitives: strided rows within a device (`copy_2d`), copies between devices
//! (`copy_peer`) and, on CUDA, the copy stream. The reference is the index arithmetic of a
//! row-major matrix: columns `c..c + w` of row `r` of an `n × h` matrix are the values
//! `r·h + c .. r·h + c + w`. The CPU cases run here; the CUDA ones need a GPU and compare with
//! the CPU backend's result.

mod common;

use common::{download_f32, f32s};
use weightlift_kernels::*;

/// An `n × h` matrix with every value distinct.
fn matrix(n: usize, h: usize) -> Vec<f32> {
    (0..n * h).map(|i| i as f32 * 0.25 - 7.0).collect()
}

/// Columns `c..c + w` of every row of the `n × h` matrix `m`, packed.
fn columns(m: &[f32], h: usize, c: usize, w: usize) -> Vec<f32> {
    m.chunks_exact(h)
        .flat_map(|row| row[c..c + w].iter().copied())
        .collect()
}

const N: usize = 7;
const H: usize = 24;

fn column_blocks_pack_and_unpack<B: Backend>(b: &B) -> Result<()> {
    let m = matrix(N, H);
    let src = f32s(b, &m)?;
    // gather columns 8..20 of every row (a tensor-parallel share of a row-major matrix)
    let (c, w) = (8, 12);
    let mut packed = b.alloc(N * w * 4)?;
    let whole = Rows {
        offset: c * 4,
        pitch: H * 4,
    };
    let dense = Rows {
        offset: 0,
        pitch: w * 4,
    };
    b.copy_2d(&src, whole, &mut packed, dense, w * 4, N)?;
    assert_eq!(
        download_f32(b, &packed, N * w)?,
        columns(&m, H, c, w),
        "{} pack",
        b.name()
    );

    // scatter the block into columns 4..16 of a zeroed matrix
    let mut back = b.alloc(N * H * 4)?;
    let at4 = Rows {
        offset: 4 * 4,
        pitch: H * 4,
    };
    b.copy_2d(&packed, dense, &mut back, at4, w * 4, N)?;
    let mut want = vec![0f32; N * H];
    for r in 0..N {
        want[r * H + 4..r * H + 4 + w].copy_from_slice(&m[r * H + c..r * H + c + w]);
    }
    assert_eq!(download_f32(b, &back, N * H)?, want, "{} unpack", b.name());

    // rows 2..5 only, two columns each at a pitch of 3 rows (every third row of the block)
    let mut few = b.alloc(2 * 2 * 4)?;
    let from = Rows {
        offset: (2 * H + 1) * 4,
        pitch: 3 * H * 4,
    };
    b.copy_2d(
        &src,
        from,
        &mut few,
        Rows {
            offset: 0,
            pitch: 8,
        },
        8,
        2,
    )?;
    let got = download_f32(b, &few, 4)?;
    assert_eq!(
        got,
        [m[2 * H + 1], m[2 * H + 2], m[5 * H + 1], m[5 * H + 2]]
    );

    // one row: its pitch is never used
    b.copy_2d(
        &src,
        Rows {
            offset: 4,
            pitch: 0,
        },
        &mut few,
        Rows {
            offset: 4,
            pitch: 0,
        },
        8,
        1,
    )?;
    assert_eq!(download_f32(b, &few, 4)?, [got[0], m[1], m[2], got[3]]);

    // bad input is an error naming the side, and copies nothing
    let before = download_f32(b, &packed, N * w)?;
    let past_end = Rows {
        offset: 4,
        pitch: w * 4,
    };
    let err = b
        .copy_2d(&src, whole, &mut packed, past_end, w * 4, N)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "copy_2d destination bytes: expected {}, got {}",
            N * w * 4 + 4,
            N * w * 4
        )
    );
    let late = Rows {
        offset: (H - w + 1) * 4,
        pitch: H * 4,
    };
    let err = b
        .copy_2d(&src, late, &mut packed, dense, w * 4, N)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "copy_2d source bytes: expected {}, got {}",
            N * H * 4 + 4,
            N * H * 4
        )
    );
    let err = b
        .copy_2d(
            &src,
            whole,
            &mut packed,
            Rows {
                offset: 0,
                pitch: 4,
            },
            w * 4,
            N,
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid shape for copy_2d: copy_2d destination bytes: rows of 48 bytes at a pitch of 4 \
         bytes overlap; the pitch is the whole row of the matrix, not the part copied"
    );
    let huge = Rows {
        offset: 0,
        pitch: usize::MAX / 2,
    };
    let err = b
        .copy_2d(&src, huge, &mut packed, dense, w * 4, N)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "copy_2d source bytes: expected {}, got {}",
            usize::MAX,
            N * H * 4
        )
    );
    assert_eq!(download_f32(b, &packed, N * w)?, before, "{}", b.name());
    // nothing to copy is not an error, wherever it points
    b.copy_2d(&src, huge, &mut packed, huge, 0, N)?;
    b.copy_2d(&src, huge, &mut packed, huge, 4, 0)?;
    Ok(())
}
test_device!(column_blocks_pack_and_unpack);

/// A peer copy from `a` to `b` at offsets: the bytes arrive, the rest of the destination stays
/// as it was, and ranges past either end are errors.
fn peer_copy<B: Backend>(a: &B, b: &B) -> Result<()> {
    let m = matrix(N, H);
    let src = f32s(a, &m)?;
    // queued on `b` just before the copy, which must land after it
    let mut dst = f32s(b, &vec![1.5f32; N * H])?;
    a.copy_peer(&src, 40, b, &mut dst, 8, 100 * 4)?;
    let mut want = vec![1.5f32; N * H];
    want[2..102].copy_from_slice(&m[10..110]);
    assert_eq!(
        download_f32(b, &dst, N * H)?,
        want,
        "{} to {}",
        a.name(),
        b.name()
    );
    let err = a
        .copy_peer(&src, 40, b, &mut dst, 300, 100 * 4)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("copy destination bytes: expected 700, got {}", N * H * 4)
    );
    let err = a
        .copy_peer(&src, N * H * 4 - 4, b, &mut dst, 0, 8)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "copy source bytes: expected {}, got {}",
            N * H * 4 + 4,
            N * H * 4
        )
    );
    Ok(())
}

/// Strided rows from `a` to `b`: columns `3..11` of an `N × H` matrix on `a` into columns
/// `5..13` of a wider matrix on `b`, the rest of the destination untouched; a contiguous pair
/// of sides in one copy; overlapping rows refused.
fn peer_rows<B: Backend>(a: &B, b: &B) -> Result<()> {
    let (m, wide) = (matrix(N, H), H + 6);
    let src = f32s(a, &m)?;
    let mut dst = f32s(b, &vec![1.5f32; N * wide])?;
    let from = Rows {
        offset: 3 * 4,
        pitch: H * 4,
    };
    let to = Rows {
        offset: 5 * 4,
        pitch: wide * 4,
    };
    a.copy_peer_2d(&src, from, b, &mut dst, to, (8 * 4, N))?;
    let mut want = vec![1.5f32; N * wide];
    for r in 0..N {
        want[r * wide + 5..r * wide + 13].copy_from_slice(&m[r * H + 3..r * H + 11]);
    }
    assert_eq!(download_f32(b, &dst, N * wide)?, want);
    let packed = Rows {
        offset: 0,
        pitch: H * 4,
    };
    let mut whole = f32s(b, &vec![0f32; N * H])?;
    a.copy_peer_2d(&src, packed, b, &mut whole, packed, (H * 4, N))?;
    assert_eq!(download_f32(b, &whole, N * H)?, m);
    let tight = Rows {
        offset: 0,
        pitch: 4,
    };
    let err = a
        .copy_peer_2d(&src, tight, b, &mut whole, packed, (8, 2))
        .unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");
    Ok(())
}

#[test]
fn cpu_backends_copy_strided_rows_to_each_other() -> Result<()> {
    let a = CpuBackend::with_capacity("virtual:0", 1 << 20);
    let b = CpuBackend::with_capacity("virtual:1", 1 << 20);
    peer_rows(&a, &b)?;
    peer_rows(&b, &a)
}

#[test]
fn cpu_backends_copy_to_each_other() -> Result<()> {
    let a = CpuBackend::with_capacity("virtual:0", 1 << 20);
    let b = CpuBackend::with_capacity("virtual:1", 1 << 20);
    assert!(a.peer_access(&b) && b.peer_access(&a) && a.peer_access(&a));
    peer_copy(&a, &b)?;
    peer_copy(&b, &a)?;
    // each buffer must belong to its side
    let src = a.alloc(64)?;
    let mut wrong = a.alloc(64)?;
    let err = a.copy_peer(&src, 0, &b, &mut wrong, 0, 64).unwrap_err();
    assert_eq!(
        err.to_string(),
        "buffer of 64 bytes on virtual:0 was used with backend virtual:1"
    );
    let mut right = b.alloc(64)?;
    let err = b.copy_peer(&src, 0, &a, &mut right, 0, 64).unwrap_err();
    assert_eq!(
        err.to_string(),
        "buffer of 64 bytes on virtual:0 was used with backend virtual:1"
    );
    Ok(())
}

#[test]
fn copy_stream_is_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<CopyStream>();
}

/// `bytes` distinct-looking bytes (a byte counter mixed with `seed`).
fn pattern(bytes: usize, seed: u8) -> Vec<u8> {
    (0..bytes)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed ^ (i >> 12) as u8)
        })
        .collect()
}

/// `m` uploaded to `b`, and `w` columns of it from `from` gathered into `to` by `copy_2d`.
fn pack<B: Backend>(b: &B, m: &[f32], from: Rows, to: Rows, w: usize) -> Result<Vec<f32>> {
    let src = f32s(b, m)?;
    let mut dst = b.alloc(N * w * 4)?;
    b.copy_2d(&src, from, &mut dst, to, w * 4, N)?;
    download_f32(b, &dst, N * w)
}

/// On cuda:0: `copy_2d` gives the CPU backend's bytes; peer copies within the device (two
/// backends, two streams) and to cuda:1 when there is one; the copy stream's uploads, ordered
/// after a compute-stream read of the old bytes and before one of the new.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn cuda_copies_match_the_cpu() -> Result<()> {
    let cpu = CpuBackend::new();
    let g0 = CudaBackend::new(0)?;
    let m = matrix(N, H);
    let (c, w) = (5, 9);
    let (whole, dense) = (
        Rows {
            offset: c * 4,
            pitch: H * 4,
        },
        Rows {
            offset: 0,
            pitch: w * 4,
        },
    );
    let on_cpu = pack(&cpu, &m, whole, dense, w)?;
    let on_gpu = pack(&g0, &m, whole, dense, w)?;
    assert_eq!(on_gpu, on_cpu);

    // same device, another backend (another stream): device to device
    let g0b = CudaBackend::new(0)?;
    assert!(g0.peer_access(&g0b));
    peer_copy(&g0, &g0b)?;
    if CudaBackend::device_count()? >= 2 {
        let g1 = CudaBackend::new(1)?;
        eprintln!(
            "cuda:0 -> cuda:1 peer access: {}, back: {}",
            g0.peer_access(&g1),
            g1.peer_access(&g0)
        );
        peer_copy(&g0, &g1)?;
        peer_rows(&g0, &g1)?;
        peer_copy(&g1, &g0)?;
        let cs = g0.copy_stream()?;
        let err = cs.after_compute(&g1).unwrap_err();
        assert!(matches!(err, KernelError::StreamDevice { .. }), "{err}");
    }

    // The copy stream: 40 MiB (three staging pieces) into a slot the compute stream is reading.
    let bytes = 40 << 20;
    let (old, new) = (pattern(bytes, 1), pattern(bytes, 2));
    let cs = g0.copy_stream()?;
    let mut slot = g0.alloc(bytes)?;
    g0.copy_from_host(&old, &mut slot, 0)?;
    let mut seen = g0.alloc(bytes)?;
    // queued on the compute stream; the refill below must wait for it
    g0.copy(&slot, 0, &mut seen, 0, bytes)?;
    cs.after_compute(&g0)?;
    cs.upload(&new, &mut slot, 0)?;
    cs.before_compute(&g0)?;
    let mut after = g0.alloc(bytes)?;
    g0.copy(&slot, 0, &mut after, 0, bytes)?;
    let mut host = vec![0u8; bytes];
    g0.copy_to_host(&seen, 0, &mut host)?;
    assert!(host == old, "the refill overtook a read of the old bytes");
    g0.copy_to_host(&after, 0, &mut host)?;
    assert!(host == new, "a read overtook the copy stream's upload");
    // an upload at an offset, then a wait on the host
    cs.upload(&old[..1000], &mut slot, 7)?;
    cs.synchronize()?;
    let mut part = vec![0u8; 1000];
    g0.copy_to_host(&slot, 7, &mut part)?;
    assert_eq!(part, old[..1000]);
    let err = cs.upload(&old[..1000], &mut slot, bytes - 10).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "copy destination bytes: expected {}, got {bytes}",
            bytes + 990
        )
    );
    Ok(())
}

/// On cuda:0: `upload_filled` writes what its windows were filled with, at an offset, over
/// three staging windows and a short last one; each window is handed over once, in order; an
/// error of the fill stops it at that window and comes back as the fill's own; a range past
/// the buffer is refused before any window is filled.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn cuda_upload_filled_writes_its_windows() -> Result<()> {
    let g0 = CudaBackend::new(0)?;
    let bytes = (40 << 20) + 12345;
    let want = pattern(bytes, 3);
    let mut dst = g0.alloc(bytes + 64)?;
    let mut windows = Vec::new();
    let filled = g0.upload_filled(&mut dst, 64, bytes, &mut |at, w: &mut [u8]| {
        windows.push((at, w.len()));
        w.copy_from_slice(&want[at..at + w.len()]);
        Ok::<(), String>(())
    })?;
    assert_eq!(filled, Ok(()));
    assert_eq!(windows.first(), Some(&(0, 16 << 20)));
    assert_eq!(windows.iter().map(|w| w.1).sum::<usize>(), bytes);
    assert!(windows.windows(2).all(|p| p[0].0 + p[0].1 == p[1].0));
    let mut host = vec![0u8; bytes];
    g0.copy_to_host(&dst, 64, &mut host)?;
    assert!(
        host == want,
        "the device holds what the windows were filled with"
    );

    let mut calls = 0;
    let stopped = g0.upload_filled(&mut dst, 0, bytes, &mut |_, _: &mut [u8]| {
        calls += 1;
        if calls == 2 {
            Err("read failed")
        } else {
            Ok(())
        }
    })?;
    assert_eq!((stopped, calls), (Err("read failed"), 2));

    let err = g0
        .upload_filled(&mut dst, 65, bytes, &mut |_, _: &mut [u8]| Ok::<(), ()>(()))
        .unwrap_err();
    assert!(err.to_string().contains("fill destination bytes"), "{err}");
    Ok(())
}
