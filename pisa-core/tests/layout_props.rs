//! Property tests of the pyramid layout (PISA.md section 1): spans partition the keys, counts
//! add up, each leaf has one ancestor per level, and the ancestor path is exactly what a full
//! rebuild changes when one key is appended.
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

mod common;

use pisa_core::reference::build_pyramid;
use pisa_core::{AttentionShape, PyramidLayout, SelectionConfig, TensorLayout};
use proptest::prelude::*;
use rand::SeedableRng;

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn spans_partition_and_counts_add_up(n in 1usize..5000, c in 1usize..17, g in 2usize..5) {
        let l = PyramidLayout::new(n, c, g).unwrap();
        prop_assert_eq!(l.leaves(), n.div_ceil(c));
        prop_assert_eq!(l.nodes(l.num_levels() - 1), 1);
        let mut total = 0;
        for level in 0..l.num_levels() {
            prop_assert_eq!(l.offset(level), total);
            total += l.nodes(level);
            if level + 1 < l.num_levels() {
                prop_assert_eq!(l.nodes(level + 1), l.nodes(level).div_ceil(g));
                prop_assert!(l.nodes(level) > 1);
            }
            // Token spans of the level: non-empty, contiguous, from 0 to n.
            let mut next_token = 0;
            let mut next_leaf = 0;
            for j in 0..l.nodes(level) {
                let t = l.token_span(level, j);
                prop_assert_eq!(t.start, next_token);
                prop_assert!(!t.is_empty());
                prop_assert_eq!(l.node_len(level, j), t.len());
                next_token = t.end;
                let s = l.leaf_span(level, j);
                prop_assert_eq!(s.start, next_leaf);
                next_leaf = s.end;
                if level > 0 {
                    // Children partition the node's leaves.
                    let ch = l.children(level, j);
                    prop_assert_eq!(l.leaf_span(level - 1, ch.start).start, s.start);
                    prop_assert_eq!(l.leaf_span(level - 1, ch.end - 1).end, s.end);
                    let sum: usize = ch.map(|x| l.node_len(level - 1, x)).sum();
                    prop_assert_eq!(sum, t.len());
                }
            }
            prop_assert_eq!(next_token, n);
            prop_assert_eq!(next_leaf, l.leaves());
        }
        prop_assert_eq!(l.total_nodes(), total);
    }

    #[test]
    fn every_leaf_has_one_ancestor_per_level(n in 1usize..400, c in 1usize..9, g in 2usize..5, m in 0usize..3000) {
        let l = PyramidLayout::new(n, c, g).unwrap();
        for leaf in 0..l.leaves() {
            let path: Vec<(usize, usize)> = l.ancestor_path(leaf).collect();
            prop_assert_eq!(path.len(), l.num_levels());
            for &(level, a) in &path {
                let owners: Vec<usize> =
                    (0..l.nodes(level)).filter(|&j| l.leaf_span(level, j).contains(&leaf)).collect();
                prop_assert_eq!(owners, vec![a]);
                if level + 1 < l.num_levels() {
                    prop_assert_eq!(path[level + 1].1, l.parent(a));
                }
            }
        }
        // A shorter sequence's nodes are a prefix of each level of a longer one.
        let big = PyramidLayout::new(n + m, c, g).unwrap();
        for level in 0..l.num_levels() {
            prop_assert!(l.nodes(level) <= big.nodes(level));
        }
    }

    #[test]
    fn ancestor_path_is_what_a_rebuild_changes(
        n in 1usize..300, c in 1usize..9, g in 2usize..4, d in 1usize..4, hkv in 1usize..3, seed in any::<u64>(),
    ) {
        let cfg = SelectionConfig::new(c, 1).unwrap().with_merge_factor(g);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let long = AttentionShape::new(1, hkv, hkv, 1, n + 1, d).unwrap();
        let short = AttentionShape::new(1, hkv, hkv, 1, n, d).unwrap();
        let k = common::tensor(&mut rng, long.kv_elems(), 1.0); // Bnhd: the first n tokens lead
        let old = build_pyramid(&k[..short.kv_elems()], &short, TensorLayout::Bnhd, &cfg).unwrap();
        let new = build_pyramid(&k, &long, TensorLayout::Bnhd, &cfg).unwrap();
        let path: Vec<(usize, usize)> = new.layout.ancestor_path(n / c).collect();
        for h in 0..hkv {
            for level in 0..new.layout.num_levels() {
                for j in 0..new.layout.nodes(level) {
                    let existed = level < old.layout.num_levels() && j < old.layout.nodes(level);
                    let same = existed
                        && old.mean(0, h, level, j) == new.mean(0, h, level, j)
                        && old.var(0, h, level, j) == new.var(0, h, level, j);
                    prop_assert_eq!(same, !path.contains(&(level, j)), "head {} level {} node {}", h, level, j);
                }
            }
        }
    }
}
