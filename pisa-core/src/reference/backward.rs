//! Backward pass of block-sparse attention (PISA.md section 4) in f64.
//!
//! Gradients flow only through the attention over the selected leaves; the discrete selection
//! has none, so it is an input held fixed. The math is FlashAttention-2's, with P recomputed
//! from Q, K and the forward's per-row LSE:
//!
//! - `P_it = exp(s * q_i.k_t - lse_i)` over the keys `t` row `i` attended to (its KV head's
//!   selected leaves, each counted once, masked to `t <= p_i` when causal);
//! - `D_i = sum_d dO_id * O_id`;
//! - `dV_t += P_it dO_i`, `dP_it = dO_i.v_t`, `dS_it = P_it (dP_it - D_i)`;
//! - `dQ_i = s * sum_t dS_it k_t`, `dK_t += s * dS_it q_i`.
//!
//! GQA: the dK and dV of a KV head sum over the g_q query heads that share it.

use alloc::vec;
use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::shape::{AttentionShape, TensorLayout};

use super::tensor::{check_block_indices, check_len, check_shape, dot, View, SELECTION_INDEX};

/// The gradients of a loss with respect to Q, K and V, f64.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// dL/dQ: `[B, Hq, Nq, D]` in Q's layout.
    pub dq: Vec<f64>,
    /// dL/dK: `[B, Hkv, Nk, D]` in K's layout; 0 for keys no query attended to.
    pub dk: Vec<f64>,
    /// dL/dV: `[B, Hkv, Nk, D]` in V's layout; 0 for keys no query attended to.
    pub dv: Vec<f64>,
}

/// Backward pass of [`super::sparse_attention`] (PISA.md section 4) for the selection held fixed.
///
/// Inputs, all as in the forward: `q`, `d_o`: `[B, Hq, Nq, D]` f32; `k`, `v`: `[B, Hkv, Nk, D]`
/// f32; `o`: the forward output, `[B, Hq, Nq, D]` f64; all in `layout`. `lse`: the forward's
/// per-row LSE `[B, Hq, Nq]` (natural log). `selection`: `[B, Hkv, Nq, K]` i32, `K = cfg.top_k`,
/// -1 entries ignored, a repeated block counted once. `d_o` is dL/dO.
///
/// Returns [`Gradients`]. A row that attended to nothing (LSE `-inf`) contributes nothing.
/// Errors: the shape's validation errors (as [`AttentionShape::new`]: its fields are public)
/// and the configuration's, [`PisaError::TooLarge`] for leaf indices or a selection past
/// `i32` / `usize`, [`PisaError::BufferLen`] for a buffer of the wrong length,
/// [`PisaError::InvalidValue`] for an index below -1 or at least `nb_0`,
/// [`PisaError::NonFinite`] for a NaN or an infinity in `q`, `k`, `v`, `d_o` or `o`, or a NaN
/// or +inf in `lse`.
#[allow(clippy::too_many_arguments)] // the forward's inputs, its outputs and dO
pub fn sparse_attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f64],
    lse: &[f64],
    d_o: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
    selection: &[i32],
) -> Result<Gradients> {
    // The shape's fields are public: re-checked here as every reference function does (a
    // shape of 0 KV heads or Nq > Nk panicked in the index arithmetic).
    check_shape(shape, Some(cfg))?;
    let s = shape;
    let (d, kk, c) = (s.head_dim, cfg.top_k, cfg.block_size);
    let qs = [s.batch, s.q_heads, s.q_len, d];
    let ks = [s.batch, s.kv_heads, s.k_len, d];
    let qv = View::new("q", q, layout, qs)?;
    let dov = View::new("d_o", d_o, layout, qs)?;
    let kv = View::new("k", k, layout, ks)?;
    let vv = View::new("v", v, layout, ks)?;
    check_len("o", o.len(), s.q_elems())?;
    check_len("lse", lse.len(), s.lse_elems())?;
    // The forward's outputs: O finite, an LSE finite or -inf (a row that attended to nothing).
    if let Some(index) = o.iter().position(|x| !x.is_finite()) {
        return Err(PisaError::NonFinite { what: "o", index });
    }
    if let Some(index) = lse.iter().position(|x| x.is_nan() || *x == f64::INFINITY) {
        return Err(PisaError::NonFinite { what: "lse", index });
    }
    check_len(
        "selection",
        selection.len(),
        s.batch * s.kv_heads * s.q_len * kk,
    )?;
    let nb0 = s.k_len.div_ceil(c);
    check_block_indices(selection, nb0, SELECTION_INDEX)?;
    let scale = cfg.softmax_scale(d) as f64;
    let mut g = Gradients {
        dq: vec![0.0; s.q_elems()],
        dk: vec![0.0; s.kv_elems()],
        dv: vec![0.0; s.kv_elems()],
    };
    let mut blocks = Vec::with_capacity(kk);
    for b in 0..s.batch {
        for hq in 0..s.q_heads {
            let h = s.kv_head_of(hq);
            for i in 0..s.q_len {
                let l = lse[(b * s.q_heads + hq) * s.q_len + i];
                if l == f64::NEG_INFINITY {
                    continue;
                }
                let r = ((b * s.kv_heads + h) * s.q_len + i) * kk;
                blocks.clear();
                blocks.extend(
                    selection[r..r + kk]
                        .iter()
                        .filter(|&&j| j >= 0)
                        .map(|&j| j as usize),
                );
                blocks.sort_unstable();
                blocks.dedup();
                let end = if cfg.causal {
                    s.query_position(i) + 1
                } else {
                    s.k_len
                };
                let (qr, dor) = (qv.row(b, hq, i), dov.row(b, hq, i));
                let qo = layout.index(s.q_heads, s.q_len, d, b, hq, i, 0);
                let di: f64 = dor
                    .iter()
                    .zip(&o[qo..qo + d])
                    .map(|(&x, &y)| x as f64 * y)
                    .sum();
                let tokens = blocks
                    .iter()
                    .flat_map(|&j| j * c..((j + 1) * c).min(s.k_len).min(end));
                for t in tokens {
                    let (kr, vr) = (kv.row(b, h, t), vv.row(b, h, t));
                    let p = libm::exp(scale * dot(qr, kr) - l);
                    let ds = p * (dot(dor, vr) - di);
                    let ko = layout.index(s.kv_heads, s.k_len, d, b, h, t, 0);
                    for x in 0..d {
                        g.dv[ko + x] += p * dor[x] as f64;
                        g.dk[ko + x] += scale * ds * qr[x] as f64;
                        g.dq[qo + x] += scale * ds * kr[x] as f64;
                    }
                }
            }
        }
    }
    Ok(g)
}
