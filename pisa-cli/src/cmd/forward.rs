//! `pisa forward`: prefill (PISA selection + block-sparse attention) of Q, K, V from files;
//! writes O, LSE and optionally the selected leaves, and prints a one-line summary with the GPU
//! time per stage.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use clap::Args;
use pisa_wgpu::ops::prefill::{PrefillOptions, PrefillOutput};
use pisa_wgpu::Storage;

use crate::args::{CausalArgs, DeviceArgs, ScoringArgs, SelectArgs};
use crate::input::{InputArgs, Loaded};
use crate::io::{self, DType, HostTensor, IndexTensor, Outputs};

/// Arguments of `pisa forward`.
#[derive(Args, Debug)]
pub struct ForwardArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub select: SelectArgs,
    #[command(flatten)]
    pub scoring: ScoringArgs,
    #[command(flatten)]
    pub causal: CausalArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Output file (`.safetensors`: tensors o, lse, indices; `.npy`: OUT.o.npy, OUT.lse.npy, ...).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Element type of O in the output file (LSE is always f32, indices i32) [default: f32].
    #[arg(long, value_enum)]
    pub out_dtype: Option<DType>,
    /// Also write the selected leaf blocks ([B,] Hkv, N, K; ascending, -1 padded).
    #[arg(long)]
    pub save_selection: bool,
    /// Skip the untimed warm-up prefill: the timed prefill then includes the shader compilation
    /// and pipeline creation that drivers do at a pipeline's first dispatch (a cold start).
    #[arg(long)]
    pub no_warmup: bool,
}

/// Output tensor shapes that mirror the input's rank.
pub fn output_tensors(
    l: &Loaded,
    r: &PrefillOutput,
    top_k: usize,
) -> Result<(HostTensor, HostTensor, Option<IndexTensor>)> {
    output_tensors_of(l, &r.out, &r.lse, r.selection.as_deref(), top_k)
}

/// O, LSE and (when given) the selection as output tensors whose ranks mirror the input's:
/// O like Q, LSE `[B,] Hq, N`, indices `[B,] Hkv, N, K`. Shared with `pisa decode`.
pub fn output_tensors_of(
    l: &Loaded,
    out: &[f32],
    lse: &[f32],
    selection: Option<&[i32]>,
    top_k: usize,
) -> Result<(HostTensor, HostTensor, Option<IndexTensor>)> {
    let s = &l.shape;
    let lead: Vec<usize> = if l.batched() { vec![s.batch] } else { vec![] };
    let o = HostTensor::new("o", l.q_dims.clone(), out.to_vec())?;
    let lse = HostTensor::new(
        "lse",
        [lead.clone(), vec![s.q_heads, s.q_len]].concat(),
        lse.to_vec(),
    )?;
    let idx = match selection {
        Some(sel) => Some(IndexTensor::new(
            "indices",
            [lead, vec![s.kv_heads, s.q_len, top_k]].concat(),
            sel.to_vec(),
        )?),
        None => None,
    };
    Ok((o, lse, idx))
}

/// Checks an output path before any work: a known extension, bf16 only in `.safetensors`, an
/// existing directory, and no output file that is one of the input files.
pub fn check_output(
    path: &Path,
    out_dtype: DType,
    save_selection: bool,
    input: &InputArgs,
) -> Result<()> {
    let names: &[&str] = if save_selection {
        &["o", "lse", "indices"]
    } else {
        &["o", "lse"]
    };
    // (a usage error, exit 2, as a --json or --plot name of the wrong kind)
    let format = match io::Format::from_path(path) {
        Ok(f) => f,
        Err(e) => crate::args::usage_bail!("-o/--output {e}"),
    };
    let outs = io::output_paths(path, names)?;
    if out_dtype == DType::BF16 && format == io::Format::Npy {
        crate::args::usage_bail!(
            "{}: bf16 cannot be stored in npy (no standard descr); use --out-dtype f16 or f32, or a .safetensors output",
            path.display()
        );
    }
    io::check_output_paths(&outs, &input.files())?;
    // An .npy set written without --save-selection leaves an earlier run's selection beside
    // it: say so (once the output is known to be usable), since it no longer belongs to these
    // outputs.
    if format == io::Format::Npy && !save_selection {
        let stale = io::output_paths(path, &["indices"])?.remove(0);
        if stale.exists() {
            eprintln!(
                "warning: {} is left from an earlier run (this one writes no selection: --save-selection): it does not belong to the new outputs",
                stale.display()
            );
        }
    }
    Ok(())
}

/// The element type of O (`--out-dtype`, default f32); refuses `--out-dtype` and
/// `--save-selection` without an output file, which they would silently do nothing without.
pub fn out_dtype_of(
    output: Option<&Path>,
    out_dtype: Option<DType>,
    save_selection: bool,
) -> Result<DType> {
    if output.is_none() {
        if save_selection {
            crate::args::usage_bail!(
                "--save-selection requires -o/--output (the selection is written there)"
            );
        }
        if out_dtype.is_some() {
            crate::args::usage_bail!(
                "--out-dtype requires -o/--output (it is the element type of O in that file)"
            );
        }
    }
    Ok(out_dtype.unwrap_or(DType::F32))
}

/// Runs `pisa forward`.
pub fn run(a: ForwardArgs) -> Result<()> {
    let out_dtype = out_dtype_of(a.output.as_deref(), a.out_dtype, a.save_selection)?;
    if let Some(path) = &a.output {
        check_output(path, out_dtype, a.save_selection, &a.input)?;
    }
    let l = a.input.load_for(a.device.storage, true)?;
    let cfg = a.select.config(
        a.scoring.scoring.into(),
        !a.causal.non_causal,
        &l.file_scale,
    )?;
    l.check_score_bound(cfg.softmax_scale(l.shape.head_dim))?;
    l.check_value_bound()?;
    if let Some(w) = crate::args::top_k_warning(&cfg, l.shape.k_len, a.save_selection) {
        eprintln!("warning: {w}");
    }
    let ctx = a.device.context()?;
    crate::limits::warn_llvmpipe(&ctx, l.shape.k_len);
    let opts = PrefillOptions {
        cfg,
        layout: l.layout,
        storage: a.device.storage.into(),
        q_tile: a.select.q_tile,
        return_selection: a.save_selection,
    };
    // Warmed up unless --no-warmup: the reported stage times are then the kernels', without
    // first-dispatch compiles.
    let r = super::embed::prefill(&ctx, &l.q, &l.k, &l.v, &l.shape, &opts, !a.no_warmup)
        .map_err(|e| crate::args::top_k_note(e.into(), &cfg, l.shape.k_len))
        .with_context(|| format!("{}: prefill failed", l.source))?;
    l.check_out_finite(&r.out, &r.lse, opts.storage == Storage::F16)?;
    // The outputs are staged, reported, then renamed into place: a report that cannot be
    // written (stdout on a full disk, a closed pipe) leaves no output file written or changed.
    let mut staged = None;
    if let Some(path) = &a.output {
        l.check_out_range(&r.out, out_dtype)?;
        let (o, lse, idx) = output_tensors(&l, &r, cfg.top_k)?;
        let meta = l.output_metadata(&cfg);
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
    let s = &l.shape;
    let clock = if r.times.gpu { "GPU" } else { "wall-clock" };
    // (passes past the profiler's capacity went untimed: the total leaves them out)
    let partial = match r.times.untimed {
        0 => String::new(),
        n => format!(" partial: {n} passes untimed,"),
    };
    if a.device.json {
        let j = l.run_json(
            &ctx.report().name,
            &cfg,
            opts.storage,
            serde_json::json!({
                "gpu_timed": r.times.gpu, "stages_ms": r.times.stages,
                "total_ms": r.times.total(), "untimed_passes": r.times.untimed,
                "chunks": r.chunks, "written": crate::io::paths_text(written),
            }),
        );
        crate::args::outln!("{}", serde_json::to_string_pretty(&j)?)?;
    } else {
        let stages: Vec<String> = r
            .times
            .stages
            .iter()
            .map(|(n, ms)| format!("{n} {ms:.3}"))
            .collect();
        crate::args::outln!(
            "forward: B={} Hq={} Hkv={} N={} D={} C={} K={} {} on {}: {clock}{partial} {:.3} ms ({}){}",
            s.batch,
            s.q_heads,
            s.kv_heads,
            s.q_len,
            s.head_dim,
            cfg.block_size,
            cfg.top_k,
            crate::text::scoring(cfg.scoring),
            ctx.report().name,
            r.times.total(),
            stages.join(", "),
            if written.is_empty() {
                String::new()
            } else {
                format!(
                    "; wrote {}",
                    written
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        )?;
    }
    commit(staged)
}

/// Renames staged outputs into place once the report is out ([`io::Staged`]): stdout flushed
/// first, so that a report that could not be written leaves no output file.
pub fn commit(staged: Option<io::Staged>) -> Result<()> {
    use std::io::Write as _;
    std::io::stdout()
        .flush()
        .map_err(|e| anyhow::anyhow!("cannot write to stdout: {e}"))?;
    staged.map_or(Ok(()), |s| s.commit().map(drop))
}
