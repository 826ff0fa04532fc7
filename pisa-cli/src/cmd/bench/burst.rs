//! The bursts of the decode measurement of `pisa bench` ([`super::decode`]): steps recorded
//! back to back into one submission and timed as one span, as the PyTorch peer times decode.

use anyhow::{Context as _, Result};
use pisa_wgpu::{Context, GpuTensor, Profiler};

/// Refuses a burst whose timed passes (`steps` per K/V part: the dense burst times one pass
/// per part and step, the PISA burst fewer) exceed one profiler ([`Profiler::MAX_PASSES`]),
/// before anything is measured (on every adapter, with timestamps or not, so the same command
/// means the same on each).
pub(super) fn check_burst(steps: usize, parts: usize) -> Result<()> {
    let most = Profiler::MAX_PASSES as usize;
    if steps.saturating_mul(parts) > most {
        anyhow::bail!(
            "--decode-burst {steps}: {parts} K/V part(s) x {steps} steps exceed the {most} timed \
             passes of one timestamp query set; use at most {}",
            most / parts
        );
    }
    Ok(())
}

/// Dense attention outputs `(O, LSE)` of a burst, kept alive until it has run.
pub(super) type Outs = Vec<(GpuTensor, GpuTensor)>;

/// Times a burst over `parts` K/V parts (a dense step times one pass per part): `record` records `steps` steps back to back into ONE command encoder
/// (each step's passes labelled `label` in the profiler) and submits it; returns ms per step.
/// With GPU timestamps it is [`Profiler::finish_span`] over the `label` passes (the first
/// step's begin to the last step's end, gaps between the steps included, as two CUDA events
/// around the PyTorch peer's 10 calls measure) divided by `steps`; without, the wall clock
/// of recording, submitting and waiting, divided by `steps` (the table then says
/// WALL-CLOCK). The PISA steps of a burst are ordered by the cache's scratch and outputs,
/// which each step rewrites. Dense steps share no buffer they write, and Vulkan may overlap
/// dispatches that nothing orders (a CUDA stream runs its kernels one after another), so the
/// dense `record` chains them: a step's query is the previous step's output O (same shape and
/// precision; the dense kernel's work does not depend on the values). `record` pushes the
/// dense outputs to its `Outs`, part-minor.
pub(super) fn burst(
    ctx: &Context,
    parts: usize,
    steps: usize,
    label: &'static str,
    record: impl FnOnce(&mut Profiler, &mut Outs) -> pisa_wgpu::Result<()>,
) -> Result<f64> {
    // Passes: a PISA step is one pass for all parts, a dense step one pass per part.
    let passes = steps.max(1) * parts;
    let mut prof = Profiler::new(ctx, passes as u32);
    let mut outs = Outs::new();
    let started = std::time::Instant::now();
    ctx.scoped("bench decode burst", || record(&mut prof, &mut outs))?;
    let wall = started.elapsed().as_secs_f64() * 1e3;
    drop(outs);
    if !ctx.has_timestamps() {
        return Ok(wall / steps.max(1) as f64);
    }
    let span = prof
        .finish_span(ctx, label)?
        .with_context(|| format!("no GPU span for the {label} burst"))?;
    Ok(span / steps.max(1) as f64)
}
