//! Attention (PISA.md section 4): dense against a naive two-pass softmax, sparse against a
//! naive masked softmax over the selected blocks, and sparse with every visible block (PISA
//! with top_k >= visible leaves) against dense to 1e-12.
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

mod common;

use common::{at, qkv, seeded};
use pisa_core::reference::{dense_attention, select_pisa, sparse_attention};
use pisa_core::{AttentionShape, PisaError, SelectionConfig, TensorLayout};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Naive attention of row (b, hq, i) over the keys `t` where `keep(t)`: (out, lse).
#[allow(clippy::too_many_arguments)]
fn naive_row(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    l: TensorLayout,
    scale: f64,
    (b, hq, i): (usize, usize, usize),
    keep: impl Fn(usize) -> bool,
) -> (Vec<f64>, f64) {
    let (d, h) = (s.head_dim, s.kv_head_of(hq));
    let ts: Vec<usize> = (0..s.k_len).filter(|&t| keep(t)).collect();
    let sc: Vec<f64> = ts
        .iter()
        .map(|&t| {
            let qk: f64 = (0..d)
                .map(|x| {
                    at(q, l, s.q_heads, s.q_len, d, [b, hq, i, x])
                        * at(k, l, s.kv_heads, s.k_len, d, [b, h, t, x])
                })
                .sum();
            scale * qk
        })
        .collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = w.iter().sum();
    let out = (0..d)
        .map(|x| {
            ts.iter()
                .zip(&w)
                .map(|(&t, wt)| wt * at(v, l, s.kv_heads, s.k_len, d, [b, h, t, x]))
                .sum::<f64>()
                / z
        })
        .collect();
    (out, m + z.ln())
}

fn random_shape(rng: &mut ChaCha8Rng) -> AttentionShape {
    let hkv = rng.random_range(1..3);
    let nk = rng.random_range(1..70);
    let nq = rng.random_range(1..=nk);
    AttentionShape::new(
        rng.random_range(1..3),
        hkv * rng.random_range(1..4),
        hkv,
        nq,
        nk,
        rng.random_range(1..9),
    )
    .unwrap()
}

fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn dense_matches_naive_softmax() {
    let (mut rng, _) = seeded("dense_matches_naive_softmax");
    for case in 0..40 {
        let s = random_shape(&mut rng);
        let l = if case % 2 == 0 {
            TensorLayout::Bhnd
        } else {
            TensorLayout::Bnhd
        };
        let causal = case % 4 < 2;
        let scale = rng.random_range(0.1..1.0f32);
        let (q, k, v) = qkv(&mut rng, &s, 2.0);
        let (o, lse) = dense_attention(&q, &k, &v, &s, l, causal, scale).unwrap();
        for b in 0..s.batch {
            for hq in 0..s.q_heads {
                for i in 0..s.q_len {
                    let p = s.query_position(i);
                    let (no, nl) = naive_row(&q, &k, &v, &s, l, scale as f64, (b, hq, i), |t| {
                        !causal || t <= p
                    });
                    let base = l.index(s.q_heads, s.q_len, s.head_dim, b, hq, i, 0);
                    assert_close(&o[base..base + s.head_dim], &no, 1e-12, "O");
                    assert_close(
                        &[lse[(b * s.q_heads + hq) * s.q_len + i]],
                        &[nl],
                        1e-12,
                        "LSE",
                    );
                }
            }
        }
    }
}

#[test]
fn sparse_matches_naive_over_selected_blocks() {
    let (mut rng, _) = seeded("sparse_matches_naive_over_selected_blocks");
    for case in 0..40 {
        let s = random_shape(&mut rng);
        let l = if case % 2 == 0 {
            TensorLayout::Bnhd
        } else {
            TensorLayout::Bhnd
        };
        let c = rng.random_range(1..6);
        let cfg = SelectionConfig::new(c, rng.random_range(1..5))
            .unwrap()
            .with_causal(case % 3 != 0);
        let nb0 = s.k_len.div_ceil(c) as i32;
        let (q, k, v) = qkv(&mut rng, &s, 2.0);
        // Arbitrary rows: any blocks, -1 anywhere, repeats allowed (a repeat counts once).
        let sel: Vec<i32> = (0..s.batch * s.kv_heads * s.q_len * cfg.top_k)
            .map(|_| rng.random_range(-1..nb0))
            .collect();
        let (o, lse) = sparse_attention(&q, &k, &v, &s, l, &cfg, &sel).unwrap();
        let scale = cfg.softmax_scale(s.head_dim) as f64;
        for b in 0..s.batch {
            for hq in 0..s.q_heads {
                for i in 0..s.q_len {
                    let r = ((b * s.kv_heads + s.kv_head_of(hq)) * s.q_len + i) * cfg.top_k;
                    let row = &sel[r..r + cfg.top_k];
                    let p = s.query_position(i);
                    let keep =
                        |t: usize| row.contains(&((t / c) as i32)) && (!cfg.causal || t <= p);
                    let (no, nl) = naive_row(&q, &k, &v, &s, l, scale, (b, hq, i), keep);
                    let base = l.index(s.q_heads, s.q_len, s.head_dim, b, hq, i, 0);
                    let got_lse = lse[(b * s.q_heads + hq) * s.q_len + i];
                    if nl == f64::NEG_INFINITY {
                        assert_eq!(got_lse, f64::NEG_INFINITY);
                        assert!(o[base..base + s.head_dim].iter().all(|&x| x == 0.0));
                        continue;
                    }
                    assert_close(&o[base..base + s.head_dim], &no, 1e-12, "O");
                    assert_close(&[got_lse], &[nl], 1e-12, "LSE");
                }
            }
        }
    }
}

#[test]
fn pisa_with_top_k_covering_every_leaf_equals_dense() {
    let (mut rng, _) = seeded("pisa_with_top_k_covering_every_leaf_equals_dense");
    for case in 0..30 {
        let s = random_shape(&mut rng);
        let l = if case % 2 == 0 {
            TensorLayout::Bhnd
        } else {
            TensorLayout::Bnhd
        };
        let c = rng.random_range(1..8);
        let nb0 = s.k_len.div_ceil(c);
        let causal = case % 3 != 0;
        let cfg = SelectionConfig::new(c, nb0 + rng.random_range(0..3))
            .unwrap()
            .with_causal(causal);
        let (q, k, v) = qkv(&mut rng, &s, 2.0);
        let sel = select_pisa(&q, &k, &s, l, &cfg).unwrap();
        let (so, sl) = sparse_attention(&q, &k, &v, &s, l, &cfg, &sel.indices).unwrap();
        let (d_o, dl) =
            dense_attention(&q, &k, &v, &s, l, causal, cfg.softmax_scale(s.head_dim)).unwrap();
        assert_close(&so, &d_o, 1e-12, "O");
        assert_close(&sl, &dl, 1e-12, "LSE");
    }
}

#[test]
fn layouts_agree() {
    let (mut rng, _) = seeded("layouts_agree");
    let s = AttentionShape::new(2, 4, 2, 9, 13, 5).unwrap();
    let (q, k, v) = qkv(&mut rng, &s, 1.0);
    // Transpose [B, H, N, D] -> [B, N, H, D].
    let tr = |x: &[f32], h: usize, n: usize| {
        let mut y = vec![0.0; x.len()];
        for (b, hh, t, d) in all_indices(s.batch, h, n, s.head_dim) {
            y[TensorLayout::Bnhd.index(h, n, s.head_dim, b, hh, t, d)] =
                x[TensorLayout::Bhnd.index(h, n, s.head_dim, b, hh, t, d)];
        }
        y
    };
    let (a, la) = dense_attention(&q, &k, &v, &s, TensorLayout::Bhnd, true, 0.4).unwrap();
    let (qt, kt, vt) = (tr(&q, 4, 9), tr(&k, 2, 13), tr(&v, 2, 13));
    let (b, lb) = dense_attention(&qt, &kt, &vt, &s, TensorLayout::Bnhd, true, 0.4).unwrap();
    assert_eq!(la, lb);
    for (bb, h, t, d) in all_indices(2, 4, 9, 5) {
        assert_eq!(
            a[TensorLayout::Bhnd.index(4, 9, 5, bb, h, t, d)],
            b[TensorLayout::Bnhd.index(4, 9, 5, bb, h, t, d)]
        );
    }
}

fn all_indices(
    b: usize,
    h: usize,
    n: usize,
    d: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..b).flat_map(move |x| {
        (0..h).flat_map(move |y| (0..n).flat_map(move |z| (0..d).map(move |w| (x, y, z, w))))
    })
}

#[test]
fn bad_attention_inputs_are_errors() {
    let s = AttentionShape::prefill(1, 2, 1, 8, 4).unwrap();
    let cfg = SelectionConfig::new(4, 2).unwrap();
    let (q, k, v) = (
        vec![0.5f32; s.q_elems()],
        vec![0.5f32; s.kv_elems()],
        vec![1.0f32; s.kv_elems()],
    );
    let l = TensorLayout::Bhnd;
    let sel = vec![0i32; 16];
    assert!(sparse_attention(&q, &k, &v, &s, l, &cfg, &sel).is_ok());
    assert!(matches!(
        sparse_attention(&q, &k, &v, &s, l, &cfg, &sel[1..]),
        Err(PisaError::BufferLen { .. })
    ));
    assert!(matches!(
        sparse_attention(&q, &k, &v[1..], &s, l, &cfg, &sel),
        Err(PisaError::BufferLen { what: "v", .. })
    ));
    let mut bad = sel.clone();
    bad[3] = 2; // nb_0 = 2
    assert!(matches!(
        sparse_attention(&q, &k, &v, &s, l, &cfg, &bad),
        Err(PisaError::InvalidValue { .. })
    ));
    bad[3] = -2;
    assert!(sparse_attention(&q, &k, &v, &s, l, &cfg, &bad).is_err());
    assert!(dense_attention(&q, &k, &v, &s, l, true, f32::NAN).is_err());
    assert!(dense_attention(&q, &k, &v, &s, l, true, 0.0).is_err());
}
