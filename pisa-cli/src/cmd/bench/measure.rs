//! The measurements of `pisa bench`: GPU-timed prefill stages (pyramid, routing, leaf
//! selection, sparse attention), BSA selection and dense flash attention on the same inputs,
//! one submission per repetition, warm-up first, median over repetitions, input sets rotated.
//!
//! The PISA prefill is a `PrefillPlan` (the library's app-facing API) made once per size and
//! run on views of the bench's own buffers; the other rows use the library's ops directly.
//! Inputs are made on the GPU (`ops::fill`). When Q does not fit one storage binding, the KV
//! heads are processed in chunks and a repetition's time is the sum over its chunks (every chunk
//! has its own buffers, which doubles as input rotation).

use anyhow::Result;
use pisa_core::{AttentionShape, PyramidLayout, Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::{
    attention_kernel, prefill_attention_kernel, record_attention, AttentionKind, QkvLayouts,
};
use pisa_wgpu::ops::backward::record_backward;
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::ops::prefill::{PrefillOptions, PrefillOutputs, PrefillPlan};
use pisa_wgpu::ops::pyramid::{self, KeyGeometry};
use pisa_wgpu::ops::select::{select, Layouts, Method};
use pisa_wgpu::{Context, DType, GpuError, GpuTensor, Profiler, StageTimes, Storage, TensorView};

use super::kernels::Kernels;
use crate::cmd::embed;

/// Q, K, V read from a file (`pisa bench --input`), f32 in [`Plan::layout`], batch 1.
#[derive(Debug)]
pub struct HostInputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// What to measure at one size.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Tokens (keys).
    pub n: usize,
    /// Queries of the prefill (at most `n`): the last `q_len` of the `n` positions.
    pub q_len: usize,
    /// Hq, Hkv, D.
    pub hq: usize,
    /// KV heads.
    pub hkv: usize,
    /// Head dim.
    pub d: usize,
    /// Selection configuration.
    pub cfg: SelectionConfig,
    /// Storage precision.
    pub storage: Storage,
    /// Stage-2 query tile.
    pub q_tile: usize,
    /// Layout of the prefill's Q, K, V and O (its LSE and selection are BHND).
    pub layout: TensorLayout,
    /// Also time dense attention.
    pub dense: bool,
    /// Also time the backward pass (dQ, dK, dV through the selected blocks).
    pub backward: bool,
    /// Also time the BSA selection baseline.
    pub baselines: bool,
    /// Timed repetitions (at most).
    pub reps: usize,
    /// Seconds of GPU time one size may take (caps the repetitions).
    pub budget_s: f64,
    /// Decode steps per back-to-back burst (decode only).
    pub burst: usize,
    /// The prefill's Q, K, V (of shape `[1, hq, n, d]`, `[1, hkv, n, d]`); `None`: random.
    pub inputs: Option<std::sync::Arc<HostInputs>>,
    /// The GPU warm-up recorded at the start of each timed submission (`--warmup-ms`).
    pub warmup: Option<std::sync::Arc<super::warm::Warmup>>,
}

impl Plan {
    /// A command encoder for one timed submission, the GPU warm-up ([`Self::warmup`]) recorded
    /// into it first, untimed: every timed submission of the benchmark starts so.
    pub fn timed_encoder(&self, ctx: &Context) -> pisa_wgpu::wgpu::CommandEncoder {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        if let Some(w) = &self.warmup {
            w.record(&mut enc);
        }
        enc
    }
}

struct Inputs {
    /// Q, K, V as views, for the plan.
    views: [TensorView; 3],
    q: GpuTensor,
    k: GpuTensor,
    v: GpuTensor,
    d_o: Option<GpuTensor>,
}

/// Median of each stage over repetitions (ms); stages missing from a repetition count 0.
fn medians(reps: &[StageTimes]) -> StageTimes {
    let mut names: Vec<String> = Vec::new();
    for r in reps {
        for (n, _) in &r.stages {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    let stages = names
        .into_iter()
        .map(|n| {
            let mut v: Vec<f64> = reps.iter().map(|r| r.get(&n)).collect();
            v.sort_by(f64::total_cmp);
            let m = v[v.len() / 2];
            (n, m)
        })
        .collect();
    StageTimes {
        stages,
        gpu: reps.iter().all(|r| r.gpu),
        untimed: reps.iter().map(|r| r.untimed).max().unwrap_or(0),
    }
}

/// KV heads per chunk so that Q (the largest input) and O fit one binding: the fewest equal
/// chunks that divide Hkv (every chunk has the same shape, so together they cover exactly the
/// Hkv heads; 8 heads of which 7 would fit run as 2 chunks of 4, not 2 of 7).
pub fn heads_per_chunk(ctx: &Context, p: &Plan) -> usize {
    let g = (p.hq / p.hkv) as u64;
    let per_head = (g * p.q_len as u64).max(p.n as u64) * p.d as u64 * p.storage.bytes();
    even_chunk(ctx.max_binding_bytes(), per_head, p.hkv)
}

/// The largest divisor of `heads` whose heads of `per_head` bytes fit `limit` bytes (at least 1).
fn even_chunk(limit: u64, per_head: u64, heads: usize) -> usize {
    let fit = ((limit / per_head.max(1)) as usize).clamp(1, heads.max(1));
    (1..=fit)
        .rev()
        .find(|h| heads.is_multiple_of(*h))
        .unwrap_or(1)
}

/// The PISA prefill of one chunk planned once ([`PrefillPlan`]), its KV heads per chunk and its
/// outputs: buffers of the bench's own, written by [`PrefillPlan::run`] through views and read
/// by the backward pass as tensors.
struct Planned {
    plan: PrefillPlan,
    hc: usize,
    o: GpuTensor,
    lse: GpuTensor,
    sel: GpuTensor,
}

/// Plans the prefill of a chunk of `hc` KV heads (and their query heads), or of the next
/// smaller divisor of Hkv when the plan refuses `hc` heads as past one storage binding (its
/// intermediates, not only Q, must fit).
fn plan_chunk(ctx: &Context, p: &Plan, mut hc: usize) -> Result<Planned> {
    let g = p.hq / p.hkv;
    let opts = PrefillOptions {
        cfg: p.cfg,
        layout: p.layout,
        storage: p.storage,
        q_tile: p.q_tile,
        return_selection: true,
    };
    let plan = loop {
        let shape = AttentionShape::new(1, hc * g, hc, p.q_len, p.n, p.d)?;
        match PrefillPlan::new(ctx, &shape, &opts) {
            Err(GpuError::Limit { .. }) if hc > 1 => {
                hc = (1..hc)
                    .rev()
                    .find(|h| p.hkv.is_multiple_of(*h))
                    .unwrap_or(1);
            }
            r => break r?,
        }
    };
    let s = *plan.shape();
    let out = |label, len, storage: Storage, dtype| {
        let bytes = embed::words(len, dtype);
        let buffer = embed::buffer(ctx, label, bytes);
        GpuTensor::from_buffer(buffer, len, storage)
    };
    // O in the kernels' output type (f32 for bf16).
    let (ost, odt) = (p.storage.output(), embed::dtype(p.storage.output()));
    Ok(Planned {
        o: out("bench o", s.q_elems(), ost, odt),
        lse: out("bench lse", s.lse_elems(), Storage::F32, DType::F32),
        sel: out(
            "bench selection",
            hc * p.q_len * p.cfg.top_k,
            Storage::F32,
            DType::I32,
        ),
        plan,
        hc,
    })
}

/// Runs the prefill measurements of one size; returns the median stage times (ms), the number
/// of repetitions and the attention kernels that ran. The PISA prefill (pyramid, routing, leaf
/// selection, sparse attention) is a [`PrefillPlan`] made once, outside the timed repetitions,
/// and run on views of the bench's input and output buffers; the BSA selection, the backward
/// pass and dense attention are recorded after it into the same submission.
pub fn prefill(ctx: &Context, p: &Plan) -> Result<(StageTimes, usize, Kernels)> {
    let planned = plan_chunk(ctx, p, heads_per_chunk(ctx, p))?;
    let hc = planned.hc;
    let chunks = p.hkv.div_ceil(hc);
    if p.inputs.is_some() && chunks > 1 {
        anyhow::bail!(
            "--input: {} tokens of {} KV heads do not fit one storage binding of this device \
             (use fewer tokens)",
            p.n,
            p.hkv
        );
    }
    let g = p.hq / p.hkv;
    let shape = *planned.plan.shape();
    let pool = chunks.max(2);
    let dt = embed::dtype(p.storage);
    let view = |t: &GpuTensor, heads, tokens| {
        TensorView::contiguous(&t.buffer, 0, dt, [1, heads, tokens, p.d], p.layout)
    };
    let mut sets = Vec::with_capacity(pool);
    for i in 0..pool {
        let s = (i * 3) as u32;
        let (q, k, v) = match &p.inputs {
            // (one chunk: checked above)
            Some(h) => (
                ctx.upload("q", &h.q, p.storage)?,
                ctx.upload("k", &h.k, p.storage)?,
                ctx.upload("v", &h.v, p.storage)?,
            ),
            None => (
                random_tensor(ctx, "q", shape.q_elems(), p.storage, s, 1.0)?,
                random_tensor(ctx, "k", shape.kv_elems(), p.storage, s + 1, 1.0)?,
                random_tensor(ctx, "v", shape.kv_elems(), p.storage, s + 2, 1.0)?,
            ),
        };
        sets.push(Inputs {
            views: [
                view(&q, hc * g, p.q_len)?,
                view(&k, hc, p.n)?,
                view(&v, hc, p.n)?,
            ],
            q,
            k,
            v,
            d_o: if p.backward {
                Some(random_tensor(
                    ctx,
                    "dO",
                    shape.q_elems(),
                    p.storage,
                    s + 100,
                    1.0,
                )?)
            } else {
                None
            },
        });
    }
    let (o_view, lse_view, sel_view) = (
        TensorView::contiguous(
            &planned.o.buffer,
            0,
            embed::dtype(p.storage.output()),
            [1, hc * g, p.q_len, p.d],
            p.layout,
        )?,
        TensorView::contiguous(
            &planned.lse.buffer,
            0,
            DType::F32,
            [1, hc * g, p.q_len, 1],
            TensorLayout::Bhnd,
        )?,
        TensorView::contiguous(
            &planned.sel.buffer,
            0,
            DType::I32,
            [1, hc, p.q_len, p.cfg.top_k],
            TensorLayout::Bhnd,
        )?,
    );
    let outputs = PrefillOutputs {
        out: &o_view,
        lse: &lse_view,
        selection: Some(&sel_view),
    };
    let layout = p.layout;
    let lay = PyramidLayout::new(p.n, p.cfg.block_size, p.cfg.merge_factor)?;
    let geo = KeyGeometry {
        batch: 1,
        kv_heads: hc,
        tokens: p.n,
        head_dim: p.d,
        layout: layout.into(),
    };
    // The BSA baseline scores blocks by the pyramid's leaf means: the plan keeps its pyramid
    // to itself, so the baseline builds its own (untimed; its row counts the plan's timed
    // pyramid build, as one pyramid serves both in a real pipeline).
    let bsa_pyr = pyramid::alloc(ctx, lay, &geo, p.cfg.scoring == Scoring::MeanVar)?;
    let layouts = Layouts::new(layout, &shape);
    let scale = p.cfg.softmax_scale(p.d);
    let qkv = QkvLayouts::from(layout);
    let sparse = AttentionKind::Sparse {
        selection: &planned.sel,
        cfg: &p.cfg,
    };
    let dense = AttentionKind::Dense {
        causal: p.cfg.causal,
        scale,
    };
    // The kernels these very calls run (the rule the prefill and record_attention dispatch
    // on; the plan records the prefill of this shape in BHND).
    let kernels = Kernels {
        attention: Some(prefill_attention_kernel(ctx, &shape, p.storage, &sparse)),
        dense: p
            .dense
            .then(|| attention_kernel(ctx, &shape, p.storage, qkv, &dense, None)),
    };
    let one_rep = |rep: usize| -> Result<StageTimes> {
        let mut total = StageTimes {
            stages: Vec::new(),
            gpu: true,
            untimed: 0,
        };
        for c in 0..chunks {
            let inp = &sets[(rep * chunks + c) % pool];
            let mut prof = Profiler::new(ctx, Profiler::MAX_PASSES);
            ctx.scoped("bench", || {
                let mut enc = p.timed_encoder(ctx);
                let [qv, kv, vv] = &inp.views;
                planned
                    .plan
                    .run(&mut enc, qv, kv, vv, &outputs, Some(&mut prof))?;
                let (q, k, v) = (&inp.q, &inp.k, &inp.v);
                if let Some(d_o) = &inp.d_o {
                    record_backward(
                        ctx,
                        &mut enc,
                        q,
                        k,
                        v,
                        &planned.o,
                        &planned.lse,
                        d_o,
                        &planned.sel,
                        &shape,
                        layout,
                        &p.cfg,
                        Some(&mut prof),
                    )?;
                }
                if p.baselines {
                    pyramid::record_build(ctx, &mut enc, k, &geo, p.n, &bsa_pyr, None)?;
                    select(
                        ctx,
                        q,
                        k,
                        Some(&bsa_pyr),
                        &shape,
                        &layouts,
                        &p.cfg,
                        Method::Bsa,
                        p.q_tile,
                        &mut enc,
                        Some(&mut prof),
                    )?;
                }
                if p.dense {
                    record_attention(
                        ctx,
                        &mut enc,
                        q,
                        k,
                        v,
                        &shape,
                        qkv,
                        &dense,
                        None,
                        Some(&mut prof),
                    )?;
                }
                ctx.queue().submit([enc.finish()]);
                Ok(())
            })?;
            let t = prof.finish(ctx)?;
            total.gpu &= t.gpu;
            total.untimed += t.untimed;
            for (n, ms) in t.stages {
                match total.stages.iter_mut().find(|x| x.0 == n) {
                    Some(x) => x.1 += ms,
                    None => total.stages.push((n, ms)),
                }
            }
        }
        Ok(total)
    };
    let wall = std::time::Instant::now();
    one_rep(0)?; // warm-up: pipelines compiled, caches filled
    let first = wall.elapsed().as_secs_f64();
    let reps = super::args::budget_reps(p.reps, p.budget_s, first);
    let mut all = Vec::with_capacity(reps);
    for r in 0..reps {
        let started = std::time::Instant::now();
        let mut t = one_rep(r + 1)?;
        if !t.gpu {
            t.stages = vec![("wall".to_string(), started.elapsed().as_secs_f64() * 1e3)];
        }
        all.push(t);
    }
    Ok((medians(&all), reps, kernels))
}

#[cfg(test)]
mod tests {
    use super::even_chunk;

    #[test]
    fn chunks_are_equal_and_cover_the_heads() {
        // 256K tokens, g 4, D 128, f16: 256 MiB per KV head against a 2047 MiB binding.
        let mib = 1u64 << 20;
        assert_eq!(even_chunk(2047 * mib, 256 * mib, 8), 4);
        assert_eq!(even_chunk(2048 * mib, 256 * mib, 8), 8);
        assert_eq!(even_chunk(2047 * mib, 128 * mib, 16), 8);
        assert_eq!(even_chunk(5 * mib, mib, 7), 1);
        assert_eq!(even_chunk(100 * mib, mib, 6), 6);
        assert_eq!(even_chunk(mib, 2 * mib, 8), 1);
        for heads in 1..=32 {
            for fit in 1..=heads {
                let h = even_chunk(fit as u64 * mib, mib, heads);
                assert!(h <= fit && heads % h == 0, "{heads} {fit} -> {h}");
            }
        }
    }
}
