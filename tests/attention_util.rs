//! Helpers of the attention tests (included with `#[path]` by `attention.rs` and
//! `attention_edge.rs`): seeded inputs (rounded to f16 or bf16 for 16-bit storage, so the f64
//! reference sees what the GPU holds), random valid selections, and the comparison with the
//! reference by relative L2 error of O and LSE: at most 1e-4 for f32 storage, 5e-3 for f16 (O
//! stored in f16), 1e-4 for bf16 (inputs widened exactly, O written in f32).
#![allow(dead_code)]

use pisa_core::{reference, AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::{Context, Storage};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::common::{random, rel_err, through_storage};

/// Tolerance of the relative L2 error for a storage precision (f16: vs f16-rounded inputs).
pub fn tol(storage: Storage) -> f64 {
    match storage {
        Storage::F32 => 1e-4,
        Storage::F16 => 5e-3,
        Storage::Bf16 => 1e-4,
    }
}

pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

pub fn inputs(r: &mut ChaCha8Rng, s: &AttentionShape, storage: Storage) -> Inputs {
    let mut q = random(r, s.q_elems(), 1.5);
    let mut k = random(r, s.kv_elems(), 1.5);
    let mut v = random(r, s.kv_elems(), 1.0);
    if storage != Storage::F32 {
        let t = |x: &[f32]| through_storage(x, storage);
        (q, k, v) = (t(&q), t(&k), t(&v));
    }
    Inputs { q, k, v }
}

/// A random valid selection: ascending, unique, the own block included when causal, some rows
/// shorter than K, -1 padded.
pub fn random_selection(r: &mut ChaCha8Rng, s: &AttentionShape, cfg: &SelectionConfig) -> Vec<i32> {
    selection_rows(r, s, cfg, |r, visible, row| {
        let want = r.random_range(1..=cfg.top_k.min(visible));
        while row.len() < want {
            let j = r.random_range(0..visible) as i32;
            if !row.contains(&j) {
                row.push(j);
            }
        }
    })
}

/// A selection `[B, Hkv, Nq, K]` whose rows `fill(r, visible, row)` completes (unique leaves
/// below `visible`, the query's visible leaf count, at most K in all) from the query's own
/// block when causal (else empty); each row then sorted and -1 padded.
pub fn selection_rows(
    r: &mut ChaCha8Rng,
    s: &AttentionShape,
    cfg: &SelectionConfig,
    mut fill: impl FnMut(&mut ChaCha8Rng, usize, &mut Vec<i32>),
) -> Vec<i32> {
    let nb0 = s.k_len.div_ceil(cfg.block_size);
    let mut out = Vec::new();
    for _ in 0..s.batch * s.kv_heads {
        for i in 0..s.q_len {
            let own = s.query_position(i) / cfg.block_size;
            let visible = if cfg.causal { own + 1 } else { nb0 };
            let mut row: Vec<i32> = if cfg.causal { vec![own as i32] } else { vec![] };
            fill(r, visible, &mut row);
            row.sort_unstable();
            row.resize(cfg.top_k, -1);
            out.extend(row);
        }
    }
    out
}

pub fn check(what: &str, (o, lse): (&[f32], &[f32]), (ro, rl): (&[f64], &[f64]), storage: Storage) {
    let eo = rel_err(o, ro);
    let el = rel_err(lse, rl);
    // Per row too, so that a few wrong rows (a tile's tail) cannot hide in the whole tensor's
    // L2 error: each row of O within 10x the tolerance of its own norm (an empty row's
    // reference is zeros: its O must be too), each LSE within the tolerance of max(1, |LSE|).
    let d = o.len() / lse.len().max(1);
    let (row, worst) = worst_row(o, ro, d);
    let (at, lse_worst) = (lse.iter().zip(rl).enumerate())
        .map(|(i, (&g, &w))| (i, (g as f64 - w).abs() / w.abs().max(1.0)))
        .fold(
            (0, 0f64),
            |a, b| if b.1 > a.1 || b.1.is_nan() { b } else { a },
        );
    eprintln!(
        "  {what}: O rel err {eo:.2e} (worst row {worst:.2e}), LSE rel err {el:.2e} (worst {lse_worst:.2e})"
    );
    assert!(eo <= tol(storage), "{what}: O rel err {eo}");
    assert!(el <= tol(storage), "{what}: LSE rel err {el}");
    assert!(
        worst <= 10.0 * tol(storage),
        "{what}: O row {row} rel err {worst}"
    );
    assert!(
        lse_worst <= tol(storage),
        "{what}: LSE {at} rel err {lse_worst}: {} vs {}",
        lse[at],
        rl[at]
    );
}

/// The row (of `d` values) of `got` farthest from `want` relative to the reference row's L2
/// norm (absolute where that row is zeros), and that error; NaN counts as infinite.
fn worst_row(got: &[f32], want: &[f64], d: usize) -> (usize, f64) {
    let mut worst = (0, 0f64);
    for (r, (g, w)) in got.chunks(d.max(1)).zip(want.chunks(d.max(1))).enumerate() {
        let num: f64 = g.iter().zip(w).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
        let den: f64 = w.iter().map(|y| y * y).sum();
        let e = if den > 0.0 {
            (num / den).sqrt()
        } else {
            num.sqrt()
        };
        let e = if e.is_nan() { f64::INFINITY } else { e };
        if e > worst.1 {
            worst = (r, e);
        }
    }
    worst
}

/// True, after saying so, when an f16 case must be skipped: the adapter has no SHADER_F16.
pub fn skip_f16(ctx: &Context, storage: Storage) -> bool {
    let skip = storage == Storage::F16 && !ctx.has_f16();
    if skip {
        eprintln!("  skipping an f16 case: adapter has no SHADER_F16");
    }
    skip
}

/// A sparse-attention case: (B, Hq, Hkv, Nq, Nk, D, C, K, layout, storage, causal, selection
/// from the reference PISA selector (else a random valid one)).
pub type Case = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    TensorLayout,
    Storage,
    bool,
    bool,
);

/// A case's shape and selection configuration.
pub fn case_config(case: Case) -> (AttentionShape, SelectionConfig) {
    let (b, hq, hkv, nq, nk, d, c, kk, _, _, causal, _) = case;
    let s = AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
    let cfg = SelectionConfig::new(c, kk).unwrap().with_causal(causal);
    (s, cfg)
}

/// A case's shape, configuration, inputs and selection (`[B, Hkv, Nq, K]`).
pub fn sparse_case(
    r: &mut ChaCha8Rng,
    case: Case,
) -> (AttentionShape, SelectionConfig, Inputs, Vec<i32>) {
    let (.., layout, storage, _, pisa) = case;
    let (s, cfg) = case_config(case);
    let x = inputs(r, &s, storage);
    let sel = if pisa {
        reference::select_pisa(&x.q, &x.k, &s, layout, &cfg)
            .unwrap()
            .indices
    } else {
        random_selection(r, &s, &cfg)
    };
    (s, cfg, x, sel)
}
