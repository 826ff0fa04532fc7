//! The measurements of `pisa bench`: GPU-timed prefill stages (pyramid, routing, leaf
//! selection, sparse attention), BSA selection and dense flash attention on the same inputs,
//! one submission per repetition, warm-up first, median over repetitions, input sets rotated.
//!
//! Inputs are made on the GPU (`ops::fill`). When Q does not fit one storage binding, the KV
//! heads are processed in chunks and a repetition's time is the sum over its chunks (every chunk
//! has its own buffers, which doubles as input rotation).

use anyhow::Result;
use pisa_core::{AttentionShape, PyramidLayout, Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::{attention_kernel, record_attention, AttentionKind, QkvLayouts};
use pisa_wgpu::ops::backward::record_backward;
use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::ops::pyramid::{self, KeyGeometry};
use pisa_wgpu::ops::select::{select, Layouts, Method};
use pisa_wgpu::{Context, GpuTensor, Profiler, StageTimes, Storage};

use super::kernels::Kernels;

/// What to measure at one size.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Tokens.
    pub n: usize,
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
    /// Also time dense attention.
    pub dense: bool,
    /// Also time the backward pass (dQ, dK, dV through the selected blocks).
    pub backward: bool,
    /// Timed repetitions (at most).
    pub reps: usize,
    /// Seconds of GPU time one size may take (caps the repetitions).
    pub budget_s: f64,
    /// Decode steps per back-to-back burst (decode only).
    pub burst: usize,
}

struct Inputs {
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
    }
}

/// KV heads per chunk so that Q (the largest input) and O fit one binding: the fewest equal
/// chunks that divide Hkv (every chunk has the same shape, so together they cover exactly the
/// Hkv heads; 8 heads of which 7 would fit run as 2 chunks of 4, not 2 of 7).
pub fn heads_per_chunk(ctx: &Context, p: &Plan) -> usize {
    let g = (p.hq / p.hkv) as u64;
    let per_head = g * p.n as u64 * p.d as u64 * p.storage.bytes();
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

/// Runs the prefill measurements of one size; returns the median stage times (ms), the number
/// of repetitions and the attention kernels that ran.
pub fn prefill(ctx: &Context, p: &Plan) -> Result<(StageTimes, usize, Kernels)> {
    let hc = heads_per_chunk(ctx, p);
    let chunks = p.hkv.div_ceil(hc);
    let g = p.hq / p.hkv;
    let shape = AttentionShape::prefill(1, hc * g, hc, p.n, p.d)?;
    let pool = chunks.max(2);
    let mut sets = Vec::with_capacity(pool);
    for i in 0..pool {
        let s = (i * 3) as u32;
        sets.push(Inputs {
            q: random_tensor(ctx, "q", shape.q_elems(), p.storage, s, 1.0)?,
            k: random_tensor(ctx, "k", shape.kv_elems(), p.storage, s + 1, 1.0)?,
            v: random_tensor(ctx, "v", shape.kv_elems(), p.storage, s + 2, 1.0)?,
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
    let layout = TensorLayout::Bhnd;
    let lay = PyramidLayout::new(p.n, p.cfg.block_size, p.cfg.merge_factor)?;
    let geo = KeyGeometry {
        batch: 1,
        kv_heads: hc,
        tokens: p.n,
        head_dim: p.d,
        layout,
    };
    let layouts = Layouts::new(layout, &shape);
    let scale = p.cfg.softmax_scale(p.d);
    let qkv = QkvLayouts::from(layout);
    let kernels = std::cell::Cell::new(Kernels::default());
    let one_rep = |rep: usize| -> Result<StageTimes> {
        let mut total = StageTimes {
            stages: Vec::new(),
            gpu: true,
        };
        for c in 0..chunks {
            let inp = &sets[(rep * chunks + c) % pool];
            let mut prof = Profiler::new(ctx, 128);
            ctx.scoped("bench", || {
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                let pyr = pyramid::alloc(ctx, lay, &geo, p.cfg.scoring == Scoring::MeanVar)?;
                pyramid::record_build(ctx, &mut enc, &inp.k, &geo, p.n, &pyr, Some(&mut prof))?;
                let sel = select(
                    ctx,
                    &inp.q,
                    &inp.k,
                    Some(&pyr),
                    &shape,
                    &layouts,
                    &p.cfg,
                    Method::Pisa,
                    p.q_tile,
                    &mut enc,
                    Some(&mut prof),
                )?;
                let sparse = AttentionKind::Sparse {
                    selection: &sel,
                    cfg: &p.cfg,
                };
                let dense = AttentionKind::Dense {
                    causal: p.cfg.causal,
                    scale,
                };
                // The kernels these very calls run (the rule record_attention dispatches on).
                kernels.set(Kernels {
                    attention: Some(attention_kernel(ctx, &shape, p.storage, qkv, &sparse, None)),
                    dense: p
                        .dense
                        .then(|| attention_kernel(ctx, &shape, p.storage, qkv, &dense, None)),
                });
                let (q, k, v) = (&inp.q, &inp.k, &inp.v);
                let (o, lse) = record_attention(
                    ctx,
                    &mut enc,
                    q,
                    k,
                    v,
                    &shape,
                    qkv,
                    &sparse,
                    None,
                    Some(&mut prof),
                )?;
                if let Some(d_o) = &inp.d_o {
                    record_backward(
                        ctx,
                        &mut enc,
                        q,
                        k,
                        v,
                        &o,
                        &lse,
                        d_o,
                        &sel,
                        &shape,
                        layout,
                        &p.cfg,
                        Some(&mut prof),
                    )?;
                }
                select(
                    ctx,
                    &inp.q,
                    &inp.k,
                    Some(&pyr),
                    &shape,
                    &layouts,
                    &p.cfg,
                    Method::Bsa,
                    p.q_tile,
                    &mut enc,
                    Some(&mut prof),
                )?;
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
    Ok((medians(&all), reps, kernels.get()))
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
