//! The split decode step's score table of the routing's top levels (`shaders/decode_table.wgsl`,
//! a module of `tests/decode.rs`): the step with the table equals the step without it BIT FOR
//! BIT (selection, output, LSE), since the table holds the dot products the routing would
//! compute, summed in the same order; and both equal the reference (the harness's check).
//! GQA groups 1, 2, 3, 4, 7, 8, head dims 64, 80, 128, merge factors 2, 3, 4, lengths that
//! are not multiples of the block size, from below the table's levels to routing several
//! levels under them.

use super::common::*;
use super::decode_harness::{base, cfg, Run};
use pisa_core::Scoring;

/// The routing's start level over `nb0` leaves (as `start_level` in decode_levels.wgsl).
fn start_level(nb0: usize, g: usize, k: usize) -> usize {
    let (mut s, mut n) = (0, nb0);
    loop {
        n = n.div_ceil(g);
        if n <= k {
            return s;
        }
        s += 1;
    }
}

#[test]
fn score_table_equals_the_routing_bit_for_bit() {
    // (name, g_q, D, C, K, g, prefill, capacity, table nodes): the first, second and fourth
    // route one to three levels below the table's (start level 5 under 2 table levels, 3
    // under 2, 2 under 1); the others take every level from it, down to the leaves' means.
    let cases = [
        ("table_gqa1_g2", 1, 64, 2, 4, 2, 301, 1200, 48),
        ("table_gqa2_g3", 2, 80, 3, 3, 3, 410, 1300, 108),
        ("table_gqa3_g2", 3, 128, 4, 5, 2, 157, 900, 200),
        ("table_gqa4_g4", 4, 64, 2, 3, 4, 333, 700, 48),
        ("table_gqa7_g2", 7, 64, 5, 3, 2, 77, 800, 960),
        ("table_gqa8_g2", 8, 80, 3, 4, 2, 250, 1000, 4096),
    ];
    let mut deep = 0;
    for (name, gq, d, c, k, g, pre, cap, nodes) in cases {
        let mut case = base(
            name,
            2 * gq,
            2,
            d,
            cfg(c, k, g, Scoring::Lse).with_forced(1, 1),
        );
        case.prefill = vec![pre, 1];
        case.steps = 0;
        let mut r = Run::new(case, cap);
        r.cache.set_fused(false);
        r.cache.set_score_table_nodes(nodes);
        let tl = r.cache.score_table_levels() as usize;
        assert!(tl >= 1, "{name}: no score table for {nodes} nodes");
        let mut rq = rng(seed(name) ^ 0x7ab1e);
        for step in 0..24 {
            // Appends (checked against the reference with the table), then one more query
            // with and without the table.
            r.step(step);
            let q = random(&mut rq, 2 * 2 * gq * d, 1.5);
            let with = r.cache.step(&q, true).unwrap();
            r.cache.set_score_table_nodes(0);
            assert_eq!(r.cache.score_table_levels(), 0);
            let without = r.cache.step(&q, true).unwrap();
            r.cache.set_score_table_nodes(nodes);
            let len = r.cache.len(0).unwrap();
            let s = start_level(len.div_ceil(c), g, k);
            deep += usize::from(s > tl);
            assert_eq!(
                with.selection, without.selection,
                "{name} step {step} len {len}: selection (table levels {tl}, start level {s})"
            );
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&with.out),
                bits(&without.out),
                "{name} step {step}: output"
            );
            assert_eq!(
                bits(&with.lse),
                bits(&without.lse),
                "{name} step {step}: lse"
            );
        }
    }
    // The three deep cases route below the table's levels at every step (rows from both).
    assert!(deep >= 72, "only {deep} steps routed past the table");
}

/// No table for `mean` and `meanvar` scoring (their level scores are not child dot products),
/// nor for 0 nodes or fewer than the start level's children.
#[test]
fn score_table_only_where_it_applies() {
    for (scoring, nodes, want) in [
        (Scoring::Mean, 960, 0),
        (Scoring::MeanVar, 960, 0),
        (Scoring::Lse, 0, 0),
        (Scoring::Lse, 63, 0),
        (Scoring::Lse, 64, 1),
        (Scoring::Lse, 191, 1),
        (Scoring::Lse, 192, 2),
        (Scoring::Lse, 960, 4),
    ] {
        let mut case = base("table_applies", 4, 1, 64, cfg(64, 16, 2, scoring));
        case.prefill = vec![0];
        case.steps = 0;
        let mut r = Run::new(case, 64);
        r.cache.set_score_table_nodes(nodes);
        assert_eq!(r.cache.score_table_levels(), want, "{scoring:?} {nodes}");
    }
}
