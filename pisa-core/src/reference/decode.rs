//! Decode (PISA.md sections 1 and 5): one sequence's KV cache with an incrementally updated
//! pyramid, and one selection-plus-attention step per new token.

use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::layout::PyramidLayout;
use crate::schedule::Schedule;
use crate::shape::{AttentionShape, TensorLayout};

use super::attention::attend_row;
use super::pyramid::Pyramid;
use super::select::{select_one, QueryCtx};
use super::tensor::{check_len, View};

/// Everything one decode step computes (see [`DecodeState::step_detailed`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeOutput {
    /// `[Hkv, K]` i32: selected leaves, ascending, -1 padded.
    pub selection: Vec<i32>,
    /// `[Hkv]`: selection margin (see [`super::Selection::margin`]).
    pub margin: Vec<f64>,
    /// `[Hkv]`: candidates scored (see [`super::Selection::scored_nodes`]).
    pub scored_nodes: Vec<u32>,
    /// `[Hq, D]`: attention output.
    pub out: Vec<f64>,
    /// `[Hq]`: natural-log LSE of the scaled scores attended.
    pub lse: Vec<f64>,
}

/// The decode state of one sequence (batch 1): keys and values stored `[1, len, Hkv, D]`
/// ([`TensorLayout::Bnhd`]) and the [`Pyramid`] over them, kept current by [`Self::append`].
#[derive(Debug, Clone)]
pub struct DecodeState {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cfg: SelectionConfig,
    keys: Vec<f32>,
    values: Vec<f32>,
    len: usize,
    pyramid: Pyramid,
}

impl DecodeState {
    /// An empty cache for `q_heads` (Hq) query heads, `kv_heads` (Hkv) KV heads and head dim D.
    /// Errors: [`PisaError::Zero`], [`PisaError::GqaNotDivisible`], the configuration's
    /// validation errors, [`PisaError::TooLarge`] when Hq x D or Hkv x D overflows `usize`. (Its
    /// buffers start at one token's pyramid, `Hkv x D` values: absurd head counts and dims are
    /// allocated as asked, as any `Vec` is.)
    pub fn new(
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        cfg: SelectionConfig,
    ) -> Result<Self> {
        AttentionShape::new(1, q_heads, kv_heads, 1, 1, head_dim)?;
        cfg.validate()?;
        // Placeholder until the first append: the layout of one key, all zeros.
        let layout = PyramidLayout::new(1, cfg.block_size, cfg.merge_factor)?;
        Ok(Self {
            q_heads,
            kv_heads,
            head_dim,
            cfg,
            keys: Vec::new(),
            values: Vec::new(),
            len: 0,
            pyramid: Pyramid::zeros(layout, 1, kv_heads, head_dim)?,
        })
    }

    /// Appends one token's key and value rows (`[Hkv, D]` each) at position `len()`.
    ///
    /// Only the ancestor path of the new key's leaf is recomputed (the leaf from its raw keys,
    /// each ancestor from its children: O(C*D + log N * g*D) per KV head). When the key opens a
    /// new leaf, the layout grows: existing nodes are copied, not recomputed, to their new
    /// offsets (a reference-only cost; a GPU cache allocates its capacity's layout up front).
    /// Errors: [`PisaError::BufferLen`] for a row of the wrong length, [`PisaError::NonFinite`]
    /// for a NaN or an infinity in a row (nothing is appended then).
    pub fn append(&mut self, k_row: &[f32], v_row: &[f32]) -> Result<()> {
        let n = self.kv_heads * self.head_dim;
        check_len("k_row", k_row.len(), n)?;
        check_len("v_row", v_row.len(), n)?;
        // (checked here, row by row, so that the views of the whole cache need no scan)
        crate::error::check_finite("k_row", k_row)?;
        crate::error::check_finite("v_row", v_row)?;
        self.keys.extend_from_slice(k_row);
        self.values.extend_from_slice(v_row);
        self.len += 1;
        let old = self.pyramid.layout;
        let new = PyramidLayout::new(self.len, self.cfg.block_size, self.cfg.merge_factor)?;
        if self.len == 1 || new.total_nodes() != old.total_nodes() {
            let mut grown = Pyramid::zeros(new, 1, self.kv_heads, self.head_dim)?;
            if self.len > 1 {
                let d = self.head_dim;
                for h in 0..self.kv_heads {
                    for level in 0..old.num_levels() {
                        for j in 0..old.nodes(level) {
                            let (a, b) = (
                                self.pyramid.offset(0, h, level, j),
                                grown.offset(0, h, level, j),
                            );
                            grown.means[b..b + d].copy_from_slice(&self.pyramid.means[a..a + d]);
                            grown.vars[b..b + d].copy_from_slice(&self.pyramid.vars[a..a + d]);
                        }
                    }
                }
            }
            self.pyramid = grown;
        }
        self.pyramid.layout = new;
        let keys = View::checked_len(
            "keys",
            &self.keys,
            TensorLayout::Bnhd,
            [1, self.kv_heads, self.len, self.head_dim],
        )?;
        let leaf = new.block_of(self.len - 1);
        for h in 0..self.kv_heads {
            for (level, j) in new.ancestor_path(leaf) {
                if level == 0 {
                    self.pyramid.compute_leaf(&keys, 0, h, j);
                } else {
                    self.pyramid.compute_internal(0, h, level, j);
                }
            }
        }
        Ok(())
    }

    /// One decode step for the query row `q_row` (`[Hq, D]`) at position `len() - 1`: PISA
    /// selection (PISA.md 3, same as prefill at that position) and attention over it
    /// (PISA.md 4). Returns `(selection [Hkv, K] ascending -1 padded, out [Hq, D], lse [Hq])`.
    /// With `cfg.causal == false` the selection is the non-causal one over the keys so far.
    /// Errors: [`PisaError::Zero`] before any append, [`PisaError::BufferLen`],
    /// [`PisaError::NonFinite`] for a NaN or an infinity in `q_row`.
    pub fn step(&self, q_row: &[f32]) -> Result<(Vec<i32>, Vec<f64>, Vec<f64>)> {
        let s = self.step_detailed(q_row)?;
        Ok((s.selection, s.out, s.lse))
    }

    /// [`Self::step`] with the selection's margins and scored-node counts (as in
    /// [`super::Selection`], one per KV head). Errors as [`Self::step`].
    pub fn step_detailed(&self, q_row: &[f32]) -> Result<DecodeOutput> {
        if self.len == 0 {
            return Err(PisaError::Zero { what: "k_len" });
        }
        let (hq, hkv, d) = (self.q_heads, self.kv_heads, self.head_dim);
        let qv = View::new("q_row", q_row, TensorLayout::Bnhd, [1, hq, 1, d])?;
        let shape = [1, hkv, self.len, d];
        let keys = View::checked_len("keys", &self.keys, TensorLayout::Bnhd, shape)?;
        let values = View::checked_len("values", &self.values, TensorLayout::Bnhd, shape)?;
        let start_level = Schedule::new(&self.pyramid.layout, &self.cfg)?.start_level;
        let (k, g, c, p) = (self.cfg.top_k, hq / hkv, self.cfg.block_size, self.len - 1);
        let scale = self.cfg.softmax_scale(d) as f64;
        let mut sel = alloc::vec![-1i32; hkv * k];
        let mut out = alloc::vec![0.0; hq * d];
        let mut lse = alloc::vec![0.0; hq];
        let mut scratch = alloc::vec![0.0; d];
        let mut margin = alloc::vec![f64::INFINITY; hkv];
        let mut scored_nodes = alloc::vec![0u32; hkv];
        for h in 0..hkv {
            let q_rows: Vec<&[f32]> = (h * g..(h + 1) * g).map(|x| qv.row(0, x, 0)).collect();
            let ctx = QueryCtx {
                pyramid: &self.pyramid,
                keys: &keys,
                b: 0,
                kv_head: h,
                q_rows: &q_rows,
                scale,
                cfg: &self.cfg,
                start_level,
            };
            let (blocks, m, n) = select_one(&ctx, p);
            (margin[h], scored_nodes[h]) = (m, n);
            for (s, &j) in sel[h * k..].iter_mut().zip(&blocks) {
                *s = j as i32;
            }
            for x in h * g..(h + 1) * g {
                let tokens = blocks
                    .iter()
                    .flat_map(|&j| j * c..((j + 1) * c).min(self.len));
                let o = &mut out[x * d..(x + 1) * d];
                lse[x] = attend_row(
                    q_rows[x - h * g],
                    &keys,
                    &values,
                    (0, h),
                    tokens,
                    Some(p),
                    scale,
                    o,
                    &mut scratch,
                );
            }
        }
        Ok(DecodeOutput {
            selection: sel,
            margin,
            scored_nodes,
            out,
            lse,
        })
    }

    /// The pyramid over the keys appended so far (before the first append: a zero placeholder
    /// with the layout of one key).
    pub fn pyramid(&self) -> &Pyramid {
        &self.pyramid
    }
    /// Tokens appended so far.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether nothing was appended yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Keys appended so far, `[1, len, Hkv, D]` ([`TensorLayout::Bnhd`] with batch 1).
    pub fn keys(&self) -> &[f32] {
        &self.keys
    }
    /// Values appended so far, same layout as [`Self::keys`].
    pub fn values(&self) -> &[f32] {
        &self.values
    }
    /// The configuration.
    pub fn config(&self) -> &SelectionConfig {
        &self.cfg
    }
}
