//! Complexity-bounded candidate scheduling (PISA.md sections 3 and 5): the start level, the
//! bound on scored candidates per level, the per-query work bound, and every buffer and grid
//! size the GPU runtime derives from them, so that no GPU code sizes anything by hand.

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::layout::PyramidLayout;
use crate::shape::AttentionShape;

/// The candidate schedule of one (shape, configuration) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Coarsest level whose node count exceeds K (PISA.md 3.1); `None` when `nb_0 <= K`, where
    /// every query simply gets all its visible leaves.
    pub start_level: Option<usize>,
    /// Most candidates a level ever holds for one query: `g * (K + 1)` (PISA.md 3.2). Stage 1 of
    /// prefill writes this many leaf-candidate slots per (query, KV head).
    pub max_candidates: usize,
    /// K.
    pub top_k: usize,
    /// g.
    pub merge_factor: usize,
    /// C.
    pub block_size: usize,
    /// Levels of the pyramid.
    pub num_levels: usize,
}

impl Schedule {
    /// Derives the schedule. Errors: the configuration's own validation errors;
    /// [`crate::PisaError::InvalidValue`] for a layout of another block size or merge factor
    /// than `cfg`'s (the schedule would mix the two).
    pub fn new(layout: &PyramidLayout, cfg: &SelectionConfig) -> Result<Self> {
        cfg.validate()?;
        if layout.block_size() != cfg.block_size || layout.merge_factor() != cfg.merge_factor {
            return Err(crate::PisaError::InvalidValue {
                what:
                    "the pyramid layout's block size and merge factor must be the configuration's",
            });
        }
        let k = cfg.top_k;
        let start_level = (0..layout.num_levels())
            .rev()
            .find(|&l| layout.nodes(l) > k);
        Ok(Self {
            start_level,
            max_candidates: cfg.merge_factor * (k + 1),
            top_k: k,
            merge_factor: cfg.merge_factor,
            block_size: cfg.block_size,
            num_levels: layout.num_levels(),
        })
    }

    /// Most node scorings one selection (one query, one KV head, one query head of the group)
    /// performs: `max_candidates` per level from the start level down to the leaves.
    /// Grows as O(log N): the count the tests hold the reference to. (`usize::MAX` where the
    /// count overflows, as every size here: a 32-bit target, or hand-set fields.)
    pub fn max_scored_nodes(&self) -> usize {
        self.start_level.map_or(0, |s| {
            saturating_product(&[s.saturating_add(1), self.max_candidates])
        })
    }

    /// Dot products of length D one selection needs at most, per query head: an intermediate
    /// candidate reads its g children's means (`lse`) and a leaf candidate its C keys.
    /// (`usize::MAX` where the count overflows, as every size here: e.g. C = 2^20 with 65,600
    /// candidates on a 32-bit target such as wasm32.)
    pub fn max_dot_products(&self) -> usize {
        match self.start_level {
            None => 0,
            Some(s) => {
                let inner = saturating_product(&[s, self.max_candidates, self.merge_factor]);
                inner.saturating_add(saturating_product(&[self.max_candidates, self.block_size]))
            }
        }
    }

    /// Elements of the stage-1 leaf-candidate buffer: `B * Hkv * Nq * max_candidates` (i32;
    /// `usize::MAX` where the product overflows, as every size here).
    pub fn candidates_len(&self, shape: &AttentionShape) -> usize {
        saturating_product(&[
            shape.batch,
            shape.kv_heads,
            shape.q_len,
            self.max_candidates,
        ])
    }

    /// Elements of the selection buffer: `B * Hkv * Nq * K` (i32, ascending, -1 padded),
    /// layout `[B, Hkv, Nq, K]`.
    pub fn selection_len(&self, shape: &AttentionShape) -> usize {
        saturating_product(&[shape.batch, shape.kv_heads, shape.q_len, self.top_k])
    }
}

/// The product of `dims`, `usize::MAX` where it overflows: a size past any buffer, which the
/// callers' checks against their limits then refuse (a wrapped product would undersize a
/// buffer).
fn saturating_product(dims: &[usize]) -> usize {
    dims.iter().fold(1usize, |a, &d| a.saturating_mul(d))
}

/// Elements of a pyramid buffer of means: `B * Hkv * total_nodes * D` (f32), layout
/// `[B, Hkv, node, D]` with nodes in [`PyramidLayout::flat`] order.
pub fn pyramid_len(
    layout: &PyramidLayout,
    batch: usize,
    kv_heads: usize,
    head_dim: usize,
) -> usize {
    saturating_product(&[batch, kv_heads, layout.total_nodes(), head_dim])
}

/// A compute grid `[x, y, z]` covering `workgroups` workgroups with no dimension above
/// `max_per_dim` (65535 on most adapters). Shaders recover the linear id as
/// `x + y * gx + z * gx * gy` and skip ids `>= workgroups`.
///
/// A `max_per_dim` of 0 is taken as 1 (and reported as 1 in the error).
///
/// Errors: [`PisaError::TooLarge`] when even `max_per_dim^3` is not enough.
pub fn grid_for(workgroups: u64, max_per_dim: u32) -> Result<[u32; 3]> {
    let m = max_per_dim.max(1) as u64;
    if workgroups == 0 {
        return Ok([0, 1, 1]);
    }
    if workgroups <= m {
        return Ok([workgroups as u32, 1, 1]);
    }
    let y = workgroups.div_ceil(m);
    if y <= m {
        return Ok([m as u32, y as u32, 1]);
    }
    let z = y.div_ceil(m);
    if z <= m {
        return Ok([m as u32, m as u32, z as u32]);
    }
    Err(PisaError::TooLarge {
        what: "workgroups of one dispatch",
        value: workgroups,
        limit: m * m * m,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_level_is_coarsest_level_above_k() {
        let l = PyramidLayout::new(64 * 100, 64, 2).unwrap(); // 100, 50, 25, 13, 7, 4, 2, 1
        let s = Schedule::new(&l, &SelectionConfig::new(64, 16).unwrap()).unwrap();
        assert_eq!(s.start_level, Some(2));
        assert_eq!(s.max_candidates, 34);
        let l = PyramidLayout::new(64 * 16, 64, 2).unwrap();
        let s = Schedule::new(&l, &SelectionConfig::new(64, 16).unwrap()).unwrap();
        assert_eq!(s.start_level, None);
    }

    /// The counts saturate instead of overflowing (a panic in debug builds, a wrapped count in
    /// release): hand-set fields here, as a 32-bit target (wasm32) reaches with a valid
    /// configuration (C = 2^20, 65,600 candidates).
    #[test]
    fn counts_saturate() {
        let l = PyramidLayout::new(64 * 100, 64, 2).unwrap();
        let mut s = Schedule::new(&l, &SelectionConfig::new(64, 16).unwrap()).unwrap();
        assert_eq!(s.max_dot_products(), 2 * 34 * 2 + 34 * 64);
        assert_eq!(s.max_scored_nodes(), 3 * 34);
        s.start_level = Some(usize::MAX);
        assert_eq!(s.max_scored_nodes(), usize::MAX);
        assert_eq!(s.max_dot_products(), usize::MAX);
        s.start_level = Some(1);
        s.block_size = usize::MAX / 2;
        assert_eq!(s.max_dot_products(), usize::MAX);
    }

    #[test]
    fn grid_splits_past_the_limit() {
        assert_eq!(grid_for(10, 65535).unwrap(), [10, 1, 1]);
        assert_eq!(grid_for(70000, 65535).unwrap(), [65535, 2, 1]);
        let g = grid_for(65535u64 * 65535 + 1, 65535).unwrap();
        assert_eq!(g, [65535, 65535, 2]);
        assert!(grid_for(u64::MAX, 65535).is_err());
    }
}
