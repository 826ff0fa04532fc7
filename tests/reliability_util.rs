//! Helpers of the reliability tests (included with `#[path]` by `reliability*.rs`): inputs from
//! fixed seeds (these tests compare runs with each other, or with a clean run, not with fresh
//! random data), prefill options, bitwise comparison ("identical" means the same bit patterns,
//! so NaN == NaN and -0.0 != 0.0), and the well-formedness check of a selection row.
#![allow(dead_code)]

use pisa_core::{AttentionShape, SelectionConfig};
use pisa_wgpu::ops::prefill::{PrefillOptions, PrefillOutput};
use pisa_wgpu::{AdapterChoice, Context};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::common::random;

/// Fixed seeds: these tests compare runs with each other, not with fresh random data.
pub fn inputs(shape: &AttentionShape, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (
        random(&mut r, shape.q_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
    )
}

pub fn opts(cfg: SelectionConfig) -> PrefillOptions {
    PrefillOptions {
        cfg,
        return_selection: true,
        ..PrefillOptions::default()
    }
}

pub fn small() -> (AttentionShape, SelectionConfig) {
    (
        AttentionShape::new(1, 4, 2, 200, 200, 32).unwrap(),
        SelectionConfig::new(16, 4).unwrap(),
    )
}

/// Bit patterns, so NaN == NaN and -0.0 != 0.0: "identical" means bitwise here.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub fn same_output(a: &PrefillOutput, b: &PrefillOutput) -> bool {
    bits(&a.out) == bits(&b.out) && bits(&a.lse) == bits(&b.lse) && a.selection == b.selection
}

/// A private context, for tests that change its limits or break its device.
pub fn private_ctx() -> Context {
    Context::new(&AdapterChoice::HighPerformance).expect("a GPU adapter")
}

/// Asserts that `row`, the selection of a query in block `bq`, is well formed: exactly
/// min(K, bq + 1) leaves, then -1 padding, strictly ascending, none in the future, and every
/// forced leaf of `cfg` present. `why` names the case in the message.
pub fn assert_well_formed(row: &[i32], cfg: &SelectionConfig, bq: usize, why: &str) {
    let picked: Vec<i32> = row.iter().copied().filter(|&j| j >= 0).collect();
    assert_eq!(picked.len(), cfg.top_k.min(bq + 1), "{why}: {row:?}");
    assert!(
        row[picked.len()..].iter().all(|&j| j == -1),
        "{why}: {row:?}"
    );
    assert!(picked.windows(2).all(|w| w[0] < w[1]), "{why}: {row:?}");
    assert!(picked.iter().all(|&j| j as usize <= bq), "{why}: {row:?}");
    cfg.for_each_forced(bq, |f| {
        assert!(picked.contains(&(f as i32)), "{why}: {row:?}")
    });
}
