//! Leaf-major stage 2 of PISA prefill selection (PISA.md 2, 3.3, 3.4 and 5): the stage-1
//! candidates are bucketed by (b, KV head, leaf) and each leaf's raw keys are scored against a
//! chunk of the queries that listed it, so that every row of a matrix multiply is useful work.
//!
//! Why: the tile kernels ([`super::record`]'s default on portable adapters) score the union of
//! Qtile consecutive queries' candidates for every query of the tile. Where those lists are
//! disjoint (random inputs; little locality) that is up to Qtile times the useful work, and
//! every query tile reads its leaves' keys again. Here a leaf's keys are read once per chunk of
//! up to QPC of its queries.
//!
//! Five dispatches, timed as profiler stages "leaf_bucket" (1-3), "leaf_score" (4) and
//! "leaf_pick" (5):
//! 1. `count` (`shaders/leaf_bucket.wgsl`): entries per bucket (atomics);
//! 2. `scan`: first entry and first chunk of every bucket (one workgroup);
//! 3. `scatter`: the bucket lists of entries `i * MC + o` (query, candidate slot) and the
//!    bucket of every chunk;
//! 4. `leaf_score` (`shaders/leaf_score.wgsl`, or `shaders/leaf_score_coop.wgsl` on tensor
//!    cores): one workgroup per chunk, the candidate's exact-LSE score summed over the group,
//!    as a ranking key in its own slot of `scores` `[B, Hkv, Nq, MC]`;
//! 5. `leaf_pick` (`shaders/leaf_pick.wgsl`): the tile kernels' union and rank-based pick
//!    (`shaders/leaf_common.wgsl`) over those keys, one workgroup per query.
//!
//! Determinism: the order of entries inside a bucket depends on atomics, but every entry's
//! score is computed from its own rows only and lands in its own slot, so the output is the
//! same bit for bit from run to run.
//!
//! Memory: three buffers of `B * Hkv * Nq * MC` u32 (candidates, lists, scores), one of about
//! a QPC-th of that (chunk buckets), plus `3 * (B * Hkv * nb0 + 1)` u32; [`plan`] returns `None` (the caller runs the tile kernel) when
//! a buffer would pass the binding limit or an index would pass u32.

use bytemuck::{Pod, Zeroable};

use super::coop::LeafCoopVariant;
use super::Plan;
use crate::error::Result;
use crate::runtime::buffers::{GpuTensor, POISON_F32, POISON_I32};
use crate::runtime::context::{Context, COOP_SUBGROUPS};
use crate::runtime::pipeline::{env_u32, ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/leaf_bucket.wgsl`: `count`, `scan`, `scatter`.
pub const BUCKET_SHADER: ShaderSource = ShaderSource {
    name: "leaf_bucket",
    wgsl: concat!(
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_bucket.wgsl")
    ),
};

/// `shaders/leaf_score.wgsl` (portable scorer) with the chunk lookup.
pub const SCORE_SHADER: ShaderSource = ShaderSource {
    name: "leaf_score",
    wgsl: concat!(
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_score.wgsl"),
        include_str!("../../../../shaders/leaf_chunk.wgsl")
    ),
};

/// `shaders/leaf_score_coop.wgsl` (tensor-core scorer; its `enable` first) with the chunk
/// lookup.
pub const SCORE_COOP_SHADER: ShaderSource = ShaderSource {
    name: "leaf_score_coop",
    wgsl: concat!(
        include_str!("../../../../shaders/leaf_score_coop.wgsl"),
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_chunk.wgsl")
    ),
};

/// `shaders/leaf_pick.wgsl` with the union and pick of `shaders/leaf_common.wgsl`.
pub const PICK_SHADER: ShaderSource = ShaderSource {
    name: "leaf_pick",
    wgsl: concat!(
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_pick.wgsl"),
        include_str!("../../../../shaders/leaf_common.wgsl")
    ),
};

/// Invocations of `count` and `scatter` workgroups (the shader's `@workgroup_size`).
const BUCKET_WG: u64 = 256;
/// Rows of a portable scoring chunk (entries * GQ), at least one entry.
const PORTABLE_ROWS: u32 = 16;
/// Subgroups (16-row tiles) of a tensor-core scoring workgroup: `PISA_LEAF_NSG` (2 or 4, a
/// tuning knob) or [`COOP_SUBGROUPS`].
fn coop_subgroups() -> u32 {
    env_u32("PISA_LEAF_NSG")
        .filter(|n| [2, 4].contains(n))
        .unwrap_or(COOP_SUBGROUPS)
}

/// The `Buckets` uniform of the shaders.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
struct Buckets {
    items: u32,
    buckets: u32,
    pad: [u32; 2],
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
    scorer: Scorer,
    /// Candidate entries `B * Hkv * Nq * MC` (count / scatter items).
    entries: u64,
    /// Buckets `B * Hkv * nb0`.
    buckets: u64,
    /// Entries per scoring chunk.
    qpc: u32,
    /// Subgroups of a tensor-core scoring workgroup.
    nsg: u32,
}

/// The leaf-major plan of a validated selection with this scorer, or `None` when a buffer or
/// an index would not fit (the caller then runs the tile kernel).
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
    let fits = |n: u64| n < u32::MAX as u64 && 4 * n <= ctx.max_binding_bytes();
    let mem = ctx.limits().max_compute_workgroup_storage_size as u64;
    let shared = match scorer {
        Scorer::Portable => 4 * (4 + qpc as u64 + (qpc * plan.gq) as u64 * 66),
        Scorer::Coop(v) => coop_bytes(&v, nsg),
    };
    (fits(entries) && fits(buckets + 1) && fits(chunks) && shared <= mem).then_some(ByLeaf {
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
fn stage_keys(plan: &Plan, ct: u32, nsg: u32) -> bool {
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

/// Records the leaf-major stage 2 `bl` over the candidates `cand` (`[B, Hkv, Nq, MC]` from
/// [`crate::ops::route`]) and returns the selection `[B, Hkv, Nq, K]` i32, ascending, -1
/// padded; equal to the tile kernels' up to near-ties. Errors: [`crate::GpuError::Limit`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    plan: &Plan,
    q: &GpuTensor,
    k: &GpuTensor,
    cand: &GpuTensor,
    bl: &ByLeaf,
    mut prof: Option<&mut Profiler>,
) -> Result<GpuTensor> {
    let mc = plan.params.mc;
    let n_entries = bl.entries as usize;
    let n_buckets = bl.buckets as usize;
    let cnt = ctx.alloc("leaf bucket counts", n_buckets, Storage::F32, 0)?;
    let off = ctx.alloc(
        "leaf bucket offsets",
        n_buckets + 1,
        Storage::F32,
        POISON_I32,
    )?;
    let coff = ctx.alloc(
        "leaf bucket chunks",
        n_buckets + 1,
        Storage::F32,
        POISON_I32,
    )?;
    let list = ctx.alloc("leaf bucket lists", n_entries, Storage::F32, POISON_I32)?;
    let n_chunks = bl.entries.div_ceil(bl.qpc as u64) + bl.buckets;
    let cdesc = ctx.alloc("leaf chunks", n_chunks as usize, Storage::F32, POISON_I32)?;
    let scores = ctx.alloc("leaf scores", n_entries, Storage::F32, POISON_F32)?;
    let sel_len = plan.sched.selection_len(&plan.shape);
    let sel = ctx.alloc("selection", sel_len, Storage::F32, POISON_I32)?;
    let params = ctx.uniform("leaf_select params", &plan.params)?;
    let uniform = |items: u64| {
        ctx.uniform(
            "leaf buckets",
            &Buckets {
                items: items as u32,
                buckets: bl.buckets as u32,
                pad: [0; 2],
            },
        )
    };
    let bucket_consts = [("MC", mc), ("QPC", bl.qpc)];
    let pipe =
        |shader: &ShaderSource, entry: &'static str, storage: Storage, consts: &[(&str, u32)]| {
            ctx.pipelines
                .get(&ctx.device, shader, entry, storage, consts, &[])
        };

    // 1-3: count, scan, scatter.
    let u_entries = uniform(bl.entries)?;
    let (c, o, co, l) = (&cnt.buffer, &off.buffer, &coff.buffer, &list.buffer);
    let count = pipe(&BUCKET_SHADER, "count", Storage::F32, &bucket_consts)?;
    let b = [(0, &params), (3, &cand.buffer), (5, c), (10, &u_entries)];
    ctx.dispatch(
        enc,
        &count,
        &b,
        bl.entries.div_ceil(BUCKET_WG),
        timer(&mut prof, "leaf_bucket"),
    )?;
    let u_buckets = uniform(bl.buckets)?;
    let scan = pipe(&BUCKET_SHADER, "scan", Storage::F32, &bucket_consts)?;
    let b = [(5, c), (6, o), (7, co), (10, &u_buckets)];
    ctx.dispatch(enc, &scan, &b, 1, timer(&mut prof, "leaf_bucket"))?;
    let scatter = pipe(&BUCKET_SHADER, "scatter", Storage::F32, &bucket_consts)?;
    let b = [
        (0, &params),
        (3, &cand.buffer),
        (5, c),
        (6, o),
        (7, co),
        (8, l),
        (10, &u_entries),
        (11, &cdesc.buffer),
    ];
    ctx.dispatch(
        enc,
        &scatter,
        &b,
        bl.entries.div_ceil(BUCKET_WG),
        timer(&mut prof, "leaf_bucket"),
    )?;

    // 4: score every chunk.
    let u_chunks = uniform(n_chunks)?;
    let score = match bl.scorer {
        Scorer::Portable => {
            let consts = [("GQ", plan.gq), ("QPC", bl.qpc), ("MC", mc)];
            pipe(&SCORE_SHADER, "leaf_score", plan.storage, &consts)?
        }
        Scorer::Coop(v) => {
            let consts = [
                ("GQ", v.gq),
                ("QPC", bl.qpc),
                ("MC", mc),
                ("HD", v.hd),
                ("CT", v.ct),
                ("SG", v.sg),
                ("NSG", bl.nsg),
                ("KSTAGE", u32::from(stage_keys(plan, v.ct, bl.nsg))),
            ];
            pipe(&SCORE_COOP_SHADER, "leaf_score", Storage::F16, &consts)?
        }
    };
    let b = [
        (0, &params),
        (1, &q.buffer),
        (2, &k.buffer),
        (6, o),
        (7, co),
        (8, l),
        (9, &scores.buffer),
        (10, &u_chunks),
        (11, &cdesc.buffer),
    ];
    let mut b = b.to_vec();
    if matches!(bl.scorer, Scorer::Coop(_)) {
        b.push((12, &k.buffer));
    }
    ctx.dispatch(enc, &score, &b, n_chunks, timer(&mut prof, "leaf_score"))?;

    // 5: the pick, one query per workgroup.
    let tiled = plan.tiled(1);
    let u_pick = ctx.uniform("leaf_pick params", &tiled)?;
    let pick = pipe(&PICK_SHADER, "leaf_pick", Storage::F32, &[("MC", mc)])?;
    let b = [
        (0, &u_pick),
        (3, &cand.buffer),
        (4, &sel.buffer),
        (9, &scores.buffer),
    ];
    ctx.dispatch(
        enc,
        &pick,
        &b,
        tiled.wg_count as u64,
        timer(&mut prof, "leaf_pick"),
    )?;
    Ok(sel)
}

/// The profiler slot of one of the stage's dispatches, labelled `label`.
fn timer<'a>(
    prof: &'a mut Option<&mut Profiler>,
    label: &'static str,
) -> Option<(&'a mut Profiler, &'static str)> {
    prof.as_deref_mut().map(|p| (p, label))
}
