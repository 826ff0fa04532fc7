//! Shared test helpers: fresh printed seeds, random tensors, and an independent brute-force
//! PISA selection written straight from PISA.md section 3 (node statistics from raw tokens,
//! descent from the top level) so the reference is not only checked against itself.
#![allow(dead_code)]

use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A fresh seed per run (time-based, or `PISA_SEED` to replay), printed so a failure names it.
pub fn seeded(test: &str) -> (ChaCha8Rng, u64) {
    let seed = std::env::var("PISA_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_nanos() as u64 ^ (test.len() as u64).rotate_left(32)
        });
    eprintln!("{test}: seed {seed} (replay with PISA_SEED={seed})");
    (ChaCha8Rng::seed_from_u64(seed), seed)
}

/// `n` values uniform in `[-amp, amp)` (never all zero).
pub fn tensor(rng: &mut ChaCha8Rng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// Random Q, K, V for `shape`.
pub fn qkv(rng: &mut ChaCha8Rng, s: &AttentionShape, amp: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        tensor(rng, s.q_elems(), amp),
        tensor(rng, s.kv_elems(), amp),
        tensor(rng, s.kv_elems(), amp),
    )
}

/// Element `(b, h, n, d)` of a `[B, H, N, D]` tensor.
pub fn at(
    x: &[f32],
    l: TensorLayout,
    heads: usize,
    tokens: usize,
    dim: usize,
    bhnd: [usize; 4],
) -> f64 {
    x[l.index(heads, tokens, dim, bhnd[0], bhnd[1], bhnd[2], bhnd[3])] as f64
}

fn lse(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// Brute-force PISA selection of one row: `(ascending blocks, margin)`.
pub struct Naive<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub shape: AttentionShape,
    pub layout: TensorLayout,
    pub cfg: SelectionConfig,
}

impl Naive<'_> {
    fn key(&self, b: usize, h: usize, t: usize) -> Vec<f64> {
        let s = &self.shape;
        (0..s.head_dim)
            .map(|d| {
                at(
                    self.k,
                    self.layout,
                    s.kv_heads,
                    s.k_len,
                    s.head_dim,
                    [b, h, t, d],
                )
            })
            .collect()
    }
    fn query(&self, b: usize, hq: usize, i: usize) -> Vec<f64> {
        let s = &self.shape;
        (0..s.head_dim)
            .map(|d| {
                at(
                    self.q,
                    self.layout,
                    s.q_heads,
                    s.q_len,
                    s.head_dim,
                    [b, hq, i, d],
                )
            })
            .collect()
    }
    /// Leaves per node of `level`.
    fn width(&self, level: u32) -> usize {
        self.cfg.merge_factor.pow(level)
    }
    fn tokens(&self, level: u32, j: usize) -> std::ops::Range<usize> {
        let w = self.width(level) * self.cfg.block_size;
        (j * w).min(self.shape.k_len)..((j + 1) * w).min(self.shape.k_len)
    }
    fn count(&self, level: u32) -> usize {
        self.shape
            .k_len
            .div_ceil(self.width(level) * self.cfg.block_size)
    }
    /// Mean and population variance straight from the node's raw tokens.
    fn stats(&self, b: usize, h: usize, level: u32, j: usize) -> (Vec<f64>, Vec<f64>, f64) {
        let ts = self.tokens(level, j);
        let n = ts.len() as f64;
        let d = self.shape.head_dim;
        let keys: Vec<Vec<f64>> = ts.map(|t| self.key(b, h, t)).collect();
        let mu: Vec<f64> = (0..d)
            .map(|x| keys.iter().map(|k| k[x]).sum::<f64>() / n)
            .collect();
        let var = (0..d)
            .map(|x| keys.iter().map(|k| (k[x] - mu[x]).powi(2)).sum::<f64>() / n)
            .collect();
        (mu, var, n)
    }
    fn score(&self, b: usize, h: usize, i: usize, level: u32, j: usize) -> f64 {
        let s = self.cfg.softmax_scale(self.shape.head_dim) as f64;
        let g = self.shape.gqa_group();
        let dotp = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        (h * g..(h + 1) * g)
            .map(|hq| {
                let q = self.query(b, hq, i);
                if level == 0 {
                    return lse(self.tokens(0, j).map(|t| s * dotp(&q, &self.key(b, h, t))));
                }
                match self.cfg.scoring {
                    Scoring::Lse => {
                        let g = self.cfg.merge_factor;
                        let kids = (j * g..(j + 1) * g).filter(|&c| c < self.count(level - 1));
                        lse(kids.map(|c| {
                            let (mu, _, n) = self.stats(b, h, level - 1, c);
                            s * dotp(&q, &mu) + n.ln()
                        }))
                    }
                    sc => {
                        let (mu, var, n) = self.stats(b, h, level, j);
                        let mut x = s * dotp(&q, &mu) + n.ln();
                        if sc == Scoring::MeanVar {
                            x += 0.5
                                * s
                                * s
                                * q.iter().zip(&var).map(|(a, v)| a * a * v).sum::<f64>();
                        }
                        x
                    }
                }
            })
            .sum()
    }
    /// Keeps the best `keep` (higher score, then lower index); returns (kept, gap).
    fn cut(&self, mut v: Vec<(f64, usize)>, keep: usize) -> (Vec<usize>, f64) {
        v.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        let gap = if keep == 0 || keep >= v.len() {
            f64::INFINITY
        } else {
            v[keep - 1].0 - v[keep].0
        };
        (v.into_iter().take(keep).map(|x| x.1).collect(), gap)
    }

    /// The selection of row (b, h, i), descending from the single top node.
    pub fn select(&self, b: usize, h: usize, i: usize) -> (Vec<usize>, f64) {
        let (k, c, gm) = (self.cfg.top_k, self.cfg.block_size, self.cfg.merge_factor);
        let p = self.shape.query_position(i);
        let bq = p / c;
        let causal = self.cfg.causal;
        let nb0 = self.count(0);
        let visible = if causal { bq + 1 } else { nb0 };
        if visible <= k {
            return ((0..visible).collect(), f64::INFINITY);
        }
        let mut top = 0;
        while self.count(top) > 1 {
            top += 1;
        }
        // A node is complete-past when its last leaf is before bq (or not causal).
        let past = |level: u32, j: usize| !causal || (j + 1) * self.width(level) <= bq;
        let mut kept: Vec<usize> = if past(top, 0) { vec![0] } else { vec![] };
        let mut margin = f64::INFINITY;
        for level in (0..top).rev() {
            let upper_anc = bq / self.width(level + 1);
            let cands: Vec<usize> = (0..self.count(level))
                .filter(|&j| {
                    past(level, j) && (kept.contains(&(j / gm)) || (causal && j / gm == upper_anc))
                })
                .collect();
            if level == 0 {
                kept = cands;
                break;
            }
            if cands.len() > k {
                let (kk, gap) = self.cut(
                    cands
                        .iter()
                        .map(|&j| (self.score(b, h, i, level, j), j))
                        .collect(),
                    k,
                );
                margin = margin.min(gap);
                kept = kk;
            } else {
                kept = cands;
            }
        }
        if top == 0 {
            kept = (0..nb0).filter(|&j| past(0, j)).collect();
        }
        let mut forced = vec![];
        self.cfg.for_each_forced(bq, |j| forced.push(j));
        let cands: Vec<usize> = kept.into_iter().filter(|j| !forced.contains(j)).collect();
        let slots = k - forced.len();
        let (fill, gap) = if slots > 0 && cands.len() > slots {
            self.cut(
                cands
                    .iter()
                    .map(|&j| (self.score(b, h, i, 0, j), j))
                    .collect(),
                slots,
            )
        } else {
            (cands.into_iter().take(slots).collect(), f64::INFINITY)
        };
        forced.extend(fill);
        forced.sort();
        (forced, margin.min(gap))
    }
}

/// Row `r` of a selection as ascending `usize` blocks without padding.
pub fn blocks(row: &[i32]) -> Vec<usize> {
    row.iter()
        .filter(|&&j| j >= 0)
        .map(|&j| j as usize)
        .collect()
}
