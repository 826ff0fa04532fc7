//! Leaf-major stage 2 of PISA prefill selection (PISA.md 2, 3.3, 3.4 and 5): the stage-1
//! candidates are bucketed by (b, KV head, leaf) and each leaf's raw keys are scored against a
//! chunk of the queries that listed it, so that every row of a matrix multiply is useful work.
//!
//! Why: the tile kernels (stage 2's default on portable adapters) score the union of
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
//!    descriptor of every chunk (bucket, first entry, entries);
//! 4. `leaf_score` (`shaders/leaf_score.wgsl`, or `shaders/leaf_score_coop.wgsl` on tensor
//!    cores, or `shaders/nv/leaf_score.comp` where the NVIDIA kernels run): one workgroup per
//!    chunk, the candidate's exact-LSE score summed over the group, as a ranking key in its own
//!    slot of `scores` `[B, Hkv, Nq, MC]`;
//! 5. `leaf_pick` (`shaders/leaf_pick.wgsl`): the tile kernels' rank-based pick
//!    (`shaders/leaf_common.wgsl`'s rule) over those keys, one invocation per entry, QW queries
//!    per workgroup.
//!
//! With the NVIDIA pair scorer (`nv_scorer_for`, [`crate::Tuning::leaf_score_pairs`]) the
//! buckets are pairs of leaves (2P, 2P + 1), `B * Hkv * ceil(nb0 / 2)` of them: a query that
//! lists both leaves of a pair in adjacent slots (a kept node's two children) is one entry,
//! whose Q rows the scorer reads once for both leaves; steps 1-3 run with `PAIR = 1`.
//!
//! Determinism: the order of entries inside a bucket depends on atomics, but every entry's
//! score is computed from its own rows only and lands in its own slot, so the output is the
//! same bit for bit from run to run.
//!
//! Memory: beside the candidates `[B, Hkv, Nq, MC]` (the input), two buffers of the same size
//! (bucket lists, scores), one of about 4 / QPC of that (chunk descriptors, four words each) and
//! `3 * B * Hkv * nb0 + 2` u32 at most (counts, entry and chunk offsets); `plan` returns `None` when a buffer
//! would pass the binding limit or an index would pass u32.

use bytemuck::{Pod, Zeroable};

use super::coop::LeafCoopVariant;
use super::Plan;
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::nv::{NvBinding, NvKernel};
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

mod plan;

use plan::stage_keys;
pub(crate) use plan::{plan, ByLeaf, Scorer};

/// Entries per `count` and `scatter` workgroup (`leaf_bucket.wgsl`: 256 invocations of EPI
/// entries each).
pub(crate) const BUCKET_TILE: u64 = 256 * 8;

/// Buckets a `count` or `scatter` workgroup adds up in workgroup memory before the global
/// counts (`leaf_bucket.wgsl` WB): 16 KiB, WebGPU's least `maxComputeWorkgroupStorageSize`;
/// fewer where a device offers less ([`bucket_window`]).
pub(crate) const BUCKET_WINDOW: u32 = 4096;

/// The bucketing's bins on `ctx`'s device: [`BUCKET_WINDOW`], or as many 4-byte counters as its
/// workgroup memory holds where that is less (wgpu's downlevel limits give 16352 bytes). Fewer
/// bins change only how many entries take the global counters directly.
pub(crate) fn bucket_window(ctx: &Context) -> u32 {
    bucket_window_for(ctx.limits().max_compute_workgroup_storage_size, false)
}

/// The leaf bins for `limit` bytes of workgroup memory: [`BUCKET_WINDOW`] or fewer; with
/// `attend_pairs` (leaf-major attention's pair buckets, `APAIR`) half as many pair bins follow
/// them, so the leaf bins take two thirds of the memory.
pub(crate) fn bucket_window_for(limit: u32, attend_pairs: bool) -> u32 {
    let per_bin = if attend_pairs { 6 } else { 4 };
    (limit / per_bin).clamp(2, BUCKET_WINDOW)
}

/// The `Buckets` uniform of `leaf_bucket.wgsl` and `leaf_chunk.wgsl`: the dispatch's items
/// (entries, buckets or chunks), the bucket count, and for leaf-major attention
/// ([`crate::ops::attention`]) the query range `i0 .. i0 + nq` of the `heads` (b, KV head)s from
/// `bh0` on.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable)]
pub(crate) struct Buckets {
    pub items: u32,
    pub buckets: u32,
    pub i0: u32,
    pub nq: u32,
    pub bh0: u32,
    /// Leaf-major attention's pair chunk kernel: the first bucket of the kind it runs (its
    /// chunks start at `coff[first]`); 0 elsewhere.
    pub first: u32,
    /// Leaf-major attention: the (b, KV head)s `bh0 .. bh0 + heads` one range covers (its
    /// entries, buckets and merge workgroups are those of one head times `heads`); 0 elsewhere.
    pub heads: u32,
    pub pad: u32,
}

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
/// lookup and the row loads it shares with leaf-major attention (`shaders/leaf_rows_coop.wgsl`).
pub const SCORE_COOP_SHADER: ShaderSource = ShaderSource {
    name: "leaf_score_coop",
    wgsl: concat!(
        include_str!("../../../../shaders/leaf_score_coop.wgsl"),
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_chunk.wgsl"),
        include_str!("../../../../shaders/leaf_rows_coop.wgsl"),
        include_str!("../../../../shaders/coop_qa.wgsl")
    ),
};

/// `shaders/leaf_pick.wgsl` after the selection prelude.
pub const PICK_SHADER: ShaderSource = ShaderSource {
    name: "leaf_pick",
    wgsl: concat!(
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_pick.wgsl")
    ),
};

/// The constants of `leaf_bucket.wgsl` for `mc` slots per query and `qpc` entries per chunk;
/// `attend`: bucketing a block selection for leaf-major attention; `pair`: buckets of leaf
/// pairs, for the NVIDIA pair scorer ([`nv_scorer_for`]; `PAIR`) or, with `attend`, for
/// leaf-major attention over sibling pairs (`APAIR`: pair buckets after the leaf buckets);
/// `window`: the leaf buckets a workgroup adds up in workgroup memory ([`BUCKET_WINDOW`] or
/// [`bucket_window_for`]'s; tests take fewer), and with `APAIR` half as many pair buckets.
pub(crate) fn bucket_consts(
    mc: u32,
    qpc: u32,
    attend: bool,
    pair: bool,
    window: u32,
) -> [(&'static str, u32); 8] {
    let apair = pair && attend;
    [
        ("EPI", (BUCKET_TILE / 256) as u32),
        ("MC", mc),
        ("QPC", qpc),
        ("ATTEND", u32::from(attend)),
        ("PAIR", u32::from(pair && !attend)),
        ("APAIR", u32::from(apair)),
        ("WB", window),
        ("WP", if apair { window / 2 } else { 0 }),
    ]
}

/// The bindings of `shaders/nv/leaf_score.comp` (those of the WGSL tensor-core scorer).
const NV_BINDINGS: &[(u32, NvBinding)] = &[
    (0, NvBinding::Uniform),
    (1, NvBinding::Read),
    (2, NvBinding::Read),
    (7, NvBinding::Read),
    (8, NvBinding::Read),
    (9, NvBinding::Write),
    (10, NvBinding::Uniform),
    (11, NvBinding::Read),
    (12, NvBinding::Read),
];

/// The NVIDIA scorer (`shaders/nv/leaf_score.comp`: [`NV_SCORER_ROWS`] rows of a chunk against
/// the 64 key rows of a leaf, or of each leaf of a pair) of a tensor-core plan (`v`) on a device
/// with `VK_NV_cooperative_matrix2`, where one is built for the head dim (64, 128) and the leaf
/// fits its 64 key rows, and [`Context::nv_scorer`] asks for it (by default: faster on the
/// H200, 83.8 against 116.4 ms at 256K, 2026-12-01); `None` keeps the WGSL scorer. Same scores.
/// With it comes whether it scores pairs of leaves ([`NvScorer::pair`]) and its chunk rows,
/// which the plan ([`plan::plan`]) takes for its chunk size.
pub(crate) fn nv_scorer_for(ctx: &Context, plan: &Plan, v: &LeafCoopVariant) -> Option<NvScorer> {
    if !ctx.nv_cm2() || !ctx.nv_scorer() || plan.params.block_size > 64 {
        return None;
    }
    let (single, paired) = match v.hd {
        128 => ("leaf_score_d128", "leaf_score_pair_d128"),
        64 => ("leaf_score_d64", "leaf_score_pair_d64"),
        _ => return None,
    };
    let rows = NV_SCORER_ROWS;
    if plan.gq > rows {
        return None;
    }
    // The pair buckets' list values i * MC + o carry two flag bits above them. Where the
    // pair kernel is not to be had, the single-leaf one.
    let pair_ok = ctx.tuning().leaf_score_pairs
        && (plan.params.q_len as u64) * (plan.params.mc as u64) < 1 << 30;
    if pair_ok {
        if let Some(kernel) = ctx.nv_kernel_named(&NV_SCORERS, paired) {
            return Some(NvScorer {
                kernel,
                pair: true,
                rows,
            });
        }
    }
    let kernel = ctx.nv_kernel_named(&NV_SCORERS, single)?;
    Some(NvScorer {
        kernel,
        pair: false,
        rows,
    })
}

/// Rows of an NVIDIA scorer's chunk (`RT` of every `leaf_score` variant in
/// `shaders/nv/kernels.txt`; entries of GQ rows each). On the H100 the pair scorer took 43.4
/// against 53.7 ms at 256K tokens with 128 rows and 256 invocations rather than 64 and 128
/// (each leaf's key tiles loaded once per 128 rows; 2026-12-05, docs/benchmarks.md A.57).
pub(crate) const NV_SCORER_ROWS: u32 = 128;

/// An NVIDIA scorer chosen by [`nv_scorer_for`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct NvScorer {
    pub kernel: NvKernel,
    /// Whether it scores buckets of leaf pairs (`leaf_bucket.wgsl` PAIR = 1,
    /// [`crate::Tuning::leaf_score_pairs`]): then `B * Hkv * ceil(nb0 / 2)` buckets.
    pub pair: bool,
    /// Rows of its chunk ([`NV_SCORER_ROWS`]).
    pub rows: u32,
}

/// The embedded NVIDIA scorers (`shaders/nv/kernels.txt`).
pub const NV_SCORERS: [NvKernel; 4] = [
    crate::nv_kernel!("leaf_score_d128", NV_BINDINGS),
    crate::nv_kernel!("leaf_score_d64", NV_BINDINGS),
    crate::nv_kernel!("leaf_score_pair_d128", NV_BINDINGS),
    crate::nv_kernel!("leaf_score_pair_d64", NV_BINDINGS),
];

/// The scorer's constants for the leaf-major stage 2 `bl` of `plan`.
fn score_consts(plan: &Plan, bl: &ByLeaf) -> Vec<(&'static str, u32)> {
    let mc = plan.params.mc;
    match bl.scorer {
        Scorer::Portable => vec![("GQ", plan.gq), ("QPC", bl.qpc), ("MC", mc)],
        Scorer::Coop(v) => vec![
            ("GQ", v.gq),
            ("QPC", bl.qpc),
            ("MC", mc),
            ("HD", v.hd),
            ("CT", v.ct),
            ("SG", v.sg),
            ("NSG", bl.nsg),
            (
                "KSTAGE",
                u32::from(stage_keys(plan, v.ct, bl.nsg, bl.stage_asked)),
            ),
        ],
    }
}

/// Invocations of a pick workgroup (`leaf_pick.wgsl`'s WG).
const PICK_WG: u32 = 256;

/// Queries per pick workgroup for `mc` slots per query (one invocation per slot, the slots
/// padded to a multiple of 4 as `leaf_pick.wgsl` packs them).
pub(crate) fn pick_queries(mc: u32) -> u32 {
    (PICK_WG / mc.max(1).next_multiple_of(4)).max(1)
}

/// The pick's constants for `mc` slots per query.
fn pick_consts(mc: u32) -> [(&'static str, u32); 2] {
    [("MC", mc), ("QW", pick_queries(mc))]
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
    let nv = bl.nv;
    let pair = nv.as_ref().is_some_and(|n| n.pair);
    let n_entries = bl.entries as usize;
    // Pair buckets: ceil(nb0 / 2) per (b, KV head), at most the leaf buckets of the plan.
    let buckets = if pair {
        plan.bh * (plan.params.nb0 as u64).div_ceil(2)
    } else {
        bl.buckets
    };
    let n_chunks = bl.chunk_bound();
    let lists = record_buckets(
        ctx,
        enc,
        &plan.params,
        cand,
        BucketSizes {
            entries: bl.entries,
            buckets,
            chunks: n_chunks,
            qpc: bl.qpc,
            pair,
            window: bucket_window(ctx),
            stats: false,
        },
        &mut prof,
    )?;
    let scores = ctx.scratch("leaf scores", n_entries, Storage::F32)?;
    let sel_len = plan.sched.selection_len(&plan.shape);
    let sel = ctx.alloc("selection", sel_len, Storage::F32, POISON_I32)?;
    let params = ctx.uniform("leaf_select params", &plan.params)?;
    let pipe =
        |shader: &ShaderSource, entry: &'static str, storage: Storage, consts: &[(&str, u32)]| {
            ctx.pipelines
                .get(&ctx.device, shader, entry, storage, consts, &[])
        };
    let (co, l) = (&lists.coff.buffer, &lists.list.buffer);

    // 4: score every chunk.
    let u_chunks = ctx.uniform(
        "leaf buckets",
        &Buckets {
            items: n_chunks as u32,
            buckets: buckets as u32,
            ..Default::default()
        },
    )?;
    let consts = score_consts(plan, bl);
    let score = match (bl.scorer, nv) {
        (Scorer::Portable, _) => pipe(&SCORE_SHADER, "leaf_score", plan.storage, &consts)?,
        (Scorer::Coop(_), Some(nv)) => ctx.nv_pipeline(&nv.kernel)?.0,
        (Scorer::Coop(_), None) => pipe(&SCORE_COOP_SHADER, "leaf_score", Storage::F16, &consts)?,
    };
    let b: [(u32, Bind<'_>); 8] = [
        (0, (&params).into()),
        (1, q.into()),
        (2, k.into()),
        (7, co.into()),
        (8, l.into()),
        (9, (&scores.buffer).into()),
        (10, (&u_chunks).into()),
        (11, (&lists.cdesc.buffer).into()),
    ];
    let mut b = b.to_vec();
    if matches!(bl.scorer, Scorer::Coop(_)) {
        b.push((12, k.into()));
    }
    ctx.dispatch(enc, &score, &b, n_chunks, timer(&mut prof, "leaf_score"))?;

    // 5: the pick, QW queries per workgroup.
    let tiled = plan.tiled(pick_queries(mc));
    let u_pick = ctx.uniform("leaf_pick params", &tiled)?;
    let pick = pipe(&PICK_SHADER, "leaf_pick", Storage::F32, &pick_consts(mc))?;
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

/// The sizes of one bucketing ([`record_buckets`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BucketSizes {
    /// Candidate entries `B * Hkv * Nq * MC` (count / scatter items).
    pub entries: u64,
    /// Buckets: `B * Hkv * nb0`, or `B * Hkv * ceil(nb0 / 2)` with `pair`.
    pub buckets: u64,
    /// Chunk descriptors allocated (an upper bound: [`ByLeaf::chunk_bound`]).
    pub chunks: u64,
    /// Entries per chunk.
    pub qpc: u32,
    /// Buckets of leaf pairs (`leaf_bucket.wgsl` PAIR = 1).
    pub pair: bool,
    /// Buckets a workgroup adds up in workgroup memory ([`BUCKET_WINDOW`]).
    pub window: u32,
    /// Tests: `count` also counts the entries that take the global counters directly, in one
    /// more word of the counts (`leaf_bucket.wgsl` STATS).
    pub stats: bool,
}

/// The bucket lists of steps 1-3 (`leaf_bucket.wgsl`): per bucket, its first entry (`off`) and
/// first chunk (`coff`), both `buckets + 1` long; the entries (`list`); the chunk descriptors
/// (`cdesc`, four words each); the counts (`cnt`, back to zero after the scatter).
pub(crate) struct BucketLists {
    #[cfg_attr(not(test), allow(dead_code))]
    pub cnt: GpuTensor,
    #[cfg_attr(not(test), allow(dead_code))]
    pub off: GpuTensor,
    pub coff: GpuTensor,
    pub list: GpuTensor,
    pub cdesc: GpuTensor,
}

/// Records steps 1-3 (count, scan, scatter) over the candidates `cand` (`[B, Hkv, Nq, MC]`)
/// of a selection with parameters `params`. Errors: those of allocation and dispatch.
pub(crate) fn record_buckets(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    params: &crate::ops::select::SelParams,
    cand: &GpuTensor,
    z: BucketSizes,
    prof: &mut Option<&mut Profiler>,
) -> Result<BucketLists> {
    let n_buckets = z.buckets as usize;
    let cnt = ctx.alloc(
        "leaf bucket counts",
        n_buckets + usize::from(z.stats),
        Storage::F32,
        0,
    )?;
    let poisoned = |label| ctx.alloc(label, n_buckets + 1, Storage::F32, POISON_I32);
    let off = poisoned("leaf bucket offsets")?;
    let coff = poisoned("leaf bucket chunks")?;
    // Written before read: the lists and chunk descriptors (scatter).
    let list = ctx.scratch("leaf bucket lists", z.entries as usize, Storage::F32)?;
    // One (bucket, first entry, entries, 0) descriptor per chunk (leaf_chunk.wgsl).
    let cdesc = ctx.scratch("leaf chunks", 4 * z.chunks as usize, Storage::F32)?;
    let mc = params.mc;
    let params = ctx.uniform("leaf_select params", params)?;
    let uniform = |items: u64| {
        ctx.uniform(
            "leaf buckets",
            &Buckets {
                items: items as u32,
                buckets: z.buckets as u32,
                ..Default::default()
            },
        )
    };
    let mut consts = bucket_consts(mc, z.qpc, false, z.pair, z.window).to_vec();
    if z.stats {
        consts.push(("STATS", 1));
    }
    let pipe = |entry: &'static str| {
        ctx.pipelines.get(
            &ctx.device,
            &BUCKET_SHADER,
            entry,
            Storage::F32,
            &consts,
            &[],
        )
    };
    let u_entries = uniform(z.entries)?;
    let (c, o, co, l) = (&cnt.buffer, &off.buffer, &coff.buffer, &list.buffer);
    let b = [(0, &params), (3, &cand.buffer), (5, c), (10, &u_entries)];
    let groups = z.entries.div_ceil(BUCKET_TILE);
    ctx.dispatch(
        enc,
        &*pipe("count")?,
        &b,
        groups,
        timer(prof, "leaf_bucket"),
    )?;
    let u_buckets = uniform(z.buckets)?;
    let b = [(5, c), (6, o), (7, co), (10, &u_buckets)];
    ctx.dispatch(enc, &*pipe("scan")?, &b, 1, timer(prof, "leaf_bucket"))?;
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
        &*pipe("scatter")?,
        &b,
        groups,
        timer(prof, "leaf_bucket"),
    )?;
    Ok(BucketLists {
        cnt,
        off,
        coff,
        list,
        cdesc,
    })
}

#[cfg(test)]
mod tests;

/// The profiler slot of one of the stage's dispatches, labelled `label`.
fn timer<'a>(
    prof: &'a mut Option<&mut Profiler>,
    label: &'static str,
) -> Option<(&'a mut Profiler, &'static str)> {
    prof.as_deref_mut().map(|p| (p, label))
}
