//! The NVIDIA cooperative-matrix-2 path (runtime/nv.rs) and its ceiling kernel, C = A B^T
//! (`shaders/nv/gemm.comp`).
//!
//! Everywhere: every embedded SPIR-V module is one, and a device without
//! `VK_NV_cooperative_matrix2` (lavapipe, llvmpipe, other vendors) gets a typed error from
//! `request_device_nv_cm2` and runs no NVIDIA kernel. On a device with it (an NVIDIA GPU;
//! skipped with a message elsewhere, failed instead when `PISA_REQUIRE_NV_CM2=1`, which the
//! GPU runs set): every variant matches a CPU f64 product of the same f16 inputs within 1e-5 of
//! the row's sum of |products|, at sizes that are multiples of no tile (the clamped loads and
//! stores), C poisoned so an unwritten element fails. `nv_gemm_tflops` (ignored) prints
//! GPU-timed TFLOP/s of every variant (`PISA_GEMM_SIZES`, default 4096,8192).
mod common;

use common::*;
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::ops::nv_gemm::{record_gemm, record_probe, PROBES, VARIANTS};
use pisa_wgpu::runtime::nv::NvBinding;
use pisa_wgpu::{Context, GpuError, Profiler, Storage, POISON_F32};

fn nv_ctx(test: &str) -> Option<&'static Context> {
    let ctx = ctx();
    if ctx.nv_cm2() {
        return Some(ctx);
    }
    let msg = format!(
        "{test}: adapter {:?} has no VK_NV_cooperative_matrix2",
        ctx.report().name
    );
    skip_unless_required(&msg);
    None
}

/// C = A B^T of f16 `a` (`m x k`) and `b` (`n x k`) by GEMM variant `v` on `ctx`, into a
/// poisoned C, read back.
fn run_gemm(
    ctx: &Context,
    v: usize,
    a: &[f32],
    b: &[f32],
    (m, n, k): (usize, usize, usize),
) -> pisa_wgpu::Result<Vec<f32>> {
    let ga = ctx.upload("A", a, Storage::F16)?;
    let gb = ctx.upload("B", b, Storage::F16)?;
    let c = ctx.alloc("C", m * n, Storage::F32, POISON_F32)?;
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    record_gemm(ctx, &mut enc, v, &ga, &gb, &c, (m, n, k), None)?;
    ctx.queue().submit([enc.finish()]);
    ctx.read_f32(&c)
}

/// Every embedded module is SPIR-V and declares only the Vulkan bindings its layout has, each of
/// the layout's kind: wgpu numbers a layout's bindings densely in order (shaders/nv/common.glsl),
/// so a module that declared a WGSL-style sparse number would read another buffer. A layout
/// listed in another order (the kinds no longer line up) is refused.
#[test]
fn embedded_spirv_is_spirv_with_dense_bindings() {
    for k in pisa_wgpu::runtime::nv::embedded_kernels() {
        assert!(k.spirv.len() > 20 && k.spirv.len() % 4 == 0, "{}", k.name);
        assert_eq!(
            &k.spirv[..4],
            &[0x03, 0x02, 0x23, 0x07],
            "{}: magic",
            k.name
        );
        let words = k.words().unwrap();
        pisa_wgpu::runtime::nv::check_bindings(&k, &words).unwrap();
        // The same module against a layout of the other kinds (uniform and storage buffers
        // swapped), or listed out of order, fails.
        let flip = |b: NvBinding| match b {
            NvBinding::Uniform => NvBinding::Read,
            _ => NvBinding::Uniform,
        };
        let flipped: Vec<_> = k.bindings.iter().map(|&(i, b)| (i, flip(b))).collect();
        let reversed: Vec<_> = k.bindings.iter().rev().cloned().collect();
        for bindings in [flipped, reversed] {
            let mut wrong = k;
            wrong.bindings = Box::leak(bindings.into_boxed_slice());
            let r = pisa_wgpu::runtime::nv::check_bindings(&wrong, &words);
            assert!(r.is_err(), "{}", k.name);
        }
    }
}

/// The shader override (`Tuning::shader_override`) of an NVIDIA kernel: `<kernel>.spv` in the
/// folder is read as the kernel's SPIR-V (here the embedded bytes of the first kernel, so the
/// words are the same); no file is no override; bytes that are not SPIR-V, or SPIR-V whose
/// bindings are another kernel's, are refused with the kernel and the file named. (Building a
/// pipeline from it needs the extension: `an_nvidia_kernel_override_builds_the_pipeline`.)
#[test]
fn an_nvidia_kernel_override_is_read_and_checked() {
    use pisa_wgpu::runtime::nv::{embedded_kernels, override_words};
    let dir = std::env::temp_dir().join(format!("pisa-nv-override-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let all = embedded_kernels();
    let k = all[0];
    // (a kernel whose module declares bindings that k's layout does not have)
    let other = (all.iter())
        .find(|o| pisa_wgpu::runtime::nv::check_bindings(&k, &o.words().unwrap()).is_err())
        .expect("a kernel of other bindings");
    let file = dir.join(format!("{}.spv", k.name));
    assert_eq!(override_words(None, &k), Ok(None), "no folder");
    assert_eq!(override_words(Some(&dir), &k), Ok(None), "no file");
    std::fs::write(&file, k.spirv).unwrap();
    assert_eq!(override_words(Some(&dir), &k), Ok(Some(k.words().unwrap())));
    std::fs::write(&file, b"not SPIR-V at all, 32 bytes long").unwrap();
    let e = override_words(Some(&dir), &k).unwrap_err();
    assert!(
        e.contains(k.name) && e.contains("not a SPIR-V module"),
        "{e}"
    );
    std::fs::write(&file, other.spirv).unwrap();
    let e = override_words(Some(&dir), &k).unwrap_err();
    assert!(e.contains(k.name) && e.contains(".spv"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// On a device with the extension, the override is what the pipeline is built from: a context
/// whose `shader_override` folder holds the first GEMM variant's own SPIR-V runs that variant
/// from the file and matches the CPU product (C poisoned, sizes no multiple of a tile); one
/// whose file for that kernel holds another kernel's module (other bindings) refuses the kernel
/// with a typed error naming the file, and the variant without the file still runs.
#[test]
fn an_nvidia_kernel_override_builds_the_pipeline() {
    let Some(base) = nv_ctx("an_nvidia_kernel_override_builds_the_pipeline") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("pisa-nv-build-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (kernel, _, _) = VARIANTS[0];
    let file = dir.join(format!("{}.spv", kernel.name));
    let with_override = || {
        let mut tuning = base.tuning();
        tuning.shader_override = Some(dir.clone());
        Context::with_tuning(&pisa_wgpu::AdapterChoice::HighPerformance, tuning).unwrap()
    };
    let seed = seed("nv_gemm_override");
    let mut r = rng(seed);
    let (m, n, k) = (300, 200, 136);
    let a: Vec<f32> = through_f16(&random(&mut r, m * k, 1.0));
    let b: Vec<f32> = through_f16(&random(&mut r, n * k, 1.0));
    let run = |ctx: &Context, v: usize| run_gemm(ctx, v, &a, &b, (m, n, k));
    std::fs::write(&file, kernel.spirv).unwrap();
    let ctx = with_override();
    assert!(ctx.nv_cm2(), "the override context has the extension too");
    let got = run(&ctx, 0).unwrap();
    let (worst, at) = worst_gemm_error(&a, &b, &got, (m, n, k));
    assert!(
        worst <= 1e-5,
        "override: error {worst:.2e} at {at} (seed {seed})"
    );
    // Another kernel's module in the file: refused, so the file is read for this kernel.
    let all = pisa_wgpu::runtime::nv::embedded_kernels();
    let other = (all.iter())
        .find(|o| pisa_wgpu::runtime::nv::check_bindings(&kernel, &o.words().unwrap()).is_err())
        .expect("a kernel of other bindings");
    std::fs::write(&file, other.spirv).unwrap();
    let ctx = with_override();
    match run(&ctx, 0) {
        Err(GpuError::Unsupported(e)) => assert!(e.contains(".spv"), "{e}"),
        other => panic!("another kernel's module ran as {}: {other:?}", kernel.name),
    }
    if VARIANTS.len() > 1 && VARIANTS[1].0.name != kernel.name {
        let got = run(&ctx, 1).unwrap();
        let (worst, at) = worst_gemm_error(&a, &b, &got, (m, n, k));
        assert!(
            worst <= 1e-5,
            "variant 1: error {worst:.2e} at {at} (seed {seed})"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn devices_without_the_extension_get_typed_errors() {
    let ctx = ctx();
    if ctx.nv_cm2() {
        eprintln!("devices_without_the_extension_get_typed_errors: this device has it: SKIPPED");
        return;
    }
    let instance = pisa_wgpu::instance();
    for adapter in pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all())) {
        let info = adapter.get_info();
        if pisa_wgpu::nv_cm2_supported(&adapter) {
            continue;
        }
        let r = pisa_wgpu::request_device_nv_cm2(&adapter, &Default::default());
        assert!(
            matches!(r, Err(GpuError::Unsupported(_))),
            "{}: {:?}",
            info.name,
            r.map(|_| ())
        );
    }
    assert!(!pisa_wgpu::device_has_nv_cm2(ctx.device()));
    let a = ctx.upload("A", &[1.0; 64], Storage::F16).unwrap();
    let c = ctx.alloc("C", 64, Storage::F32, POISON_F32).unwrap();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let r = record_gemm(ctx, &mut enc, 0, &a, &a, &c, (8, 8, 8), None);
    assert!(matches!(r, Err(GpuError::Unsupported(_))), "{r:?}");
}

#[test]
fn gemm_variants_match_cpu() {
    let Some(ctx) = nv_ctx("gemm_variants_match_cpu") else {
        return;
    };
    let seed = seed("nv_gemm");
    let mut r = rng(seed);
    // No multiple of any tile (64..256) nor of the K steps (32, 64); not powers of two.
    for (m, n, k) in [(300, 200, 136), (77, 333, 40)] {
        let a: Vec<f32> = through_f16(&random(&mut r, m * k, 1.0));
        let b: Vec<f32> = through_f16(&random(&mut r, n * k, 1.0));
        for (v, (kernel, _, _)) in VARIANTS.iter().enumerate() {
            let got = run_gemm(ctx, v, &a, &b, (m, n, k)).unwrap();
            let (worst, at) = worst_gemm_error(&a, &b, &got, (m, n, k));
            eprintln!(
                "{} {m}x{n}x{k}: worst error {worst:.2e} of the row's |products| at {at} (seed {seed})",
                kernel.name
            );
            assert!(
                worst <= 1e-5,
                "{}: error {worst:.2e} at {at} (seed {seed})",
                kernel.name
            );
        }
    }
}

/// Every embedded NVIDIA kernel builds on the device (a driver that cannot compile one reports
/// an internal error, which `Context::nv_pipeline` turns into a typed error).
#[test]
fn every_kernel_builds() {
    let Some(ctx) = nv_ctx("every_kernel_builds") else {
        return;
    };
    let mut failed = Vec::new();
    for k in pisa_wgpu::runtime::nv::embedded_kernels() {
        match ctx.nv_pipeline_for_tests(&k) {
            Ok(()) => eprintln!("{}: built", k.name),
            Err(e) => {
                eprintln!("{}: {e}", k.name);
                failed.push(k.name);
            }
        }
    }
    assert!(failed.is_empty(), "not built: {failed:?}");
}

#[test]
fn probes_match_cpu() {
    let Some(ctx) = nv_ctx("probes_match_cpu") else {
        return;
    };
    let seed = seed("nv_probe");
    let mut r = rng(seed);
    let a: Vec<f32> = through_f16(&random(&mut r, 64 * 128, 1.0));
    let b: Vec<f32> = through_f16(&random(&mut r, 64 * 128, 1.0));
    let ga = ctx.upload("A", &a, Storage::F16).unwrap();
    let gb = ctx.upload("B", &b, Storage::F16).unwrap();
    let s: Vec<f64> = (0..64 * 64)
        .map(|x| {
            let (i, j) = (x / 64, x % 64);
            (0..128)
                .map(|t| a[i * 128 + t] as f64 * b[j * 128 + t] as f64)
                .sum()
        })
        .collect();
    let rowmax: Vec<f64> = s
        .chunks(64)
        .map(|r| r.iter().cloned().fold(f64::MIN, f64::max))
        .collect();
    let mut failed = Vec::new();
    for k in &PROBES {
        let out = ctx.alloc("out", 64 * 64, Storage::F32, POISON_F32).unwrap();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        record_probe(ctx, &mut enc, k, &ga, &gb, &out).unwrap();
        ctx.queue().submit([enc.finish()]);
        let got = ctx.read_f32(&out).unwrap();
        let want: &[f64] = if k.name == "probe_shared_load" {
            &s
        } else {
            &rowmax
        };
        // Negated so that a NaN element counts as bad.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let bad = (0..want.len())
            .filter(|&x| !((got[x] as f64 - want[x]).abs() <= 1e-3 * (1.0 + want[x].abs())))
            .count();
        eprintln!(
            "{}: {bad} of {} elements wrong (first: got {:?}, want {:?})",
            k.name,
            want.len(),
            &got[..4],
            &want[..4]
        );
        if bad > 0 {
            failed.push(k.name);
        }
    }
    assert!(failed.is_empty(), "probes failed: {failed:?} (seed {seed})");
}

/// GPU-timed TFLOP/s of every variant (median of 5 after a warm-up).
#[test]
#[ignore]
fn nv_gemm_tflops() {
    let Some(ctx) = nv_ctx("nv_gemm_tflops") else {
        return;
    };
    let sizes: Vec<usize> = std::env::var("PISA_GEMM_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or(vec![4096, 8192]);
    for &s in &sizes {
        let a = random_tensor(ctx, "A", s * s, Storage::F16, 1, 1.0).unwrap();
        let b = random_tensor(ctx, "B", s * s, Storage::F16, 2, 1.0).unwrap();
        let c = ctx.alloc("C", s * s, Storage::F32, POISON_F32).unwrap();
        for (v, (kernel, _, _)) in VARIANTS.iter().enumerate() {
            let mut times = Vec::new();
            for rep in 0..6 {
                let mut prof = Profiler::new(ctx, 1);
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                record_gemm(ctx, &mut enc, v, &a, &b, &c, (s, s, s), Some(&mut prof)).unwrap();
                ctx.queue().submit([enc.finish()]);
                let st = prof.finish(ctx).unwrap();
                if rep > 0 {
                    times.push(st.get("gemm"));
                }
            }
            times.sort_by(|x, y| x.partial_cmp(y).unwrap());
            let ms = times[times.len() / 2];
            let tf = 2.0 * (s as f64).powi(3) / (ms * 1e-3) / 1e12;
            println!("nv {} {s}^3: {ms:.3} ms, {tf:.1} TFLOP/s", kernel.name);
        }
    }
}
