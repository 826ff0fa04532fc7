//! GPU block-sparse and dense attention (PISA.md section 4) against the f64 CPU reference:
//! selections from the reference PISA selector and random valid ones, GQA groups 1..32, head
//! dims 64..256, both layouts, f32 and f16 storage, causal and not, forced small tilings, the
//! binding-size split path, and outputs that start poisoned.
mod common;

use common::*;
use pisa_core::{reference, AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::{self, AttentionKind, Tiling};
use pisa_wgpu::{AdapterChoice, Context, GpuError, Storage};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use TensorLayout::{Bhnd, Bnhd};

/// Tolerance of the relative L2 error for a storage precision (f16: vs f16-rounded inputs).
fn tol(storage: Storage) -> f64 {
    match storage {
        Storage::F32 => 1e-4,
        Storage::F16 => 5e-3,
    }
}

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn inputs(r: &mut ChaCha8Rng, s: &AttentionShape, storage: Storage) -> Inputs {
    let mut q = random(r, s.q_elems(), 1.5);
    let mut k = random(r, s.kv_elems(), 1.5);
    let mut v = random(r, s.kv_elems(), 1.0);
    if storage == Storage::F16 {
        (q, k, v) = (through_f16(&q), through_f16(&k), through_f16(&v));
    }
    Inputs { q, k, v }
}

/// A random valid selection: ascending, unique, the own block included when causal, some rows
/// shorter than K, -1 padded.
fn random_selection(r: &mut ChaCha8Rng, s: &AttentionShape, cfg: &SelectionConfig) -> Vec<i32> {
    let nb0 = s.k_len.div_ceil(cfg.block_size);
    let mut out = Vec::new();
    for _ in 0..s.batch * s.kv_heads {
        for i in 0..s.q_len {
            let own = s.query_position(i) / cfg.block_size;
            let visible = if cfg.causal { own + 1 } else { nb0 };
            let want = r.random_range(1..=cfg.top_k.min(visible));
            let mut row: Vec<i32> = if cfg.causal { vec![own as i32] } else { vec![] };
            while row.len() < want {
                let j = r.random_range(0..visible) as i32;
                if !row.contains(&j) {
                    row.push(j);
                }
            }
            row.sort_unstable();
            row.resize(cfg.top_k, -1);
            out.extend(row);
        }
    }
    out
}

fn check(what: &str, (o, lse): (&[f32], &[f32]), (ro, rl): (&[f64], &[f64]), storage: Storage) {
    let eo = rel_err(o, ro);
    let el = rel_err(lse, rl);
    eprintln!("  {what}: O rel err {eo:.2e}, LSE rel err {el:.2e}");
    assert!(eo <= tol(storage), "{what}: O rel err {eo}");
    assert!(el <= tol(storage), "{what}: LSE rel err {el}");
}

/// (B, Hq, Hkv, Nq, Nk, D, C, K, layout, storage, causal, selection from PISA)
type Case = (
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

#[test]
fn sparse_matches_reference() {
    let ctx = ctx();
    let seed = seed("sparse");
    let mut r = rng(seed);
    use Storage::{F16, F32};
    let cases: &[Case] = &[
        (2, 4, 2, 100, 100, 64, 16, 4, Bhnd, F32, true, true),
        (2, 3, 1, 65, 65, 80, 32, 3, Bnhd, F32, true, true),
        (1, 2, 1, 1000, 1000, 64, 64, 4, Bhnd, F32, true, true),
        (2, 7, 1, 33, 33, 96, 16, 3, Bnhd, F16, true, true),
        (1, 8, 1, 40, 63, 256, 16, 3, Bhnd, F32, true, false),
        (2, 16, 1, 31, 31, 64, 16, 2, Bnhd, F32, true, false),
        (1, 32, 1, 17, 129, 64, 128, 2, Bhnd, F16, true, false),
        (2, 2, 2, 127, 127, 128, 32, 5, Bnhd, F16, false, true),
        (1, 1, 1, 1, 1, 64, 64, 1, Bhnd, F32, true, true),
        (1, 4, 1, 64, 64, 80, 64, 1, Bnhd, F32, false, false),
    ];
    for &(b, hq, hkv, nq, nk, d, c, kk, layout, storage, causal, pisa) in cases {
        if storage == F16 && !ctx.has_f16() {
            eprintln!("  skipping an f16 case: adapter has no SHADER_F16");
            continue;
        }
        let s = AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
        let cfg = SelectionConfig::new(c, kk).unwrap().with_causal(causal);
        let x = inputs(&mut r, &s, storage);
        let sel = if pisa {
            reference::select_pisa(&x.q, &x.k, &s, layout, &cfg)
                .unwrap()
                .indices
        } else {
            random_selection(&mut r, &s, &cfg)
        };
        let (ro, rl) =
            reference::sparse_attention(&x.q, &x.k, &x.v, &s, layout, &cfg, &sel).unwrap();
        let got = attention::sparse_attention_host(
            ctx, &x.q, &x.k, &x.v, &s, layout, &cfg, storage, &sel,
        )
        .unwrap();
        let what = format!(
            "{s:?} C {c} K {kk} {layout:?} {storage:?} causal {causal} pisa {pisa} seed {seed}"
        );
        check(&what, (&got.0, &got.1), (&ro, &rl), storage);
    }
}

/// Sparse and dense with forced small tilings: several key tiles per block, tiles that do not
/// divide C, one query or head per workgroup, larger query tiles.
#[test]
fn forced_tilings_match_reference() {
    let ctx = ctx();
    let seed = seed("tilings");
    let mut r = rng(seed);
    let s = AttentionShape::new(2, 6, 2, 45, 50, 64).unwrap();
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let x = inputs(&mut r, &s, Storage::F32);
    let sel = random_selection(&mut r, &s, &cfg);
    let (ro, rl) = reference::sparse_attention(&x.q, &x.k, &x.v, &s, Bnhd, &cfg, &sel).unwrap();
    let (dro, drl) = reference::dense_attention(&x.q, &x.k, &x.v, &s, Bnhd, true, 0.3).unwrap();
    let up = |d: &[f32]| ctx.upload("t", d, Storage::F32).unwrap();
    let (qt, kt, vt, st) = (
        up(&x.q),
        up(&x.k),
        up(&x.v),
        ctx.upload_u32("sel", &sel).unwrap(),
    );
    for (gh, qtile, ktile, rm) in [
        (1, 1, 4, 0),
        (2, 3, 5, 8),
        (3, 8, 16, 0),
        (1, 32, 7, 8),
        (3, 2, 128, 8),
        (2, 4, 64, 4),
    ] {
        let tiling = Tiling {
            head_chunk: gh,
            query_tile: qtile,
            key_tile: ktile,
            rows_per_thread: rm,
        };
        for sparse in [true, false] {
            let kind = if sparse {
                AttentionKind::Sparse {
                    selection: &st,
                    cfg: &cfg,
                }
            } else {
                AttentionKind::Dense {
                    causal: true,
                    scale: 0.3,
                }
            };
            let (o, l) = ctx
                .scoped("test", || {
                    let mut enc = ctx.device().create_command_encoder(&Default::default());
                    let out = attention::record_attention(
                        ctx,
                        &mut enc,
                        &qt,
                        &kt,
                        &vt,
                        &s,
                        Bnhd.into(),
                        &kind,
                        Some(tiling),
                        None,
                    )?;
                    ctx.queue().submit([enc.finish()]);
                    Ok(out)
                })
                .unwrap();
            let (o, l) = (ctx.read_f32(&o).unwrap(), ctx.read_f32(&l).unwrap());
            let what = format!("{tiling:?} sparse {sparse} seed {seed}");
            let want = if sparse {
                (&ro[..], &rl[..])
            } else {
                (&dro[..], &drl[..])
            };
            check(&what, (&o, &l), want, Storage::F32);
        }
    }
}

/// (B, Hq, Hkv, Nq, Nk, D, layout, storage, causal)
type DenseCase = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    TensorLayout,
    Storage,
    bool,
);

#[test]
fn dense_matches_reference() {
    let ctx = ctx();
    let seed = seed("dense");
    let mut r = rng(seed);
    use Storage::{F16, F32};
    let cases: &[DenseCase] = &[
        (2, 4, 2, 100, 100, 64, Bhnd, F32, true),
        (1, 7, 1, 65, 65, 80, Bnhd, F32, true),
        (1, 8, 2, 300, 300, 128, Bhnd, F16, true),
        (2, 3, 3, 31, 70, 96, Bnhd, F32, true),
        (1, 2, 1, 33, 33, 256, Bhnd, F32, false),
        (1, 32, 2, 9, 40, 64, Bnhd, F16, false),
        (1, 1, 1, 1, 1, 64, Bhnd, F32, true),
    ];
    for &(b, hq, hkv, nq, nk, d, layout, storage, causal) in cases {
        if storage == F16 && !ctx.has_f16() {
            eprintln!("  skipping an f16 case: adapter has no SHADER_F16");
            continue;
        }
        let s = AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
        let x = inputs(&mut r, &s, storage);
        let scale = 1.0 / (d as f32).sqrt();
        let (ro, rl) =
            reference::dense_attention(&x.q, &x.k, &x.v, &s, layout, causal, scale).unwrap();
        let got = attention::dense_attention_host(
            ctx, &x.q, &x.k, &x.v, &s, layout, causal, scale, storage,
        )
        .unwrap();
        let what = format!("{s:?} {layout:?} {storage:?} causal {causal} seed {seed}");
        check(&what, (&got.0, &got.1), (&ro, &rl), storage);
    }
}

/// Every row selects only its own block; the query at position 0 then sees a single key, so
/// its output is exactly V's first row and its LSE the one scaled score. A row selecting
/// nothing gets zeros and -inf, like the reference.
#[test]
fn single_key_and_empty_rows() {
    let ctx = ctx();
    let seed = seed("single key");
    let mut r = rng(seed);
    let (c, kk) = (16, 3);
    let s = AttentionShape::new(1, 2, 1, 40, 40, 64).unwrap();
    let cfg = SelectionConfig::new(c, kk).unwrap();
    let x = inputs(&mut r, &s, Storage::F32);
    let mut sel = Vec::new();
    for i in 0..s.q_len {
        sel.extend([(i / c) as i32, -1, -1]);
    }
    let (ro, rl) = reference::sparse_attention(&x.q, &x.k, &x.v, &s, Bhnd, &cfg, &sel).unwrap();
    let (o, l) =
        attention::sparse_attention_host(ctx, &x.q, &x.k, &x.v, &s, Bhnd, &cfg, Storage::F32, &sel)
            .unwrap();
    check(
        &format!("own block only, seed {seed}"),
        (&o, &l),
        (&ro, &rl),
        Storage::F32,
    );
    for h in 0..2 {
        let row = &o[h * 40 * 64..h * 40 * 64 + 64];
        let e = rel_err(
            row,
            &x.v[..64].iter().map(|&y| y as f64).collect::<Vec<_>>(),
        );
        assert!(
            e < 1e-6,
            "head {h}: single-key output is not V[0] (rel err {e})"
        );
        let score: f64 = (0..64)
            .map(|dd| x.q[h * 40 * 64 + dd] as f64 * x.k[dd] as f64)
            .sum::<f64>()
            / 8.0;
        assert!(
            (l[h * 40] as f64 - score).abs() < 1e-5,
            "head {h}: LSE {} vs {score}",
            l[h * 40]
        );
    }
    // Row 5 selects nothing.
    sel[5 * kk] = -1;
    let (o, l) =
        attention::sparse_attention_host(ctx, &x.q, &x.k, &x.v, &s, Bhnd, &cfg, Storage::F32, &sel)
            .unwrap();
    for h in 0..2 {
        assert_eq!(l[h * 40 + 5], f32::NEG_INFINITY, "empty row LSE");
        assert!(
            o[(h * 40 + 5) * 64..][..64].iter().all(|&y| y == 0.0),
            "empty row O"
        );
        assert!(
            l.iter()
                .enumerate()
                .all(|(i, y)| i % 40 == 5 || y.is_finite()),
            "unwritten LSE"
        );
        assert!(o.iter().all(|y| y.is_finite()), "unwritten O");
    }
}

/// A lowered binding limit splits the call into (batch, KV head) chunks with the same result,
/// bit for bit; a limit below one pair's slice is a typed error.
#[test]
fn split_path_is_identical() {
    let ctx = Context::new(&AdapterChoice::HighPerformance).expect("a GPU adapter");
    let seed = seed("split");
    let mut r = rng(seed);
    let s = AttentionShape::new(2, 6, 3, 40, 40, 64).unwrap();
    let cfg = SelectionConfig::new(16, 2).unwrap();
    let x = inputs(&mut r, &s, Storage::F32);
    let sel = random_selection(&mut r, &s, &cfg);
    for layout in [Bhnd, Bnhd] {
        let whole = attention::sparse_attention_host(
            &ctx,
            &x.q,
            &x.k,
            &x.v,
            &s,
            layout,
            &cfg,
            Storage::F32,
            &sel,
        )
        .unwrap();
        let dense = attention::dense_attention_host(
            &ctx,
            &x.q,
            &x.k,
            &x.v,
            &s,
            layout,
            true,
            0.2,
            Storage::F32,
        )
        .unwrap();
        // One pair's Q slice is 2 * 40 * 64 * 4 = 20480 bytes: chunks of 3 pairs (whole
        // sequences), then 2 (head ranges of one sequence).
        for limit in [3 * 20480, 2 * 20480] {
            ctx.set_max_binding_bytes(limit);
            let split = attention::sparse_attention_host(
                &ctx,
                &x.q,
                &x.k,
                &x.v,
                &s,
                layout,
                &cfg,
                Storage::F32,
                &sel,
            )
            .unwrap();
            assert!(
                split == whole,
                "sparse split at {limit} bytes differs ({layout:?}, seed {seed})"
            );
            let split = attention::dense_attention_host(
                &ctx,
                &x.q,
                &x.k,
                &x.v,
                &s,
                layout,
                true,
                0.2,
                Storage::F32,
            )
            .unwrap();
            assert!(
                split == dense,
                "dense split at {limit} bytes differs ({layout:?}, seed {seed})"
            );
            ctx.set_max_binding_bytes(u64::MAX);
        }
    }
    ctx.set_max_binding_bytes(20000);
    let e = attention::sparse_attention_host(
        &ctx,
        &x.q,
        &x.k,
        &x.v,
        &s,
        Bhnd,
        &cfg,
        Storage::F32,
        &sel,
    );
    assert!(matches!(e, Err(GpuError::Limit { .. })), "{e:?}");
}

#[test]
fn invalid_inputs_are_typed_errors() {
    let ctx = ctx();
    let s = AttentionShape::new(1, 2, 1, 8, 8, 66).unwrap();
    let cfg = SelectionConfig::new(4, 2).unwrap();
    let q = vec![0.5; s.q_elems()];
    let kv = vec![0.5; s.kv_elems()];
    let e = attention::dense_attention_host(ctx, &q, &kv, &kv, &s, Bhnd, true, 0.1, Storage::F32);
    assert!(
        matches!(
            e,
            Err(GpuError::Input(pisa_core::PisaError::HeadDim { .. }))
        ),
        "{e:?}"
    );
    let s = AttentionShape::new(1, 2, 1, 8, 8, 64).unwrap();
    let q = vec![0.5; s.q_elems()];
    let kv = vec![0.5; s.kv_elems()];
    let e =
        attention::sparse_attention_host(ctx, &q, &kv, &kv, &s, Bhnd, &cfg, Storage::F32, &[0; 3]);
    assert!(
        matches!(
            e,
            Err(GpuError::Input(pisa_core::PisaError::BufferLen { .. }))
        ),
        "{e:?}"
    );
    let e =
        attention::dense_attention_host(ctx, &q[1..], &kv, &kv, &s, Bhnd, true, 0.1, Storage::F32);
    assert!(
        matches!(
            e,
            Err(GpuError::Input(pisa_core::PisaError::BufferLen { .. }))
        ),
        "{e:?}"
    );
}
