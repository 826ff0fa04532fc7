//! `KvCache::record_chunk` (T tokens appended and attended per sequence: chunked prefill into
//! the cache) gives bitwise what recording the T append + step pairs one by one gives, over two
//! chunks (lengths advance), with the chunk's views strided (gathered per token) and outputs
//! poisoned first; bad calls are typed errors that record nothing.

mod common;

use common::*;
use pisa_core::{SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::{ChunkOutputs, KvCache, StepOutputs};
use pisa_wgpu::{wgpu, Context, DType, GpuError, Storage, TensorView};
use rand_chacha::ChaCha8Rng;

fn bits(ctx: &Context, b: &wgpu::Buffer) -> Vec<u32> {
    let bytes = ctx.read_bytes(b).unwrap();
    bytemuck::cast_slice::<u8, u32>(&bytes).to_vec()
}

#[test]
fn chunk_equals_steps_one_by_one() {
    let ctx = ctx();
    let (bsz, hq, hkv, d, cap) = (2usize, 6usize, 2usize, 32usize, 200usize);
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let new_cache = || KvCache::new(ctx, bsz, cap, hq, hkv, d, cfg, Storage::F32).unwrap();
    let (mut chunked, mut stepped) = (new_cache(), new_cache());
    let mut r = rng(seed("decode_chunk"));
    // Both caches start from the same 50 (sequence 0) and 33 (sequence 1) tokens.
    for (seq, p) in [(0usize, 50usize), (1, 33)] {
        let (k, v) = (
            random(&mut r, hkv * p * d, 1.0),
            random(&mut r, hkv * p * d, 1.0),
        );
        for c in [&mut chunked, &mut stepped] {
            c.prefill(seq, &k, &v, TensorLayout::Bhnd).unwrap();
        }
    }
    for t_n in [7usize, 4] {
        let (q, k, v) = (
            app_buffer(ctx, &random(&mut r, bsz * hq * t_n * d, 1.0)),
            app_buffer(ctx, &random(&mut r, bsz * hkv * t_n * d, 1.0)),
            app_buffer(ctx, &random(&mut r, bsz * hkv * t_n * d, 1.0)),
        );
        let (qv, kv, vv) = (
            bhnd_f32(&q, [bsz, hq, t_n, d]),
            bhnd_f32(&k, [bsz, hkv, t_n, d]),
            bhnd_f32(&v, [bsz, hkv, t_n, d]),
        );
        let (o, l) = (
            app_buffer(ctx, &vec![f32::NAN; bsz * hq * t_n * d]),
            app_buffer(ctx, &vec![f32::NAN; bsz * hq * t_n]),
        );
        let (ov, lv) = (
            bhnd_f32(&o, [bsz, hq, t_n, d]),
            bhnd_f32(&l, [bsz, hq, t_n, 1]),
        );
        let outs = ChunkOutputs { out: &ov, lse: &lv };
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        // Bad calls first: nothing is recorded, nothing changes.
        let e = chunked
            .record_chunk(&mut enc, &kv, &kv, &vv, &outs, None)
            .unwrap_err();
        assert!(matches!(e, GpuError::View(_)), "{e}");
        let bad = TensorView::new(&o, 0, DType::I32, ov.shape(), ov.strides()).unwrap();
        let e = chunked
            .record_chunk(
                &mut enc,
                &qv,
                &kv,
                &vv,
                &ChunkOutputs {
                    out: &bad,
                    lse: &lv,
                },
                None,
            )
            .unwrap_err();
        assert!(matches!(e, GpuError::View(_)), "{e}");
        // An i32 query, a k of another T, and outputs over the queries are refused too.
        let q32 = TensorView::new(&q, 0, DType::I32, qv.shape(), qv.strides()).unwrap();
        let e = chunked
            .record_chunk(&mut enc, &q32, &kv, &vv, &outs, None)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::View(ref m) if m.contains("I32")),
            "{e}"
        );
        // i32 keys and values loaded into a cache are refused as well (they were copied as raw
        // bits into the f32 cache), and the sequence keeps its length.
        let k1 = bhnd_f32(&k, [1, hkv, t_n, d]);
        let k32 = TensorView::new(&k, 0, DType::I32, k1.shape(), k1.strides()).unwrap();
        let len0 = chunked.len(0).unwrap();
        for (kk, vv2) in [(&k32, &k1), (&k1, &k32)] {
            let e = chunked.prefill_view(0, kk, vv2).unwrap_err();
            assert!(
                matches!(e, GpuError::View(ref m) if m.contains("I32")),
                "{e}"
            );
        }
        assert_eq!(chunked.len(0).unwrap(), len0);
        let k_short = bhnd_f32(&k, [bsz, hkv, t_n - 1, d]);
        let e = chunked
            .record_chunk(&mut enc, &qv, &k_short, &vv, &outs, None)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::View(ref m) if m.contains("same T")),
            "{e}"
        );
        let over = ChunkOutputs { out: &qv, lse: &lv };
        let e = chunked
            .record_chunk(&mut enc, &qv, &kv, &vv, &over, None)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::View(ref m) if m.contains("share bytes")),
            "{e}"
        );
        assert_eq!(
            chunked.lens(),
            stepped.lens(),
            "a refused chunk changed the lengths"
        );
        let lens = chunked.lens().to_vec();
        chunked
            .record_chunk(&mut enc, &qv, &kv, &vv, &outs, None)
            .unwrap();
        // The same tokens one by one, each step's outputs in a buffer of its own.
        let mut per_token = Vec::new();
        for t in 0..t_n {
            let (ot, lt) = (
                app_buffer(ctx, &vec![f32::NAN; bsz * hq * d]),
                app_buffer(ctx, &vec![f32::NAN; bsz * hq]),
            );
            let (otv, ltv) = (
                bhnd_f32(&ot, [bsz, hq, 1, d]),
                bhnd_f32(&lt, [bsz, hq, 1, 1]),
            );
            let all = [true; 2];
            let (kt, vt) = (kv.tokens(t, 1).unwrap(), vv.tokens(t, 1).unwrap());
            stepped
                .record_append_view(&mut enc, &kt, &vt, &all, None)
                .unwrap();
            let so = StepOutputs {
                out: &otv,
                lse: &ltv,
                selection: None,
            };
            stepped
                .record_step_into(&mut enc, &qv.tokens(t, 1).unwrap(), Some(&so), None)
                .unwrap();
            per_token.push((ot, lt));
        }
        ctx.queue().submit([enc.finish()]);
        assert_eq!(chunked.lens(), stepped.lens());
        assert_eq!(chunked.lens(), &[lens[0] + t_n, lens[1] + t_n][..]);
        let (o_bits, l_bits) = (bits(ctx, &o), bits(ctx, &l));
        assert!(
            o_bits.iter().all(|&x| f32::from_bits(x).is_finite()),
            "O not written"
        );
        for (t, (ot, lt)) in per_token.iter().enumerate() {
            let (want_o, want_l) = (bits(ctx, ot), bits(ctx, lt));
            for bh in 0..bsz * hq {
                let got = &o_bits[(bh * t_n + t) * d..][..d];
                assert_eq!(got, &want_o[bh * d..][..d], "T {t_n} token {t} row {bh}: O");
                assert_eq!(
                    l_bits[bh * t_n + t],
                    want_l[bh],
                    "T {t_n} token {t} row {bh}: LSE"
                );
            }
        }
    }
    // Past the capacity: refused before anything is recorded.
    let t_n = cap;
    let (q, k) = (
        app_buffer(ctx, &vec![0.5; bsz * hq * t_n * d]),
        app_buffer(ctx, &vec![0.5; bsz * hkv * t_n * d]),
    );
    let (o, l) = (
        app_buffer(ctx, &vec![0.0; bsz * hq * t_n * d]),
        app_buffer(ctx, &vec![0.0; bsz * hq * t_n]),
    );
    let (ov, lv) = (
        bhnd_f32(&o, [bsz, hq, t_n, d]),
        bhnd_f32(&l, [bsz, hq, t_n, 1]),
    );
    let kv = bhnd_f32(&k, [bsz, hkv, t_n, d]);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let lens = chunked.lens().to_vec();
    let e = chunked
        .record_chunk(
            &mut enc,
            &bhnd_f32(&q, [bsz, hq, t_n, d]),
            &kv,
            &kv,
            &ChunkOutputs { out: &ov, lse: &lv },
            None,
        )
        .unwrap_err();
    assert!(matches!(e, GpuError::Input(_)), "{e}");
    assert_eq!(chunked.lens(), &lens[..]);
}

/// Regression (found by an embedder's trial): an encoder holding a recorded reset that is
/// dropped leaves the sequence's host length at 0 and its GPU length at the capacity, so a later
/// recorded append passed the host's capacity check and the GPU wrote the key one position past
/// the sequence's rows, into the next sequence's keys (its outputs changed). The append kernel
/// now skips a position past the capacity: sequence 1, never touched, must give the same outputs
/// (bit for bit) before and after. Batch 2, capacity 40 (not a multiple of the block size 16),
/// both sequences full; large key values, so that a stray key would move sequence 1's softmax.
#[test]
fn dropped_reset_leaves_the_other_sequences_alone() {
    let _g = settings_lock();
    let ctx = ctx();
    let mut r = rng(seed("dropped_reset_leaves_the_other_sequences_alone"));
    let (bsz, cap, hq, hkv, d) = (2, 40, 4, 2, 32);
    let cfg = SelectionConfig::new(16, 2).unwrap();
    let mut cache = KvCache::new(ctx, bsz, cap, hq, hkv, d, cfg, Storage::F32).unwrap();
    for b in 0..bsz {
        let k = random(&mut r, hkv * cap * d, 1.0);
        let v = random(&mut r, hkv * cap * d, 1.0);
        cache.prefill(b, &k, &v, TensorLayout::Bhnd).unwrap();
    }
    let q = random(&mut r, bsz * hq * d, 1.0);
    let before = cache.step(&q, false).unwrap();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    cache.record_reset(&mut enc, 0).unwrap();
    drop(enc);
    assert_eq!(
        cache.lens(),
        &[0, cap],
        "the host length changes when recorded"
    );
    let big = app_buffer(ctx, &vec![50.0; bsz * hkv * d]);
    let rows = bhnd_f32(&big, [bsz, hkv, 1, d]);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    cache
        .record_append_view(&mut enc, &rows, &rows, &[true, false], None)
        .unwrap();
    ctx.queue().submit([enc.finish()]);
    let after = cache.step(&q, false).unwrap();
    let s1 = hq * d;
    assert_eq!(
        &after.out[s1..],
        &before.out[s1..],
        "sequence 1's O changed"
    );
    assert_eq!(
        &after.lse[hq..],
        &before.lse[hq..],
        "sequence 1's LSE changed"
    );
    // A reset writes the GPU lengths too: sequence 0 is usable again.
    cache.reset(0).unwrap();
    assert_eq!(cache.lens(), &[0, cap]);
}

/// Regression (found by an embedder's trial): with the host's length of a sequence behind the
/// GPU's (here an encoder holding a recorded reset dropped), appends to it advanced its GPU
/// length past the capacity, and its step then attended the rows past its own: the next
/// sequence's keys and values. The GPU length now stops at the capacity. Sequence 0's outputs
/// are unspecified after the dropped reset, but they must stay a softmax-weighted mean of its
/// own values (all in [-1, 1]) rather than take in sequence 1's (all 1000, under keys that
/// score far above sequence 0's). Batch 2, one KV head (so that the rows past sequence 0's are
/// sequence 1's), capacity 24 (not a multiple of the block size 16), both split and fused.
#[test]
fn lengths_behind_the_gpu_never_read_the_next_sequence() {
    let _g = settings_lock();
    let ctx = ctx();
    let mut r = rng(seed("lengths_behind_the_gpu_never_read_the_next_sequence"));
    let (bsz, cap, hq, hkv, d) = (2, 24, 3, 1, 16);
    let cfg = SelectionConfig::new(16, 2).unwrap();
    for fused in [false, true] {
        let mut cache = KvCache::new(ctx, bsz, cap, hq, hkv, d, cfg, Storage::F32).unwrap();
        cache.set_fused(fused);
        let k0 = random(&mut r, cap * d, 1.0);
        let v0 = random(&mut r, cap * d, 1.0);
        cache.prefill(0, &k0, &v0, TensorLayout::Bhnd).unwrap();
        cache
            .prefill(
                1,
                &vec![4.0; cap * d],
                &vec![1000.0; cap * d],
                TensorLayout::Bhnd,
            )
            .unwrap();
        // The query leans towards sequence 1's keys: q.k = 4 * sum(q) there.
        let q: Vec<f32> = random(&mut r, bsz * hq * d, 1.0)
            .iter()
            .map(|x| x.abs() + 0.5)
            .collect();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        cache.record_reset(&mut enc, 0).unwrap();
        drop(enc);
        assert_eq!(cache.lens(), &[0, cap], "fused {fused}");
        // Three appends: the host counts 1, 2, 3; the GPU's length was the capacity already.
        for _ in 0..3 {
            let rows = random(&mut r, bsz * hkv * d, 1.0);
            cache.append(&rows, &rows, &[true, false]).unwrap();
        }
        let out = cache.step(&q, false).unwrap();
        let seq0 = &out.out[..hq * d];
        assert!(
            seq0.iter().all(|x| x.is_finite() && x.abs() <= 1.0 + 1e-5),
            "fused {fused}: sequence 0 attended rows past its own: {seq0:?}"
        );
        assert!(out.lse[..hq].iter().all(|x| x.is_finite()), "fused {fused}");
        cache.reset(0).unwrap();
    }
}

/// A cache of batch 1, capacity 70, Hq 4, Hkv 2, D 32 (f32, blocks of 16, g 2) holding 50
/// random tokens: the shape of the two tests of a query beside the step's outputs.
fn cache_of_50_tokens(ctx: &Context, r: &mut ChaCha8Rng) -> KvCache {
    let (hkv, d) = (2, 32);
    let cfg = SelectionConfig::new(16, 2).unwrap();
    let mut cache = KvCache::new(ctx, 1, 70, 4, hkv, d, cfg, Storage::F32).unwrap();
    let k = random(r, hkv * 50 * d, 1.0);
    let v = random(r, hkv * 50 * d, 1.0);
    cache.prefill(0, &k, &v, TensorLayout::Bhnd).unwrap();
    cache
}

/// With `cache` set to the fused step (where it fits the device), `record` of a step whose
/// query shares a buffer with its outputs is refused with a `View` error that records nothing
/// (the encoder submits as it is); the cache is left on the split step.
fn fused_refuses(
    ctx: &Context,
    cache: &mut KvCache,
    record: impl FnOnce(&mut wgpu::CommandEncoder, &KvCache) -> pisa_wgpu::Result<()>,
) {
    cache.set_fused(true);
    if cache.is_fused() {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let e = record(&mut enc, cache).unwrap_err();
        assert!(
            matches!(e, GpuError::View(ref m) if m.contains("one buffer")),
            "{e}"
        );
        ctx.queue().submit([enc.finish()]);
    } else {
        eprintln!("the fused step does not fit this device: only the split step is checked");
    }
    cache.set_fused(false);
}

/// Regression (found by an embedder's trial): with the fused step, a query and an output in one
/// buffer (disjoint, aligned ranges) made `record_step_into` succeed and the encoder's `finish`
/// panic inside wgpu (one dispatch binds q read-only and the outputs writable). It is now a
/// `View` error that records nothing; the split step, whose dispatches bind them apart, runs
/// the same views and gives the outputs of separate buffers (bit for bit).
#[test]
fn fused_step_refuses_q_and_output_in_one_buffer() {
    let _g = settings_lock();
    let ctx = ctx();
    let mut r = rng(seed("fused_step_refuses_q_and_output_in_one_buffer"));
    let (bsz, hq, d) = (1, 4, 32);
    let mut cache = cache_of_50_tokens(ctx, &mut r);
    let q = random(&mut r, bsz * hq * d, 1.0);
    let align = ctx.device().limits().min_storage_buffer_offset_alignment as usize / 4;
    let o_at = (bsz * hq * d).div_ceil(align) * align; // O after Q, aligned
    let mut data = q.clone();
    data.resize(o_at + bsz * hq * d, f32::NAN);
    let shared = app_buffer(ctx, &data);
    let qv = bhnd_f32(&shared, [bsz, hq, 1, d]);
    let ov = TensorView::contiguous(
        &shared,
        4 * o_at as u64,
        DType::F32,
        [bsz, hq, 1, d],
        TensorLayout::Bhnd,
    )
    .unwrap();
    let lse = app_buffer(ctx, &vec![f32::NAN; bsz * hq]);
    let lv = bhnd_f32(&lse, [bsz, hq, 1, 1]);
    let so = StepOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    fused_refuses(ctx, &mut cache, |enc, c| {
        c.record_step_into(enc, &qv, Some(&so), None)
    });
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    cache
        .record_step_into(&mut enc, &qv, Some(&so), None)
        .unwrap();
    ctx.queue().submit([enc.finish()]);
    let want = cache.step(&q, false).unwrap();
    let got = ctx.read_bytes(&shared).unwrap();
    let got: &[f32] = bytemuck::cast_slice(&got[4 * o_at..4 * (o_at + bsz * hq * d)]);
    assert_eq!(got, want.out.as_slice());
}

/// Regression: `record_steps_into` with the fused step and a
/// query in the cache's own output buffer (the last step's O fed back as the next query)
/// returned Ok and the submit panicked inside wgpu, while `record_step_into` refused the same
/// query. Both now refuse it with a `View` error that records nothing; the split step, whose
/// dispatches bind them apart, runs it and equals a step of the same query from the host.
#[test]
fn fused_steps_into_refuses_q_in_the_cache_outputs() {
    let _g = settings_lock();
    let ctx = ctx();
    let mut r = rng(seed("fused_steps_into_refuses_q_in_the_cache_outputs"));
    let (bsz, hq, d) = (1, 4, 32);
    let mut cache = cache_of_50_tokens(ctx, &mut r);
    cache
        .step(&random(&mut r, bsz * hq * d, 1.0), false)
        .unwrap();
    let q = cache.outputs().out.clone();
    let n = bsz * hq * d;
    let read = |view: &TensorView| {
        let bytes = ctx.read_bytes(view.buffer()).unwrap();
        let at = view.offset() as usize;
        bytemuck::cast_slice::<u8, f32>(&bytes[at..at + 4 * n]).to_vec()
    };
    let host_q = read(&q);
    assert!(host_q.iter().all(|x| x.is_finite()), "{host_q:?}");
    fused_refuses(ctx, &mut cache, |enc, c| {
        KvCache::record_steps_into(enc, &[(c, &q)], None)
    });
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    KvCache::record_steps_into(&mut enc, &[(&cache, &q)], None).unwrap();
    ctx.queue().submit([enc.finish()]);
    let got = read(cache.outputs().out);
    let want = cache.step(&host_q, false).unwrap();
    assert!(got.iter().all(|x| x.is_finite()), "{got:?}");
    assert_eq!(got, want.out);
}
