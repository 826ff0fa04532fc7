//! GPU selections on real activations (SmolLM2-135M, layers 15 and 29, the first tokens of
//! `shared/data/smollm2-rustbook-8k.safetensors`: Hq = 9, Hkv = 3, D = 64, scale 1/8) equal
//! the CPU reference's, within near-ties. Skipped with a message when the file is absent.
mod common;
#[path = "select_util.rs"]
mod select_util;

use std::ops::Range;

use common::*;
use pisa_core::reference::{select_bsa, select_oracle, select_pisa};
use pisa_core::TensorLayout::Bhnd;
use pisa_core::{AttentionShape, Scoring, SelectionConfig};
use pisa_wgpu::ops::select::{select_host, Method};
use pisa_wgpu::Storage;
use select_util::{check, report, tie_tol};

const PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/data/smollm2-rustbook-8k.safetensors"
);

/// `layer{i}.q` and `.k` of the first `n` tokens and the KV heads `kv` (with their query heads
/// `3 * kv.start .. 3 * kv.end`) as f32 `[1, H, n, 64]` (Bhnd), or None when the file is absent.
fn load(layer: usize, n: usize, kv: Range<usize>) -> Option<(Vec<f32>, Vec<f32>)> {
    let bytes = match std::fs::read(PATH) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: {PATH} not readable ({e})");
            return None;
        }
    };
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors file");
    let get = |name: String, heads: Range<usize>| {
        let t = st.tensor(&name).expect("tensor present");
        assert_eq!(t.dtype(), safetensors::Dtype::BF16, "{name}");
        let [_, tokens, d] = t.shape() else {
            panic!("{name}: shape {:?}", t.shape())
        };
        let data = t.data();
        let mut out = Vec::with_capacity(heads.len() * n * d);
        for hi in heads {
            for ti in 0..n {
                let o = (hi * tokens + ti) * d;
                for x in data[2 * o..2 * (o + d)].chunks_exact(2) {
                    out.push(half::bf16::from_le_bytes([x[0], x[1]]).to_f32());
                }
            }
        }
        out
    };
    let qh = 3 * kv.start..3 * kv.end;
    Some((
        get(format!("layer{layer}.q"), qh),
        get(format!("layer{layer}.k"), kv),
    ))
}

fn shape(n: usize, kv_heads: usize) -> AttentionShape {
    AttentionShape::prefill(1, 3 * kv_heads, kv_heads, n, 64).unwrap()
}

/// C = 32, K = 8, one sink and one local block, scale 1/8.
fn cfg(scoring: Scoring) -> SelectionConfig {
    SelectionConfig::new(32, 8)
        .unwrap()
        .with_forced(1, 1)
        .with_scoring(scoring)
        .with_scale(Some(0.125))
}

fn run(what: &str, q: &[f32], k: &[f32], s: &AttentionShape, c: &SelectionConfig, m: Method) {
    let t0 = std::time::Instant::now();
    let want = match m {
        Method::Pisa => select_pisa(q, k, s, Bhnd, c),
        Method::Bsa => select_bsa(q, k, s, Bhnd, c),
        Method::Oracle => select_oracle(q, k, s, Bhnd, c),
    }
    .unwrap();
    let t_ref = t0.elapsed();
    let t0 = std::time::Instant::now();
    let got = select_host(ctx(), q, k, s, Bhnd, c, Storage::F32, m, 4).unwrap();
    eprintln!("{what}: reference {t_ref:.2?}, gpu {:.2?}", t0.elapsed());
    let tol = match m {
        Method::Oracle => 2e-6,
        _ => tie_tol(3, 64, 0.125, q, k, Storage::F32),
    };
    let ties = check(what, &got, &want, tol);
    report(what, ties, want.rows());
}

#[test]
fn pisa_on_real_activations() {
    // The CPU reference is slow in debug builds: one KV head (three query heads) per case.
    let cases = [
        (15, 0, Scoring::Lse, 2048),
        (29, 2, Scoring::Lse, 1024),
        (29, 1, Scoring::MeanVar, 1024),
    ];
    for (layer, kv, scoring, n) in cases {
        let Some((q, k)) = load(layer, n, kv..kv + 1) else {
            return;
        };
        let what = format!("layer {layer} kv head {kv} {n} tokens pisa {scoring:?}");
        run(&what, &q, &k, &shape(n, 1), &cfg(scoring), Method::Pisa);
    }
}

#[test]
fn baselines_on_real_activations() {
    for layer in [15, 29] {
        let n = 2048;
        let Some((q, k)) = load(layer, n, 0..3) else {
            return;
        };
        let what = format!("layer {layer} bsa");
        run(&what, &q, &k, &shape(n, 3), &cfg(Scoring::Lse), Method::Bsa);
    }
    // The oracle's CPU reference is O(N^2 D): 512 tokens of layer 29.
    let n = 512;
    let Some((q, k)) = load(29, n, 0..3) else {
        return;
    };
    let c = cfg(Scoring::Lse);
    run("layer 29 oracle", &q, &k, &shape(n, 3), &c, Method::Oracle);
}
