//! The key pyramid (PISA.md section 1): per-node mean key and per-dimension key variance.

use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::layout::PyramidLayout;
use crate::shape::{AttentionShape, TensorLayout};

use super::tensor::{check_shape, checked_elems, filled, View};

/// The key pyramid of `B` sequences with `Hkv` key heads (PISA.md section 1), in f64.
///
/// A leaf (level 0) holds the mean and population variance of its raw keys; a node of a
/// level `l >= 1` holds the count-weighted mean of its children's means and the pooled population variance
/// `sum_c n_c (var_c + (mu_c - mu)^2) / n`, which equals the variance over all its tokens. Token
/// counts are not stored: they are [`PyramidLayout::node_len`].
#[derive(Debug, Clone, PartialEq)]
pub struct Pyramid {
    /// Levels and node counts over the keys the pyramid was built from.
    pub layout: PyramidLayout,
    /// B.
    pub batch: usize,
    /// Hkv.
    pub kv_heads: usize,
    /// D.
    pub head_dim: usize,
    /// Mean keys, `[B, Hkv, total_nodes, D]`, nodes in [`PyramidLayout::flat`] order.
    pub means: Vec<f64>,
    /// Per-dimension population variance of each node's keys; same shape as `means`.
    pub vars: Vec<f64>,
}

impl Pyramid {
    /// An all-zero pyramid of the given layout and sizes (filled by [`build_pyramid`] or the
    /// decode state). Errors: [`PisaError::Zero`] for a batch, KV head count or head dim of 0,
    /// [`PisaError::TooLarge`] when the buffer size overflows `usize` or cannot be allocated.
    pub fn zeros(
        layout: PyramidLayout,
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        for (what, n) in [
            ("batch", batch),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ] {
            if n == 0 {
                return Err(PisaError::Zero { what });
            }
        }
        let n = checked_elems(
            "pyramid",
            &[batch, kv_heads, layout.total_nodes(), head_dim],
        )?;
        Ok(Self {
            layout,
            batch,
            kv_heads,
            head_dim,
            means: filled("pyramid means", n, 0.0)?,
            vars: filled("pyramid variances", n, 0.0)?,
        })
    }

    /// Offset of node `(b, h, level, j)`'s first dimension in `means` / `vars`. Panics when an
    /// index is out of range, as [`Self::mean`] (a KV head past the last named another
    /// sequence's node).
    #[inline]
    pub fn offset(&self, b: usize, h: usize, level: usize, j: usize) -> usize {
        assert!(b < self.batch, "sequence {b} of a batch of {}", self.batch);
        assert!(h < self.kv_heads, "KV head {h} of {}", self.kv_heads);
        // (checked: the fields are public, and a batch set past the buffers must not wrap to
        // another node's offset)
        b.checked_mul(self.kv_heads)
            .and_then(|o| o.checked_add(h))
            .and_then(|o| o.checked_mul(self.layout.total_nodes()))
            .and_then(|o| o.checked_add(self.layout.flat(level, j)))
            .and_then(|o| o.checked_mul(self.head_dim))
            .unwrap_or_else(|| panic!("node ({b}, {h}, {level}, {j}) past the pyramid's size"))
    }

    /// Mean key (D values) of node `j` of `level` for sequence `b`, KV head `h`.
    /// Panics when an index is out of range (b past the batch, h past the KV heads, a level
    /// past the pyramid's, j past the level's nodes).
    pub fn mean(&self, b: usize, h: usize, level: usize, j: usize) -> &[f64] {
        let o = self.offset(b, h, level, j);
        &self.means[o..o + self.head_dim]
    }

    /// Per-dimension key variance (D values) of node `j` of `level`. Panics when out of range,
    /// as [`Self::mean`].
    pub fn var(&self, b: usize, h: usize, level: usize, j: usize) -> &[f64] {
        let o = self.offset(b, h, level, j);
        &self.vars[o..o + self.head_dim]
    }

    /// Recomputes leaf `j` of `(b, h)` from the raw keys (two-pass mean, then variance).
    pub(crate) fn compute_leaf(&mut self, keys: &View<'_>, b: usize, h: usize, j: usize) {
        let span = self.layout.token_span(0, j);
        let n = span.len() as f64;
        let o = self.offset(b, h, 0, j);
        let d = self.head_dim;
        let mean = &mut self.means[o..o + d];
        mean.fill(0.0);
        for t in span.clone() {
            for (m, &x) in mean.iter_mut().zip(keys.row(b, h, t)) {
                *m += x as f64;
            }
        }
        for m in mean.iter_mut() {
            *m /= n;
        }
        let var = &mut self.vars[o..o + d];
        var.fill(0.0);
        for t in span {
            for ((v, &x), &m) in var.iter_mut().zip(keys.row(b, h, t)).zip(&self.means[o..]) {
                let e = x as f64 - m;
                *v += e * e;
            }
        }
        for v in var.iter_mut() {
            *v /= n;
        }
    }

    /// Recomputes node `j` of `level >= 1` of `(b, h)` from its children.
    pub(crate) fn compute_internal(&mut self, b: usize, h: usize, level: usize, j: usize) {
        let n = self.layout.node_len(level, j) as f64;
        let o = self.offset(b, h, level, j);
        let children = self.layout.children(level, j);
        for d in 0..self.head_dim {
            let mut s = 0.0;
            for c in children.clone() {
                let nc = self.layout.node_len(level - 1, c) as f64;
                s += nc * self.means[self.offset(b, h, level - 1, c) + d];
            }
            self.means[o + d] = s / n;
        }
        for d in 0..self.head_dim {
            let mu = self.means[o + d];
            let mut s = 0.0;
            for c in children.clone() {
                let nc = self.layout.node_len(level - 1, c) as f64;
                let oc = self.offset(b, h, level - 1, c) + d;
                let e = self.means[oc] - mu;
                s += nc * (self.vars[oc] + e * e);
            }
            self.vars[o + d] = s / n;
        }
    }

    /// Checks that this pyramid was built for `shape` and `cfg` (same key length, block size,
    /// merge factor, batch, KV heads and head dim). Errors: [`PisaError::InvalidValue`] (a
    /// mismatch, e.g. a block size or merge factor other than the pyramid's), and those of
    /// [`PyramidLayout::new`] for `cfg` (a zero block size, a merge factor below 2) and of the
    /// size of the pyramid it implies ([`PisaError::TooLarge`]).
    pub fn check_matches(&self, shape: &AttentionShape, cfg: &SelectionConfig) -> Result<()> {
        let want = PyramidLayout::new(shape.k_len, cfg.block_size, cfg.merge_factor)?;
        let n = checked_elems(
            "pyramid",
            &[self.batch, self.kv_heads, want.total_nodes(), self.head_dim],
        )?;
        if self.layout != want
            || self.batch != shape.batch
            || self.kv_heads != shape.kv_heads
            || self.head_dim != shape.head_dim
            || self.means.len() != n
            || self.vars.len() != n
        {
            return Err(PisaError::InvalidValue {
                what: "pyramid does not match the shape and configuration",
            });
        }
        Ok(())
    }
}

/// Builds the key pyramid of `k` (PISA.md section 1).
///
/// `k` is `[B, Hkv, Nk, D]` in `layout` (sizes from `shape`); the layout of the pyramid is
/// `PyramidLayout::new(Nk, C, g)` of `cfg`. Errors: shape errors as
/// [`AttentionShape::new`] (the shape is checked again: its fields are public), the
/// configuration's validation errors, [`PisaError::TooLarge`] for more leaves than an i32
/// index holds or a selection of `shape` past `usize` (the checks every selection takes) and
/// for a pyramid that cannot be allocated, [`PisaError::BufferLen`] when `k.len() !=
/// shape.kv_elems()`, [`PisaError::NonFinite`] for a NaN or an infinity in `k`.
pub fn build_pyramid(
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<Pyramid> {
    check_shape(shape, Some(cfg))?;
    let keys = View::new(
        "k",
        k,
        layout,
        [shape.batch, shape.kv_heads, shape.k_len, shape.head_dim],
    )?;
    pyramid_of(&keys, shape, cfg)
}

/// [`build_pyramid`] of keys already validated as a view of `shape` (the selections, which
/// check Q and K once).
pub(crate) fn pyramid_of(
    keys: &View<'_>,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Result<Pyramid> {
    let pl = PyramidLayout::new(shape.k_len, cfg.block_size, cfg.merge_factor)?;
    let mut p = Pyramid::zeros(pl, shape.batch, shape.kv_heads, shape.head_dim)?;
    for b in 0..shape.batch {
        for h in 0..shape.kv_heads {
            for j in 0..pl.leaves() {
                p.compute_leaf(keys, b, h, j);
            }
            for level in 1..pl.num_levels() {
                for j in 0..pl.nodes(level) {
                    p.compute_internal(b, h, level, j);
                }
            }
        }
    }
    Ok(p)
}
