//! The plan of a leaf-major stage 2 ([`super`]): which scorer, chunk size and subgroups, and
//! whether every buffer, index and workgroup fits the device.

use super::super::{common_bytes, coop::LeafCoopVariant, Plan};
use crate::runtime::context::{Context, COOP_SUBGROUPS};
use crate::runtime::pipeline::env_u32;

/// Rows of a portable scoring chunk (entries * GQ), at least one entry.
const PORTABLE_ROWS: u32 = 16;
/// Subgroups (16-row tiles) of a tensor-core scoring workgroup: `PISA_LEAF_NSG` (2 or 4, a
/// tuning knob) or [`COOP_SUBGROUPS`].
fn coop_subgroups() -> u32 {
    env_u32("PISA_LEAF_NSG")
        .filter(|n| [2, 4].contains(n))
        .unwrap_or(COOP_SUBGROUPS)
}

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
    /// Subgroups of a tensor-core scoring workgroup.
    pub nsg: u32,
}

impl ByLeaf {
    /// Scoring workgroups dispatched: an upper bound on the chunks (each bucket's last chunk
    /// may be partial); those past the real count exit at once.
    pub fn chunk_bound(&self) -> u64 {
        self.entries.div_ceil(self.qpc as u64) + self.buckets
    }
}

/// The leaf-major plan of a validated selection with this scorer, or `None` when a buffer or
/// an index would not fit, or the scorer's or the pick's workgroup memory would not (the
/// caller then tries another scorer or runs the tile kernel).
pub(crate) fn plan(ctx: &Context, plan: &Plan, scorer: Scorer) -> Option<ByLeaf> {
    let p = &plan.params;
    let entries = plan.bh * p.q_len as u64 * p.mc as u64;
    let nsg = coop_subgroups();
    let buckets = plan.bh * p.nb0 as u64;
    let qpc = match scorer {
        Scorer::Portable => (PORTABLE_ROWS / plan.gq).max(1),
        Scorer::Coop(v) => {
            // SG >= 16: at least one invocation per row in the scalar step.
            // Q (and K, when staged) are read 16 bytes at a time: strides of 8 halves.
            let rows = 16 * nsg;
            let strides = [p.q_sb, p.q_sh, p.q_sn, p.k_sb, p.k_sh, p.k_sn];
            if v.sg < 16 || plan.gq > rows || strides.iter().any(|s| s % 8 != 0) {
                return None;
            }
            rows / plan.gq
        }
    };
    let chunks = entries.div_ceil(qpc as u64) + buckets;
    let pick = common_bytes(1, p.mc);
    let fits = |n: u64| n < u32::MAX as u64 && 4 * n <= ctx.max_binding_bytes();
    let mem = ctx.limits().max_compute_workgroup_storage_size as u64;
    let shared = match scorer {
        Scorer::Portable => 4 * (4 + qpc as u64 + (qpc * plan.gq) as u64 * 66),
        Scorer::Coop(v) => coop_bytes(&v, nsg),
    };
    let ok = fits(entries) && fits(buckets + 1) && fits(chunks) && shared.max(pick) <= mem;
    ok.then_some(ByLeaf {
        scorer,
        entries,
        buckets,
        qpc,
        nsg,
    })
}

/// Whether the tensor-core scorer stages the leaf's keys in workgroup memory: by default where
/// the key rows fit in the Q rows' space (CT <= NSG) and K's strides are multiples of 8 halves
/// (its 16-byte loads); `PISA_LEAF_KSTAGE=0` (a tuning knob) loads the key matrices straight
/// from the storage buffer instead. On the H200 staging took the scorer from 98 to 76 ms at
/// 64K tokens (each staged key matrix serves the NSG subgroups; docs/benchmarks.md).
pub(crate) fn stage_keys(plan: &Plan, ct: u32, nsg: u32) -> bool {
    let p = &plan.params;
    env_u32("PISA_LEAF_KSTAGE") != Some(0)
        && ct <= nsg
        && [p.k_sb, p.k_sh, p.k_sn].iter().all(|s| s % 8 == 0)
}

/// Workgroup bytes of `leaf_score_coop.wgsl` (mirrors its `var<workgroup>` list).
fn coop_bytes(v: &LeafCoopVariant, nsg: u32) -> u64 {
    let (rt, wg) = (16 * nsg as u64, (nsg * v.sg) as u64);
    let cw = 16 * v.ct as u64;
    2 * rt * (v.hd as u64 + 8) + 4 * rt * (cw + 4) + 8 * wg + 4 * rt + 16
}
