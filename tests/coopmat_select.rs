//! Tensor-core (cooperative-matrix) stage 2 of PISA selection (leaf scoring, PISA.md sections
//! 2, 3 and 5; the tile kernel `shaders/leaf_select_coop.wgsl` and the leaf-major scorer
//! `shaders/leaf_score_coop.wgsl`, each case run in both orders): naga validation and SPIR-V generation of its
//! variants and the kernel-path choice (run everywhere), and the coop selection against the f64
//! CPU reference on f16-rounded inputs (on adapters with cooperative matrices; skipped with a
//! message elsewhere): GQA groups 1, 2, 3, 4, 7, 8 and 16, head dims 64, 80, 96 and 128, block
//! sizes 16, 20, 64 and 100 (not all multiples of the 16-key tile), lengths that are not
//! multiples of the block, both layouts, forced blocks, causal and not, Nq < Nk. Rows may differ
//! from the reference only where its margin is a near-tie (`select_util::check`).
mod common;
#[path = "select_util.rs"]
mod select_util;

use common::*;
use pisa_core::reference::select_pisa;
use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::leaf_select::by_leaf;
use pisa_wgpu::ops::leaf_select::{coop, leaf_path};
use pisa_wgpu::ops::select::{select_host, Method};
use pisa_wgpu::runtime::pipeline::preprocess;
use pisa_wgpu::{KernelPath, LeafOrder, Storage};
use select_util::{check, report, Case};

fn variants() -> Vec<coop::LeafCoopVariant> {
    let mut out = Vec::new();
    for (gq, qt, mc, hd, ct, lpi, sg) in [
        (4, 4, 34, 128, 4, 2, 32),
        (1, 4, 34, 64, 4, 1, 32),
        (2, 8, 10, 80, 1, 4, 32),
        (3, 5, 12, 96, 2, 3, 8),
        (7, 2, 34, 128, 7, 2, 64),
        (8, 2, 27, 64, 8, 1, 16),
        (16, 1, 34, 128, 4, 2, 32),
    ] {
        out.push(coop::LeafCoopVariant {
            gq,
            qt,
            mc,
            hd,
            ct,
            lpi,
            sg,
        });
    }
    out
}

/// naga parses and validates every variant (f16, the cooperative-matrix capability enabled) and
/// writes SPIR-V for it (the path wgpu takes on Vulkan).
#[test]
fn leaf_coop_shader_validates_and_writes_spirv() {
    for v in variants() {
        let src = preprocess(&coop::SHADER, Storage::F16, &v.consts()).unwrap();
        assert_spirv(&format!("{v:?}"), &src, &["leaf_select"]);
        // The leaf-major scorer with the same constants, 2 or 4 subgroups (chunks of
        // 16 * NSG / g_q entries; SG >= 16), keys direct or staged.
        for (nsg, kstage) in [(2, 0), (2, 1), (4, 0), (4, 1)] {
            if v.sg < 16 || v.gq > 16 * nsg || (kstage == 1 && v.ct > nsg) {
                continue;
            }
            let consts = [
                ("GQ", v.gq),
                ("QPC", 16 * nsg / v.gq),
                ("MC", v.mc),
                ("HD", v.hd),
                ("CT", v.ct),
                ("SG", v.sg),
                ("NSG", nsg),
                ("KSTAGE", kstage),
            ];
            let src = preprocess(&by_leaf::SCORE_COOP_SHADER, Storage::F16, &consts).unwrap();
            assert_spirv(
                &format!("leaf_score_coop {v:?} NSG {nsg}"),
                &src,
                &["leaf_score"],
            );
        }
        eprintln!("  {v:?}: {} bytes of workgroup memory", v.shared_bytes());
    }
}

/// The coop leaf scorer runs exactly for f16 storage, head dims that are multiples of 16 up to
/// 128 and GQA groups up to 16, on a CoopMat context; everything else (and every adapter
/// without cooperative matrices, lavapipe included) is Portable.
#[test]
fn leaf_path_follows_shape_and_adapter() {
    let _settings = settings_lock();
    let ctx = ctx();
    let before = ctx.kernel_path();
    let coop_on = ctx.set_kernel_path(KernelPath::CoopMat) == KernelPath::CoopMat;
    let cfg = SelectionConfig::new(64, 16).unwrap();
    let sh = |hq, d| AttentionShape::new(1, hq, 1, 100, 100, d).unwrap();
    let want = if coop_on {
        KernelPath::CoopMat
    } else {
        KernelPath::Portable
    };
    for (hq, d) in [(4, 128), (1, 64), (16, 80), (7, 96)] {
        assert_eq!(
            leaf_path(ctx, &sh(hq, d), &cfg, Storage::F16, 4),
            want,
            "{hq} {d}"
        );
        assert_eq!(
            leaf_path(ctx, &sh(hq, d), &cfg, Storage::F32, 4),
            KernelPath::Portable
        );
    }
    for (hq, d) in [(4, 72), (4, 256), (20, 64), (32, 128)] {
        assert_eq!(
            leaf_path(ctx, &sh(hq, d), &cfg, Storage::F16, 4),
            KernelPath::Portable
        );
    }
    // Fewer than 16 keys: the kernel's 16-key tiles would not fit; portable.
    let short = AttentionShape::new(1, 4, 1, 12, 12, 64).unwrap();
    let c2 = SelectionConfig::new(2, 2).unwrap();
    assert_eq!(
        leaf_path(ctx, &short, &c2, Storage::F16, 4),
        KernelPath::Portable
    );
    ctx.set_kernel_path(KernelPath::Portable);
    assert_eq!(
        leaf_path(ctx, &sh(4, 128), &cfg, Storage::F16, 4),
        KernelPath::Portable
    );
    ctx.set_kernel_path(before);
}

#[test]
fn leaf_coop_matches_reference() {
    let _settings = settings_lock();
    let ctx = ctx();
    let before = ctx.kernel_path();
    if ctx.set_kernel_path(KernelPath::CoopMat) != KernelPath::CoopMat {
        ctx.set_kernel_path(before);
        skip_unless_required(&format!(
            "leaf_coop_matches_reference: adapter {:?} has no cooperative-matrix path",
            ctx.report().name
        ));
        return;
    }
    let mut r = rng(seed("leaf_coop_matches_reference"));
    let base = Case {
        storage: Storage::F16,
        ..Case::new(1, 4, 1, 1000, 128, 64, 16)
    };
    let cases = [
        ("gq4 d128 C64 K16", base),
        (
            "gq1 d64 C16 K6 b2 bnhd",
            Case {
                b: 2,
                hq: 2,
                hkv: 2,
                d: 64,
                c: 16,
                k: 6,
                layout: TensorLayout::Bnhd,
                ..base
            },
        ),
        (
            "gq2 d80 C20 K5 sink1 local1",
            Case {
                hq: 4,
                hkv: 2,
                nq: 777,
                nk: 777,
                d: 80,
                c: 20,
                k: 5,
                sink: 1,
                local: 1,
                ..base
            },
        ),
        (
            "gq3 d96 C64 K8 g3 non-causal",
            Case {
                hq: 3,
                nq: 900,
                nk: 900,
                d: 96,
                k: 8,
                g: 3,
                causal: false,
                ..base
            },
        ),
        (
            "gq7 d128 C100 K4",
            Case {
                hq: 7,
                nq: 1500,
                nk: 1500,
                c: 100,
                k: 4,
                ..base
            },
        ),
        (
            "gq8 d64 C32 K8 mean Nq<Nk",
            Case {
                hq: 8,
                nq: 300,
                nk: 1100,
                d: 64,
                c: 32,
                k: 8,
                scoring: Scoring::Mean,
                ..base
            },
        ),
        (
            "gq16 d128 C64 K4 bnhd",
            Case {
                hq: 16,
                nq: 600,
                nk: 600,
                k: 4,
                layout: TensorLayout::Bnhd,
                ..base
            },
        ),
    ];
    for (name, c) in cases {
        let (q, k) = c.inputs(&mut r);
        let (shape, cfg) = (c.shape(), c.cfg());
        assert_eq!(
            leaf_path(ctx, &shape, &cfg, Storage::F16, 4),
            KernelPath::CoopMat,
            "{name}"
        );
        let want = select_pisa(&q, &k, &shape, c.layout, &cfg).unwrap();
        for (order, tile) in [
            (LeafOrder::Tiles, 4),
            (LeafOrder::Tiles, 1),
            (LeafOrder::Leaves, 4),
        ] {
            ctx.set_leaf_order(order);
            let got = select_host(
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
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            let what = format!("{name} {order:?} Qtile {tile}");
            let ties = check(&what, &got, &want, c.tol(&q, &k));
            report(&what, ties, want.rows());
        }
    }
    ctx.set_leaf_order(LeafOrder::Auto);
    ctx.set_kernel_path(before);
}

/// A partial last leaf whose few keys dominate every query (non-causal, so every query may pick
/// it): the coop kernel loads that leaf's last 16-key tile clamped back into the sequence, and
/// must still count exactly its keys. Every row must equal the reference (which picks the leaf)
/// up to rare near-ties of rounding among the other leaves, and hold the last leaf exactly where
/// the reference does, in both stage-2 orders, on whatever path the adapter runs (the portable
/// kernels on lavapipe).
#[test]
fn partial_last_leaf_is_scored_on_its_own_keys() {
    let _settings = settings_lock();
    let ctx = ctx();
    if !ctx.has_f16() {
        eprintln!(
            "{}: no SHADER_F16: this f16 test is skipped",
            ctx.report().name
        );
        return;
    }
    let mut r = rng(seed("partial_last_leaf_is_scored_on_its_own_keys"));
    for (n, c) in [(165, 16), (300, 20), (1000, 64)] {
        let case = Case {
            causal: false,
            storage: Storage::F16,
            ..Case::new(1, 4, 1, n, 64, c, 3)
        };
        let (mut q, mut k) = case.inputs(&mut r);
        let (shape, cfg) = (case.shape(), case.cfg());
        // A direction u shared by every query (q += u) and the last leaf's keys = 2u, so that
        // leaf's mass dominates every row.
        let u = random(&mut r, 64, 1.0);
        for (i, x) in q.iter_mut().enumerate() {
            *x = half::f16::from_f32(*x + u[i % 64]).to_f32();
        }
        let last = (n - 1) / c * c;
        for t in last..n {
            for d in 0..64 {
                k[t * 64 + d] = half::f16::from_f32(2.0 * u[d]).to_f32();
            }
        }
        let want = select_pisa(&q, &k, &shape, case.layout, &cfg).unwrap();
        let nb = n.div_ceil(c) as i32;
        let picked = (0..want.rows())
            .filter(|&i| want.row(i).contains(&(nb - 1)))
            .count();
        assert!(
            picked * 2 > want.rows(),
            "n {n} C {c}: the last leaf must dominate"
        );
        for order in [LeafOrder::Tiles, LeafOrder::Leaves] {
            ctx.set_leaf_order(order);
            let got = select_host(
                ctx,
                &q,
                &k,
                &shape,
                case.layout,
                &cfg,
                case.storage,
                Method::Pisa,
                4,
            )
            .unwrap();
            let what = format!("n {n} C {c} {order:?}");
            // Rows may differ where the reference's K-th and (K+1)-th scores tie within
            // rounding (`check`: the reference's margin under the tolerance), among the other
            // leaves; the last leaf, whose few keys dominate, is in exactly the rows where the
            // reference has it: a kernel that scored it on more or fewer keys would miss it or
            // keep it in rows of its own.
            let ties = check(&what, &got, &want, case.tol(&q, &k));
            report(&what, ties, want.rows());
            let top_k = want.top_k;
            for i in 0..want.rows() {
                let gpu_has = got[i * top_k..(i + 1) * top_k].contains(&(nb - 1));
                assert_eq!(
                    gpu_has,
                    want.row(i).contains(&(nb - 1)),
                    "{what}: row {i}: the last leaf"
                );
            }
        }
        ctx.set_leaf_order(LeafOrder::Auto);
        eprintln!(
            "n {n} C {c}: {} of {} rows pick the last leaf; path {}",
            picked,
            want.rows(),
            leaf_path(ctx, &shape, &cfg, Storage::F16, 4)
        );
    }
}
