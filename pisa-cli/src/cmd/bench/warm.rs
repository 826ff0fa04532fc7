//! The GPU warm-up of `pisa bench`: a spin kernel ([`Warmup`], `spin.wgsl`) recorded at the
//! start of each timed submission, untimed, so that the timed passes after it run on a GPU that
//! has been busy for a set time, at the clocks a busy GPU holds, whatever ran before them.
//!
//! Why: a GPU's power management lowers its clocks when it is mostly idle, and a benchmark
//! that submits microseconds of work between host round trips leaves it mostly idle, in a
//! state that depends on what ran before (in the same process or another). Measured on an
//! NVIDIA H100, driver 580.159.04 (docs/benchmarks.md A.77, 2026-12-07, commit `e8d4c1e`),
//! without a warm-up: the decode step at a 64K-token cache took 64.0 us instead of 38.6 when
//! the smaller caches had been measured first in the same run, at 256K 69 to 126 us instead of
//! 42 (dense decode 0.70 to 1.41 ms instead of 0.44, so not the kernels), and 2K to 8K-token
//! prefills 4.3 to 4.6 times their usual time after an earlier run; measured alone, while
//! another process kept the GPU busy, or with a warm-up (of 14.7 or 29.4 ms in that run, whose
//! dispatch was longer), every size took its usual time. An inference loop keeps the GPU busy,
//! so the warm GPU's times are the ones it sees.

use anyhow::{Context as _, Result};
use pisa_wgpu::wgpu::{self, util::DeviceExt};
use pisa_wgpu::{Context, Profiler};

/// Spin iterations of one warm-up dispatch (about 0.9 ms on an idle H100, whose clock the
/// calibration finds low: 2^19 took 14.8 ms there).
const ITERS: u32 = 1 << 15;
/// Most dispatches of one warm-up.
const MAX_DISPATCHES: u32 = 1000;

/// Default warm-up, ms of GPU time before each timed submission: `default_ms` for a GPU, none
/// for a CPU adapter (lavapipe, SwiftShader), whose clocks no spin kernel changes.
pub fn default_ms(ctx: &Context) -> f64 {
    if ctx.report().device_type == "Cpu" {
        0.0
    } else {
        DEFAULT_MS
    }
}

/// The default warm-up on a GPU, ms.
pub const DEFAULT_MS: f64 = 5.0;

/// A warm-up of about `ms` of GPU time, recorded into a command encoder before timed work.
pub struct Warmup {
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    /// Dispatches of one warm-up.
    dispatches: u32,
    /// GPU time of one dispatch when calibrated, ms.
    dispatch_ms: f64,
}

impl std::fmt::Debug for Warmup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Warmup")
            .field("dispatches", &self.dispatches)
            .field("dispatch_ms", &self.dispatch_ms)
            .finish()
    }
}

impl Warmup {
    /// A warm-up of about `ms` of GPU time, calibrated by timing its dispatch; `None` for
    /// `ms` 0, or without GPU timestamps (the wall clock that times the submissions then
    /// would count it).
    pub fn new(ctx: &Context, ms: f64) -> Result<Option<Self>> {
        if ms <= 0.0 || !ctx.has_timestamps() {
            return Ok(None);
        }
        let device = ctx.device();
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("bench warm-up"),
            source: wgpu::ShaderSource::Wgsl(include_str!("spin.wgsl").into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("bench warm-up"),
            layout: None,
            module: &module,
            entry_point: Some("spin"),
            compilation_options: Default::default(),
            cache: None,
        });
        let params = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("bench warm-up params"),
            contents: &ITERS.to_le_bytes(),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let sink = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("bench warm-up sink"),
            size: 64 * 4,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("bench warm-up"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: params.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: sink.as_entire_binding(),
                },
            ],
        });
        let mut w = Self {
            pipeline,
            bind_group,
            dispatches: 1,
            dispatch_ms: 0.0,
        };
        // Calibration: one dispatch timed three times (the last, on a GPU the first two woke).
        for _ in 0..3 {
            let mut prof = Profiler::new(ctx, 1);
            ctx.scoped("bench warm-up", || {
                let mut enc = device.create_command_encoder(&Default::default());
                {
                    let mut pass = prof.compute_pass(&mut enc, "warm-up");
                    w.dispatch(&mut pass, 1);
                }
                ctx.queue().submit([enc.finish()]);
                Ok(())
            })?;
            w.dispatch_ms = prof.finish(ctx)?.get("warm-up");
        }
        anyhow::ensure!(
            w.dispatch_ms.is_finite() && w.dispatch_ms > 0.0,
            "the warm-up kernel was not timed ({} ms)",
            w.dispatch_ms
        );
        w.dispatches = ((ms / w.dispatch_ms).ceil() as u32).clamp(1, MAX_DISPATCHES);
        Ok(Some(w))
    }

    /// GPU time of one warm-up as calibrated, ms.
    pub fn ms(&self) -> f64 {
        self.dispatch_ms * self.dispatches as f64
    }

    fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, n: u32) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        for _ in 0..n {
            pass.dispatch_workgroups(1, 1, 1);
        }
    }

    /// Records the warm-up into `enc` (one untimed compute pass), to run before what `enc`
    /// records next.
    pub fn record(&self, enc: &mut wgpu::CommandEncoder) {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("bench warm-up"),
            timestamp_writes: None,
        });
        self.dispatch(&mut pass, self.dispatches);
    }
}

/// The warm-up of `ms` (`None`: [`default_ms`]) for `ctx`, with what it was calibrated to.
///
/// Not covered: on an NVIDIA H100 just started, the first process's first size (a 2K-token
/// prefill, memory-bound kernels of microseconds) ran 3 to 4 times slower than in every later
/// process, with this warm-up or with a first one of 280 ms, while the spin kernel itself ran
/// at its usual speed (docs/benchmarks.md A.80).
pub fn for_run(ctx: &Context, ms: Option<f64>) -> Result<Option<std::sync::Arc<Warmup>>> {
    let ms = ms.unwrap_or_else(|| default_ms(ctx));
    let w = Warmup::new(ctx, ms).context("calibrating the GPU warm-up (--warmup-ms)")?;
    Ok(w.map(std::sync::Arc::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Context {
        // A missing adapter fails the test (as the library's tests do), never skips it.
        Context::new(&pisa_wgpu::AdapterChoice::HighPerformance)
            .expect("a GPU adapter (install mesa-vulkan-drivers)")
    }

    /// The warm-up is calibrated where there are timestamps (none without, and none for 0 ms),
    /// runs, and stays out of the timed passes recorded after it: the profiler reports only
    /// the timed pass, and a time far below the warm-up's.
    #[test]
    fn the_warm_up_runs_untimed_before_the_timed_passes() {
        let ctx = ctx();
        assert!(Warmup::new(&ctx, 0.0).unwrap().is_none());
        let Some(w) = Warmup::new(&ctx, 2.0).unwrap() else {
            assert!(!ctx.has_timestamps(), "timestamps, yet no warm-up");
            return;
        };
        assert!(w.dispatch_ms > 0.0 && w.dispatches >= 1, "{w:?}");
        assert!(w.ms() >= 2.0 || w.dispatches == MAX_DISPATCHES, "{w:?}");
        let mut prof = Profiler::new(&ctx, 1);
        ctx.scoped("warm-up test", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            w.record(&mut enc);
            drop(prof.compute_pass(&mut enc, "timed"));
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })
        .unwrap();
        let t = prof.finish(&ctx).unwrap();
        assert_eq!(t.stages.len(), 1, "{:?}", t.stages);
        assert!(
            t.get("timed") < w.ms() / 2.0,
            "{:?} against {w:?}",
            t.stages
        );
    }

    /// No warm-up by default on a CPU adapter (lavapipe), whose clocks a spin does not change.
    #[test]
    fn the_default_is_none_on_a_cpu_adapter() {
        let ctx = ctx();
        let cpu = ctx.report().device_type == "Cpu";
        assert_eq!(default_ms(&ctx) == 0.0, cpu, "{}", ctx.report().device_type);
        if cpu {
            assert!(for_run(&ctx, None).unwrap().is_none());
        }
    }
}
