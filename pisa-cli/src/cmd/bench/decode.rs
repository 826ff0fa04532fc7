//! The decode measurement of `pisa bench`: PISA's decode step (one compute pass of three
//! dispatches, and the same dispatches timed apart) against dense attention of one query over
//! the whole cache, at one cache length, with the KV heads split over caches past one storage
//! binding; each both as one isolated step per submission and as a burst of `--decode-burst`
//! steps back to back in one submission (how the PyTorch peer times SDPA decode). The records
//! `pisa bench` writes for them are made by [`super::report::decode_records`].

use anyhow::Result;
use pisa_core::{AttentionShape, TensorLayout};
use pisa_wgpu::ops::attention::{
    attention_kernel, record_dense_attention, AttentionKind, QkvLayouts,
};
use pisa_wgpu::ops::decode::{KvCache, StepOutputs};
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::{wgpu, Context, DType, GpuTensor, Profiler, TensorView};

use super::burst::{burst, check_burst};
use super::measure::Plan;
use crate::cmd::embed;

/// Default steps per burst (`--decode-burst`): as `benches/peers/torch_peers.py` (`timeit`,
/// `inner=10`) times decode.
pub const BURST: usize = 10;

/// Dense attention's unit: the KV heads of one K/V tensor (all of them unless they exceed one
/// storage binding), with its own queries.
struct Part {
    k: GpuTensor,
    v: GpuTensor,
    /// The two queries of the isolated steps, used in rotation.
    qs: [GpuTensor; 2],
    /// [`BURST`] distinct queries, used in rotation by the steps of a burst.
    burst_qs: Vec<GpuTensor>,
    shape: AttentionShape,
}

/// PISA's unit: one cache of the KV heads of up to two [`Part`]s (its K/V split over two
/// storage bindings when they exceed one), prefilled from their K/V tensors, with queries of
/// all its heads.
struct Cache {
    cache: KvCache,
    /// The two queries of the isolated steps and the [`BURST`] of the bursts, as views
    /// `[1, Hq, 1, D]` (each holds its buffer).
    q_views: [TensorView; 2],
    burst_q_views: Vec<TensorView>,
    /// O and LSE of the steps, in a buffer of the bench's own.
    out: TensorView,
    lse: TensorView,
}

impl Cache {
    /// `qs` as views `[1, heads, 1, D]` of the storage dtype, and O / LSE views of one output
    /// buffer (each at an offset the device can bind).
    fn new(
        ctx: &Context,
        p: &Plan,
        cache: KvCache,
        heads: usize,
        qs: [GpuTensor; 2],
        burst_qs: Vec<GpuTensor>,
    ) -> Result<Self> {
        let dt = embed::dtype(p.storage);
        let view = |t: &GpuTensor| {
            TensorView::contiguous(&t.buffer, 0, dt, [1, heads, 1, p.d], TensorLayout::Bhnd)
        };
        let q_views = [view(&qs[0])?, view(&qs[1])?];
        let burst_q_views = burst_qs
            .iter()
            .map(view)
            .collect::<pisa_wgpu::Result<_>>()?;
        let align = (ctx.limits().min_storage_buffer_offset_alignment as u64).max(4);
        // O in the kernels' output type (f32 for bf16).
        let odt = embed::dtype(p.storage.output());
        let o_bytes = embed::words(heads * p.d, odt).next_multiple_of(align);
        let outs = embed::buffer(ctx, "bench decode outputs", o_bytes + heads as u64 * 4);
        let out_view =
            |at, dtype, shape| TensorView::contiguous(&outs, at, dtype, shape, TensorLayout::Bhnd);
        Ok(Cache {
            out: out_view(0, odt, [1, heads, 1, p.d])?,
            lse: out_view(o_bytes, DType::F32, [1, heads, 1, 1])?,
            cache,
            q_views,
            burst_q_views,
        })
    }
}

/// Records one PISA step of every cache in ONE compute pass labelled "decode", the query of
/// each cache picked by `q` (an index into its queries: `Some(i)` burst query `i`, `None`
/// isolated query `r`): one cache (the usual case) through [`KvCache::record_step_into`] on
/// views of the bench's buffers, as an application records it; several (K/V past two
/// bindings) through [`KvCache::record_steps_into`], which steps several caches in one pass
/// (writing the caches' own outputs).
fn record_pisa(
    enc: &mut wgpu::CommandEncoder,
    caches: &[Cache],
    r: usize,
    burst_q: Option<usize>,
    prof: Option<&mut Profiler>,
) -> pisa_wgpu::Result<()> {
    if let [x] = caches {
        let q = match burst_q {
            Some(i) => &x.burst_q_views[i],
            None => &x.q_views[r % 2],
        };
        let outs = StepOutputs {
            out: &x.out,
            lse: &x.lse,
            selection: None,
        };
        return x.cache.record_step_into(enc, q, Some(&outs), prof);
    }
    let steps: Vec<_> = caches
        .iter()
        .map(|x| {
            let q = match burst_q {
                Some(i) => &x.burst_q_views[i],
                None => &x.q_views[r % 2],
            };
            (&x.cache, q)
        })
        .collect();
    KvCache::record_steps_into(enc, &steps, prof)
}

/// Queries of `heads` query heads: two for the isolated steps, [`BURST`] for the bursts.
fn queries(
    ctx: &Context,
    p: &Plan,
    heads: usize,
    seed: u32,
) -> Result<([GpuTensor; 2], Vec<GpuTensor>)> {
    let n = heads * p.d;
    let qs = [
        random_tensor(ctx, "q", n, p.storage, seed, 1.0)?,
        random_tensor(ctx, "q", n, p.storage, seed + 1, 1.0)?,
    ];
    let burst_qs = (0..BURST as u32)
        .map(|s| random_tensor(ctx, "burst q", n, p.storage, 10_000 + 16 * seed + s, 1.0))
        .collect::<pisa_wgpu::Result<_>>()?;
    Ok((qs, burst_qs))
}

/// Decode step at a cache of `p.n` tokens (batch 1): PISA's step (one compute pass: route,
/// leaf, merge) against dense attention of one query over the whole cache, on the same keys
/// and values (the queries are drawn alike but apart: dense takes one K/V tensor per call).
/// K/V of all KV heads past one storage binding (1M tokens x 8 heads x 128 x f16 is 2 GiB, one
/// MiB over the H200's 2047 MiB) are made a few heads at a time: dense attention runs once per
/// such tensor, side by side in one pass, while ONE PISA cache holds up to two of them (its
/// K/V split over two bindings: [`KvCache::kv_shards`]), as a server would hold them. Past two
/// bindings (f32 at 1M) there are several caches, stepped side by side in the same pass
/// ([`KvCache::record_steps_into`]). With GPU timestamps, the same step is also recorded as
/// three timed passes ([`KvCache::record_steps_by_stage_into`]) to split its time into `route`, `leaf` and
/// `merge` (the sum exceeds the one-pass step by the pass boundaries). Each repetition also
/// times a burst of `p.burst` steps (see [`super::burst::burst`]). Medians over repetitions, the isolated
/// step's query rotated between two sets.
pub fn decode(ctx: &Context, p: &Plan) -> Result<DecodeTimes> {
    let (hq, hkv, d, n) = (p.hq, p.hkv, p.d, p.n);
    let g = hq / hkv;
    let dt = embed::dtype(p.storage);
    let per_head = (n * d) as u64 * p.storage.bytes();
    let hc = ((ctx.max_binding_bytes() / per_head.max(1)) as usize).clamp(1, hkv);
    let per_cache = (2 * hc).min(hkv);
    // K/V parts (one per dense call): checked before anything is allocated.
    let n_parts: usize = (0..hkv)
        .step_by(per_cache)
        .map(|c0| per_cache.min(hkv - c0).div_ceil(hc))
        .sum();
    check_burst(p.burst, n_parts)?;
    let mut parts = Vec::new();
    let mut caches = Vec::new();
    for c0 in (0..hkv).step_by(per_cache) {
        let ch = per_cache.min(hkv - c0);
        let mut cache = KvCache::new(ctx, 1, n, ch * g, ch, d, p.cfg, p.storage)?;
        for h0 in (c0..c0 + ch).step_by(hc) {
            let h = hc.min(c0 + ch - h0);
            let k = random_tensor(ctx, "k", h * n * d, p.storage, 11 + 2 * h0 as u32, 1.0)?;
            let v = random_tensor(ctx, "v", h * n * d, p.storage, 12 + 2 * h0 as u32, 1.0)?;
            let kv_view = |t: &GpuTensor| {
                TensorView::contiguous(&t.buffer, 0, dt, [1, h, n, d], TensorLayout::Bhnd)
            };
            cache.prefill_view_heads(0, h0 - c0, &kv_view(&k)?, &kv_view(&v)?)?;
            let (qs, burst_qs) = queries(ctx, p, h * g, 500 + 2 * h0 as u32)?;
            let shape = AttentionShape::new(1, h * g, h, 1, n, d)?;
            parts.push(Part {
                k,
                v,
                qs,
                burst_qs,
                shape,
            });
        }
        let (qs, burst_qs) = queries(ctx, p, ch * g, 300 + 2 * c0 as u32)?;
        caches.push(Cache::new(ctx, p, cache, ch * g, qs, burst_qs)?);
    }
    debug_assert_eq!(parts.len(), n_parts);
    let scale = p.cfg.softmax_scale(d);
    let dense_layouts = QkvLayouts::from(TensorLayout::Bhnd);
    // The kernel of the dense calls below (record_dense_attention: causal, `scale`, no tiling).
    let kind = AttentionKind::Dense {
        causal: true,
        scale,
    };
    let kernels = parts
        .iter()
        .map(|x| attention_kernel(ctx, &x.shape, p.storage, dense_layouts, &kind, None));
    let dense_kernel = super::kernels::names(kernels);
    let mut pisa_step: Vec<&str> = Vec::new();
    for c in &caches {
        let name = c.cache.decode_step().name();
        if !pisa_step.contains(&name) {
            pisa_step.push(name);
        }
    }
    let mut pisa = Vec::new();
    let mut dense = Vec::new();
    let mut bursts: [Vec<f64>; 2] = Default::default();
    let mut by_stage: [Vec<f64>; 3] = Default::default();
    let mut gpu = true;
    // Two warm-up repetitions, then as many as --reps and --budget-s allow (as the prefill).
    let mut reps = p.reps.max(1);
    let mut r = 0;
    while r < reps + 2 {
        let rep_started = std::time::Instant::now();
        let mut prof = Profiler::new(ctx, 32);
        let started = std::time::Instant::now();
        ctx.scoped("bench decode", || {
            let mut enc = p.timed_encoder(ctx);
            record_pisa(&mut enc, &caches, r, None, Some(&mut prof))?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let wall_pisa = started.elapsed().as_secs_f64() * 1e3;
        let started = std::time::Instant::now();
        ctx.scoped("bench dense decode", || {
            let mut enc = p.timed_encoder(ctx);
            for x in &parts {
                record_dense_attention(
                    ctx,
                    &mut enc,
                    &x.qs[r % 2],
                    &x.k,
                    &x.v,
                    &x.shape,
                    dense_layouts,
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
            let mut enc = p.timed_encoder(ctx);
            let steps: Vec<_> = (caches.iter())
                .map(|x| (&x.cache, &x.q_views[r % 2]))
                .collect();
            KvCache::record_steps_by_stage_into(&mut enc, &steps, Some(&mut prof))?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let t = prof.finish(ctx)?;
        gpu &= t.gpu;
        let pisa_burst = burst(ctx, parts.len(), p.burst, "decode", |prof, _| {
            let mut enc = p.timed_encoder(ctx);
            for s in 0..p.burst {
                record_pisa(&mut enc, &caches, r, Some(s % BURST), Some(&mut *prof))?;
            }
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        let dense_burst = burst(ctx, parts.len(), p.burst, "dense", |prof, outs| {
            let mut enc = p.timed_encoder(ctx);
            let np = parts.len();
            for s in 0..p.burst {
                for (i, x) in parts.iter().enumerate() {
                    // Step s > 0 reads step s-1's output as its query (see `burst`). With
                    // bf16 storage O is f32: its buffer is read as bf16 words (meaningless
                    // values, the same work: the ordering is what is needed).
                    let chained;
                    let q = match s {
                        0 => &x.burst_qs[0],
                        _ => {
                            let o = &outs[(s - 1) * np + i].0;
                            chained = GpuTensor::from_buffer(o.buffer.clone(), o.len, p.storage);
                            &chained
                        }
                    };
                    let prof = Some(&mut *prof);
                    let o = record_dense_attention(
                        ctx,
                        &mut enc,
                        q,
                        &x.k,
                        &x.v,
                        &x.shape,
                        dense_layouts,
                        true,
                        scale,
                        prof,
                    )?;
                    outs.push(o);
                }
            }
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })?;
        if r >= 2 {
            pisa.push(if t.gpu { t.get("decode") } else { wall_pisa });
            dense.push(if t.gpu { t.get("dense") } else { wall_dense });
            bursts[0].push(pisa_burst);
            bursts[1].push(dense_burst);
            for (v, stage) in
                by_stage
                    .iter_mut()
                    .zip(["decode_route", "decode_leaf", "decode_merge"])
            {
                v.push(t.get(stage));
            }
        }
        if r == 1 {
            reps =
                super::args::budget_reps(p.reps, p.budget_s, rep_started.elapsed().as_secs_f64());
        }
        r += 1;
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [a, b, c] = by_stage;
    let [pb, db] = bursts;
    Ok(DecodeTimes {
        pisa: med(pisa),
        dense: med(dense),
        pisa_burst: med(pb),
        dense_burst: med(db),
        stages: gpu.then(|| [med(a), med(b), med(c)]),
        reps,
        gpu,
        dense_kernel,
        pisa_step: (!pisa_step.is_empty()).then(|| pisa_step.join(", ")),
    })
}

/// Medians of [`decode`], ms.
#[derive(Debug)]
pub struct DecodeTimes {
    /// The PISA step (one compute pass).
    pub pisa: f64,
    /// Dense attention of one query over the whole cache.
    pub dense: f64,
    /// The PISA step within a burst of back-to-back steps: the burst / its steps.
    pub pisa_burst: f64,
    /// Dense attention of one query within a burst: the burst / its steps.
    pub dense_burst: f64,
    /// The step's `route`, `leaf` and `merge` passes timed apart (GPU timestamps only).
    pub stages: Option<[f64; 3]>,
    /// Repetitions.
    pub reps: usize,
    /// True when timed by GPU timestamps (else wall clock).
    pub gpu: bool,
    /// The dense calls' attention kernel ([`super::kernels::names`]).
    pub dense_kernel: Option<String>,
    /// The PISA step's dispatches in its one pass (`pisa_wgpu::DecodeStep::name` of each
    /// cache's `KvCache::decode_step`), each once, in
    /// order, joined by `, ` (caches may differ).
    pub pisa_step: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use pisa_core::SelectionConfig;
    use pisa_wgpu::Storage;

    /// K/V of one KV head per binding: 4 KV heads are 2 caches of 2 heads (each over two
    /// bindings), stepped side by side through `KvCache::record_steps_into` and timed by stage
    /// through `record_steps_by_stage_into`, with 4 dense parts.
    #[test]
    fn several_caches_are_stepped_side_by_side() {
        // A missing adapter fails the test (as the library's tests do), never skips it.
        let ctx = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance)
            .expect("a GPU adapter (install mesa-vulkan-drivers)");
        let (n, d) = (300, 32);
        // One head's K (300 x 32 f32, 37.5 KiB) fits a binding, two do not.
        ctx.set_max_binding_bytes((n * d * 4 + 1000) as u64);
        let p = Plan {
            n,
            q_len: 1,
            hq: 8,
            hkv: 4,
            d,
            cfg: SelectionConfig::new(16, 2).unwrap(),
            storage: Storage::F32,
            q_tile: 1,
            layout: TensorLayout::Bhnd,
            dense: true,
            backward: false,
            baselines: false,
            reps: 1,
            budget_s: 1.0,
            burst: 2,
            inputs: None,
            warmup: None,
        };
        let t = decode(&ctx, &p).unwrap();
        assert!(t.pisa > 0.0 && t.dense > 0.0 && t.pisa_burst > 0.0, "{t:?}");
        // (the caches' step, named once: they have one shape)
        let steps = [
            "fused",
            "one-dispatch",
            "route-leaf+merge",
            "route+leaf+merge",
        ];
        assert!(
            steps.contains(&t.pisa_step.as_deref().unwrap_or_default()),
            "{t:?}"
        );
        if t.gpu {
            assert!(t.stages.is_some(), "{t:?}");
        }
    }
}
