//! The BSA baseline and the full-attention oracle (PISA.md section 3, "BSA baseline" and
//! "Quality").

use alloc::vec;
use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::lse::log_add_exp;
use crate::shape::{AttentionShape, TensorLayout};

use super::super::pyramid::pyramid_of;
use super::super::tensor::{check_len, check_shape, checked_elems, dot, dot_mean};
use super::{cut, views, Selection};

/// Leaves visible to the query at `p`: `0..=p/C` when causal, else all `nb_0`.
fn visible(p: usize, nb0: usize, cfg: &SelectionConfig) -> usize {
    if cfg.causal {
        p / cfg.block_size + 1
    } else {
        nb0
    }
}

/// BSA baseline selection (PISA.md section 3): the same forced leaves as PISA, then every
/// complete-past (causal: `j < b_q`; else every) non-forced leaf is scored by `s * q.mu_leaf`
/// (mean-pooled key), summed over the GQA group, and the best fill the remaining slots.
/// O(N / C) per query. A query that sees K or fewer leaves gets them all.
///
/// Shapes, layouts and errors as [`super::select_pisa`].
pub fn select_bsa(
    q: &[f32],
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<Selection> {
    let (qv, kv) = views(q, k, shape, layout, cfg)?;
    let pyr = pyramid_of(&kv, shape, cfg)?;
    let nb0 = pyr.layout.leaves();
    let s = cfg.softmax_scale(shape.head_dim) as f64;
    let g = shape.gqa_group();
    let mut sel = Selection::with_rows(shape.batch * shape.kv_heads * shape.q_len, cfg.top_k)?;
    for b in 0..shape.batch {
        for h in 0..shape.kv_heads {
            for i in 0..shape.q_len {
                let p = shape.query_position(i);
                let b_q = p / cfg.block_size;
                let r = (b * shape.kv_heads + h) * shape.q_len + i;
                let vis = visible(p, nb0, cfg);
                if vis <= cfg.top_k {
                    let all: Vec<usize> = (0..vis).collect();
                    sel.set_row(r, &all, f64::INFINITY, 0);
                    continue;
                }
                let mut out = Vec::new();
                cfg.for_each_forced(b_q, |j| out.push(j));
                let slots = cfg.top_k - out.len();
                let past = if cfg.causal { b_q } else { nb0 };
                let cands: Vec<usize> = (0..past).filter(|&j| !cfg.is_forced(b_q, j)).collect();
                let (mut margin, mut scored) = (f64::INFINITY, 0);
                if slots > 0 && cands.len() > slots {
                    let scores = cands
                        .iter()
                        .map(|&j| {
                            let sc = (h * g..(h + 1) * g)
                                .map(|hq| s * dot_mean(qv.row(b, hq, i), pyr.mean(b, h, 0, j)))
                                .sum();
                            (sc, j)
                        })
                        .collect();
                    let (kept, gap) = cut(scores, slots);
                    out.extend(kept);
                    margin = gap;
                    scored = cands.len() as u32;
                } else {
                    out.extend(cands.into_iter().take(slots));
                }
                out.sort_unstable();
                sel.set_row(r, &out, margin, scored);
            }
        }
    }
    Ok(sel)
}

/// Full-attention block mass (PISA.md section 3, "Quality"): `[B, Hkv, Nq, nb_0]`, the softmax
/// probability (scores `s * q.k_t`, causal mask `t <= p_i` when `cfg.causal`) that falls in
/// each leaf, averaged over the KV head's g_q query heads. Each row sums to 1.
///
/// Cost O(B * Hq * Nq * Nk * D). Shapes, layouts and errors as [`super::select_pisa`].
pub fn block_mass(
    q: &[f32],
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<Vec<f64>> {
    let (qv, kv) = views(q, k, shape, layout, cfg)?;
    let nb0 = shape.k_len.div_ceil(cfg.block_size);
    let s = cfg.softmax_scale(shape.head_dim) as f64;
    let g = shape.gqa_group();
    let elems = checked_elems("mass", &[shape.batch, shape.kv_heads, shape.q_len, nb0])?;
    let mut mass = vec![0.0; elems];
    let mut scores = vec![0.0; shape.k_len];
    for b in 0..shape.batch {
        for hq in 0..shape.q_heads {
            let h = hq / g;
            for i in 0..shape.q_len {
                let p = shape.query_position(i);
                let n = if cfg.causal { p + 1 } else { shape.k_len };
                let qr = qv.row(b, hq, i);
                for (t, sc) in scores[..n].iter_mut().enumerate() {
                    *sc = s * dot(qr, kv.row(b, h, t));
                }
                let lse = scores[..n]
                    .iter()
                    .copied()
                    .fold(f64::NEG_INFINITY, log_add_exp);
                let row = ((b * shape.kv_heads + h) * shape.q_len + i) * nb0;
                for (t, &sc) in scores[..n].iter().enumerate() {
                    mass[row + t / cfg.block_size] += libm::exp(sc - lse) / g as f64;
                }
            }
        }
    }
    Ok(mass)
}

/// The oracle selection (PISA.md section 3, "Quality"): the K visible leaves of largest
/// [`block_mass`] (ties: lower index), no forced leaves, ascending. Margins are in probability
/// mass; `scored_nodes` counts the visible leaves ranked.
///
/// Shapes, layouts and errors as [`super::select_pisa`].
pub fn select_oracle(
    q: &[f32],
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<Selection> {
    let mass = block_mass(q, k, shape, layout, cfg)?;
    select_oracle_from_mass(&mass, shape, cfg)
}

/// [`select_oracle`] from a [`block_mass`] computed beforehand (`[B, Hkv, Nq, nb_0]`).
/// Errors: shape errors, the configuration's validation errors,
/// [`crate::PisaError::BufferLen`], [`crate::PisaError::TooLarge`] as [`super::select_pisa`],
/// [`crate::PisaError::NonFinite`] for a mass that is NaN, infinite or negative.
pub fn select_oracle_from_mass(
    mass: &[f64],
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Result<Selection> {
    check_shape(shape, Some(cfg))?;
    let nb0 = shape.k_len.div_ceil(cfg.block_size);
    let rows = shape.batch * shape.kv_heads * shape.q_len;
    check_len("mass", mass.len(), checked_elems("mass", &[rows, nb0])?)?;
    // A mass is a probability: NaN or negative (or infinite) ranks by bits, not by mass.
    if let Some(index) = mass.iter().position(|x| !(x.is_finite() && *x >= 0.0)) {
        return Err(PisaError::NonFinite {
            what: "mass",
            index,
        });
    }
    let mut sel = Selection::with_rows(rows, cfg.top_k)?;
    for r in 0..rows {
        let p = shape.query_position(r % shape.q_len);
        let vis = visible(p, nb0, cfg);
        let scores = (0..vis).map(|j| (mass[r * nb0 + j], j)).collect();
        let (mut kept, gap) = cut(scores, cfg.top_k);
        kept.sort_unstable();
        let scored = if vis > cfg.top_k { vis as u32 } else { 0 };
        sel.set_row(r, &kept, gap, scored);
    }
    Ok(sel)
}
