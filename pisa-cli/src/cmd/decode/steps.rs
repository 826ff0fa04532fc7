//! The decode loop of `pisa decode`: a prefill of the first P tokens, then the KV cache fed one
//! token per step ([`run_decode`]), with the per-token row copies it needs.

use anyhow::{bail, Context as _, Result};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::{KvCache, StepOutputs};
use pisa_wgpu::ops::prefill::PrefillOptions;
use pisa_wgpu::{Context, DType, Profiler, Storage, TensorView};

use crate::args::progress;
use crate::cmd::embed;
use crate::input::{token_range, Loaded};

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
    token_range(x, layout, [b_count, heads, n, d], (t, t + 1))
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
    let per = heads * n * d;
    token_range(&x[b * per..(b + 1) * per], layout, [1, heads, n, d], (0, p))
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
        bail!(
            "decode needs at least 2 tokens (one prefilled, one decoded); the run has {n} (the \
             input's, or --tokens)"
        );
    }
    if p == 0 || p >= n {
        bail!(
            "--prefill {p} must be in 1..={} (the run has {n} tokens, the input's or --tokens; at \
             least the last is decoded)",
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
    let pre = embed::prefill(ctx, &q_pre, &k_pre, &v_pre, &pre_shape, &opts, false)
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
    // The cache: the same P tokens, loaded from views of K and V in buffers of the CLI's.
    let mut cache = KvCache::new(ctx, b_count, n, hq, hkv, d, *cfg, storage)?;
    let dt = embed::dtype(storage);
    for b in 0..b_count {
        let seq = |x: &[f32], label| {
            let part = prefix(x, l.layout, hkv, n, d, b, p);
            let buf = embed::buffer(ctx, label, embed::words(part.len(), dt));
            ctx.queue()
                .write_buffer(&buf, 0, &embed::bytes_of(&part, storage));
            TensorView::contiguous(&buf, 0, dt, [1, hkv, p, d], l.layout)
        };
        cache.prefill_view(b, &seq(&l.k, "cli k prefix")?, &seq(&l.v, "cli v prefix")?)?;
    }
    // Per step: the token's K/V rows and query written into one input buffer, the step's O,
    // LSE and selection into one output buffer (each at an offset the device can bind),
    // copied into one mappable buffer in the step's own submission.
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    let slot = |bytes: u64| bytes.next_multiple_of(align.max(4));
    let (kv_n, q_n, sel_n) = (b_count * hkv * d, b_count * hq * d, b_count * hkv * k);
    let (kv_slot, q_bytes) = (slot(embed::words(kv_n, dt)), embed::words(q_n, dt));
    let input = embed::buffer(ctx, "cli decode rows", 2 * kv_slot + q_bytes);
    // The step writes O in the kernels' output type (f32 for bf16 storage).
    let odt = embed::dtype(storage.output());
    let o_bytes = embed::words(q_n, odt);
    let l_bytes = embed::words(b_count * hq, DType::F32);
    let s_bytes = embed::words(sel_n, DType::I32);
    let (o_at, l_at, s_at) = (0, slot(o_bytes), slot(o_bytes) + slot(l_bytes));
    let output = embed::buffer(ctx, "cli decode outputs", s_at + s_bytes);
    let read = embed::staging(ctx, o_bytes + l_bytes + s_bytes);
    let row = |at, heads, dtype| {
        TensorView::contiguous(
            &input,
            at,
            dtype,
            [b_count, heads, 1, d],
            TensorLayout::Bhnd,
        )
    };
    let (kv, vv, qv) = (
        row(0, hkv, dt)?,
        row(kv_slot, hkv, dt)?,
        row(2 * kv_slot, hq, dt)?,
    );
    let out_view =
        |at, dtype, shape| TensorView::contiguous(&output, at, dtype, shape, TensorLayout::Bhnd);
    let ov = out_view(o_at, odt, [b_count, hq, 1, d])?;
    let lv = out_view(l_at, DType::F32, [b_count, hq, 1, 1])?;
    let sv = out_view(s_at, DType::I32, [b_count, hkv, 1, k])?;
    let outs = StepOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&sv),
    };
    let active = vec![true; b_count];
    let (mut step_ms, mut wall_ms, mut gpu) = (Vec::new(), Vec::new(), true);
    let pb = progress((n - p) as u64, "decode");
    for t in p..n {
        let started = std::time::Instant::now();
        let rows = [
            (0, token_rows(&l.k, l.layout, b_count, hkv, n, d, t)),
            (kv_slot, token_rows(&l.v, l.layout, b_count, hkv, n, d, t)),
            (
                2 * kv_slot,
                token_rows(&l.q, l.layout, b_count, hq, n, d, t),
            ),
        ];
        for (at, x) in &rows {
            ctx.queue()
                .write_buffer(&input, *at, &embed::bytes_of(x, storage));
        }
        let mut prof = Profiler::new(ctx, 4);
        ctx.scoped("decode step", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            cache.record_append_view(&mut enc, &kv, &vv, &active, Some(&mut prof))?;
            cache.record_step_into(&mut enc, &qv, Some(&outs), Some(&mut prof))?;
            let parts = [
                (&output, o_at, o_bytes),
                (&output, l_at, l_bytes),
                (&output, s_at, s_bytes),
            ];
            embed::copy_out(&mut enc, &parts, &read);
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let got = embed::map_read(ctx, &read, o_bytes + l_bytes + s_bytes)?;
        let (o_t, rest) = got.split_at(o_bytes as usize);
        let (lse_t, sel_t) = rest.split_at(l_bytes as usize);
        let (o_t, lse_t, sel_t) = (
            embed::f32_of(o_t, storage.output(), q_n),
            embed::f32_of(lse_t, Storage::F32, b_count * hq),
            embed::i32_of(sel_t, sel_n),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode loop on the CLI's buffers (views, record_append_view + record_step_into) is
    /// bitwise the host conveniences' (prefill, append_and_step), in both layouts.
    #[test]
    fn decode_on_cli_buffers_equals_the_host_loop() {
        // A missing adapter fails the test (as the library's tests do), never skips it.
        let ctx = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance)
            .expect("a GPU adapter (install mesa-vulkan-drivers)");
        let (b_count, hq, hkv, n, d, p) = (2, 4, 2, 90, 16, 70);
        let cfg = SelectionConfig::new(16, 3).unwrap();
        let shape = AttentionShape::prefill(b_count, hq, hkv, n, d).unwrap();
        for layout in [TensorLayout::Bhnd, TensorLayout::Bnhd] {
            let l = crate::cmd::embed::tests::loaded(shape, layout, 1);
            let r = run_decode(&ctx, &l, &cfg, Storage::F32, p).unwrap();
            let mut cache = KvCache::new(&ctx, b_count, n, hq, hkv, d, cfg, Storage::F32).unwrap();
            for b in 0..b_count {
                let (k, v) = (
                    prefix(&l.k, layout, hkv, n, d, b, p),
                    prefix(&l.v, layout, hkv, n, d, b, p),
                );
                cache.prefill(b, &k, &v, layout).unwrap();
            }
            let k = cfg.top_k;
            for t in p..n {
                let rows = |x: &[f32], heads| token_rows(x, layout, b_count, heads, n, d, t);
                let (kr, vr, qr) = (rows(&l.k, hkv), rows(&l.v, hkv), rows(&l.q, hq));
                let want = cache
                    .append_and_step(&kr, &vr, &[true; 2], &qr, true)
                    .unwrap();
                let sel = want.selection.unwrap();
                for b in 0..b_count {
                    for h in 0..hq {
                        let i = layout.index(hq, n, d, b, h, t, 0);
                        let w = (b * hq + h) * d;
                        assert_eq!(r.out[i..i + d], want.out[w..w + d], "{layout:?} t {t}");
                        assert_eq!(r.lse[(b * hq + h) * n + t], want.lse[b * hq + h]);
                    }
                    for h in 0..hkv {
                        let dst = ((b * hkv + h) * n + t) * k;
                        let src = (b * hkv + h) * k;
                        assert_eq!(r.selection[dst..dst + k], sel[src..src + k]);
                    }
                }
            }
        }
    }
}
