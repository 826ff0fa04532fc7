//! Backward pass of block-sparse attention (PISA.md section 4) against central finite
//! differences of the forward `sparse_attention`, with the selection held fixed: the loss is
//! `L = sum dO * O`, so dL/dx is the reference's gradient for every input element x.
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

mod common;

use common::seeded;
use pisa_core::reference::{select_pisa, sparse_attention, sparse_attention_backward};
use pisa_core::{AttentionShape, PisaError, SelectionConfig, TensorLayout};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Finite-difference step: a power of two, so `x +- H` is exact for inputs on a 2^-8 grid.
const H: f32 = 1.0 / 1024.0;

/// `n` values on the 2^-8 grid in `[-amp, amp]` (never all zero).
fn grid(rng: &mut ChaCha8Rng, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random_range(-amp..amp) * 256.0).round() / 256.0)
        .collect()
}

struct Case {
    shape: AttentionShape,
    layout: TensorLayout,
    cfg: SelectionConfig,
    /// `None`: PISA's selection; `Some(p)`: random blocks, each slot -1 with probability p.
    random_sel: Option<f64>,
}

fn check(case: &Case, rng: &mut ChaCha8Rng, seed: u64) {
    let (s, l, cfg) = (&case.shape, case.layout, &case.cfg);
    let q = grid(rng, s.q_elems(), 2.0);
    let k = grid(rng, s.kv_elems(), 2.0);
    let v = grid(rng, s.kv_elems(), 1.0);
    let d_o = grid(rng, s.q_elems(), 1.0);
    let sel = match case.random_sel {
        None => select_pisa(&q, &k, s, l, cfg).unwrap().indices,
        Some(p_pad) => {
            let nb0 = s.k_len.div_ceil(cfg.block_size) as i32;
            let n = s.batch * s.kv_heads * s.q_len * cfg.top_k;
            (0..n)
                .map(|_| {
                    if rng.random_bool(p_pad) {
                        -1
                    } else {
                        rng.random_range(0..nb0)
                    }
                })
                .collect()
        }
    };
    let (o, lse) = sparse_attention(&q, &k, &v, s, l, cfg, &sel).unwrap();
    let g = sparse_attention_backward(&q, &k, &v, &o, &lse, &d_o, s, l, cfg, &sel).unwrap();
    let loss = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
        let (o, _) = sparse_attention(q, k, v, s, l, cfg, &sel).unwrap();
        o.iter().zip(&d_o).map(|(&a, &b)| a * b as f64).sum()
    };
    let mut inputs = [q, k, v];
    for (which, grad) in [(0usize, &g.dq), (1, &g.dk), (2, &g.dv)] {
        let mut fd = vec![0.0f64; grad.len()];
        for (e, f) in fd.iter_mut().enumerate() {
            let x = inputs[which][e];
            inputs[which][e] = x + H;
            let up = loss(&inputs[0], &inputs[1], &inputs[2]);
            inputs[which][e] = x - H;
            let down = loss(&inputs[0], &inputs[1], &inputs[2]);
            inputs[which][e] = x;
            *f = (up - down) / (2.0 * H as f64);
        }
        let num: f64 = grad.iter().zip(&fd).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f64 = fd.iter().map(|b| b * b).sum();
        let rel = (num / den).sqrt();
        let name = ["dQ", "dK", "dV"][which];
        assert!(
            den > 0.0 && rel < 1e-5,
            "{name}: relative error {rel} against finite differences ({s:?}, {l:?}, causal {}, \
             seed {seed})",
            cfg.causal
        );
    }
}

#[test]
fn gradients_match_finite_differences() {
    let (mut rng, seed) = seeded("backward_fd");
    let cases = [
        // GQA 1, partial last block (11 = 2*4 + 3), a sink block, PISA's selection, causal.
        Case {
            shape: AttentionShape::prefill(2, 2, 2, 11, 5).unwrap(),
            layout: TensorLayout::Bhnd,
            cfg: SelectionConfig::new(4, 2).unwrap().with_forced(1, 0),
            random_sel: None,
        },
        // GQA 3, queries the suffix of the keys, sink and local blocks, last block of 1 token.
        Case {
            shape: AttentionShape::new(1, 3, 1, 9, 13, 4).unwrap(),
            layout: TensorLayout::Bnhd,
            cfg: SelectionConfig::new(3, 3).unwrap().with_forced(1, 1),
            random_sel: None,
        },
        // GQA 3, not causal: blocks after the query's own count too.
        Case {
            shape: AttentionShape::prefill(1, 3, 1, 10, 3).unwrap(),
            layout: TensorLayout::Bhnd,
            cfg: SelectionConfig::new(4, 2)
                .unwrap()
                .with_forced(1, 0)
                .with_causal(false),
            random_sel: None,
        },
        // Random selections: -1 padding, repeated blocks (counted once), future blocks
        // (masked out when causal); rows that attend to nothing (LSE -inf) must give 0.
        Case {
            shape: AttentionShape::new(2, 2, 1, 7, 10, 3).unwrap(),
            layout: TensorLayout::Bnhd,
            cfg: SelectionConfig::new(3, 3).unwrap(),
            random_sel: Some(0.3),
        },
        Case {
            shape: AttentionShape::new(1, 3, 1, 6, 9, 4).unwrap(),
            layout: TensorLayout::Bhnd,
            cfg: SelectionConfig::new(2, 3).unwrap().with_causal(false),
            random_sel: Some(0.3),
        },
    ];
    for case in &cases {
        check(case, &mut rng, seed);
    }
}

#[test]
fn unselected_keys_get_zero_and_inputs_are_checked() {
    let (mut rng, seed) = seeded("backward_zero");
    let s = AttentionShape::prefill(1, 2, 1, 8, 4).unwrap();
    let l = TensorLayout::Bhnd;
    let cfg = SelectionConfig::new(4, 1).unwrap().with_causal(false);
    let q = grid(&mut rng, s.q_elems(), 1.0);
    let k = grid(&mut rng, s.kv_elems(), 1.0);
    let v = grid(&mut rng, s.kv_elems(), 1.0);
    let d_o = grid(&mut rng, s.q_elems(), 1.0);
    // Every query selects block 1 only: the keys of block 0 get exactly zero gradient.
    let sel = vec![1i32; s.q_len];
    let (o, lse) = sparse_attention(&q, &k, &v, &s, l, &cfg, &sel).unwrap();
    let g = sparse_attention_backward(&q, &k, &v, &o, &lse, &d_o, &s, l, &cfg, &sel).unwrap();
    let half = s.kv_elems() / 2;
    assert!(g.dk[..half].iter().chain(&g.dv[..half]).all(|&x| x == 0.0));
    assert!(
        g.dk[half..].iter().any(|&x| x != 0.0),
        "block 1 has gradient (seed {seed})"
    );
    let e = sparse_attention_backward(&q, &k, &v, &o, &lse[1..], &d_o, &s, l, &cfg, &sel);
    assert!(matches!(e, Err(PisaError::BufferLen { what: "lse", .. })));
    let bad = vec![2i32; s.q_len];
    let e = sparse_attention_backward(&q, &k, &v, &o, &lse, &d_o, &s, l, &cfg, &bad);
    assert!(matches!(e, Err(PisaError::InvalidValue { .. })));
}
