//! GPU block-sparse and dense attention (PISA.md section 4) against the f64 CPU reference:
//! selections from the reference PISA selector and random valid ones, GQA groups 1..32, head
//! dims 64..256, both layouts, f32, f16 and bf16 storage, causal and not, and forced small tilings.
//! Tolerance: relative L2 error of O and LSE at most 1e-4 (f32 storage) or 5e-3 (f16, against the
//! reference on f16-rounded inputs), and no element non-finite (outputs start poisoned, so an
//! unwritten one fails); see `attention_util.rs`. Single-key and empty rows, the binding-size
//! split path and typed errors are in `attention_edge.rs`.
#[path = "attention_util.rs"]
mod attention_util;
mod common;

use attention_util::{check, inputs, random_selection, skip_f16, sparse_case, Case};
use common::*;
use pisa_core::{reference, AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::{self, coop, AttentionKernel, AttentionKind, QkvLayouts, Tiling};
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::{AdapterChoice, Context, KernelPath, LeafOrder, Storage};
use TensorLayout::{Bhnd, Bnhd};

#[test]
fn sparse_matches_reference() {
    let ctx = ctx();
    let seed = seed("sparse");
    let mut r = rng(seed);
    use Storage::{Bf16, F16, F32};
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
        // Long blocks: C far above Nk (one block, the whole sequence: only the keys that exist
        // are walked), and two blocks both selected, non-causal (the second block's tiles past
        // Nk are not walked either). Larger ones meet lavapipe's loop limit
        // (tests/lavapipe_loops.rs).
        (1, 3, 1, 128, 128, 64, 4096, 1, Bhnd, F32, true, true),
        (1, 2, 1, 100, 100, 64, 4096, 2, Bnhd, F32, false, false),
        (1, 1, 1, 64, 4112, 64, 4096, 2, Bhnd, F32, false, false),
        // A large top_k at D 16 (workgroups of 4 invocations): the union of 4 queries' 160
        // entries alone passed lavapipe's 65535 loop iterations per invocation, so the tile
        // kernel returned wrong rows there; the host now halves the query tile until the
        // kernel's count fits (Context::loop_limit).
        (1, 1, 1, 256, 256, 16, 1, 160, Bhnd, F32, true, false),
        // bf16 storage: the kernels read the 16-bit words and widen them (f32 tolerance).
        (2, 6, 2, 70, 70, 64, 16, 3, Bnhd, Bf16, true, true),
        (1, 8, 1, 45, 45, 128, 32, 2, Bhnd, Bf16, true, false),
    ];
    for &case in cases {
        let (.., c, kk, layout, storage, causal, pisa) = case;
        if skip_f16(ctx, storage) {
            continue;
        }
        let (s, cfg, x, sel) = sparse_case(&mut r, case);
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
            let (o, l) = record_tiled(ctx, [&qt, &kt, &vt], &s, Bnhd, &kind, tiling).unwrap();
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

/// Records and submits one attention call of the tile kernel with `tiling`; returns (O, LSE).
fn record_tiled(
    ctx: &Context,
    [q, k, v]: [&pisa_wgpu::GpuTensor; 3],
    s: &AttentionShape,
    layout: TensorLayout,
    kind: &AttentionKind<'_>,
    tiling: Tiling,
) -> pisa_wgpu::Result<(pisa_wgpu::GpuTensor, pisa_wgpu::GpuTensor)> {
    ctx.scoped("test", || {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let out = attention::record_attention(
            ctx,
            &mut enc,
            q,
            k,
            v,
            s,
            layout.into(),
            kind,
            Some(tiling),
            None,
        )?;
        ctx.queue().submit([enc.finish()]);
        Ok(out)
    })
}

/// Where the driver caps a shader invocation's loop iterations (llvmpipe:
/// `Context::loop_limit`), a tile-kernel attention that cannot fit the cap even with one query
/// per workgroup is refused with a typed error before anything runs, not returned wrong: here
/// a dense walk over 40000 keys at D 16 (about 110000 iterations per invocation). Elsewhere the
/// same call runs, and its rows are checked against the reference.
#[test]
fn loop_limit_is_refused_not_wrong() {
    let ctx = ctx();
    let mut r = rng(seed("loop_limit"));
    let s = AttentionShape::new(1, 1, 1, 3, 40000, 16).unwrap();
    let x = inputs(&mut r, &s, Storage::F32);
    let up = |d: &[f32]| ctx.upload("t", d, Storage::F32).unwrap();
    let (qt, kt, vt) = (up(&x.q), up(&x.k), up(&x.v));
    let kind = AttentionKind::Dense {
        causal: true,
        scale: 0.25,
    };
    let tiling = Tiling::default_for(1, None);
    let got = record_tiled(ctx, [&qt, &kt, &vt], &s, Bhnd, &kind, tiling);
    match ctx.loop_limit() {
        Some(limit) => {
            let e = got.expect_err("a walk past the loop limit must be refused");
            let msg = e.to_string();
            assert!(
                matches!(e, pisa_wgpu::GpuError::Limit { .. }) && msg.contains(&limit.to_string()),
                "{msg}"
            );
        }
        None => {
            let (o, l) = got.unwrap();
            let (o, l) = (ctx.read_f32(&o).unwrap(), ctx.read_f32(&l).unwrap());
            let (ro, rl) =
                reference::dense_attention(&x.q, &x.k, &x.v, &s, Bhnd, true, 0.25).unwrap();
            check("dense 40000 keys D 16", (&o, &l), (&ro, &rl), Storage::F32);
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
    use Storage::{Bf16, F16, F32};
    let cases: &[DenseCase] = &[
        (2, 4, 2, 100, 100, 64, Bhnd, F32, true),
        (1, 7, 1, 65, 65, 80, Bnhd, F32, true),
        (1, 8, 2, 300, 300, 128, Bhnd, F16, true),
        (2, 3, 3, 31, 70, 96, Bnhd, F32, true),
        (1, 2, 1, 33, 33, 256, Bhnd, F32, false),
        (1, 32, 2, 9, 40, 64, Bnhd, F16, false),
        (1, 1, 1, 1, 1, 64, Bhnd, F32, true),
        // f16 tile calls: on a device with VK_NV_cooperative_matrix2 the head dims 64 and 128
        // run shaders/nv/attention_dense.comp (GQA 1, 3, 4, 7; Nq < Nk; partial blocks).
        (1, 4, 1, 200, 330, 128, Bnhd, F16, true),
        (2, 8, 8, 129, 129, 64, Bhnd, F16, false),
        (1, 6, 2, 257, 257, 128, Bhnd, F16, true),
        (1, 7, 1, 100, 100, 128, Bnhd, F16, true),
        (1, 6, 3, 77, 77, 64, Bhnd, Bf16, true),
        (2, 2, 1, 40, 90, 96, Bnhd, Bf16, false),
        (1, 6, 2, 300, 390, 64, Bhnd, F16, true),
        (1, 4, 2, 255, 255, 64, Bnhd, F16, false),
        // Causal heads of 4 tiles or more: the NVIDIA kernels run each head's lightest quarter
        // of tiles last (5 tiles of 128 rows, 1 last; 8 tiles, 2 last), through full blocks of
        // 128 keys and a partial last one.
        (2, 4, 1, 600, 650, 128, Bhnd, F16, true),
        (1, 3, 3, 530, 530, 64, Bnhd, F16, true),
        (1, 8, 1, 1000, 1000, 64, Bnhd, F16, true),
    ];
    for &(b, hq, hkv, nq, nk, d, layout, storage, causal) in cases {
        if skip_f16(ctx, storage) {
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
        let nv = attention::nv_dense::kernel_for(ctx, &s, storage, QkvLayouts::from(layout));
        let what = format!(
            "{s:?} {layout:?} {storage:?} causal {causal} seed {seed} {}",
            nv.map_or("", |k| k.0.name)
        );
        check(&what, (&got.0, &got.1), (&ro, &rl), storage);
    }
}

/// The shaders of each kernel [`attention::attention_kernel`] can report.
fn shaders_of(kernel: AttentionKernel) -> &'static [&'static str] {
    match kernel {
        AttentionKernel::SplitK => &["attention_split", "attention_split_merge"],
        AttentionKernel::LeafMajor(KernelPath::Portable) => {
            &["attention_leaf", "attention_leaf_merge", "leaf_bucket"]
        }
        AttentionKernel::LeafMajorNv => &["attention_leaf_merge", "leaf_bucket"],
        AttentionKernel::LeafMajor(KernelPath::CoopMat) => {
            &["attention_leaf_coop", "attention_leaf_merge", "leaf_bucket"]
        }
        AttentionKernel::CoopTile => &["attention_coop"],
        AttentionKernel::PortableTile => &["attention"],
        // Passthrough SPIR-V: no WGSL shader built.
        AttentionKernel::NvDense => &[],
    }
}

/// The kernel `attention_kernel` reports is the one `record_attention` runs: each case records
/// one call on a context of its own (per kernel path the adapter has), and the shaders the call
/// built are those of the reported kernel. On the portable path the kernel is also the expected
/// one: split-K for few queries against many keys, leaf-major with `LeafOrder::Leaves` (not
/// where V's layout differs from K's), the tile kernel for the rest and for an explicit tiling;
/// on the tensor-core path, Auto's sparse f16 attention leaf-major from 512 queries on, the
/// tile kernel at 511.
#[test]
fn reported_kernel_is_the_one_that_runs() {
    use AttentionKernel::{LeafMajor, PortableTile, SplitK};
    use LeafOrder::{Auto, Leaves};
    use Storage::{F16, F32};
    let mut r = rng(seed("reported kernel"));
    let tiles = Tiling::default_for(4, None);
    // (what, Hq, Hkv, Nq, Nk, sparse, order, V layout, tiling, storage, portable-path kernel)
    #[rustfmt::skip]
    let cases = [
        ("dense decode", 8, 2, 1, 4096, false, Auto, Bhnd, None, F32, SplitK),
        ("dense decode f16", 8, 2, 1, 4096, false, Auto, Bhnd, None, F16, SplitK),
        ("dense decode, tiling", 8, 2, 1, 4096, false, Auto, Bhnd, Some(tiles), F32, PortableTile),
        ("dense, 128 rows", 8, 2, 32, 4096, false, Auto, Bhnd, None, F32, PortableTile),
        ("dense prefill", 4, 2, 128, 128, false, Auto, Bhnd, None, F16, PortableTile),
        ("sparse, Auto", 4, 2, 256, 256, true, Auto, Bhnd, None, F32, PortableTile),
        ("sparse, Leaves", 4, 2, 256, 256, true, Leaves, Bhnd, None, F32, LeafMajor(KernelPath::Portable)),
        ("sparse f16, Leaves", 4, 2, 256, 256, true, Leaves, Bhnd, None, F16, LeafMajor(KernelPath::Portable)),
        ("sparse, Leaves, V Bnhd", 4, 2, 256, 256, true, Leaves, Bnhd, None, F32, PortableTile),
        ("sparse f16, Auto, 511 queries", 4, 2, 511, 511, true, Auto, Bhnd, None, F16, PortableTile),
        ("sparse f16, Auto, 512 queries", 4, 2, 512, 512, true, Auto, Bhnd, None, F16, PortableTile),
    ];
    for (what, hq, hkv, nq, nk, sparse, order, v_layout, tiling, storage, portable) in cases {
        for path in [KernelPath::Portable, KernelPath::CoopMat] {
            let ctx = &Context::new(&AdapterChoice::HighPerformance).unwrap();
            if ctx.set_kernel_path(path) != path || skip_f16(ctx, storage) {
                continue;
            }
            ctx.set_leaf_order(order);
            let s = AttentionShape::new(1, hq, hkv, nq, nk, 64).unwrap();
            let cfg = SelectionConfig::new(16, 4).unwrap();
            let t = |n, seed| random_tensor(ctx, "x", n, storage, seed, 1.0).unwrap();
            let (q, k, v) = (t(s.q_elems(), 1), t(s.kv_elems(), 2), t(s.kv_elems(), 3));
            let sel = ctx
                .upload_u32("sel", &random_selection(&mut r, &s, &cfg))
                .unwrap();
            let kind = match sparse {
                true => AttentionKind::Sparse {
                    selection: &sel,
                    cfg: &cfg,
                },
                false => AttentionKind::Dense {
                    causal: true,
                    scale: 0.125,
                },
            };
            let layouts = QkvLayouts {
                v: v_layout.into(),
                ..QkvLayouts::default()
            };
            let reported = attention::attention_kernel(ctx, &s, storage, layouts, &kind, tiling);
            let before = ctx.built_shaders();
            let (o, lse) = ctx
                .scoped("test", || {
                    let mut enc = ctx.device().create_command_encoder(&Default::default());
                    let out = attention::record_attention(
                        ctx, &mut enc, &q, &k, &v, &s, layouts, &kind, tiling, None,
                    )?;
                    ctx.queue().submit([enc.finish()]);
                    Ok(out)
                })
                .unwrap();
            let what = format!("{what} {s:?} {storage:?} on {path}: reported {reported}");
            let built: Vec<_> = ctx.built_shaders();
            let new: Vec<_> = built.into_iter().filter(|x| !before.contains(x)).collect();
            // The NVIDIA merge, where it applies, is passthrough SPIR-V too.
            let mut want = shaders_of(reported).to_vec();
            if let (AttentionKernel::LeafMajorNv, Some((_, Some(_)))) =
                (reported, attention::by_leaf::nv_kernel_for(ctx, &s, &cfg))
            {
                want.retain(|&x| x != "attention_leaf_merge");
            }
            assert_eq!(new, want, "{what}: shaders built");
            if path == KernelPath::Portable {
                assert_eq!(reported, portable, "{what}");
            }
            // On tensor cores Auto runs sparse attention leaf-major from 512 queries on
            // (docs/benchmarks.md A.53), the tile kernel below.
            if path == KernelPath::CoopMat && sparse && order == Auto && storage == F16 {
                let leaf_major = matches!(
                    reported,
                    AttentionKernel::LeafMajorNv | AttentionKernel::LeafMajor(_)
                );
                assert_eq!(leaf_major, nq >= 512, "{what}: Auto's order");
            }
            if tiling.is_none() && layouts == QkvLayouts::default() {
                let p = coop::attention_path(ctx, &s, storage, &kind);
                assert_eq!(p, reported.path(), "{what}: attention_path");
            }
            for x in [ctx.read_f32(&o).unwrap(), ctx.read_f32(&lse).unwrap()] {
                assert!(x.iter().all(|v| !v.is_nan()), "{what}: unwritten output");
            }
            eprintln!("{what}: ran {new:?}");
        }
    }
}
