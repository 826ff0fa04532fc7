//! The fused decode step (`shaders/decode_fused.wgsl`, ONE dispatch per step; see the module
//! docs of [`crate::ops::decode`]): the path selection ([`crate::Tuning::decode_fused`],
//! [`KvCache::set_fused`]), the kernel's sizing ([`FusedPlan`]) and its dispatch.

use pisa_core::SelectionConfig;

use super::plan::{cut_words, lanes, max_workgroup, Dims, Params, Plan};
use super::record::{range, whole, Binds, Stage, StepIo};
use super::{KvCache, FUSED_SHADER};
use crate::error::{GpuError, Result};

/// The constants of the fused decode kernel (`decode_fused.wgsl`: routing, every slot's block
/// state, the cut and the attention over the selection in one workgroup per (sequence, KV
/// head)) and the workgroup memory it takes; `None` from [`FusedPlan::new`] when it does not
/// fit the device (the step then runs split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FusedPlan {
    /// Invocations per workgroup (up to 1024).
    pub wg: u32,
    /// Route lanes per pyramid row.
    pub lr: u32,
    /// Floats of `xr`, the scratch shared by the route and the passes over key rows.
    pub xr: u32,
    /// Invocations per key row.
    pub lk: u32,
    /// Blocks per pass.
    pub nb: u32,
    /// Keys of each block per pass (C when memory allows).
    pub ch: u32,
    /// Sub-accumulators per (block, head).
    pub rn: u32,
    /// P.V parts summed per reduction round.
    pub pb: u32,
    /// Value rows prefetched per P.V invocation.
    pub pv: u32,
    /// Workgroup memory, bytes.
    pub smem: u64,
}

impl FusedPlan {
    /// Sizes the fused kernel for group `gq`, head dim `d` (a multiple of 4, checked by
    /// [`Plan::new`]) and `cfg` within `limits`. Largest workgroup (a power of two up to 1024);
    /// LK = 4 invocations per key row (`key_lanes`, [`crate::Tuning::decode_key_lanes`], a
    /// power of two up to D/4, overrides it), one row per LK invocations a pass, whole blocks per pass when
    /// memory allows (fewer lanes, then fewer keys per block and pass, when not). `None` when
    /// even one key row per pass, one P.V part per round and the route's one lane per row do
    /// not fit.
    pub fn new(
        limits: &wgpu::Limits,
        gq: usize,
        d: usize,
        cfg: &SelectionConfig,
        key_lanes: Option<u32>,
    ) -> Option<Self> {
        let wg = max_workgroup(limits).min(1024);
        let (gq, d) = (gq as u64, d as u64);
        let d4 = d / 4;
        if d4 == 0 || d4 > wg || gq > wg {
            return None;
        }
        let Dims { k, c, g, maxc, ns } = Dims::of(cfg);
        let rn = c.min(4);
        // qs, wlen | cand, rk | mc, msc, mrank, mtmp, msel, mcnt | lst, bst, hml, wnl.
        let fixed = 4 * (gq * d + 1)
            + 4 * 3 * maxc
            + 4 * (ns + maxc + 3 * k + cut_words(wg, maxc))
            + 4 * ns
            + 8 * ns * gq * rn
            + 8 * gq
            + 4;
        let limit = limits.max_compute_workgroup_storage_size as u64;
        let budget = limit.checked_sub(fixed)? / 4;
        let route = |lr: u64| maxc * g.max(2) * lr * gq;
        if budget < route(1).max(2 * gq).max(gq * d) {
            return None;
        }
        let lr = lanes(8, d4, |lr| route(lr) <= budget && maxc * g * lr <= wg);
        let lk_asked = key_lanes
            .map(|v| v as u64)
            .filter(|v| v.is_power_of_two() && *v <= d4);
        let rows = |lk: u64| (wg / lk).min(budget / (gq * (lk + 1)));
        let lk = lanes(lk_asked.unwrap_or(4), d4, |lk| rows(lk) >= c.min(wg / lk));
        let r = rows(lk).max(1);
        let (nb, ch) = if r >= c { (r / c, c) } else { (1, r) };
        // P.V parts summed per round: as many as the route's and the passes' scratch holds
        // (at least one), not more: workgroup memory is taken from the L1 that caches the keys
        // read again for the attention.
        let parts = wg / d4;
        let scratch = route(lr).max(nb * ch * gq * (lk + 1));
        let pb = parts.min(scratch / (gq * d)).max(1);
        let xr = scratch.max(pb * gq * d);
        let pv_it = (nb * ch).div_ceil(parts);
        Some(Self {
            wg: wg as u32,
            lr: lr as u32,
            xr: xr as u32,
            lk: lk as u32,
            nb: nb as u32,
            ch: ch as u32,
            rn: rn as u32,
            pb: pb as u32,
            pv: if pv_it <= 8 { pv_it as u32 } else { 1 },
            smem: fixed + 4 * xr,
        })
    }

    /// An upper bound of the loop iterations one invocation of the fused kernel runs, all its
    /// loops together, for group `gq`, head dim `d` and `cfg` (those of [`Self::new`]): the
    /// passes over key rows of steps 2 and 4 (`ceil(slots / FNB) * ceil(C / FCH)` and `ceil(K /
    /// FNB) * ceil(C / FCH)` passes, each bounded by the trip counts of its loops), plus a
    /// bound of the routing over `levels` pyramid levels, the cut and the output. Compared with
    /// [`crate::Context::loop_limit`] (llvmpipe ends every loop of an invocation once it has run
    /// 65535 iterations in all, silently): a cache whose fused step would pass it runs split.
    pub fn iterations(&self, gq: usize, d: usize, cfg: &SelectionConfig, levels: usize) -> u64 {
        let Dims { k, c, g, maxc, ns } = Dims::of(cfg);
        let (gq, d4) = (gq as u64, (d / 4) as u64);
        let (wg, lk, nb, ch, rn) = (
            self.wg as u64,
            self.lk as u64,
            self.nb as u64,
            self.ch as u64,
            self.rn as u64,
        );
        let rp = nb * ch;
        let parts = (wg / d4).max(1);
        let chunks = c.div_ceil(ch);
        // pass_partials (each row: the heads' stores and the dot products of its lanes) and
        // the row values (each: its lanes' partial sums); then per step its own loops.
        let common = 1
            + (rp * lk).div_ceil(wg) * (1 + gq + d4.div_ceil(lk))
            + (rp * gq).div_ceil(wg) * (1 + lk);
        let pass2 = common + (nb * gq * rn).div_ceil(wg) * (1 + 2 * ch.div_ceil(rn));
        let pass4 = common + self.pv as u64 + rp.div_ceil(parts) * (1 + gq);
        let passes = ns.div_ceil(nb) * chunks * pass2 + k.div_ceil(nb) * chunks * pass4;
        // A routed level (decode_levels.wgsl): its rows' dot products (LR lanes a row), the
        // candidates' sums and LSEs, the rank and expand steps over the candidates.
        let lr = self.lr as u64;
        let level = (maxc * g * lr).div_ceil(wg) * (1 + gq + d4.div_ceil(lr) * (1 + gq))
            + maxc.div_ceil(wg) * (1 + gq * (2 * g + 2 * lr + 2))
            + 4 * maxc
            + 2 * k
            + 16;
        let foe = (gq * d4 * 4).div_ceil(wg);
        let fixed = levels as u64 * level
            + 8 * (ns + maxc + k)
            + 64
            + (parts.div_ceil(self.pb as u64) + 1) * (gq + foe * self.pb as u64 + 2);
        passes + fixed
    }

    /// The `const` substitutions of `decode.wgsl` + `decode_levels.wgsl` + `decode_cut.wgsl` +
    /// `decode_fused.wgsl` (`split`: the shared sizes).
    pub fn consts(&self, split: &Plan) -> [(&'static str, u32); 14] {
        [
            ("WG", self.wg),
            ("GQ", split.gq),
            ("KMAX", split.kmax),
            ("MAXC", split.maxc),
            ("MG", split.mg),
            ("LR", self.lr),
            ("XR", self.xr),
            ("LK", self.lk),
            ("DD", split.dd),
            ("FNB", self.nb),
            ("FCH", self.ch),
            ("FRN", self.rn),
            ("FPB", self.pb),
            ("FPV", self.pv),
        ]
    }
}

/// Whether the fused kernel of `fplan` keeps its loops within the device's cap on an
/// invocation's loop iterations ([`crate::Context::loop_limit`]; [`FusedPlan::iterations`] for
/// `(gq, d)`, `cfg` and `levels` pyramid levels): a block of 2^20 keys ran past llvmpipe's and
/// gave NaN silently. Where they do not, the step runs split. Computed when the plan is made,
/// not at every step.
pub(super) fn loops_within_cap(
    fplan: Option<&FusedPlan>,
    ctx: &crate::Context,
    (gq, d): (usize, usize),
    cfg: &SelectionConfig,
    levels: usize,
) -> bool {
    match (fplan, ctx.loop_limit()) {
        (Some(f), Some(limit)) => f.iterations(gq, d, cfg, levels) <= limit,
        _ => true,
    }
}

impl KvCache {
    /// Workgroup memory of the fused kernel, bytes; `None` where it does not fit the device (or
    /// the limit of [`Self::set_workgroup_memory_limit`]), so that the step runs split. (A cache
    /// split over two storage bindings runs split whatever this says: [`Self::is_fused`].)
    pub fn fused_workgroup_memory(&self) -> Option<u64> {
        self.fplan.map(|f| f.smem)
    }

    /// Selects the step's path: `true`, the fused step (ONE dispatch per step: routing, leaf
    /// scores, cut and attention in one workgroup per (sequence, KV head)) where its workgroup
    /// memory fits and the cache's K/V are in one storage binding, else the split one;
    /// `false`, the split step (three dispatches: `route`, `leaf`, `merge`; two or one where
    /// [`Self::route_leaf_blocks`] and [`Self::merges_in_route`] say so). New caches take the
    /// context's [`crate::Tuning::decode_fused`]. Results agree within rounding.
    pub fn set_fused(&mut self, fused: bool) {
        self.fused = fused;
    }

    /// Whether the step runs fused: selected ([`Self::set_fused`]), within the device's
    /// workgroup memory and its cap on loop iterations, and the cache's K/V in one storage
    /// binding (the fused kernel reads one shard; a cache split over two runs the split step).
    pub fn is_fused(&self) -> bool {
        self.fused && self.fplan.is_some() && self.kv.len() == 1 && self.fused_loops_ok
    }

    /// The one dispatch of this cache's fused step for `q` (one workgroup per (sequence, KV
    /// head)). Errors: [`GpuError::Unsupported`] where the fused kernel does not fit the device
    /// (callers take this path only when [`Self::is_fused`]).
    pub(super) fn fused_stage(&self, io: &StepIo) -> Result<Stage> {
        let s = &self.shape;
        let ctx = &self.ctx;
        let fp = self.fplan.ok_or_else(|| {
            GpuError::Unsupported(
                "the fused decode step: its workgroup memory does not fit this device".into(),
            )
        })?;
        let heads = (s.batch * s.kv_heads) as u64;
        let u = ctx.uniform(
            "decode params",
            &Params {
                wg_count: heads as u32,
                ..self.base()
            },
        )?;
        let consts = fp.consts(&self.plan);
        let pipe = ctx.pipelines.get(
            &ctx.device,
            &FUSED_SHADER,
            "fused",
            self.storage,
            &consts,
            &[],
        )?;
        let sq = self.pyr.sq.as_ref().unwrap_or(&self.dummy);
        let b: Binds = vec![
            whole(0, &u),
            whole(1, &self.lens_gpu),
            range(2, &io.q),
            whole(3, &self.kv[0].0.buffer),
            whole(4, &self.kv[0].1.buffer),
            whole(5, &self.pyr.means.buffer),
            whole(6, &sq.buffer),
            range(7, &io.out),
            range(8, &io.lse),
            range(9, &io.sel),
        ];
        self.make_stage(pipe, &b, heads)
    }
}
