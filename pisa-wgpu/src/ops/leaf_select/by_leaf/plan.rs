//! The plan of a leaf-major stage 2 ([`super`]): which scorer, chunk size and subgroups, and
//! whether every buffer, index and workgroup fits the device.

use super::super::{coop::LeafCoopVariant, Plan};
use super::{nv_scorer_for, pick_queries, NvScorer};
use crate::runtime::context::Context;

/// Rows of a portable scoring chunk (entries * GQ), at least one entry.
const PORTABLE_ROWS: u32 = 16;
/// The scorer of a leaf-major stage 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scorer {
    /// `leaf_score.wgsl` (any storage, any adapter).
    Portable,
    /// `leaf_score_coop.wgsl` with the tile kernel's variant constants (f16, tensor cores).
    Coop(LeafCoopVariant),
}

/// Sizes of one leaf-major stage 2.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ByLeaf {
    pub scorer: Scorer,
    /// Candidate entries `B * Hkv * Nq * MC` (count / scatter items).
    pub entries: u64,
    /// Buckets `B * Hkv * nb0`.
    pub buckets: u64,
    /// Entries per scoring chunk.
    pub qpc: u32,
    /// Subgroups of a tensor-core scoring workgroup (the WGSL scorer's).
    pub nsg: u32,
    /// The NVIDIA scorer that runs instead of the WGSL tensor-core one, where the device has
    /// one ([`nv_scorer_for`]); its chunk rows set `qpc`.
    pub nv: Option<NvScorer>,
    /// Whether the context's tuning asks the tensor-core scorer to stage the leaf's keys
    /// ([`crate::Tuning::leaf_stage_keys`]; see [`stage_keys`]).
    pub stage_asked: bool,
}

impl ByLeaf {
    /// Scoring workgroups dispatched: an upper bound on the chunks (each bucket's last chunk
    /// may be partial); those past the real count exit at once.
    pub fn chunk_bound(&self) -> u64 {
        self.entries.div_ceil(self.qpc as u64) + self.buckets
    }

    /// Workgroup bytes of the scorer for GQA group `gq` (mirrors the `var<workgroup>` lists
    /// of `leaf_score.wgsl` and `leaf_score_coop.wgsl`, with the chunk lookup's four words).
    pub fn score_bytes(&self, gq: u32) -> u64 {
        match self.scorer {
            Scorer::Portable => 4 * (4 + self.qpc as u64 + (self.qpc * gq) as u64 * 66),
            Scorer::Coop(v) => coop_bytes(&v, self.nsg),
        }
    }
}

/// The leaf-major plan of a validated selection with this scorer, or `None` when a buffer or
/// an index would not fit, or the scorer's or the pick's workgroup memory would not (the
/// caller then tries another scorer or runs the tile kernel).
pub(crate) fn plan(ctx: &Context, plan: &Plan, scorer: Scorer) -> Option<ByLeaf> {
    let t = ctx.tuning();
    let nv = match scorer {
        Scorer::Coop(v) => nv_scorer_for(ctx, plan, &v),
        Scorer::Portable => None,
    };
    let mut bl = plan_for(
        ctx.limits(),
        ctx.max_binding_bytes(),
        plan,
        scorer,
        t.leaf_subgroups,
        nv,
    )?;
    bl.stage_asked = t.leaf_stage_keys;
    Some(bl)
}

/// [`plan`] for a device with limits `l` and storage bindings of at most `max_binding` bytes,
/// with `nsg` subgroups per WGSL tensor-core scoring workgroup, or the NVIDIA scorer `nv` (its
/// chunk rows; the WGSL scorer's workgroup memory is then not asked for).
fn plan_for(
    l: &wgpu::Limits,
    max_binding: u64,
    plan: &Plan,
    scorer: Scorer,
    nsg: u32,
    nv: Option<NvScorer>,
) -> Option<ByLeaf> {
    let p = &plan.params;
    let entries = plan.bh * p.q_len as u64 * p.mc as u64;
    let buckets = plan.bh * p.nb0 as u64;
    let qpc = match scorer {
        Scorer::Portable => (PORTABLE_ROWS / plan.gq).max(1),
        Scorer::Coop(v) => {
            // SG >= 16: at least one invocation per row in the scalar step.
            // Q (and K, when staged) are read 16 bytes at a time: strides of 8 halves (the
            // WGSL scorer's rule, kept for the NVIDIA one, which reads both by tensor loads).
            let rows = nv.map_or(16 * nsg, |n| n.rows);
            let strides = [p.q_sb, p.q_sh, p.q_sn, p.k_sb, p.k_sh, p.k_sn];
            if v.sg < 16 || plan.gq > rows || strides.iter().any(|s| s % 8 != 0) {
                return None;
            }
            rows / plan.gq
        }
    };
    let bl = ByLeaf {
        scorer,
        entries,
        buckets,
        qpc,
        nsg,
        nv,
        stage_asked: true,
    };
    let pick = pick_bytes(p.mc);
    let fits = |n: u64| n < u32::MAX as u64 && 4 * n <= max_binding;
    let mem = l.max_compute_workgroup_storage_size as u64;
    let shared = if nv.is_some() {
        0
    } else {
        bl.score_bytes(plan.gq)
    };
    let ok =
        fits(entries) && fits(buckets + 1) && fits(4 * bl.chunk_bound()) && shared.max(pick) <= mem;
    ok.then_some(bl)
}

/// Workgroup bytes of the pick (`leaf_pick.wgsl`: three words per entry of its QW queries of
/// `mc` candidates, padded to a multiple of 4).
fn pick_bytes(mc: u32) -> u64 {
    12 * (pick_queries(mc) * mc.next_multiple_of(4)) as u64
}

/// Whether the tensor-core scorer stages the leaf's keys in workgroup memory: by default where
/// the key rows fit in the Q rows' space (CT <= NSG) and K's strides are multiples of 8 halves
/// (its 16-byte loads), unless the tuning says not to (`asked`,
/// [`crate::Tuning::leaf_stage_keys`]): then the key matrices load straight from the storage
/// buffer. On the H200 staging took the scorer from 98 to 76 ms at
/// 64K tokens (each staged key matrix serves the NSG subgroups; docs/benchmarks.md).
pub(crate) fn stage_keys(plan: &Plan, ct: u32, nsg: u32, asked: bool) -> bool {
    let p = &plan.params;
    asked && ct <= nsg && [p.k_sb, p.k_sh, p.k_sn].iter().all(|s| s % 8 == 0)
}

/// Workgroup bytes of `leaf_score_coop.wgsl` (mirrors its `var<workgroup>` list).
fn coop_bytes(v: &LeafCoopVariant, nsg: u32) -> u64 {
    let (rt, wg) = (16 * nsg as u64, (nsg * v.sg) as u64);
    let cw = 16 * v.ct as u64;
    2 * rt * (v.hd as u64 + 8) + 4 * rt * (cw + 4) + 8 * wg + 4 * rt + 16
}

#[cfg(test)]
mod tests {
    use super::super::{
        bucket_consts, pick_consts, score_consts, BUCKET_SHADER, BUCKET_WINDOW, PICK_SHADER,
        SCORE_COOP_SHADER, SCORE_SHADER,
    };
    use super::*;
    use crate::ops::leaf_select::coop;
    use crate::ops::select::SelParams;
    use crate::runtime::pipeline::{
        assert_workgroup_fits, limits_with_memory, Storage, MIN_WORKGROUP_BYTES,
    };
    use pisa_core::{AttentionShape, PyramidLayout, Schedule, SelectionConfig, TensorLayout};

    /// A validated selection of shape `s` and configuration `cfg` (Q and K in `[B, H, N, D]`),
    /// as [`crate::ops::select::plan`] builds it, without tensors.
    fn selection(s: &AttentionShape, cfg: &SelectionConfig, storage: Storage) -> Plan {
        let valid = PyramidLayout::new(s.k_len, cfg.block_size, cfg.merge_factor).unwrap();
        let sched = Schedule::new(&valid, cfg).unwrap();
        let d = s.head_dim;
        let (q_sb, q_sh, q_sn) = TensorLayout::Bhnd.strides(s.q_heads, s.q_len, d);
        let (k_sb, k_sh, k_sn) = TensorLayout::Bhnd.strides(s.kv_heads, s.k_len, d);
        let mut params: SelParams = bytemuck::Zeroable::zeroed();
        [params.q_sb, params.q_sh, params.q_sn] = [q_sb as u32, q_sh as u32, q_sn as u32];
        [params.k_sb, params.k_sh, params.k_sn] = [k_sb as u32, k_sh as u32, k_sn as u32];
        params.q_heads = s.q_heads as u32;
        params.kv_heads = s.kv_heads as u32;
        params.q_len = s.q_len as u32;
        params.k_len = s.k_len as u32;
        params.head_dim = d as u32;
        params.block_size = cfg.block_size as u32;
        params.merge = cfg.merge_factor as u32;
        params.top_k = cfg.top_k as u32;
        params.nb0 = valid.leaves() as u32;
        params.mc = sched.max_candidates as u32;
        Plan {
            params,
            sched,
            shape: *s,
            cfg: *cfg,
            storage,
            bh: (s.batch * s.kv_heads) as u64,
            gq: s.gqa_group() as u32,
        }
    }

    /// The scorers' workgroup variables (naga's sizes, the constants [`super::super::record`]
    /// builds substituted; the tensor-core scorer in f16, keys staged or not) fit what
    /// [`ByLeaf::score_bytes`] charges, and the pick's fit [`pick_bytes`], for the plans
    /// [`plan`] makes: head dims 16 to 128 (30: portable only), GQA groups 1 to 32 (tensor
    /// cores: up to 16), C 16 to 128, K 4 to 64, merge factors 2 to 4, 2 or 4 subgroups of 16
    /// to 64 invocations, at 16 and 48 KiB. The bucket kernels (fixed arrays, not planned) fit
    /// WebGPU's minimum of 16 KiB.
    #[test]
    fn workgroup_bytes_cover_the_shaders() {
        let mut checked = 0;
        let more = [(96, 8, 16, 4, 2), (30, 32, 64, 16, 2)];
        for (d, g, c, k, merge) in coop::tests::ACCOUNTING_CASES.into_iter().chain(more) {
            let shape = AttentionShape::new(1, g, 1, 64, 4096, d).unwrap();
            let cfg = SelectionConfig::new(c, k).unwrap().with_merge_factor(merge);
            for mem in [16u32 << 10, 48 << 10] {
                let lim = limits_with_memory(mem);
                let mut runs = vec![(Scorer::Portable, Storage::F32, 4)];
                runs.push((Scorer::Portable, Storage::F16, 4));
                for sg in [16, 32, 64] {
                    let v = coop::choose(&lim, sg, &shape, &cfg, Storage::F16, 4, 2);
                    for nsg in [2, 4] {
                        runs.extend(v.map(|v| (Scorer::Coop(v), Storage::F16, nsg)));
                    }
                }
                for (scorer, storage, nsg) in runs {
                    let sel = selection(&shape, &cfg, storage);
                    let Some(bl) = plan_for(&lim, 1 << 31, &sel, scorer, nsg, None) else {
                        continue;
                    };
                    checked += 1;
                    let consts = score_consts(&sel, &bl);
                    let (shader, st) = match scorer {
                        Scorer::Portable => (&SCORE_SHADER, storage),
                        Scorer::Coop(_) => (&SCORE_COOP_SHADER, Storage::F16),
                    };
                    // Keys staged (where the plan stages them) and loaded from storage.
                    let unstaged: Vec<_> = consts
                        .iter()
                        .map(|&(n, x)| (n, if n == "KSTAGE" { 0 } else { x }))
                        .collect();
                    let what = format!("{bl:?} at {mem} bytes");
                    let charged = bl.score_bytes(sel.gq);
                    for c in [consts, unstaged] {
                        assert_workgroup_fits(shader, "leaf_score", st, &c, charged, &what);
                    }
                    let mc = sel.params.mc;
                    let (c, charged) = (pick_consts(mc), pick_bytes(mc));
                    assert_workgroup_fits(
                        &PICK_SHADER,
                        "leaf_pick",
                        Storage::F32,
                        &c,
                        charged,
                        &what,
                    );
                    for (entry, pair) in ["count", "scan", "scatter"]
                        .into_iter()
                        .flat_map(|e| [(e, false), (e, true)])
                    {
                        let c = bucket_consts(mc, bl.qpc, false, pair, BUCKET_WINDOW);
                        let min = MIN_WORKGROUP_BYTES;
                        assert_workgroup_fits(&BUCKET_SHADER, entry, Storage::F32, &c, min, &what);
                    }
                }
            }
        }
        assert!(checked >= 50, "only {checked} plans checked");
    }

    /// With an NVIDIA scorer the plan's chunks are its rows ([`super::super::NV_SCORER_ROWS`]),
    /// `128 / g_q` entries, whatever the WGSL scorer's subgroups, and the WGSL scorer's
    /// workgroup memory is not asked for: at 16 KiB, where the WGSL scorer's 64-row plan does
    /// not fit, the NVIDIA one still plans. GQA groups 1, 2, 3, 4, 7, 8, 16.
    #[test]
    fn nvidia_scorer_sets_the_chunk_rows() {
        use super::super::{NV_SCORERS, NV_SCORER_ROWS};
        let nv = NvScorer {
            kernel: NV_SCORERS[2],
            pair: true,
            rows: NV_SCORER_ROWS,
        };
        let wide = limits_with_memory(48 << 10);
        let small = limits_with_memory(16 << 10);
        for g in [1usize, 2, 3, 4, 7, 8, 16] {
            let shape = AttentionShape::new(1, 2 * g, 2, 512, 4096, 128).unwrap();
            let cfg = SelectionConfig::new(64, 16).unwrap();
            let sel = selection(&shape, &cfg, Storage::F16);
            let v = coop::choose(&wide, 32, &shape, &cfg, Storage::F16, 4, 2).unwrap();
            let bl = plan_for(&small, 1 << 31, &sel, Scorer::Coop(v), 4, Some(nv)).unwrap();
            assert_eq!(bl.qpc, NV_SCORER_ROWS / g as u32, "GQA {g}");
            assert!(bl.nv.is_some());
            let wgsl = plan_for(&wide, 1 << 31, &sel, Scorer::Coop(v), 4, None).unwrap();
            assert_eq!(wgsl.qpc, 64 / g as u32, "GQA {g}");
            assert!(plan_for(&small, 1 << 31, &sel, Scorer::Coop(v), 4, None).is_none());
        }
    }
}
