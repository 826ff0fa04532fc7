//! The key pyramid's layout (PISA.md section 1): levels, node counts, flat-buffer offsets, and
//! the parent / children / ancestor / span arithmetic, for any key length.
//!
//! Level 0 holds `nb_0 = ceil(Nk / C)` leaf blocks; `nb_{l+1} = ceil(nb_l / g)` down to a top
//! level of one node. Node `j` of level `l + 1` has children `g*j .. g*j + g` of level `l`
//! (the last node may have fewer). Since `ceil(ceil(x / a) / b) == ceil(x / (a * b))`, the nodes
//! of a shorter sequence are a prefix of each level of a longer one: a KV cache can allocate the
//! layout of its capacity and grow inside it.

use core::ops::Range;

use crate::error::{PisaError, Result};

/// Most levels a pyramid can have (g >= 2 and at most 2^64 leaves).
pub const MAX_LEVELS: usize = 64;

/// Where a node stands relative to a query's own leaf block `b_q` (PISA.md section 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeClass {
    /// All its leaves are `< b_q` (or the selection is not causal): a candidate.
    CompletePast,
    /// Contains `b_q`: never scored, always expanded.
    Ancestor,
    /// All its leaves are `> b_q`: never a candidate.
    Future,
}

/// Level structure of the pyramid over `key_len` keys with leaf block size C and merge factor g.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyramidLayout {
    key_len: usize,
    block_size: usize,
    merge_factor: usize,
    levels: usize,
    counts: [usize; MAX_LEVELS],
    offsets: [usize; MAX_LEVELS],
    total: usize,
}

impl PyramidLayout {
    /// Layout over `key_len` keys. Errors: [`PisaError::Zero`] for a zero length or block size,
    /// [`PisaError::MergeFactor`] for g < 2, [`PisaError::TooLarge`] when the pyramid would need
    /// more than [`MAX_LEVELS`] levels or its node total overflows `usize` (only for key lengths
    /// near `usize::MAX`).
    pub fn new(key_len: usize, block_size: usize, merge_factor: usize) -> Result<Self> {
        if key_len == 0 {
            return Err(PisaError::Zero { what: "k_len" });
        }
        if block_size == 0 {
            return Err(PisaError::Zero { what: "block_size" });
        }
        if merge_factor < 2 {
            return Err(PisaError::MergeFactor { merge_factor });
        }
        let mut counts = [0usize; MAX_LEVELS];
        let mut offsets = [0usize; MAX_LEVELS];
        let mut n = key_len.div_ceil(block_size);
        let mut levels = 0;
        let mut total = 0;
        loop {
            if levels == MAX_LEVELS {
                return Err(PisaError::TooLarge {
                    what: "pyramid levels",
                    value: levels as u64 + 1,
                    limit: MAX_LEVELS as u64,
                });
            }
            counts[levels] = n;
            offsets[levels] = total;
            total = match total.checked_add(n) {
                Some(t) => t,
                None => {
                    return Err(PisaError::TooLarge {
                        what: "pyramid nodes (all levels)",
                        value: u64::MAX,
                        limit: usize::MAX as u64,
                    })
                }
            };
            levels += 1;
            if n == 1 {
                break;
            }
            n = n.div_ceil(merge_factor);
        }
        Ok(Self {
            key_len,
            block_size,
            merge_factor,
            levels,
            counts,
            offsets,
            total,
        })
    }

    /// Nk: keys covered.
    pub fn key_len(&self) -> usize {
        self.key_len
    }
    /// C: tokens per leaf.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// g: children per node.
    pub fn merge_factor(&self) -> usize {
        self.merge_factor
    }
    /// Number of levels, leaves included (>= 1; the top level has one node).
    pub fn num_levels(&self) -> usize {
        self.levels
    }
    /// nb_l: nodes of level `level` (panics if `level >= num_levels()`).
    pub fn nodes(&self, level: usize) -> usize {
        assert!(
            level < self.levels,
            "level {level} out of {} levels",
            self.levels
        );
        self.counts[level]
    }
    /// nb_0: leaf blocks, `ceil(Nk / C)`.
    pub fn leaves(&self) -> usize {
        self.counts[0]
    }
    /// Offset, in nodes, of level `level` in one flat buffer holding all levels from 0 up.
    /// Panics when `level` is not one of the pyramid's.
    pub fn offset(&self, level: usize) -> usize {
        assert!(
            level < self.levels,
            "level {level} out of {} levels",
            self.levels
        );
        self.offsets[level]
    }
    /// Nodes over all levels (about `2 * nb_0` for g = 2).
    pub fn total_nodes(&self) -> usize {
        self.total
    }
    /// Flat index of node `j` of `level`. Panics when the level or `j` is out of range (a `j`
    /// past the level's nodes would name a node of the next level).
    pub fn flat(&self, level: usize, j: usize) -> usize {
        let o = self.offset(level);
        assert!(
            j < self.nodes(level),
            "node {j} of level {level}'s {}",
            self.nodes(level)
        );
        o + j
    }
    /// Parent (at `level + 1`) of node `j`: `floor(j / g)` (arithmetic only, as
    /// [`Self::ancestor`]).
    pub fn parent(&self, j: usize) -> usize {
        j / self.merge_factor
    }
    /// Children (at `level - 1`) of node `j` of `level >= 1`; the last node may have fewer than g.
    /// Panics when `level` is 0 (leaves have no children) or not one of the pyramid's, or `j`
    /// is past the level's nodes.
    pub fn children(&self, level: usize, j: usize) -> Range<usize> {
        assert!(level >= 1, "leaves have no children");
        assert!(
            j < self.nodes(level),
            "node {j} of level {level}'s {}",
            self.nodes(level)
        );
        let lo = j * self.merge_factor;
        lo..(lo + self.merge_factor).min(self.nodes(level - 1))
    }
    /// Leaves per node at `level`: `g^level` (saturating, for any `level`).
    pub fn leaves_per_node(&self, level: usize) -> usize {
        u32::try_from(level).map_or(usize::MAX, |l| self.merge_factor.saturating_pow(l))
    }
    /// Ancestor at `level` of leaf `leaf`: `floor(leaf / g^level)` (arithmetic only: neither
    /// `leaf` nor `level` is checked against the layout; a level past the top gives 0).
    pub fn ancestor(&self, leaf: usize, level: usize) -> usize {
        leaf / self.leaves_per_node(level)
    }
    /// Leaves covered by node `j` of `level`. Panics when the level or `j` is out of range (as
    /// [`Self::flat`]: a node past its level would claim leaves it does not cover).
    pub fn leaf_span(&self, level: usize, j: usize) -> Range<usize> {
        assert!(
            j < self.nodes(level),
            "node {j} of level {level}'s {}",
            self.nodes(level)
        );
        let w = self.leaves_per_node(level);
        j.saturating_mul(w).min(self.leaves())
            ..(j.saturating_add(1).saturating_mul(w)).min(self.leaves())
    }
    /// Tokens covered by node `j` of `level` (panics as [`Self::leaf_span`]).
    pub fn token_span(&self, level: usize, j: usize) -> Range<usize> {
        let l = self.leaf_span(level, j);
        // (saturating: the end of the last leaf of a key length near usize::MAX is past it)
        let at = |leaf: usize| leaf.saturating_mul(self.block_size).min(self.key_len);
        at(l.start)..at(l.end)
    }
    /// n: token count of node `j` of `level` (panics as [`Self::leaf_span`]).
    pub fn node_len(&self, level: usize, j: usize) -> usize {
        self.token_span(level, j).len()
    }
    /// Leaf block of token position `p`: `floor(p / C)`.
    pub fn block_of(&self, p: usize) -> usize {
        p / self.block_size
    }
    /// The ancestor path of `leaf`: `(level, node)` for every level from 0 (the leaf itself) to
    /// the top. A decode step that appends a key to `leaf` changes exactly these nodes. Panics
    /// when `leaf` is not one of the layout's leaves (its path would name nodes past their
    /// levels' ends, as [`Self::leaf_span`] refuses).
    pub fn ancestor_path(&self, leaf: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        assert!(
            leaf < self.leaves(),
            "leaf {leaf} of {} leaves",
            self.leaves()
        );
        (0..self.levels).map(move |l| (l, self.ancestor(leaf, l)))
    }
    /// Class of node `j` at `level` for a query whose own leaf is `own_block`; `None` means not
    /// causal, where every node is complete-past (PISA.md section 3). Arithmetic only, as
    /// [`Self::ancestor`]: a node past its level's end classes as the position it would have.
    pub fn classify(&self, level: usize, j: usize, own_block: Option<usize>) -> NodeClass {
        match own_block {
            None => NodeClass::CompletePast,
            Some(b) => {
                let a = self.ancestor(b, level);
                if j < a {
                    NodeClass::CompletePast
                } else if j == a {
                    NodeClass::Ancestor
                } else {
                    NodeClass::Future
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_layout_by_hand() {
        // 10 keys, C = 2 -> 5 leaves -> 3 -> 2 -> 1.
        let l = PyramidLayout::new(10, 2, 2).unwrap();
        assert_eq!(l.num_levels(), 4);
        assert_eq!(
            [l.nodes(0), l.nodes(1), l.nodes(2), l.nodes(3)],
            [5, 3, 2, 1]
        );
        assert_eq!(
            [l.offset(0), l.offset(1), l.offset(2), l.offset(3)],
            [0, 5, 8, 10]
        );
        assert_eq!(l.total_nodes(), 11);
        assert_eq!(l.children(1, 2), 4..5);
        assert_eq!(l.token_span(2, 1), 8..10);
        assert_eq!(l.node_len(1, 2), 2);
        assert_eq!(l.classify(1, 0, Some(3)), NodeClass::CompletePast);
        assert_eq!(l.classify(1, 1, Some(3)), NodeClass::Ancestor);
        assert_eq!(l.classify(1, 2, Some(3)), NodeClass::Future);
        assert_eq!(l.classify(1, 2, None), NodeClass::CompletePast);
        let path: [(usize, usize); 4] =
            core::array::from_fn(|i| l.ancestor_path(4).nth(i).unwrap());
        assert_eq!(path, [(0, 4), (1, 2), (2, 1), (3, 0)]);
    }

    #[test]
    fn single_block_has_one_level() {
        let l = PyramidLayout::new(5, 64, 2).unwrap();
        assert_eq!(l.num_levels(), 1);
        assert_eq!(l.node_len(0, 0), 5);
    }
}
