//! GPU pyramid build against a direct CPU computation of every node's mean.
mod common;

use common::*;
use pisa_core::{PyramidLayout, TensorLayout};
use pisa_wgpu::ops::pyramid::{self, KeyGeometry};
use pisa_wgpu::Storage;

#[test]
fn pyramid_means_match_direct_means() {
    let ctx = ctx();
    let seed = seed("pyramid");
    let mut r = rng(seed);
    for &(nk, c, g, d, layout) in &[
        (1000usize, 64usize, 2usize, 64usize, TensorLayout::Bhnd),
        (129, 16, 3, 80, TensorLayout::Bnhd),
        (1, 64, 2, 96, TensorLayout::Bhnd),
    ] {
        let (b, h) = (2, 3);
        let k = random(&mut r, b * h * nk * d, 1.0);
        let geo = KeyGeometry {
            batch: b,
            kv_heads: h,
            tokens: nk,
            head_dim: d,
            layout: layout.into(),
        };
        let lay = PyramidLayout::new(nk, c, g).unwrap();
        let kt = ctx.upload("k", &k, Storage::F32).unwrap();
        let pyr = pyramid::alloc(ctx, lay, &geo, true).unwrap();
        ctx.scoped("test", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            pyramid::record_build(ctx, &mut enc, &kt, &geo, nk, &pyr, None)?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })
        .unwrap();
        let means = ctx.read_f32(&pyr.means).unwrap();
        let sq = ctx.read_f32(pyr.sq.as_ref().unwrap()).unwrap();
        let mut want_m = vec![0f64; means.len()];
        let mut want_s = vec![0f64; means.len()];
        for bi in 0..b {
            for hi in 0..h {
                for l in 0..lay.num_levels() {
                    for j in 0..lay.nodes(l) {
                        let span = lay.token_span(l, j);
                        for dd in 0..d {
                            let (mut s, mut s2) = (0f64, 0f64);
                            for t in span.clone() {
                                let x = k[layout.index(h, nk, d, bi, hi, t, dd)] as f64;
                                s += x;
                                s2 += x * x;
                            }
                            let o = ((bi * h + hi) * lay.total_nodes() + lay.flat(l, j)) * d + dd;
                            want_m[o] = s / span.len() as f64;
                            want_s[o] = s2 / span.len() as f64;
                        }
                    }
                }
            }
        }
        let e = rel_err(&means, &want_m);
        assert!(
            e < 1e-5,
            "means rel err {e} (nk {nk}, C {c}, g {g}, seed {seed})"
        );
        let e = rel_err(&sq, &want_s);
        assert!(
            e < 1e-5,
            "second moments rel err {e} (nk {nk}, seed {seed})"
        );
    }
}
