//! GPU PISA selection (stage 1 routing + stage 2 leaf scoring) against the CPU reference
//! `select_pisa`, over scorings, causal / non-causal, forced blocks, merge factors, GQA groups,
//! head dims, layouts, storages and query tiles; plus input validation.
mod common;
#[path = "select_util.rs"]
mod select_util;

use common::*;
use pisa_core::reference::select_pisa;
use pisa_core::{PisaError, Scoring, TensorLayout};
use pisa_wgpu::ops::select::{select_host, Method};
use pisa_wgpu::{GpuError, Storage};
use select_util::{check, report, Case};

/// Runs one case with Qtile 4 against the reference; with `tile1`, also Qtile 1 (must be equal).
fn run_case(name: &str, c: Case, r: &mut rand_chacha::ChaCha8Rng, tile1: bool) {
    let ctx = ctx();
    if c.storage == Storage::F16 && !ctx.has_f16() {
        eprintln!("{name}: skipped (adapter has no SHADER_F16)");
        return;
    }
    let (q, k) = c.inputs(r);
    let (shape, cfg) = (c.shape(), c.cfg());
    let t0 = std::time::Instant::now();
    let want = select_pisa(&q, &k, &shape, c.layout, &cfg).unwrap();
    let t_ref = t0.elapsed();
    let run = |tile| {
        select_host(
            ctx,
            &q,
            &k,
            &shape,
            c.layout,
            &cfg,
            c.storage,
            Method::Pisa,
            tile,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let t0 = std::time::Instant::now();
    let got = run(4);
    eprintln!(
        "{name}: reference {t_ref:.2?}, gpu (Qtile 4) {:.2?}",
        t0.elapsed()
    );
    let ties = check(name, &got, &want, c.tol(&q, &k));
    report(name, ties, want.rows());
    if tile1 {
        assert_eq!(got, run(1), "{name}: Qtile 1 and 4 differ");
    }
}

use Scoring::*;
use Storage::*;
use TensorLayout::*;

/// Causal b = 2, Hq = Hkv = 2, N = 1000, D = 64, C = 16, K = 4, g = 2, `lse`, Bhnd, f32.
fn base() -> Case {
    Case::new(2, 2, 2, 1000, 64, 16, 4)
}

#[test]
fn pisa_scorings_groups_and_head_dims() {
    let seed = seed("pisa_scorings_groups_and_head_dims");
    let mut r = rng(seed);
    let base = base();
    let cases = [
        ("gq1 d64 lse b2", base, false),
        (
            "gq2 d80 mean g3 sink+local bnhd",
            Case {
                b: 1,
                hq: 4,
                nq: 600,
                nk: 600,
                d: 80,
                k: 6,
                g: 3,
                scoring: Mean,
                sink: 1,
                local: 1,
                layout: Bnhd,
                ..base
            },
            false,
        ),
        (
            "gq3 d96 meanvar non-causal f16",
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                nq: 700,
                nk: 700,
                d: 96,
                k: 5,
                scoring: MeanVar,
                causal: false,
                storage: F16,
                ..base
            },
            false,
        ),
        (
            "gq4 d128 lse local2 bnhd f16",
            Case {
                b: 1,
                hq: 8,
                nq: 333,
                nk: 333,
                d: 128,
                c: 8,
                k: 8,
                local: 2,
                layout: Bnhd,
                storage: F16,
                ..base
            },
            true,
        ),
        (
            "gq7 d256 lse g3 sink1",
            Case {
                b: 1,
                hq: 7,
                hkv: 1,
                nq: 130,
                nk: 130,
                d: 256,
                c: 8,
                g: 3,
                sink: 1,
                ..base
            },
            false,
        ),
        (
            "gq8 d64 meanvar bnhd b2",
            Case {
                hq: 8,
                hkv: 1,
                nq: 150,
                nk: 150,
                c: 4,
                k: 6,
                scoring: MeanVar,
                layout: Bnhd,
                ..base
            },
            false,
        ),
    ];
    for (name, c, tile1) in cases {
        run_case(name, c, &mut r, tile1);
    }
}

#[test]
fn pisa_lengths_layouts_and_tiles() {
    let seed = seed("pisa_lengths_layouts_and_tiles");
    let mut r = rng(seed);
    let base = base();
    let cases = [
        (
            "decode-like nq 37 of nk 1000, mean, local1, gq2",
            Case {
                hq: 4,
                nq: 37,
                scoring: Mean,
                local: 1,
                ..base
            },
            true,
        ),
        (
            "non-causal lse partial last block bnhd sink1",
            Case {
                b: 1,
                hkv: 1,
                nq: 999,
                nk: 999,
                causal: false,
                sink: 1,
                layout: Bnhd,
                ..base
            },
            true,
        ),
        (
            "n 4099 d32 lse K8",
            Case {
                b: 1,
                hq: 1,
                hkv: 1,
                nq: 4099,
                nk: 4099,
                d: 32,
                k: 8,
                ..base
            },
            false,
        ),
    ];
    for (name, c, tile1) in cases {
        run_case(name, c, &mut r, tile1);
    }
    for n in [1, 15, 17] {
        let c = Case {
            hq: 2,
            hkv: 1,
            nq: n,
            nk: n,
            k: 2,
            ..base
        };
        run_case(&format!("n {n}"), c, &mut r, true);
        let nc = Case { causal: false, ..c };
        run_case(&format!("n {n} non-causal"), nc, &mut r, true);
    }
}

#[test]
fn invalid_inputs_are_typed_errors() {
    let ctx = ctx();
    let c = Case::new(1, 2, 1, 100, 64, 16, 4);
    let (shape, cfg) = (c.shape(), c.cfg());
    let q = vec![0.5f32; shape.q_elems()];
    let k = vec![0.25f32; shape.kv_elems()];
    let run = |q: &[f32], k: &[f32], cfg: &pisa_core::SelectionConfig| {
        select_host(
            ctx,
            q,
            k,
            &shape,
            c.layout,
            cfg,
            Storage::F32,
            Method::Pisa,
            4,
        )
    };
    match run(&q[1..], &k, &cfg) {
        Err(GpuError::Input(PisaError::BufferLen { what: "q", .. })) => {}
        other => panic!("short q: {other:?}"),
    }
    match run(&q, &k[..10], &cfg) {
        Err(GpuError::Input(PisaError::BufferLen { what: "k", .. })) => {}
        other => panic!("short k: {other:?}"),
    }
    let mut bad = cfg;
    bad.sink_blocks = 4;
    match run(&q, &k, &bad) {
        Err(GpuError::Input(PisaError::TopKBelowForced { .. })) => {}
        other => panic!("forced above K: {other:?}"),
    }
    let big = Case::new(1, 1, 1, 4, 600, 16, 4);
    let (s, cf) = (big.shape(), big.cfg());
    let (q, k) = (vec![0.1; s.q_elems()], vec![0.1; s.kv_elems()]);
    match select_host(
        ctx,
        &q,
        &k,
        &s,
        big.layout,
        &cf,
        Storage::F32,
        Method::Bsa,
        4,
    ) {
        Err(GpuError::Input(PisaError::HeadDim { head_dim: 600, .. })) => {}
        other => panic!("head dim 600: {other:?}"),
    }
}

/// Routing code paths: head dims not a multiple of 4 (scalar pyramid loads; an odd number of
/// vec4s gives one lane per candidate, scored without the partial-sum barrier), GQA groups of
/// several head groups (partial scores summed across invocations, up to the 32-head limit),
/// and small candidate lists (the widest query tile, with a partial last tile).
/// `PISA_ROUTE_LANES`, `PISA_ROUTE_TILE`, `PISA_ROUTE_MAX_WG` select other shapes.
#[test]
fn pisa_route_paths() {
    let seed = seed("pisa_route_paths");
    let mut r = rng(seed);
    let base = base();
    let cases = [
        (
            "gq5 d30 meanvar sink1",
            Case {
                b: 1,
                hq: 5,
                hkv: 1,
                nq: 500,
                nk: 500,
                d: 30,
                c: 8,
                k: 6,
                sink: 1,
                scoring: MeanVar,
                ..base
            },
            true,
        ),
        (
            "gq32 d64 lse non-causal",
            Case {
                b: 1,
                hq: 32,
                hkv: 1,
                nq: 300,
                nk: 300,
                c: 8,
                k: 4,
                causal: false,
                ..base
            },
            false,
        ),
        (
            "gq16 d34 mean local1 f16 bnhd",
            Case {
                b: 1,
                hq: 16,
                hkv: 1,
                nq: 400,
                nk: 400,
                d: 34,
                c: 8,
                k: 5,
                local: 1,
                scoring: Mean,
                storage: F16,
                layout: Bnhd,
                ..base
            },
            false,
        ),
        (
            "gq3 d18 lse g3 local1 (one task per candidate)",
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                nq: 450,
                nk: 450,
                d: 18,
                c: 8,
                k: 5,
                g: 3,
                local: 1,
                ..base
            },
            false,
        ),
        (
            "gq1 d6 lse K3 g4 wide tile",
            Case {
                b: 1,
                hq: 2,
                hkv: 2,
                nq: 777,
                nk: 777,
                d: 6,
                c: 4,
                k: 3,
                g: 4,
                ..base
            },
            true,
        ),
    ];
    for (name, c, tile1) in cases {
        run_case(name, c, &mut r, tile1);
    }
}
