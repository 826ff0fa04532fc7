//! Decode against prefill (PISA.md sections 1 and 3): the selection and output of each decode
//! step equal prefill's at the same position; `append` changes only the new key's ancestor
//! path and leaves the pyramid equal to a full rebuild; causality of prefill.
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

mod common;

use common::{seeded, tensor};
use pisa_core::reference::{build_pyramid, select_pisa, sparse_attention, DecodeState, Pyramid};
use pisa_core::{AttentionShape, PisaError, Scoring, SelectionConfig, TensorLayout};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

fn config(c: usize, k: usize, g: usize, sc: usize, sink: usize, local: usize) -> SelectionConfig {
    let sink = sink.min(k - 1);
    SelectionConfig::new(c, k)
        .unwrap()
        .with_merge_factor(g)
        .with_scoring([Scoring::Lse, Scoring::Mean, Scoring::MeanVar][sc])
        .with_forced(sink, local.min(k - 1 - sink))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn prefill_equals_decode_at_every_position(
        n in 1usize..600, c in 1usize..17, k in 1usize..9, g in 2usize..4, sc in 0usize..3,
        sink in 0usize..2, local in 0usize..2, hkv in 1usize..3, gq in 1usize..3, d in 1usize..4,
        seed in any::<u64>(),
    ) {
        let cfg = config(c, k, g, sc, sink, local);
        let hq = gq * hkv;
        let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (q, kk, v) = common::qkv(&mut rng, &shape, 2.0);
        let l = TensorLayout::Bnhd; // token-major: token t's rows are contiguous
        let sel = select_pisa(&q, &kk, &shape, l, &cfg).unwrap();
        let (o, lse) = sparse_attention(&q, &kk, &v, &shape, l, &cfg, &sel.indices).unwrap();
        let mut st = DecodeState::new(hq, hkv, d, cfg).unwrap();
        let (kr, qr) = (hkv * d, hq * d);
        for t in 0..n {
            st.append(&kk[t * kr..(t + 1) * kr], &v[t * kr..(t + 1) * kr]).unwrap();
            let step = st.step_detailed(&q[t * qr..(t + 1) * qr]).unwrap();
            for h in 0..hkv {
                let r = h * n + t;
                prop_assert_eq!(&step.selection[h * k..(h + 1) * k], sel.row(r), "position {} kv head {}", t, h);
                prop_assert_eq!(step.scored_nodes[h], sel.scored_nodes[r]);
            }
            for x in 0..hq {
                prop_assert!((step.lse[x] - lse[x * n + t]).abs() <= 1e-12);
                for y in 0..d {
                    prop_assert!((step.out[x * d + y] - o[l.index(hq, n, d, 0, x, t, y)]).abs() <= 1e-12);
                }
            }
        }
    }

    #[test]
    fn later_keys_change_nothing_at_or_before_p(
        nk in 2usize..300, nq_frac in 0.0f64..1.0, c in 1usize..9, k in 1usize..6, g in 2usize..4,
        sc in 0usize..3, sink in 0usize..2, local in 0usize..2, gq in 1usize..3, seed in any::<u64>(),
    ) {
        let cfg = config(c, k, g, sc, sink, local);
        let nq = ((nk as f64 * nq_frac) as usize).max(1);
        let shape = AttentionShape::new(1, 2 * gq, 2, nq, nk, 3).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (q, kk, v) = common::qkv(&mut rng, &shape, 2.0);
        let p = rng.random_range(nk - nq..nk);
        let (mut k2, mut v2) = (kk.clone(), v.clone());
        let l = TensorLayout::Bhnd;
        for h in 0..2 {
            for t in p + 1..nk {
                for x in 0..3 {
                    k2[l.index(2, nk, 3, 0, h, t, x)] = rng.random_range(-4.0..4.0);
                    v2[l.index(2, nk, 3, 0, h, t, x)] = rng.random_range(-4.0..4.0);
                }
            }
        }
        let a = select_pisa(&q, &kk, &shape, l, &cfg).unwrap();
        let b = select_pisa(&q, &k2, &shape, l, &cfg).unwrap();
        let (oa, la) = sparse_attention(&q, &kk, &v, &shape, l, &cfg, &a.indices).unwrap();
        let (ob, lb) = sparse_attention(&q, &k2, &v2, &shape, l, &cfg, &b.indices).unwrap();
        for i in 0..=(p - (nk - nq)) {
            for h in 0..2 {
                prop_assert_eq!(a.row(h * nq + i), b.row(h * nq + i), "query {} kv head {}", i, h);
            }
            for hq in 0..2 * gq {
                prop_assert_eq!(la[hq * nq + i], lb[hq * nq + i]);
                let o = l.index(2 * gq, nq, 3, 0, hq, i, 0);
                prop_assert_eq!(&oa[o..o + 3], &ob[o..o + 3]);
            }
        }
    }
}

/// Nodes not on `path` are bit-identical between the pyramid before and after an append.
fn untouched_outside_path(before: &Pyramid, after: &Pyramid, path: &[(usize, usize)]) {
    for h in 0..before.kv_heads {
        for level in 0..before.layout.num_levels() {
            for j in 0..before.layout.nodes(level) {
                if !path.contains(&(level, j)) {
                    assert_eq!(before.mean(0, h, level, j), after.mean(0, h, level, j));
                    assert_eq!(before.var(0, h, level, j), after.var(0, h, level, j));
                }
            }
        }
    }
}

#[test]
fn append_updates_only_the_ancestor_path_and_matches_a_rebuild() {
    let (mut rng, _) = seeded("append_updates_only_the_ancestor_path_and_matches_a_rebuild");
    for (c, g) in [(3, 2), (2, 3), (1, 2)] {
        let cfg = SelectionConfig::new(c, 4).unwrap().with_merge_factor(g);
        let (hkv, d) = (2, 3);
        let mut st = DecodeState::new(4, hkv, d, cfg).unwrap();
        for t in 0..300 {
            let before = st.pyramid().clone();
            let kr = tensor(&mut rng, hkv * d, 1.5);
            st.append(&kr, &tensor(&mut rng, hkv * d, 1.0)).unwrap();
            let after = st.pyramid();
            let path: Vec<(usize, usize)> = after.layout.ancestor_path(t / c).collect();
            if t > 0 {
                untouched_outside_path(&before, after, &path);
            }
            let shape = AttentionShape::new(1, hkv, hkv, 1, t + 1, d).unwrap();
            let full = build_pyramid(st.keys(), &shape, TensorLayout::Bnhd, &cfg).unwrap();
            assert_eq!(
                after,
                &full,
                "C {c} g {g}: incremental pyramid differs from a rebuild after {} keys",
                t + 1
            );
        }
    }
}

#[test]
fn decode_rejects_bad_rows() {
    let cfg = SelectionConfig::new(4, 2).unwrap();
    assert!(matches!(
        DecodeState::new(3, 2, 4, cfg),
        Err(PisaError::GqaNotDivisible { .. })
    ));
    assert!(DecodeState::new(2, 1, 0, cfg).is_err());
    let mut st = DecodeState::new(2, 1, 4, cfg).unwrap();
    assert!(st.is_empty());
    assert!(matches!(st.step(&[1.0; 8]), Err(PisaError::Zero { .. })));
    assert!(matches!(
        st.append(&[1.0; 3], &[1.0; 4]),
        Err(PisaError::BufferLen { .. })
    ));
    assert!(st.append(&[1.0; 4], &[1.0; 5]).is_err());
    assert_eq!(st.len(), 0);
    st.append(&[0.5; 4], &[0.25; 4]).unwrap();
    assert!(matches!(
        st.step(&[1.0; 4]),
        Err(PisaError::BufferLen { .. })
    ));
    let (sel, out, lse) = st.step(&[1.0; 8]).unwrap();
    assert_eq!(sel, [0, -1]);
    assert_eq!(out, [0.25; 8]);
    assert!((lse[0] - 1.0).abs() < 1e-12); // one key: s * q.k = 0.5 * (4 * 0.5) = 1
}
