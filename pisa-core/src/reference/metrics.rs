//! Selection quality against the oracle (PISA.md section 3, "Quality"): Recall@K and mass
//! recall.

use alloc::vec;
use alloc::vec::Vec;

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::shape::AttentionShape;

use super::select::Selection;
use super::tensor::{check_len, check_shape};

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
/// Never panics: buffers whose sizes do not match give `queries == 0` and NaN (use
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
/// [`PisaError::InvalidValue`] when the two selections have different K, the shape's and the
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
    check_len("selection", selection.indices.len(), rows * k)?;
    check_len("oracle", oracle.indices.len(), rows * k)?;
    check_len("mass", mass.len(), rows * nb0)?;
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
        let sel = selection
            .row(r)
            .iter()
            .filter(|&&j| j >= 0 && (j as usize) < nb0);
        let (mut hit, mut m) = (0usize, 0.0);
        for &j in sel {
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
