//! GPU time of the decode step the library runs by default (the split step: `route`, `leaf`,
//! `merge`; `PISA_DECODE=fused` asks for the fused one, which runs where it fits) and of the
//! append (timestamp queries), batch 1 by default.
//!
//! `cargo run --release -p pisa-wgpu --example decode_bench -- [N ...]` with environment
//! overrides `HQ HKV D C K G B STORAGE(f16|f32|bf16) STEPS`. N is the cache length: N - STEPS
//! tokens are prefilled, then STEPS are appended, one per timed step (so N must be at least
//! STEPS). Prints one line per length: the step that ran (split or fused) and the mean GPU
//! microseconds of "decode" and "append" over STEPS steps.
use pisa_core::{SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::{AdapterChoice, Context, Profiler, Storage};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Deterministic values in [-1, 1) (splitmix64 of the index): fast for a billion elements.
fn fill(n: usize, salt: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (i ^ salt.rotate_left(17)).wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

/// Ends the run on a bad argument or variable: `error: msg` on stderr, exit code 2.
fn usage(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(2)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lens: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let lens = if lens.is_empty() { vec![1 << 20] } else { lens };
    let (hq, hkv, d) = (env("HQ", 32), env("HKV", 8), env("D", 128));
    let (c, k, g, b, steps) = (
        env("C", 64),
        env("K", 16),
        env("G", 2),
        env("B", 1),
        env("STEPS", 100),
    );
    let storage = match std::env::var("STORAGE").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("f16") => Storage::F16,
        Ok("f32") => Storage::F32,
        Ok("bf16") => Storage::Bf16,
        Ok(v) => usage(&format!(
            "STORAGE={v}: unknown storage; use f16, f32 or bf16"
        )),
        Err(_) => usage("STORAGE is not valid Unicode; use f16, f32 or bf16"),
    };
    if let Some(&n) = lens.iter().find(|&&n| n < steps) {
        usage(&format!(
            "cache length {n} is below STEPS {steps}: the timed steps append STEPS tokens to a \
             cache of N - STEPS prefilled ones; give N >= {steps} or set STEPS lower"
        ));
    }
    let ctx = Context::new(&AdapterChoice::HighPerformance)?;
    println!(
        "adapter: {} ({})",
        ctx.report().name,
        ctx.report().driver_info
    );
    let cfg = SelectionConfig::new(c, k)?.with_merge_factor(g);
    for &n in &lens {
        let mut cache = KvCache::new(&ctx, b, n, hq, hkv, d, cfg, storage)?;
        let p = n - steps;
        let t = std::time::Instant::now();
        // (N = STEPS: nothing to prefill; the steps fill the cache)
        for s in (0..b).filter(|_| p > 0) {
            let kv = fill(hkv * p * d, 2 * s as u64 + 1);
            cache.prefill(s, &kv, &kv, TensorLayout::Bhnd)?;
        }
        let prefill_s = t.elapsed().as_secs_f64();
        let q = ctx.upload("q", &fill(b * hq * d, 7), storage)?;
        let rows = ctx.upload("rows", &fill(b * hkv * d, 9), storage)?;
        let active = vec![true; b];
        // Warm-up (pipelines), then STEPS append + step pairs in one submission, each timed.
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        cache.record_step(&mut enc, &q, None)?;
        ctx.queue().submit([enc.finish()]);
        let mut prof = Profiler::new(&ctx, 2 * steps as u32);
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        for _ in 0..steps {
            cache.record_append(&mut enc, &rows, &rows, &active, Some(&mut prof))?;
            cache.record_step(&mut enc, &q, Some(&mut prof))?;
        }
        ctx.queue().submit([enc.finish()]);
        ctx.wait()?;
        let times = prof.finish(&ctx)?;
        let per = |l: &str| times.get(l) * 1e3 / steps as f64;
        let step = if cache.is_fused() { "fused" } else { "split" };
        println!(
            "N {n} B {b} Hq {hq} Hkv {hkv} D {d} C {c} K {k} g {g} {storage:?}: decode ({step}) {:.1} us, \
             append {:.1} us (means of {steps}, GPU timestamps {}); smem {} B; prefill {prefill_s:.1} s",
            per("decode"),
            per("append"),
            times.gpu,
            cache.workgroup_memory()
        );
    }
    Ok(())
}
