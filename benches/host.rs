//! Host CPU time to record work, the cost an inference loop pays per layer on the CPU whatever
//! the GPU does: a decode step (append + step of a batch into the caller's encoder, buffers of
//! the caller's) at several cache capacities, a serving loop's step (random append masks, or
//! rows from a packed projection), and a planned prefill's run at several sequence
//! lengths. The recorded commands are not submitted: this measures the host side only
//! (`pisa bench` measures the GPU side).
//!
//! `cargo bench -p pisa-wgpu --bench host`. Results: docs/benchmarks.md, "Host time to record".

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::{KvCache, StepOutputs};
use pisa_wgpu::ops::prefill::{PlanViews, PrefillOptions, PrefillOutputs, PrefillPlan};
use pisa_wgpu::{wgpu, AdapterChoice, Context, DType, Storage, TensorView};

const B: usize = 3;
const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;

fn buffer(ctx: &Context, bytes: usize) -> wgpu::Buffer {
    ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("app buffer"),
        size: bytes as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

fn view(buf: &wgpu::Buffer, dtype: DType, shape: [usize; 4]) -> TensorView {
    TensorView::contiguous(buf, 0, dtype, shape, TensorLayout::Bhnd).expect("view")
}

/// A decode step's views of `b` sequences in the caller's own buffers, f32, contiguous:
/// appended K and V rows `[b, Hkv, 1, D]`, Q and O `[b, Hq, 1, D]`, LSE `[b, Hq, 1, 1]`.
fn step_views(ctx: &Context, b: usize) -> [TensorView; 5] {
    let at = |h: usize, d: usize| view(&buffer(ctx, b * h * d * 4), DType::F32, [b, h, 1, d]);
    [at(HKV, D), at(HKV, D), at(HQ, D), at(HQ, D), at(HQ, 1)]
}

fn decode_record(c: &mut Criterion) {
    let Ok(ctx) = Context::new(&AdapterChoice::HighPerformance) else {
        eprintln!("no adapter: host-time benches skipped");
        return;
    };
    let cfg = SelectionConfig::new(64, 8).expect("config");
    let mut group = c.benchmark_group("decode_record_step");
    for capacity in [1024usize, 16384, 65536] {
        let mut cache =
            KvCache::new(&ctx, B, capacity, HQ, HKV, D, cfg, Storage::F32).expect("cache");
        let [kv, vv, qv, ov, lv] = step_views(&ctx, B);
        let outs = StepOutputs {
            out: &ov,
            lse: &lv,
            selection: None,
        };
        let active = [true; B];
        group.bench_with_input(
            BenchmarkId::from_parameter(capacity),
            &capacity,
            |bch, _| {
                bch.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for i in 0..iters {
                        // The cache would fill up: empty it now and then (outside the timing).
                        if cache.len(0).expect("len") + 1 >= capacity {
                            for s in 0..B {
                                cache.reset(s).expect("reset");
                            }
                        }
                        let mut enc = ctx.device().create_command_encoder(&Default::default());
                        let t0 = Instant::now();
                        cache
                            .record_append_view(&mut enc, &kv, &vv, &active, None)
                            .expect("append");
                        cache
                            .record_step_into(&mut enc, &qv, Some(&outs), None)
                            .expect("step");
                        total += t0.elapsed();
                        drop(enc);
                        if i % 256 == 255 {
                            // Release what wgpu keeps of the dropped encoders.
                            let _ = ctx.device().poll(wgpu::PollType::Poll);
                        }
                    }
                    total
                })
            },
        );
    }
    group.finish();
}

/// A serving loop's decode step at batch 16 (capacity 16,384): `masks` with a new random
/// append mask every step (sequences joining and leaving, as continuous batching does),
/// `packed` with every sequence appending its rows from a packed QKV projection `[B, (Hq + 2
/// Hkv) * D]` (views the cache gathers, the same buffer every step).
fn decode_record_serving(c: &mut Criterion) {
    const BS: usize = 16;
    let Ok(ctx) = Context::new(&AdapterChoice::HighPerformance) else {
        eprintln!("no adapter: host-time benches skipped");
        return;
    };
    let cfg = SelectionConfig::new(64, 8).expect("config");
    let capacity = 16384;
    let mut group = c.benchmark_group("decode_record_serving_b16");
    let row = (HQ + 2 * HKV) * D;
    let qkv = buffer(&ctx, BS * row * 4);
    let strided = |off: usize, h: usize| {
        TensorView::new(
            &qkv,
            (off * 4) as u64,
            DType::F32,
            [BS, h, 1, D],
            [row, D, row, 1],
        )
        .expect("packed view")
    };
    let (pq, pk, pv) = (
        strided(0, HQ),
        strided(HQ * D, HKV),
        strided((HQ + HKV) * D, HKV),
    );
    let [kv, vv, qv, ov, lv] = step_views(&ctx, BS);
    let outs = StepOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    for case in ["masks", "packed"] {
        let mut cache =
            KvCache::new(&ctx, BS, capacity, HQ, HKV, D, cfg, Storage::F32).expect("cache");
        // A fixed sequence of pseudo-random masks (xorshift), about half the batch each.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        group.bench_function(case, |bch| {
            bch.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    if (0..BS).any(|s| cache.len(s).expect("len") + 1 >= capacity) {
                        for s in 0..BS {
                            cache.reset(s).expect("reset");
                        }
                    }
                    let active: Vec<bool> = match case {
                        "masks" => (0..BS)
                            .map(|_| {
                                state ^= state << 13;
                                state ^= state >> 7;
                                state ^= state << 17;
                                state & 1 == 1
                            })
                            .collect(),
                        _ => vec![true; BS],
                    };
                    let (kk, vvv, qq) = match case {
                        "masks" => (&kv, &vv, &qv),
                        _ => (&pk, &pv, &pq),
                    };
                    let mut enc = ctx.device().create_command_encoder(&Default::default());
                    let t0 = Instant::now();
                    cache
                        .record_append_view(&mut enc, kk, vvv, &active, None)
                        .expect("append");
                    cache
                        .record_step_into(&mut enc, qq, Some(&outs), None)
                        .expect("step");
                    total += t0.elapsed();
                    drop(enc);
                    if i % 256 == 255 {
                        let _ = ctx.device().poll(wgpu::PollType::Poll);
                    }
                }
                total
            })
        });
    }
    group.finish();
}

fn prefill_record(c: &mut Criterion) {
    let Ok(ctx) = Context::new(&AdapterChoice::HighPerformance) else {
        eprintln!("no adapter: host-time benches skipped");
        return;
    };
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(64, 8).expect("config"),
        ..Default::default()
    };
    for in_place in [false, true] {
        prefill_group(c, &ctx, &opts, in_place);
    }
}

/// `prefill_record_run`: [`PrefillPlan::new`] run on views of the caller's buffers (read in
/// place, O copied out); `prefill_record_run_in_place`: [`PrefillPlan::new_in_place`] with O
/// written in place (no staging, no copy).
fn prefill_group(c: &mut Criterion, ctx: &Context, opts: &PrefillOptions, in_place: bool) {
    let name = match in_place {
        false => "prefill_record_run",
        true => "prefill_record_run_in_place",
    };
    let mut group = c.benchmark_group(name);
    for n in [1024usize, 4096, 16384] {
        let shape = AttentionShape::prefill(1, HQ, HKV, n, D).expect("shape");
        let (q, o) = (buffer(ctx, HQ * n * D * 4), buffer(ctx, HQ * n * D * 4));
        let (k, v) = (buffer(ctx, HKV * n * D * 4), buffer(ctx, HKV * n * D * 4));
        let lse = buffer(ctx, HQ * n * 4);
        let (qs, kvs) = ([1, HQ, n, D], [1, HKV, n, D]);
        let (qv, kv, vv) = (
            view(&q, DType::F32, qs),
            view(&k, DType::F32, kvs),
            view(&v, DType::F32, kvs),
        );
        let (ov, lv) = (
            view(&o, DType::F32, qs),
            view(&lse, DType::F32, [1, HQ, n, 1]),
        );
        let outs = PrefillOutputs {
            out: &ov,
            lse: &lv,
            selection: None,
        };
        let plan = match in_place {
            false => PrefillPlan::new(ctx, &shape, opts),
            true => {
                let views = PlanViews {
                    q: &qv,
                    k: &kv,
                    v: &vv,
                    out: Some(&ov),
                };
                PrefillPlan::new_in_place(ctx, &shape, opts, &views)
            }
        }
        .expect("plan");
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bch, _| {
            bch.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    let mut enc = ctx.device().create_command_encoder(&Default::default());
                    let t0 = Instant::now();
                    plan.run(&mut enc, &qv, &kv, &vv, &outs, None).expect("run");
                    total += t0.elapsed();
                    drop(enc);
                    if i % 64 == 63 {
                        let _ = ctx.device().poll(wgpu::PollType::Poll);
                    }
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(host, decode_record, decode_record_serving, prefill_record);
criterion_main!(host);
