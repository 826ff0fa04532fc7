//! The ascending union of a query tile's selections (`shaders/attention_common.wgsl`, shared by
//! the portable and the tensor-core sparse attention): lists with -1 holes anywhere and repeated
//! blocks (both allowed: ignored, and counted once) must give the reference's result, on the
//! portable kernels and, where the adapter has them, the cooperative-matrix ones. Queries of one
//! tile get overlapping, partly equal lists, so the union's masks and ranks are exercised.
mod common;

use common::*;
use pisa_core::{reference, AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::sparse_attention_host;
use pisa_wgpu::{KernelPath, LeafOrder, Storage};
use rand::Rng;

#[test]
fn holes_and_repeats_match_reference() {
    let ctx = ctx();
    if !ctx.has_f16() {
        eprintln!(
            "{}: no SHADER_F16: this f16 test is skipped",
            ctx.report().name
        );
        return;
    }
    // The query tiles' union (leaf-major attention skips the same entries: attention_by_leaf.rs).
    ctx.set_leaf_order(LeafOrder::Tiles);
    let before = ctx.kernel_path();
    let mut r = rng(seed("holes_and_repeats_match_reference"));
    for path in [KernelPath::Portable, KernelPath::CoopMat] {
        if ctx.set_kernel_path(path) != path {
            eprintln!("{path}: not available on this adapter, skipped");
            continue;
        }
        for (hq, n, d, c, kk) in [
            (4, 300, 64, 16, 6),
            (8, 517, 128, 64, 5),
            (3, 200, 80, 20, 4),
        ] {
            let shape = AttentionShape::new(1, hq, 1, n, n, d).unwrap();
            let cfg = SelectionConfig::new(c, kk).unwrap();
            let q = through_f16(&random(&mut r, shape.q_elems(), 1.0));
            let k = through_f16(&random(&mut r, shape.kv_elems(), 1.0));
            let v = through_f16(&random(&mut r, shape.kv_elems(), 1.0));
            let nb = n.div_ceil(c);
            // Per query: an ascending list drawn from a window shared by neighbours, then
            // holes (-1) and repeats (an entry equal to the one before) at random places.
            let mut sel = Vec::with_capacity(n * kk);
            for i in 0..n {
                let own = i / c;
                let mut list: Vec<i32> = (0..kk)
                    .map(|_| r.random_range(0..=own.min(nb - 1)) as i32)
                    .collect();
                list.sort_unstable();
                for j in 1..kk {
                    match r.random_range(0..6) {
                        0 => list[j] = -1,
                        1 if list[j - 1] >= 0 => list[j] = list[j - 1],
                        _ => {}
                    }
                }
                if r.random_range(0..4) == 0 {
                    list[0] = -1;
                }
                // Never an empty row (its LSE is -inf, which the error measure refuses).
                list[kk - 1] = own.min(nb - 1) as i32;
                sel.extend(list);
            }
            let want =
                reference::sparse_attention(&q, &k, &v, &shape, TensorLayout::Bhnd, &cfg, &sel)
                    .unwrap();
            let got = sparse_attention_host(
                ctx,
                &q,
                &k,
                &v,
                &shape,
                TensorLayout::Bhnd,
                &cfg,
                Storage::F16,
                &sel,
            )
            .unwrap();
            let (eo, el) = (rel_err(&got.0, &want.0), rel_err(&got.1, &want.1));
            eprintln!("{path} hq {hq} n {n} d {d} C {c} K {kk}: O rel err {eo:.2e}, LSE {el:.2e}");
            assert!(eo <= 5e-3 && el <= 5e-3, "{path} hq {hq} n {n}: {eo} {el}");
        }
    }
    ctx.set_kernel_path(before);
}
