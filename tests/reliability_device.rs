//! Reliability of the GPU library (`docs/reliability.md`), device limits and faults: a
//! binding limit gives a typed `Limit` error, then a split call with bitwise the same result; a
//! dispatch past the grid limit is a typed error (past one dimension it is split); a wgpu
//! validation error comes back as `GpuError::Validation` with the context usable; a destroyed
//! device gives `DeviceLost` from every call, no panic, and a new context works. Results are
//! compared bitwise with fixed-seed runs (`reliability_util`).
mod common;
#[path = "reliability_util.rs"]
mod reliability_util;

use common::*;
use pisa_core::PisaError;
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::ops::prefill::prefill_host;
use pisa_wgpu::{GpuError, Storage};
use reliability_util::{inputs, opts, private_ctx, same_output, small};

#[test]
fn binding_limit_gives_limit_error_then_the_context_recovers() {
    let ctx = private_ctx();
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 3);
    let want = prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    assert_eq!(want.chunks, 1);
    // One KV head of K is 200 * 32 * 4 = 25,600 bytes: a 4 KiB binding cannot hold it.
    ctx.set_max_binding_bytes(4096);
    let e = prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap_err();
    match &e {
        GpuError::Limit { needed, limit, .. } => {
            assert_eq!(*limit, 4096);
            assert!(*needed > 4096);
        }
        other => panic!("expected GpuError::Limit, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("4096"), "{msg}");
    // Enough for one KV head but not two: the call is split, with identical results.
    ctx.set_max_binding_bytes(60_000);
    let split = prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    assert!(split.chunks > 1);
    assert!(same_output(&want, &split), "split result differs");
    // Back to the device limit: same result again.
    ctx.set_max_binding_bytes(u64::MAX);
    let again = prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    assert!(same_output(&want, &again));
}

/// The `Limit` hint of a head past one binding suggests f16 storage only where the storage is
/// f32: with f16 storage already it says to shorten the sequence.
#[test]
fn binding_limit_hint_fits_the_storage() {
    let ctx = private_ctx();
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 5);
    // One KV head of K: 200 * 32 * 2 = 12,800 bytes in f16, 25,600 in f32.
    ctx.set_max_binding_bytes(4096);
    for (storage, f16_hint) in [(Storage::F32, true), (Storage::F16, false)] {
        if storage == Storage::F16
            && !ctx
                .features()
                .contains(pisa_wgpu::wgpu::Features::SHADER_F16)
        {
            continue;
        }
        let o = pisa_wgpu::ops::prefill::PrefillOptions {
            storage,
            ..opts(cfg)
        };
        match prefill_host(&ctx, &q, &k, &v, &shape, &o).unwrap_err() {
            GpuError::Limit { hint, .. } => {
                assert_eq!(
                    hint.contains("f16 storage"),
                    f16_hint,
                    "{storage:?}: {hint}"
                )
            }
            other => panic!("expected GpuError::Limit, got {other:?}"),
        }
    }
}

#[test]
fn dispatch_past_the_grid_limit_is_a_typed_error() {
    let ctx = ctx();
    let module = ctx
        .device()
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("noop"),
            source: wgpu::ShaderSource::Wgsl("@compute @workgroup_size(1) fn main() {}".into()),
        });
    let pipe = ctx
        .device()
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("noop"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let e = ctx
        .dispatch::<&wgpu::Buffer>(&mut enc, &pipe, &[], u64::MAX, None)
        .unwrap_err();
    assert!(
        matches!(
            e,
            GpuError::Input(PisaError::TooLarge {
                value: u64::MAX,
                ..
            })
        ),
        "{e:?}"
    );
    // A grid past one dimension's limit is split, not refused.
    let per_dim = ctx.limits().max_compute_workgroups_per_dimension as u64;
    ctx.scoped("noop", || {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        ctx.dispatch::<&wgpu::Buffer>(&mut enc, &pipe, &[], per_dim + 1, None)?;
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
}

/// A wgpu validation error raised inside `Context::scoped` comes back as
/// `GpuError::Validation`, and the next call on the same context succeeds.
#[test]
fn validation_error_is_returned_and_the_context_stays_usable() {
    let ctx = ctx();
    let too_big = ctx.limits().max_buffer_size + 4;
    let e = ctx
        .scoped("oversized buffer", || {
            let _b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
                label: Some("too big"),
                size: too_big,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            });
            Ok(())
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            GpuError::Validation {
                op: "oversized buffer",
                ..
            } | GpuError::OutOfMemory { .. }
        ),
        "{e:?}"
    );
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 4);
    prefill_host(ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
}

/// A destroyed device (what a driver reset looks like from wgpu): every later call returns
/// [`GpuError::DeviceLost`], none panics, and a new context works. (Found by the reliability
/// review: `upload`/`alloc` panicked inside wgpu's `create_buffer_init`, and the device-lost
/// callback ignored the `Destroyed` reason.)
#[test]
fn destroyed_device_gives_errors_and_a_new_context_works() {
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 5);
    let want = prefill_host(ctx(), &q, &k, &v, &shape, &opts(cfg)).unwrap();
    let dead = private_ctx();
    let mut cache = KvCache::new(&dead, 1, 64, 4, 2, 32, cfg, Storage::F32).unwrap();
    let live = dead.upload("before", &[1.0; 8], Storage::F32).unwrap();
    dead.device().destroy();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let lost = |r: pisa_wgpu::Result<()>| matches!(r, Err(GpuError::DeviceLost(_)));
        let checks: Vec<(&str, pisa_wgpu::Result<()>)> = vec![
            ("check_alive", dead.check_alive()),
            (
                "upload",
                dead.upload("x", &[1.0; 8], Storage::F32).map(|_| ()),
            ),
            ("upload_u32", dead.upload_u32("x", &[1u32; 8]).map(|_| ())),
            ("alloc", dead.alloc("x", 8, Storage::F32, 0).map(|_| ())),
            ("uniform", dead.uniform("x", &[1u32; 4]).map(|_| ())),
            ("read_f32", dead.read_f32(&live).map(|_| ())),
            ("wait", dead.wait()),
            ("scoped", dead.scoped("x", || Ok(()))),
            (
                "prefill",
                prefill_host(&dead, &q, &k, &v, &shape, &opts(cfg)).map(|_| ()),
            ),
            (
                "decode",
                cache
                    .append_and_step(&[0.1; 64], &[0.1; 64], &[true], &[0.1; 128], true)
                    .map(|_| ()),
            ),
            (
                "new cache",
                KvCache::new(&dead, 1, 64, 4, 2, 32, cfg, Storage::F32).map(|_| ()),
            ),
        ];
        checks
            .into_iter()
            .map(|(what, r)| (what, format!("{r:?}"), lost(r)))
            .collect::<Vec<_>>()
    }));
    let results = r.expect("a call on a destroyed device panicked");
    for (what, r, ok) in &results {
        eprintln!("destroyed device: {what}: {r}");
        assert!(ok, "{what} on a destroyed device gave {r}, not DeviceLost");
    }
    let msg = dead.check_alive().unwrap_err().to_string();
    assert!(
        msg.contains("destroyed") && msg.contains("new context"),
        "{msg}"
    );
    // A fresh context gives the same result as before.
    let fresh = private_ctx();
    let got = prefill_host(&fresh, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    assert!(same_output(&want, &got));
}

/// A device the application opened with lower limits than the adapter's gets typed errors
/// that say what to change, not wgpu's validation errors: with wgpu's downlevel defaults (4
/// storage buffers per stage) a prefill and a decode cache are a `Limit` in "bindings" naming
/// the kernel; with its
/// WebGL2 defaults (no compute shaders) the context itself is `Unsupported`. With the
/// adapter's limits the same prefill runs (so the errors come from the limits alone).
#[test]
fn lower_device_limits_give_typed_errors() {
    let instance = pisa_wgpu::wgpu::Instance::new(
        pisa_wgpu::wgpu::InstanceDescriptor::new_without_display_handle_from_env(),
    );
    let adapter = pollster::block_on(instance.request_adapter(&Default::default()))
        .expect("a GPU adapter (install mesa-vulkan-drivers)");
    let open_without = |limits: pisa_wgpu::wgpu::Limits, without: pisa_wgpu::wgpu::Features| {
        let (device, queue) =
            pollster::block_on(adapter.request_device(&pisa_wgpu::wgpu::DeviceDescriptor {
                required_features: pisa_wgpu::wanted_features(&adapter)
                    - pisa_wgpu::wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
                    - without,
                required_limits: limits.using_resolution(adapter.limits()),
                ..Default::default()
            }))
            .expect("a device with lower limits than the adapter's");
        pisa_wgpu::Context::from_device(&adapter, device, queue)
    };
    let open = |limits| open_without(limits, pisa_wgpu::wgpu::Features::empty());
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 11);

    let ctx = open(adapter.limits()).unwrap();
    prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();

    let ctx = open(pisa_wgpu::wgpu::Limits::downlevel_defaults()).unwrap();
    match prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap_err() {
        GpuError::Limit {
            what,
            needed,
            limit,
            unit,
            ..
        } => {
            assert_eq!((unit, limit), ("bindings", 4), "{what}");
            assert!(needed > 4, "{what}: {needed}");
            assert!(
                what.contains("storage buffers") && what.contains("kernel"),
                "{what}"
            );
        }
        other => panic!("expected GpuError::Limit, got {other:?}"),
    }
    // A decode cache too (its kernels bind 9 storage buffers; checked when it is made).
    match KvCache::new(&ctx, 1, 64, 4, 2, 16, cfg, Storage::F32) {
        Err(GpuError::Limit {
            what,
            needed,
            limit,
            unit,
            ..
        }) => {
            assert_eq!((unit, limit, needed), ("bindings", 4, 9), "{what}");
            assert!(what.contains("decode"), "{what}");
        }
        other => panic!("expected GpuError::Limit for a decode cache, got {other:?}"),
    }

    // A device opened without SHADER_F16: f16 storage is refused, naming the device's
    // features where the adapter has it.
    let ctx = open_without(adapter.limits(), pisa_wgpu::wgpu::Features::SHADER_F16).unwrap();
    let adapter_f16 = adapter
        .features()
        .contains(pisa_wgpu::wgpu::Features::SHADER_F16);
    match KvCache::new(&ctx, 1, 64, 4, 2, 16, cfg, Storage::F16) {
        Err(GpuError::Unsupported(msg)) => {
            let want = if adapter_f16 {
                "device was opened without SHADER_F16"
            } else {
                "adapter has no SHADER_F16"
            };
            assert!(msg.contains(want), "{msg}");
        }
        other => panic!("expected GpuError::Unsupported for f16 storage, got {other:?}"),
    }
    // The plans too, at `new` (a varlen plan refused only at its first run).
    let f16_opts = pisa_wgpu::PrefillOptions {
        cfg,
        storage: Storage::F16,
        ..Default::default()
    };
    let shape = pisa_core::AttentionShape::prefill(1, 4, 2, 100, 16).unwrap();
    let r = pisa_wgpu::PrefillPlan::new(&ctx, &shape, &f16_opts).map(drop);
    assert!(
        matches!(r, Err(GpuError::Unsupported(_))),
        "PrefillPlan: {r:?}"
    );
    let r = pisa_wgpu::VarlenPrefillPlan::new(&ctx, 4, 2, 16, &f16_opts).map(drop);
    assert!(
        matches!(r, Err(GpuError::Unsupported(_))),
        "VarlenPrefillPlan: {r:?}"
    );

    match open(pisa_wgpu::wgpu::Limits::downlevel_webgl2_defaults()) {
        Err(GpuError::Unsupported(msg)) => assert!(msg.contains("compute"), "{msg}"),
        Err(other) => panic!("expected GpuError::Unsupported, got {other:?}"),
        Ok(_) => panic!("a context on a device without compute shaders"),
    }
}

/// pisa's own device destroyed while its queue still runs a prefill: wgpu runs the device-lost
/// callback only once the queue is empty, so a call that then caught an error (a plan's buffers
/// invalid) returned `Validation`; it now probes the device and returns `DeviceLost`, as every
/// later call does. (Whether the prefill is still running when the device goes depends on the
/// machine; either way every call below must say `DeviceLost`.)
#[test]
fn device_destroyed_with_work_in_flight_gives_device_lost() {
    use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
    use pisa_wgpu::{wgpu, DType, PrefillOptions, PrefillOutputs, PrefillPlan, TensorView};
    let dead = private_ctx();
    let (hq, hkv, n, d) = (8, 2, 2048, 64);
    let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
    let po = PrefillOptions {
        cfg: SelectionConfig::new(16, 8).unwrap(),
        ..Default::default()
    };
    let plan = PrefillPlan::new(&dead, &shape, &po).unwrap();
    let buffer = |elems: usize| {
        dead.device().create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (elems * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let view = |b: &wgpu::Buffer, h: usize, dd: usize| {
        TensorView::contiguous(b, 0, DType::F32, [1, h, n, dd], TensorLayout::Bhnd).unwrap()
    };
    let (q, kv, o, lse) = (
        buffer(hq * n * d),
        buffer(hkv * n * d),
        buffer(hq * n * d),
        buffer(hq * n),
    );
    let (qv, kvv, ov, lv) = (
        view(&q, hq, d),
        view(&kv, hkv, d),
        view(&o, hq, d),
        view(&lse, hq, 1),
    );
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    for _ in 0..4 {
        let mut enc = dead.device().create_command_encoder(&Default::default());
        plan.run(&mut enc, &qv, &kvv, &kvv, &outs, None).unwrap();
        dead.queue().submit([enc.finish()]);
    }
    dead.device().destroy();
    let lost = |what: &str, r: pisa_wgpu::Result<()>| {
        assert!(
            matches!(r, Err(GpuError::DeviceLost(_))),
            "{what} after the device was destroyed: {r:?}"
        );
    };
    lost(
        "a new plan",
        PrefillPlan::new(&dead, &shape, &po).map(|_| ()),
    );
    lost("check_alive", dead.check_alive());
}

/// `record_prefill` (the hidden entry of device tensors) given a K in a buffer without
/// `STORAGE` usage, on a device the app opened (whose uncaptured-error handler panics): a
/// typed `Validation` error, not a panic inside wgpu. The same call with K in a storage
/// buffer records and runs, so the error comes from the buffer alone.
#[test]
fn prefill_of_a_buffer_it_cannot_bind_is_a_typed_error() {
    let instance = pisa_wgpu::instance();
    let adapter = pollster::block_on(instance.request_adapter(&Default::default()))
        .expect("a GPU adapter (install mesa-vulkan-drivers)");
    let desc = pisa_wgpu::app_device_descriptor(&adapter);
    let (device, queue) = pollster::block_on(adapter.request_device(&desc)).unwrap();
    let ctx = pisa_wgpu::Context::from_device(&adapter, device, queue).unwrap();
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 6);
    let up = |x: &[f32], name| ctx.upload(name, x, Storage::F32).unwrap();
    let (qt, kt, vt) = (up(&q, "q"), up(&k, "k"), up(&v, "v"));
    let not_storage = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("K without STORAGE"),
        size: 4 * k.len() as u64,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let bad_k = pisa_wgpu::GpuTensor::from_buffer(not_storage, k.len(), Storage::F32);
    let o = opts(cfg);
    let record = |k: &pisa_wgpu::GpuTensor| {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let r =
            pisa_wgpu::ops::prefill::record_prefill(&ctx, &mut enc, &qt, k, &vt, &shape, &o, None);
        (r.map(drop), enc)
    };
    let (r, enc) = record(&bad_k);
    assert!(matches!(r, Err(GpuError::Validation { .. })), "{r:?}");
    drop(enc);
    let (r, enc) = record(&kt);
    r.unwrap();
    ctx.queue().submit([enc.finish()]);
    ctx.wait().unwrap();
}
