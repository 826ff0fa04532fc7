//! Hand-worked selections (PISA.md sections 2 and 3) with 1-D keys and queries (D = 1), softmax
//! scale 1 and q = 1 unless stated, so every score is worked out in the comments. Each leaf's
//! keys are written `leaf j = [k, k]` (C = 2) or one key per leaf (C = 1).
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

use pisa_core::reference::{block_mass, recall, select_bsa, select_oracle, select_pisa, Selection};
use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};

const LN2: f64 = core::f64::consts::LN_2;

fn cfg(c: usize, k: usize) -> SelectionConfig {
    SelectionConfig::new(c, k).unwrap().with_scale(Some(1.0))
}

/// One KV head, `qs.len() / nq` query heads, D = 1, layout Bhnd.
fn shape(keys: &[f32], qs: &[f32], nq: usize) -> AttentionShape {
    AttentionShape::new(1, qs.len() / nq, 1, nq, keys.len(), 1).unwrap()
}

fn pisa(keys: &[f32], qs: &[f32], nq: usize, c: &SelectionConfig) -> Selection {
    select_pisa(qs, keys, &shape(keys, qs, nq), TensorLayout::Bhnd, c).unwrap()
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-9, "{a} != {b}");
}

// Case A: C = 2, K = 2, g = 2, 8 tokens: leaf0 = [0, 0], leaf1 = [3, -3], leaf2 = [1, 1],
// leaf3 = [0.5, 0.5]. Pyramid 4 -> 2 -> 1 leaves; the start level is 0 (nb_1 = 2 is not > K).
const CASE_A: [f32; 8] = [0.0, 0.0, 3.0, -3.0, 1.0, 1.0, 0.5, 0.5];

#[test]
fn case_a_exact_leaf_lse_beats_mean_pooling() {
    // Query at p = 7 (b_q = 3): forced {3}, one slot, candidates 0, 1, 2 with exact LSE
    // leaf0 = ln 2 = 0.693, leaf1 = ln(e^3 + e^-3) = 3.0025, leaf2 = 1 + ln 2 = 1.693
    // -> [1, 3], margin 3.0025 - 1.693.
    let s = pisa(&CASE_A, &[1.0], 1, &cfg(2, 2));
    assert_eq!(s.indices, [1, 3]);
    close(s.margin[0], (3f64.exp() + (-3f64).exp()).ln() - (1.0 + LN2));
    assert_eq!(s.scored_nodes[0], 3);
    // BSA scores the mean-pooled keys 0, 0, 1 -> leaf2: [2, 3], margin 1 - 0.
    let b = select_bsa(
        &[1.0],
        &CASE_A,
        &shape(&CASE_A, &[1.0], 1),
        TensorLayout::Bhnd,
        &cfg(2, 2),
    )
    .unwrap();
    assert_eq!(b.indices, [2, 3]);
    close(b.margin[0], 1.0);
    // Oracle: masses proportional to 2, e^3 + e^-3 = 20.1, 2e = 5.44, 2e^0.5 = 3.30 -> [1, 2].
    let o = select_oracle(
        &[1.0],
        &CASE_A,
        &shape(&CASE_A, &[1.0], 1),
        TensorLayout::Bhnd,
        &cfg(2, 2),
    )
    .unwrap();
    assert_eq!(o.indices, [1, 2]);
}

#[test]
fn case_a_every_prefill_query() {
    // Prefill, q = 1 everywhere. p = 0..3 (b_q <= 1) see at most 2 leaves: all of them.
    // p = 4, 5 (b_q = 2): candidates 0, 1 -> leaf1 (3.0025 > 0.693): [1, 2].
    // p = 6, 7 (b_q = 3): as above, [1, 3].
    let s = pisa(&CASE_A, &[1.0; 8], 8, &cfg(2, 2));
    let want = [
        [0, -1],
        [0, -1],
        [0, 1],
        [0, 1],
        [1, 2],
        [1, 2],
        [1, 3],
        [1, 3],
    ];
    assert_eq!(s.indices, want.concat());
    assert_eq!(&s.margin[..4], &[f64::INFINITY; 4]);
}

// Case B: C = 2, K = 2, g = 2, 16 tokens: leaf0 = [2, 2], leaf1 = [2, 2], leaf2 = [4, -4],
// leaf3 = [0, 0], leaf4 = [3, 3], leaf5 = [-3, -3], leaf6 = [1, 1], leaf7 = [0, 0] (own).
// Pyramid 8 -> 4 -> 2 -> 1; start level 1 (4 > K). Query at p = 15: b_q = 7, ancestor at level
// 1 is node 3; complete-past level-1 candidates 0, 1, 2 (> K: scored, best 2 kept). Level 0
// candidates: children of the kept nodes plus leaf6 (the ancestor's past child); leaf7 forced.
const CASE_B: [f32; 16] = [
    2., 2., 2., 2., 4., -4., 0., 0., 3., 3., -3., -3., 1., 1., 0., 0.,
];

#[test]
fn case_b_three_scorings() {
    let e = |x: f64| x.exp();
    // lse: node0 = ln(2e^2 + 2e^2) = 3.386, node1 = ln(2 + 2) = 1.386 (its 4 is averaged away),
    // node2 = ln(2e^3 + 2e^-3) = 3.696 -> keep 2, 0 (gap 2.0). Leaves 0, 1, 4, 5, 6:
    // ln(2e^2) = 2.693, 2.693, 3 + ln 2 = 3.693, -2.307, 1.693 -> leaf4 (gap 1.0): [4, 7].
    let s = pisa(&CASE_B, &[1.0], 1, &cfg(2, 2));
    assert_eq!(s.indices, [4, 7]);
    close(s.margin[0], 1.0);
    assert_eq!(s.scored_nodes[0], 3 + 5);
    // mean: node0 = 2 + ln 4, node1 = 0 + ln 4, node2 = 0 + ln 4: node1 and node2 tie and the
    // lower index wins (margin 0). Leaves 0, 1, 2, 3, 6: leaf2 = ln(e^4 + e^-4) = 4.0007
    // beats 2.693 -> [2, 7].
    let s = pisa(&CASE_B, &[1.0], 1, &cfg(2, 2).with_scoring(Scoring::Mean));
    assert_eq!(s.indices, [2, 7]);
    assert_eq!(s.margin[0], 0.0);
    // meanvar: variances node0 = 0, node1 = (16 + 16) / 4 = 8, node2 = 9, so node0 = 3.386,
    // node1 = ln 4 + 8/2 = 5.386, node2 = ln 4 + 9/2 = 5.886 -> keep 2, 1 (gap 2.0). Leaves 2, 3,
    // 4, 5, 6: leaf2 = 4.0007 beats leaf4 = 3.693 -> [2, 7], margin 4.0007 - 3.693.
    let s = pisa(
        &CASE_B,
        &[1.0],
        1,
        &cfg(2, 2).with_scoring(Scoring::MeanVar),
    );
    assert_eq!(s.indices, [2, 7]);
    close(s.margin[0], (e(4.0) + e(-4.0)).ln() - (3.0 + LN2));
}

#[test]
fn case_b_bsa_oracle_and_recall() {
    let (c, sh) = (cfg(2, 2), shape(&CASE_B, &[1.0], 1));
    // BSA: leaf means 2, 2, 0, 0, 3, -3, 1 -> leaf4 (gap 3 - 2): [4, 7].
    let bsa = select_bsa(&[1.0], &CASE_B, &sh, TensorLayout::Bhnd, &c).unwrap();
    assert_eq!(bsa.indices, [4, 7]);
    close(bsa.margin[0], 1.0);
    // Oracle masses (unnormalised): 2e^2, 2e^2, e^4 + e^-4, 2, 2e^3, 2e^-3, 2e, 2 -> [2, 4].
    let e = |x: f64| x.exp();
    let w = [
        2. * e(2.),
        2. * e(2.),
        e(4.) + e(-4.),
        2.,
        2. * e(3.),
        2. * e(-3.),
        2. * e(1.),
        2.,
    ];
    let z: f64 = w.iter().sum();
    let mass = block_mass(&[1.0], &CASE_B, &sh, TensorLayout::Bhnd, &c).unwrap();
    for j in 0..8 {
        close(mass[j], w[j] / z);
    }
    let oracle = select_oracle(&[1.0], &CASE_B, &sh, TensorLayout::Bhnd, &c).unwrap();
    assert_eq!(oracle.indices, [2, 4]);
    // PISA (lse) [4, 7]: one of two oracle blocks, mass (2e^3 + 2) / z; BSA the same.
    let p = pisa(&CASE_B, &[1.0], 1, &c);
    let r = recall(&p, &oracle, &mass, &sh, &c);
    assert_eq!((r.recall_at_k, r.queries), (0.5, 1));
    close(r.mass_recall, (w[4] + w[7]) / z);
    assert_eq!(recall(&bsa, &oracle, &mass, &sh, &c), r);
    // PISA (mean) [2, 7]: the other oracle block, mass (e^4 + e^-4 + 2) / z.
    let p = pisa(&CASE_B, &[1.0], 1, &c.with_scoring(Scoring::Mean));
    let r = recall(&p, &oracle, &mass, &sh, &c);
    assert_eq!(r.recall_at_k, 0.5);
    close(r.mass_recall, (w[2] + w[7]) / z);
    // The oracle against itself.
    let r = recall(&oracle, &oracle, &mass, &sh, &c);
    assert_eq!(r.recall_at_k, 1.0);
    close(r.mass_recall, (w[2] + w[4]) / z);
}

#[test]
fn case_c_gqa_scores_are_summed_over_the_group() {
    // C = 2, K = 2: leaf0 = [-2, -2], leaf1 = [1.5, -1.5], leaf2 = [2, 2], leaf3 = [0.5, 0.5].
    // Head q = +1: leaf0 = -2 + ln 2, leaf1 = ln(e^1.5 + e^-1.5) = 1.549, leaf2 = 2 + ln 2
    // -> alone it picks leaf2. Head q = -1 mirrors it and picks leaf0. Summed: leaf0 = leaf2 =
    // 2 ln 2 = 1.386, leaf1 = 3.097 -> the group picks leaf1.
    let keys = [-2.0, -2.0, 1.5, -1.5, 2.0, 2.0, 0.5, 0.5];
    assert_eq!(pisa(&keys, &[1.0], 1, &cfg(2, 2)).indices, [2, 3]);
    assert_eq!(pisa(&keys, &[-1.0], 1, &cfg(2, 2)).indices, [0, 3]);
    let s = pisa(&keys, &[1.0, -1.0], 1, &cfg(2, 2));
    assert_eq!(s.indices, [1, 3]);
    close(
        s.margin[0],
        2.0 * (1.5f64.exp() + (-1.5f64).exp()).ln() - 2.0 * LN2,
    );
}

#[test]
fn case_d_non_causal_sees_later_leaves() {
    // C = 2, K = 2: leaf0 = [0.5, 0.5], leaf1 = [1, 1], leaf2 = [-1, -1], leaf3 = [2, 2].
    // Leaf LSE: 0.5 + ln 2, 1 + ln 2, -1 + ln 2, 2 + ln 2.
    let keys = [0.5, 0.5, 1.0, 1.0, -1.0, -1.0, 2.0, 2.0];
    // Non-causal: own leaf forced, best other leaf of all four: leaf3, except for b_q = 3,
    // whose best other is leaf1.
    let s = pisa(&keys, &[1.0; 8], 8, &cfg(2, 2).with_causal(false));
    let want = [
        [0, 3],
        [0, 3],
        [1, 3],
        [1, 3],
        [2, 3],
        [2, 3],
        [1, 3],
        [1, 3],
    ];
    assert_eq!(s.indices, want.concat());
    // Causal: b_q <= 1 sees all; b_q = 2: leaf1 over leaf0; b_q = 3: leaf1 over 0 and 2.
    let s = pisa(&keys, &[1.0; 8], 8, &cfg(2, 2));
    let want = [
        [0, -1],
        [0, -1],
        [0, 1],
        [0, 1],
        [1, 2],
        [1, 2],
        [1, 3],
        [1, 3],
    ];
    assert_eq!(s.indices, want.concat());
}

#[test]
fn case_e_sink_and_local_blocks() {
    // C = 1 (one key per leaf), K = 4, 8 keys; the query at p = 7 has b_q = 7.
    let keys = [0.5, 5.0, 1.0, 2.0, -1.0, 0.25, 3.0, 0.75];
    // No forced extras: own 7, then the 3 best of keys 0..6: 5 (1), 3 (6), 2 (3).
    assert_eq!(pisa(&keys, &[1.0], 1, &cfg(1, 4)).indices, [1, 3, 6, 7]);
    // sink 1, local 1: forced {0, 6, 7}, one slot: key 5 at leaf1 (gap 5 - 2).
    let s = pisa(&keys, &[1.0], 1, &cfg(1, 4).with_forced(1, 1));
    assert_eq!(s.indices, [0, 1, 6, 7]);
    close(s.margin[0], 3.0);
    // sink 2, local 1: forced {0, 1, 6, 7}, nothing to choose, nothing scored.
    let s = pisa(&keys, &[1.0], 1, &cfg(1, 4).with_forced(2, 1));
    assert_eq!(
        (s.indices.as_slice(), s.scored_nodes[0]),
        (&[0, 1, 6, 7][..], 0)
    );
}

#[test]
fn case_f_merge_factor_three() {
    // C = 1, g = 3, K = 2, 27 keys, zero except k6 = 4, k15 = k16 = k17 = 3, k20 = 3.5,
    // k24 = 4.5. Pyramid 27 -> 9 -> 3 -> 1; start level 2 (3 > K). Query p = 26: ancestors
    // a_2 = 2, a_1 = 8. Level 2: past nodes {0, 1}, not more than K: kept, not scored.
    // Level 1: children 0..5 of the kept nodes + the ancestor's past children 6, 7 = 8 nodes,
    // scored (lse over 3 unit-count keys): node5 = 3 + ln 3 = 4.099, node2 = ln(e^4 + 2) =
    // 4.036, node6 = ln(e^3.5 + 2) = 3.559, others ln 3 -> keep 5, 2 (gap 4.036 - 3.559 =
    // 0.477). Level 0: leaves 6, 7, 8, 15, 16, 17 plus the level-1 ancestor's past children
    // 24, 25 (26 forced), 8 scored: k24 = 4.5 beats k6 = 4 (gap 0.5) -> [24, 26], margin 0.477.
    let mut keys = [0.0f32; 27];
    (keys[6], keys[15], keys[16], keys[17], keys[20], keys[24]) = (4.0, 3.0, 3.0, 3.0, 3.5, 4.5);
    let c = cfg(1, 2).with_merge_factor(3);
    let s = pisa(&keys, &[1.0], 1, &c);
    assert_eq!(s.indices, [24, 26]);
    close(
        s.margin[0],
        (4f64.exp() + 2.0).ln() - (3.5f64.exp() + 2.0).ln(),
    );
    assert_eq!(s.scored_nodes[0], 16);
    // mean: node2 = 4/3 + ln 3, node5 = 3 + ln 3, node6 = 3.5/3 + ln 3 -> keep 5, 2
    // (gap 1/6); same leaves -> [24, 26], margin 1/6.
    let s = pisa(&keys, &[1.0], 1, &c.with_scoring(Scoring::Mean));
    assert_eq!(s.indices, [24, 26]);
    close(s.margin[0], 0.5 / 3.0);
    // Without k24 the best leaf is k6: [6, 26].
    keys[24] = 0.0;
    assert_eq!(pisa(&keys, &[1.0], 1, &c).indices, [6, 26]);
}

/// Equal scores of opposite zero signs tie, broken by the lower block (PISA.md 3.4), as the GPU
/// kernels' comparisons break them: a zero query's BSA scores are -0.0 against a block mean of
/// negative components and +0.0 against a positive one, and the reference ranked +0.0 first.
#[test]
fn zero_scores_of_either_sign_tie_to_the_lower_block() {
    use pisa_core::reference::{select_bsa, select_pisa};
    use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
    // D 2, C 2, K 2: block means (-1, -1), (1, 1), (-1, -1), then the query's own block 3.
    let k: Vec<f32> = [
        -1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 0.5, 0.5,
    ]
    .to_vec();
    let s = AttentionShape::new(1, 1, 1, 1, 7, 2).unwrap();
    let cfg = SelectionConfig::new(2, 2).unwrap();
    let q = [0.0f32, 0.0];
    let bsa = select_bsa(&q, &k, &s, TensorLayout::Bhnd, &cfg).unwrap();
    assert_eq!(bsa.row(0), &[0, 3], "a tie keeps the lower block");
    assert_eq!(bsa.margin[0], 0.0, "and is flagged as one");
    let pisa = select_pisa(&q, &k, &s, TensorLayout::Bhnd, &cfg).unwrap();
    assert_eq!(pisa.row(0), &[0, 3]);
}
