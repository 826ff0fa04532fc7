//! Tests of the decode step's split into route | leaf | merge dispatches (a module of
//! `tests/decode.rs`): GQA groups and head dims, blocks in several chunks, decode against
//! prefill at every position, wide levels, a grid past one dimension, several caches in one
//! pass.

use super::common::*;
use super::decode_harness::{self, base, cfg, Case, Run};
use pisa_core::reference;
use pisa_core::{AttentionShape, Scoring, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::{wgpu, DType, GpuError, Storage, TensorView};

/// The split step (route | leaf | merge) across GQA groups 1, 2, 3, 4, 7, 8 and head dims 64,
/// 80, 128, with odd cache lengths (partial last blocks) and a sink and a local block: deep
/// routing (C = 16, K = 4: 19+ leaves), so every step fills many leaf slots.
#[test]
fn gqa_groups_and_head_dims() {
    const NAMES: [&str; 6] = [
        "gqa1_d64",
        "gqa2_d80",
        "gqa3_d128",
        "gqa4_d128",
        "gqa7_d64",
        "gqa8_d80",
    ];
    let cases = [(1, 64), (2, 80), (3, 128), (4, 128), (7, 64), (8, 80)];
    for (i, (g_q, d)) in cases.into_iter().enumerate() {
        let cf = cfg(16, 4, 2, Scoring::Lse).with_forced(1, 1);
        let mut c = base(NAMES[i], 2 * g_q, 2, d, cf);
        c.prefill = vec![301 + 2 * i, 77];
        c.steps = 12;
        Run::new(c, 400).run();
    }
}

/// Blocks longer than a chunk of the leaf kernel: at the least workgroup memory the step
/// accepts, D = 32 and g_q = 2 leave 66 floats of leaf scratch (the P.V merge's minimum), so a
/// 64-key block is scored and attended in chunks of 16 keys with online-softmax rescaling.
#[test]
fn leaf_blocks_in_several_chunks() {
    let mut c = base("leaf_chunks", 4, 2, 32, cfg(64, 4, 2, Scoring::Lse));
    c.prefill = vec![333, 290];
    c.steps = 30;
    let mut r = Run::new(c, 400);
    let full = r.cache.workgroup_memory();
    let needed = match r.cache.set_workgroup_memory_limit(0) {
        Err(GpuError::Limit { needed, .. }) => needed,
        other => panic!("expected a Limit error, got {other:?}"),
    };
    r.cache.set_workgroup_memory_limit(needed as u32).unwrap();
    assert!(r.cache.workgroup_memory() < full);
    r.run();
}

/// Decode at length t + 1 equals prefill's row t: selection exactly (unless the reference's
/// margin of that row is a tie), output and LSE within f32 rounding; odd lengths, GQA 3 and 8.
#[test]
fn decode_equals_prefill_at_every_position() {
    use pisa_wgpu::ops::prefill::{prefill_host, PrefillOptions};
    for (hq, hkv, d, n, c, k) in [(3, 1, 80, 203, 8, 4), (16, 2, 64, 157, 4, 3)] {
        let cf = cfg(c, k, 2, Scoring::Lse);
        let mut r = rng(seed("decode_vs_prefill") ^ hq as u64);
        let q = random(&mut r, hq * n * d, 1.5);
        let kk = random(&mut r, hkv * n * d, 1.0);
        let v = random(&mut r, hkv * n * d, 1.0);
        let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
        let opts = PrefillOptions {
            cfg: cf,
            layout: TensorLayout::Bhnd,
            storage: Storage::F32,
            q_tile: 4,
            return_selection: true,
        };
        let pre = prefill_host(ctx(), &q, &kk, &v, &shape, &opts).unwrap();
        let psel = pre.selection.unwrap();
        let margin = reference::select_pisa(&q, &kk, &shape, TensorLayout::Bhnd, &cf)
            .unwrap()
            .margin;
        let mut cache = KvCache::new(ctx(), 1, n, hq, hkv, d, cf, Storage::F32).unwrap();
        let rows = |x: &[f32], h: usize, t: usize| -> Vec<f32> {
            (0..h)
                .flat_map(|i| x[(i * n + t) * d..(i * n + t + 1) * d].to_vec())
                .collect()
        };
        for t in 0..n {
            let (kr, vr, qr) = (rows(&kk, hkv, t), rows(&v, hkv, t), rows(&q, hq, t));
            let o = cache.append_and_step(&kr, &vr, &[true], &qr, true).unwrap();
            let sel = o.selection.unwrap();
            let mut same = true;
            for h in 0..hkv {
                let want = &psel[(h * n + t) * k..(h * n + t + 1) * k];
                if &sel[h * k..(h + 1) * k] != want {
                    let m = margin[h * n + t];
                    assert!(
                        m < decode_harness::TIE,
                        "row {t} kv head {h}: {sel:?} vs {want:?}"
                    );
                    same = false;
                }
            }
            if !same {
                continue;
            }
            for hh in 0..hq {
                let got = &o.out[hh * d..(hh + 1) * d];
                let want = &pre.out[(hh * n + t) * d..(hh * n + t + 1) * d];
                let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
                let e = rel_err(got, &want);
                assert!(e < 1e-4, "row {t} head {hh}: output rel err {e}");
                let (a, b) = (o.lse[hh], pre.lse[hh * n + t]);
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "row {t} head {hh}: lse {a} vs {b}"
                );
            }
        }
    }
}

/// The bench's selection shape (K = 16, g = 2: 34 candidates, a 1024-invocation `route`
/// workgroup where the device allows it) and a wide merge factor (g = 4: 68 candidates of 4
/// children, fewer lanes per row), with small blocks so routing starts several levels up.
#[test]
fn wide_levels_top16() {
    let mut c = base("top16_g2", 8, 2, 128, cfg(4, 16, 2, Scoring::Lse));
    c.prefill = vec![701, 333];
    c.steps = 10;
    Run::new(c, 800).run();
    let mut c = base(
        "top16_g4",
        4,
        1,
        64,
        cfg(4, 16, 4, Scoring::Lse).with_forced(1, 2),
    );
    c.prefill = vec![1203];
    c.steps = 10;
    Run::new(c, 1300).run();
}

/// top_k past the merge's register cap (K = 40 > 32: the selected blocks' states are loaded in
/// its loops instead of into per-invocation arrays), with sink and local blocks, a partial last
/// block and three routed levels (1500 tokens of C = 4: 375 leaves); the fused step's cut with
/// `PISA_DECODE=fused`.
#[test]
fn top_k_past_merge_registers() {
    let mut c = base(
        "top40",
        6,
        3,
        32,
        cfg(4, 40, 2, Scoring::Lse).with_forced(2, 3),
    );
    c.prefill = vec![1500, 90];
    c.steps = 12;
    Run::new(c, 1600).run();
}

/// More leaf workgroups than one grid dimension holds (2400 sequences x 2 KV heads x 14 slots
/// = 67200 > 65535): the grid is split over y, and the one non-empty sequence, the last
/// (its workgroups past the first row of the grid), matches the reference; the empty ones give
/// zeros, LSE -inf and no blocks.
#[test]
fn leaf_grid_past_one_dimension() {
    let mut c = base("grid_2d", 4, 2, 16, cfg(8, 4, 2, Scoring::Lse));
    c.prefill = vec![0; 2400];
    c.prefill[2399] = 75;
    c.steps = 2;
    c.active = 0.0;
    Run::new(c, 80).run();
}

/// `KvCache::record_steps`: the KV heads of one cache split over two caches, both steps in ONE
/// compute pass (routes, then leaves, then merges), give bitwise the single cache's outputs; so
/// does `record_steps_by_stage` (the same dispatches in three timed passes), whose profile names
/// the three stages where the adapter has timestamps.
#[test]
fn steps_of_several_caches_in_one_pass() {
    // (the default tuning: the one dispatch or not, as the adapter's defaults and PISA_*
    // variables say)
    several_caches_in_one_pass(ctx(), None);
    // ... and where each cache's step is one dispatch (`route_leaf_merge`), and where not.
    let own = route_leaf_context(false, true);
    several_caches_in_one_pass(own, Some(one_dispatch_runs(own)));
    several_caches_in_one_pass(route_leaf_context(false, false), Some(false));
}

/// [`steps_of_several_caches_in_one_pass`] in `ctx`, whose caches run the one-dispatch step
/// where `merge` says so (asserted; `None`: either).
fn several_caches_in_one_pass(ctx: &'static pisa_wgpu::Context, merge: Option<bool>) {
    let cf = cfg(8, 4, 2, Scoring::Lse).with_forced(1, 0);
    let (hq, hkv, d, n) = (6, 2, 32, 151);
    let g = hq / hkv;
    let mut r = rng(seed("several_caches"));
    let k = random(&mut r, hkv * n * d, 1.0);
    let v = random(&mut r, hkv * n * d, 1.0);
    let q = random(&mut r, hq * d, 1.5);
    // The split step whatever PISA_DECODE says (the fused one: `decode_fused`).
    let mut full = KvCache::new(ctx, 1, n, hq, hkv, d, cf, Storage::F32).unwrap();
    full.set_fused(false);
    full.prefill(0, &k, &v, TensorLayout::Bhnd).unwrap();
    let want = full.step(&q, true).unwrap();
    let want_sel = want.selection.clone().unwrap();
    // Fresh caches for every run below (so a run that wrote nothing cannot pass on an earlier
    // run's outputs).
    let make_caches = || -> Vec<KvCache> {
        (0..hkv)
            .map(|h| {
                let mut c = KvCache::new(ctx, 1, n, g, 1, d, cf, Storage::F32).unwrap();
                c.set_fused(false);
                let rows = h * n * d..(h + 1) * n * d;
                c.prefill(0, &k[rows.clone()], &v[rows], TensorLayout::Bhnd)
                    .unwrap();
                c
            })
            .collect()
    };
    let qs: Vec<_> = (0..hkv)
        .map(|h| {
            ctx.upload("q", &q[h * g * d..(h + 1) * g * d], Storage::F32)
                .unwrap()
        })
        .collect();
    // The same through the public views: cache 0's query bound in place, cache 1's strided
    // (rows of D + 3 floats, the padding poisoned), so gathered first.
    let pad = d + 3;
    let mut strided = vec![f32::NAN; g * pad];
    for h in 0..g {
        strided[h * pad..h * pad + d].copy_from_slice(&q[(g + h) * d..(g + h + 1) * d]);
    }
    let buf = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("strided q"),
        size: (strided.len() * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    ctx.queue()
        .write_buffer(&buf, 0, bytemuck::cast_slice(&strided));
    let q_views = [
        TensorView::contiguous(
            &qs[0].buffer,
            0,
            DType::F32,
            [1, g, 1, d],
            TensorLayout::Bhnd,
        )
        .unwrap(),
        TensorView::new(&buf, 0, DType::F32, [1, g, 1, d], [g * pad, pad, pad, 1]).unwrap(),
    ];
    for (views, by_stage) in [(false, false), (false, true), (true, false), (true, true)] {
        let caches = make_caches();
        let merges = caches[0].merges_in_route();
        assert!(merge.is_none_or(|m| m == merges), "{merge:?}");
        let steps: Vec<_> = caches.iter().zip(&qs).collect();
        let view_steps: Vec<_> = caches.iter().zip(&q_views).collect();
        let mut prof = pisa_wgpu::Profiler::new(ctx, 8);
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        match (views, by_stage) {
            (false, true) => KvCache::record_steps_by_stage(&mut enc, &steps, Some(&mut prof)),
            (false, false) => KvCache::record_steps(&mut enc, &steps, Some(&mut prof)),
            (true, true) => {
                KvCache::record_steps_by_stage_into(&mut enc, &view_steps, Some(&mut prof))
            }
            (true, false) => KvCache::record_steps_into(&mut enc, &view_steps, Some(&mut prof)),
        }
        .unwrap();
        ctx.queue().submit([enc.finish()]);
        let t = prof.finish(ctx).unwrap();
        let names: Vec<&str> = t.stages.iter().map(|s| s.0.as_str()).collect();
        if t.gpu {
            // (`route_leaf` runs the leaf's work in the route's dispatch.)
            let want_names: &[&str] = if by_stage && caches[0].route_leaf_blocks().is_some() {
                &["decode_route", "decode_merge"]
            } else if by_stage {
                &["decode_route", "decode_leaf", "decode_merge"]
            } else {
                &["decode"]
            };
            // (views: the gather of the strided query runs in its own untimed pass first)
            assert_eq!(names, want_names, "views {views} by_stage {by_stage}");
        }
        check_outputs(ctx, &caches, &want, &want_sel, (g, d, cf.top_k));
        if merges {
            for c in &caches {
                assert_eq!(
                    c.route_merge_counts().unwrap(),
                    vec![0],
                    "by_stage {by_stage}"
                );
            }
        }
    }
    // Misuse: a query of the wrong shape, or an integer one, is refused before anything is
    // recorded.
    let wrong =
        TensorView::contiguous(&buf, 0, DType::F32, [1, g, 1, d - 1], TensorLayout::Bhnd).unwrap();
    let int =
        TensorView::contiguous(&buf, 0, DType::I32, [1, g, 1, d], TensorLayout::Bhnd).unwrap();
    let caches = make_caches();
    for bad in [&wrong, &int] {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let e = KvCache::record_steps_into(
            &mut enc,
            &[(&caches[0], &q_views[0]), (&caches[1], bad)],
            None,
        )
        .unwrap_err();
        assert!(matches!(e, GpuError::View(_)), "{e}");
    }
    // One cache listed twice is refused: its two steps would share its scratch and outputs, and
    // the first step's outputs would be lost.
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let twice = [
        (&caches[0], &q_views[0]),
        (&caches[1], &q_views[1]),
        (&caches[0], &q_views[0]),
    ];
    let e = KvCache::record_steps_into(&mut enc, &twice, None).unwrap_err();
    assert!(matches!(e, GpuError::Misuse(_)), "{e}");
    // A query in another listed cache's outputs is refused, in either order: the steps run
    // side by side, so it would read that cache's earlier outputs (it was `Ok`, and the step
    // silently took the stale rows), where separate steps read the new ones.
    let o0 = caches[0].outputs().out.clone();
    assert_eq!(o0.shape(), q_views[1].shape());
    for by_stage in [false, true] {
        for steps in [
            [(&caches[0], &q_views[0]), (&caches[1], &o0)],
            [(&caches[1], &o0), (&caches[0], &q_views[0])],
        ] {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let e = match by_stage {
                false => KvCache::record_steps_into(&mut enc, &steps, None),
                true => KvCache::record_steps_by_stage_into(&mut enc, &steps, None),
            }
            .unwrap_err();
            assert!(
                matches!(&e, GpuError::View(m) if m.contains("outputs of step")),
                "{e}"
            );
        }
    }
}

pub(crate) fn check_outputs(
    ctx: &pisa_wgpu::Context,
    caches: &[KvCache],
    want: &pisa_wgpu::ops::decode::DecodeOutput,
    want_sel: &[i32],
    (g, d, kk): (usize, usize, usize),
) {
    for (h, c) in caches.iter().enumerate() {
        let outs = c.outputs();
        let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // (f32 caches: every output is of 4-byte words)
        let read = |v: &pisa_wgpu::TensorView| {
            let bytes = ctx.read_bytes(v.buffer()).unwrap();
            bytemuck::cast_slice::<u8, u32>(&bytes)[..v.elems()].to_vec()
        };
        let f32s = |w: Vec<u32>| w.into_iter().map(f32::from_bits).collect::<Vec<_>>();
        let o = f32s(read(outs.out));
        let l = f32s(read(outs.lse));
        let s: Vec<i32> = read(outs.selection.unwrap())
            .into_iter()
            .map(|w| w as i32)
            .collect();
        assert_eq!(
            bits(o),
            bits(want.out[h * g * d..(h + 1) * g * d].to_vec()),
            "head {h}"
        );
        assert_eq!(
            bits(l),
            bits(want.lse[h * g..(h + 1) * g].to_vec()),
            "head {h}"
        );
        assert_eq!(s, want_sel[h * kk..(h + 1) * kk], "head {h}");
    }
}

/// An empty sequence's row is written in full when K exceeds the `merge` workgroup.
#[test]
fn empty_sequence_with_top_k_past_workgroup() {
    decode_harness::empty_beside_top_k_past_workgroup("split_empty_k300", false);
}

/// The top-K cut with one rank part per slot (CPM = 1: workgroups of 32 invocations, fewer than
/// the MAXC = 34 candidate slots of K = 16, g = 2) and K <= 32 (the weighted merge), with
/// selections that have empty entries (a sequence of fewer than K visible blocks) beside full
/// ones: the empty entries must come last, each written once.
#[test]
fn cut_in_one_rank_part() {
    let mut c = base(
        "cut_cpm1",
        4,
        2,
        64,
        cfg(4, 16, 2, Scoring::Lse).with_forced(1, 1),
    );
    c.prefill = vec![9, 150];
    c.steps = 40;
    let mut r = Run::new(c, 400);
    // A cap below the step's needs (D 64: 16 invocations) is a Limit naming the power of two
    // the kernels would take within it, and leaves the cache's plan as it was.
    for cap in [1, 3, 15] {
        let e = r.cache.set_workgroup_size_limit(cap).unwrap_err();
        assert!(
            matches!(e, GpuError::Limit { limit, .. } if limit == 1u64 << (31 - cap.leading_zeros())),
            "cap {cap}: {e}"
        );
    }
    r.cache.set_workgroup_size_limit(32).unwrap();
    r.run();
}

/// The split step's `route` both ways, each against the reference: its level steps on subgroup
/// shuffles (`decode_route_subgroups` on, where the device has subgroups of 8 lanes or more:
/// lavapipe's 8 take g 2 with 4 lanes per pyramid row and g 4 with 2, NVIDIA's 32 take 8
/// lanes per row) and through workgroup memory (off). GQA groups 1, 2, 3, 4, 7, 8, head dims
/// 12, 64, 72, 80, 96, 128 (12 and 72: rows of 3 and 18 vec4s, not a multiple of the lanes),
/// merge factors 2, 4 and 8 (and 3, which takes the workgroup-memory steps
/// either way), odd lengths, a sink and a local block; and exact ties (every key the same
/// vector), where the selection must follow the tie rule (lower block first) exactly. With the knob on, every case the
/// subgroup route applies to must have built it (counted per thread), so the test cannot pass
/// on the other kernel, and built it once for all its steps; with it off, none.
#[test]
fn route_with_and_without_subgroups() {
    use pisa_wgpu::ops::decode::subgroup_routes_on_this_thread;
    const NAMES: [&str; 9] = [
        "sg_gqa1_d64_g2",
        "sg_gqa2_d80_g4",
        "sg_gqa3_d128_g2",
        "sg_gqa4_d128_g2",
        "sg_gqa7_d64_g3",
        "sg_gqa8_d96_g2",
        "sg_gqa2_d72_g2",
        "sg_gqa2_d12_g2",
        "sg_gqa2_d64_g8",
    ];
    let cases = [
        (1, 64, 2),
        (2, 80, 4),
        (3, 128, 2),
        (4, 128, 2),
        (7, 64, 3),
        (8, 96, 2),
        (2, 72, 2),
        (2, 12, 2),
        (2, 64, 8),
    ];
    for on in [true, false] {
        let mut t = pisa_wgpu::Tuning::default();
        t.decode_route_subgroups = on;
        let own: &'static pisa_wgpu::Context = Box::leak(Box::new(
            pisa_wgpu::Context::with_tuning(&pisa_wgpu::AdapterChoice::HighPerformance, t).unwrap(),
        ));
        let has_sg = own.features().contains(wgpu::Features::SUBGROUP) && own.shuffle_lanes() >= 8;
        for (i, (g_q, d, g)) in cases.into_iter().enumerate() {
            let before = subgroup_routes_on_this_thread();
            let cf = cfg(16, 4, g, Scoring::Lse).with_forced(1, 1);
            let mut c = base(NAMES[i], 2 * g_q, 2, d, cf);
            c.prefill = vec![301 + 2 * i, 77];
            c.steps = 12;
            Run::new_in(own, c, 400).run();
            let built = subgroup_routes_on_this_thread() - before;
            let expected = on && has_sg && g != 3;
            eprintln!("{}: subgroup route {on}: {built} builds", NAMES[i]);
            // One build for all the steps: `KvCache::step` writes its inputs into the cache's
            // own buffers, so every step binds the same ones and reuses the recorded dispatches
            // (a step built them anew for each call's uploaded buffers before).
            assert_eq!(
                built,
                u64::from(expected),
                "{}: subgroup route built {built} times (knob {on}, device subgroups {has_sg})",
                NAMES[i]
            );
        }
        let before = subgroup_routes_on_this_thread();
        let mut c = base("sg_ties", 4, 2, 64, cfg(4, 3, 2, Scoring::Lse));
        c.prefill = vec![100, 61];
        c.steps = 20;
        c.tied = true;
        Run::new_in(own, c, 130).run();
        let built = subgroup_routes_on_this_thread() - before;
        assert_eq!(built, u64::from(on && has_sg), "sg_ties: {built} builds");
    }
}

/// One `route_leaf` case of [`route_and_leaf_in_one_dispatch`] and
/// [`route_leaf_attention_with_and_without_subgroups`]: `2 g_q` query heads over 2 KV heads of
/// head dim `d`, blocks of `c` keys, `top_k` `k` with a sink and a local block, `storage`, two
/// sequences prefilled with `prefill` tokens, then `steps` decode steps.
#[allow(clippy::too_many_arguments)]
fn route_leaf_case(
    name: &'static str,
    g_q: usize,
    d: usize,
    c: usize,
    k: usize,
    storage: Storage,
    prefill: Vec<usize>,
    steps: usize,
) -> Case {
    let cf = cfg(c, k, 2, Scoring::Lse).with_forced(1, 1);
    let mut case = base(name, 2 * g_q, 2, d, cf);
    case.storage = storage;
    case.prefill = prefill;
    case.steps = steps;
    case
}

/// Whether `ctx`'s decode step can run as one dispatch (`route_leaf_merge`): a Vulkan device
/// with `MEMORY_DECORATION_COHERENT` (lavapipe in CI; not wgpu's GL backend).
fn one_dispatch_runs(ctx: &pisa_wgpu::Context) -> bool {
    let coherent = wgpu::Features::MEMORY_DECORATION_COHERENT;
    ctx.report().backend == "Vulkan" && ctx.features().contains(coherent)
}

/// A context of the default tuning but `decode_route_workgroups` 4096 (so that `route_leaf`
/// runs wherever it fits), `decode_leaf_subgroups` `leaf_sg` and `decode_merge_in_route`
/// `merge`, kept for the test's life.
fn route_leaf_context(leaf_sg: bool, merge: bool) -> &'static pisa_wgpu::Context {
    route_leaf_context_with(leaf_sg, merge, true)
}

/// [`route_leaf_context`] with `decode_leaf_prefetch` `prefetch`.
fn route_leaf_context_with(
    leaf_sg: bool,
    merge: bool,
    prefetch: bool,
) -> &'static pisa_wgpu::Context {
    let mut t = pisa_wgpu::Tuning::default();
    t.decode_route_workgroups = 4096;
    t.decode_leaf_subgroups = leaf_sg;
    t.decode_merge_in_route = merge;
    t.decode_leaf_prefetch = prefetch;
    Box::leak(Box::new(
        pisa_wgpu::Context::with_tuning(&pisa_wgpu::AdapterChoice::HighPerformance, t).unwrap(),
    ))
}

/// The split step's `route` and `leaf` as one dispatch (`route_leaf`, asked for by
/// `decode_route_workgroups`): several workgroups per (sequence, KV head) route the token the
/// same way, then each attends its share of the leaf slots, several blocks at once, before the
/// `merge` dispatch, or (`decode_merge_in_route`, `route_leaf_merge`) with the merge done by
/// the last of them to finish, every step one dispatch. Both ways, every step against the
/// reference (selection exactly unless tied, output and LSE within rounding): GQA 1, 2, 3, 4,
/// 7, 8, head dims 12 to 128, f32 and f16 storage, blocks of 16 and 64 keys (whole and
/// partial), top_k 4 and 40 (the merge's loops past 32), a sink and a local block, a batch of
/// two sequences of different lengths (one empty at first: the merge's empty outputs); and a
/// cache split over two storage bindings; the one-dispatch step also with its value rows
/// loaded in the P.V loop (`decode_leaf_prefetch` off). The kernel asked for must have been
/// built for every case (counted per thread), so the test cannot pass on the other dispatches.
#[test]
fn route_and_leaf_in_one_dispatch() {
    for (merge, prefetch) in [(true, true), (false, true), (true, false)] {
        route_and_leaf_cases(merge, prefetch);
    }
}

/// [`route_and_leaf_in_one_dispatch`] with `decode_merge_in_route` `merge` and
/// `decode_leaf_prefetch` `prefetch`.
fn route_and_leaf_cases(merge: bool, prefetch: bool) {
    use pisa_wgpu::ops::decode::{route_leaves_on_this_thread, route_merges_on_this_thread};
    let leaf_sg = pisa_wgpu::Tuning::default().decode_leaf_subgroups;
    let own = route_leaf_context_with(leaf_sg, merge, prefetch);
    let merge = merge && one_dispatch_runs(own);
    let cases = [
        ("rl_gqa1_d64", 1, 64, 16, 4, Storage::F32),
        ("rl_gqa2_d12", 2, 12, 16, 4, Storage::F32),
        ("rl_gqa3_d128", 3, 128, 64, 4, Storage::F16),
        ("rl_gqa4_d128", 4, 128, 64, 4, Storage::F32),
        ("rl_gqa7_d80", 7, 80, 16, 4, Storage::F16),
        ("rl_gqa8_d96", 8, 96, 16, 4, Storage::F32),
        ("rl_gqa2_k40", 2, 32, 16, 40, Storage::F32),
    ];
    let mut built = 0;
    for (i, (name, g_q, d, c, k, storage)) in cases.into_iter().enumerate() {
        if storage == Storage::F16 && !own.has_f16() {
            continue;
        }
        let before = (route_leaves_on_this_thread(), route_merges_on_this_thread());
        let prefill = if k > 4 {
            vec![0, 1300]
        } else {
            vec![1201 + 2 * i, 77]
        };
        let case = route_leaf_case(name, g_q, d, c, k, storage, prefill, 10);
        let r = Run::new_in(own, case, 1400);
        let blocks = r.cache.route_leaf_blocks();
        assert!(blocks.is_some(), "{name}: route_leaf does not run");
        assert_eq!(r.cache.merges_in_route(), merge, "{name}");
        // (the step it names, and what the adapter's plan says of the same tuning)
        let step = match merge {
            true => pisa_wgpu::DecodeStep::OneDispatch,
            false => pisa_wgpu::DecodeStep::RouteLeafAndMerge,
        };
        assert_eq!(r.cache.decode_step(), step, "{name}");
        assert_eq!(
            pisa_wgpu::DecodeStep::planned(&own.tuning(), own.report()),
            step,
            "{name}"
        );
        let r = r.run();
        assert_eq!(
            route_leaves_on_this_thread() - before.0,
            1,
            "{name}: builds"
        );
        // (every step's last copy set its head's count back to 0)
        assert!(r
            .cache
            .route_merge_counts()
            .unwrap()
            .iter()
            .all(|&c| c == 0));
        let merges = route_merges_on_this_thread() - before.1;
        assert_eq!(merges, merge as u64, "{name}: builds of route_leaf_merge");
        built += 1;
    }
    assert!(built >= 5, "only {built} cases ran");
    let small = route_leaf_context_with(leaf_sg, merge, prefetch);
    small.set_max_binding_bytes(5 * 400 * 32 * 4); // 5 rows of capacity 400, D 32, f32
    let cf = cfg(4, 5, 2, Scoring::Lse).with_forced(1, 1);
    let mut case = base("rl_two_shards", 6, 3, 32, cf);
    case.prefill = vec![300, 120, 157];
    case.steps = 12;
    let r = Run::new_in(small, case, 400);
    assert_eq!(r.cache.kv_shards().0.len(), 2, "split over two bindings");
    assert!(r.cache.route_leaf_blocks().is_some());
    assert_eq!(r.cache.merges_in_route(), merge);
    r.run();
}

/// The one-dispatch step (`route_leaf_merge`) where the merge's inputs are unusual: an empty
/// sequence beside a non-empty one (its outputs written by the last copy to finish: zeros, LSE
/// -inf, -1s), at the benchmark's shape (GQA 4, D 128, C 64, K 16) and at K 40 (the merge's
/// loops past 32), three steps of each against the reference, the counts of finished copies 0
/// after every step; and a query in the cache's own output buffer, which runs the two
/// dispatches instead (one dispatch would bind it read-only beside the outputs, which wgpu
/// refuses) and equals a step of the same query from the host.
#[test]
fn one_dispatch_step_beside_an_empty_sequence() {
    let own = route_leaf_context(false, true);
    if !one_dispatch_runs(own) {
        eprintln!("no one-dispatch step on this device (Vulkan and its coherent decoration)");
        return;
    }
    for (name, g_q, d, c, k) in [
        ("rlm_empty_k16", 4, 128, 64, 16),
        ("rlm_empty_k40", 2, 32, 16, 40),
    ] {
        let hq = 2 * g_q;
        let mut case = base(name, hq, 2, d, cfg(c, k, 2, Scoring::Lse));
        case.prefill = vec![0, 1201];
        let mut r = Run::new_in(own, case, 1400);
        assert!(r.cache.merges_in_route(), "{name}");
        for step in 0..3 {
            let q = random(&mut r.rng, 2 * hq * d, 1.5);
            let o = r.cache.step(&q, true).unwrap();
            r.check(step, 0, &q[..hq * d], &o);
            r.check(step, 1, &q[hq * d..], &o);
            assert_eq!(r.cache.route_merge_counts().unwrap(), vec![0; 4], "{name}");
        }
        let read = |v: &TensorView| {
            let bytes = own.read_bytes(v.buffer()).unwrap();
            let at = v.offset() as usize;
            bytemuck::cast_slice::<u8, f32>(&bytes[at..at + 4 * v.elems()]).to_vec()
        };
        let qv = r.cache.outputs().out.clone();
        let host_q = read(&qv);
        let mut enc = own.device().create_command_encoder(&Default::default());
        KvCache::record_steps_into(&mut enc, &[(&r.cache, &qv)], None).unwrap();
        own.queue().submit([enc.finish()]);
        let got = read(r.cache.outputs().out);
        let want = r.cache.step(&host_q, false).unwrap();
        // (another pipeline than the one-dispatch step's: equal within f32 rounding, not bit
        // for bit, on a GPU whose compiler contracts the two kernels' arithmetic differently)
        let want: Vec<f64> = want.out.iter().map(|&x| x as f64).collect();
        let e = rel_err(&got, &want);
        assert!(e <= 1e-5, "{name}: q in the outputs: rel err {e}");
        assert!(
            got[..hq * d].iter().all(|&x| x == 0.0),
            "{name}: the empty sequence"
        );
    }
}

/// `route_leaf`'s block attention both ways, each against the reference: on subgroup shuffles
/// (`decode_leaf_subgroups` on, `decode_attend_sg.wgsl`, where the device has subgroups of 8
/// lanes or more and the plan's shapes allow it) and through workgroup memory (off). GQA
/// groups 1, 2, 3, 4, 7, 8, head dims 64 and 128, blocks of 16 and 64 keys (whole and partial:
/// odd lengths), top_k 4 and 16 (the benchmark's shape, several blocks a workgroup), f32 and
/// f16 storage, a sink and a local block, a batch of two sequences; and exact ties (every key
/// the same vector). With the knob on, every case must have built the subgroup attention
/// (counted per thread), so the test cannot pass on the other code; with it off, none.
#[test]
fn route_leaf_attention_with_and_without_subgroups() {
    use pisa_wgpu::ops::decode::subgroup_leaves_on_this_thread;
    // (name, g_q, D, C, top_k, storage); top_k 16 at C 64, D 128, GQA 4 is the benchmark's
    // shape, where a workgroup attends several blocks at once.
    let cases = [
        ("sga_gqa1_d64", 1, 64, 64, 4, Storage::F32),
        ("sga_gqa2_d128", 2, 128, 64, 4, Storage::F16),
        ("sga_gqa3_d128", 3, 128, 64, 4, Storage::F32),
        ("sga_gqa4_d128", 4, 128, 64, 4, Storage::F16),
        ("sga_gqa7_d64_c16", 7, 64, 16, 4, Storage::F32),
        ("sga_gqa8_d128_c16", 8, 128, 16, 4, Storage::F32),
        ("sga_gqa4_d128_k16", 4, 128, 64, 16, Storage::F16),
    ];
    // (the subgroup attention also with decode_leaf_prefetch off, which it leaves out: its
    // rows are always loaded ahead, and the build refused PVR 1)
    for (on, prefetch) in [(true, true), (false, true), (true, false)] {
        let own = route_leaf_context_with(on, true, prefetch);
        let has_sg = own.features().contains(wgpu::Features::SUBGROUP) && own.shuffle_lanes() >= 8;
        let before = subgroup_leaves_on_this_thread();
        let mut ran = 0;
        for (i, (name, g_q, d, c, k, storage)) in cases.into_iter().enumerate() {
            if storage == Storage::F16 && !own.has_f16() {
                continue;
            }
            ran += 1;
            let prefill = vec![1201 + 2 * i, 77];
            let case = route_leaf_case(name, g_q, d, c, k, storage, prefill, 6);
            let r = Run::new_in(own, case, 1400);
            assert!(
                r.cache.route_leaf_blocks().is_some(),
                "{name}: route_leaf does not run"
            );
            r.run();
        }
        let mut c = base("sga_ties", 4, 2, 64, cfg(64, 3, 2, Scoring::Lse));
        c.prefill = vec![1000, 611];
        c.steps = 8;
        c.tied = true;
        Run::new_in(own, c, 1300).run();
        ran += 1;
        let built = subgroup_leaves_on_this_thread() - before;
        eprintln!("subgroup attention {on}: {built} of {ran} cases (device subgroups {has_sg})");
        if on && has_sg {
            // Every case is shaped to take it (the block one chunk, one invocation per key
            // row lane and per P.V part) on devices with the memory of lavapipe's or more.
            assert_eq!(built, ran, "cases that did not take the subgroup attention");
        } else {
            assert_eq!(built, 0, "the subgroup attention ran with the knob off");
        }
    }
}
