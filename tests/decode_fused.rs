//! Tests of the fused decode step (ONE dispatch: routing, every slot's block state, the top-K
//! cut and the attention over the selection in one workgroup per (sequence, KV head); a module
//! of `tests/decode.rs`), whatever `PISA_DECODE` says: against the CPU reference on random
//! inputs with fresh seeds (GQA groups, head dims, C not a power of two, lengths not multiples
//! of C, forced sinks and locals, caches of a few thousand tokens, f16), exact ties, blocks in
//! several passes, several caches in one pass, and against the split step.

use super::common::*;
use super::decode_harness::{base, cfg, Case, Run};
use super::decode_split::check_outputs;
use pisa_core::{Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::Storage;

/// The harness run of `case` on the fused step (asserted to be the path taken).
fn run_fused(case: Case, capacity: usize) -> Run {
    let mut r = Run::new(case, capacity);
    r.cache.set_fused(true);
    assert!(
        r.cache.is_fused(),
        "{}: the fused step does not fit",
        r.case.name
    );
    r.run()
}

/// GQA groups 1, 2, 3, 4, 7, 8 and head dims 64, 80, 128, blocks of C = 12 and 20 keys (not
/// powers of two), caches of 1.3K-3K tokens (lengths not multiples of C) with a sink and one or
/// two local blocks: deep routing (K = 6: over 100 leaves), many slots per step.
#[test]
fn fused_gqa_groups_head_dims_odd_blocks() {
    const NAMES: [&str; 6] = [
        "fused_gqa1_d64",
        "fused_gqa2_d80",
        "fused_gqa3_d128",
        "fused_gqa4_d128",
        "fused_gqa7_d64",
        "fused_gqa8_d80",
    ];
    let cases = [(1, 64), (2, 80), (3, 128), (4, 128), (7, 64), (8, 80)];
    for (i, (g_q, d)) in cases.into_iter().enumerate() {
        let c = if i % 2 == 0 { 12 } else { 20 };
        let cf = cfg(c, 6, 2, Scoring::Lse).with_forced(1, 1 + i % 2);
        let mut cs = base(NAMES[i], 2 * g_q, 2, d, cf);
        cs.prefill = vec![1301 + 311 * i, 2999 - 211 * i];
        cs.steps = 3;
        run_fused(cs, 3100);
    }
}

/// The bench's shape (g_q 4, D 128, C 64, K 16, g 2: 34 candidates and 50 slots) on a 3K-token
/// cache, in f32 and (where the adapter has SHADER_F16) f16, and a wide merge factor (g = 4).
#[test]
fn fused_bench_shape_f32_f16_and_wide_merge() {
    let mut c = base("fused_top16", 8, 2, 128, cfg(64, 16, 2, Scoring::Lse));
    c.prefill = vec![3001];
    c.steps = 3;
    run_fused(c, 3100);
    if ctx().has_f16() {
        let mut c = base("fused_top16_f16", 8, 2, 128, cfg(64, 16, 2, Scoring::Lse));
        c.storage = Storage::F16;
        c.prefill = vec![2777];
        c.steps = 3;
        run_fused(c, 2800);
    } else {
        eprintln!("fused f16: skipped, no SHADER_F16 on this adapter");
    }
    let mut c = base(
        "fused_top16_g4",
        4,
        1,
        64,
        cfg(4, 16, 4, Scoring::Lse).with_forced(1, 2),
    );
    c.prefill = vec![1203];
    c.steps = 4;
    run_fused(c, 1300);
}

/// The ablation scores (`mean`, `meanvar`), no causal mask, and a batch of different lengths
/// (an empty sequence, a short one that sees K or fewer leaves, growing ones), BNHD prefill.
#[test]
fn fused_scorings_non_causal_and_batches() {
    let cf = cfg(10, 4, 3, Scoring::MeanVar).with_forced(1, 1);
    let mut c = base("fused_meanvar", 6, 2, 64, cf);
    c.prefill = vec![523, 0, 31];
    c.steps = 12;
    c.active = 0.8;
    c.layout = TensorLayout::Bnhd;
    run_fused(c, 600);
    let mut c = base("fused_mean", 3, 1, 80, cfg(6, 5, 2, Scoring::Mean));
    c.prefill = vec![777, 5];
    c.steps = 12;
    run_fused(c, 800);
    let mut c = base(
        "fused_non_causal",
        4,
        2,
        64,
        cfg(12, 4, 2, Scoring::Lse).with_causal(false),
    );
    c.prefill = vec![250, 45];
    c.steps = 12;
    run_fused(c, 300);
}

/// Every key the same vector: complete blocks tie exactly, so the selection must follow the tie
/// rule (lower block first) with no margin allowance; blocks fall at different places in the
/// passes, which must not change their scores.
#[test]
fn fused_exact_ties_prefer_lower_blocks() {
    let mut c = base("fused_ties", 4, 2, 64, cfg(4, 3, 2, Scoring::Lse));
    c.prefill = vec![100, 61];
    c.steps = 12;
    c.tied = true;
    run_fused(c, 130);
    let mut c = base("fused_ties_k16", 8, 2, 128, cfg(64, 16, 2, Scoring::Lse));
    c.prefill = vec![2500];
    c.steps = 2;
    c.tied = true;
    run_fused(c, 2600);
}

/// The smallest workgroup memory at which the step still runs fused: fewer lanes per key, then
/// fewer keys of a block per pass (a block's state merged over passes); results as the
/// reference.
#[test]
fn fused_blocks_over_several_passes() {
    let mut c = base("fused_chunks", 4, 2, 64, cfg(64, 4, 2, Scoring::Lse));
    c.prefill = vec![701, 290];
    c.steps = 6;
    let mut r = Run::new(c, 800);
    r.cache.set_fused(true);
    let full = r.cache.fused_workgroup_memory().expect("fused fits");
    let (mut lo, mut hi) = (0u32, full as u32);
    while hi - lo > 4 {
        let mid = (lo + hi) / 2;
        let fits = r.cache.set_workgroup_memory_limit(mid).is_ok()
            && r.cache.fused_workgroup_memory().is_some();
        if fits {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    r.cache.set_workgroup_memory_limit(hi).unwrap();
    assert!(r.cache.is_fused());
    assert_eq!(r.cache.decode_step(), pisa_wgpu::DecodeStep::Fused);
    let least = r.cache.workgroup_memory();
    assert!(least < full, "{least} vs {full}");
    eprintln!("fused_chunks: {least} bytes (full {full})");
    r.run();
}

/// `KvCache::record_steps` of fused caches (the KV heads of one cache split over two) in ONE
/// pass of one dispatch each: bitwise the single fused cache's outputs; a fused and a split
/// cache in one pass: each bitwise its own path's.
#[test]
fn fused_steps_of_several_caches_in_one_pass() {
    let ctx = ctx();
    let cf = cfg(8, 4, 2, Scoring::Lse).with_forced(1, 0);
    let (hq, hkv, d, n) = (6, 2, 32, 151);
    let g = hq / hkv;
    let mut r = rng(seed("fused_several_caches"));
    let k = random(&mut r, hkv * n * d, 1.0);
    let v = random(&mut r, hkv * n * d, 1.0);
    let q = random(&mut r, hq * d, 1.5);
    let want = |fused: bool| {
        let mut full = KvCache::new(ctx, 1, n, hq, hkv, d, cf, Storage::F32).unwrap();
        full.set_fused(fused);
        full.prefill(0, &k, &v, TensorLayout::Bhnd).unwrap();
        full.step(&q, true).unwrap()
    };
    let (want_f, want_s) = (want(true), want(false));
    let qs: Vec<_> = (0..hkv)
        .map(|h| {
            ctx.upload("q", &q[h * g * d..(h + 1) * g * d], Storage::F32)
                .unwrap()
        })
        .collect();
    for mixed in [false, true] {
        let caches: Vec<KvCache> = (0..hkv)
            .map(|h| {
                let mut c = KvCache::new(ctx, 1, n, g, 1, d, cf, Storage::F32).unwrap();
                c.set_fused(!(mixed && h == 1));
                let rows = h * n * d..(h + 1) * n * d;
                c.prefill(0, &k[rows.clone()], &v[rows], TensorLayout::Bhnd)
                    .unwrap();
                c
            })
            .collect();
        let steps: Vec<_> = caches.iter().zip(&qs).collect();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        KvCache::record_steps(&mut enc, &steps, None).unwrap();
        ctx.queue().submit([enc.finish()]);
        for (h, c) in caches.iter().enumerate() {
            let w = if c.is_fused() { &want_f } else { &want_s };
            let sel = w.selection.clone().unwrap();
            let one = std::slice::from_ref(c);
            let part = pisa_wgpu::ops::decode::DecodeOutput {
                out: w.out[h * g * d..].to_vec(),
                lse: w.lse[h * g..].to_vec(),
                selection: None,
            };
            check_outputs(ctx, one, &part, &sel[h * cf.top_k..], (g, d, cf.top_k));
        }
    }
}

/// The fused and the split step on the same caches (fresh ones, outputs poisoned): same
/// selection unless within the reference's tie margin, outputs within f32 rounding.
#[test]
fn fused_agrees_with_split() {
    let ctx = ctx();
    for (hq, hkv, d, cf, n) in [
        (8, 2, 128, cfg(64, 16, 2, Scoring::Lse), 2345usize),
        (
            14,
            2,
            80,
            SelectionConfig::new(20, 5)
                .unwrap()
                .with_merge_factor(3)
                .with_forced(2, 1),
            1999,
        ),
    ] {
        let mut r = rng(seed("fused_vs_split") ^ n as u64);
        let k = random(&mut r, hkv * n * d, 1.0);
        let v = random(&mut r, hkv * n * d, 1.0);
        let q = random(&mut r, hq * d, 1.5);
        let run = |fused: bool| {
            let mut c = KvCache::new(ctx, 1, n, hq, hkv, d, cf, Storage::F32).unwrap();
            c.set_fused(fused);
            assert_eq!(c.is_fused(), fused);
            c.prefill(0, &k, &v, TensorLayout::Bhnd).unwrap();
            c.step(&q, true).unwrap()
        };
        let (f, s) = (run(true), run(false));
        let (fs, ss) = (f.selection.as_ref().unwrap(), s.selection.as_ref().unwrap());
        // A KV head whose two selections differ must be a near-tie of the reference (its own
        // margin, not any head's) and its query heads' outputs are not compared; every other
        // KV head's are.
        let shape = pisa_core::AttentionShape::new(1, hq, hkv, 1, n, d).unwrap();
        let want =
            pisa_core::reference::select_pisa(&q, &k, &shape, TensorLayout::Bhnd, &cf).unwrap();
        let tie = tie_tol_of(&shape, &cf, &q, &k, Storage::F32);
        let (kk, g) = (cf.top_k, hq / hkv);
        let mut compared = 0;
        for h in 0..hkv {
            let rows = h * kk..(h + 1) * kk;
            if fs[rows.clone()] != ss[rows.clone()] {
                let m = want.margin[h];
                assert!(
                    m < tie,
                    "n {n} kv head {h}: fused {:?} split {:?}, reference margin {m:.3e} (tie tolerance {tie:.1e})",
                    &fs[rows.clone()],
                    &ss[rows]
                );
                eprintln!("fused_agrees_with_split: n {n} kv head {h} differs within a near-tie");
                continue;
            }
            let out = h * g * d..(h + 1) * g * d;
            let want: Vec<f64> = s.out[out.clone()].iter().map(|&x| x as f64).collect();
            let e = rel_err(&f.out[out], &want);
            assert!(e <= 1e-5, "n {n} kv head {h}: output rel err {e}");
            for (a, b) in f.lse[h * g..(h + 1) * g]
                .iter()
                .zip(&s.lse[h * g..(h + 1) * g])
            {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "lse {a} vs {b}");
            }
            compared += 1;
        }
        assert!(compared > 0, "n {n}: no KV head's outputs compared");
    }
}

/// An empty sequence's row is written in full when K exceeds the fused workgroup.
#[test]
fn fused_empty_sequence_with_top_k_past_workgroup() {
    super::decode_harness::empty_beside_top_k_past_workgroup("fused_empty_k300", true);
}

/// A block of 2^20 keys (the largest block size a configuration takes): on a device that caps
/// an invocation's loop iterations (llvmpipe, `Context::loop_limit`) the fused kernel's passes
/// over the block would run past the cap and end early, silently (a head's LSE came out NaN),
/// so the cache runs the split step there; where the device has no cap the step stays fused.
/// Either way the results are the reference's.
#[test]
fn fused_step_past_the_loop_limit_runs_split() {
    let mut c = base(
        "fused_block_2e20",
        2,
        1,
        16,
        cfg(1 << 20, 16, 2, Scoring::Lse),
    );
    c.prefill = vec![150];
    c.steps = 3;
    let mut r = Run::new(c, 200);
    r.cache.set_fused(true);
    let capped = ctx().loop_limit().is_some();
    assert_eq!(
        r.cache.is_fused(),
        !capped,
        "loop limit {:?}",
        ctx().loop_limit()
    );
    r.run();
}
