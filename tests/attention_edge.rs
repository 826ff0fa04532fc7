//! GPU attention edge cases against exact values and the f64 CPU reference: rows that see a
//! single key (output V's row within 1e-6 relative, LSE the one scaled score within 1e-5), rows
//! that select nothing (zeros and -inf, every other row finite, so a row the kernel left
//! unwritten in the poisoned output fails), the binding-size split path (bitwise equal to the
//! whole call; below one pair's slice a typed `Limit` error), and invalid inputs as typed
//! errors. Comparisons with the reference use the tolerances of `attention_util.rs` (relative L2
//! error at most 1e-4 for f32 storage).
#[path = "attention_util.rs"]
mod attention_util;
mod common;

use attention_util::{check, inputs, random_selection};
use common::*;
use pisa_core::{reference, AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention;
use pisa_wgpu::{AdapterChoice, Context, GpuError, Storage};
use TensorLayout::{Bhnd, Bnhd};

/// Every row selects only its own block; the query at position 0 then sees a single key, so
/// its output is exactly V's first row and its LSE the one scaled score. A row selecting
/// nothing gets zeros and -inf, like the reference.
#[test]
fn single_key_and_empty_rows() {
    let ctx = ctx();
    let seed = seed("single key");
    let mut r = rng(seed);
    let (c, kk) = (16, 3);
    let s = AttentionShape::new(1, 2, 1, 40, 40, 64).unwrap();
    let cfg = SelectionConfig::new(c, kk).unwrap();
    let x = inputs(&mut r, &s, Storage::F32);
    let mut sel = Vec::new();
    for i in 0..s.q_len {
        sel.extend([(i / c) as i32, -1, -1]);
    }
    let (ro, rl) = reference::sparse_attention(&x.q, &x.k, &x.v, &s, Bhnd, &cfg, &sel).unwrap();
    let run = |sel: &[i32]| {
        attention::sparse_attention_host(ctx, &x.q, &x.k, &x.v, &s, Bhnd, &cfg, Storage::F32, sel)
            .unwrap()
    };
    let (o, l) = run(&sel);
    check(
        &format!("own block only, seed {seed}"),
        (&o, &l),
        (&ro, &rl),
        Storage::F32,
    );
    for h in 0..2 {
        let row = &o[h * 40 * 64..h * 40 * 64 + 64];
        let e = rel_err(
            row,
            &x.v[..64].iter().map(|&y| y as f64).collect::<Vec<_>>(),
        );
        assert!(
            e < 1e-6,
            "head {h}: single-key output is not V[0] (rel err {e})"
        );
        let score: f64 = (0..64)
            .map(|dd| x.q[h * 40 * 64 + dd] as f64 * x.k[dd] as f64)
            .sum::<f64>()
            / 8.0;
        assert!(
            (l[h * 40] as f64 - score).abs() < 1e-5,
            "head {h}: LSE {} vs {score}",
            l[h * 40]
        );
    }
    // Row 5 selects nothing.
    sel[5 * kk] = -1;
    let (o, l) = run(&sel);
    for h in 0..2 {
        assert_eq!(l[h * 40 + 5], f32::NEG_INFINITY, "empty row LSE");
        assert!(
            o[(h * 40 + 5) * 64..][..64].iter().all(|&y| y == 0.0),
            "empty row O"
        );
        assert!(
            l.iter()
                .enumerate()
                .all(|(i, y)| i % 40 == 5 || y.is_finite()),
            "unwritten LSE"
        );
        assert!(o.iter().all(|y| y.is_finite()), "unwritten O");
    }
}

/// A lowered binding limit splits the call into (batch, KV head) chunks with the same result,
/// bit for bit; a limit below one pair's slice is a typed error.
#[test]
fn split_path_is_identical() {
    let ctx = Context::new(&AdapterChoice::HighPerformance).expect("a GPU adapter");
    let seed = seed("split");
    let mut r = rng(seed);
    let s = AttentionShape::new(2, 6, 3, 40, 40, 64).unwrap();
    let cfg = SelectionConfig::new(16, 2).unwrap();
    let x = inputs(&mut r, &s, Storage::F32);
    let sel = random_selection(&mut r, &s, &cfg);
    let sparse = |layout| {
        attention::sparse_attention_host(
            &ctx,
            &x.q,
            &x.k,
            &x.v,
            &s,
            layout,
            &cfg,
            Storage::F32,
            &sel,
        )
    };
    let dense = |layout| {
        attention::dense_attention_host(&ctx, &x.q, &x.k, &x.v, &s, layout, true, 0.2, Storage::F32)
    };
    for layout in [Bhnd, Bnhd] {
        let whole = sparse(layout).unwrap();
        let whole_dense = dense(layout).unwrap();
        // One pair's Q slice is 2 * 40 * 64 * 4 = 20480 bytes: chunks of 3 pairs (whole
        // sequences), then 2 (head ranges of one sequence).
        for limit in [3 * 20480, 2 * 20480] {
            ctx.set_max_binding_bytes(limit);
            let split = sparse(layout).unwrap();
            assert!(
                split == whole,
                "sparse split at {limit} bytes differs ({layout:?}, seed {seed})"
            );
            let split = dense(layout).unwrap();
            assert!(
                split == whole_dense,
                "dense split at {limit} bytes differs ({layout:?}, seed {seed})"
            );
            ctx.set_max_binding_bytes(u64::MAX);
        }
    }
    ctx.set_max_binding_bytes(20000);
    let e = sparse(Bhnd);
    assert!(matches!(e, Err(GpuError::Limit { .. })), "{e:?}");
}

#[test]
fn invalid_inputs_are_typed_errors() {
    let ctx = ctx();
    let s = AttentionShape::new(1, 2, 1, 8, 8, 66).unwrap();
    let cfg = SelectionConfig::new(4, 2).unwrap();
    let q = vec![0.5; s.q_elems()];
    let kv = vec![0.5; s.kv_elems()];
    let e = attention::dense_attention_host(ctx, &q, &kv, &kv, &s, Bhnd, true, 0.1, Storage::F32);
    assert!(
        matches!(
            e,
            Err(GpuError::Input(pisa_core::PisaError::HeadDim { .. }))
        ),
        "{e:?}"
    );
    let s = AttentionShape::new(1, 2, 1, 8, 8, 64).unwrap();
    let q = vec![0.5; s.q_elems()];
    let kv = vec![0.5; s.kv_elems()];
    let e =
        attention::sparse_attention_host(ctx, &q, &kv, &kv, &s, Bhnd, &cfg, Storage::F32, &[0; 3]);
    assert!(
        matches!(
            e,
            Err(GpuError::Input(pisa_core::PisaError::BufferLen { .. }))
        ),
        "{e:?}"
    );
    let e =
        attention::dense_attention_host(ctx, &q[1..], &kv, &kv, &s, Bhnd, true, 0.1, Storage::F32);
    assert!(
        matches!(
            e,
            Err(GpuError::Input(pisa_core::PisaError::BufferLen { .. }))
        ),
        "{e:?}"
    );
}

/// Strided views through the device-tensor API: a Q whose heads sit 2 D apart (as in a wider
/// projection) runs dense attention on a kernel that writes O at O's own strides (split-K, which
/// writes O at Q's, is not chosen), matching the reference; a
/// stride that is not a multiple of 4 elements is a typed error, not a misaligned read.
#[test]
fn strided_q_and_misaligned_strides() {
    use pisa_wgpu::ops::attention::{AttentionKind, QkvLayouts};
    use pisa_wgpu::runtime::view::KernelLayout;
    let ctx = ctx();
    let mut r = rng(seed("strided q"));
    // A decode-shaped call (one query against 2100 keys): split-K's shape (at least 2048 keys).
    let nk = 2100;
    let s = AttentionShape::new(1, 4, 2, 1, nk, 64).unwrap();
    let x = inputs(&mut r, &s, Storage::F32);
    let (d, hq) = (s.head_dim, s.q_heads);
    // Q's head h at element 2 h D of a buffer twice its size; the gaps hold NaN.
    let mut wide = vec![f32::NAN; 2 * hq * d];
    for h in 0..hq {
        wide[2 * h * d..(2 * h + 1) * d].copy_from_slice(&x.q[h * d..(h + 1) * d]);
    }
    // The tensor's length is the span, first to past the last element: (2 Hq - 1) D.
    let q = ctx
        .upload("q", &wide[..(2 * hq - 1) * d], Storage::F32)
        .unwrap();
    let k = ctx.upload("k", &x.k, Storage::F32).unwrap();
    let v = ctx.upload("v", &x.v, Storage::F32).unwrap();
    let scale = 0.125;
    let kind = AttentionKind::Dense {
        causal: true,
        scale,
    };
    let strided = KernelLayout::Strided {
        batch: 0,
        head: 2 * d,
        token: 2 * hq * d,
    };
    let layouts = QkvLayouts {
        q: strided,
        ..QkvLayouts::from(Bhnd)
    };
    let kernel = attention::attention_kernel(ctx, &s, Storage::F32, layouts, &kind, None);
    assert!(
        !matches!(kernel, attention::AttentionKernel::SplitK),
        "{kernel:?}"
    );
    let (o, l) = ctx
        .scoped("strided q", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let out = attention::record_attention(
                ctx, &mut enc, &q, &k, &v, &s, layouts, &kind, None, None,
            )?;
            ctx.queue().submit([enc.finish()]);
            Ok(out)
        })
        .unwrap();
    let (o, l) = (ctx.read_f32(&o).unwrap(), ctx.read_f32(&l).unwrap());
    let (ro, rl) = reference::dense_attention(&x.q, &x.k, &x.v, &s, Bhnd, true, scale).unwrap();
    check("strided q", (&o, &l), (&ro, &rl), Storage::F32);

    // A token stride of 18 elements: refused.
    // Heads 18 * nk apart: the span is one head's stride plus nk - 1 token strides plus D.
    let span = 18 * nk + 18 * (nk - 1) + 64;
    let k18 = ctx.upload("k", &vec![0.5; span], Storage::F32).unwrap();
    let bad = QkvLayouts {
        q: strided,
        k: KernelLayout::Strided {
            batch: 0,
            head: 18 * nk,
            token: 18,
        },
        ..QkvLayouts::from(Bhnd)
    };
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let e = attention::record_attention(ctx, &mut enc, &q, &k18, &v, &s, bad, &kind, None, None)
        .unwrap_err();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
}

/// Scores far below zero but finite (every score of a row about -1e30 to -2e30, from
/// elements of 2e15) are scores, not "no score": the tile kernel and split-K (one query over
/// 4000 keys) took every score at or below -1e30 in log2 units for masked and gave such rows
/// zeros and LSE -inf; their sentinel is now -3e38, as the other kernels'. Dense attention
/// and a prefill in both orders, against the reference.
#[test]
fn scores_far_below_zero_are_not_masked() {
    use pisa_wgpu::LeafOrder;
    let ctx = Context::new(&AdapterChoice::HighPerformance).unwrap();
    let mut r = rng(seed("scores_far_below_zero"));
    let d = 16;
    let big = 2.0e15f32;
    let make = |r: &mut rand_chacha::ChaCha8Rng, nq: usize, nk: usize| {
        let mut q = random(r, nq * d, 1.0);
        let mut k = random(r, nk * d, 1.0);
        let v = random(r, nk * d, 1.0);
        for i in 0..nq {
            q[i * d] = big;
        }
        for t in 0..nk {
            k[t * d] = -big * (1.0 + t as f32 / nk as f32);
        }
        (q, k, v)
    };
    let scale = 0.25;
    for (nq, nk) in [(40, 40), (1, 4000)] {
        let s = AttentionShape::new(1, 1, 1, nq, nk, d).unwrap();
        let (q, k, v) = make(&mut r, nq, nk);
        let (ro, rl) = reference::dense_attention(&q, &k, &v, &s, Bhnd, true, scale).unwrap();
        assert!(rl.iter().all(|&x| x < -9e29 && x.is_finite()), "{rl:?}");
        let got =
            attention::dense_attention_host(&ctx, &q, &k, &v, &s, Bhnd, true, scale, Storage::F32)
                .unwrap();
        check(
            &format!("dense {nq} x {nk}"),
            (&got.0, &got.1),
            (&ro, &rl),
            Storage::F32,
        );
    }
    let n = 300;
    let s = AttentionShape::prefill(1, 1, 1, n, d).unwrap();
    let (q, k, v) = make(&mut r, n, n);
    let cfg = SelectionConfig::new(16, 4).unwrap();
    let opts = pisa_wgpu::PrefillOptions {
        cfg,
        return_selection: true,
        ..Default::default()
    };
    for order in [LeafOrder::Tiles, LeafOrder::Leaves] {
        ctx.set_leaf_order(order);
        let got = pisa_wgpu::prefill_host(&ctx, &q, &k, &v, &s, &opts).unwrap();
        let sel = got.selection.unwrap();
        let (ro, rl) = reference::sparse_attention(&q, &k, &v, &s, Bhnd, &cfg, &sel).unwrap();
        check(
            &format!("prefill {order:?}"),
            (&got.out, &got.lse),
            (&ro, &rl),
            Storage::F32,
        );
    }
}

/// A shape whose query-tile stage-2 kernel passes the device's workgroup memory (GQA 32, D 128,
/// `meanvar`: 34 KiB against lavapipe's 32), run with the tile order asked for: the refusal
/// names the knob and the leaf-major order that runs the shape (it told the app to shrink its
/// head dim or GQA group), and the default order runs it, as the reference selects. Where the
/// device's memory holds the tile kernel, that run must simply succeed.
#[test]
fn tiles_asked_past_the_memory_name_the_knob() {
    use pisa_wgpu::LeafOrder;
    let ctx = Context::new(&AdapterChoice::HighPerformance).unwrap();
    let mut r = rng(seed("tiles_asked_past_the_memory"));
    let s = AttentionShape::prefill(1, 32, 1, 256, 128).unwrap();
    let cfg = SelectionConfig {
        scoring: pisa_core::Scoring::MeanVar,
        ..SelectionConfig::new(8, 4).unwrap()
    };
    let (q, k, v) = (
        random(&mut r, s.q_elems(), 1.0),
        random(&mut r, s.kv_elems(), 1.0),
        random(&mut r, s.kv_elems(), 1.0),
    );
    let opts = pisa_wgpu::PrefillOptions {
        cfg,
        return_selection: true,
        ..Default::default()
    };
    ctx.set_leaf_order(LeafOrder::Tiles);
    if let Err(e) = pisa_wgpu::prefill_host(&ctx, &q, &k, &v, &s, &opts) {
        let m = e.to_string();
        assert!(
            matches!(e, GpuError::Limit { .. })
                && m.contains("leaf_order=tiles")
                && m.contains("leaf-major order"),
            "{m}"
        );
    }
    ctx.set_leaf_order(LeafOrder::Auto);
    let got = pisa_wgpu::prefill_host(&ctx, &q, &k, &v, &s, &opts).unwrap();
    let want = reference::select_pisa(&q, &k, &s, Bhnd, &cfg).unwrap();
    // (the tolerance of every selection test: scores summed over 32 heads, near-ties rare)
    let tol = tie_tol_of(&s, &cfg, &q, &k, Storage::F32);
    let ties = check_rows("auto order", &got.selection.unwrap(), &want, cfg.top_k, tol);
    assert!(
        ties * 20 <= want.rows(),
        "{ties} ties of {} rows",
        want.rows()
    );
}
