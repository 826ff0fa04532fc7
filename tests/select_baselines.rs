//! GPU BSA selection against `select_bsa` and the GPU oracle (mass and selection) against
//! `block_mass` / `select_oracle`.
mod common;
#[path = "select_util.rs"]
mod select_util;

use common::*;
use pisa_core::reference::{block_mass, select_bsa, select_oracle};
use pisa_core::TensorLayout::*;
use pisa_wgpu::ops::select::{oracle_host, select_host, Method};
use pisa_wgpu::GpuError;
use pisa_wgpu::Storage::{self, *};
use select_util::{check, report, Case};

fn skip_f16(name: &str, s: Storage) -> bool {
    let skip = s == F16 && !ctx().has_f16();
    if skip {
        eprintln!("{name}: skipped (adapter has no SHADER_F16)");
    }
    skip
}

#[test]
fn bsa_matches_reference() {
    let seed = seed("bsa_matches_reference");
    let mut r = rng(seed);
    let base = Case::new(2, 2, 2, 1000, 64, 8, 6);
    let cases = [
        ("gq1 d64 C8 K6 b2 (125 leaves, two chunks)", base),
        (
            "gq3 d128 C4 K16 sink1 local2 bnhd (250 leaves)",
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                d: 128,
                c: 4,
                k: 16,
                sink: 1,
                local: 2,
                layout: Bnhd,
                ..base
            },
        ),
        (
            "gq8 d80 non-causal f16",
            Case {
                b: 1,
                hq: 8,
                hkv: 1,
                nq: 301,
                nk: 301,
                d: 80,
                c: 16,
                k: 4,
                causal: false,
                storage: F16,
                ..base
            },
        ),
        (
            "gq2 d96 decode-like nq 9 of nk 700, local1",
            Case {
                hq: 4,
                nq: 9,
                nk: 700,
                d: 96,
                local: 1,
                ..base
            },
        ),
        (
            "n 1",
            Case {
                nq: 1,
                nk: 1,
                ..base
            },
        ),
        (
            "n 9 (C+1) non-causal",
            Case {
                nq: 9,
                nk: 9,
                k: 2,
                causal: false,
                ..base
            },
        ),
    ];
    for (name, c) in cases {
        if skip_f16(name, c.storage) {
            continue;
        }
        let (q, k) = c.inputs(&mut r);
        let (shape, cfg) = (c.shape(), c.cfg());
        let want = select_bsa(&q, &k, &shape, c.layout, &cfg).unwrap();
        let got = (c.select_gpu(&q, &k, Method::Bsa, 4)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ties = check(name, &got, &want, c.tol(&q, &k));
        report(name, ties, want.rows());
    }
}

/// Regression (found by an embedder's trial): on a device that caps an invocation's loop
/// iterations (llvmpipe: 65535 in all), the BSA kernel ran past the cap over many leaves and
/// returned wrong selections. It now runs smaller query tiles where they fit, and refuses with
/// `Limit` where one query does not. 8 queries over 40,960 keys (2560 leaves of 16, the
/// bench's GQA 4, D 128, K 16: past the cap by the kernel's worst-case count with the whole
/// tile, within it with one query) match the reference everywhere; 70,000 leaves of one key
/// (D 16, K 4; wrong rows before the fix) match it on a device without a cap and are a
/// `Limit` error on one with it.
#[test]
fn bsa_over_many_leaves_within_the_loop_limit() {
    let mut r = rng(seed("bsa_over_many_leaves_within_the_loop_limit"));
    let many = Case {
        nq: 8,
        nk: 40_960,
        ..Case::new(1, 4, 1, 0, 128, 16, 16)
    };
    let past = Case {
        nq: 2,
        nk: 70_000,
        ..Case::new(1, 1, 1, 0, 16, 1, 4)
    };
    for (name, c, fits) in [("2560 leaves", many, true), ("70000 leaves", past, false)] {
        let (q, k) = c.inputs(&mut r);
        let (shape, cfg) = (c.shape(), c.cfg());
        let got = c.select_gpu(&q, &k, Method::Bsa, 4);
        if !fits && ctx().loop_limit().is_some() {
            let e = got.unwrap_err();
            assert!(matches!(e, GpuError::Limit { .. }), "{name}: {e}");
            continue;
        }
        let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = select_bsa(&q, &k, &shape, c.layout, &cfg).unwrap();
        let ties = check(name, &got, &want, c.tol(&q, &k));
        report(name, ties, want.rows());
    }
}

#[test]
fn oracle_matches_reference() {
    let seed = seed("oracle_matches_reference");
    let mut r = rng(seed);
    let base = Case::new(2, 4, 2, 300, 64, 8, 6);
    let cases = [
        ("gq2 d64 C8 K6 b2", base),
        (
            "gq3 d128 non-causal bnhd f16",
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                nq: 203,
                nk: 203,
                d: 128,
                c: 16,
                k: 4,
                causal: false,
                layout: Bnhd,
                storage: F16,
                ..base
            },
        ),
        (
            "gq7 d80 decode-like nq 5 of nk 400",
            Case {
                b: 1,
                hq: 7,
                hkv: 1,
                nq: 5,
                nk: 400,
                d: 80,
                ..base
            },
        ),
        (
            "n 7 (C-1)",
            Case {
                nq: 7,
                nk: 7,
                ..base
            },
        ),
    ];
    for (name, c) in cases {
        if skip_f16(name, c.storage) {
            continue;
        }
        let (q, k) = c.inputs(&mut r);
        let (shape, cfg) = (c.shape(), c.cfg());
        let want_mass = block_mass(&q, &k, &shape, c.layout, &cfg).unwrap();
        let want = select_oracle(&q, &k, &shape, c.layout, &cfg).unwrap();
        let (got, mass) = oracle_host(ctx(), &q, &k, &shape, c.layout, &cfg, c.storage)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let e = rel_err(&mass, &want_mass);
        assert!(e < 1e-4, "{name}: mass rel err {e} (seed {seed})");
        // Masses are probabilities: the f32 sums are good to ~1e-6 absolute.
        let ties = check(name, &got, &want, 2e-6);
        report(name, ties, want.rows());
        let only = select_host(
            ctx(),
            &q,
            &k,
            &shape,
            c.layout,
            &cfg,
            c.storage,
            Method::Oracle,
            4,
        )
        .unwrap();
        assert_eq!(only, got, "{name}: select(Oracle) differs from oracle_host");
    }
}

/// The oracle over many leaves (7500 leaves of one key, K 16 and 64): its top-k pass ranked every
/// leaf against every other, past llvmpipe's 65535 loop iterations an invocation, and came out
/// wrong there with no error (`pisa recall --block-size 1 --tokens 7500`); it now picks the top
/// K in K rounds and matches the reference. Where the device caps an invocation's loops
/// (llvmpipe), an oracle past the cap (16384 keys at D 128) is a `Limit` error; elsewhere it
/// runs (not checked against the reference there: too long on the CPU).
#[test]
fn oracle_over_many_leaves_is_right_or_refused() {
    let mut r = rng(seed("oracle_over_many_leaves"));
    let base = Case::new(1, 1, 1, 96, 16, 1, 16);
    for k in [16, 64] {
        let c = Case {
            nk: 7500,
            k,
            ..base
        };
        let (q, kk) = c.inputs(&mut r);
        let (shape, cfg) = (c.shape(), c.cfg());
        let want = select_oracle(&q, &kk, &shape, c.layout, &cfg).unwrap();
        let (got, _) = oracle_host(ctx(), &q, &kk, &shape, c.layout, &cfg, c.storage)
            .unwrap_or_else(|e| panic!("K {k}: {e}"));
        let ties = check("oracle, 7500 leaves", &got, &want, 2e-6);
        report("oracle, 7500 leaves", ties, want.rows());
    }
    let big = Case {
        hq: 4,
        nq: 4,
        nk: 16384,
        d: 128,
        c: 64,
        ..base
    };
    let (q, kk) = big.inputs(&mut r);
    let got = oracle_host(
        ctx(),
        &q,
        &kk,
        &big.shape(),
        big.layout,
        &big.cfg(),
        big.storage,
    );
    match (ctx().loop_limit(), got) {
        (Some(_), Err(GpuError::Limit { unit, .. })) => assert_eq!(unit, "loop iterations"),
        (Some(_), other) => panic!("past the loop limit: {:?}", other.map(|_| ())),
        (None, got) => {
            got.unwrap();
        }
    }
}

/// Where the device caps an invocation's loop iterations (llvmpipe), the oracle at the largest
/// key count it accepts is right: per (GQA group, D, C, K), the count found by bisection on
/// `Ok` against `Limit`, two queries at the end, mass and selection against the reference.
/// (The count had no exit tests and took the loops over a group past 32 heads as unrolled:
/// at D 128, GQA 4 the oracle accepted 16000 keys and its rows summed to 0.992, and at GQA 33
/// over 4000 keys to 0.63, with `Ok`.) Elsewhere there is no cap to test: skipped.
#[test]
fn oracle_at_the_longest_length_it_accepts_is_right() {
    if ctx().loop_limit().is_none() {
        eprintln!("no loop cap on {}: skipped", ctx().report().name);
        return;
    }
    let mut r = rng(seed("oracle_at_the_longest_length"));
    for (gq, d, c, k) in [
        (4, 128, 64, 16),
        (33, 16, 64, 4),
        (8, 32, 16, 8),
        (1, 16, 64, 4),
    ] {
        let case = |nk: usize| Case {
            nq: 2,
            nk,
            ..Case::new(1, gq, 1, nk, d, c, k)
        };
        let accepted = |nk: usize| {
            let c = case(nk);
            let q = vec![0.25f32; c.shape().q_elems()];
            let kk = vec![0.5f32; c.shape().kv_elems()];
            match oracle_host(ctx(), &q, &kk, &c.shape(), c.layout, &c.cfg(), c.storage) {
                Ok(_) => true,
                Err(GpuError::Limit {
                    unit: "loop iterations",
                    ..
                }) => false,
                Err(e) => panic!("gqa {gq} d {d} nk {nk}: {e}"),
            }
        };
        let (mut lo, mut hi) = (64, 128);
        while accepted(hi) {
            (lo, hi) = (hi, 2 * hi);
            assert!(hi <= 1 << 22, "gqa {gq} d {d}: no loop limit reached");
        }
        while hi - lo > 1 {
            let m = (lo + hi) / 2;
            if accepted(m) {
                lo = m
            } else {
                hi = m
            }
        }
        let c = case(lo);
        let (q, kk) = c.inputs(&mut r);
        let (shape, cfg) = (c.shape(), c.cfg());
        let name = format!("gqa {gq} d {d} C {c} K {k} at {lo} keys", c = c.c);
        let want_mass = block_mass(&q, &kk, &shape, c.layout, &cfg).unwrap();
        let want = select_oracle(&q, &kk, &shape, c.layout, &cfg).unwrap();
        let (got, mass) = oracle_host(ctx(), &q, &kk, &shape, c.layout, &cfg, c.storage)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let worst = (mass.iter().zip(&want_mass))
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0f64, |m, e| if e > m || e.is_nan() { e } else { m });
        eprintln!("  {name}: mass within {worst:.1e}");
        assert!(worst <= 1e-5, "{name}: mass off by {worst}");
        let ties = check(&name, &got, &want, 2e-6);
        report(&name, ties, want.rows());
    }
}

/// A NaN key row makes every leaf mass of the rows that see it NaN: the oracle then keeps the
/// lowest K leaves of every such row (every mass ties; ties go to the lower leaf), here every
/// row (not causal). The CPU reference refuses such a key (`PisaError::NonFinite`), so the rows
/// are written out. Regression: its NaN test (`m != m`) was an ordered compare on Vulkan, false
/// for NaN, and the rows came out `[0, -1, ...]`.
#[test]
fn oracle_of_a_nan_key_keeps_the_lowest_leaves() {
    let mut r = rng(seed("oracle_nan_key"));
    let c = Case {
        nq: 8,
        causal: false,
        ..Case::new(1, 1, 1, 640, 32, 16, 8)
    };
    let (q, mut kk) = c.inputs(&mut r);
    for x in &mut kk[100 * c.d..101 * c.d] {
        *x = f32::NAN;
    }
    let (shape, cfg) = (c.shape(), c.cfg());
    let e = select_oracle(&q, &kk, &shape, c.layout, &cfg).unwrap_err();
    assert!(
        matches!(e, pisa_core::PisaError::NonFinite { what: "k", .. }),
        "{e:?}"
    );
    let (got, _) = oracle_host(ctx(), &q, &kk, &shape, c.layout, &cfg, c.storage).unwrap();
    let want: Vec<i32> = (0..c.nq).flat_map(|_| 0..c.k as i32).collect();
    assert_eq!(got, want, "oracle with a NaN key row");
}
