//! Tensor-core (cooperative-matrix) attention, PISA.md sections 4 and 5: kernel-path selection
//! (run everywhere: lavapipe without the feature must be Portable), naga validation and SPIR-V
//! generation of the coop shader variants (run everywhere), and the coop kernels against the
//! f64 CPU reference on f16-rounded inputs (tolerance 5e-3; skipped with a message on adapters
//! without cooperative matrices): GQA groups 1 to 32, head dims 64, 80, 96, 128, lengths and
//! block sizes that are not multiples of the key tile, both layouts, causal or not, Nq < Nk. `bench_coop_vs_portable` (ignored) prints GPU-timed TFLOP/s
//! of coop vs portable dense and sparse attention at 16K and 64K tokens.
#[path = "attention_util.rs"]
mod attention_util;
mod common;

use attention_util::{check, inputs, random_selection, sparse_case, Case, Inputs};
use common::*;
use pisa_core::{reference, AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::coop::{self, CoopVariant};
use pisa_wgpu::ops::attention::{self, AttentionKind};
use pisa_wgpu::runtime::context::coop_supported;
use pisa_wgpu::runtime::pipeline::preprocess;
use pisa_wgpu::{Context, KernelPath, LeafOrder, Storage};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use TensorLayout::{Bhnd, Bnhd};

fn coop_ctx(test: &str) -> Option<&'static Context> {
    let ctx = ctx();
    // Ask for CoopMat (the default where supported; kept only where the adapter supports it).
    ctx.set_kernel_path(KernelPath::CoopMat);
    if ctx.kernel_path() != KernelPath::CoopMat {
        skip_unless_required(&format!(
            "{test}: adapter {:?} has no cooperative-matrix path (kernel path {})",
            ctx.report().name,
            ctx.kernel_path()
        ));
        return None;
    }
    Some(ctx)
}

#[test]
fn kernel_path_follows_the_adapter() {
    // A context of its own: the shared one may have been switched to CoopMat by another test.
    let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
    let ctx = &own;
    let r = ctx.report();
    let props = ctx.cooperative_matrix_properties();
    eprintln!(
        "adapter {:?}: coop feature {}, subgroups {:?}, {} coop configs, path {}",
        r.name,
        r.cooperative_matrix,
        r.subgroup_size,
        props.len(),
        ctx.kernel_path()
    );
    for p in props {
        eprintln!("  {p:?}");
    }
    let ok = coop_supported(ctx.features(), ctx.limits(), r.subgroup_size, props);
    let env_coop = std::env::var("PISA_KERNEL_PATH").as_deref() != Ok("portable");
    let want = if ok && env_coop {
        KernelPath::CoopMat
    } else {
        KernelPath::Portable
    };
    assert_eq!(ctx.kernel_path(), want);
    if !r.cooperative_matrix {
        assert_eq!(ctx.kernel_path(), KernelPath::Portable);
        assert!(!ctx
            .features()
            .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX));
    }
    if r.name.to_lowercase().contains("llvmpipe") && !r.cooperative_matrix {
        eprintln!("lavapipe without cooperative matrices: Portable, as it must be");
    }
    // f32 storage never takes the coop path; asking for CoopMat where unsupported keeps Portable.
    let s = AttentionShape::new(1, 4, 1, 64, 64, 64).unwrap();
    let dense = AttentionKind::Dense {
        causal: true,
        scale: 0.125,
    };
    assert_eq!(
        coop::attention_path(ctx, &s, Storage::F32, &dense),
        KernelPath::Portable
    );
    let before = ctx.kernel_path();
    assert_eq!(
        ctx.set_kernel_path(KernelPath::Portable),
        KernelPath::Portable
    );
    assert_eq!(
        coop::attention_path(ctx, &s, Storage::F16, &dense),
        KernelPath::Portable
    );
    assert_eq!(ctx.set_kernel_path(KernelPath::CoopMat), want);
    assert_eq!(ctx.set_kernel_path(before), before);
    // Path and shape: D 256 and D 72 stay portable even on CoopMat.
    let s256 = AttentionShape::new(1, 4, 1, 64, 64, 256).unwrap();
    let s72 = AttentionShape::new(1, 4, 1, 64, 64, 72).unwrap();
    for sh in [s256, s72] {
        assert_eq!(
            coop::attention_path(ctx, &sh, Storage::F16, &dense),
            KernelPath::Portable
        );
    }
}

fn variants() -> Vec<CoopVariant> {
    let mut out = Vec::new();
    for (hd, rb, kt, qt, gh, selk, sg) in [
        (128, 1, 64, 4, 4, 16, 32),
        (128, 2, 64, 4, 8, 16, 32),
        (64, 1, 32, 16, 1, 8, 32),
        (128, 4, 32, 16, 4, 1, 32),
        (64, 4, 32, 64, 1, 1, 32),
        (80, 2, 16, 8, 3, 1, 8),
        (96, 1, 48, 4, 4, 3, 16),
        (128, 4, 16, 4, 16, 4, 64),
    ] {
        out.push(CoopVariant {
            hd,
            rb,
            kt,
            qt,
            gh,
            selk,
            sg,
            prefetch: out.len() % 2 == 0,
            direct: out.len() % 3 == 1,
        });
    }
    out
}

/// naga parses and validates every coop variant (f16 only; the cooperative-matrix capability
/// enabled) and writes SPIR-V for it (the path wgpu takes on Vulkan).
#[test]
fn coop_shader_validates_and_writes_spirv() {
    for v in variants() {
        let src = preprocess(&coop::SHADER, Storage::F16, &v.consts()).unwrap();
        assert_spirv(&format!("{v:?}"), &src, &["sparse", "dense"]);
        eprintln!("  {v:?}: {} bytes of workgroup memory", v.shared_bytes());
    }
}

#[test]
fn coop_sparse_matches_reference() {
    // The query-tile kernel of attention_coop.wgsl (under the default order, f16 sparse
    // attention on tensor cores runs leaf-major: tests/attention_by_leaf.rs).
    let _settings = settings_lock();
    let Some(ctx) = coop_ctx("coop_sparse_matches_reference") else {
        return;
    };
    ctx.set_leaf_order(LeafOrder::Tiles);
    let seed = seed("coop sparse");
    let mut r = rng(seed);
    // (B, Hq, Hkv, Nq, Nk, D, C, K, layout, storage, causal, selection from PISA)
    const F16: Storage = Storage::F16;
    let cases: &[Case] = &[
        (2, 8, 2, 200, 200, 64, 64, 4, Bhnd, F16, true, true),
        (2, 4, 4, 150, 150, 128, 32, 3, Bnhd, F16, true, false),
        (1, 16, 2, 131, 131, 128, 48, 3, Bhnd, F16, false, false),
        (2, 8, 1, 97, 97, 64, 64, 2, Bnhd, F16, true, true),
        (1, 8, 1, 40, 203, 128, 20, 5, Bhnd, F16, true, false),
        (1, 12, 1, 33, 70, 64, 16, 3, Bnhd, F16, true, false),
        (2, 4, 1, 90, 90, 80, 64, 3, Bhnd, F16, true, false),
        (1, 4, 1, 1, 1, 64, 64, 1, Bhnd, F16, true, true),
    ];
    for &case in cases {
        let (.., c, kk, layout, _, causal, pisa) = case;
        let (s, cfg, Inputs { q, k, v }, sel) = sparse_case(&mut r, case);
        let kind_sel = ctx.upload_u32("sel", &sel).unwrap();
        let kind = AttentionKind::Sparse {
            selection: &kind_sel,
            cfg: &cfg,
        };
        assert_eq!(
            coop::attention_path(ctx, &s, Storage::F16, &kind),
            KernelPath::CoopMat,
            "{s:?} C {c} should run on cooperative matrices ({:?})",
            coop::plan(ctx, &s, &kind)
        );
        let (ro, rl) = reference::sparse_attention(&q, &k, &v, &s, layout, &cfg, &sel).unwrap();
        let got =
            attention::sparse_attention_host(ctx, &q, &k, &v, &s, layout, &cfg, Storage::F16, &sel)
                .unwrap();
        let what = format!(
            "{s:?} C {c} K {kk} {layout:?} causal {causal} pisa {pisa} {:?} seed {seed}",
            coop::plan(ctx, &s, &kind).unwrap()
        );
        check(&what, (&got.0, &got.1), (&ro, &rl), Storage::F16);
    }
}

#[test]
fn coop_dense_matches_reference() {
    let Some(ctx) = coop_ctx("coop_dense_matches_reference") else {
        return;
    };
    let seed = seed("coop dense");
    let mut r = rng(seed);
    // (B, Hq, Hkv, Nq, Nk, D, layout, causal, scale)
    let cases = [
        (2, 4, 1, 77, 77, 64, Bhnd, true, 0.125),
        (1, 8, 2, 130, 130, 128, Bnhd, true, 0.0884),
        (2, 8, 1, 65, 65, 128, Bhnd, false, 0.0884),
        (1, 2, 2, 50, 130, 64, Bnhd, true, 0.2),
        (1, 3, 1, 100, 100, 96, Bhnd, true, 0.1),
        (1, 4, 1, 70, 70, 80, Bnhd, true, 0.1),
        (1, 32, 1, 20, 33, 64, Bnhd, false, 0.125),
        (1, 1, 1, 1, 1, 64, Bhnd, true, 0.125),
    ];
    for (b, hq, hkv, nq, nk, d, layout, causal, scale) in cases {
        let s = AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
        let Inputs { q, k, v } = inputs(&mut r, &s, Storage::F16);
        let kind = AttentionKind::Dense { causal, scale };
        assert_eq!(
            coop::attention_path(ctx, &s, Storage::F16, &kind),
            KernelPath::CoopMat
        );
        let (ro, rl) = reference::dense_attention(&q, &k, &v, &s, layout, causal, scale).unwrap();
        let got = attention::dense_attention_host(
            ctx,
            &q,
            &k,
            &v,
            &s,
            layout,
            causal,
            scale,
            Storage::F16,
        )
        .unwrap();
        let what = format!(
            "{s:?} {layout:?} causal {causal} {:?} seed {seed}",
            coop::plan(ctx, &s, &kind).unwrap()
        );
        check(&what, (&got.0, &got.1), (&ro, &rl), Storage::F16);
    }
}

/// Large score ranges: the lazy rescale must fire (keys whose scores grow along the sequence,
/// so the running max keeps moving by more than 2^8) and stay exact.
#[test]
fn coop_rescale_with_growing_scores() {
    // The query-tile kernel of attention_coop.wgsl (under the default order, f16 sparse
    // attention on tensor cores runs leaf-major: tests/attention_by_leaf.rs).
    let _settings = settings_lock();
    let Some(ctx) = coop_ctx("coop_rescale_with_growing_scores") else {
        return;
    };
    ctx.set_leaf_order(LeafOrder::Tiles);
    let seed = seed("coop rescale");
    let mut r = rng(seed);
    let s = AttentionShape::new(1, 4, 1, 300, 300, 64).unwrap();
    let Inputs { mut q, mut k, v } = inputs(&mut r, &s, Storage::F16);
    // Q positive-ish, K growing with the position: scores rise by ~40 (natural log) over the
    // sequence, far beyond the lazy threshold.
    for x in q.iter_mut() {
        *x = half::f16::from_f32(x.abs() * 0.5 + 0.5).to_f32();
    }
    for (i, x) in k.iter_mut().enumerate() {
        let t = (i / s.head_dim) % s.k_len;
        *x = half::f16::from_f32(x.abs() * 0.2 + t as f32 / 60.0).to_f32();
    }
    for causal in [true, false] {
        let (ro, rl) = reference::dense_attention(&q, &k, &v, &s, Bhnd, causal, 0.125).unwrap();
        let got =
            attention::dense_attention_host(ctx, &q, &k, &v, &s, Bhnd, causal, 0.125, Storage::F16)
                .unwrap();
        check(
            &format!("dense growing scores causal {causal} seed {seed}"),
            (&got.0, &got.1),
            (&ro, &rl),
            Storage::F16,
        );
        let cfg = SelectionConfig::new(32, 4).unwrap().with_causal(causal);
        let sel = random_selection(&mut r, &s, &cfg);
        let (ro, rl) = reference::sparse_attention(&q, &k, &v, &s, Bhnd, &cfg, &sel).unwrap();
        let got =
            attention::sparse_attention_host(ctx, &q, &k, &v, &s, Bhnd, &cfg, Storage::F16, &sel)
                .unwrap();
        check(
            &format!("sparse growing scores causal {causal} seed {seed}"),
            (&got.0, &got.1),
            (&ro, &rl),
            Storage::F16,
        );
    }
}

#[path = "coopmat_bench.rs"]
mod bench;
