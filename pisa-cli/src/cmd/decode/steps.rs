//! The decode loop of `pisa decode`: a prefill of the first P tokens, then the KV cache fed one
//! token per step ([`run_decode`]), with the per-token row copies it needs.

use anyhow::{bail, Context as _, Result};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::ops::prefill::{prefill_host, PrefillOptions};
use pisa_wgpu::{Context, Profiler, Storage};

use crate::args::progress;
use crate::input::Loaded;

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
        bail!(
            "--prefill {p} must be in 1..={} (the input has {n} tokens; at least the last is decoded)",
            n - 1
        );
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
