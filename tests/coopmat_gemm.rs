//! The ceiling of WGSL tensor-core code on a device: a plain f16 GEMM on cooperative matrices
//! (`shaders/gemm_coop.wgsl`, benchmark only), C = A B^T with f32 accumulation, in the variants
//! the attention kernels could use (subgroup tile, K step, A staged transposed or not, or no
//! workgroup staging at all). Tests: naga validates every variant and writes its SPIR-V (run
//! everywhere); each variant matches a CPU f64 product of the same f16 inputs within 1e-5 of
//! the row's sum of |products| (tensor-core adapters only; skipped with a message elsewhere).
//! `gemm_tflops` (ignored) prints GPU-timed TFLOP/s of every variant at 4096^3 and 8192^3
//! (`PISA_GEMM_SIZES=4096,8192`), then of the shader's timing-only entry points `peak` and
//! `probe` (PL 0 to 4): the numbers against which the attention kernels' TFLOP/s are read
//! (docs/benchmarks.md, Ceilings). Pipelines are built as the library's own
//! (`Context::pipeline`): with wgpu's default runtime checks (naga's loop bounding on) the
//! driver does not unroll the loops over the accumulators and the GEMM ran 2.7x slower on the
//! H200.
mod common;

use common::*;
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::runtime::pipeline::preprocess;
use pisa_wgpu::ShaderSource;
use pisa_wgpu::{Context, GpuTensor, KernelPath, Profiler, Storage, POISON_F32};
use wgpu::util::DeviceExt;

const SHADER: ShaderSource = ShaderSource {
    name: "gemm_coop",
    wgsl: include_str!("../shaders/gemm_coop.wgsl"),
};

/// One variant: (WM, WN, BK, AT, DIRECT); the workgroup tile is 32 WM x 32 WN. `pl`: the
/// loads of the "probe" entry point (shader constant PL).
#[derive(Debug, Clone, Copy)]
struct Variant {
    pl: u32,
    wm: u32,
    wn: u32,
    bk: u32,
    at: bool,
    direct: bool,
}

impl Variant {
    fn consts(&self, sg: u32) -> Vec<(&'static str, u32)> {
        vec![
            ("WM", self.wm),
            ("WN", self.wn),
            ("BK", self.bk),
            ("SG", sg),
            ("AT", self.at as u32),
            ("DIRECT", self.direct as u32),
            ("PL", self.pl),
        ]
    }
    fn tile(&self) -> (usize, usize) {
        (32 * self.wm as usize, 32 * self.wn as usize)
    }
}

fn variants() -> Vec<Variant> {
    let v = |wm, wn, bk, at, direct| Variant {
        pl: 0,
        wm,
        wn,
        bk,
        at,
        direct,
    };
    vec![
        v(4, 4, 32, true, false),
        v(4, 4, 32, false, false),
        v(4, 4, 64, true, false),
        v(2, 4, 32, true, false),
        v(2, 2, 32, true, false),
        v(2, 2, 64, true, false),
        v(4, 4, 32, true, true),
        v(2, 4, 32, true, true),
        v(2, 2, 32, true, true),
    ]
}

fn coop_ctx(test: &str) -> Option<&'static Context> {
    let ctx = ctx();
    if ctx.kernel_path() != KernelPath::CoopMat {
        skip_unless_required(&format!(
            "{test}: adapter {:?} has no cooperative matrices",
            ctx.report().name
        ));
        return None;
    }
    Some(ctx)
}

#[test]
fn gemm_variants_validate_and_write_spirv() {
    for v in variants() {
        for sg in [8, 32, 64] {
            let src = preprocess(&SHADER, Storage::F16, &v.consts(sg)).unwrap();
            assert_spirv(&format!("{v:?} sg {sg}"), &src, &["gemm", "peak", "probe"]);
        }
    }
}

/// Records C = A B^T ([m, k] and [n, k] f16, C [m, n] f32, poisoned) in one timed pass "gemm"
/// (`entry` "gemm"; "peak": the multiply-add rate with no loads, C not a product).
fn record(
    ctx: &Context,
    entry: &'static str,
    enc: &mut wgpu::CommandEncoder,
    v: &Variant,
    (a, b): (&GpuTensor, &GpuTensor),
    (m, n, k): (usize, usize, usize),
    prof: Option<&mut Profiler>,
) -> GpuTensor {
    let (bm, bn) = v.tile();
    assert!(
        m % bm == 0 && n % bn == 0 && k % v.bk as usize == 0,
        "{v:?}: {m} {n} {k}"
    );
    let sg = ctx.report().subgroup_size.0;
    // As the library builds its own: its runtime checks (naga's loop bounding off, which
    // otherwise keeps the driver from unrolling the loops over the accumulators) and the
    // PISA_DUMP_WGSL dump that tests/shader_stats.rs reads.
    let pipe = ctx
        .pipeline(&SHADER, entry, Storage::F16, &v.consts(sg))
        .unwrap();
    let dev = ctx.device();
    let c = ctx.alloc("C", m * n, Storage::F32, POISON_F32).unwrap();
    let dims = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("dims"),
        contents: bytemuck::cast_slice(&[m as u32, n as u32, k as u32, 0]),
        usage: wgpu::BufferUsages::UNIFORM,
    });
    // The layout is derived from the entry point: "peak" and "probe" read A and B only as f16
    // scalars.
    let all = [
        (0, &dims),
        (1, &a.buffer),
        (2, &b.buffer),
        (3, &c.buffer),
        (4, &a.buffer),
        (5, &b.buffer),
    ];
    let entries: Vec<_> = (all.into_iter())
        .filter(|(i, _)| entry == "gemm" || ![1, 2].contains(i))
        .collect();
    let bind = bind_group(&pipe, &entries);
    let mut prof = prof;
    let mut pass = match prof.as_mut() {
        Some(p) => p.compute_pass(enc, "gemm"),
        None => enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("gemm"),
            timestamp_writes: None,
        }),
    };
    pass.set_pipeline(&pipe);
    pass.set_bind_group(0, &bind, &[]);
    pass.dispatch_workgroups((n / bn) as u32, (m / bm) as u32, 1);
    drop(pass);
    c
}

#[test]
fn gemm_variants_match_cpu() {
    let Some(ctx) = coop_ctx("gemm_variants_match_cpu") else {
        return;
    };
    let seed = seed("gemm");
    let mut r = rng(seed);
    // Multiples of every variant's tile (128 x 128) and K step (32, 64); not powers of two.
    let (m, n, k) = (256, 384, 320);
    let a: Vec<f32> = through_f16(&random(&mut r, m * k, 1.0));
    let b: Vec<f32> = through_f16(&random(&mut r, n * k, 1.0));
    let ga = ctx.upload("A", &a, Storage::F16).unwrap();
    let gb = ctx.upload("B", &b, Storage::F16).unwrap();
    for v in variants() {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let c = record(ctx, "gemm", &mut enc, &v, (&ga, &gb), (m, n, k), None);
        ctx.queue().submit([enc.finish()]);
        let got = ctx.read_f32(&c).unwrap();
        let (worst, at) = worst_gemm_error(&a, &b, &got, (m, n, k));
        eprintln!("{v:?}: worst error {worst:.2e} of the row's |products| at {at} (seed {seed})");
        assert!(
            worst <= 1e-5,
            "{v:?}: error {worst:.2e} at {at} (seed {seed})"
        );
    }
}

/// GPU-timed TFLOP/s of every variant (median of 5 after a warm-up).
#[test]
#[ignore]
fn gemm_tflops() {
    let Some(ctx) = coop_ctx("gemm_tflops") else {
        return;
    };
    let sizes: Vec<usize> = std::env::var("PISA_GEMM_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or(vec![4096, 8192]);
    for &s in &sizes {
        let a = random_tensor(ctx, "A", s * s, Storage::F16, 1, 1.0).unwrap();
        let b = random_tensor(ctx, "B", s * s, Storage::F16, 2, 1.0).unwrap();
        let peak = Variant {
            pl: 0,
            wm: 4,
            wn: 4,
            bk: 32,
            at: true,
            direct: true,
        };
        let runs = variants().into_iter().map(|v| ("gemm", v));
        let probes = (0..5).map(|pl| {
            let v = Variant {
                pl,
                wm: 2,
                wn: 2,
                ..peak
            };
            ("probe", v)
        });
        for (entry, v) in runs.chain([("peak", peak)]).chain(probes) {
            let mut times = Vec::new();
            for rep in 0..6 {
                let mut prof = Profiler::new(ctx, 1);
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                let ab = (&a, &b);
                let _c = record(ctx, entry, &mut enc, &v, ab, (s, s, s), Some(&mut prof));
                ctx.queue().submit([enc.finish()]);
                let st = prof.finish(ctx).unwrap();
                if rep > 0 {
                    times.push(st.get("gemm"));
                }
            }
            times.sort_by(|x, y| x.partial_cmp(y).unwrap());
            let ms = times[times.len() / 2];
            let tf = 2.0 * (s as f64).powi(3) / (ms * 1e-3) / 1e12;
            println!("{entry} {s}^3 {v:?}: {ms:.3} ms, {tf:.1} TFLOP/s");
        }
    }
}
