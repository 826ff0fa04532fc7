//! Split-K dense attention (`ops/attention/split_k.rs`, FlashDecoding) against the f64 CPU
//! reference: few queries (1..5) against key lengths from the rule's threshold up, not
//! multiples of the split size, GQA groups 1, 2, 3, 4, 7, 8, head dims 16 to 256, every
//! combination of Q / K / V layouts, f32 and f16 storage, causal and not; explicit plans with
//! tiny splits (more than the merge's 256 invocations take at once), one split longer than the
//! keys, one pair per range (a multi-dispatch pass), and a partial dispatch past 65535
//! workgroups; the automatic rule; the binding-limit ranges; typed errors. Tolerances as
//! `attention_util.rs` (relative L2 error of O and LSE at most 1e-4 for f32 storage, 5e-3 for
//! f16); outputs start poisoned, so an unwritten element fails. Helpers: `attention_split_util.rs`.
#[path = "attention_util.rs"]
mod attention_util;
mod common;
#[path = "attention_split_util.rs"]
mod split_util;

use attention_util::skip_f16;
use common::*;
use pisa_core::{AttentionShape, PisaError};
use pisa_wgpu::ops::attention::split_k::{self, SplitK};
use pisa_wgpu::{AdapterChoice, Context, GpuError, Storage};
use rand::Rng;
use split_util::{exec, prepare, run, Call, LAYOUTS};

/// The default path (record_attention, no tiling) on decode-like shapes: GQA groups 1, 2, 3, 4, 7
/// and 8, 1..5 queries, key lengths from the threshold to a few hundred above it.
#[test]
fn default_path_matches_reference() {
    let ctx = ctx();
    let seed = seed("split-K default path");
    let mut r = rng(seed);
    let mut n = 0;
    for (i, g) in [1, 2, 3, 4, 7, 8].into_iter().enumerate() {
        for j in 0..2 {
            let case = 2 * i + j;
            let storage = [Storage::F32, Storage::F16][case % 2];
            if skip_f16(ctx, storage) {
                continue;
            }
            let (b, hkv) = [(1, 2), (2, 1)][j];
            let q_len = 1 + case % 5;
            let d = [64, 80, 128][case % 3];
            let k_len = if case == 0 {
                2048
            } else {
                2049 + r.random_range(0..300)
            };
            let s = AttentionShape::new(b, hkv * g, hkv, q_len, k_len, d).unwrap();
            let plan = split_k::plan(ctx, &s, storage);
            assert!(
                plan.is_some(),
                "{s:?} {storage:?}: the rule must pick split-K"
            );
            let c = Call {
                s,
                layouts: LAYOUTS[case % 4],
                storage,
                causal: case % 3 != 1,
                plan: None,
            };
            let what = format!(
                "{s:?} {:?} {storage:?} causal {} {plan:?} seed {seed}",
                c.layouts, c.causal
            );
            run(ctx, &mut r, &c, &what);
            n += 1;
        }
    }
    assert!(n >= 6);
}

/// Explicit plans: tiny splits (600 splits: three of the merge's chunks), one pair per
/// range (several ranges in one pass), a split longer than the keys, head dims 16 and 256.
#[test]
fn explicit_plans_match_reference() {
    let ctx = ctx();
    let seed = seed("split-K explicit plans");
    let mut r = rng(seed);
    // (B, Hq, Hkv, Nq, Nk, D, S, pairs per range, storage, causal, layouts)
    let cases = [
        (2, 6, 3, 3, 301, 64, 7, 1, Storage::F32, true, 0),
        (1, 8, 1, 5, 600, 128, 1, 1, Storage::F16, true, 2),
        (2, 4, 2, 2, 130, 80, 1000, 1, Storage::F32, false, 3),
        (1, 14, 2, 4, 97, 16, 5, 2, Storage::F16, false, 1),
        (1, 3, 1, 1, 77, 256, 13, 1, Storage::F32, true, 2),
        (2, 2, 2, 5, 90, 128, 33, 3, Storage::F32, true, 1),
    ];
    for (b, hq, hkv, nq, nk, d, sk, ppr, storage, causal, li) in cases {
        if skip_f16(ctx, storage) {
            continue;
        }
        let s = AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
        let plan = SplitK {
            split_keys: sk,
            pairs_per_range: ppr,
        };
        let c = Call {
            s,
            layouts: LAYOUTS[li],
            storage,
            causal,
            plan: Some(plan),
        };
        let what = format!("{s:?} {plan:?} {storage:?} causal {causal} seed {seed}");
        run(ctx, &mut r, &c, &what);
    }
}

/// One key per split over 65600 keys: 65600 partial workgroups, a grid split past the
/// per-dimension limit of 65535.
#[test]
fn partial_dispatch_past_65535_workgroups() {
    let ctx = ctx();
    let seed = seed("split-K many workgroups");
    let mut r = rng(seed);
    let s = AttentionShape::new(1, 1, 1, 1, 65600, 64).unwrap();
    let plan = SplitK {
        split_keys: 1,
        pairs_per_range: 1,
    };
    let layouts = LAYOUTS[0];
    let c = Call {
        s,
        layouts,
        storage: Storage::F32,
        causal: true,
        plan: Some(plan),
    };
    run(ctx, &mut r, &c, &format!("{s:?} {plan:?} seed {seed}"));
}

/// The rule: split-K for decode shapes (the 1M-key decode baseline among them), the tile kernel
/// for prefill, for too many rows, too few keys or a tile grid that already fills the GPU; and
/// `record_attention` really runs the plan (bitwise equal to `record_split_k` with it).
#[test]
fn rule_picks_split_k_for_decode_and_tiles_for_prefill() {
    let ctx = ctx();
    let sh = |b, hq, hkv, nq, nk, d| AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
    let decode = sh(1, 32, 8, 1, 1 << 20, 128);
    assert_eq!(split_k::tile_workgroups(&decode), 8);
    for st in [Storage::F16, Storage::F32] {
        let p = split_k::plan(ctx, &decode, st).expect("decode baseline takes split-K");
        let splits = decode.k_len.div_ceil(p.split_keys);
        eprintln!("decode baseline {st:?}: {p:?}, {splits} splits");
        assert!((256..=4096).contains(&(8 * splits)), "{p:?}");
    }
    let yes = [
        sh(1, 32, 8, 1, 2048, 128),
        sh(4, 32, 8, 4, 100_000, 64),
        sh(1, 64, 8, 8, 32768, 128),
        sh(64, 32, 8, 1, 8192, 128),
        sh(1, 32, 8, 3, 65536, 128),
    ];
    for s in yes {
        assert!(split_k::plan(ctx, &s, Storage::F16).is_some(), "{s:?}");
        // Split-K reads f32 or f16 words: never planned for bf16 (the tile kernels read it).
        assert!(split_k::plan(ctx, &s, Storage::Bf16).is_none(), "{s:?}");
    }
    let no = [
        sh(1, 32, 8, 4096, 4096, 128),  // prefill
        sh(1, 32, 8, 2048, 65536, 128), // chunked prefill: many rows
        sh(1, 32, 8, 17, 65536, 128),   // 68 rows
        sh(1, 32, 8, 1, 2047, 128),     // few keys
        sh(128, 32, 8, 1, 8192, 128),   // 1024 tile workgroups
    ];
    for s in no {
        assert!(split_k::plan(ctx, &s, Storage::F16).is_none(), "{s:?}");
    }
    let seed = seed("split-K rule");
    let s = sh(1, 8, 2, 2, 2500, 64);
    let plan = split_k::plan(ctx, &s, Storage::F32);
    let mut c = Call {
        s,
        layouts: LAYOUTS[2],
        storage: Storage::F32,
        causal: true,
        plan: None,
    };
    let a = run(
        ctx,
        &mut rng(seed),
        &c,
        &format!("{s:?} default seed {seed}"),
    );
    c.plan = plan;
    let b = run(
        ctx,
        &mut rng(seed),
        &c,
        &format!("{s:?} {plan:?} seed {seed}"),
    );
    assert!(
        a == b,
        "record_attention did not run split-K's plan {plan:?}"
    );
}

/// A low storage-binding limit: the plan puts fewer pairs in a range (several ranges, one pass)
/// and the result is bitwise the one-range result; an explicit plan past the limit, a zero split
/// and a bad head dim are typed errors.
#[test]
fn binding_limit_ranges_and_errors() {
    let ctx = Context::new(&AdapterChoice::HighPerformance).expect("a GPU adapter");
    let seed = seed("split-K ranges");
    let s = AttentionShape::new(2, 6, 3, 1, 2100, 64).unwrap();
    let whole = split_k::plan(&ctx, &s, Storage::F32).unwrap();
    assert_eq!(whole.pairs_per_range, 6);
    let c = Call {
        s,
        layouts: LAYOUTS[1],
        storage: Storage::F32,
        causal: false,
        plan: None,
    };
    let x = prepare(&ctx, &mut rng(seed), &c);
    let a = exec(&ctx, &c, &x, &format!("{s:?} {whole:?} seed {seed}"));
    let up = |n: usize| ctx.upload("t", &vec![0.5; n], Storage::F32).unwrap();
    let (q, kv) = (up(s.q_elems()), up(s.kv_elems()));
    // One pair's partial states: splits * 4 rows (one row block, padded) * 64 * 4 bytes.
    let per_pair = (2100usize.div_ceil(whole.split_keys) * 4 * 64 * 4) as u64;
    ctx.set_max_binding_bytes(2 * per_pair + 100);
    let limited = split_k::plan(&ctx, &s, Storage::F32).unwrap();
    assert_eq!(limited.split_keys, whole.split_keys);
    assert_eq!(limited.pairs_per_range, 2);
    // The inputs were uploaded before the limit: run the limited plan on them.
    let c = Call {
        plan: Some(limited),
        ..c
    };
    let b = exec(&ctx, &c, &x, &format!("{s:?} {limited:?} seed {seed}"));
    assert!(a == b, "3 ranges differ from one range");
    let go = |s: &AttentionShape, plan: SplitK| {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let l = LAYOUTS[0];
        split_k::record_split_k(&ctx, &mut enc, &q, &kv, &kv, s, l, (true, 0.1), &plan, None)
            .map(|_| ())
    };
    let e = go(
        &s,
        SplitK {
            pairs_per_range: 6,
            ..whole
        },
    );
    assert!(matches!(e, Err(GpuError::Limit { .. })), "{e:?}");
    let e = go(
        &s,
        SplitK {
            split_keys: 0,
            pairs_per_range: 1,
        },
    );
    assert!(
        matches!(e, Err(GpuError::Input(PisaError::InvalidValue { .. }))),
        "{e:?}"
    );
    let bad = AttentionShape::new(2, 6, 3, 1, 2100, 72).unwrap();
    let e = go(&bad, whole);
    assert!(
        matches!(e, Err(GpuError::Input(PisaError::HeadDim { .. }))),
        "{e:?}"
    );
}
