//! `PrefillPlan` over a prefix: `q_len < k_len`, the queries being the last `q_len` of the
//! `k_len` tokens (a chunk of a prompt prefilled over its earlier chunks' keys and values).
//! Each run is checked against the CPU reference: the selection against `select_pisa` (a row
//! may differ only where the reference's margin, the gap between its K-th and (K+1)-th
//! scores, is within rounding: `common::tie_tol`, a still valid row, at most 5% of rows), O and LSE against
//! `sparse_attention` over the GPU's own selection (relative error 1e-4 for f32, 5e-3 for f16).
//! Outputs start as NaN, so an unwritten element fails. Inputs are read in place (BHND at byte
//! 0) or gathered (BNHD at byte 52); a decode cache taking over such a plan holds all `k_len`
//! keys and decodes bitwise like one loaded from the same keys and values.
mod common;

use common::*;
use pisa_core::reference::{select_pisa, sparse_attention};
use pisa_core::{AttentionShape, PisaError, SelectionConfig, TensorLayout};
use pisa_wgpu::{
    wgpu, Context, DType, GpuError, KvCache, LeafOrder, PlanViews, PrefillOptions, PrefillOutputs,
    PrefillPlan, StepOutputs, Storage, TensorView, VarlenPrefillPlan,
};

const PAD: usize = 52;

/// The caller's view of BHND `data` of `shape`: BHND at byte 0 (read in place) when
/// `in_place`, else BNHD at byte `PAD` (gathered).
fn input(
    ctx: &Context,
    data: &[f32],
    shape: [usize; 4],
    st: Storage,
    in_place: bool,
) -> TensorView {
    let (pad, layout, host) = match in_place {
        true => (0, TensorLayout::Bhnd, data.to_vec()),
        false => (
            PAD,
            TensorLayout::Bnhd,
            to_bnhd(data, shape[0], shape[1], shape[2], shape[3]),
        ),
    };
    let buf = storage_buffer(ctx, pad, &host, st);
    TensorView::contiguous(&buf, pad as u64, DType::from(st), shape, layout).unwrap()
}

struct Case {
    shape: AttentionShape,
    cfg: SelectionConfig,
    storage: Storage,
    in_place: bool,
}

/// Plans `c`, runs it once on fresh random inputs and checks the selection, O and LSE against
/// the reference. Returns the plan and the inputs (BHND host data, as stored).
fn run_case(ctx: &Context, c: &Case, seed: u64) -> (PrefillPlan, [Vec<f32>; 3], [TensorView; 3]) {
    let s = c.shape;
    let st = c.storage;
    let mut r = rng(seed);
    let [q, k, v] = [s.q_elems(), s.kv_elems(), s.kv_elems()]
        .map(|n| through_storage(&random(&mut r, n, 1.0), st));
    let (b, hq, hkv, nq, nk, d) = (s.batch, s.q_heads, s.kv_heads, s.q_len, s.k_len, s.head_dim);
    let kk = c.cfg.top_k;
    let views = [
        input(ctx, &q, [b, hq, nq, d], st, c.in_place),
        input(ctx, &k, [b, hkv, nk, d], st, c.in_place),
        input(ctx, &v, [b, hkv, nk, d], st, c.in_place),
    ];
    let opts = PrefillOptions {
        cfg: c.cfg,
        storage: st,
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &s, &opts).unwrap();
    let [qv, kv, vv] = &views;
    let read = plan.reads_in_place_qkv(qv, kv, vv);
    assert_eq!(read, [c.in_place; 3], "{s:?}");
    let (ob, lb) = (
        app_buffer(ctx, &vec![f32::NAN; s.q_elems()]),
        app_buffer(ctx, &vec![f32::NAN; s.lse_elems()]),
    );
    let sb = storage_buffer(
        ctx,
        0,
        &vec![f32::from_bits(0x7FFF_FFFF); b * hkv * nq * kk],
        Storage::F32,
    );
    let sv = TensorView::contiguous(&sb, 0, DType::I32, [b, hkv, nq, kk], TensorLayout::Bhnd);
    let sv = sv.unwrap();
    let (ov, lv) = (bhnd_f32(&ob, [b, hq, nq, d]), bhnd_f32(&lb, [b, hq, nq, 1]));
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&sv),
    };
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    plan.run(&mut enc, qv, kv, vv, &outs, None).unwrap();
    ctx.scoped("submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    let sel_bytes = ctx.read_bytes(&sb).unwrap();
    // (the buffer holds 64 bytes of 0x5A past the selection)
    let sel: Vec<i32> = bytemuck::cast_slice(&sel_bytes[..4 * b * hkv * nq * kk]).to_vec();
    let got_o: Vec<f32> = bytemuck::cast_slice(&ctx.read_bytes(&ob).unwrap()).to_vec();
    let got_lse: Vec<f32> = bytemuck::cast_slice(&ctx.read_bytes(&lb).unwrap()).to_vec();
    let what = format!("{s:?} {st:?} seed {seed}");
    check_reference(&what, c, [&q, &k, &v], &sel, &got_o, &got_lse);
    (plan, [q, k, v], views)
}

/// Checks a run's selection (BHND `[B, Hkv, Nq, K]`), O and LSE against the reference on the
/// BHND inputs `q`, `k`, `v` (as stored) of case `c`.
fn check_reference(
    what: &str,
    c: &Case,
    [q, k, v]: [&[f32]; 3],
    sel: &[i32],
    got_o: &[f32],
    got_lse: &[f32],
) {
    let (s, st) = (&c.shape, c.storage);
    let want = select_pisa(q, k, s, TensorLayout::Bhnd, &c.cfg).unwrap();
    let tie = tie_tol_of(s, &c.cfg, q, k, st);
    let ties = check_selection_ties(what, sel, &want, c.cfg.top_k, tie);
    eprintln!("{what}: {ties} of {} rows differ within a tie", want.rows());
    let (o, lse) = sparse_attention(q, k, v, s, TensorLayout::Bhnd, &c.cfg, sel).unwrap();
    let tol = if st == Storage::F16 { 5e-3 } else { 1e-4 };
    assert!(
        got_o.iter().chain(got_lse).all(|x| x.is_finite()),
        "{what}: unwritten output"
    );
    let e = rel_err(got_o, &o);
    assert!(e < tol, "{what}: O rel err {e}");
    let e = rel_err(got_lse, &lse);
    assert!(e < tol, "{what}: LSE rel err {e}");
}

/// GQA groups 1, 3, 4 and 7, head dims 32 to 128, query counts from 1 to most of the keys, key
/// counts that are not multiples of the block size, f32 and f16, inputs read in place and
/// gathered, in both leaf orders (query tiles and leaf-major kernels).
#[test]
fn plan_over_a_prefix_matches_the_reference() {
    // Its own context: the leaf order changes below.
    let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
    let ctx = &own;
    let base = seed("plan_over_a_prefix");
    let sh = |b, hq, hkv, nq, nk, d| AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
    let cases = [
        Case {
            shape: sh(2, 6, 2, 37, 203, 32),
            cfg: SelectionConfig::new(32, 3).unwrap(),
            storage: Storage::F32,
            in_place: false,
        },
        Case {
            shape: sh(1, 7, 1, 70, 150, 64),
            cfg: SelectionConfig::new(16, 4).unwrap().with_forced(1, 1),
            storage: Storage::F32,
            in_place: true,
        },
        Case {
            shape: sh(1, 3, 3, 1, 261, 80),
            cfg: SelectionConfig::new(16, 5).unwrap(),
            storage: Storage::F32,
            in_place: true,
        },
        Case {
            shape: sh(1, 8, 2, 129, 300, 128),
            cfg: SelectionConfig::new(32, 4).unwrap().with_merge_factor(3),
            storage: Storage::F16,
            in_place: false,
        },
    ];
    for order in [LeafOrder::Tiles, LeafOrder::Leaves] {
        ctx.set_leaf_order(order);
        for (i, c) in cases.iter().enumerate() {
            if c.storage == Storage::F16 && !ctx.has_f16() {
                eprintln!("no SHADER_F16: f16 case skipped");
                continue;
            }
            run_case(ctx, c, base + i as u64);
        }
    }
}

/// A decode cache taking over a plan over a prefix holds all `k_len` keys and its pyramid:
/// its steps equal, bitwise, those of a cache loaded from the same keys and values through
/// views (itself checked against the reference in `tests/embedding.rs`). Both caches start
/// poisoned and decode 20 steps, O and LSE poisoned before each.
#[test]
fn cache_from_a_prefix_plan_decodes_like_cache_from_views() {
    let ctx = ctx();
    let (hq, hkv, d) = (4usize, 2usize, 32usize);
    let cfg = SelectionConfig::new(16, 3).unwrap();
    for in_place in [true, false] {
        let c = Case {
            shape: AttentionShape::new(1, hq, hkv, 25, 118, d).unwrap(),
            cfg,
            storage: Storage::F32,
            in_place,
        };
        let (plan, _, [_, kv, vv]) = run_case(ctx, &c, seed("cache_from_a_prefix_plan"));
        let new_cache = || KvCache::new(ctx, 1, 160, hq, hkv, d, cfg, Storage::F32).unwrap();
        let (mut from_plan, mut from_views) = (new_cache(), new_cache());
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        from_plan
            .record_prefill_from_plan(&mut enc, 0, &plan, 0)
            .unwrap();
        // The reference cache reads the same keys and values, gathered from the same views.
        from_views
            .record_prefill_view(&mut enc, 0, &kv, &vv)
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        assert_eq!(from_plan.lens(), &[118]);
        let what = format!("in place {in_place}");
        let seed = seed("cache_from_a_prefix_plan_steps");
        decode_alike(
            ctx,
            [&mut from_plan, &mut from_views],
            [hq, hkv, d],
            20,
            seed,
            &what,
        );
    }
}

/// `VarlenPrefillPlan::run_with_keys`: sequences of 20 queries over 90 keys, none over 40 (skipped),
/// 33 over their own 33, and 5 over 130, packed `[T, H, D]` along the token dimension; each
/// sequence's rows are checked against the reference on its own data, with room for two of
/// the three sequence plans (one is dropped and made again within the run). Offsets that do
/// not pair up are refused, naming the list at fault.
#[test]
fn varlen_with_keys_matches_the_reference() {
    let ctx = ctx();
    let (hq, hkv, d) = (6usize, 2usize, 32usize);
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let lens = [(20usize, 90usize), (0, 40), (33, 33), (5, 130)];
    let cu = |f: fn(&(usize, usize)) -> usize| -> Vec<usize> {
        let mut c = vec![0];
        for l in &lens {
            c.push(c.last().unwrap() + f(l));
        }
        c
    };
    let (cu_q, cu_k) = (cu(|l| l.0), cu(|l| l.1));
    let (tq, tk) = (cu_q[lens.len()], cu_k[lens.len()]);
    let mut r = rng(seed("varlen_with_keys"));
    // Per sequence, BHND [1, H, n, D]; packed into [T, H, D].
    let seqs: Vec<[Vec<f32>; 3]> = lens
        .iter()
        .map(|&(nq, nk)| [hq * nq * d, hkv * nk * d, hkv * nk * d].map(|n| random(&mut r, n, 1.0)))
        .collect();
    let pack = |which: usize, h: usize, cu: &[usize]| {
        let t = cu[lens.len()];
        let mut out = vec![f32::NAN; t * h * d];
        for (i, sq) in seqs.iter().enumerate() {
            let n = cu[i + 1] - cu[i];
            for hi in 0..h {
                for j in 0..n {
                    let src = (hi * n + j) * d;
                    let dst = ((cu[i] + j) * h + hi) * d;
                    out[dst..dst + d].copy_from_slice(&sq[which][src..src + d]);
                }
            }
        }
        out
    };
    let view = |data: &[f32], h: usize, t: usize| {
        let buf = app_buffer(ctx, data);
        TensorView::contiguous(&buf, 0, DType::F32, [1, h, t, d], TensorLayout::Bnhd).unwrap()
    };
    let (qv, kv, vv) = (
        view(&pack(0, hq, &cu_q), hq, tq),
        view(&pack(1, hkv, &cu_k), hkv, tk),
        view(&pack(2, hkv, &cu_k), hkv, tk),
    );
    let (ob, lb, sb) = (
        app_buffer(ctx, &vec![f32::NAN; hq * tq * d]),
        app_buffer(ctx, &vec![f32::NAN; hq * tq]),
        app_buffer(ctx, &vec![f32::from_bits(0x7FFF_FFFF); hkv * tq * 3]),
    );
    let (ov, lv) = (bhnd_f32(&ob, [1, hq, tq, d]), bhnd_f32(&lb, [1, hq, tq, 1]));
    let sv = TensorView::contiguous(&sb, 0, DType::I32, [1, hkv, tq, 3], TensorLayout::Bhnd);
    let sv = sv.unwrap();
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&sv),
    };
    // Three sequence shapes and room for two plans: the least recently used is dropped.
    let varlen = VarlenPrefillPlan::new(ctx, hq, hkv, d, &opts)
        .unwrap()
        .with_kept_plans(2);
    // Shapes planned ahead: a shape with more queries than keys is refused before any plan is
    // made, and one without queries needs none.
    let e = varlen.prepare_with_keys(&[(20, 90), (91, 90)]).unwrap_err();
    assert!(
        matches!(
            e,
            GpuError::Input(PisaError::QueryLongerThanKeys {
                q_len: 91,
                k_len: 90
            })
        ),
        "{e}"
    );
    assert_eq!(varlen.kept_plans(), 0);
    varlen.prepare_with_keys(&[(0, 40), (20, 90)]).unwrap();
    assert_eq!(varlen.kept_plans(), 1);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    // Offsets that do not pair up, or a sequence with fewer keys than queries, are refused
    // before anything is recorded.
    let short_k: Vec<usize> = cu_k[..4].to_vec();
    let fewer = [0, 20, 20, 53, 57];
    let wrong_k = view(&pack(1, hkv, &cu_k)[..(tk - 1) * hkv * d], hkv, tk - 1);
    let (not_from_0, decreasing) = ([5, 95, 135, 168, 303], [0, 90, 130, 120, 298]);
    for (ck, k, needle) in [
        (&short_k[..], &kv, "one offset per offset"),
        (&fewer[..], &kv, "fewer keys than queries"),
        (&cu_k[..], &wrong_k, "k: expected shape"),
        // The list at fault is named: cu_seqlens_q is right in each of these.
        (
            &not_from_0[..],
            &kv,
            "cu_seqlens_k: the first offset must be 0",
        ),
        (
            &decreasing[..],
            &kv,
            "cu_seqlens_k: offsets must not decrease",
        ),
    ] {
        let e = varlen
            .run_with_keys(&mut enc, &cu_q, ck, &qv, k, &vv, &outs, None)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::Input(_) | GpuError::View(_)) && e.to_string().contains(needle),
            "{e}"
        );
    }
    varlen
        .run_with_keys(&mut enc, &cu_q, &cu_k, &qv, &kv, &vv, &outs, None)
        .unwrap();
    ctx.scoped("submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    assert_eq!(varlen.kept_plans(), 2);
    let (o, lse) = (read_all(ctx, &ob), read_all(ctx, &lb));
    let sel: Vec<i32> = bytemuck::cast_slice(&ctx.read_bytes(&sb).unwrap()).to_vec();
    // Rows of sequence i: head h's tokens cu_q[i] .. cu_q[i + 1] of each output.
    let rows = |x: &[f32], h: usize, w: usize, i: usize| -> Vec<f32> {
        (0..h)
            .flat_map(|hi| (cu_q[i]..cu_q[i + 1]).map(move |t| (hi * tq + t) * w))
            .flat_map(|at| x[at..at + w].to_vec())
            .collect()
    };
    for (i, &(nq, nk)) in lens.iter().enumerate().filter(|l| l.1 .0 > 0) {
        let sel_i: Vec<i32> = (0..hkv)
            .flat_map(|hi| (cu_q[i]..cu_q[i + 1]).map(move |t| (hi * tq + t) * 3))
            .flat_map(|at| sel[at..at + 3].to_vec())
            .collect();
        let c = Case {
            shape: AttentionShape::new(1, hq, hkv, nq, nk, d).unwrap(),
            cfg,
            storage: Storage::F32,
            in_place: false,
        };
        let [q, k, v] = &seqs[i];
        let what = format!("sequence {i} ({nq} queries over {nk} keys)");
        let (o_i, l_i) = (rows(&o, hq, d, i), rows(&lse, hq, 1, i));
        check_reference(&what, &c, [q, k, v], &sel_i, &o_i, &l_i);
    }
}

fn read_all(ctx: &Context, b: &wgpu::Buffer) -> Vec<f32> {
    bytemuck::cast_slice(&ctx.read_bytes(b).unwrap()).to_vec()
}

/// A plan over a prefix made by `PrefillPlan::new_in_place` (no staging, O written in place by
/// the kernels) equals, bitwise, the plan that gathers (itself checked against the reference
/// above), on the same views.
#[test]
fn in_place_plan_over_a_prefix_equals_the_gathering_plan() {
    let ctx = ctx();
    let c = Case {
        shape: AttentionShape::new(1, 8, 2, 45, 170, 64).unwrap(),
        cfg: SelectionConfig::new(16, 4).unwrap(),
        storage: Storage::F32,
        in_place: true,
    };
    let s = c.shape;
    let (gathering, _, [qv, kv, vv]) = run_case(ctx, &c, seed("in_place_plan_over_a_prefix"));
    let (hq, nq, d) = (s.q_heads, s.q_len, s.head_dim);
    let opts = *gathering.options();
    let mut got = Vec::new();
    for own in [false, true] {
        let (ob, lb) = (
            app_buffer(ctx, &vec![f32::NAN; s.q_elems()]),
            app_buffer(ctx, &vec![f32::NAN; s.lse_elems()]),
        );
        let (ov, lv) = (bhnd_f32(&ob, [1, hq, nq, d]), bhnd_f32(&lb, [1, hq, nq, 1]));
        let outs = PrefillOutputs {
            out: &ov,
            lse: &lv,
            selection: None,
        };
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        if own {
            let views = PlanViews {
                q: &qv,
                k: &kv,
                v: &vv,
                out: Some(&ov),
            };
            let plan = PrefillPlan::new_in_place(ctx, &s, &opts, &views).unwrap();
            plan.run(&mut enc, &qv, &kv, &vv, &outs, None).unwrap();
        } else {
            gathering.run(&mut enc, &qv, &kv, &vv, &outs, None).unwrap();
        }
        ctx.queue().submit([enc.finish()]);
        got.push((read_all(ctx, &ob), read_all(ctx, &lb)));
    }
    assert!(got[1].0.iter().all(|x| x.is_finite()), "O unwritten");
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got[0].0), bits(&got[1].0), "O");
    assert_eq!(bits(&got[0].1), bits(&got[1].1), "LSE");
}

/// `VarlenPrefillPlan::run_with_keys_into_cache`: sequences of 20 queries over 90 keys, none
/// over 40 (loaded from its keys), none over none (empties its cache sequence, which held
/// tokens), and 33 over their own 33, into cache sequences 2, 0, 1 and 3. The cache holds every
/// sequence's keys and decodes, bitwise, like one loaded from the same keys and values through
/// views; both start poisoned (the outputs NaN before each step).
#[test]
fn varlen_with_keys_into_cache_decodes_like_cache_from_views() {
    let ctx = ctx();
    let (hq, hkv, d) = (4usize, 2usize, 32usize);
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let (cu_q, cu_k) = ([0usize, 20, 20, 20, 53], [0usize, 90, 130, 130, 163]);
    let seqs = [2usize, 0, 1, 3];
    let (tq, tk) = (53, 163);
    let mut r = rng(seed("varlen_with_keys_into_cache"));
    let q = app_buffer(ctx, &random(&mut r, hq * tq * d, 1.0));
    let k = app_buffer(ctx, &random(&mut r, hkv * tk * d, 1.0));
    let v = app_buffer(ctx, &random(&mut r, hkv * tk * d, 1.0));
    let (qv, kv, vv) = (
        bhnd_f32(&q, [1, hq, tq, d]),
        bhnd_f32(&k, [1, hkv, tk, d]),
        bhnd_f32(&v, [1, hkv, tk, d]),
    );
    let (ob, lb) = (
        app_buffer(ctx, &vec![f32::NAN; hq * tq * d]),
        app_buffer(ctx, &vec![f32::NAN; hq * tq]),
    );
    let (ov, lv) = (bhnd_f32(&ob, [1, hq, tq, d]), bhnd_f32(&lb, [1, hq, tq, 1]));
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    let new_cache = || KvCache::new(ctx, 4, 200, hq, hkv, d, cfg, Storage::F32).unwrap();
    let (mut from_plan, mut from_views) = (new_cache(), new_cache());
    let varlen = VarlenPrefillPlan::new(ctx, hq, hkv, d, &opts).unwrap();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    // Cache sequence 1 holds tokens first: the empty sequence must empty it.
    let k50 = kv.tokens(0, 50).unwrap();
    let v50 = vv.tokens(0, 50).unwrap();
    from_plan
        .record_prefill_view(&mut enc, 1, &k50, &v50)
        .unwrap();
    // A cache too short for a sequence's keys is refused before anything is recorded.
    let mut short = KvCache::new(ctx, 4, 64, hq, hkv, d, cfg, Storage::F32).unwrap();
    let e = varlen
        .run_with_keys_into_cache(
            &mut enc, &cu_q, &cu_k, &qv, &kv, &vv, &outs, &mut short, &seqs, None,
        )
        .unwrap_err();
    assert!(matches!(e, GpuError::Input(_)), "{e}");
    varlen
        .run_with_keys_into_cache(
            &mut enc,
            &cu_q,
            &cu_k,
            &qv,
            &kv,
            &vv,
            &outs,
            &mut from_plan,
            &seqs,
            None,
        )
        .unwrap();
    for i in 0..4 {
        let (k0, nk) = (cu_k[i], cu_k[i + 1] - cu_k[i]);
        if nk > 0 {
            let (ks, vs) = (kv.tokens(k0, nk).unwrap(), vv.tokens(k0, nk).unwrap());
            from_views
                .record_prefill_view(&mut enc, seqs[i], &ks, &vs)
                .unwrap();
        }
    }
    ctx.scoped("submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    assert_eq!(from_plan.lens(), &[40, 0, 90, 33]);
    assert_eq!(from_views.lens(), from_plan.lens());
    let o = read_all(ctx, &ob);
    assert!(o.iter().all(|x| x.is_finite()), "O unwritten");
    let seed = seed("varlen_with_keys_into_cache_steps");
    decode_alike(
        ctx,
        [&mut from_plan, &mut from_views],
        [hq, hkv, d],
        12,
        seed,
        "varlen",
    );
}

/// A varlen run into a cache whose second sequence's plan cannot be made (its buffers past the
/// storage-binding limit, lowered on a context of its own so that the cache still fits) fails
/// before anything is recorded: the first sequence, keys only, is not loaded into the cache
/// (its length stays 0, where it was 30 when plans were made as the run went). And `q_tile` 0 is refused by
/// `VarlenPrefillPlan::new` itself, not at the first run.
#[test]
fn varlen_into_cache_error_mid_batch_records_nothing() {
    static SMALL: std::sync::OnceLock<Context> = std::sync::OnceLock::new();
    let (hq, hkv, d, n) = (8usize, 2usize, 32usize, 100usize);
    let small = SMALL.get_or_init(|| {
        let c = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
        c.set_max_binding_bytes((2 * n * d * 4 + 256) as u64); // two cache rows of capacity n
        c
    });
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let zero = PrefillOptions { q_tile: 0, ..opts };
    let e = VarlenPrefillPlan::new(small, hq, hkv, d, &zero).unwrap_err();
    assert!(
        matches!(e, GpuError::Input(PisaError::Zero { what: "q_tile" })),
        "{e}"
    );
    let mut cache = KvCache::new(small, 2, n, hq, hkv, d, cfg, Storage::F32).unwrap();
    let (cu_q, cu_k) = ([0usize, 0, n], [0usize, 30, 30 + n]);
    let (tq, tk) = (n, 30 + n);
    let mut r = rng(seed("varlen_into_cache_error_mid_batch"));
    let q = app_buffer(small, &random(&mut r, hq * tq * d, 1.0));
    let k = app_buffer(small, &random(&mut r, hkv * tk * d, 1.0));
    let v = app_buffer(small, &random(&mut r, hkv * tk * d, 1.0));
    let (ob, lb) = (
        app_buffer(small, &vec![f32::NAN; hq * tq * d]),
        app_buffer(small, &vec![f32::NAN; hq * tq]),
    );
    let (ov, lv) = (bhnd_f32(&ob, [1, hq, tq, d]), bhnd_f32(&lb, [1, hq, tq, 1]));
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    let varlen = VarlenPrefillPlan::new(small, hq, hkv, d, &opts).unwrap();
    let mut enc = small.device().create_command_encoder(&Default::default());
    let e = varlen
        .run_with_keys_into_cache(
            &mut enc,
            &cu_q,
            &cu_k,
            &bhnd_f32(&q, [1, hq, tq, d]),
            &bhnd_f32(&k, [1, hkv, tk, d]),
            &bhnd_f32(&v, [1, hkv, tk, d]),
            &outs,
            &mut cache,
            &[0, 1],
            None,
        )
        .unwrap_err();
    assert!(matches!(e, GpuError::Limit { .. }), "{e}");
    assert_eq!(cache.lens(), &[0, 0], "nothing loaded on error");
}

/// Appends a random key and value to every sequence of both caches and steps them with the same
/// random queries, `steps` times: O (NaN before each step, so unwritten elements show) must be
/// finite and both caches' O and LSE equal bitwise. `[hq, hkv, d]`: the caches' heads and head
/// dim; `what` names the case in a failure.
fn decode_alike(
    ctx: &Context,
    caches: [&mut KvCache; 2],
    [hq, hkv, d]: [usize; 3],
    steps: u64,
    seed: u64,
    what: &str,
) {
    let b = caches[0].lens().len();
    let active = vec![true; b];
    let [first, second] = caches;
    for step in 0..steps {
        let row =
            |n: usize, i: u64| app_buffer(ctx, &random(&mut rng(seed + 3 * step + i), n, 1.0));
        let (kr, vr, qr) = (row(b * hkv * d, 0), row(b * hkv * d, 1), row(b * hq * d, 2));
        let mut got = Vec::new();
        for cache in [&mut *first, &mut *second] {
            let (ob, lb) = (
                app_buffer(ctx, &vec![f32::NAN; b * hq * d]),
                app_buffer(ctx, &vec![f32::NAN; b * hq]),
            );
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let (krv, vrv) = (bhnd_f32(&kr, [b, hkv, 1, d]), bhnd_f32(&vr, [b, hkv, 1, d]));
            cache
                .record_append_view(&mut enc, &krv, &vrv, &active, None)
                .unwrap();
            let (ov, lv) = (bhnd_f32(&ob, [b, hq, 1, d]), bhnd_f32(&lb, [b, hq, 1, 1]));
            let so = StepOutputs {
                out: &ov,
                lse: &lv,
                selection: None,
            };
            let qv = bhnd_f32(&qr, [b, hq, 1, d]);
            cache
                .record_step_into(&mut enc, &qv, Some(&so), None)
                .unwrap();
            ctx.queue().submit([enc.finish()]);
            got.push((read_all(ctx, &ob), read_all(ctx, &lb)));
        }
        assert!(
            got[0].0.iter().all(|x| x.is_finite()),
            "{what} step {step}: unwritten O"
        );
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[0].0), bits(&got[1].0), "{what} step {step}: O");
        assert_eq!(bits(&got[0].1), bits(&got[1].1), "{what} step {step}: LSE");
    }
}
