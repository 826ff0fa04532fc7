//! `pisa decode`: prefill the first P tokens of the given K/V into the GPU KV cache, then decode
//! the remaining tokens one at a time as an inference loop would (append the token's key and
//! value, then one fused selection + attention step), write the outputs, and report per-step
//! latency. `--check` compares every decoded row with `forward` on the same input.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::ops::prefill::{prefill_host, PrefillOptions};
use pisa_wgpu::{Context, Profiler, Storage};

use crate::args::{progress, DeviceArgs, SelectArgs};
use crate::input::{InputArgs, Loaded};
use crate::io::{self, DType, Outputs};

/// Arguments of `pisa decode`.
#[derive(Args, Debug)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub select: SelectArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Tokens prefilled before decoding starts (default: half the input).
    #[arg(long)]
    pub prefill: Option<usize>,
    /// Output file for O, LSE (and the selection): rows of the prefill part come from the
    /// prefill, the rest from the decode steps.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Element type of O in the output file.
    #[arg(long, value_enum, default_value_t = DType::F32)]
    pub out_dtype: DType,
    /// Also write the selected leaf blocks.
    #[arg(long)]
    pub save_selection: bool,
    /// Compare every decoded row with `forward` (prefill) on the same input; fails past the
    /// tolerance (1e-4 relative for f32 storage, 5e-3 for f16).
    #[arg(long)]
    pub check: bool,
}

/// Per-token rows of a `[B, H, N, D]` tensor in `layout`: `out[b][h][..D]` of token `t`.
fn token_rows(
    x: &[f32],
    layout: TensorLayout,
    b_count: usize,
    heads: usize,
    n: usize,
    d: usize,
    t: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(b_count * heads * d);
    for b in 0..b_count {
        for h in 0..heads {
            let i = layout.index(heads, n, d, b, h, t, 0);
            out.extend_from_slice(&x[i..i + d]);
        }
    }
    out
}

/// The first `p` tokens of sequence `b` as `[1, H, p, D]` in `layout`.
fn prefix(
    x: &[f32],
    layout: TensorLayout,
    heads: usize,
    n: usize,
    d: usize,
    b: usize,
    p: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; heads * p * d];
    for h in 0..heads {
        for t in 0..p {
            let i = layout.index(heads, n, d, b, h, t, 0);
            let o = layout.index(heads, p, d, 0, h, t, 0);
            out[o..o + d].copy_from_slice(&x[i..i + d]);
        }
    }
    out
}

/// Decoded rows and timings.
pub struct DecodeRun {
    /// O `[B, Hq, N, D]` in the input layout: prefill rows then decoded rows.
    pub out: Vec<f32>,
    /// LSE `[B, Hq, N]`.
    pub lse: Vec<f32>,
    /// Selection `[B, Hkv, N, K]`.
    pub selection: Vec<i32>,
    /// GPU ms of each step (append + fused step), or wall-clock where timestamps are missing.
    pub step_ms: Vec<f64>,
    /// Wall-clock ms of each step, uploads and readback included.
    pub wall_ms: Vec<f64>,
    /// Whether `step_ms` comes from GPU timestamps.
    pub gpu: bool,
}

/// Errors unless `1 <= p < n`: at least one token prefilled and one decoded.
pub fn check_prefill(p: usize, n: usize) -> Result<()> {
    if n < 2 {
        bail!("decode needs at least 2 tokens (one prefilled, one decoded); the input has {n}");
    }
    if p == 0 || p >= n {
        bail!("--prefill {p} must be in 1..{n} (the input has {n} tokens; the rest are decoded)");
    }
    Ok(())
}

/// Prefill `p` tokens into a KV cache, then decode the rest token by token.
pub fn run_decode(
    ctx: &Context,
    l: &Loaded,
    cfg: &SelectionConfig,
    storage: Storage,
    p: usize,
) -> Result<DecodeRun> {
    let s = l.shape;
    let (b_count, hq, hkv, n, d, k) = (
        s.batch, s.q_heads, s.kv_heads, s.q_len, s.head_dim, cfg.top_k,
    );
    check_prefill(p, n)?;
    // Rows before P: a prefill of the first P tokens (what an inference server does first).
    let pre_shape = AttentionShape::new(b_count, hq, hkv, p, p, d)?;
    let (mut q_pre, mut k_pre, mut v_pre) = (Vec::new(), Vec::new(), Vec::new());
    for b in 0..b_count {
        q_pre.extend(prefix(&l.q, l.layout, hq, n, d, b, p));
        k_pre.extend(prefix(&l.k, l.layout, hkv, n, d, b, p));
        v_pre.extend(prefix(&l.v, l.layout, hkv, n, d, b, p));
    }
    let opts = PrefillOptions {
        cfg: *cfg,
        layout: l.layout,
        storage,
        q_tile: 4,
        return_selection: true,
    };
    let pre = prefill_host(ctx, &q_pre, &k_pre, &v_pre, &pre_shape, &opts)
        .context("prefill of the first tokens")?;
    let mut out = vec![0f32; s.q_elems()];
    let mut lse = vec![0f32; s.lse_elems()];
    let mut selection = vec![-1i32; b_count * hkv * n * k];
    for b in 0..b_count {
        for h in 0..hq {
            for t in 0..p {
                let i = l.layout.index(hq, n, d, b, h, t, 0);
                let o = l.layout.index(hq, p, d, b, h, t, 0);
                out[i..i + d].copy_from_slice(&pre.out[o..o + d]);
                lse[(b * hq + h) * n + t] = pre.lse[(b * hq + h) * p + t];
            }
        }
        for h in 0..hkv {
            for t in 0..p {
                let src = ((b * hkv + h) * p + t) * k;
                let dst = ((b * hkv + h) * n + t) * k;
                selection[dst..dst + k]
                    .copy_from_slice(&pre.selection.as_ref().expect("requested")[src..src + k]);
            }
        }
    }
    // The cache: the same P tokens, then one token per step.
    let mut cache = KvCache::new(ctx, b_count, n, hq, hkv, d, *cfg, storage)?;
    for b in 0..b_count {
        cache.prefill(
            b,
            &prefix(&l.k, l.layout, hkv, n, d, b, p),
            &prefix(&l.v, l.layout, hkv, n, d, b, p),
            l.layout,
        )?;
    }
    let active = vec![true; b_count];
    let (mut step_ms, mut wall_ms, mut gpu) = (Vec::new(), Vec::new(), true);
    let pb = progress((n - p) as u64, "decode");
    for t in p..n {
        let started = std::time::Instant::now();
        let kr = ctx.upload(
            "k row",
            &token_rows(&l.k, l.layout, b_count, hkv, n, d, t),
            storage,
        )?;
        let vr = ctx.upload(
            "v row",
            &token_rows(&l.v, l.layout, b_count, hkv, n, d, t),
            storage,
        )?;
        let qt = ctx.upload(
            "q row",
            &token_rows(&l.q, l.layout, b_count, hq, n, d, t),
            storage,
        )?;
        let mut prof = Profiler::new(ctx, 4);
        ctx.scoped("decode step", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            cache.record_append(&mut enc, &kr, &vr, &active, Some(&mut prof))?;
            cache.record_step(&mut enc, &qt, Some(&mut prof))?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let (o_t, lse_t, sel_t) = cache.outputs();
        let (o_t, lse_t, sel_t) = (
            ctx.read_f32(o_t)?,
            ctx.read_f32(lse_t)?,
            ctx.read_i32(sel_t)?,
        );
        wall_ms.push(started.elapsed().as_secs_f64() * 1e3);
        let times = prof.finish(ctx)?;
        gpu &= times.gpu;
        step_ms.push(if times.gpu {
            times.total()
        } else {
            *wall_ms.last().unwrap_or(&0.0)
        });
        for b in 0..b_count {
            for h in 0..hq {
                let i = l.layout.index(hq, n, d, b, h, t, 0);
                out[i..i + d].copy_from_slice(&o_t[(b * hq + h) * d..(b * hq + h + 1) * d]);
                lse[(b * hq + h) * n + t] = lse_t[b * hq + h];
            }
            for h in 0..hkv {
                let dst = ((b * hkv + h) * n + t) * k;
                selection[dst..dst + k]
                    .copy_from_slice(&sel_t[(b * hkv + h) * k..(b * hkv + h + 1) * k]);
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(DecodeRun {
        out,
        lse,
        selection,
        step_ms,
        wall_ms,
        gpu,
    })
}

/// Median and 99th percentile.
pub fn percentiles(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    (
        s[s.len() / 2],
        s[((s.len() as f64 * 0.99).ceil() as usize)
            .saturating_sub(1)
            .min(s.len() - 1)],
    )
}

/// What `--check` found: relative errors of the decoded rows against `forward`, and rows whose
/// selection differs.
pub struct CheckResult {
    /// Relative L2 error of O over the decoded rows.
    pub out_err: f64,
    /// Relative L2 error of LSE over the decoded rows.
    pub lse_err: f64,
    /// (query, KV head) rows whose selections differ / rows compared.
    pub differing: (usize, usize),
}

/// Compares the decoded rows (positions `p..N`) with a full prefill of the same input.
pub fn check(
    ctx: &Context,
    l: &Loaded,
    cfg: &SelectionConfig,
    storage: Storage,
    p: usize,
    r: &DecodeRun,
) -> Result<CheckResult> {
    let s = l.shape;
    let opts = PrefillOptions {
        cfg: *cfg,
        layout: l.layout,
        storage,
        q_tile: 4,
        return_selection: true,
    };
    let f = prefill_host(ctx, &l.q, &l.k, &l.v, &s, &opts)?;
    let (mut num, mut den, mut ln, mut ld) = (0f64, 0f64, 0f64, 0f64);
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            for t in p..s.q_len {
                let i = l.layout.index(s.q_heads, s.q_len, s.head_dim, b, h, t, 0);
                for x in 0..s.head_dim {
                    num += ((r.out[i + x] - f.out[i + x]) as f64).powi(2);
                    den += (f.out[i + x] as f64).powi(2);
                }
                let j = (b * s.q_heads + h) * s.q_len + t;
                ln += ((r.lse[j] - f.lse[j]) as f64).powi(2);
                ld += (f.lse[j] as f64).powi(2);
            }
        }
    }
    let fsel = f.selection.as_ref().expect("requested");
    let k = cfg.top_k;
    let (mut diff, mut total) = (0, 0);
    for row in 0..s.batch * s.kv_heads {
        for t in p..s.q_len {
            let o = (row * s.q_len + t) * k;
            total += 1;
            diff += usize::from(r.selection[o..o + k] != fsel[o..o + k]);
        }
    }
    Ok(CheckResult {
        out_err: (num / den.max(1e-300)).sqrt(),
        lse_err: (ln / ld.max(1e-300)).sqrt(),
        differing: (diff, total),
    })
}

/// Runs `pisa decode`.
pub fn run(a: DecodeArgs) -> Result<()> {
    if let Some(path) = &a.output {
        super::forward::check_output(path, a.out_dtype, a.save_selection, &a.input)?;
    }
    let l = a.input.load_for(a.device.storage, true)?;
    let cfg = a.select.config(l.file_scale)?;
    let p = a.prefill.unwrap_or(l.shape.q_len / 2);
    check_prefill(p, l.shape.q_len).with_context(|| l.source.clone())?;
    let ctx = a.device.context()?;
    let storage: Storage = a.device.storage.into();
    let r = run_decode(&ctx, &l, &cfg, storage, p)
        .with_context(|| format!("{}: decode failed", l.source))?;
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
    let mut written = Vec::new();
    if let (Some(path), true) = (&a.output, check_ok) {
        let sel = a.save_selection.then_some(&r.selection[..]);
        let (o, lse, idx) = super::forward::output_tensors_of(&l, &r.out, &r.lse, sel, cfg.top_k)?;
        let mut meta = BTreeMap::new();
        meta.insert("prefill_tokens".to_string(), p.to_string());
        meta.insert("config".to_string(), format!("{cfg:?}"));
        written = io::write_outputs(
            path,
            &Outputs {
                o: &o,
                lse: Some(&lse),
                indices: idx.as_ref(),
            },
            a.out_dtype,
            &meta,
        )?;
    }
    let clock = if r.gpu { "GPU" } else { "wall-clock" };
    if a.device.json {
        let mut j = serde_json::json!({
            "adapter": ctx.report().name, "source": l.source, "prefill": p, "steps": r.step_ms.len(),
            "step_ms_median": med, "step_ms_p99": p99, "gpu_timed": r.gpu,
            "wall_ms_median": wmed, "wall_ms_p99": wp99, "written": written,
        });
        if let Some(c) = &checked {
            j["check"] = serde_json::json!({"out_rel_err": c.out_err, "lse_rel_err": c.lse_err, "selection_rows_differing": c.differing.0, "rows": c.differing.1});
        }
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "decode: prefill {p} tokens, {} steps on {}: {clock} per step median {med:.3} ms, p99 {p99:.3} ms (wall-clock with transfers: median {wmed:.3} ms, p99 {wp99:.3} ms; first step excluded){}",
            r.step_ms.len(),
            ctx.report().name,
            if written.is_empty() { String::new() } else { format!("; wrote {}", written.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")) }
        );
        if let Some(c) = &checked {
            println!(
                "check vs forward: O rel. error {:.2e}, LSE rel. error {:.2e}, selections differ in {} of {} rows",
                c.out_err, c.lse_err, c.differing.0, c.differing.1
            );
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
    Ok(())
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
    println!(
        "decode: prefill {p} tokens, then {steps} steps through the KV cache: {} per step median {med:.3} ms, p99 {p99:.3} ms",
        if r.gpu { "GPU" } else { "wall-clock" }
    );
    println!(
        "  equal to forward: O rel. error {:.2e}, LSE rel. error {:.2e}, selection differs in {} of {} (query, KV head) rows",
        c.out_err, c.lse_err, c.differing.0, c.differing.1
    );
    Ok(())
}
