//! PISA selection against the brute-force selector of `common` over all three scorings, GQA
//! groups 1-3, g = 2 and 3, sink/local blocks, causal and not, both layouts (PISA.md 2, 3);
//! selection invariants; the O(log N) scored-node bound; input validation.
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

mod common;

use common::{blocks, qkv, seeded, tensor, Naive};
use pisa_core::reference::{build_pyramid, select_bsa, select_pisa, select_pisa_with};
use pisa_core::{
    AttentionShape, PisaError, PyramidLayout, Schedule, Scoring, SelectionConfig, TensorLayout,
};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

/// Differences from the brute force are accepted only where the reference's margin says the
/// two are within rounding of a tie.
const TIE: f64 = 1e-9;

fn config() -> impl Strategy<Value = SelectionConfig> {
    (
        1usize..5,
        1usize..7,
        2usize..4,
        0usize..3,
        0usize..3,
        0usize..3,
        any::<bool>(),
    )
        .prop_map(|(c, k, g, sc, sink, local, causal)| {
            let scoring = [Scoring::Lse, Scoring::Mean, Scoring::MeanVar][sc];
            let sink = sink.min(k - 1);
            let local = local.min(k - 1 - sink);
            SelectionConfig::new(c, k)
                .unwrap()
                .with_merge_factor(g)
                .with_scoring(scoring)
                .with_forced(sink, local)
                .with_causal(causal)
        })
}

/// Compares every row of a random case with the brute force and checks the invariants.
#[allow(clippy::too_many_arguments)]
fn check_case(
    cfg: SelectionConfig,
    gq: usize,
    hkv: usize,
    nk: usize,
    nq: usize,
    d: usize,
    layout: TensorLayout,
    seed: u64,
) -> Result<(), String> {
    let shape = AttentionShape::new(1, gq * hkv, hkv, nq, nk, d).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let q = tensor(&mut rng, shape.q_elems(), 2.0);
    let k = tensor(&mut rng, shape.kv_elems(), 2.0);
    let sel = select_pisa(&q, &k, &shape, layout, &cfg).unwrap();
    let naive = Naive {
        q: &q,
        k: &k,
        shape,
        layout,
        cfg,
    };
    let pl = PyramidLayout::new(nk, cfg.block_size, cfg.merge_factor).unwrap();
    let bound = Schedule::new(&pl, &cfg).unwrap().max_scored_nodes();
    let ctx = format!(
        "seed {seed}, cfg {cfg:?}, g_q {gq}, Hkv {hkv}, Nk {nk}, Nq {nq}, D {d}, {layout:?}"
    );
    for h in 0..hkv {
        for i in 0..nq {
            let r = h * nq + i;
            let got = blocks(sel.row(r));
            let bq = shape.query_position(i) / cfg.block_size;
            let visible = if cfg.causal { bq + 1 } else { pl.leaves() };
            // Invariants: ascending, unique, visible, forced included, min(K, visible) long.
            let mut forced_in = true;
            cfg.for_each_forced(bq, |f| {
                forced_in &= visible <= cfg.top_k || got.contains(&f)
            });
            if !got.windows(2).all(|w| w[0] < w[1])
                || !got.iter().all(|&j| j < visible)
                || got.len() != cfg.top_k.min(visible)
                || !forced_in
            {
                return Err(format!("{ctx}: row {r} breaks an invariant: {got:?}"));
            }
            if sel.scored_nodes[r] as usize > bound {
                return Err(format!(
                    "{ctx}: row {r} scored {} > bound {bound}",
                    sel.scored_nodes[r]
                ));
            }
            let (want, _) = naive.select(0, h, i);
            if got != want && sel.margin[r] >= TIE {
                return Err(format!(
                    "{ctx}: row {r}: reference {got:?} vs brute force {want:?}, margin {}",
                    sel.margin[r]
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn matches_brute_force(
        cfg in config(), gq in 1usize..4, hkv in 1usize..3, nk in 1usize..160, nq_frac in 0.0f64..1.0,
        d in 1usize..5, bnhd in any::<bool>(), seed in any::<u64>(),
    ) {
        let nq = ((nk as f64 * nq_frac) as usize).clamp(1, 12);
        let layout = if bnhd { TensorLayout::Bnhd } else { TensorLayout::Bhnd };
        if let Err(e) = check_case(cfg, gq, hkv, nk, nq, d, layout, seed) {
            prop_assert!(false, "{}", e);
        }
    }
}

#[test]
fn brute_force_sweep_of_every_combination() {
    // Every scoring x GQA group 1, 2, 3 x g = 2, 3 x causal or not x with or without sink and
    // local blocks, on random lengths and block sizes.
    let (mut rng, _) = seeded("brute_force_sweep_of_every_combination");
    for scoring in [Scoring::Lse, Scoring::Mean, Scoring::MeanVar] {
        for gq in 1..=3 {
            for g in [2, 3] {
                for causal in [true, false] {
                    for (sink, local) in [(0, 0), (1, 2)] {
                        let cfg =
                            SelectionConfig::new(rng.random_range(1..5), rng.random_range(4..7))
                                .unwrap()
                                .with_scoring(scoring)
                                .with_merge_factor(g)
                                .with_causal(causal)
                                .with_forced(sink, local);
                        let nk = rng.random_range(40..200);
                        let nq = rng.random_range(1..10);
                        check_case(cfg, gq, 2, nk, nq, 3, TensorLayout::Bhnd, rng.random())
                            .unwrap();
                    }
                }
            }
        }
    }
}

#[test]
fn duplicated_query_heads_select_like_one_head() {
    // The GQA score is a SUM over the group: g_q identical heads score g_q times one head,
    // which ranks the same.
    let (mut rng, _) = seeded("duplicated_query_heads_select_like_one_head");
    let cfg = SelectionConfig::new(4, 4).unwrap().with_forced(1, 1);
    let (n, d) = (300, 8);
    let one = AttentionShape::prefill(1, 1, 1, n, d).unwrap();
    let (q, k, _) = qkv(&mut rng, &one, 1.5);
    let three = AttentionShape::prefill(1, 3, 1, n, d).unwrap();
    let q3: Vec<f32> = [q.clone(), q.clone(), q.clone()].concat(); // Bhnd: heads outermost
    for scoring in [Scoring::Lse, Scoring::Mean, Scoring::MeanVar] {
        let cfg = cfg.with_scoring(scoring);
        let a = select_pisa(&q, &k, &one, TensorLayout::Bhnd, &cfg).unwrap();
        let b = select_pisa(&q3, &k, &three, TensorLayout::Bhnd, &cfg).unwrap();
        for r in 0..n {
            if a.row(r) != b.row(r) {
                assert!(
                    a.margin[r] < 1e-12,
                    "{scoring:?} row {r}: {:?} vs {:?}",
                    a.row(r),
                    b.row(r)
                );
            }
        }
    }
}

/// Node scorings per query at `n` keys (D = 4, one head, the last 4 queries), with its bound.
fn scored_at(n: usize, rng: &mut rand_chacha::ChaCha8Rng) -> (u32, usize) {
    let cfg = SelectionConfig::new(16, 8).unwrap();
    let shape = AttentionShape::new(1, 1, 1, 4, n, 4).unwrap();
    let q = tensor(rng, shape.q_elems(), 1.0);
    let k = tensor(rng, shape.kv_elems(), 1.0);
    let sel = select_pisa(&q, &k, &shape, TensorLayout::Bhnd, &cfg).unwrap();
    let pl = PyramidLayout::new(n, 16, 2).unwrap();
    let bound = Schedule::new(&pl, &cfg).unwrap().max_scored_nodes();
    (*sel.scored_nodes.iter().max().unwrap(), bound)
}

#[test]
fn scored_nodes_grow_logarithmically() {
    let (mut rng, _) = seeded("scored_nodes_grow_logarithmically");
    let sizes = [1 << 10, 1 << 14, 1 << 18];
    let counts: Vec<(u32, usize)> = sizes.iter().map(|&n| scored_at(n, &mut rng)).collect();
    eprintln!("scored nodes (max over queries, bound) at {sizes:?} keys: {counts:?}");
    for &(c, bound) in &counts {
        assert!(c as usize <= bound, "{c} > bound {bound}");
    }
    // Each 16x more keys adds 4 levels: at most 4 * g * (K + 1) = 144 more scorings, and the
    // two increments are about equal (linear growth would multiply by 16).
    let d1 = counts[1].0 as i64 - counts[0].0 as i64;
    let d2 = counts[2].0 as i64 - counts[1].0 as i64;
    assert!(
        (0..=144).contains(&d1) && (0..=144).contains(&d2),
        "increments {d1}, {d2}"
    );
    assert!(
        (d2 - d1).abs() <= 36,
        "increments {d1}, {d2} are not logarithmic growth"
    );
}

#[test]
fn bsa_keeps_forced_and_fills_by_mean_score() {
    let (mut rng, _) = seeded("bsa_keeps_forced_and_fills_by_mean_score");
    let cfg = SelectionConfig::new(3, 5).unwrap().with_forced(1, 1);
    let shape = AttentionShape::prefill(2, 4, 2, 90, 4).unwrap();
    let (q, k, _) = qkv(&mut rng, &shape, 1.0);
    let sel = select_bsa(&q, &k, &shape, TensorLayout::Bnhd, &cfg).unwrap();
    let pyr = build_pyramid(&k, &shape, TensorLayout::Bnhd, &cfg).unwrap();
    let s = cfg.softmax_scale(4) as f64;
    for r in 0..sel.rows() {
        let (i, h, b) = (r % 90, (r / 90) % 2, r / 180);
        let bq = i / 3;
        let got = blocks(sel.row(r));
        assert_eq!(got.len(), 5.min(bq + 1));
        if bq < 5 {
            continue;
        }
        assert!(got.contains(&0) && got.contains(&(bq - 1)) && got.contains(&bq));
        // Every dropped complete-past leaf scores no better than every kept non-forced one.
        let score = |j: usize| -> f64 {
            (2 * h..2 * h + 2)
                .map(|hq| {
                    let mu = pyr.mean(b, h, 0, j);
                    (0..4)
                        .map(|x| {
                            s * q[pisa_core::TensorLayout::Bnhd.index(4, 90, 4, b, hq, i, x)] as f64
                                * mu[x]
                        })
                        .sum::<f64>()
                })
                .sum()
        };
        let kept: Vec<usize> = got
            .iter()
            .copied()
            .filter(|&j| !cfg.is_forced(bq, j))
            .collect();
        let worst = kept.iter().map(|&j| score(j)).fold(f64::INFINITY, f64::min);
        for j in (0..bq).filter(|j| !got.contains(j)) {
            assert!(
                score(j) <= worst + 1e-12,
                "row {r}: dropped {j} beats a kept leaf"
            );
        }
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let cfg = SelectionConfig::new(4, 2).unwrap();
    let shape = AttentionShape::prefill(1, 2, 1, 16, 4).unwrap();
    let q = vec![0.5f32; shape.q_elems()];
    let k = vec![0.25f32; shape.kv_elems()];
    let l = TensorLayout::Bhnd;
    let short = &k[..k.len() - 1];
    assert!(matches!(
        select_pisa(&q, short, &shape, l, &cfg),
        Err(PisaError::BufferLen { what: "k", .. })
    ));
    assert!(matches!(
        select_pisa(&q[1..], &k, &shape, l, &cfg),
        Err(PisaError::BufferLen { what: "q", .. })
    ));
    assert!(select_bsa(&q, short, &shape, l, &cfg).is_err());
    let bad_cfg = cfg.with_forced(3, 0);
    assert!(matches!(
        select_pisa(&q, &k, &shape, l, &bad_cfg),
        Err(PisaError::TopKBelowForced { .. })
    ));
    let other = AttentionShape::prefill(1, 2, 1, 12, 4).unwrap();
    let pyr = build_pyramid(&k[..other.kv_elems()], &other, l, &cfg).unwrap();
    assert!(matches!(
        select_pisa_with(&pyr, &q, &k, &shape, l, &cfg),
        Err(PisaError::InvalidValue { .. })
    ));
    // Shapes built field by field are re-validated, never divided by.
    for bad in [
        AttentionShape {
            kv_heads: 0,
            ..shape
        },
        AttentionShape {
            q_heads: 3,
            kv_heads: 2,
            ..shape
        },
        AttentionShape { q_len: 17, ..shape },
    ] {
        assert!(select_pisa(&q, &k, &bad, l, &cfg).is_err(), "{bad:?}");
        assert!(select_bsa(&q, &k, &bad, l, &cfg).is_err(), "{bad:?}");
        assert!(build_pyramid(&k, &bad, l, &cfg).is_err(), "{bad:?}");
        let v = &k;
        assert!(pisa_core::reference::dense_attention(&q, &k, v, &bad, l, true, 0.5).is_err());
        assert!(pisa_core::reference::block_mass(&q, &k, &bad, l, &cfg).is_err());
    }
}
