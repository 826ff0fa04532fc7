//! Criterion benches of the GPU operations at small sizes, on any adapter (lavapipe included).
//! Each iteration's time is the GPU time from timestamp queries (`iter_custom`), falling back
//! to wall-clock around submit-and-wait where the adapter has no timestamps.
//!
//! `cargo bench -p pisa-wgpu --bench kernels` (sizes via PISA_BENCH_N, default 1024,4096).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pisa_core::{AttentionShape, PyramidLayout, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::{record_dense_attention, record_sparse_attention, QkvLayouts};
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::ops::pyramid::{self, KeyGeometry};
use pisa_wgpu::ops::select::{select, Layouts, Method};
use pisa_wgpu::{AdapterChoice, Context, Profiler, Storage};

#[derive(Clone, Copy, Debug)]
enum Op {
    PisaSelect,
    BsaSelect,
    SparseAttention,
    Dense,
}

fn time_op(ctx: &Context, op: Op, n: usize, iters: u64) -> Duration {
    let shape = AttentionShape::prefill(1, 8, 2, n, 64).unwrap();
    let cfg = SelectionConfig::new(64, 8).unwrap();
    let q = random_tensor(ctx, "q", shape.q_elems(), Storage::F32, 1, 1.0).unwrap();
    let k = random_tensor(ctx, "k", shape.kv_elems(), Storage::F32, 2, 1.0).unwrap();
    let v = random_tensor(ctx, "v", shape.kv_elems(), Storage::F32, 3, 1.0).unwrap();
    let layout = TensorLayout::Bhnd;
    let geo = KeyGeometry {
        batch: 1,
        kv_heads: 2,
        tokens: n,
        head_dim: 64,
        layout: layout.into(),
    };
    let lay = PyramidLayout::new(n, 64, 2).unwrap();
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let mut prof = Profiler::new(ctx, 64);
        let start = Instant::now();
        ctx.scoped("bench", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let pyr = pyramid::alloc(ctx, lay, &geo, false)?;
            pyramid::record_build(ctx, &mut enc, &k, &geo, n, &pyr, Some(&mut prof))?;
            let layouts = Layouts::new(layout, &shape);
            match op {
                Op::PisaSelect | Op::SparseAttention => {
                    let sel = select(
                        ctx,
                        &q,
                        &k,
                        Some(&pyr),
                        &shape,
                        &layouts,
                        &cfg,
                        Method::Pisa,
                        4,
                        &mut enc,
                        Some(&mut prof),
                    )?;
                    if let Op::SparseAttention = op {
                        record_sparse_attention(
                            ctx,
                            &mut enc,
                            &q,
                            &k,
                            &v,
                            &sel,
                            &shape,
                            QkvLayouts::from(layout),
                            &cfg,
                            Some(&mut prof),
                        )?;
                    }
                }
                Op::BsaSelect => {
                    select(
                        ctx,
                        &q,
                        &k,
                        Some(&pyr),
                        &shape,
                        &layouts,
                        &cfg,
                        Method::Bsa,
                        4,
                        &mut enc,
                        Some(&mut prof),
                    )?;
                }
                Op::Dense => {
                    record_dense_attention(
                        ctx,
                        &mut enc,
                        &q,
                        &k,
                        &v,
                        &shape,
                        QkvLayouts::from(layout),
                        true,
                        0.125,
                        Some(&mut prof),
                    )?;
                }
            }
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })
        .unwrap();
        let wall = start.elapsed();
        let t = prof.finish(ctx).unwrap();
        let ms = match op {
            Op::PisaSelect => [
                "pyramid",
                "route",
                "leaf_select",
                "leaf_bucket",
                "leaf_score",
                "leaf_pick",
            ]
            .iter()
            .map(|s| t.get(s))
            .sum(),
            Op::BsaSelect => t.get("pyramid") + t.get("bsa"),
            Op::SparseAttention => t.attention(),
            Op::Dense => t.get("dense"),
        };
        total += if t.gpu {
            Duration::from_secs_f64(ms * 1e-3)
        } else {
            wall
        };
    }
    total
}

fn benches(c: &mut Criterion) {
    let ctx = Context::new(&AdapterChoice::HighPerformance).expect("a GPU adapter");
    let sizes: Vec<usize> = std::env::var("PISA_BENCH_N")
        .unwrap_or_else(|_| "1024,4096".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let mut g = c.benchmark_group(format!("gpu time on {}", ctx.report().name));
    g.sample_size(10);
    for &n in &sizes {
        for op in [
            Op::PisaSelect,
            Op::BsaSelect,
            Op::SparseAttention,
            Op::Dense,
        ] {
            g.bench_with_input(BenchmarkId::new(format!("{op:?}"), n), &n, |b, &n| {
                b.iter_custom(|iters| time_op(&ctx, op, n, iters))
            });
        }
    }
    g.finish();
}

criterion_group!(kernels, benches);
criterion_main!(kernels);
