//! The decode plans' workgroup-memory accounting against the shaders: for each kernel, the
//! bytes of the `var<workgroup>` globals its entry point uses (naga's own type sizes, after the
//! plan's constants are substituted) must not exceed what [`Plan`] / [`FusedPlan`] charge, so a
//! kernel that passes the plan's check cannot fail pipeline creation on a device at the limit.

use super::super::fused::FusedPlan;
use super::super::{
    FUSED_SHADER, MERGE_SHADER, ROUTE_LEAF_MERGE_SG_SHADER, ROUTE_LEAF_MERGE_SHADER,
    ROUTE_LEAF_SG_SHADER, ROUTE_LEAF_SHADER, ROUTE_SG_SHADER, ROUTE_SHADER, SHADER,
};
use super::*;
use crate::runtime::pipeline::{assert_workgroup_fits, Storage};

#[test]
fn workgroup_memory_accounting_covers_the_shaders() {
    let limits = wgpu::Limits {
        max_compute_workgroup_size_x: 1024,
        ..Default::default()
    };
    // (g_q, D, C, K, g, scoring): the bench shape, small and large K, g = 3 and 4, every scoring.
    let cases = [
        (4, 128, 64, 16, 2, Scoring::Lse),
        (1, 64, 16, 4, 2, Scoring::MeanVar),
        (7, 80, 32, 8, 3, Scoring::Lse),
        (8, 32, 8, 40, 2, Scoring::Mean),
        (2, 128, 64, 16, 4, Scoring::Lse),
        (1, 4, 1, 300, 2, Scoring::Lse),
    ];
    let mut checked = 0;
    let mut sg_checked = 0;
    let mut rl_checked = 0;
    let mut rlm_checked = 0;
    for (gq, d, c, k, g, scoring) in cases {
        let cfg = SelectionConfig::new(c, k)
            .unwrap()
            .with_merge_factor(g)
            .with_scoring(scoring);
        for (cap, mem) in [
            (1024u32, 48u32 << 10),
            (256, 48 << 10),
            (64, 48 << 10),
            (256, 8 << 10),
        ] {
            let mut lim = limits.clone();
            lim.max_compute_invocations_per_workgroup = cap;
            lim.max_compute_workgroup_storage_size = mem;
            let Ok(plan) = Plan::new(&lim, gq, d, &cfg) else {
                continue; // (a typed Limit error: nothing to check)
            };
            checked += 1;
            let what = format!("g_q {gq} D {d} C {c} K {k} g {g} {scoring:?}, {cap} x {mem} bytes");
            for (shader, entry, wg) in [
                (&ROUTE_SHADER, "route", plan.wr),
                (&SHADER, "leaf", plan.wg),
                (&MERGE_SHADER, "merge", plan.wm),
            ] {
                let consts = plan.consts(wg);
                assert_workgroup_fits(shader, entry, Storage::F32, &consts, plan.smem, &what);
            }
            // The route and the leaf in one kernel (both level steps), where it fits.
            if let Some((nb, _)) = plan.route_leaf_blocks(mem as u64, false) {
                let charged = plan.route_leaf_smem(nb);
                let consts = plan.route_leaf_consts(plan.consts(plan.wr).to_vec(), nb);
                let rl = &ROUTE_LEAF_SHADER;
                assert_workgroup_fits(rl, "route_leaf", Storage::F32, &consts, charged, &what);
                if let Some(lr) = plan.route_subgroup_lanes(32, scoring == Scoring::Lse) {
                    let consts = plan.route_leaf_consts(plan.route_subgroup_consts(lr, 32), nb);
                    let rl = &ROUTE_LEAF_SG_SHADER;
                    assert_workgroup_fits(rl, "route_leaf", Storage::F32, &consts, charged, &what);
                }
                rl_checked += 1;
            }
            // ... and with the merge in its last workgroup, where that fits.
            if let Some((nb, _)) = plan.route_leaf_blocks(mem as u64, true) {
                let charged = plan.route_leaf_merge_smem(nb);
                let consts = plan.route_leaf_consts(plan.consts(plan.wr).to_vec(), nb);
                let (rl, entry) = (&ROUTE_LEAF_MERGE_SHADER, "route_leaf_merge");
                assert_workgroup_fits(rl, entry, Storage::F32, &consts, charged, &what);
                if let Some(lr) = plan.route_subgroup_lanes(32, scoring == Scoring::Lse) {
                    let consts = plan.route_leaf_consts(plan.route_subgroup_consts(lr, 32), nb);
                    let rl = &ROUTE_LEAF_MERGE_SG_SHADER;
                    assert_workgroup_fits(rl, entry, Storage::F32, &consts, charged, &what);
                }
                rlm_checked += 1;
            }
            // The route with its subgroup level steps, where it runs on 32-lane subgroups.
            if let Some(lr) = plan.route_subgroup_lanes(32, scoring == Scoring::Lse) {
                let consts = plan.route_subgroup_consts(lr, 32);
                let sg = &ROUTE_SG_SHADER;
                assert_workgroup_fits(sg, "route", Storage::F32, &consts, plan.smem, &what);
                sg_checked += 1;
            }
            if let Some(fp) = FusedPlan::new(&lim, gq, d, &cfg, None) {
                let consts = fp.consts(&plan);
                assert_workgroup_fits(
                    &FUSED_SHADER,
                    "fused",
                    Storage::F32,
                    &consts,
                    fp.smem,
                    &what,
                );
            }
        }
    }
    // Every case fits at 48 KiB (18 plans); some fit at 8 KiB.
    assert!(checked > 18, "only {checked} plans checked");
    assert!(sg_checked > 8, "only {sg_checked} subgroup routes checked");
    assert!(
        rl_checked > 12,
        "only {rl_checked} route_leaf kernels checked"
    );
    assert!(
        rlm_checked > 12,
        "only {rlm_checked} route_leaf_merge kernels checked"
    );
}

/// The fused kernel's bound on an invocation's loop iterations: the bench's shape (GQA 4, D 128,
/// C 64, K 16, g 2), the fused tests' shapes and a K of 40 stay within llvmpipe's 65535 on a
/// pyramid of 15 levels (1M tokens of C 64), so they run fused there; a block of 2^20 keys
/// (16384 passes a block) does not.
#[test]
fn fused_iterations_within_the_loop_limit() {
    let lim = wgpu::Limits {
        max_compute_workgroup_size_x: 1024,
        max_compute_invocations_per_workgroup: 1024,
        max_compute_workgroup_storage_size: 32768,
        ..Default::default()
    };
    let fits = |gq: usize, d: usize, c: usize, k: usize| {
        let cfg = pisa_core::SelectionConfig::new(c, k).unwrap();
        let fp = FusedPlan::new(&lim, gq, d, &cfg, None)
            .unwrap_or_else(|| panic!("fused does not fit: {gq} {d} {c} {k}"));
        fp.iterations(gq, d, &cfg, 15)
    };
    assert!(fits(4, 128, 64, 16) < 65535, "{}", fits(4, 128, 64, 16));
    for (gq, d, c, k) in [(8, 80, 20, 6), (3, 128, 12, 6), (1, 64, 16, 40)] {
        let n = fits(gq, d, c, k);
        assert!(n < 65535, "{gq} {d} {c} {k}: {n}");
    }
    assert!(
        fits(1, 16, 1 << 20, 16) > 65535,
        "{}",
        fits(1, 16, 1 << 20, 16)
    );
}
