//! `pisa decode`: prefill the first P tokens of the given K/V into the GPU KV cache, then decode
//! the remaining tokens one at a time as an inference loop would (append the token's key and
//! value, then one fused selection + attention step), write the outputs, and report per-step
//! latency. `--check` compares every decoded row with `forward` on the same input.
//!
//! Split by role: this file holds the arguments and the command ([`run`], and [`demo`] for
//! `pisa demo`); [`steps`] the decode loop, [`stats`] the latency percentiles and the check.

pub mod stats;
pub mod steps;

use std::path::PathBuf;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use pisa_core::SelectionConfig;
use pisa_wgpu::{Context, Storage};

use crate::args::{DeviceArgs, ScoringArgs, SelectArgs};
use crate::input::{InputArgs, Loaded};
use crate::io::{self, DType, Outputs};
use crate::text::plural;

pub use stats::{check, percentiles};
pub use steps::{check_prefill, run_decode, DecodeRun};

/// Arguments of `pisa decode`.
#[derive(Args, Debug)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub select: SelectArgs,
    #[command(flatten)]
    pub scoring: ScoringArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Tokens prefilled before decoding starts (default: half the input).
    #[arg(long)]
    pub prefill: Option<usize>,
    /// Output file for O, LSE (and the selection): rows of the prefill part come from the
    /// prefill, the rest from the decode steps.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Element type of O in the output file [default: f32].
    #[arg(long, value_enum)]
    pub out_dtype: Option<DType>,
    /// Also write the selected leaf blocks.
    #[arg(long)]
    pub save_selection: bool,
    /// Compare every decoded row with `forward` (prefill) on the same input; fails past the
    /// tolerance (1e-4 relative for f32 and bf16 storage, 5e-3 for f16).
    #[arg(long)]
    pub check: bool,
}

/// Runs `pisa decode`.
pub fn run(a: DecodeArgs) -> Result<()> {
    let out_dtype =
        super::forward::out_dtype_of(a.output.as_deref(), a.out_dtype, a.save_selection)?;
    if let Some(path) = &a.output {
        super::forward::check_output(path, out_dtype, a.save_selection, &a.input)?;
    }
    let l = a.input.load_for(a.device.storage, true)?;
    // Causal: each decoded token attends to the tokens before it.
    let cfg = a
        .select
        .config(a.scoring.scoring.into(), true, &l.file_scale)?;
    l.check_score_bound(cfg.softmax_scale(l.shape.head_dim))?;
    l.check_value_bound()?;
    if let Some(w) = crate::args::top_k_warning(&cfg, l.shape.k_len, a.save_selection) {
        eprintln!("warning: {w}");
    }
    let p = a.prefill.unwrap_or(l.shape.q_len / 2);
    check_prefill(p, l.shape.q_len).with_context(|| l.source.clone())?;
    let ctx = a.device.context()?;
    crate::limits::warn_llvmpipe(&ctx, l.shape.k_len);
    let storage: Storage = a.device.storage.into();
    let r = run_decode(&ctx, &l, &cfg, storage, p)
        .map_err(|e| crate::args::top_k_note(e, &cfg, l.shape.k_len))
        .with_context(|| format!("{}: decode failed", l.source))?;
    l.check_out_finite(&r.out, &r.lse, storage == Storage::F16)?;
    // The first step compiles the decode pipelines: left out of the latency statistics.
    let skip = usize::from(r.step_ms.len() > 1);
    let (med, p99) = percentiles(&r.step_ms[skip..]);
    let (wmed, wp99) = percentiles(&r.wall_ms[skip..]);
    // The check runs before anything is written: a failing run leaves no output file.
    let checked = if a.check {
        Some(check(&ctx, &l, &cfg, storage, p, &r)?)
    } else {
        None
    };
    let tol = if storage == Storage::F16 { 5e-3 } else { 1e-4 };
    let check_ok = checked
        .as_ref()
        .is_none_or(|c| c.out_err <= tol && c.lse_err <= tol);
    // Staged, reported, then renamed into place (as `forward`).
    let mut staged = None;
    if let (Some(path), true) = (&a.output, check_ok) {
        l.check_out_range(&r.out, out_dtype)?;
        let sel = a.save_selection.then_some(&r.selection[..]);
        let (o, lse, idx) = super::forward::output_tensors_of(&l, &r.out, &r.lse, sel, cfg.top_k)?;
        let mut meta = l.output_metadata(&cfg);
        meta.insert("prefill_tokens".to_string(), p.to_string());
        staged = Some(io::stage_outputs(
            path,
            &Outputs {
                o: &o,
                lse: Some(&lse),
                indices: idx.as_ref(),
            },
            out_dtype,
            &meta,
        )?);
    }
    let written = staged.as_ref().map_or(&[][..], |s| s.paths());
    let clock = if r.gpu { "GPU" } else { "wall-clock" };
    if a.device.json {
        let mut j = l.run_json(
            &ctx.report().name,
            &cfg,
            storage,
            serde_json::json!({
                "prefill": p, "steps": r.step_ms.len(),
                "step_ms_median": med, "step_ms_p99": p99, "gpu_timed": r.gpu,
                "wall_ms_median": wmed, "wall_ms_p99": wp99, "written": crate::io::paths_text(written),
            }),
        );
        if let Some(c) = &checked {
            j["check"] = serde_json::json!({"out_rel_err": c.out_err, "lse_rel_err": c.lse_err, "selection_rows_differing": c.differing.0, "rows": c.differing.1, "tolerance": tol, "passed": check_ok});
        }
        crate::args::outln!("{}", serde_json::to_string_pretty(&j)?)?;
    } else {
        crate::args::outln!(
            "decode: prefill {}, {} on {}: {clock} per step median {med:.3} ms, p99 {p99:.3} ms (wall-clock with transfers: median {wmed:.3} ms, p99 {wp99:.3} ms; {}){}",
            plural(p, "token"),
            plural(r.step_ms.len(), "step"),
            ctx.report().name,
            if skip == 1 { "first step excluded" } else { "one step: pipeline builds included" },
            if written.is_empty() { String::new() } else { format!("; wrote {}", written.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")) }
        )?;
        if let Some(c) = &checked {
            crate::args::outln!(
                "check vs forward: O rel. error {:.2e}, LSE rel. error {:.2e}, selections differ in {} of {} rows",
                c.out_err, c.lse_err, c.differing.0, c.differing.1
            )?;
        }
    }
    if !check_ok {
        bail!(
            "{}: --check failed: decode differs from forward beyond the tolerance {tol}{}",
            l.source,
            if a.output.is_some() {
                " (nothing written)"
            } else {
                ""
            }
        );
    }
    super::forward::commit(staged)
}

/// The decode part of `pisa demo`: the last `steps` tokens decoded after a prefill of the rest,
/// checked against the forward pass.
pub fn demo(ctx: &Context, l: &Loaded, cfg: &SelectionConfig, steps: usize) -> Result<()> {
    let n = l.shape.q_len;
    check_prefill(n.saturating_sub(1), n)?;
    let steps = steps.clamp(1, n - 1);
    let p = n - steps;
    let r = run_decode(ctx, l, cfg, Storage::F32, p)?;
    let c = check(ctx, l, cfg, Storage::F32, p, &r)?;
    let skip = usize::from(r.step_ms.len() > 1);
    let (med, p99) = percentiles(&r.step_ms[skip..]);
    crate::args::outln!(
        "decode: prefill {}, then {} through the KV cache: {} per step median {med:.3} ms, p99 {p99:.3} ms",
        plural(p, "token"),
        plural(steps, "step"),
        if r.gpu { "GPU" } else { "wall-clock" }
    )?;
    crate::args::outln!(
        "  equal to forward: O rel. error {:.2e}, LSE rel. error {:.2e}, selection differs in {} of {} (query, KV head) rows",
        c.out_err, c.lse_err, c.differing.0, c.differing.1
    )?;
    Ok(())
}
