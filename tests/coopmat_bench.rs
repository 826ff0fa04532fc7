//! The ignored micro-benchmark of `tests/coopmat.rs`: GPU-timed (Profiler) dense causal and
//! block-sparse attention, cooperative-matrix vs portable kernels on the same f16 inputs, at
//! Hq = 32, Hkv = 8, D = 128, C = 64, K = 16 and N = 16K, 64K (`PISA_BENCH_LENS=16384,65536`
//! overrides). TFLOP/s counts useful work only: 4 D FLOPs per (query head, attended key).
//! Run: `cargo test --release -p pisa-wgpu --test coopmat -- --ignored --nocapture`.

use super::*;
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::{GpuTensor, Profiler};
use rand::SeedableRng;

const REPS: usize = 3;

/// A causal selection whose Qtile-aligned groups of 4 queries share their K - 1 past blocks
/// (random, distinct) beside their own block, as neighbouring queries mostly do under PISA;
/// returns it with the number of (query, key) pairs it attends per KV head, summed.
fn shared_selection(s: &AttentionShape, c: usize, kk: usize, seed: u64) -> (Vec<i32>, u64) {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(s.kv_heads * s.q_len * kk);
    let mut pairs = 0u64;
    let mut row: Vec<i32> = Vec::new();
    for _ in 0..s.kv_heads {
        for i in 0..s.q_len {
            let own = i / c;
            if i % 4 == 0 || own * c == i {
                row.clear();
                row.push(own as i32);
                let want = kk.min(own + 1);
                while row.len() < want {
                    let j = r.random_range(0..own) as i32;
                    if !row.contains(&j) {
                        row.push(j);
                    }
                }
                row.sort_unstable();
            }
            for &blk in &row {
                let b0 = blk as usize * c;
                pairs += ((i + 1).min(b0 + c) - b0) as u64;
            }
            out.extend_from_slice(&row);
            out.extend(std::iter::repeat_n(-1, kk - row.len()));
        }
    }
    (out, pairs)
}

/// One attention call recorded into an encoder, optionally timed: returns (O, LSE).
type Run<'a> =
    dyn Fn(&mut wgpu::CommandEncoder, Option<&mut Profiler>) -> (GpuTensor, GpuTensor) + 'a;

/// Median GPU milliseconds of `REPS` timed runs (after one warm-up) of one attention call.
fn time_ms(ctx: &Context, label: &'static str, run: &Run<'_>) -> (f64, GpuTensor) {
    let mut times = Vec::new();
    let mut last = None;
    for rep in 0..=REPS {
        let mut prof = Profiler::new(ctx, 1);
        let t0 = std::time::Instant::now();
        let out = ctx
            .scoped("bench", || {
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                let out = run(&mut enc, Some(&mut prof));
                ctx.queue().submit([enc.finish()]);
                Ok(out)
            })
            .unwrap();
        let wall = t0.elapsed().as_secs_f64() * 1e3;
        let st = prof.finish(ctx).unwrap();
        // (leaf-major attention, where the profiler has room, is timed in parts)
        let ms = match (st.gpu, label) {
            (true, "attention") => st.attention(),
            (true, _) => st.get(label),
            (false, _) => wall,
        };
        if rep > 0 {
            times.push(ms);
        }
        last = Some(out.0);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (times[times.len() / 2], last.unwrap())
}

#[test]
#[ignore]
fn bench_coop_vs_portable() {
    let ctx = ctx();
    let lens: Vec<usize> = std::env::var("PISA_BENCH_LENS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![16384, 65536]);
    let start = ctx.kernel_path();
    eprintln!(
        "adapter {:?}, kernel path {start}, timestamps {}",
        ctx.report().name,
        ctx.has_timestamps()
    );
    let paths: Vec<KernelPath> = if start == KernelPath::CoopMat {
        vec![KernelPath::CoopMat, KernelPath::Portable]
    } else {
        eprintln!("no cooperative-matrix path: timing the portable kernels only");
        vec![KernelPath::Portable]
    };
    let (c, kk, d) = (64usize, 16usize, 128usize);
    for &n in &lens {
        let s = AttentionShape::new(1, 32, 8, n, n, d).unwrap();
        let g = s.gqa_group() as f64;
        let q = random_tensor(ctx, "q", s.q_elems(), Storage::F16, 1, 1.0).unwrap();
        let k = random_tensor(ctx, "k", s.kv_elems(), Storage::F16, 2, 1.0).unwrap();
        let v = random_tensor(ctx, "v", s.kv_elems(), Storage::F16, 3, 1.0).unwrap();
        let cfg = SelectionConfig::new(c, kk).unwrap();
        let (sel, pairs) = shared_selection(&s, c, kk, 7);
        let sel = ctx.upload_u32("selection", &sel).unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let dense_flop = 4.0 * d as f64 * s.q_heads as f64 * (n as f64 * (n as f64 + 1.0) / 2.0);
        let sparse_flop = 4.0 * d as f64 * g * pairs as f64;
        let mut outs: Vec<(KernelPath, Vec<f32>)> = Vec::new();
        for &path in &paths {
            ctx.set_kernel_path(path);
            let dk = AttentionKind::Dense {
                causal: true,
                scale,
            };
            let sk = AttentionKind::Sparse {
                selection: &sel,
                cfg: &cfg,
            };
            // The kernels the calls below run (split-K, leaf-major or a tile kernel).
            let ran =
                |kind| attention::attention_kernel(ctx, &s, Storage::F16, Bhnd.into(), kind, None);
            let (ran_d, ran_s) = (ran(&dk), ran(&sk));
            let (dms, o) = time_ms(ctx, "dense", &|enc, prof| {
                attention::record_dense_attention(
                    ctx,
                    enc,
                    &q,
                    &k,
                    &v,
                    &s,
                    Bhnd.into(),
                    true,
                    scale,
                    prof,
                )
                .unwrap()
            });
            if n <= 16384 {
                outs.push((path, ctx.read_f32(&o).unwrap()));
            }
            drop(o);
            let (sms, o) = time_ms(ctx, "attention", &|enc, prof| {
                attention::record_sparse_attention(
                    ctx,
                    enc,
                    &q,
                    &k,
                    &v,
                    &sel,
                    &s,
                    Bhnd.into(),
                    &cfg,
                    prof,
                )
                .unwrap()
            });
            drop(o);
            eprintln!(
                "N {n:>6} {path:>8}: dense causal {dms:9.3} ms {:7.2} TFLOP/s (ran {ran_d}, {:?}) | \
                 sparse C {c} K {kk} {sms:8.3} ms {:7.2} TFLOP/s (ran {ran_s}, {:?})",
                dense_flop / dms / 1e9,
                coop::plan(ctx, &s, &dk),
                sparse_flop / sms / 1e9,
                coop::plan(ctx, &s, &sk),
            );
        }
        if start == KernelPath::CoopMat && n == lens[0] {
            ctx.set_kernel_path(KernelPath::CoopMat);
            sweep(
                ctx,
                &s,
                (&q, &k, &v, &sel),
                &cfg,
                scale,
                (dense_flop, sparse_flop),
            );
        }
        if outs.len() == 2 {
            let reference: Vec<f64> = outs[1].1.iter().map(|&x| x as f64).collect();
            let e = rel_err(&outs[0].1, &reference);
            eprintln!("N {n:>6}: dense O, coop vs portable: rel diff {e:.2e}");
            assert!(
                e <= attention_util::tol(Storage::F16),
                "coop vs portable dense O differ: {e}"
            );
        }
    }
    ctx.set_kernel_path(start);
}

/// Times variants around the planned ones (prefetch off, other key tiles, fewer rows) so one
/// device run shows which way to tune; a variant that does not fit is reported and skipped.
fn sweep(
    ctx: &Context,
    s: &AttentionShape,
    (q, k, v, sel): (&GpuTensor, &GpuTensor, &GpuTensor, &GpuTensor),
    cfg: &SelectionConfig,
    scale: f32,
    (dense_flop, sparse_flop): (f64, f64),
) {
    let dk = AttentionKind::Dense {
        causal: true,
        scale,
    };
    let sk = AttentionKind::Sparse {
        selection: sel,
        cfg,
    };
    for (kind, flop, label) in [(&dk, dense_flop, "dense"), (&sk, sparse_flop, "attention")] {
        let base = coop::plan(ctx, s, kind).unwrap();
        let mut vars = vec![
            base,
            CoopVariant {
                prefetch: false,
                ..base
            },
            CoopVariant {
                direct: !base.direct,
                ..base
            },
        ];
        for kt in [16, 32, 64] {
            if kt != base.kt {
                vars.push(CoopVariant { kt, ..base });
            }
        }
        if base.rb > 1 {
            vars.push(CoopVariant {
                rb: base.rb / 2,
                qt: (base.qt / 2).max(1),
                ..base
            });
        }
        let mut base_o: Option<Vec<f64>> = None;
        for var in vars {
            let fits = std::cell::Cell::new(true);
            let (ms, o) = time_ms(ctx, label, &|enc, prof| {
                match coop::record_coop(ctx, enc, q, k, v, s, Bhnd.into(), kind, &var, prof) {
                    Ok(out) => out,
                    Err(_) => {
                        // Does not fit this device: run the planned one to keep the encoder valid.
                        fits.set(false);
                        coop::record_coop(ctx, enc, q, k, v, s, Bhnd.into(), kind, &base, None)
                            .unwrap()
                    }
                }
            });
            let got = ctx.read_f32(&o).unwrap();
            drop(o);
            if fits.get() {
                let diff = match &base_o {
                    None => {
                        base_o = Some(got.iter().map(|&x| x as f64).collect());
                        0.0
                    }
                    Some(b) => rel_err(&got, b),
                };
                eprintln!(
                    "  sweep {label:>9} N {}: {ms:9.3} ms {:7.2} TFLOP/s {var:?} ({} B shared), \
                     O rel diff vs planned {diff:.1e}",
                    s.q_len,
                    flop / ms / 1e9,
                    var.shared_bytes()
                );
                assert!(
                    diff <= attention_util::tol(Storage::F16),
                    "variant {var:?} differs from the planned one"
                );
            } else {
                eprintln!("  sweep {label:>9}: {var:?} does not fit this device, skipped");
            }
        }
    }
}
