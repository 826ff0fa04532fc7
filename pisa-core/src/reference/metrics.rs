//! Selection quality against the oracle (PISA.md section 3, "Quality"): Recall@K and mass
//! recall.

use alloc::vec;
use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::shape::AttentionShape;

use super::select::Selection;
use super::tensor::{check_block_indices, check_len, check_shape, checked_elems, SELECTION_INDEX};

/// Selection quality averaged over the rows that count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recall {
    /// Mean of `|selected ∩ oracle| / K` (in [0, 1]).
    pub recall_at_k: f64,
    /// Mean of the full-attention mass of the selected leaves (in [0, 1]).
    pub mass_recall: f64,
    /// Rows averaged: (sequence, KV head, query) whose query sees more than K leaves. When 0,
    /// both means are NaN.
    pub queries: usize,
}

/// Recall of `selection` against `oracle` ([`super::select_oracle`] with the same K), using
/// `mass` ([`super::block_mass`], `[B, Hkv, Nq, nb_0]`), averaged over every (sequence,
/// KV head, query) whose query sees more than K leaves (causal: `p / C + 1 > K`; else
/// `nb_0 > K`, per `cfg`). K is `selection.top_k`.
///
/// Never panics: buffers whose sizes do not match, or block indices past the leaves, give
/// `queries == 0` and NaN (use
/// [`try_recall`] for the error).
pub fn recall(
    selection: &Selection,
    oracle: &Selection,
    mass: &[f64],
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Recall {
    try_recall(selection, oracle, mass, shape, cfg).unwrap_or(Recall {
        recall_at_k: f64::NAN,
        mass_recall: f64::NAN,
        queries: 0,
    })
}

/// [`recall`] reporting size mismatches. Errors: [`PisaError::BufferLen`],
/// [`PisaError::InvalidValue`] when the two selections have different K or one holds a block
/// index below -1 or past the last leaf (-1 pads a row), the shape's and the
/// configuration's validation errors.
pub fn try_recall(
    selection: &Selection,
    oracle: &Selection,
    mass: &[f64],
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Result<Recall> {
    let per = try_recall_per_kv_head(selection, oracle, mass, shape, cfg)?;
    let queries: usize = per.iter().map(|r| r.queries).sum();
    let avg = |f: fn(&Recall) -> f64| {
        per.iter()
            .filter(|r| r.queries > 0)
            .map(|r| f(r) * r.queries as f64)
            .sum::<f64>()
            / queries as f64
    };
    Ok(Recall {
        recall_at_k: avg(|r| r.recall_at_k),
        mass_recall: avg(|r| r.mass_recall),
        queries,
    })
}

/// [`try_recall`] per KV head: `Hkv` entries, each averaged over batch and queries.
pub fn try_recall_per_kv_head(
    selection: &Selection,
    oracle: &Selection,
    mass: &[f64],
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Result<Vec<Recall>> {
    let k = selection.top_k;
    if oracle.top_k != k || k == 0 {
        return Err(PisaError::InvalidValue {
            what: "selection and oracle must have the same nonzero top_k",
        });
    }
    check_shape(shape, Some(cfg))?;
    let rows = shape.batch * shape.kv_heads * shape.q_len;
    let nb0 = shape.k_len.div_ceil(cfg.block_size);
    check_len(
        "selection",
        selection.indices.len(),
        checked_elems("selection", &[rows, k])?,
    )?;
    check_len(
        "oracle",
        oracle.indices.len(),
        checked_elems("oracle", &[rows, k])?,
    )?;
    check_len("mass", mass.len(), checked_elems("mass", &[rows, nb0])?)?;
    // (as `sparse_attention`: -1 pads a row; an index below it or past the last leaf is no
    // leaf, and was skipped without a word)
    check_block_indices(&selection.indices, nb0, SELECTION_INDEX)?;
    check_block_indices(
        &oracle.indices,
        nb0,
        "oracle holds a block index below -1 or past the last leaf",
    )?;
    let mut sums = vec![(0.0f64, 0.0f64, 0usize); shape.kv_heads];
    for r in 0..rows {
        let p = shape.query_position(r % shape.q_len);
        let vis = if cfg.causal {
            p / cfg.block_size + 1
        } else {
            nb0
        };
        if vis <= k {
            continue;
        }
        // Each distinct leaf once (|selected ∩ oracle top K|, PISA.md 3: a row listing a leaf
        // twice was credited twice).
        let (mut hit, mut m) = (0usize, 0.0);
        for j in distinct_leaves(selection.row(r)) {
            hit += oracle.row(r).contains(&j) as usize;
            m += mass[r * nb0 + j as usize];
        }
        let s = &mut sums[(r / shape.q_len) % shape.kv_heads];
        s.0 += hit as f64 / k as f64;
        s.1 += m;
        s.2 += 1;
    }
    Ok(sums
        .into_iter()
        .map(|(a, b, n)| Recall {
            recall_at_k: a / n as f64,
            mass_recall: b / n as f64,
            queries: n,
        })
        .collect())
}

/// [`recall`] per KV head (`Hkv` entries); never panics (mismatched sizes give an empty vector).
pub fn recall_per_kv_head(
    selection: &Selection,
    oracle: &Selection,
    mass: &[f64],
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Vec<Recall> {
    try_recall_per_kv_head(selection, oracle, mass, shape, cfg).unwrap_or_default()
}

/// The leaves of a selection row (its indices checked to be leaves or -1), each once, in row
/// order: the -1 padding and repeats left out.
fn distinct_leaves(row: &[i32]) -> impl Iterator<Item = i32> + '_ {
    (row.iter().enumerate())
        .filter(|&(i, &j)| j >= 0 && !row[..i].contains(&j))
        .map(|(_, &j)| j)
}

/// How much a selection's rows share, which bounds what kernels can reuse (PISA.md section 5:
/// query tiles and sibling leaves): over the rows that count (as in [`try_recall`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Locality {
    /// Fraction of selected leaves another of whose siblings (the leaves of the same level-1
    /// node, `j / g`) the row selected too (in [0, 1]). Leaf-major attention over sibling
    /// groups gathers a query's rows once per group rather than once per leaf.
    pub sibling_fraction: f64,
    /// Distinct leaves selected by `tile` consecutive counted rows of one (sequence, KV head),
    /// over their `tile * K` slots, averaged over such whole tiles (in (0, 1]): 1 when the
    /// tile's queries share no leaf, 1 / tile when they all select the same K leaves.
    pub tile_union: f64,
    /// The query tile the union was taken over.
    pub tile: usize,
    /// Selected leaves counted for `sibling_fraction`.
    pub leaves: usize,
    /// Whole tiles counted for `tile_union`.
    pub tiles: usize,
}

/// [`Locality`] of `selection` (`[B, Hkv, Nq, K]`, ascending leaves padded with -1) for query
/// tiles of `tile` rows. Rows whose query sees K or fewer leaves are skipped, and a tile is
/// `tile` consecutive counted rows of one (sequence, KV head). Means are NaN when nothing
/// counted; a leaf a row lists twice counts once. Errors: [`PisaError::BufferLen`] for a
/// selection of another size, [`PisaError::InvalidValue`] for `tile == 0` or K == 0 and for an
/// index below -1 or past the last leaf (as [`try_recall`]), the shape's and the
/// configuration's validation errors.
pub fn try_locality(
    selection: &Selection,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
    tile: usize,
) -> Result<Locality> {
    let k = selection.top_k;
    if tile == 0 || k == 0 {
        return Err(PisaError::InvalidValue {
            what: "locality needs a nonzero tile and top_k",
        });
    }
    check_shape(shape, Some(cfg))?;
    let rows = shape.batch * shape.kv_heads * shape.q_len;
    let nb0 = shape.k_len.div_ceil(cfg.block_size);
    check_len(
        "selection",
        selection.indices.len(),
        checked_elems("selection", &[rows, k])?,
    )?;
    // (-1 pads a row; an index below it or past the last leaf names no leaf: leaf nb0 - 1's
    // "sibling" nb0 was counted as selected, and i32::MIN put the union below 0)
    check_block_indices(&selection.indices, nb0, SELECTION_INDEX)?;
    let g = cfg.merge_factor.max(1);
    let (mut leaves, mut with_sibling) = (0usize, 0usize);
    let (mut tiles, mut union_sum) = (0usize, 0.0f64);
    // (A tile holds at most the rows there are: a tile past them reserves no more.)
    let mut members: Vec<i32> =
        Vec::with_capacity(checked_elems("locality tile", &[tile.min(rows), k])?);
    let mut in_tile = 0usize;
    for r in 0..rows {
        if r % shape.q_len == 0 {
            // A new (sequence, KV head): a tile never spans two.
            members.clear();
            in_tile = 0;
        }
        let p = shape.query_position(r % shape.q_len);
        let vis = if cfg.causal {
            p / cfg.block_size + 1
        } else {
            nb0
        };
        if vis <= k {
            continue;
        }
        let row = selection.row(r);
        // (a row listing a leaf twice counted it twice, and as its own sibling)
        for j in distinct_leaves(row) {
            leaves += 1;
            let parent = j as usize / g;
            let sibling = row
                .iter()
                .any(|&o| o >= 0 && o != j && o as usize / g == parent);
            with_sibling += sibling as usize;
            if !members.contains(&j) {
                members.push(j);
            }
        }
        in_tile += 1;
        if in_tile == tile {
            union_sum += members.len() as f64 / (tile * k) as f64;
            tiles += 1;
            members.clear();
            in_tile = 0;
        }
    }
    Ok(Locality {
        sibling_fraction: with_sibling as f64 / leaves as f64,
        tile_union: union_sum / tiles as f64,
        tile,
        leaves,
        tiles,
    })
}

#[cfg(test)]
mod locality_tests {
    use super::*;

    fn sel(rows: &[[i32; 4]]) -> Selection {
        Selection {
            top_k: 4,
            indices: rows.iter().flatten().copied().collect(),
            margin: Vec::new(),
            scored_nodes: Vec::new(),
        }
    }

    #[test]
    fn siblings_and_tile_unions_are_counted() {
        // 1 KV head, 8 queries at positions 24..32 of 32 keys, C 4: every query sees 7 or 8
        // leaves (> K = 4), so all count.
        let shape = AttentionShape::new(1, 1, 1, 8, 32, 8).unwrap();
        let cfg = SelectionConfig {
            block_size: 4,
            top_k: 4,
            ..Default::default()
        };
        let rows = [
            [0, 1, 4, 6], // 0,1 siblings; 4 and 6 not
            [0, 1, 4, 6],
            [2, 3, 4, 5], // all four have their sibling
            [2, 3, 4, 5],
            [0, 2, 4, 6], // none
            [1, 3, 5, 7], // none
            [0, 1, 2, 3],
            [4, 5, 6, 7],
        ];
        let l = try_locality(&sel(&rows), &shape, &cfg, 2).unwrap();
        assert_eq!(l.leaves, 32);
        // Siblings: 2 + 2 + 4 + 4 + 0 + 0 + 4 + 4 = 20 of 32.
        assert!((l.sibling_fraction - 20.0 / 32.0).abs() < 1e-12, "{l:?}");
        // Tiles of 2: {0,1,4,6}: 4/8; {2,3,4,5}: 4/8; {0,2,4,6,1,3,5,7}: 8/8; {0..8}: 8/8.
        assert_eq!(l.tiles, 4);
        assert!((l.tile_union - 0.75).abs() < 1e-12, "{l:?}");
        // A tile of 8: one tile, 8 distinct leaves of 32 slots.
        let l8 = try_locality(&sel(&rows), &shape, &cfg, 8).unwrap();
        assert_eq!(l8.tiles, 1);
        assert!((l8.tile_union - 0.25).abs() < 1e-12, "{l8:?}");
        // A tile longer than the counted rows: no whole tile, NaN.
        let l9 = try_locality(&sel(&rows), &shape, &cfg, 9).unwrap();
        assert!(l9.tiles == 0 && l9.tile_union.is_nan());
    }

    #[test]
    fn rows_that_see_k_or_fewer_leaves_and_bad_input() {
        // Queries at positions 0..8 of 8 keys, C 2, K 4: query p sees p / 2 + 1 <= 4 leaves,
        // so no row counts.
        let shape = AttentionShape::new(1, 1, 1, 8, 8, 8).unwrap();
        let cfg = SelectionConfig {
            block_size: 2,
            top_k: 4,
            ..Default::default()
        };
        let rows = [[0, 1, 2, 3]; 8];
        let l = try_locality(&sel(&rows), &shape, &cfg, 2).unwrap();
        assert_eq!((l.leaves, l.tiles), (0, 0));
        assert!(l.sibling_fraction.is_nan() && l.tile_union.is_nan());
        assert!(try_locality(&sel(&rows), &shape, &cfg, 0).is_err());
        assert!(try_locality(&sel(&rows[..7]), &shape, &cfg, 2).is_err());
    }

    /// An index below -1 or past the last leaf is refused, as try_recall refuses it (leaf 7's
    /// "sibling" 8 of 8 leaves counted as selected; i32::MIN put the union below 0); a leaf
    /// listed twice counts once, and not as its own sibling.
    #[test]
    fn bad_indices_are_refused_and_repeats_count_once() {
        let shape = AttentionShape::new(1, 1, 1, 8, 32, 8).unwrap();
        let cfg = SelectionConfig {
            block_size: 4,
            top_k: 4,
            ..Default::default()
        };
        for bad in [8, i32::MAX, -2, i32::MIN] {
            let rows = [[0, 2, 7, bad]; 8];
            let e = try_locality(&sel(&rows), &shape, &cfg, 2).unwrap_err();
            assert!(matches!(e, PisaError::InvalidValue { .. }), "{bad}: {e:?}");
        }
        let rows = [[0, 3, 3, -1]; 8];
        let l = try_locality(&sel(&rows), &shape, &cfg, 2).unwrap();
        assert_eq!(l.leaves, 16, "{l:?}");
        assert_eq!(l.sibling_fraction, 0.0, "{l:?}");
        // Each tile of 2 rows: 2 distinct leaves over 8 slots.
        assert!((l.tile_union - 0.25).abs() < 1e-12, "{l:?}");
    }
}
