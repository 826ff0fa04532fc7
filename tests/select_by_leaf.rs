//! Leaf-major stage 2 of PISA selection (`ops::leaf_select::by_leaf`: bucket the candidates by
//! leaf, score chunks of each leaf's queries, pick; PISA.md 3 and 5) against the CPU reference
//! `select_pisa`. Every test of this binary sets `LeafOrder::Leaves` on the shared context, so
//! the whole binary runs the leaf-major path: the portable scorer (`leaf_score.wgsl`) on
//! adapters without cooperative matrices (lavapipe, CI), the tensor-core scorer
//! (`leaf_score_coop.wgsl`) for supported f16 shapes where they exist. Cases: GQA groups 1, 2,
//! 3, 4, 7, 8 and 32, head dims 32 to 256, lengths that are not multiples of the block, both
//! layouts, every scoring, causal and not, forced blocks, Nq < Nk, batch 2, f32 and f16, and
//! more candidate slots per query (260) than a pick workgroup has invocations. A GPU
//! row may differ from the reference only where the reference's margin is a near-tie
//! (`select_util::check`, at most 5% of the rows); Qtile 1 and 4 each so (the leaf-major path
//! does not depend on Qtile: two runs judged alike). `by_leaf_path_is_taken` checks, through
//! the profiler stages, that the leaf-major path runs (a failure where the GPU runs of the
//! test binaries require the NVIDIA path and the device has no timestamps).
mod common;
#[path = "select_util.rs"]
mod select_util;

use common::*;
use pisa_wgpu::ops::select::{build_pyramid, select, Layouts, Method};
use pisa_wgpu::{LeafOrder, Profiler, Storage};
use select_util::{base, group_cases, length_cases, run_case, run_short_lengths, Case};

use Storage::*;

fn leaves() {
    ctx().set_leaf_order(LeafOrder::Leaves);
    assert_eq!(ctx().leaf_order(), LeafOrder::Leaves);
    // The context's scorer: the NVIDIA one (shaders/nv/leaf_score.comp) by default where the
    // device has VK_NV_cooperative_matrix2, the WGSL one with PISA_NV_SCORER=0 (the GPU runs
    // take both) and on every other device.
    if ctx().nv_scorer() && std::env::var("PISA_REQUIRE_NV_CM2").as_deref() == Ok("1") {
        assert!(
            ctx().nv_cm2(),
            "no VK_NV_cooperative_matrix2 (PISA_REQUIRE_NV_CM2=1)"
        );
    }
}

#[test]
fn by_leaf_groups_head_dims_and_scorings() {
    leaves();
    let mut r = rng(seed("by_leaf_groups_head_dims_and_scorings"));
    let base = base();
    let [gq1, gq2, gq3, gq4, gq7, (_, gq8)] = group_cases();
    let cases = [
        gq1,
        gq2,
        gq3,
        (
            "gq4 d128 C64 K16 f16 (the benchmark shape, short)",
            Case {
                b: 1,
                hq: 8,
                nq: 1500,
                nk: 1500,
                d: 128,
                c: 64,
                k: 16,
                storage: F16,
                ..base
            },
        ),
        gq4,
        gq7,
        (
            "gq8 d64 meanvar bnhd b2 f16",
            Case {
                storage: F16,
                ..gq8
            },
        ),
        (
            "gq32 d32 C20",
            Case {
                b: 1,
                hq: 32,
                hkv: 1,
                nq: 211,
                nk: 211,
                d: 32,
                c: 20,
                k: 4,
                ..base
            },
        ),
    ];
    for (name, c) in cases {
        run_case(name, c, &mut r, true);
    }
}

#[test]
fn by_leaf_lengths_and_partial_blocks() {
    leaves();
    let mut r = rng(seed("by_leaf_lengths_and_partial_blocks"));
    let [decode_like, (_, partial)] = length_cases();
    let cases = [
        decode_like,
        (
            "non-causal partial last block bnhd sink1 f16",
            Case {
                storage: F16,
                ..partial
            },
        ),
        (
            // g * (K + 1) = 260 candidate slots per query: more than a pick workgroup's 256
            // invocations, so one query's entries take two trips of its loops.
            "K64 g4 local2 C4 (MC 260)",
            Case {
                b: 1,
                hq: 2,
                hkv: 1,
                nq: 371,
                nk: 371,
                d: 16,
                c: 4,
                k: 64,
                g: 4,
                local: 2,
                ..base()
            },
        ),
        (
            "n 2099 d32 K8 C100",
            Case {
                b: 1,
                hq: 1,
                hkv: 1,
                nq: 2099,
                nk: 2099,
                d: 32,
                c: 100,
                k: 8,
                ..base()
            },
        ),
    ];
    for (name, c) in cases {
        run_case(name, c, &mut r, true);
    }
    run_short_lengths(&mut r, &[1, 15, 17, 70]);
}

/// The leaf-major path really runs (no silent fall-back to the query tiles): its profiler stages
/// ("leaf_bucket", "leaf_score", "leaf_pick") appear and the tile kernel's ("leaf_select") does
/// not, for f32 and (where the adapter has it) f16 storage, i.e. the portable scorer on lavapipe
/// and the tensor-core one where cooperative matrices exist. Skipped without timestamp queries.
#[test]
fn by_leaf_path_is_taken() {
    leaves();
    let ctx = ctx();
    let mut r = rng(seed("by_leaf_path_is_taken"));
    for storage in [F32, F16] {
        if storage == F16 && !ctx.has_f16() {
            continue;
        }
        let c = Case {
            b: 1,
            hq: 8,
            nq: 700,
            nk: 700,
            d: 128,
            c: 64,
            k: 4,
            storage,
            ..base()
        };
        let (q, k) = c.inputs(&mut r);
        let (shape, cfg) = (c.shape(), c.cfg());
        let qt = ctx.upload("q", &q, storage).unwrap();
        let kt = ctx.upload("k", &k, storage).unwrap();
        let mut prof = Profiler::new(ctx, 16);
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let pyr = build_pyramid(ctx, &mut enc, &kt, &shape, c.layout, &cfg).unwrap();
        let layouts = Layouts::new(c.layout, &shape);
        let sel = select(
            ctx,
            &qt,
            &kt,
            Some(&pyr),
            &shape,
            &layouts,
            &cfg,
            Method::Pisa,
            4,
            &mut enc,
            Some(&mut prof),
        )
        .unwrap();
        ctx.queue().submit([enc.finish()]);
        let t = prof.finish(ctx).unwrap();
        if !t.gpu {
            skip_unless_required("by_leaf_path_is_taken: no timestamp queries");
            return;
        }
        let names: Vec<&str> = t.stages.iter().map(|s| s.0.as_str()).collect();
        for stage in ["leaf_bucket", "leaf_score", "leaf_pick"] {
            assert!(names.contains(&stage), "{storage:?}: stages {names:?}");
        }
        assert!(
            !names.contains(&"leaf_select"),
            "{storage:?}: stages {names:?}"
        );
        let got = ctx.read_i32(&sel).unwrap();
        assert!(
            got.iter().all(|&x| x >= -1),
            "{storage:?}: unwritten selection"
        );
    }
}
