//! Leaf-major block-sparse attention (`ops::attention::by_leaf`: the selection bucketed by
//! leaf, per-(query, leaf) partial states from chunks of each leaf's queries, then merged;
//! PISA.md 4 and 5) against the f64 CPU reference. Every test of this binary sets
//! `LeafOrder::Leaves` (holding the settings lock), and each case asserts that the leaf-major
//! path runs (`leaf_major_path`: the portable kernel on lavapipe, the tensor-core one for
//! supported f16 shapes where cooperative matrices exist). A last test compares it with the
//! query tiles on selections the reference reads differently (out of order, past the last leaf,
//! empty rows). Cases: GQA groups 1, 2, 3, 4, 7, 8, head dims 64 to 256, both layouts, f32
//! and f16, causal and not, Nq < Nk, C not a power of two, selections from PISA and random ones
//! with -1 holes and repeats (skipped, as the tile kernels skip them), and
//! ranges forced small through a lowered binding limit: part of one head's queries, or all
//! queries of several heads with a last range of fewer. Tolerances as
//! `attention_util.rs`: relative L2 error of O and LSE <= 1e-4 (f32) or 5e-3 (f16).
#[path = "attention_util.rs"]
mod attention_util;
mod common;

use attention_util::{case_config, check, inputs, skip_f16, sparse_case, Case};
use common::*;
use pisa_core::{reference, AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::{self, by_leaf, by_leaf::leaf_major_path, QkvLayouts};
use pisa_wgpu::{Context, LeafOrder, Storage};
use rand::Rng;
use Storage::{F16, F32};
use TensorLayout::{Bhnd, Bnhd};

/// The preamble of a leaf-major test: the settings lock (held while the test runs), the shared
/// context in the leaf-major order, the test's seed and its generator.
fn leaf_major(
    test: &str,
) -> (
    std::sync::MutexGuard<'static, ()>,
    &'static Context,
    u64,
    rand_chacha::ChaCha8Rng,
) {
    let settings = settings_lock();
    let ctx = ctx();
    ctx.set_leaf_order(LeafOrder::Leaves);
    let seed = seed(test);
    (settings, ctx, seed, rng(seed))
}

fn run(ctx: &Context, r: &mut rand_chacha::ChaCha8Rng, case: Case, messy: bool, seed: u64) {
    run_with(ctx, r, case, messy, false, false, seed);
}

/// `run`, and with `future` each query's last slot replaced by the leaf after its own (when
/// there is one): under causal masking every key of that leaf is masked for the query, so its
/// partial state must count for nothing (a chunk whose rows are all masked); with `siblings`
/// the selection is `sibling_selection`'s. Returns the selection's sibling pairs.
fn run_with(
    ctx: &Context,
    r: &mut rand_chacha::ChaCha8Rng,
    case: Case,
    messy: bool,
    future: bool,
    siblings: bool,
    seed: u64,
) -> usize {
    let (.., c, kk, layout, storage, causal, pisa) = case;
    if skip_f16(ctx, storage) {
        return 0;
    }
    let (s, cfg, x, mut sel) = sparse_case(r, case);
    if siblings {
        sel = sibling_selection(r, &s, &cfg);
    }
    // On a device with VK_NV_cooperative_matrix2 (PISA_REQUIRE_NV_CM2=1 on the GPU runs) the
    // supported head dims run shaders/nv/attention_leaf.comp instead of the WGSL chunk kernel.
    if std::env::var("PISA_REQUIRE_NV_CM2").as_deref() == Ok("1") {
        assert!(
            ctx.nv_cm2(),
            "no VK_NV_cooperative_matrix2 (PISA_REQUIRE_NV_CM2=1)"
        );
    }
    if let Some((k, m)) = attention::by_leaf::nv_kernel_for(ctx, &s, &cfg) {
        if storage == F16 {
            eprintln!("D {}: {} {:?}", s.head_dim, k.name, m.map(|m| m.name));
        }
    }
    if future {
        let nb0 = s.k_len.div_ceil(c) as i32;
        for (row_i, row) in sel.chunks_mut(kk).enumerate() {
            let i = row_i % s.q_len;
            let own = ((s.k_len - s.q_len + i) / c) as i32;
            if kk > 1 && own + 1 < nb0 && row[..kk - 1].iter().all(|&x| x < own + 1) {
                row[kk - 1] = own + 1;
            }
        }
    }
    if messy {
        // Holes and repeats (the kernels skip an entry not above every valid one before it, the
        // reference dedups: the same set for ascending lists with holes and repeats). Entry 0
        // stays, so no row is left without a key (its LSE would be -inf).
        for row in sel.chunks_mut(kk).filter(|_| kk > 1) {
            let j = r.random_range(1..kk);
            row[j] = if r.random_bool(0.5) { -1 } else { row[0] };
        }
    }
    let path = leaf_major_path(ctx, storage, &s, QkvLayouts::from(layout), &cfg);
    let what = format!("{s:?} C {c} K {kk} {layout:?} {storage:?} causal {causal} pisa {pisa} messy {messy} seed {seed}");
    assert!(path.is_some(), "{what}: the leaf-major path does not run");
    let (ro, rl) = reference::sparse_attention(&x.q, &x.k, &x.v, &s, layout, &cfg, &sel).unwrap();
    let got =
        attention::sparse_attention_host(ctx, &x.q, &x.k, &x.v, &s, layout, &cfg, storage, &sel)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    if storage == F16 && attention::by_leaf::nv_kernel_for(ctx, &s, &cfg).is_some() {
        let bad_lse = got.1.iter().filter(|x| !x.is_finite()).count();
        eprintln!(
            "  {what}: NVIDIA kernel: O {:?} (reference {:?}), LSE {:?} (reference {:?}), {bad_lse} of {} LSE not finite",
            &got.0[..4],
            &ro[..4],
            &got.1[..4],
            &rl[..4],
            got.1.len()
        );
    }
    check(
        &format!("{what} path {:?}", path.unwrap()),
        (&got.0, &got.1),
        (&ro, &rl),
        storage,
    );
    sibling_pairs(&sel, kk)
}

/// A selection of mostly sibling pairs (`[B, Hkv, Nq, K]`, each row ascending, -1 padded): per
/// query its own leaf (causal), then pairs 2P, 2P + 1 of random visible pairs, a quarter of
/// them with one leaf only, so that rows mix pair entries and single ones (the last leaf of an
/// odd leaf count has no sibling).
fn sibling_selection(
    r: &mut rand_chacha::ChaCha8Rng,
    s: &AttentionShape,
    cfg: &SelectionConfig,
) -> Vec<i32> {
    attention_util::selection_rows(r, s, cfg, |r, visible, row| {
        for _ in 0..2 * cfg.top_k {
            let pair = r.random_range(0..visible.div_ceil(2)) as i32;
            let mut add = vec![2 * pair, 2 * pair + 1];
            if r.random_bool(0.25) {
                add.remove(r.random_range(0..2));
            }
            add.retain(|&j| (j as usize) < visible && !row.contains(&j));
            if row.len() + add.len() <= cfg.top_k {
                row.extend(add);
            }
        }
    })
}

/// Entries of `sel` (rows of `kk`) that are an even leaf followed by its sibling.
fn sibling_pairs(sel: &[i32], kk: usize) -> usize {
    sel.chunks(kk)
        .map(|row| {
            row.windows(2)
                .filter(|w| w[0] >= 0 && w[0] % 2 == 0 && w[1] == w[0] + 1)
                .count()
        })
        .sum()
}

/// Sibling pairs as one entry (`Tuning::attention_pairs`; `leaf_bucket.wgsl` APAIR, the chunk
/// kernels' PAIR = 1) and as two, on selections of mostly pairs mixed with single leaves:
/// GQA groups 1, 2, 3, 4, 7, 8, head dims 64, 80, 128, C 64 and not a power of two, odd leaf
/// counts (a last leaf without a sibling), causal and not, Nq < Nk, f32 and f16, and PISA's own
/// selections, some with holes and repeats. Each case asserts that the pair path is taken when on
/// where the chunk kernel has a pair variant (`by_leaf::leaf_major_pairs`) and that the
/// selection has pairs; the bucketing's pair entries are checked against a model in
/// `attention_buckets_equal_the_model` (unit tests of `ops::leaf_select::by_leaf`).
#[test]
fn leaf_major_attention_over_sibling_pairs() {
    let (_settings, ctx, seed, mut r) = leaf_major("leaf_major_attention_over_sibling_pairs");
    let base = ctx.tuning();
    // (case, sibling_selection's selection (else PISA's), holes and repeats added)
    let cases: &[(Case, bool, bool)] = &[
        (
            (1, 4, 1, 300, 300, 128, 64, 8, Bhnd, F16, true, false),
            true,
            false,
        ),
        (
            (2, 3, 1, 130, 210, 64, 20, 6, Bnhd, F32, true, false),
            true,
            false,
        ),
        (
            (1, 7, 1, 257, 257, 80, 64, 5, Bhnd, F32, false, false),
            true,
            false,
        ),
        (
            (1, 8, 1, 200, 200, 128, 64, 16, Bnhd, F16, true, false),
            true,
            true,
        ),
        (
            (1, 2, 1, 150, 150, 64, 32, 9, Bhnd, F16, true, false),
            true,
            false,
        ),
        (
            (1, 4, 1, 190, 190, 128, 48, 7, Bhnd, F16, false, false),
            true,
            true,
        ),
        (
            (2, 4, 4, 100, 100, 64, 16, 4, Bhnd, F32, true, false),
            true,
            true,
        ),
        (
            (1, 4, 1, 700, 700, 64, 64, 4, Bhnd, F32, true, true),
            false,
            false,
        ),
    ];
    for pairs in [true, false] {
        let mut t = base.clone();
        t.attention_pairs = pairs;
        ctx.set_tuning(t).unwrap();
        for &(case, siblings, messy) in cases {
            let (s, cfg) = attention_util::case_config(case);
            let (layout, storage) = (case.8, case.9);
            let layouts = QkvLayouts::from(layout);
            let on = attention::by_leaf::leaf_major_pairs(ctx, storage, &s, layouts, &cfg);
            // Pairs run where the chunk kernel has a pair variant: the portable kernel, the
            // NVIDIA ones (not the WGSL tensor-core kernel of other devices).
            let portable = leaf_major_path(ctx, storage, &s, layouts, &cfg)
                == Some(pisa_wgpu::KernelPath::Portable);
            let nv_pair = attention::by_leaf::nv_kernel_for(ctx, &s, &cfg)
                .and_then(|nv| attention::by_leaf::nv_pair_kernel_for(ctx, &nv));
            if !skip_f16(ctx, storage) {
                let want = pairs && (portable || nv_pair.is_some());
                assert_eq!(on, want, "{case:?}: pairs {on}, tuning {pairs}");
            }
            let n = run_with(ctx, &mut r, case, messy, false, siblings, seed);
            assert!(
                n > 0 || skip_f16(ctx, storage),
                "{case:?}: no sibling pairs"
            );
        }
    }
    ctx.set_tuning(base).unwrap();
}

#[test]
fn leaf_major_attention_matches_reference() {
    let (_settings, ctx, seed, mut r) = leaf_major("leaf_major_attention");
    let cases: &[(Case, bool)] = &[
        ((2, 4, 2, 100, 100, 64, 16, 4, Bhnd, F32, true, true), false),
        ((2, 3, 1, 65, 65, 80, 32, 3, Bnhd, F32, true, true), false),
        ((1, 2, 1, 700, 700, 64, 64, 4, Bhnd, F32, true, true), false),
        ((2, 7, 1, 33, 33, 96, 16, 3, Bnhd, F16, true, true), false),
        ((1, 8, 1, 40, 63, 256, 16, 3, Bhnd, F32, true, false), true),
        (
            (1, 4, 1, 300, 300, 128, 64, 8, Bhnd, F16, true, true),
            false,
        ),
        (
            (1, 8, 2, 257, 257, 128, 48, 5, Bnhd, F16, true, false),
            true,
        ),
        (
            (2, 2, 2, 127, 127, 128, 20, 5, Bnhd, F16, false, true),
            false,
        ),
        ((1, 4, 1, 64, 64, 80, 64, 1, Bnhd, F32, false, false), true),
        // The NVIDIA f16 merges: the small one with a partial batch of slots (GQ 8, K 11), the
        // large one past the small one's 256 (slot, head) pairs (GQ 16, K 17).
        (
            (1, 8, 1, 200, 200, 128, 16, 11, Bnhd, F16, true, false),
            false,
        ),
        (
            (1, 16, 1, 150, 150, 128, 32, 17, Bhnd, F16, true, true),
            false,
        ),
        ((1, 16, 2, 90, 200, 64, 12, 6, Bhnd, F32, true, false), true),
        // Head dim 64 in f16: on a device with VK_NV_cooperative_matrix2 the f16 partial rows
        // and their merges, small (GQ 3, K 8; GQ 4, K 5) and large (GQ 16, K 17), causal and
        // not, leaves of 64 keys and fewer.
        ((1, 6, 2, 300, 300, 64, 64, 8, Bhnd, F16, true, true), false),
        ((2, 4, 1, 257, 257, 64, 48, 5, Bnhd, F16, false, true), true),
        (
            (1, 16, 1, 150, 150, 64, 32, 17, Bhnd, F16, true, false),
            false,
        ),
    ];
    for &(case, messy) in cases {
        // On a device with VK_NV_cooperative_matrix2 every f16 case of head dim 64 or 128 (GQA
        // groups up to 16, K up to 64 here) takes the f16 rows and the NVIDIA merge.
        let (s, cfg) = case_config(case);
        if ctx.nv_cm2() && case.9 == F16 && matches!(s.head_dim, 64 | 128) {
            let (k, m) = attention::by_leaf::nv_kernel_for(ctx, &s, &cfg).expect("NVIDIA kernel");
            assert!(
                k.name.ends_with("_h") && m.is_some(),
                "{case:?}: {}",
                k.name
            );
        }
        run(ctx, &mut r, case, messy, seed);
    }
}

/// A GQA group past the NVIDIA f16 merge's 16 heads: on a device with
/// VK_NV_cooperative_matrix2 the chunk kernel's f32-row variant (`attention_leaf_d128`) runs,
/// followed by the WGSL merge (elsewhere the WGSL kernels); causal and not, leaves of 64 keys
/// and fewer, a ragged last leaf.
#[test]
fn leaf_major_attention_f32_rows_past_the_f16_merge() {
    let (_settings, ctx, seed, mut r) = leaf_major("leaf_major_f32_rows");
    for case in [
        (1, 32, 1, 150, 150, 128, 64, 6, Bnhd, F16, true, false),
        (1, 24, 1, 97, 161, 128, 48, 4, Bhnd, F16, false, true),
    ] {
        if ctx.nv_cm2() && !skip_f16(ctx, case.9) {
            let (s, cfg) = case_config(case);
            let (k, m) = attention::by_leaf::nv_kernel_for(ctx, &s, &cfg)
                .expect("the NVIDIA chunk kernel for head dim 128");
            assert_eq!((k.name, m.map(|m| m.name)), ("attention_leaf_d128", None));
        }
        run(ctx, &mut r, case, false, seed);
    }
}

/// Selections that list the leaf after the query's own (causal: all its keys masked for that
/// query): the NVIDIA chunk kernel and the WGSL ones must give such a state no weight.
#[test]
fn leaf_major_attention_ignores_future_leaves() {
    let (_settings, ctx, seed, mut r) = leaf_major("leaf_major_future_leaves");
    for case in [
        (1, 4, 1, 300, 300, 128, 64, 8, Bhnd, F16, true, true),
        (1, 8, 2, 257, 257, 64, 64, 5, Bnhd, F16, true, true),
        (1, 4, 2, 200, 200, 80, 32, 4, Bhnd, F32, true, true),
    ] {
        run_with(ctx, &mut r, case, false, true, false, seed);
    }
}

/// Query ranges forced small: a context of its own whose binding limit leaves room for the
/// partial states of a few chunks, so one call runs many ranges and reuses its scratch.
#[test]
fn leaf_major_attention_in_small_ranges() {
    let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
    own.set_leaf_order(LeafOrder::Leaves);
    let seed = seed("leaf_major_attention_in_small_ranges");
    let mut r = rng(seed);
    // D 64, 16-row chunks: 4 KiB of partial state per chunk, so a range holds about 133 queries
    // in the first case (4 ranges; 8 leaves and 4 pairs) and about 125 in the second (8 entries
    // a chunk, 13 leaves and 7 pairs, K 8: 3 ranges per (b, KV head)); the Q, K, V slices of one
    // (b, KV head), 512 KB at most, still fit (the host splits larger calls per (b, KV head)).
    own.set_max_binding_bytes(600_000);
    for case in [
        (1, 4, 1, 500, 500, 64, 64, 4, Bhnd, F32, true, true),
        (2, 4, 2, 300, 500, 64, 40, 8, Bnhd, F32, false, false),
    ] {
        run(&own, &mut r, case, false, seed);
    }
    // Every query in one range, 3 (b, KV head)s per range where 8 need ranges of 3, 3 and 2
    // (GQA 2, 8 entries a chunk: 30 chunks of entries, 7 leaves and 4 pairs, 42 per head of the
    // 146 chunks a binding holds; Q 245 KB, K and V 205 KB each).
    let case = (2, 8, 4, 60, 200, 64, 32, 4, Bnhd, F32, true, true);
    let (s, cfg) = case_config(case);
    let (layout, storage) = (case.8, case.9);
    let range = by_leaf::leaf_major_range(&own, storage, &s, QkvLayouts::from(layout), &cfg);
    assert_eq!(
        range,
        Some((60, 3)),
        "ranges of 60 queries and 3 (b, KV head)s"
    );
    for _ in 0..2 {
        run(&own, &mut r, case, true, seed);
        let pairs = run_with(&own, &mut r, case, false, false, true, seed);
        assert!(pairs > 0, "no sibling pairs in the selection");
    }
    // f16 at D 128 and 64, where a GPU with cooperative matrices runs its tensor-core kernels
    // (on NVIDIA the multi-head twins: f16 rows at GQA 4, f32 rows at GQA 32, and D 64), with
    // a binding limit that gives ranges of several heads and a last range of fewer: the chunk
    // sizes differ by device, so the limit is searched for.
    for case in [
        (3, 12, 3, 50, 400, 128, 64, 4, Bhnd, F16, true, true),
        (1, 96, 3, 40, 300, 128, 32, 4, Bnhd, F16, true, true),
        (3, 6, 3, 50, 400, 64, 32, 4, Bhnd, F16, false, true),
    ] {
        // (An adapter without SHADER_F16, e.g. the GL backend's, runs none of them.)
        if skip_f16(&own, case.9) {
            continue;
        }
        let (s, cfg) = case_config(case);
        let layouts = QkvLayouts::from(case.8);
        let bhs = s.batch * s.kv_heads;
        // Q (the largest of Q, K, V here) within the limit, or the host splits the call.
        let q_bytes = (s.q_elems() * 2) as u64;
        let found = (0..400)
            .map(|i| (q_bytes as f64 * 1.02f64.powi(i)) as u64)
            .find(|&lim| {
                own.set_max_binding_bytes(lim);
                let range = by_leaf::leaf_major_range(&own, case.9, &s, layouts, &cfg);
                matches!(range, Some((nq, h)) if nq == s.q_len && h > 1 && bhs % h != 0)
            });
        let Some(lim) = found else {
            panic!(
                "no binding limit gives ranges of several heads and a shorter last one: {case:?}"
            );
        };
        own.set_max_binding_bytes(lim);
        run(&own, &mut r, case, true, seed);
        let pairs = run_with(&own, &mut r, case, false, false, true, seed);
        assert!(pairs > 0, "no sibling pairs in the selection: {case:?}");
    }
}

/// naga parses and validates the tensor-core kernel's variants (f16, the cooperative-matrix
/// capability enabled; ranges of one and of several heads) and writes SPIR-V for them (the path
/// wgpu takes on Vulkan), on every adapter; the kernel itself runs where cooperative matrices
/// exist.
#[test]
fn leaf_major_coop_shader_validates_and_writes_spirv() {
    use pisa_wgpu::ops::attention::by_leaf::COOP_SHADER;
    use pisa_wgpu::runtime::pipeline::preprocess;
    for (gq, hd, ct, sg, kk) in [
        (4, 128, 4, 32, 16),
        (1, 64, 1, 32, 4),
        (2, 80, 2, 64, 5),
        (3, 96, 3, 16, 8),
        (7, 128, 4, 32, 3),
        (8, 64, 4, 32, 6),
        (16, 128, 2, 32, 2),
    ] {
        let consts = [
            ("GQ", gq),
            ("QPC", 64 / gq),
            ("MC", kk),
            ("HD", hd),
            ("CT", ct),
            ("SG", sg),
            ("NSG", 4),
            ("MULTI", u32::from(kk % 2 == 0)),
        ];
        let src = preprocess(&COOP_SHADER, Storage::F16, &consts).unwrap();
        assert_spirv(
            &format!("attention_leaf_coop {consts:?}"),
            &src,
            &["attend_leaf"],
        );
    }
}

/// Leaf-major and query-tile attention agree on messy selections: out-of-order entries, indices
/// past the last leaf, all -1 rows (zeros and LSE -inf on both), repeats, future leaves. f32, on
/// whatever path the adapter runs; O and LSE within 1e-5 relative, -inf exactly where the other
/// has it; and both equal the reference over the rows as the kernels document reading them.
#[test]
fn leaf_major_equals_tiles_on_messy_selections() {
    let _settings = settings_lock();
    let ctx = ctx();
    let seed = seed("leaf_major_equals_tiles_on_messy_selections");
    let mut r = rng(seed);
    for (b, hq, hkv, nq, nk, d, c, kk, causal) in [
        (2, 6, 2, 150, 230, 64, 24, 5, true),
        (1, 7, 1, 200, 200, 96, 13, 4, false),
    ] {
        let s = AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
        let cfg = SelectionConfig::new(c, kk).unwrap().with_causal(causal);
        let x = inputs(&mut r, &s, F32);
        let nb0 = nk.div_ceil(c) as i32;
        let sel: Vec<i32> = (0..b * hkv * nq * kk)
            .map(|i| {
                if (i / kk) % 17 == 3 {
                    -1 // every slot of some rows: an empty row
                } else {
                    r.random_range(-1..nb0 + 2) // holes, repeats, disorder, past the last leaf
                }
            })
            .collect();
        let mut out = Vec::new();
        for order in [LeafOrder::Tiles, LeafOrder::Leaves] {
            ctx.set_leaf_order(order);
            let got =
                attention::sparse_attention_host(ctx, &x.q, &x.k, &x.v, &s, Bhnd, &cfg, F32, &sel)
                    .unwrap();
            out.push(got);
        }
        ctx.set_leaf_order(LeafOrder::Leaves);
        let what = format!("{s:?} C {c} K {kk} causal {causal} seed {seed}");
        let path = leaf_major_path(ctx, F32, &s, QkvLayouts::from(Bhnd), &cfg);
        assert!(path.is_some(), "{what}: the leaf-major path does not run");
        let close = |a: f32, b: f32| {
            (a == b) || (a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-5 * (1.0 + b.abs()))
        };
        for (i, (a, bb)) in out[1].1.iter().zip(&out[0].1).enumerate() {
            assert!(close(*a, *bb), "{what}: LSE {i}: leaves {a}, tiles {bb}");
        }
        for (i, (a, bb)) in out[1].0.iter().zip(&out[0].0).enumerate() {
            assert!(close(*a, *bb), "{what}: O {i}: leaves {a}, tiles {bb}");
        }
        let empty = out[0].1.iter().filter(|l| **l == f32::NEG_INFINITY).count();
        eprintln!("  {what}: equal, {empty} empty rows");
        assert!(empty > 0, "{what}: no empty row was tested");
        // And against the reference over the rows as `record_sparse_attention` documents
        // reading them: a -1, an index past the last leaf, or an entry not above the last one
        // kept is ignored (the reference masks future keys itself).
        let read: Vec<i32> = sel
            .chunks(kk)
            .flat_map(|row| {
                let mut kept = Vec::with_capacity(kk);
                for &x in row {
                    if x >= 0 && x < nb0 && kept.last().is_none_or(|&l| x > l) {
                        kept.push(x);
                    }
                }
                kept.resize(kk, -1);
                kept
            })
            .collect();
        let (ro, rl) =
            reference::sparse_attention(&x.q, &x.k, &x.v, &s, Bhnd, &cfg, &read).unwrap();
        // Rows that attend to nothing (zeros, LSE -inf) apart, the others as every case.
        let seen: Vec<usize> = (0..rl.len()).filter(|&i| rl[i].is_finite()).collect();
        for i in (0..rl.len()).filter(|&i| !rl[i].is_finite()) {
            let (o, l) = (&out[1].0[i * d..(i + 1) * d], out[1].1[i]);
            assert!(
                l == f32::NEG_INFINITY && o.iter().all(|&x| x == 0.0),
                "{what}: row {i} attends to nothing: LSE {l}"
            );
        }
        let rows = |o: &[f32]| -> Vec<f32> {
            seen.iter()
                .flat_map(|&i| o[i * d..(i + 1) * d].to_vec())
                .collect()
        };
        let (wo, wl): (Vec<f64>, Vec<f64>) = (
            seen.iter()
                .flat_map(|&i| ro[i * d..(i + 1) * d].to_vec())
                .collect(),
            seen.iter().map(|&i| rl[i]).collect(),
        );
        let gl: Vec<f32> = seen.iter().map(|&i| out[1].1[i]).collect();
        check(
            &format!("{what}, against the reference"),
            (&rows(&out[1].0), &gl),
            (&wo, &wl),
            F32,
        );
        assert!(
            seen.len() * 2 > rl.len(),
            "{what}: {} of {} rows attend to keys",
            seen.len(),
            rl.len()
        );
    }
}

/// Profiled, leaf-major attention is timed in its three parts when the profiler has room for
/// every part of every range, and as one "attention" pass when it has not; the outputs are the
/// same either way (and the same as unprofiled).
#[test]
fn leaf_major_attention_profiled_in_parts_or_whole() {
    use pisa_wgpu::Profiler;
    let (_settings, ctx, _, mut r) = leaf_major("leaf_major_attention_profiled");
    let s = AttentionShape::new(2, 4, 2, 130, 130, 32).unwrap();
    let cfg = SelectionConfig::new(16, 3).unwrap();
    assert!(leaf_major_path(ctx, F32, &s, QkvLayouts::from(Bhnd), &cfg).is_some());
    let x = inputs(&mut r, &s, F32);
    let sel = attention_util::random_selection(&mut r, &s, &cfg);
    let (q, k, v) = (
        ctx.upload("q", &x.q, F32).unwrap(),
        ctx.upload("k", &x.k, F32).unwrap(),
        ctx.upload("v", &x.v, F32).unwrap(),
    );
    let sel = ctx.upload_u32("selection", &sel).unwrap();
    let run = |capacity: Option<u32>| {
        let mut prof = capacity.map(|c| Profiler::new(ctx, c));
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let (o, lse) = attention::record_sparse_attention(
            ctx,
            &mut enc,
            &q,
            &k,
            &v,
            &sel,
            &s,
            Bhnd.into(),
            &cfg,
            prof.as_mut(),
        )
        .unwrap();
        ctx.queue().submit([enc.finish()]);
        let stages: Vec<String> = match prof {
            Some(p) => p
                .finish(ctx)
                .unwrap()
                .stages
                .into_iter()
                .map(|x| x.0)
                .collect(),
            None => Vec::new(),
        };
        (
            ctx.read_f32(&o).unwrap(),
            ctx.read_f32(&lse).unwrap(),
            stages,
        )
    };
    let plain = run(None);
    // The 4 (b, KV head)s in one range (every query fits): three parts.
    assert_eq!(
        attention::by_leaf::leaf_major_range(ctx, F32, &s, QkvLayouts::from(Bhnd), &cfg),
        Some((130, 4))
    );
    let parts = run(Some(3));
    let whole = run(Some(2));
    if ctx.has_timestamps() {
        let names = attention::by_leaf::PARTS;
        assert_eq!(
            parts.2,
            names.map(String::from).to_vec(),
            "room for every part"
        );
        assert_eq!(
            whole.2,
            vec!["attention".to_string()],
            "no room for every part"
        );
    }
    for got in [&parts, &whole] {
        assert_eq!(got.0, plain.0, "O");
        assert_eq!(got.1, plain.1, "LSE");
    }
}
