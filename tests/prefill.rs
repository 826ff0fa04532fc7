//! End-to-end prefill (pyramid, routing, leaf selection, sparse attention) against the CPU
//! reference, and the binding-size split path against the unsplit result.
//!
//! Tie rule: a GPU selection row may differ from the reference's only where the reference's
//! `margin` (smallest gap between a kept and a dropped score at any cut) is within rounding
//! (`common::tie_tol`, from the inputs' magnitudes and the storage), the row is still a valid
//! selection, and at most 5% of the rows differ; the output is always checked against the reference
//! attention over the GPU's own selection, so it is exact whatever ties did.
mod common;

use common::*;
use pisa_core::reference::{select_pisa, sparse_attention};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::prefill::{prefill_host, PrefillOptions};
use pisa_wgpu::{AdapterChoice, Context, StageTimes, Storage};

fn check(
    ctx: &Context,
    shape: AttentionShape,
    cfg: SelectionConfig,
    layout: TensorLayout,
    storage: Storage,
    seed: u64,
) -> Option<StageTimes> {
    let mut r = rng(seed);
    let q = random(&mut r, shape.q_elems(), 1.0);
    let k = random(&mut r, shape.kv_elems(), 1.0);
    let v = random(&mut r, shape.kv_elems(), 1.0);
    check_inputs(ctx, shape, cfg, layout, storage, [q, k, v], seed)
}

/// [`check`] on given inputs (rounded through f16 or bf16 first for those storages, so the
/// reference sees what the GPU stores; bf16 is computed in f32, so its tolerances are f32's).
/// Returns the prefill's stage times, `None` for an f16 case skipped on a device without
/// SHADER_F16.
fn check_inputs(
    ctx: &Context,
    shape: AttentionShape,
    cfg: SelectionConfig,
    layout: TensorLayout,
    storage: Storage,
    [mut q, mut k, mut v]: [Vec<f32>; 3],
    seed: u64,
) -> Option<StageTimes> {
    if storage == Storage::F16 && !ctx.has_f16() {
        eprintln!("{}: no SHADER_F16: f16 case skipped", ctx.report().name);
        return None;
    }
    (q, k, v) = (
        through_storage(&q, storage),
        through_storage(&k, storage),
        through_storage(&v, storage),
    );
    let opts = PrefillOptions {
        cfg,
        layout,
        storage,
        q_tile: 4,
        return_selection: true,
    };
    let got = prefill_host(ctx, &q, &k, &v, &shape, &opts).unwrap();
    let sel = got.selection.as_ref().unwrap();
    let want = select_pisa(&q, &k, &shape, layout, &cfg).unwrap();
    let tie = tie_tol_of(&shape, &cfg, &q, &k, storage);
    let what = format!("seed {seed}");
    let ties = check_selection_ties(&what, sel, &want, cfg.top_k, tie);
    eprintln!(
        "{shape:?} {storage:?}: {ties} of {} rows differ within a tie",
        want.rows()
    );
    let (o, lse) = sparse_attention(&q, &k, &v, &shape, layout, &cfg, sel).unwrap();
    let tol = if storage == Storage::F16 { 5e-3 } else { 1e-4 };
    let e = rel_err(&got.out, &o);
    assert!(e < tol, "O rel err {e} (seed {seed})");
    let e = rel_err(&got.lse, &lse);
    assert!(e < tol, "LSE rel err {e} (seed {seed})");
    assert!(
        // (the tile kernels' one stage, or leaf-major attention's chunk kernel among its parts)
        got.times
            .stages
            .iter()
            .any(|s| s.0 == "attention" || s.0 == "attention_leaf"),
        "stage times: {:?}",
        got.times
    );
    Some(got.times)
}

#[test]
fn prefill_matches_reference() {
    let ctx = ctx();
    let seed = seed("prefill");
    let cfg = SelectionConfig::new(64, 4).unwrap();
    check(
        ctx,
        AttentionShape::prefill(2, 6, 2, 1000, 64).unwrap(),
        cfg,
        TensorLayout::Bhnd,
        Storage::F32,
        seed,
    );
    let cfg = SelectionConfig::new(16, 6).unwrap().with_forced(1, 1);
    check(
        ctx,
        AttentionShape::prefill(1, 8, 8, 300, 80).unwrap(),
        cfg,
        TensorLayout::Bnhd,
        Storage::F32,
        seed + 1,
    );
    let cfg = SelectionConfig::new(32, 5)
        .unwrap()
        .with_merge_factor(3)
        .with_scoring(pisa_core::Scoring::MeanVar);
    check(
        ctx,
        AttentionShape::prefill(1, 4, 1, 777, 128).unwrap(),
        cfg,
        TensorLayout::Bhnd,
        Storage::F16,
        seed + 2,
    );
}

/// Where every query sees `top_k` or fewer leaves (`ceil(k_len / C) <= top_k`), its selection
/// is every leaf it sees (PISA.md 3, step 3), and the prefill skips the route and the leaf
/// stage (one "select_all" dispatch writes the rows) and runs dense attention: against the
/// reference there, f16 at D 128 and 64, causal and not, a prompt and a chunk over a prefix;
/// f32 and bf16, GQA groups 1 to 8, D 32 to 128. With one leaf more than top_k the route runs.
#[test]
fn prefill_where_every_query_selects_every_leaf() {
    let ctx = ctx();
    let seed = seed("prefill_every_leaf");
    // Which path a case took, from its stage times.
    let shortcut = |t: &StageTimes| match (t.has("select_all"), t.has("route")) {
        (true, false) => true,
        (false, true) => false,
        _ => panic!("stage times: {t:?}"),
    };
    let (f16, f32, bf16) = (Storage::F16, Storage::F32, Storage::Bf16);
    let (bhnd, bnhd) = (TensorLayout::Bhnd, TensorLayout::Bnhd);
    let prefill = AttentionShape::prefill;
    let chunk = AttentionShape::new;
    // (shape, C, K, causal, layout, storage): f16 at D 128 and 64, then f32 and bf16, GQA
    // groups 1, 2, 3, 4, 7, 8, head dims 32 to 128, causal or not, prompts shorter than a
    // prefix of keys, sizes that are not multiples of C; the one case of 1025 keys is routed.
    let cases = [
        (prefill(2, 8, 2, 1000, 128), 64, 16, true, bhnd, f16),
        (chunk(1, 8, 2, 300, 900, 128), 64, 16, true, bnhd, f16),
        (prefill(1, 4, 1, 500, 64), 32, 16, false, bhnd, f16),
        (prefill(1, 8, 2, 1025, 128), 64, 16, true, bhnd, f16),
        (prefill(1, 3, 3, 77, 32), 16, 5, true, bhnd, f32),
        (prefill(2, 6, 3, 130, 64), 32, 5, true, bhnd, f32),
        (chunk(1, 6, 2, 40, 190, 48), 32, 6, true, bhnd, f32),
        (prefill(1, 8, 2, 100, 128), 64, 2, false, bhnd, f32),
        (prefill(1, 7, 1, 150, 64), 16, 10, true, bhnd, bf16),
        (prefill(1, 8, 1, 63, 64), 16, 4, true, bhnd, f32),
        (chunk(2, 16, 2, 33, 97, 32), 16, 7, false, bhnd, bf16),
    ];
    let mut routed = 0;
    for (i, (shape, c, k, causal, layout, storage)) in cases.into_iter().enumerate() {
        let shape = shape.unwrap();
        let cfg = SelectionConfig::new(c, k).unwrap().with_causal(causal);
        let every_leaf = shape.k_len.div_ceil(c) <= k;
        routed += usize::from(!every_leaf);
        // (None: an f16 case on a device without SHADER_F16; the others must run.)
        let t = check(ctx, shape, cfg, layout, storage, seed + i as u64);
        assert!(t.is_some() || storage == f16, "case {i} did not run");
        if let Some(t) = t {
            assert_eq!(shortcut(&t), every_leaf, "case {i}");
        }
    }
    assert_eq!(routed, 1, "cases past top_k leaves");
}

/// A prompt of `n` tokens (Hq 2, Hkv 1, D 16) whose queries keep every leaf at blocks of `c`
/// keys and top_k `k` (`k * c >= n`): its shape, random Q, K, V from the seed of `name`, and
/// options returning the selection.
fn every_leaf_case(
    name: &str,
    n: usize,
    c: usize,
    k: usize,
) -> (AttentionShape, [Vec<f32>; 3], PrefillOptions) {
    let mut r = rng(seed(name));
    let shape = AttentionShape::prefill(1, 2, 1, n, 16).unwrap();
    let qkv = [
        random(&mut r, shape.q_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
    ];
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(c, k).unwrap(),
        return_selection: true,
        ..Default::default()
    };
    (shape, qkv, opts)
}

/// Regression (found by an embedder's trial): the every-leaf selection wrote a row of top_k
/// entries from one invocation, whose loop llvmpipe ends after 65535 iterations, so entries
/// 65535 onwards kept the output's poison instead of -1. One invocation an entry now: with
/// top_k 100000 (past the cap) every row is its visible leaves ascending, then -1 to the end;
/// O and LSE against the reference (dense attention, as every leaf is kept).
#[test]
fn every_leaf_selection_past_the_loop_cap() {
    let ctx = ctx();
    let (c, k) = (16, 100_000);
    let name = "every_leaf_selection_past_the_loop_cap";
    let (shape, [q, kk, v], opts) = every_leaf_case(name, 100, c, k);
    let cfg = opts.cfg;
    let got = prefill_host(ctx, &q, &kk, &v, &shape, &opts).unwrap();
    let sel = got.selection.expect("selection asked for");
    assert_eq!(sel.len(), shape.q_len * k);
    for (i, row) in sel.chunks(k).enumerate() {
        let last = i / c;
        for (j, &x) in row.iter().enumerate() {
            let want = if j <= last { j as i32 } else { -1 };
            assert_eq!(x, want, "row {i} entry {j}");
        }
    }
    // (the rows just checked are the reference's: every visible leaf)
    let (o, lse) = sparse_attention(&q, &kk, &v, &shape, TensorLayout::Bhnd, &cfg, &sel).unwrap();
    let (eo, el) = (rel_err(&got.out, &o), rel_err(&got.lse, &lse));
    assert!(
        eo <= 1e-4 && el <= 1e-4,
        "relative error O {eo:.2e}, LSE {el:.2e}"
    );
}

/// A prompt whose queries keep every leaf allocates no stage-1 candidates (no route runs), so a
/// top_k whose candidates would pass the binding limit, while its selection fits, runs and is
/// right (it was refused, the hint naming the candidates). A context of its own with a binding
/// of 600,000 bytes: candidates 100 x 2 (1000 + 1) x 4 = 800,800 bytes, selection 100 x 1000 x
/// 4 = 400,000.
#[test]
fn every_leaf_prefill_sizes_by_its_selection_not_candidates() {
    let own = Context::new(&AdapterChoice::HighPerformance).unwrap();
    own.set_max_binding_bytes(600_000);
    let k = 1000;
    let name = "every_leaf_prefill_sizes_by_its_selection";
    let (shape, [q, kk, v], opts) = every_leaf_case(name, 100, 16, k);
    let cfg = opts.cfg;
    let got = prefill_host(&own, &q, &kk, &v, &shape, &opts).unwrap();
    let sel = got.selection.expect("selection asked for");
    let want = select_pisa(&q, &kk, &shape, TensorLayout::Bhnd, &cfg).unwrap();
    assert_eq!(sel.len(), want.rows() * k);
    assert_eq!(sel, want.indices, "every visible leaf, ascending, then -1");
    let (o, lse) = sparse_attention(&q, &kk, &v, &shape, TensorLayout::Bhnd, &cfg, &sel).unwrap();
    let (eo, el) = (rel_err(&got.out, &o), rel_err(&got.lse, &lse));
    assert!(
        eo <= 1e-4 && el <= 1e-4,
        "relative error O {eo:.2e}, LSE {el:.2e}"
    );
    // The same call past the selection too (400,000 > 300,000 bytes) is refused, naming top_k.
    own.set_max_binding_bytes(300_000);
    let e = prefill_host(&own, &q, &kk, &v, &shape, &opts).unwrap_err();
    assert!(
        matches!(&e, pisa_wgpu::GpuError::Limit { hint, .. } if hint.contains("the selection")),
        "{e}"
    );
}

/// The shader override (`Tuning::shader_override`, a diagnostic): a pipeline whose file (named as
/// the dump names it) is in the folder is built from that file. The every-leaf selection's
/// shader (`select_all.main`) dumped by one context, edited to pad rows with -7 instead of -1,
/// and run by a context given the folder: its padding is -7 and its leaves as before, where
/// a context without it keeps -1. A file that is not WGSL is an error of the call, not a
/// panic; a folder that does not exist is refused by the knob.
#[test]
fn a_shader_override_replaces_the_pipeline_it_names() {
    let base = std::env::temp_dir().join(format!("pisa-override-{}", std::process::id()));
    let (dump, edit) = (base.join("dump"), base.join("edit"));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&edit).unwrap();
    let with = |f: &dyn Fn(&mut pisa_wgpu::Tuning)| {
        let mut t = pisa_wgpu::Tuning::default();
        f(&mut t);
        Context::with_tuning(&AdapterChoice::HighPerformance, t).unwrap()
    };
    let name = "a_shader_override_replaces_the_pipeline_it_names";
    let (shape, [q, k, v], opts) = every_leaf_case(name, 40, 16, 8);
    let run = |ctx: &Context| prefill_host(ctx, &q, &k, &v, &shape, &opts);
    let plain = run(&with(&|t| t.dump_wgsl = Some(dump.clone()))).unwrap();
    let name = std::fs::read_dir(&dump)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .find(|n| n.starts_with("select_all.main."))
        .expect("the dump holds the selection's pipeline");
    let text = std::fs::read_to_string(dump.join(&name)).unwrap();
    let padding = "select(-1, i32(j), j <= last)";
    assert!(text.contains(padding), "the shader pads with -1");
    std::fs::write(
        edit.join(&name),
        text.replace(padding, "select(-7, i32(j), j <= last)"),
    )
    .unwrap();
    let edited = run(&with(&|t| t.shader_override = Some(edit.clone()))).unwrap();
    let (a, b) = (plain.selection.unwrap(), edited.selection.unwrap());
    assert!(
        a.contains(&-1) && !a.contains(&-7),
        "rows padded with -1 without the override"
    );
    let swapped: Vec<i32> = a.iter().map(|&x| if x == -1 { -7 } else { x }).collect();
    assert_eq!(b, swapped, "the edited pipeline ran, and only it changed");
    std::fs::write(edit.join(&name), "this is not WGSL").unwrap();
    let e = run(&with(&|t| t.shader_override = Some(edit.clone())));
    assert!(
        matches!(e, Err(pisa_wgpu::GpuError::Validation { .. })),
        "a broken override file: {:?}",
        e.map(|_| ())
    );
    let _ = std::fs::remove_dir_all(&base);
    let mut t = pisa_wgpu::Tuning::default();
    assert!(t
        .set("shader_override", &base.display().to_string())
        .is_err());
}

#[test]
fn split_prefill_equals_unsplit() {
    let seed = seed("split prefill");
    let mut r = rng(seed);
    let shape = AttentionShape::prefill(2, 6, 3, 200, 64).unwrap();
    let (q, k, v) = (
        random(&mut r, shape.q_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
    );
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(16, 4).unwrap(),
        return_selection: true,
        ..Default::default()
    };
    let whole = prefill_host(ctx(), &q, &k, &v, &shape, &opts).unwrap();
    assert_eq!(whole.chunks, 1);
    let small = Context::new(&AdapterChoice::HighPerformance).unwrap();
    small.set_max_binding_bytes(2 * 200 * 64 * 4 + 1024); // about one KV head's Q slice
    let split = prefill_host(&small, &q, &k, &v, &shape, &opts).unwrap();
    assert!(
        split.chunks > 1,
        "expected a split, got {} chunk",
        split.chunks
    );
    assert_eq!(split.selection, whole.selection);
    assert_eq!(split.out, whole.out, "split output differs");
    assert_eq!(split.lse, whole.lse);
    small.set_max_binding_bytes(1024);
    let err = prefill_host(&small, &q, &k, &v, &shape, &opts).unwrap_err();
    assert!(matches!(err, pisa_wgpu::GpuError::Limit { .. }), "{err}");
}

#[test]
fn large_gqa_groups_multi_query() {
    // MQA-style groups above 16 query heads per KV head (routing takes heads 16 at a time):
    // the selection sums the scores of all of them (PISA.md section 2).
    let ctx = ctx();
    let seed = seed("large groups");
    let cfg = SelectionConfig::new(16, 4).unwrap();
    check(
        ctx,
        AttentionShape::prefill(1, 32, 1, 700, 64).unwrap(),
        cfg,
        TensorLayout::Bhnd,
        Storage::F32,
        seed,
    );
    let cfg = cfg.with_scoring(pisa_core::Scoring::MeanVar);
    check(
        ctx,
        AttentionShape::prefill(1, 40, 2, 300, 64).unwrap(),
        cfg,
        TensorLayout::Bnhd,
        Storage::F32,
        seed + 1,
    );
    // Past the kernels' group limit: a typed error, not a wrong answer.
    let shape = AttentionShape::prefill(1, 33, 1, 300, 64).unwrap();
    let x = vec![0.5f32; shape.q_elems()];
    let kv = vec![0.25f32; shape.kv_elems()];
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let err = prefill_host(ctx, &x, &kv, &kv, &shape, &opts).unwrap_err();
    assert!(matches!(err, pisa_wgpu::GpuError::Unsupported(_)), "{err}");
    // The same where every query selects every leaf it sees (60 keys, C 16, K 4: no routing
    // runs), so that the shapes a prefill takes do not depend on the prompt's length.
    let shape = AttentionShape::prefill(1, 33, 1, 60, 64).unwrap();
    let x = vec![0.5f32; shape.q_elems()];
    let kv = vec![0.25f32; shape.kv_elems()];
    let err = prefill_host(ctx, &x, &kv, &kv, &shape, &opts).unwrap_err();
    assert!(matches!(err, pisa_wgpu::GpuError::Unsupported(_)), "{err}");
}

/// A prefill whose queries select every leaf they see builds the kernels that
/// `prefill_attention_kernel` reports and no routing or leaf-stage kernel: on a context of its
/// own, the WGSL shaders the call built are the pyramid's, `select_all` and the reported dense
/// kernel's (none for the NVIDIA dense kernel, passthrough SPIR-V), which is the NVIDIA one for
/// f16 at D 64 and 128 where the device has `VK_NV_cooperative_matrix2`.
#[test]
fn every_leaf_prefill_builds_the_kernels_it_reports() {
    use pisa_wgpu::ops::attention::{prefill_attention_kernel, AttentionKernel, AttentionKind};
    let seed = seed("every_leaf_kernels");
    for (i, (shape, storage)) in [
        (AttentionShape::prefill(1, 8, 2, 1000, 128), Storage::F16),
        (AttentionShape::prefill(1, 4, 1, 500, 64), Storage::F16),
        (AttentionShape::prefill(1, 6, 3, 700, 48), Storage::F16),
        (AttentionShape::prefill(2, 4, 2, 333, 64), Storage::F32),
    ]
    .into_iter()
    .enumerate()
    {
        let own = Context::new(&AdapterChoice::HighPerformance).unwrap();
        let shape = shape.unwrap();
        if storage == Storage::F16 && !own.has_f16() {
            eprintln!("no SHADER_F16: case {i} skipped");
            continue;
        }
        let cfg = SelectionConfig::new(64, 16).unwrap();
        let placeholder = own.upload("selection", &[1.0], Storage::F32).unwrap();
        let kind = AttentionKind::Sparse {
            selection: &placeholder,
            cfg: &cfg,
        };
        let reported = prefill_attention_kernel(&own, &shape, storage, &kind);
        let nv = own.nv_cm2() && storage == Storage::F16 && shape.head_dim % 64 == 0;
        assert_eq!(
            reported == AttentionKernel::NvDense,
            nv,
            "case {i}: {reported:?}"
        );
        let attention: &[&str] = match reported {
            AttentionKernel::NvDense => &[],
            AttentionKernel::CoopTile => &["attention_coop"],
            AttentionKernel::PortableTile => &["attention"],
            k => panic!("case {i}: {k:?} for a dense prompt"),
        };
        let before = own.built_shaders();
        let mut r = rng(seed + i as u64);
        let x = [
            random(&mut r, shape.q_elems(), 1.0),
            random(&mut r, shape.kv_elems(), 1.0),
            random(&mut r, shape.kv_elems(), 1.0),
        ];
        let opts = PrefillOptions {
            cfg,
            storage,
            ..Default::default()
        };
        prefill_host(&own, &x[0], &x[1], &x[2], &shape, &opts).unwrap();
        let mut want = vec!["pyramid", "select_all"];
        want.extend_from_slice(attention);
        want.sort_unstable();
        let new: Vec<_> = own
            .built_shaders()
            .into_iter()
            .filter(|s| !before.contains(s) && *s != "fill" && *s != "gather")
            .collect();
        assert_eq!(new, want, "case {i}: shaders built ({reported:?})");
    }
}

/// Q, K, V of the first `n` tokens of real activations (SmolLM2-135M: Hq 9, Hkv 3, D 64) as f32
/// `[1, H, n, 64]`: layer 15 from the repository's demo input, layer 29 from the shared capture
/// beside the repository (`common::real_tensors`). Panics when the file is missing.
fn real_qkv(layer: usize, n: usize) -> [Vec<f32>; 3] {
    let (path, prefix) = match layer {
        15 => (DEMO_INPUT, String::new()),
        _ => (SHARED_CAPTURE, format!("layer{layer}.")),
    };
    let names = [("q", 0..9), ("k", 0..3), ("v", 0..3)].map(|(t, h)| (format!("{prefix}{t}"), h));
    let names: Vec<(&str, std::ops::Range<usize>)> =
        names.iter().map(|(t, h)| (t.as_str(), h.clone())).collect();
    let [q, k, v]: [Vec<f32>; 3] = real_tensors(path, &names, n).try_into().unwrap();
    [q, k, v]
}

/// A prefill of 1024 tokens of real activations of `layer` (GQA group 3, D 64, scale 1/8, f16
/// storage): selections equal the reference's within ties, outputs within 5e-3.
fn prefill_on_layer(layer: usize) {
    let shape = AttentionShape::prefill(1, 9, 3, 1024, 64).unwrap();
    let cfg = SelectionConfig::new(32, 8).unwrap().with_scale(Some(0.125));
    let qkv = real_qkv(layer, 1024);
    check_inputs(
        ctx(),
        shape,
        cfg,
        TensorLayout::Bhnd,
        Storage::F16,
        qkv,
        layer as u64,
    );
}

/// Layer 15 (peaked attention, token 0 a sink), from the repository's demo input.
#[test]
fn prefill_on_real_activations() {
    prefill_on_layer(15);
}

/// Layer 29, from the shared capture beside the repository (not in it).
#[test]
#[ignore = "needs ../shared/data/smollm2-rustbook-8k.safetensors beside the repository"]
fn prefill_on_real_activations_layer_29() {
    prefill_on_layer(29);
}

#[test]
fn repeated_calls_reuse_buffers_and_stay_correct() {
    // Buffers come back to the context's pool after a call and serve the next call of the same
    // shape, rewritten first: the second call on new inputs must equal a fresh context's.
    let seed = seed("buffer reuse");
    let mut r = rng(seed);
    let shape = AttentionShape::prefill(1, 4, 2, 300, 64).unwrap();
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(16, 4).unwrap(),
        return_selection: true,
        ..Default::default()
    };
    let own = Context::new(&AdapterChoice::HighPerformance).unwrap();
    let mut inputs = || {
        (
            random(&mut r, shape.q_elems(), 1.0),
            random(&mut r, shape.kv_elems(), 1.0),
            random(&mut r, shape.kv_elems(), 1.0),
        )
    };
    let (q1, k1, v1) = inputs();
    prefill_host(&own, &q1, &k1, &v1, &shape, &opts).unwrap();
    assert!(
        own.pooled_bytes() > 0,
        "buffers should come back to the pool"
    );
    let pooled = own.pooled_bytes();
    let (q2, k2, v2) = inputs();
    let reused = prefill_host(&own, &q2, &k2, &v2, &shape, &opts).unwrap();
    assert_eq!(
        own.pooled_bytes(),
        pooled,
        "the same buffers went out and came back"
    );
    let fresh = prefill_host(
        &Context::new(&AdapterChoice::HighPerformance).unwrap(),
        &q2,
        &k2,
        &v2,
        &shape,
        &opts,
    )
    .unwrap();
    assert_eq!(reused.out, fresh.out);
    assert_eq!(reused.lse, fresh.lse);
    assert_eq!(reused.selection, fresh.selection);
    own.clear_pool();
    assert_eq!(own.pooled_bytes(), 0);
}

/// A device with WebGPU's default 16 KiB of workgroup memory (an app's or a browser's): the
/// selection's query-tile kernel needs more than that for GQA 16 at D 128 even for one query,
/// so the default order (`LeafOrder::Auto`) runs the leaf-major stage there (it was a `Limit`
/// error telling the app to change its model); against the reference, f32, GQA 16 at D 128
/// and GQA 32 at D 64, lengths not multiples of the block. With `LeafOrder::Tiles` asked for,
/// the same shape stays the typed `Limit` error.
#[test]
fn default_order_runs_leaf_major_where_the_tile_kernel_does_not_fit() {
    use pisa_wgpu::{GpuError, LeafOrder};
    let instance = pisa_wgpu::instance();
    let adapter = pollster::block_on(instance.request_adapter(&Default::default()))
        .expect("a GPU adapter (install mesa-vulkan-drivers)");
    let mut desc = pisa_wgpu::app_device_descriptor(&adapter);
    desc.required_limits.max_compute_workgroup_storage_size = 16384;
    let (device, queue) = pollster::block_on(adapter.request_device(&desc)).unwrap();
    let ctx = Context::from_device(&adapter, device, queue).unwrap();
    assert_eq!(ctx.leaf_order(), LeafOrder::Auto);
    let seed = seed("default_order_runs_leaf_major");
    let cases = [
        (
            AttentionShape::prefill(1, 16, 1, 700, 128).unwrap(),
            SelectionConfig::new(64, 8),
        ),
        (
            AttentionShape::prefill(1, 32, 1, 333, 64).unwrap(),
            SelectionConfig::new(32, 4),
        ),
    ];
    for (i, (shape, cfg)) in cases.iter().enumerate() {
        let (shape, cfg) = (*shape, cfg.clone().unwrap());
        let times = check(
            &ctx,
            shape,
            cfg,
            TensorLayout::Bhnd,
            Storage::F32,
            seed + i as u64,
        )
        .unwrap();
        assert!(
            times.stages.iter().any(|s| s.0 == "leaf_score"),
            "not the leaf-major stage: {times:?}"
        );
    }
    ctx.set_leaf_order(LeafOrder::Tiles);
    let (shape, cfg) = (cases[0].0, cases[0].1.clone().unwrap());
    let q = vec![0.5f32; shape.q_elems()];
    let kv = vec![0.25f32; shape.kv_elems()];
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let err = prefill_host(&ctx, &q, &kv, &kv, &shape, &opts).unwrap_err();
    assert!(matches!(err, GpuError::Limit { .. }), "{err}");
}
