//! Oracle and recall (PISA.md section 3, "Quality"): block mass, the oracle's top K, Recall@K
//! and mass recall bounds, per-KV-head recall, and a planted needle every method must find.
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

mod common;

use common::{blocks, qkv, seeded};
use pisa_core::reference::{
    block_mass, recall, recall_per_kv_head, select_bsa, select_oracle_from_mass, select_pisa,
    try_recall,
};
use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};
use rand::Rng;

#[test]
fn mass_oracle_and_recall_bounds() {
    let (mut rng, _) = seeded("mass_oracle_and_recall_bounds");
    for case in 0..6 {
        let causal = case % 3 != 2;
        let (c, k) = (rng.random_range(2..6), rng.random_range(2..6));
        let cfg = SelectionConfig::new(c, k)
            .unwrap()
            .with_causal(causal)
            .with_forced(case % 2, 0);
        let s = AttentionShape::new(1, 4, 2, 60, 80, 6).unwrap();
        let l = TensorLayout::Bnhd;
        let (q, kk, _) = qkv(&mut rng, &s, 2.0);
        let nb0 = 80usize.div_ceil(c);
        let mass = block_mass(&q, &kk, &s, l, &cfg).unwrap();
        let oracle = select_oracle_from_mass(&mass, &s, &cfg).unwrap();
        for r in 0..s.kv_heads * s.q_len {
            let row = &mass[r * nb0..(r + 1) * nb0];
            assert!(
                (row.iter().sum::<f64>() - 1.0).abs() < 1e-12,
                "row {r} mass does not sum to 1"
            );
            let bq = s.query_position(r % s.q_len) / c;
            if causal {
                assert!(
                    row[bq + 1..].iter().all(|&m| m == 0.0),
                    "row {r}: mass in the future"
                );
            }
            // The oracle's blocks carry at least as much mass as any block it left out.
            let got = blocks(oracle.row(r));
            let worst = got.iter().map(|&j| row[j]).fold(f64::INFINITY, f64::min);
            let visible = if causal { bq + 1 } else { nb0 };
            assert_eq!(got.len(), k.min(visible));
            assert!((0..visible)
                .filter(|j| !got.contains(j))
                .all(|j| row[j] <= worst));
        }
        let me = recall(&oracle, &oracle, &mass, &s, &cfg);
        assert_eq!(me.recall_at_k, 1.0);
        for sel in [
            select_pisa(&q, &kk, &s, l, &cfg).unwrap(),
            select_bsa(&q, &kk, &s, l, &cfg).unwrap(),
        ] {
            let r = recall(&sel, &oracle, &mass, &s, &cfg);
            assert_eq!(r.queries, me.queries);
            assert!((0.0..=1.0).contains(&r.recall_at_k));
            assert!(
                r.mass_recall <= me.mass_recall + 1e-12,
                "{r:?} beats the oracle {me:?}"
            );
            let per = recall_per_kv_head(&sel, &oracle, &mass, &s, &cfg);
            assert_eq!(per.len(), 2);
            let n: usize = per.iter().map(|p| p.queries).sum();
            let avg = per
                .iter()
                .map(|p| p.recall_at_k * p.queries as f64)
                .sum::<f64>()
                / n as f64;
            assert!((avg - r.recall_at_k).abs() < 1e-12);
        }
        // Mismatched sizes: an error from try_recall, NaN (no panic) from recall.
        assert!(try_recall(&oracle, &oracle, &mass[1..], &s, &cfg).is_err());
        let bad = recall(&oracle, &oracle, &mass[1..], &s, &cfg);
        assert!(bad.recall_at_k.is_nan() && bad.queries == 0);
    }
}

#[test]
fn every_method_finds_a_planted_needle() {
    // Small noise keys and one needle key aligned with the query, far in the past: its leaf
    // dominates every score level (lse, mean, meanvar), the BSA mean, and the oracle.
    let (mut rng, _) = seeded("every_method_finds_a_planted_needle");
    let (n, d, c) = (2048, 8, 8);
    let s = AttentionShape::new(1, 2, 1, 1, n, d).unwrap();
    let l = TensorLayout::Bhnd;
    let mut k: Vec<f32> = (0..n * d).map(|_| rng.random_range(-0.05..0.05)).collect();
    let q: Vec<f32> = (0..2 * d)
        .map(|x| {
            if x % d == 0 {
                1.0
            } else {
                rng.random_range(-0.05..0.05)
            }
        })
        .collect();
    let needle = rng.random_range(0..n - 4 * c);
    k[needle * d] = 400.0;
    for scoring in [Scoring::Lse, Scoring::Mean, Scoring::MeanVar] {
        let cfg = SelectionConfig::new(c, 4)
            .unwrap()
            .with_scoring(scoring)
            .with_forced(1, 1);
        let sel = select_pisa(&q, &k, &s, l, &cfg).unwrap();
        assert!(
            blocks(sel.row(0)).contains(&(needle / c)),
            "{scoring:?} missed the needle at {needle}"
        );
        let bsa = select_bsa(&q, &k, &s, l, &cfg).unwrap();
        assert!(blocks(bsa.row(0)).contains(&(needle / c)));
        let mass = block_mass(&q, &k, &s, l, &cfg).unwrap();
        let oracle = select_oracle_from_mass(&mass, &s, &cfg).unwrap();
        assert!(blocks(oracle.row(0)).contains(&(needle / c)));
    }
}
