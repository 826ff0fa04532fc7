//! Block selection (PISA.md section 3): PISA's coarse-to-fine Top-K, the BSA baseline, and the
//! full-attention oracle.
//!
//! Scores are ranked higher first, then the lower index, with -0.0 and +0.0 equal (a tie, as
//! the GPU kernels' comparisons see them). The reference refuses non-finite inputs
//! ([`crate::PisaError::NonFinite`]): their scores would rank by a NaN's sign bit. The GPU
//! kernels promise nothing for them either (check them first: `pisa_wgpu::ops::check_finite`);
//! finite inputs whose scores overflow f32 are a different matter, documented with the kernels
//! (the reference's f64 scores of finite f32 inputs do not overflow).

use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::Result;
use crate::schedule::Schedule;
use crate::shape::{AttentionShape, TensorLayout};

use super::pyramid::{pyramid_of, Pyramid};
use super::tensor::{check_shape, checked_elems, filled, View};

mod baseline;
mod pisa;

pub use baseline::{block_mass, select_bsa, select_oracle, select_oracle_from_mass};
pub(crate) use pisa::{select_one, QueryCtx};

/// The leaf blocks selected for every (sequence, KV head, query) (PISA.md section 3.4).
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// K: entries per row.
    pub top_k: usize,
    /// `[B, Hkv, Nq, K]` i32: ascending leaf-block indices, padded with -1.
    pub indices: Vec<i32>,
    /// `[B, Hkv, Nq]`: the smallest gap, over every cut of this row (each intermediate level
    /// that cut its candidates to K, and the final leaf cut), between the worst kept score
    /// and the best dropped score (scores are summed over the GQA group, natural-log units;
    /// the oracle's are probability mass). `f64::INFINITY` when nothing was cut. A selection
    /// computed with different rounding may legitimately differ only where this is tiny.
    pub margin: Vec<f64>,
    /// `[B, Hkv, Nq]`: candidates scored by this row (one per candidate, not per query head).
    /// A level whose candidates all fit is not scored and counts 0.
    pub scored_nodes: Vec<u32>,
}

impl Selection {
    /// Row `r = (b * Hkv + h) * Nq + i` of `indices` (K entries). Panics when out of range.
    pub fn row(&self, r: usize) -> &[i32] {
        &self.indices[r * self.top_k..(r + 1) * self.top_k]
    }

    /// Number of rows (`B * Hkv * Nq`): `indices.len() / top_k` (0 for `top_k == 0`), so
    /// that a selection built by hand without margins counts its rows too.
    pub fn rows(&self) -> usize {
        self.indices.len().checked_div(self.top_k).unwrap_or(0)
    }

    /// An empty selection of `rows` rows of `top_k` entries. Errors: [`crate::PisaError::TooLarge`]
    /// when its buffers cannot be allocated (a `top_k` far past the leaves asks for an absurd
    /// padded output, which aborted the process).
    pub(crate) fn with_rows(rows: usize, top_k: usize) -> Result<Self> {
        let n = checked_elems("selection", &[rows, top_k])?;
        Ok(Self {
            top_k,
            indices: filled("selection", n, -1)?,
            margin: filled("selection margins", rows, f64::INFINITY)?,
            scored_nodes: filled("selection counts", rows, 0)?,
        })
    }

    /// Writes row `r` from ascending `blocks` (at most K of them).
    pub(crate) fn set_row(&mut self, r: usize, blocks: &[usize], margin: f64, scored: u32) {
        let k = self.top_k;
        for (slot, &b) in self.indices[r * k..(r + 1) * k].iter_mut().zip(blocks) {
            *slot = b as i32;
        }
        self.margin[r] = margin;
        self.scored_nodes[r] = scored;
    }
}

/// Keeps the best `keep` of `(score, index)` candidates: higher score first, then lower index
/// (PISA.md 3.4). Returns the kept indices (in rank order) and the gap between the worst kept
/// and the best dropped score (`INFINITY` when nothing is dropped or nothing is kept).
pub(crate) fn cut(mut scored: Vec<(f64, usize)>, keep: usize) -> (Vec<usize>, f64) {
    // -0.0 + 0.0 is +0.0: equal scores of either sign tie (total_cmp ranks +0.0 above -0.0, so
    // a zero query's BSA scores, -0.0 against a negative mean and +0.0 against a positive one,
    // broke the tie by sign instead of by the lower block).
    for s in &mut scored {
        s.0 += 0.0;
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let gap = if keep == 0 || keep >= scored.len() {
        f64::INFINITY
    } else {
        scored[keep - 1].0 - scored[keep].0
    };
    scored.truncate(keep);
    (scored.into_iter().map(|(_, j)| j).collect(), gap)
}

/// Validates the configuration and the Q and K buffers of a selection.
fn views<'a>(
    q: &'a [f32],
    k: &'a [f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<(View<'a>, View<'a>)> {
    check_shape(shape, Some(cfg))?;
    let s = shape;
    let qv = View::new("q", q, layout, [s.batch, s.q_heads, s.q_len, s.head_dim])?;
    let kv = View::new("k", k, layout, [s.batch, s.kv_heads, s.k_len, s.head_dim])?;
    Ok((qv, kv))
}

/// PISA selection (PISA.md section 3) of every query: builds the pyramid of `k`, then
/// [`select_pisa_with`].
///
/// `q`: `[B, Hq, Nq, D]`, `k`: `[B, Hkv, Nk, D]`, both in `layout`. Errors: shape errors as
/// [`crate::AttentionShape::new`], the configuration's validation errors,
/// [`crate::PisaError::BufferLen`] for a buffer whose length does not match `shape`,
/// [`crate::PisaError::TooLarge`] for more leaf blocks than an i32 index holds or a selection
/// past the memory an allocation may take, [`crate::PisaError::NonFinite`] for a NaN or an
/// infinity in `q` or `k`.
pub fn select_pisa(
    q: &[f32],
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<Selection> {
    let (qv, kv) = views(q, k, shape, layout, cfg)?;
    let pyr = pyramid_of(&kv, shape, cfg)?;
    select_with(&pyr, &qv, &kv, shape, cfg)
}

/// PISA selection with a pyramid built beforehand (by [`super::build_pyramid`] over the same
/// `k`, or by a decode state). Query `i` sits at `p = Nk - Nq + i` (causal: sees `0..=p`).
///
/// Returns a [`Selection`] `[B, Hkv, Nq, K]`. Intermediate scores follow `cfg.scoring`, leaf
/// scores are exact LSE over raw keys, all summed over the GQA group (PISA.md section 2).
/// Errors: as [`select_pisa`], plus [`crate::PisaError::InvalidValue`] when the pyramid does
/// not match `shape` and `cfg`.
pub fn select_pisa_with(
    pyramid: &Pyramid,
    q: &[f32],
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<Selection> {
    let (qv, kv) = views(q, k, shape, layout, cfg)?;
    select_with(pyramid, &qv, &kv, shape, cfg)
}

/// [`select_pisa_with`] of Q and K already validated as views of `shape`.
fn select_with(
    pyramid: &Pyramid,
    qv: &View<'_>,
    kv: &View<'_>,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Result<Selection> {
    pyramid.check_matches(shape, cfg)?;
    let start_level = Schedule::new(&pyramid.layout, cfg)?.start_level;
    let g = shape.gqa_group();
    let mut sel = Selection::with_rows(shape.batch * shape.kv_heads * shape.q_len, cfg.top_k)?;
    for b in 0..shape.batch {
        for h in 0..shape.kv_heads {
            for i in 0..shape.q_len {
                let q_rows: Vec<&[f32]> = (h * g..(h + 1) * g).map(|hq| qv.row(b, hq, i)).collect();
                let ctx = QueryCtx {
                    pyramid,
                    keys: kv,
                    b,
                    kv_head: h,
                    q_rows: &q_rows,
                    scale: cfg.softmax_scale(shape.head_dim) as f64,
                    cfg,
                    start_level,
                };
                let (blocks, margin, scored) = select_one(&ctx, shape.query_position(i));
                sel.set_row(
                    (b * shape.kv_heads + h) * shape.q_len + i,
                    &blocks,
                    margin,
                    scored,
                );
            }
        }
    }
    Ok(sel)
}

#[cfg(test)]
mod tests {
    use super::Selection;
    use crate::PisaError;

    /// A selection too large to allocate is [`PisaError::TooLarge`] before anything is
    /// allocated (a `top_k` of 2^24 over 64 KiB of input asked for 1 TiB and aborted), and one
    /// whose element count overflows too.
    #[test]
    #[cfg(target_pointer_width = "64")] // (sizes past a 32-bit usize)
    fn a_selection_past_memory_is_an_error() {
        // 2^40 rows of 2^22 entries: 2^62 i32, past the 2^61 an allocation may hold.
        let e = Selection::with_rows(1 << 40, 1 << 22).unwrap_err();
        assert!(
            matches!(
                e,
                PisaError::TooLarge {
                    what: "selection",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = Selection::with_rows(usize::MAX, 2).unwrap_err();
        assert!(matches!(e, PisaError::TooLarge { .. }), "{e:?}");
        let s = Selection::with_rows(3, 4).unwrap();
        assert_eq!((s.rows(), s.indices.len()), (3, 12));
        assert!(s.indices.iter().all(|&j| j == -1));
    }
}
