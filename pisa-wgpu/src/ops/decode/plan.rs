//! Sizing of the split decode step's three kernels (`shaders/decode.wgsl` +
//! `decode_route.wgsl`, `decode_attend.wgsl`, `decode_merge.wgsl`, [`Plan`]): workgroup size,
//! the constants substituted per pipeline, and the workgroup memory they need, checked against
//! the device; the uniform [`Params`]; and the sizing helpers shared with the fused step's
//! [`FusedPlan`](super::fused::FusedPlan).

use bytemuck::{Pod, Zeroable};
use pisa_core::{PisaError, PyramidLayout, Scoring, SelectionConfig};

use crate::error::{GpuError, Result};

/// Uniform parameters shared by `decode.wgsl` and `decode_append.wgsl` (same field order).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
pub(super) struct Params {
    pub batch: u32,
    pub kv_heads: u32,
    pub q_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub merge: u32,
    pub top_k: u32,
    pub scoring: u32,
    pub causal: u32,
    pub sink: u32,
    pub local: u32,
    pub capacity: u32,
    pub cap_nodes: u32,
    pub wg_count: u32,
    pub scale: f32,
    pub seq: u32,
    pub src_sh: u32,
    pub src_sn: u32,
    pub count: u32,
    pub src_len: u32,
    /// Flat (sequence, KV head) rows of K/V shard 0; rows from here on are in shard 1.
    pub kv_split: u32,
    /// First flat row of the shard an append / prefill-copy dispatch writes.
    pub kv_row0: u32,
    /// Prefill copy: first KV head of the dispatch, and its head index in the source.
    pub hd0: u32,
    pub src_h0: u32,
    pub cap_off: [[u32; 4]; 16],
}

// The uniform's layout: 24 scalars, then `cap_off` 16-byte aligned, as WGSL lays it out.
const _: () =
    assert!(std::mem::size_of::<Params>() == 352 && std::mem::offset_of!(Params, cap_off) == 96);

impl Params {
    /// Every field that depends only on the cache's geometry and configuration.
    pub fn base(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        layout: &PyramidLayout,
        cfg: &SelectionConfig,
    ) -> Self {
        let mut cap_off = [[0u32; 4]; 16];
        for l in 0..layout.num_levels() {
            cap_off[l / 4][l % 4] = layout.offset(l) as u32;
        }
        Self {
            batch: batch as u32,
            kv_heads: kv_heads as u32,
            q_heads: q_heads as u32,
            head_dim: head_dim as u32,
            block_size: cfg.block_size as u32,
            merge: cfg.merge_factor as u32,
            top_k: cfg.top_k as u32,
            scoring: cfg.scoring.code(),
            causal: cfg.causal as u32,
            sink: cfg.sink_blocks as u32,
            local: cfg.local_blocks as u32,
            capacity: layout.key_len() as u32,
            cap_nodes: layout.total_nodes() as u32,
            scale: cfg.softmax_scale(head_dim),
            cap_off,
            ..Default::default()
        }
    }
}

/// Invocations per `leaf` workgroup, where D/4 and g_q allow (more up to [`WG_MAX`] where they
/// need it; lowered to the device's limit). On the H200 (docs/benchmarks.md, A.20, call t7)
/// 128 made the leaf dispatch 17.8 -> 16.4 us and the step 59.2 -> 57.3 us at 1M (and 47.5 ->
/// 46.3 at 64K) against 256; 64 took 31 us; 512 was slower than 256 (A.6, commit dbef09c).
const WG: u32 = 128;
/// The most invocations per `leaf` workgroup: D/4 and g_q up to this are taken (D up to 1024,
/// g_q up to 256).
const WG_MAX: u32 = 256;
/// Invocations per `merge` workgroup (lowered to the device's limit): one output element of
/// the group per invocation at g_q = 4, D = 128; 256 was 1.9 us slower on the H200
/// (docs/benchmarks.md, A.6, commit dbef09c).
const WM: u32 = 512;

/// The constants of the decode pipelines (`route`, `leaf`, `merge`: one set for all three
/// modules but the workgroup size, `wr`, `wg` and `wm`) and the workgroup memory they take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    pub wg: u32,
    /// Invocations per `route` workgroup.
    pub wr: u32,
    /// Invocations per `merge` workgroup.
    pub wm: u32,
    pub gq: u32,
    pub kmax: u32,
    pub maxc: u32,
    /// g, the merge factor.
    pub mg: u32,
    pub lr: u32,
    pub xr: u32,
    pub xs: u32,
    pub ch: u32,
    pub lk: u32,
    pub dd: u32,
    pub parts: u32,
    /// Workgroup memory of the largest of the three kernels, bytes.
    pub smem: u64,
    /// Workgroup memory of `route` (its workgroup-memory level steps), bytes.
    pub route_smem: u64,
    /// Workgroup memory of one block's `leaf` scratch (xs, red, hm, halpha), bytes.
    pub leaf_smem: u64,
}

impl Plan {
    /// Sizes the step's kernels for group `gq`, head dim `d` and `cfg`. `route` needs the
    /// level scratch (`g(K+1) * g * LR * gq` partial per-child scores, LR lanes per row);
    /// `leaf` splits the P.V phase into as many key subsets as there are invocations per
    /// output vec4 (`WG / (D/4)`) and memory allows, and scores a whole block of C keys in one
    /// chunk (LK lanes per key row) when memory allows, else as many keys as fit; `merge`
    /// needs the slot lists, the cut's partial rank counts and, for K <= 32, the (m, l) and
    /// weights per (head, selected block).
    /// Errors: [`PisaError::HeadDim`] unless D is a multiple of 4 up to `4 * WG_MAX`;
    /// [`GpuError::Limit`] when even the minimum of a kernel does not fit;
    /// [`GpuError::Unsupported`] for a GQA group above the workgroup size.
    pub fn new(limits: &wgpu::Limits, gq: usize, d: usize, cfg: &SelectionConfig) -> Result<Self> {
        let max_pow2 = max_workgroup(limits);
        let wg_max = (WG_MAX as u64).min(max_pow2);
        let wm = (WM as u64).min(max_pow2);
        if !d.is_multiple_of(4) || d > 4 * wg_max as usize {
            return Err(GpuError::Input(PisaError::HeadDim {
                head_dim: d,
                supported: "multiples of 4 up to 1024, 4 per invocation of a decode workgroup (fewer where the device or set_workgroup_size_limit allows fewer than 256 invocations)",
            }));
        }
        let (gq, d) = (gq as u64, d as u64);
        let Dims { k, c, g, maxc, ns } = Dims::of(cfg);
        if gq > wg_max {
            return Err(GpuError::Unsupported(format!(
                "decode with {gq} query heads per KV head (at most {wg_max})"
            )));
        }
        // `leaf` has an invocation per output vec4 (D/4) and per head (g_q) at least.
        let wg = (WG as u64)
            .max((d / 4).next_power_of_two())
            .max(gq.next_power_of_two())
            .min(wg_max);
        if k * c > u32::MAX as u64 {
            return Err(GpuError::Input(PisaError::TooLarge {
                what: "top_k * block_size",
                value: k * c,
                limit: u32::MAX as u64,
            }));
        }
        let common = 4 * (gq * d + 1);
        let limit = limits.max_compute_workgroup_storage_size as u64;
        // Route: LR invocations per pyramid row (8 f32 vec4s = one 128-byte line), all the
        // level's rows at once: a workgroup of up to 1024 invocations (WR), rounded up to a
        // multiple of 32, not to a power of two (g(K+1) g 8 = 544 at K 16, g 2: the route at
        // 1M 34.3 -> 33.1 us and the step 56.0 -> 54.4 us on the H200 against 1024,
        // docs/benchmarks.md A.23, where the 480 invocations past the level's rows had no row
        // to load but took part in every barrier); fewer lanes when the level scratch would
        // not fit.
        let wr = (maxc * g * 8)
            .next_multiple_of(32)
            .clamp(wg_max.min(64), max_pow2.min(1024));
        // (The subgroup level steps, decode_levels_sg.wgsl, take 2 words per slot for their
        // (key, node) pairs instead of the level scratch, XR = 1: less, but where g LR g_q is
        // 2 or less.)
        let route_mem =
            |lr: u64| common + 4 * (3 * maxc + (maxc * g.max(2) * lr * gq).max(2 * maxc + 1));
        let lr = lanes(8, d / 4, |lr| {
            route_mem(lr) <= limit.max(route_mem(1)) && maxc * g * lr <= wr
        });
        let xr = maxc * g.max(2) * lr * gq;
        let route = route_mem(lr);
        // + the (m, l) and weights per (head, selection entry) of K <= 32 (decode_merge.wgsl).
        let merge_k = common + 4 * (ns + maxc + 3 * k + cut_words(wm, maxc) + merge_words(gq, k));
        // red, hm, halpha, wleaf (vec2).
        let leaf_fixed = common + 4 * (wg + 2 * gq + 2);
        let budget = limit.saturating_sub(leaf_fixed) / 4;
        // Leaf scratch: a chunk's scores and partial scores (at least one key, CH*gq*(1+LK)
        // floats), and the merge of the P.V parts.
        let merge = |parts: u64| parts * gq * (d + 1);
        let mut parts = (wg / (d / 4)).max(1);
        while parts > 1 && merge(parts).max(2 * gq) > budget {
            parts -= 1;
        }
        let floor = merge(parts).max(2 * gq);
        let needed = route_mem(1).max(merge_k).max(leaf_fixed + 4 * floor);
        if needed > limit {
            return Err(GpuError::Limit {
                what: "decode workgroup memory".into(),
                needed,
                limit,
                unit: "bytes",
                hint: "use a smaller top_k, merge factor, GQA group or head dim",
            });
        }
        // The whole block in one chunk, LK invocations per key row (up to 8 vec4s: a 128-byte
        // line of f32), one row per invocation group (C * LK <= WG); fewer lanes and then
        // fewer keys while that does not fit.
        let room = budget.max(floor);
        let lk = lanes(8, d / 4, |lk| c * gq * (1 + lk) <= room && c * lk <= wg);
        let ch = c.min(room / (gq * (1 + lk))).max(1);
        let xs = floor.max(ch * gq * (1 + lk));
        let smem = route.max(merge_k).max(leaf_fixed + 4 * xs);
        let leaf_smem = 4 * (xs + wg + 2 * gq);
        Ok(Self {
            wg: wg as u32,
            wr: wr as u32,
            wm: wm as u32,
            gq: gq as u32,
            kmax: k as u32,
            maxc: maxc as u32,
            mg: g as u32,
            lr: lr as u32,
            xr: xr as u32,
            xs: xs as u32,
            ch: ch as u32,
            lk: lk as u32,
            dd: d as u32,
            parts: parts as u32,
            smem,
            route_smem: route,
            leaf_smem,
        })
    }

    /// Value rows each `leaf` P.V invocation loads with the keys, `ceil(CH / PARTS)` when at
    /// most 16 (registers), else 1 (no prefetch: loaded in the P.V loop).
    pub fn prefetch_rows(&self) -> u32 {
        let n = self.ch.div_ceil(self.parts);
        if n <= 16 {
            n
        } else {
            1
        }
    }

    /// Leaf slots per (sequence, KV head): `g * (K+1)` candidates and `K` forced leaves.
    pub fn slots(&self) -> u32 {
        self.maxc + self.kmax
    }

    /// The `const` substitutions of `decode.wgsl` (shared by the three modules) for a kernel of
    /// `wg` invocations per workgroup (`wr` for `route`, `wg` for `leaf`, `wm` for `merge`).
    pub fn consts(&self, wg: u32) -> [(&'static str, u32); 13] {
        [
            ("WG", wg),
            ("GQ", self.gq),
            ("KMAX", self.kmax),
            ("MAXC", self.maxc),
            ("MG", self.mg),
            ("LR", self.lr),
            ("XR", self.xr),
            ("XS", self.xs),
            ("CH", self.ch),
            ("LK", self.lk),
            ("DD", self.dd),
            ("PARTS", self.parts),
            ("PVR", self.prefetch_rows()),
        ]
    }
}

impl Plan {
    /// Lanes per pyramid row of the route's subgroup level steps (`decode_levels_sg.wgsl`) on
    /// a device whose smallest subgroup has `sg_min` lanes, or `None` where they cannot run:
    /// `lse` scoring, g_q at most 8, g a power of two, `sg_min` at least 8 (the rank step's
    /// counting lanes), and g times the lanes (the plan's, lowered to a power of two that fits)
    /// at most `sg_min` and dividing the route's workgroup, so that a candidate's lanes are in
    /// one subgroup.
    pub fn route_subgroup_lanes(&self, sg_min: u32, lse: bool) -> Option<u32> {
        let (g, wr) = (self.mg, self.wr);
        if !(lse && self.gq <= 8 && g.is_power_of_two() && sg_min >= 8 && wr.is_multiple_of(8)) {
            return None;
        }
        let mut lr = 1u32 << (31 - self.lr.max(1).leading_zeros());
        while lr > 1 && (g * lr > sg_min || !wr.is_multiple_of(g * lr)) {
            lr /= 2;
        }
        (g * lr <= sg_min && wr.is_multiple_of(g * lr)).then_some(lr)
    }

    /// The `const` substitutions of the route with its subgroup level steps: [`Self::consts`]
    /// of the route's workgroup with `lr` lanes per row, no level scratch (XR = 1: the subgroup
    /// steps do not use it), SGR = 1 and the smallest subgroup size SGL (up to 32).
    pub fn route_subgroup_consts(&self, lr: u32, sg_min: u32) -> Vec<(&'static str, u32)> {
        let mut consts = self.consts(self.wr).to_vec();
        for c in consts.iter_mut() {
            match c.0 {
                "LR" => c.1 = lr,
                "XR" => c.1 = 1,
                _ => {}
            }
        }
        consts.extend([("SGR", 1), ("SGL", sg_min.min(32))]);
        consts
    }
}

impl Plan {
    /// `route_leaf` (`decode_route_leaf.wgsl`) within workgroup memory `limit`: the leaf slots
    /// each workgroup attends at once (NB: as many `leaf` workgroups of `wg` invocations as
    /// the route's `wr` hold, fewer where memory needs it) and the workgroups per (sequence,
    /// KV head), `(nb, ceil(NS / nb))`; `None` where not even one block fits beside the route.
    /// With `merge`, the same for `route_leaf_merge` ([`Self::route_leaf_merge_smem`]).
    pub fn route_leaf_blocks(&self, limit: u64, merge: bool) -> Option<(u32, u32)> {
        let smem = |nb: u32| match merge {
            true => self.route_leaf_merge_smem(nb),
            false => self.route_leaf_smem(nb),
        };
        let mut nb = (self.wr / self.wg) as u64;
        while nb > 0 && smem(nb as u32) > limit {
            nb -= 1;
        }
        (nb > 0).then(|| (nb as u32, self.slots().div_ceil(nb as u32)))
    }

    /// Workgroup memory of `route_leaf` attending `nb` blocks at once, bytes: the route's, and
    /// `nb` blocks' leaf scratch.
    pub fn route_leaf_smem(&self, nb: u32) -> u64 {
        self.route_smem + nb as u64 * self.leaf_smem
    }

    /// Workgroup memory of `route_leaf_merge` attending `nb` blocks at once, bytes:
    /// `route_leaf`'s and the cut's and merge's (decode_cut.wgsl, decode_merge.wgsl) in a
    /// workgroup of `wr` invocations, and the count of finished copies.
    pub fn route_leaf_merge_smem(&self, nb: u32) -> u64 {
        let (k, maxc) = (self.kmax as u64, self.maxc as u64);
        let merge = self.slots() as u64
            + maxc
            + 3 * k
            + cut_words(self.wr as u64, maxc)
            + merge_words(self.gq as u64, k)
            + 1;
        self.route_leaf_smem(nb) + 4 * merge
    }

    /// Lanes per group of the block attention with subgroup shuffles
    /// (`decode_attend_sg.wgsl`, SGA_G) on a device whose smallest subgroup has `sg_min` lanes,
    /// for blocks of `block` keys, or `None` where it cannot run: the block one chunk (CH = C),
    /// one invocation per (key row, lane) (CH * LK = AW) and per (output vec4, part) (PARTS *
    /// D/4 = AW, PARTS a power of two), at most 16 value rows per invocation, and groups of
    /// min(`sg_min`, 32) lanes (at least 8) holding whole key rows and P.V parts and dividing
    /// the route's workgroup (whose idle tail lanes shuffle too), the groups' (max, sum) pairs
    /// within the leaf scratch. The shader restates these as `const_assert`s.
    pub fn attend_subgroup_lanes(&self, sg_min: u32, block: u32) -> Option<u32> {
        let (aw, ch, lk, parts) = (self.wg, self.ch, self.lk, self.parts);
        let g = sg_min.min(32);
        let ok = g >= 8
            && g.is_power_of_two()
            && ch == block
            && ch * lk == aw
            && parts.is_power_of_two()
            && parts * (self.dd / 4) == aw
            && ch.is_multiple_of(parts)
            && ch / parts <= 16
            && g.is_multiple_of(lk)
            && g.is_multiple_of(parts)
            && aw.is_multiple_of(g)
            && self.wr.is_multiple_of(g)
            && ch * self.gq + 2 * (aw / g) * self.gq <= self.xs;
        ok.then_some(g)
    }

    /// The `const` substitutions of `route_leaf` over the route's (`route`: [`Self::consts`]
    /// of `wr`, or [`Self::route_subgroup_consts`]): AW = `wg` invocations per block, NB.
    pub fn route_leaf_consts(
        &self,
        mut route: Vec<(&'static str, u32)>,
        nb: u32,
    ) -> Vec<(&'static str, u32)> {
        route.extend([("AW", self.wg), ("NB", nb)]);
        route
    }
}

/// Words of the top-K cut's partial rank counts (`decode_cut.wgsl`: `mcnt`) for a workgroup of
/// `wg` invocations: CPM = clamp(wg / MAXC, 1, 8) counts per slot (one word when CPM = 1: the
/// counts are then whole).
pub(super) fn cut_words(wg: u64, maxc: u64) -> u64 {
    let cpm = (wg / maxc).clamp(1, 8);
    if cpm > 1 {
        maxc * cpm + 1
    } else {
        1
    }
}

/// Words of the weighted merge's arrays (`decode_merge.wgsl`, `mml` and `mw`) for g_q `gq` and
/// K `k`: an (m, l) pair and a weight per (head, selection entry), K up to 32.
pub(super) fn merge_words(gq: u64, k: u64) -> u64 {
    3 * gq * k.min(32)
}

/// Whether the pyramid keeps second moments (needed by the `meanvar` scoring only).
pub(super) fn needs_sq(cfg: &SelectionConfig) -> bool {
    cfg.scoring == Scoring::MeanVar
}

/// The largest power of two within the device's invocations per workgroup (and workgroup
/// size in x): the workgroup of every decode kernel is this or less.
pub(super) fn max_workgroup(limits: &wgpu::Limits) -> u64 {
    let max_wg = limits
        .max_compute_invocations_per_workgroup
        .min(limits.max_compute_workgroup_size_x);
    1u64 << (31 - max_wg.max(1).leading_zeros())
}

/// Invocations sharing one row's dot products (route rows, key rows): `start` capped at the
/// row's D/4 vec4s (at least 1), halved while `fits` refuses it, down to 1.
pub(super) fn lanes(start: u64, d4: u64, fits: impl Fn(u64) -> bool) -> u64 {
    let mut n = start.min(d4).max(1);
    while n > 1 && !fits(n) {
        n /= 2;
    }
    n
}

/// The configuration's sizes, as u64: top_k K, block size C, merge factor g, the g(K+1)
/// candidate slots of a level (MAXC) and the leaf slots with the K forced ones (NS).
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub k: u64,
    pub c: u64,
    pub g: u64,
    pub maxc: u64,
    pub ns: u64,
}

impl Dims {
    pub fn of(cfg: &SelectionConfig) -> Self {
        let (k, c, g) = (
            cfg.top_k as u64,
            cfg.block_size as u64,
            cfg.merge_factor as u64,
        );
        let maxc = g * (k + 1);
        Self {
            k,
            c,
            g,
            maxc,
            ns: maxc + k,
        }
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
