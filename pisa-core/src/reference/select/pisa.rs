//! PISA's causal coarse-to-fine Top-K descent for one (sequence, KV head, query)
//! (PISA.md sections 2 and 3).

use alloc::vec::Vec;

use crate::config::{Scoring, SelectionConfig};
use crate::lse::log_add_exp;

use super::super::pyramid::Pyramid;
use super::super::tensor::{dot, dot_mean, View};
use super::cut;

/// Everything one row's selection reads.
pub(crate) struct QueryCtx<'a> {
    pub pyramid: &'a Pyramid,
    /// Raw keys `[B, Hkv, Nk, D]` (leaf scores).
    pub keys: &'a View<'a>,
    pub b: usize,
    pub kv_head: usize,
    /// The g_q query rows of the KV head's group.
    pub q_rows: &'a [&'a [f32]],
    pub scale: f64,
    pub cfg: &'a SelectionConfig,
    /// [`crate::Schedule::start_level`] of the pyramid's layout.
    pub start_level: Option<usize>,
}

impl QueryCtx<'_> {
    /// Score of intermediate node `j` of `level >= 1`, summed over the group (PISA.md 2).
    fn node_score(&self, level: usize, j: usize) -> f64 {
        let (p, s) = (self.pyramid, self.scale);
        let (b, h) = (self.b, self.kv_head);
        let layout = &p.layout;
        let mut total = 0.0;
        for q in self.q_rows {
            total += match self.cfg.scoring {
                Scoring::Lse => layout
                    .children(level, j)
                    .map(|c| {
                        let n = layout.node_len(level - 1, c) as f64;
                        s * dot_mean(q, p.mean(b, h, level - 1, c)) + libm::log(n)
                    })
                    .fold(f64::NEG_INFINITY, log_add_exp),
                Scoring::Mean | Scoring::MeanVar => {
                    let n = layout.node_len(level, j) as f64;
                    let mut x = s * dot_mean(q, p.mean(b, h, level, j)) + libm::log(n);
                    if self.cfg.scoring == Scoring::MeanVar {
                        let v = p.var(b, h, level, j);
                        let qv: f64 = q
                            .iter()
                            .zip(v)
                            .map(|(&a, &v)| a as f64 * a as f64 * v)
                            .sum();
                        x += 0.5 * s * s * qv;
                    }
                    x
                }
            };
        }
        total
    }

    /// Exact LSE of leaf `j` over its raw keys, summed over the group (PISA.md 2).
    fn leaf_score(&self, j: usize) -> f64 {
        let span = self.pyramid.layout.token_span(0, j);
        let mut total = 0.0;
        for q in self.q_rows {
            total += span
                .clone()
                .map(|t| self.scale * dot(q, self.keys.row(self.b, self.kv_head, t)))
                .fold(f64::NEG_INFINITY, log_add_exp);
        }
        total
    }
}

/// Selects the leaves of the query at absolute position `p` (PISA.md 3): returns the blocks
/// (ascending, at most K), the margin and the number of scored candidates.
pub(crate) fn select_one(ctx: &QueryCtx<'_>, p: usize) -> (Vec<usize>, f64, u32) {
    let cfg = ctx.cfg;
    let layout = &ctx.pyramid.layout;
    let k = cfg.top_k;
    let b_q = layout.block_of(p);
    let own = cfg.causal.then_some(b_q);
    let visible = if cfg.causal { b_q + 1 } else { layout.leaves() };
    let start = match ctx.start_level {
        Some(s) if visible > k => s,
        _ => return ((0..visible).collect(), f64::INFINITY, 0),
    };
    let mut margin = f64::INFINITY;
    let mut scored = 0u32;
    // Complete-past candidates of the start level; the ancestor is implicit.
    let mut cands: Vec<usize> = match own {
        Some(b) => (0..layout.ancestor(b, start)).collect(),
        None => (0..layout.nodes(start)).collect(),
    };
    for level in (1..=start).rev() {
        if cands.len() > k {
            scored += cands.len() as u32;
            let s = cands
                .iter()
                .map(|&j| (ctx.node_score(level, j), j))
                .collect();
            let (kept, gap) = cut(s, k);
            margin = margin.min(gap);
            cands = kept;
        }
        let mut next: Vec<usize> = cands
            .iter()
            .flat_map(|&j| layout.children(level, j))
            .collect();
        if let Some(b) = own {
            let below = layout.ancestor(b, level - 1);
            next.extend(
                layout
                    .children(level, layout.ancestor(b, level))
                    .filter(|&c| c < below),
            );
        }
        cands = next;
    }
    let mut out = Vec::with_capacity(k);
    cfg.for_each_forced(b_q, |j| out.push(j));
    cands.retain(|&j| !cfg.is_forced(b_q, j));
    let slots = k - out.len();
    if cands.len() > slots && slots > 0 {
        scored += cands.len() as u32;
        let s = cands.iter().map(|&j| (ctx.leaf_score(j), j)).collect();
        let (kept, gap) = cut(s, slots);
        margin = margin.min(gap);
        cands = kept;
    } else {
        cands.truncate(slots);
    }
    out.extend(cands);
    out.sort_unstable();
    (out, margin, scored)
}
