//! Recording of the decode step: [`KvCache::record_step`] and [`KvCache::record_steps`], ONE
//! compute pass of one dispatch per cache (`fused`) or three (`route`, `leaf`, `merge`; see the
//! module docs of [`crate::ops::decode`] for the two paths).

use std::sync::Arc;

use super::{KvCache, Params, MERGE_SHADER, ROUTE_SHADER, SHADER};
use crate::error::{GpuError, Result};
use crate::runtime::buffers::GpuTensor;
use crate::runtime::profiler::Profiler;

/// Bindings of one dispatch: `(binding, buffer)`.
pub(super) type Binds<'a> = Vec<(u32, &'a wgpu::Buffer)>;

pub(super) use crate::runtime::buffers::Stage;

impl KvCache {
    /// Records the decode step (PISA.md 3, 4, 5) of every sequence, labelled "decode" in
    /// `prof`: ONE compute pass of one dispatch when the cache runs fused ([`Self::is_fused`]:
    /// `fused`, one workgroup per (sequence, KV head)), else of three (see the module docs:
    /// `route`, one workgroup per (sequence, KV head); `leaf`, one per (sequence, KV head,
    /// leaf slot); `merge`, one per (sequence, KV head)). `q`: `[B, Hq, D]` in the cache's storage
    /// precision, the token at position `len(b) - 1` of each sequence (append its key first).
    /// Writes [`Self::outputs`]: O `[B, Hq, D]` (storage precision), LSE `[B, Hq]` f32,
    /// selection `[B, Hkv, K]` i32. An empty sequence gets zeros, LSE `-inf` and no blocks.
    /// Errors: [`pisa_core::PisaError::BufferLen`] or [`crate::GpuError::Unsupported`] for a
    /// `q` of the wrong size or precision.
    pub fn record_step(
        &self,
        enc: &mut wgpu::CommandEncoder,
        q: &GpuTensor,
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_steps(enc, &[(self, q)], prof)
    }

    /// Records the steps of several caches (each as [`Self::record_step`], with its own `q`)
    /// in ONE compute pass labelled "decode": every fused cache's `fused` and every split
    /// cache's `route`, then every `leaf`, then every `merge`, so the caches' steps run side by
    /// side as one dependent chain (of one dispatch when all are fused, else three) instead of
    /// one chain per cache. For KV heads split over several caches (K or V of all heads past
    /// two storage bindings, e.g. 1M tokens x 8 heads x 128 x f32; one cache holds them up to
    /// two bindings).
    /// Outputs are bitwise those of separate steps. Errors: those of [`Self::record_step`];
    /// [`GpuError::Unsupported`] for caches of different contexts. Nothing is recorded on
    /// error.
    pub fn record_steps(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &GpuTensor)],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_passes(enc, steps, prof, false)
    }

    /// As [`Self::record_steps`], but always the split step (whatever [`Self::is_fused`] says),
    /// each of its three dispatches (every cache's `route`, then `leaf`, then `merge`) in its
    /// own timed compute pass, labelled "decode_route", "decode_leaf" and "decode_merge" in
    /// `prof`: where a split step's GPU time goes (benchmarks; the pass boundaries add a little
    /// time against the one-pass step). Same errors; the outputs of the split step (those of
    /// the fused step within rounding).
    pub fn record_steps_by_stage(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &GpuTensor)],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_passes(enc, steps, prof, true)
    }

    fn record_passes(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &GpuTensor)],
        mut prof: Option<&mut Profiler>,
        by_stage: bool,
    ) -> Result<()> {
        let Some(first) = steps.first() else {
            return Ok(());
        };
        let mut stages: [Vec<Stage>; 3] = Default::default();
        for (cache, q) in steps {
            if !cache.ctx.same(&first.0.ctx) {
                return Err(GpuError::Unsupported(
                    "decode steps of caches from different contexts in one pass".into(),
                ));
            }
            if cache.is_fused() && !by_stage {
                stages[0].push(cache.fused_stage(q)?);
                continue;
            }
            for (all, st) in stages.iter_mut().zip(cache.stages(q)?) {
                all.push(st);
            }
        }
        let passes: Vec<(&'static str, Vec<&Stage>)> = if by_stage {
            ["decode_route", "decode_leaf", "decode_merge"]
                .into_iter()
                .zip(stages.iter())
                .filter(|(_, group)| !group.is_empty())
                .map(|(label, group)| (label, group.iter().collect()))
                .collect()
        } else {
            vec![("decode", stages.iter().flatten().collect())]
        };
        for (label, group) in passes {
            first
                .0
                .ctx
                .record_pass(enc, label, group, prof.as_deref_mut());
        }
        Ok(())
    }

    pub(super) fn lens_buffer(&self) -> Result<GpuTensor> {
        let lens: Vec<u32> = self.lens.iter().map(|&l| l as u32).collect();
        self.ctx.upload_u32("decode lengths", &lens)
    }

    /// A dispatch of `n` workgroups of pipeline `p` with bindings `b`.
    pub(super) fn make_stage(
        &self,
        p: Arc<wgpu::ComputePipeline>,
        b: &Binds,
        n: u64,
    ) -> Result<Stage> {
        self.ctx.stage(&p, b, n)
    }

    /// The three dispatches of this cache's split step for `q`: `route`, `leaf`, `merge`.
    fn stages(&self, q: &GpuTensor) -> Result<[Stage; 3]> {
        let s = &self.shape;
        self.check_tensor("q", q, s.batch * s.q_heads * s.head_dim)?;
        let ctx = &self.ctx;
        let lens_buf = self.lens_buffer()?;
        let heads = (s.batch * s.kv_heads) as u64;
        let slots = heads * self.plan.slots() as u64;
        let uniform = |wg_count: u64| {
            ctx.uniform(
                "decode params",
                &Params {
                    wg_count: wg_count as u32,
                    ..self.base()
                },
            )
        };
        let (u_heads, u_slots) = (uniform(heads)?, uniform(slots)?);
        let pipe = |shader, entry, wg| {
            let consts = self.plan.consts(wg);
            ctx.pipelines
                .get(&ctx.device, shader, entry, self.storage, &consts, &[])
        };
        let sq = self.pyr.sq.as_ref().unwrap_or(&self.dummy);
        let (l, c, pa) = (&lens_buf.buffer, &self.cands.buffer, &self.parts.buffer);
        let route: Binds = vec![
            (0, &u_heads),
            (1, l),
            (2, &q.buffer),
            (5, &self.pyr.means.buffer),
            (6, &sq.buffer),
            (10, c),
        ];
        let leaf: Binds = vec![
            (0, &u_slots),
            (1, l),
            (2, &q.buffer),
            (3, &self.kv[0].0.buffer),
            (4, &self.kv[0].1.buffer),
            (12, &self.kv[self.kv.len() - 1].0.buffer),
            (13, &self.kv[self.kv.len() - 1].1.buffer),
            (10, c),
            (11, pa),
        ];
        let merge: Binds = vec![
            (0, &u_heads),
            (1, l),
            (7, &self.out.buffer),
            (8, &self.lse.buffer),
            (9, &self.sel.buffer),
            (10, c),
            (11, pa),
        ];
        let stage = |p, b: Binds, n| self.make_stage(p, &b, n);
        Ok([
            stage(pipe(&ROUTE_SHADER, "route", self.plan.wr)?, route, heads)?,
            stage(pipe(&SHADER, "leaf", self.plan.wg)?, leaf, slots)?,
            stage(pipe(&MERGE_SHADER, "merge", self.plan.wm)?, merge, heads)?,
        ])
    }
}
