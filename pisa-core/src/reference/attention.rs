//! Block-sparse and dense attention (PISA.md section 4) in f64 with the online softmax.

use alloc::vec;
use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::lse::OnlineSoftmax;
use crate::shape::{AttentionShape, TensorLayout};

use super::tensor::{check_block_indices, check_len, check_shape, dot, View, SELECTION_INDEX};

/// Attends one query row over the keys `tokens` (ascending), skipping `t > limit`; writes the
/// output into `out` (D values) and returns the LSE. `scratch` holds D values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_row(
    q: &[f32],
    keys: &View<'_>,
    values: &View<'_>,
    (b, h): (usize, usize),
    tokens: impl Iterator<Item = usize>,
    limit: Option<usize>,
    scale: f64,
    out: &mut [f64],
    scratch: &mut [f64],
) -> f64 {
    let mut st = OnlineSoftmax::<f64>::new();
    out.fill(0.0);
    for t in tokens {
        if limit.is_some_and(|p| t > p) {
            break;
        }
        for (x, &v) in scratch.iter_mut().zip(values.row(b, h, t)) {
            *x = v as f64;
        }
        st.push(scale * dot(q, keys.row(b, h, t)), scratch, out);
    }
    st.finish(out)
}

type Views<'a> = (View<'a>, View<'a>, View<'a>);

fn qkv<'a>(
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    s: &AttentionShape,
    layout: TensorLayout,
) -> Result<Views<'a>> {
    check_shape(s, None)?;
    let qs = [s.batch, s.q_heads, s.q_len, s.head_dim];
    let ks = [s.batch, s.kv_heads, s.k_len, s.head_dim];
    Ok((
        View::new("q", q, layout, qs)?,
        View::new("k", k, layout, ks)?,
        View::new("v", v, layout, ks)?,
    ))
}

/// Runs `row(b, hq, i, kv_head, out, scratch) -> lse` for every query row, filling O (Q's
/// layout) and LSE `[B, Hq, Nq]`.
fn for_rows(
    s: &AttentionShape,
    layout: TensorLayout,
    mut row: impl FnMut(usize, usize, usize, usize, &mut [f64], &mut [f64]) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let d = s.head_dim;
    let mut o = vec![0.0; s.q_elems()];
    let mut lse = vec![0.0; s.lse_elems()];
    let (mut out, mut scratch) = (vec![0.0; d], vec![0.0; d]);
    for b in 0..s.batch {
        for hq in 0..s.q_heads {
            for i in 0..s.q_len {
                let l = row(b, hq, i, s.kv_head_of(hq), &mut out, &mut scratch);
                lse[(b * s.q_heads + hq) * s.q_len + i] = l;
                let base = layout.index(s.q_heads, s.q_len, d, b, hq, i, 0);
                o[base..base + d].copy_from_slice(&out);
            }
        }
    }
    (o, lse)
}

/// Block-sparse attention over selected leaves (PISA.md section 4), f64 accumulation.
///
/// `q`: `[B, Hq, Nq, D]`; `k`, `v`: `[B, Hkv, Nk, D]`, all in `layout`. `selection`:
/// `[B, Hkv, Nq, K]` i32 with `K = cfg.top_k` (a [`super::Selection`]'s `indices`); -1 entries
/// are ignored and a repeated block counts once. Query `i` (at `p = Nk - Nq + i`) attends to
/// the keys of its KV head's selected leaves, masked to `t <= p` when `cfg.causal`; scores are
/// `s * q.k_t` with `s = cfg.softmax_scale(D)`.
///
/// Returns `(O, LSE)`: O in Q's layout, LSE `[B, Hq, Nq]` (natural log of the sum of
/// `exp(score)` over attended keys). A row attending to nothing gets zeros and `-inf`.
/// Errors: shape errors as [`crate::AttentionShape::new`] (the shape is checked again: its
/// fields are public), the configuration's validation errors, [`PisaError::BufferLen`] for a
/// buffer of the wrong length, [`PisaError::InvalidValue`] for an index below -1 or at least
/// `nb_0`,
/// [`PisaError::NonFinite`] for a NaN or an infinity in `q`, `k` or `v`.
pub fn sparse_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
    selection: &[i32],
) -> Result<(Vec<f64>, Vec<f64>)> {
    check_shape(shape, Some(cfg))?;
    let (qv, kv, vv) = qkv(q, k, v, shape, layout)?;
    let kk = cfg.top_k;
    check_len(
        "selection",
        selection.len(),
        shape.kv_heads * shape.batch * shape.q_len * kk,
    )?;
    let nb0 = shape.k_len.div_ceil(cfg.block_size);
    check_block_indices(selection, nb0, SELECTION_INDEX)?;
    let scale = cfg.softmax_scale(shape.head_dim) as f64;
    let c = cfg.block_size;
    let mut blocks = Vec::with_capacity(kk);
    Ok(for_rows(shape, layout, |b, hq, i, h, out, scratch| {
        let p = shape.query_position(i);
        let r = ((b * shape.kv_heads + h) * shape.q_len + i) * kk;
        blocks.clear();
        blocks.extend(
            selection[r..r + kk]
                .iter()
                .filter(|&&j| j >= 0)
                .map(|&j| j as usize),
        );
        blocks.sort_unstable();
        blocks.dedup();
        let tokens = blocks
            .iter()
            .flat_map(|&j| j * c..((j + 1) * c).min(shape.k_len));
        let limit = cfg.causal.then_some(p);
        // The limit `break`s at the first token past p: tokens are ascending.
        attend_row(
            qv.row(b, hq, i),
            &kv,
            &vv,
            (b, h),
            tokens,
            limit,
            scale,
            out,
            scratch,
        )
    }))
}

/// Dense attention (PISA.md section 4): every key, masked to `t <= p_i` when `causal`, scores
/// `scale * q.k_t`. Shapes, layouts and returns as [`sparse_attention`].
/// Errors: shape errors as [`crate::AttentionShape::new`], [`PisaError::BufferLen`],
/// [`PisaError::InvalidValue`] for a non-finite or non-positive scale, [`PisaError::NonFinite`]
/// for a NaN or an infinity in `q`, `k` or `v`.
pub fn dense_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    causal: bool,
    scale: f32,
) -> Result<(Vec<f64>, Vec<f64>)> {
    if !scale.is_finite() || scale <= 0.0 {
        return Err(PisaError::InvalidValue {
            what: "softmax scale must be finite and positive",
        });
    }
    let (qv, kv, vv) = qkv(q, k, v, shape, layout)?;
    Ok(for_rows(shape, layout, |b, hq, i, h, out, scratch| {
        let limit = causal.then_some(shape.query_position(i));
        let tokens = 0..shape.k_len;
        attend_row(
            qv.row(b, hq, i),
            &kv,
            &vv,
            (b, h),
            tokens,
            limit,
            scale as f64,
            out,
            scratch,
        )
    }))
}
