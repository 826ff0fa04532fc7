//! GPU PISA selection against the CPU reference `select_pisa` on the routing code paths of
//! stage 1: head dims not a multiple of 4, GQA groups of several head groups up to 32 heads, and
//! small candidate lists. Judged as in `select.rs` ([`select_util::run_case`]): a GPU row may
//! differ from the reference only where the reference's margin is a near-tie, in at most 5% of
//! the rows, Qtile 1 and 4 each so where a case asks for both.
mod common;
#[path = "select_util.rs"]
mod select_util;

use common::*;
use pisa_core::Scoring::*;
use pisa_core::TensorLayout::*;
use pisa_wgpu::Storage::*;
use select_util::{base, run_case, Case};

/// Puts the shared context's tuning back however a test ends (the tests here change the
/// routing knobs while they hold `settings_lock`).
struct Restore(pisa_wgpu::Tuning);
impl Drop for Restore {
    fn drop(&mut self) {
        common::ctx().set_tuning(self.0.clone()).unwrap();
    }
}

/// Routing code paths: head dims not a multiple of 4 (scalar pyramid loads; an odd number of
/// vec4s gives one lane per candidate, scored without the partial-sum barrier), GQA groups of
/// several head groups (partial scores summed across invocations, up to the 32-head limit),
/// and small candidate lists (the widest query tile, with a partial last tile). All through the
/// workgroup-memory routing kernel (`route_subgroups` off: the kernel of devices without
/// subgroups; `pisa_route_subgroups` checks the other). `PISA_ROUTE_LANES`, `PISA_ROUTE_TILE`,
/// `PISA_ROUTE_MAX_WG` select other shapes.
#[test]
fn pisa_route_paths() {
    // `pisa_route_table` changes the context's routing knobs meanwhile: not while this runs.
    let _guard = settings_lock();
    let before = ctx().tuning();
    let _restore = Restore(before.clone());
    let mut t = before;
    t.route_subgroups = false;
    ctx().set_tuning(t).unwrap();
    let seed = seed("pisa_route_paths");
    let mut r = rng(seed);
    let base = base();
    let cases = [
        (
            "gq5 d30 meanvar sink1",
            Case {
                b: 1,
                hq: 5,
                hkv: 1,
                nq: 500,
                nk: 500,
                d: 30,
                c: 8,
                k: 6,
                sink: 1,
                scoring: MeanVar,
                ..base
            },
            true,
        ),
        (
            "gq32 d64 lse non-causal",
            Case {
                b: 1,
                hq: 32,
                hkv: 1,
                nq: 300,
                nk: 300,
                c: 8,
                k: 4,
                causal: false,
                ..base
            },
            false,
        ),
        (
            "gq16 d34 mean local1 f16 bnhd",
            Case {
                b: 1,
                hq: 16,
                hkv: 1,
                nq: 400,
                nk: 400,
                d: 34,
                c: 8,
                k: 5,
                local: 1,
                scoring: Mean,
                storage: F16,
                layout: Bnhd,
                ..base
            },
            false,
        ),
        (
            "gq3 d18 lse g3 local1 (one task per candidate)",
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                nq: 450,
                nk: 450,
                d: 18,
                c: 8,
                k: 5,
                g: 3,
                local: 1,
                ..base
            },
            false,
        ),
        (
            "gq1 d6 lse K3 g4 wide tile",
            Case {
                b: 1,
                hq: 2,
                hkv: 2,
                nq: 777,
                nk: 777,
                d: 6,
                c: 4,
                k: 3,
                g: 4,
                ..base
            },
            true,
        ),
        // f16 storage: the kernel holds the queries as f16 pairs of heads (a pair past the
        // group's last head is half empty: GQ 1, 7).
        (
            "gq4 d128 lse f16",
            Case {
                b: 1,
                hq: 8,
                hkv: 2,
                nq: 333,
                nk: 333,
                d: 128,
                c: 8,
                k: 5,
                storage: F16,
                ..base
            },
            true,
        ),
        (
            "gq7 d36 meanvar sink1 f16",
            Case {
                b: 1,
                hq: 7,
                hkv: 1,
                nq: 410,
                nk: 410,
                d: 36,
                c: 8,
                k: 5,
                sink: 1,
                scoring: MeanVar,
                storage: F16,
                ..base
            },
            false,
        ),
        (
            "gq1 d20 lse g3 f16 bnhd",
            Case {
                b: 2,
                hq: 3,
                hkv: 3,
                nq: 290,
                nk: 290,
                d: 20,
                c: 4,
                k: 4,
                g: 3,
                storage: F16,
                layout: Bnhd,
                ..base
            },
            false,
        ),
    ];
    for (name, c, tile1) in cases {
        run_case(name, c, &mut r, tile1);
    }
}

/// The routing table (`route_table.wgsl`, or `shaders/nv/route_table.comp` where the NVIDIA
/// kernels run): the top levels looked up rather than scored, for some of the levels or all of
/// them, in one chunk of queries or several (chunks not a multiple of anything), `lse` and
/// `mean`, causal or not, GQA groups 1 to 8, head dims 20 to 128; judged as the other cases.
/// Each case checks that its table kernel ran (per-thread dispatch count), so a table path
/// that silently stays off fails; with `PISA_REQUIRE_NV_CM2=1` the f16 cases of head dim 64
/// and 128 must have run the NVIDIA kernel.
#[test]
fn pisa_route_table() {
    use pisa_wgpu::ops::route::table_dispatches_on_this_thread;
    let _guard = settings_lock();
    let seed = seed("pisa_route_table");
    let mut r = rng(seed);
    let base = base();
    let require_nv = std::env::var("PISA_REQUIRE_NV_CM2").as_deref() == Ok("1");
    // (name, case, table nodes, queries per chunk, whether the NVIDIA kernel takes it)
    let cases = [
        (
            "lse gq2 d64 levels 3-2 of 3, chunks",
            Case {
                hq: 4,
                hkv: 2,
                nq: 1000,
                nk: 1000,
                ..base
            },
            24,
            Some(97),
            false,
        ),
        (
            "mean gq3 d36 f16 all levels",
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                nq: 700,
                nk: 700,
                d: 36,
                c: 8,
                k: 5,
                scoring: Mean,
                storage: F16,
                ..base
            },
            4096,
            None,
            false,
        ),
        (
            "lse gq7 d20 g3 non-causal start level only, chunks",
            Case {
                b: 1,
                hq: 7,
                hkv: 1,
                nq: 500,
                nk: 500,
                d: 20,
                c: 8,
                k: 4,
                g: 3,
                causal: false,
                ..base
            },
            7,
            // Fewer queries than a routing tile: chunks of one tile.
            Some(1),
            false,
        ),
        (
            "lse gq8 d128 f16 bnhd sink1 local1",
            Case {
                b: 1,
                hq: 16,
                hkv: 2,
                nq: 1500,
                nk: 1500,
                d: 128,
                c: 16,
                k: 5,
                sink: 1,
                local: 1,
                storage: F16,
                layout: Bnhd,
                ..base
            },
            42,
            None,
            true,
        ),
        (
            "lse gq1 d64 f16 all levels, chunks",
            Case {
                b: 1,
                hq: 2,
                hkv: 2,
                nq: 900,
                nk: 900,
                c: 8,
                k: 6,
                storage: F16,
                ..base
            },
            512,
            Some(300),
            true,
        ),
        (
            "mean gq4 d128 f16 q offset",
            Case {
                b: 2,
                hq: 8,
                hkv: 2,
                nq: 333,
                nk: 1200,
                d: 128,
                c: 16,
                k: 4,
                scoring: Mean,
                storage: F16,
                ..base
            },
            4096,
            None,
            true,
        ),
    ];
    let ctx = ctx();
    let before = ctx.tuning();
    let _restore = Restore(before.clone());
    for (name, c, nodes, chunk, nv_shape) in cases {
        if c.storage == F16 && !ctx.has_f16() {
            eprintln!("{name}: skipped (adapter has no SHADER_F16)");
            continue;
        }
        let mut t = before.clone();
        t.route_table_nodes = nodes;
        t.route_table_portable = true;
        t.route_table_queries = chunk;
        ctx.set_tuning(t).unwrap();
        let (a0, n0) = table_dispatches_on_this_thread();
        run_case(name, c, &mut r, false);
        let (a1, n1) = table_dispatches_on_this_thread();
        let runs = (a1 - a0) + (n1 - n0);
        eprintln!(
            "{name}: {} portable, {} NVIDIA table dispatches",
            a1 - a0,
            n1 - n0
        );
        assert!(runs > 0, "{name}: the routing table did not run");
        if chunk.is_some() {
            assert!(runs >= 2, "{name}: one chunk only");
        }
        if require_nv && nv_shape {
            assert!(n1 > n0, "{name}: the NVIDIA table kernel did not run");
        }
    }
}

/// The routing kernel's subgroup score step (`shaders/route_sg.wgsl`: a query's lane of its
/// heads in registers, the lanes and head groups summed by subgroup shuffles): `lse`, GQA
/// groups 1, 2, 3, 4, 7, 8 and 16 (one, two and four head groups), head dims 32 to 128 (80:
/// fewer lanes per head group, as D allows), f32 and f16, causal or not, merge factors 2 (the
/// transposed lane sums, `score_lanes`, where a head group has 8 lanes) and 3, sinks and local
/// blocks, a query offset, batch 2, lengths that are not multiples of the routing tile, with
/// the routing table in chunks and without it; judged as
/// the other cases. Each case checks, by the per-thread dispatch count, that the subgroup
/// kernel ran exactly where the library's rule says it runs (subgroups, and a query's head
/// groups times at least 2 lanes within the smallest subgroup: lavapipe 8, NVIDIA 32, AMD 32
/// or 64), so on a device without it the case checks the workgroup-memory kernel.
#[test]
fn pisa_route_subgroups() {
    use pisa_wgpu::ops::route::subgroup_dispatches_on_this_thread;
    let _guard = settings_lock();
    let seed = seed("pisa_route_subgroups");
    let mut r = rng(seed);
    let base = base();
    let ctx = ctx();
    // The lanes the kernels plan within (the smallest subgroup; llvmpipe: at most 16).
    let sg_min = ctx.shuffle_lanes();
    let has_sg = ctx.features().contains(wgpu::Features::SUBGROUP);
    // The rule of `route::subgroup_shape`: lanes per head group the most, a power of two of at
    // most min(8, subgroup / groups), whose 4-element slices divide D; at least 2.
    let runs_sg = |gq: usize, d: usize| {
        let groups = gq.div_ceil(4).next_power_of_two() as u32;
        let mut lanes = 8.min(sg_min / groups) as usize;
        while lanes >= 2 && !(lanes.is_power_of_two() && d.is_multiple_of(4 * lanes)) {
            lanes -= 1;
        }
        has_sg && lanes >= 2
    };
    // (name, case, table nodes, queries per table chunk)
    let cases = [
        (
            "gq4 d128 f16 (the benchmark shape)",
            Case {
                b: 1,
                hq: 8,
                hkv: 2,
                nq: 533,
                nk: 533,
                d: 128,
                c: 16,
                k: 5,
                storage: F16,
                ..base
            },
            0,
            None,
        ),
        (
            "gq1 d64 f32 sink1 local1 batch 2",
            Case {
                b: 2,
                hq: 3,
                hkv: 3,
                nq: 301,
                nk: 301,
                d: 64,
                c: 8,
                k: 6,
                sink: 1,
                local: 1,
                ..base
            },
            0,
            None,
        ),
        (
            "gq2 d32 f32 non-causal g3",
            Case {
                b: 1,
                hq: 4,
                hkv: 2,
                nq: 450,
                nk: 450,
                d: 32,
                c: 8,
                k: 4,
                g: 3,
                causal: false,
                ..base
            },
            0,
            None,
        ),
        (
            "gq3 d96 f16 bnhd q offset",
            Case {
                b: 1,
                hq: 6,
                hkv: 2,
                nq: 157,
                nk: 700,
                d: 96,
                c: 16,
                k: 5,
                storage: F16,
                layout: Bnhd,
                ..base
            },
            0,
            None,
        ),
        (
            "gq8 d128 f16 (two head groups)",
            Case {
                b: 1,
                hq: 16,
                hkv: 2,
                nq: 377,
                nk: 377,
                d: 128,
                c: 16,
                k: 5,
                storage: F16,
                ..base
            },
            0,
            None,
        ),
        (
            "gq7 d64 f32 sink1 (a half-empty head group)",
            Case {
                b: 1,
                hq: 7,
                hkv: 1,
                nq: 400,
                nk: 400,
                d: 64,
                c: 8,
                k: 5,
                sink: 1,
                ..base
            },
            24,
            Some(128),
        ),
        (
            "gq16 d32 f32 non-causal (four head groups)",
            Case {
                b: 1,
                hq: 16,
                hkv: 1,
                nq: 300,
                nk: 300,
                d: 32,
                c: 8,
                k: 4,
                causal: false,
                ..base
            },
            0,
            None,
        ),
        (
            "gq2 d80 f32 (fewer lanes: 80 is not a multiple of 8 lanes' vec4s)",
            Case {
                b: 1,
                hq: 4,
                hkv: 2,
                nq: 333,
                nk: 333,
                d: 80,
                c: 8,
                k: 6,
                ..base
            },
            0,
            None,
        ),
        (
            "gq4 d64 f32 with the table in chunks",
            Case {
                b: 1,
                hq: 4,
                hkv: 1,
                nq: 500,
                nk: 500,
                d: 64,
                c: 8,
                k: 5,
                ..base
            },
            24,
            Some(100),
        ),
    ];
    let before = ctx.tuning();
    let _restore = Restore(before.clone());
    for (name, c, nodes, chunk) in cases {
        if c.storage == F16 && !ctx.has_f16() {
            eprintln!("{name}: skipped (adapter has no SHADER_F16)");
            continue;
        }
        let mut t = before.clone();
        t.route_subgroups = true;
        t.route_table_nodes = nodes;
        t.route_table_portable = true;
        t.route_table_queries = chunk;
        ctx.set_tuning(t).unwrap();
        let n0 = subgroup_dispatches_on_this_thread();
        run_case(name, c, &mut r, false);
        let ran = subgroup_dispatches_on_this_thread() - n0;
        eprintln!("{name}: {ran} subgroup routing dispatches");
        let want = runs_sg(c.hq / c.hkv, c.d);
        assert_eq!(ran > 0, want, "{name}: subgroup kernel ran {ran} times");
    }
}
