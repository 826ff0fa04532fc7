//! The decode measurement of `pisa bench`: PISA's decode step (one compute pass of three
//! dispatches, and the same dispatches timed apart) against dense attention of one query over
//! the whole cache, at one cache length, with the KV heads split over caches past one storage
//! binding.

use anyhow::Result;
use pisa_core::{AttentionShape, TensorLayout};
use pisa_wgpu::ops::attention::{record_dense_attention, QkvLayouts};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::{Context, Profiler};

use super::measure::Plan;

/// Decode step at a cache of `p.n` tokens (batch 1): PISA's step (one compute pass: route,
/// leaf, merge) against dense attention of one query over the whole cache. When K or V of all
/// KV heads exceed one storage binding (1M tokens x 8 heads x 128 x f16 is exactly 2 GiB), the
/// heads are split over several caches whose steps are recorded side by side in the same pass
/// ([`KvCache::record_steps`]), as a server would run them. With GPU timestamps, the same
/// step is also recorded as three timed passes ([`KvCache::record_steps_by_stage`]) to split
/// its time into `route`, `leaf` and `merge` (the sum exceeds the one-pass step by the pass
/// boundaries). Returns (PISA ms, dense ms, reps, GPU-timed);
/// medians over repetitions, the query rotated between two sets.
pub fn decode(ctx: &Context, p: &Plan) -> Result<DecodeTimes> {
    let (hq, hkv, d, n) = (p.hq, p.hkv, p.d, p.n);
    let g = hq / hkv;
    let per_head = (n * d) as u64 * p.storage.bytes();
    let hc = ((ctx.max_binding_bytes() / per_head.max(1)) as usize).clamp(1, hkv);
    let mut parts = Vec::new();
    for h0 in (0..hkv).step_by(hc) {
        let h = hc.min(hkv - h0);
        let mut cache = KvCache::new(ctx, 1, n, h * g, h, d, p.cfg, p.storage)?;
        let k = random_tensor(ctx, "k", h * n * d, p.storage, 11 + h0 as u32, 1.0)?;
        let v = random_tensor(ctx, "v", h * n * d, p.storage, 12 + h0 as u32, 1.0)?;
        cache.prefill_device(0, &k, &v, TensorLayout::Bhnd)?;
        let qs = [
            random_tensor(ctx, "q", h * g * d, p.storage, 13, 1.0)?,
            random_tensor(ctx, "q", h * g * d, p.storage, 14, 1.0)?,
        ];
        let shape = AttentionShape::new(1, h * g, h, 1, n, d)?;
        parts.push((cache, k, v, qs, shape));
    }
    let scale = p.cfg.softmax_scale(d);
    let mut pisa = Vec::new();
    let mut dense = Vec::new();
    let mut by_stage: [Vec<f64>; 3] = Default::default();
    let mut gpu = true;
    let reps = p.reps.max(5);
    for r in 0..reps + 2 {
        let mut prof = Profiler::new(ctx, 32);
        let started = std::time::Instant::now();
        ctx.scoped("bench decode", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let steps: Vec<_> = parts
                .iter()
                .map(|(c, _, _, qs, _)| (c, &qs[r % 2]))
                .collect();
            KvCache::record_steps(&mut enc, &steps, Some(&mut prof))?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let wall_pisa = started.elapsed().as_secs_f64() * 1e3;
        let started = std::time::Instant::now();
        ctx.scoped("bench dense decode", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            for (_, k, v, qs, shape) in &parts {
                record_dense_attention(
                    ctx,
                    &mut enc,
                    &qs[r % 2],
                    k,
                    v,
                    shape,
                    QkvLayouts::from(TensorLayout::Bhnd),
                    true,
                    scale,
                    Some(&mut prof),
                )?;
            }
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let wall_dense = started.elapsed().as_secs_f64() * 1e3;
        ctx.scoped("bench decode by stage", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let steps: Vec<_> = parts
                .iter()
                .map(|(c, _, _, qs, _)| (c, &qs[r % 2]))
                .collect();
            KvCache::record_steps_by_stage(&mut enc, &steps, Some(&mut prof))?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let t = prof.finish(ctx)?;
        gpu &= t.gpu;
        if r >= 2 {
            pisa.push(if t.gpu { t.get("decode") } else { wall_pisa });
            dense.push(if t.gpu { t.get("dense") } else { wall_dense });
            for (v, stage) in
                by_stage
                    .iter_mut()
                    .zip(["decode_route", "decode_leaf", "decode_merge"])
            {
                v.push(t.get(stage));
            }
        }
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [a, b, c] = by_stage;
    Ok(DecodeTimes {
        pisa: med(pisa),
        dense: med(dense),
        stages: gpu.then(|| [med(a), med(b), med(c)]),
        reps,
        gpu,
    })
}

/// Medians of [`decode`], ms.
pub struct DecodeTimes {
    /// The PISA step (one compute pass).
    pub pisa: f64,
    /// Dense attention of one query over the whole cache.
    pub dense: f64,
    /// The step's `route`, `leaf` and `merge` passes timed apart (GPU timestamps only).
    pub stages: Option<[f64; 3]>,
    /// Repetitions.
    pub reps: usize,
    /// True when timed by GPU timestamps (else wall clock).
    pub gpu: bool,
}
