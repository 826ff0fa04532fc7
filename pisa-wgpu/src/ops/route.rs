//! Stage 1 of PISA prefill selection (PISA.md sections 3 and 5): routes every query through the
//! intermediate pyramid levels and writes its leaf candidates; shader `shaders/route.wgsl`.
//!
//! The top levels can come from a routing table instead ([`Tuning::route_table_nodes`]): the
//! score of every node of those levels for every query, computed for tiles of queries as matrix
//! products (`shaders/nv/route_table.comp` on NVIDIA tensor cores; `shaders/route_table.wgsl`,
//! scalar, on any device when asked), which the routing kernel looks up. Each query routes
//! through its few candidates per level, reading each candidate's rows from memory; the table
//! reads each row once per tile of queries, so its levels cost matrix products instead of row
//! loads. The table holds every node of the levels it covers, so it covers the top levels
//! only, and the table and the routing run in chunks of queries that keep the table small.
//!
//! Two routing kernels share `shaders/route.wgsl`: where the device has subgroups (and the
//! selection allows, [`Tuning::route_subgroups`]), each query's lanes hold its heads in
//! registers and sum their dot products by subgroup shuffles (SG = 1, [`SG_SHADER`], a fixed
//! workgroup shape); elsewhere the score tasks go through workgroup memory, with the shape
//! `choose_shape` sizes from the tuning's lanes, tile and workgroup limit.
//!
//! [`Tuning::route_table_nodes`]: crate::Tuning::route_table_nodes
//! [`Tuning::route_subgroups`]: crate::Tuning::route_subgroups

use super::pyramid::GpuPyramid;
use super::select::{Plan, SelParams};
use bytemuck::{Pod, Zeroable};

use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::nv::{NvBinding, NvKernel};
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/route.wgsl` (its subgroup score step left out: `shaders/route_nosg.wgsl`).
pub const SHADER: ShaderSource = ShaderSource {
    name: "route",
    wgsl: concat!(
        include_str!("../../../shaders/select_common.wgsl"),
        include_str!("../../../shaders/route_chunk.wgsl"),
        include_str!("../../../shaders/route.wgsl"),
        include_str!("../../../shaders/route_nosg.wgsl")
    ),
};

/// `shaders/route.wgsl` with its subgroup score step (SG = 1, `shaders/route_sg.wgsl`), for
/// devices with `Features::SUBGROUP` (`subgroup_shape`). (No `enable subgroups`: naga of
/// wgpu 30 refuses the directive and takes the subgroup builtins where the device has the
/// feature.)
pub const SG_SHADER: ShaderSource = ShaderSource {
    name: "route_sg",
    wgsl: concat!(
        include_str!("../../../shaders/select_common.wgsl"),
        include_str!("../../../shaders/route_chunk.wgsl"),
        include_str!("../../../shaders/route.wgsl"),
        include_str!("../../../shaders/route_sg.wgsl")
    ),
};

/// Most lanes per head group of the subgroup score step (8 measured fastest on the H200 for
/// GQ 4: 63.5 ms at 256K against 71.7 with 4 and 74.0 with 16; with the transposed lane sums
/// of `route_sg.wgsl` `score_lanes`, 54.4 against 59.2 with 16, 2026-12-02,
/// docs/benchmarks.md A.16).
const SG_LANES: u32 = 8;
/// Invocations of a subgroup routing workgroup (WebGPU's minimum limit is 256).
const SG_WG: u32 = 256;
/// Most query heads per KV head of the subgroup score step (four head groups).
const SG_MAX_GQ: u32 = 16;

/// The workgroup shape of the subgroup score step (route.wgsl SG = 1) for a selection of GQA
/// group `gq`, head dim `d`, scoring `scoring` (0: `lse`) where the context runs it, or `None`
/// (the kernel then scores through workgroup memory). It runs where
/// [`crate::Tuning::route_subgroups`] asks, the device has `Features::SUBGROUP`, the scoring
/// is `lse`, `gq` is at most [`SG_MAX_GQ`], and a query's lanes fit [`Context::shuffle_lanes`]
/// (the smallest subgroup; on llvmpipe at most 16): its
/// head groups rounded up to a power of two (`GQ4P`) times the lanes per group, at most
/// [`SG_LANES`] and at least 2 (each lane holds D / (4 lanes) vec4 of each of its 4 heads), with
/// D a multiple of 4 lanes, and the workgroup memory fits.
fn subgroup_shape(ctx: &Context, plan: &Plan) -> Option<Shape> {
    let p = &plan.params;
    let (gq, d, mc, g, scoring) = (plan.gq, p.head_dim, p.mc, p.merge, p.scoring);
    let lim = ctx.limits();
    let sg_max = ctx.report().subgroup_size.1;
    let groups = sg_groups(gq);
    let lanes = sg_lanes(ctx.shuffle_lanes() / groups, d);
    let ok = ctx.tuning().route_subgroups
        && ctx.features().contains(wgpu::Features::SUBGROUP)
        && scoring == 0
        && gq <= SG_MAX_GQ
        && lanes >= 2
        && lanes.is_power_of_two()
        && sg_max <= SG_WG
        && d.is_multiple_of(4 * lanes)
        && lim.max_compute_invocations_per_workgroup >= SG_WG
        && lim.max_compute_workgroup_size_x >= SG_WG;
    if !ok {
        return None;
    }
    let s = sg_shape(lanes, groups);
    let fits = wg_bytes(s.tile, s.lanes, gq, d, mc, g, 0, true)
        <= lim.max_compute_workgroup_storage_size as u64;
    // An invocation loops over every candidate of every level: within a loop limit (llvmpipe)
    // only if the count stays below it; else the workgroup-memory kernel, one task each.
    let n = sg_iterations(s, p.start_level, mc, g, d, groups);
    let loops_ok = ctx.loop_limit().is_none_or(|limit| n <= limit);
    (fits && loops_ok).then_some(s)
}

/// Lanes per head group of the subgroup score step: the most, a power of two, of at most
/// [`SG_LANES`] and `room` (the smallest subgroup size divided by the query's head groups) whose vec4s
/// divide the head dim `d` (4 lanes x vec4 must divide D); 0 or 1 where none (D not a multiple
/// of 8, or no room for 2).
fn sg_lanes(room: u32, d: u32) -> u32 {
    let mut lanes = SG_LANES.min(room.max(1)).next_power_of_two();
    if lanes > SG_LANES.min(room) {
        lanes /= 2;
    }
    while lanes > 1 && !d.is_multiple_of(4 * lanes) {
        lanes /= 2;
    }
    lanes
}

/// Head groups of 4 per query of the subgroup score step for GQA group `gq`, rounded up to a
/// power of two (the shader's GQ4P).
fn sg_groups(gq: u32) -> u32 {
    gq.div_ceil(4).next_power_of_two()
}

/// The subgroup score step's workgroup: [`SG_WG`] invocations, `lanes` per head group and
/// `groups` head groups per query.
fn sg_shape(lanes: u32, groups: u32) -> Shape {
    Shape {
        tile: SG_WG / (lanes * groups),
        lanes,
        wg: SG_WG,
    }
}

/// Loop iterations of one invocation of the subgroup routing kernel (an upper bound, counting
/// every loop of route.wgsl and route_sg.wgsl it runs) for `levels` intermediate levels, `mc`
/// candidate slots, merge factor `g`, head dim `d` and `groups` head groups per query (a
/// power of two).
fn sg_iterations(s: Shape, levels: u32, mc: u32, g: u32, d: u32, groups: u32) -> u64 {
    let (mc, g, levels) = (mc as u64, g as u64, levels as u64);
    let lanes = s.lanes as u64;
    let qd = (d as u64).div_ceil(4).div_ceil(lanes);
    let log2 = |x: u64| 64 - u64::from(x.leading_zeros()) - 1;
    // Per candidate: the sums' zeroing, the head dims' vec4s by child, the lane butterflies by
    // child, score_lse (the children's logs, 4 heads by children), the group butterfly.
    let per_candidate =
        g + qd * (1 + g) + g * (1 + log2(lanes)) + g + 4 * (1 + g) + log2(groups as u64 + 1) + 2;
    // The workgroup's strided loops over the tile's slots, with the keep step's rank loop and
    // the expand step's "kept before" loop and children.
    let strided = (s.tile as u64 * mc).div_ceil(s.wg as u64);
    let mc4 = mc.div_ceil(4);
    let per_level = mc * per_candidate + strided * (3 + 2 * mc4 + g) + g;
    // The query registers, the start and final strided loops, then the levels.
    4 * (qd + 1) + 2 * strided + levels * (per_level + 1)
}

/// `shaders/route_table.wgsl`, the portable table kernel.
pub const TABLE_SHADER: ShaderSource = ShaderSource {
    name: "route_table",
    wgsl: concat!(
        include_str!("../../../shaders/select_common.wgsl"),
        include_str!("../../../shaders/route_chunk.wgsl"),
        include_str!("../../../shaders/route_table.wgsl")
    ),
};

/// Invocations of a portable table workgroup (`route_table.wgsl`'s WG), one per entry.
const TABLE_WG: u32 = 64;

/// Rows (query heads of a tile of queries) of an NVIDIA table workgroup (the kernel's RT).
const NV_TABLE_ROWS: u32 = 64;
/// Child rows of an NVIDIA table kernel's matrix products (the kernel's CW).
const NV_TABLE_COLS: u32 = 32;

/// The bindings of `shaders/nv/route_table.comp`.
const NV_TABLE_BINDINGS: &[(u32, NvBinding)] = &[
    (0, NvBinding::Uniform),
    (1, NvBinding::Read),
    (2, NvBinding::Read),
    (3, NvBinding::Write),
    (4, NvBinding::Uniform),
];

/// The embedded NVIDIA table kernels (`shaders/nv/kernels.txt`).
pub const NV_TABLES: [NvKernel; 2] = [
    crate::nv_kernel!("route_table_d128", NV_TABLE_BINDINGS),
    crate::nv_kernel!("route_table_d64", NV_TABLE_BINDINGS),
];

/// Most bytes of a routing table: the table and the routing run in chunks of queries whose
/// table fits.
const TABLE_BYTES: u64 = 256 << 20;

/// The `Table` uniform of `route.wgsl`, `route_table.wgsl` and `route_table.comp`: the chunk of
/// queries `i0 .. i0 + nq`, the lowest table level `lt` (above the start level: no table),
/// the entries per query `tn`, and the table kernel's grid: `items` (entries for the portable
/// kernel, workgroups for the NVIDIA one) and the NVIDIA kernel's query tiles per (b, KV head).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
pub(crate) struct TableParams {
    pub i0: u32,
    pub nq: u32,
    pub lt: u32,
    pub tn: u32,
    pub items: u32,
    pub tiles: u32,
    pub pad: [u32; 2],
}

thread_local! {
    /// Table-kernel dispatches recorded on this thread: (portable, NVIDIA).
    static TABLE_DISPATCHES: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
    static SG_DISPATCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Routing dispatches with the subgroup score step ([`SG_SHADER`]) recorded on the calling
/// thread so far: lets a test tell which routing kernel a case ran.
#[doc(hidden)]
pub fn subgroup_dispatches_on_this_thread() -> u64 {
    SG_DISPATCHES.with(|c| c.get())
}

/// Routing-table dispatches recorded on the calling thread so far, `(portable, NVIDIA)`: lets a
/// test tell that a case went through the table, and through which kernel.
#[doc(hidden)]
pub fn table_dispatches_on_this_thread() -> (u64, u64) {
    TABLE_DISPATCHES.with(|c| c.get())
}

/// Which kernel writes the routing table.
#[derive(Debug, Clone, Copy)]
enum TableKernel {
    Portable,
    Nv(NvKernel),
}

/// A selection's routing table: levels `lt ..= start level`, `tn` entries per query, chunks of
/// `chunk` queries (a multiple of the routing tile).
#[derive(Debug, Clone, Copy)]
struct TablePlan {
    lt: u32,
    tn: u32,
    chunk: u32,
    kernel: TableKernel,
}

/// The NVIDIA table kernel for `plan`, where the device runs the NVIDIA kernels: f16 storage,
/// head dim 64 or 128, at most [`NV_TABLE_ROWS`] query heads per KV head, a merge factor up to
/// [`NV_TABLE_COLS`], and Q strides of whole 16-byte words (its loads).
fn nv_table_for(ctx: &Context, plan: &Plan) -> Option<NvKernel> {
    let p = &plan.params;
    if !ctx.nv_cm2() || plan.storage != Storage::F16 {
        return None;
    }
    let strides = [p.q_sb, p.q_sh, p.q_sn];
    if plan.gq > NV_TABLE_ROWS || p.merge > NV_TABLE_COLS || strides.iter().any(|s| s % 8 != 0) {
        return None;
    }
    let name = match p.head_dim {
        128 => "route_table_d128",
        64 => "route_table_d64",
        _ => return None,
    };
    ctx.nv_kernel_named(&NV_TABLES, name)
}

/// Whether an invocation of the portable table kernel stays within the device's loop limit
/// ([`Context::loop_limit`]: llvmpipe ends every loop of an invocation after 65535 iterations in
/// all, silently): its loops run GQ heads x g children (1 for `mean`) x D dims, plus the level
/// walk. Past the limit the routing scores those levels itself (no table).
fn portable_fits(ctx: &Context, plan: &Plan) -> bool {
    let p = &plan.params;
    let n = portable_iterations(plan.gq, p.merge, p.scoring, p.head_dim);
    ctx.loop_limit().is_none_or(|limit| n <= limit)
}

/// Loop iterations of one invocation of the portable table kernel (an upper bound): per head,
/// per child (`lse`: g; `mean`: 1), the D dims and the child's own step; the level walk (at
/// most 64 levels).
fn portable_iterations(gq: u32, merge: u32, scoring: u32, d: u32) -> u64 {
    let children = if scoring == 0 { merge } else { 1 } as u64;
    gq as u64 * (1 + children * (d as u64 + 1)) + 64
}

/// The routing table of `plan` with routing tile `tile`, or `None`: no routing, `meanvar`
/// scoring, [`crate::Tuning::route_table_nodes`] 0 or below the start level's nodes, no table
/// kernel (the NVIDIA one does not run, and the portable one is not asked for or would pass the
/// device's loop limit: [`portable_fits`]), or not even one
/// tile's table within [`TABLE_BYTES`] and the device's buffer limits.
fn table_plan(ctx: &Context, plan: &Plan, tile: u32) -> Option<TablePlan> {
    let p = &plan.params;
    let t = ctx.tuning();
    if p.routed == 0 || p.scoring == 2 || t.route_table_nodes == 0 {
        return None;
    }
    let (mut lt, mut tn) = (None, 0u32);
    for l in (1..=p.start_level).rev() {
        let n = p.levels[l as usize][1];
        if tn + n > t.route_table_nodes {
            break;
        }
        tn += n;
        lt = Some(l);
    }
    let lt = lt?;
    let kernel = match nv_table_for(ctx, plan) {
        Some(k) => TableKernel::Nv(k),
        None if t.route_table_portable && portable_fits(ctx, plan) => TableKernel::Portable,
        None => return None,
    };
    let cap = TABLE_BYTES.min(ctx.max_binding_bytes());
    let per_query = plan.bh * tn as u64 * 4;
    // Whole routing tiles that fit; at least one tile even when fewer queries are asked for.
    let tile = tile as u64;
    let fit = cap / per_query / tile * tile;
    if fit == 0 {
        return None;
    }
    let asked = t
        .route_table_queries
        .map_or(fit, |c| (c as u64).max(tile) / tile * tile);
    let chunk = asked.min(fit).min((p.q_len as u64).next_multiple_of(tile));
    Some(TablePlan {
        lt,
        tn,
        chunk: chunk as u32,
        kernel,
    })
}

/// Workgroup sizes are multiples of this.
const WG_STEP: u32 = 32;
/// Most queries per routing workgroup. Nothing is shared between the tile's queries, so the
/// output does not depend on the tile; it is sized so that the score tasks fill the workgroup.
const MAX_TILE: u32 = 16;
/// Most query heads per KV head the routing kernel supports.
pub const MAX_GQ: u32 = 32;

/// Workgroup bytes of the routing kernel (see the shader's `var<workgroup>`s) for a tile of `t`
/// queries and `l` lanes, whether it holds its queries as f32 or as f16 pairs
/// ([`queries_as_f16`]): the larger of the two, so that the shape does not depend on it.
#[allow(clippy::too_many_arguments)]
fn wg_bytes(t: u32, l: u32, gq: u32, d: u32, mc: u32, g: u32, mv: u32, sg: bool) -> u64 {
    let gq4 = gq.div_ceil(4) as u64;
    let (t, l, gq, d4) = (t as u64, l as u64, gq as u64, d.div_ceil(4) as u64);
    let (mc, g, mv) = (mc as u64, g as u64, mv as u64);
    // (SG: the queries and the partial sums are not in workgroup memory.)
    let on = u64::from(!sg);
    let queries = on * (16 * t * gq * d4).max(16 * t * gq4 * 2 * d4) + 32;
    queries
        + 16 * (on * t * mc * gq4 * l * g + 1)
        + 16 * (mv * t * mc * gq4 * l + 1)
        + 4 * (2 * t * mc + 3 * t)
        + 2 * 16 * t * mc.div_ceil(4)
}

/// Whether the routing kernel holds its queries as f16 pairs of heads (the shader's QH): for
/// f16 storage, whose queries the pairs hold exactly, so that one 16-byte load from workgroup
/// memory serves two heads.
fn queries_as_f16(storage: Storage) -> bool {
    storage == Storage::F16
}

/// The shader constants of the routing kernel for workgroup shape `s`.
#[allow(clippy::too_many_arguments)]
fn consts(
    s: Shape,
    gq: u32,
    d: u32,
    mc: u32,
    g: u32,
    mv: u32,
    qh: bool,
    sg: bool,
) -> [(&'static str, u32); 11] {
    [
        ("SG", u32::from(sg)),
        ("QH", u32::from(qh)),
        ("GQ", gq),
        ("QT", s.tile),
        ("MC", mc),
        ("G", g),
        ("MV", mv),
        ("D4", d.div_ceil(4)),
        ("V4", d.is_multiple_of(4) as u32),
        ("WG", s.wg),
        ("L", s.lanes),
    ]
}

/// The routing workgroup shape: queries per workgroup, lanes per score task, invocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    tile: u32,
    lanes: u32,
    wg: u32,
}

/// Chooses the workgroup shape: the most lanes up to `asked` that divide ceil(D / 4), then the
/// tile whose score tasks (tile * MC * ceil(GQ / 4) * lanes) best fill a workgroup of whole
/// [`WG_STEP`]s of at most `max_wg` invocations, within `mem` bytes of workgroup memory (fewer lanes
/// if even one query does not fit). `None` when nothing fits.
#[allow(clippy::too_many_arguments)]
fn choose_shape(
    asked: u32,
    tile: Option<u32>,
    max_wg: u32,
    mem: u64,
    gq: u32,
    d: u32,
    mc: u32,
    g: u32,
    mv: u32,
) -> Option<Shape> {
    let d4 = d.div_ceil(4);
    let max_wg = (max_wg / WG_STEP * WG_STEP).max(WG_STEP);
    let mut l = asked.max(1);
    loop {
        if d4.is_multiple_of(l) {
            let per_query = mc * gq.div_ceil(4) * l;
            let mut best: Option<(u64, Shape)> = None;
            for t in 1..=tile.unwrap_or(MAX_TILE) {
                if tile.is_none() && t > 1 && t * per_query > max_wg {
                    break;
                }
                if wg_bytes(t, l, gq, d, mc, g, mv, false) > mem {
                    break;
                }
                let tasks = t * per_query;
                let wg = tasks.div_ceil(WG_STEP).saturating_mul(WG_STEP).min(max_wg);
                // Utilisation in parts per 1024: tasks over invocation slots used.
                let slots = tasks.div_ceil(wg) as u64 * wg as u64;
                let util = tasks as u64 * 1024 / slots;
                if tile.is_some() || best.is_none_or(|(u, _)| util > u) {
                    best = Some((
                        util,
                        Shape {
                            tile: t,
                            lanes: l,
                            wg,
                        },
                    ));
                }
            }
            if let Some((_, s)) = best {
                return Some(s);
            }
        }
        if l == 1 {
            return None;
        }
        l /= 2;
    }
}

/// The prefill selection's limit on query heads per KV head ([`MAX_GQ`]), which every prefill
/// meets whether or not it routes (a prompt whose queries select every leaf they see does not):
/// [`crate::GpuError::Unsupported`] above it.
pub(crate) fn check_query_group(gq: usize) -> Result<()> {
    if gq > MAX_GQ as usize {
        return Err(crate::GpuError::Unsupported(format!(
            "PISA prefill routing with {gq} query heads per KV head: at most {MAX_GQ} (prefill \
             selection holds up to 32 (query, head) rows per workgroup; the decode step takes \
             up to 256)"
        )));
    }
    Ok(())
}

/// Records stage 1 and returns the candidates `[B, Hkv, Nq, g*(K+1)]` i32: per query its
/// level-0 candidate leaves, ascending, -1 padded (all -1 for a query that sees K or fewer
/// leaves, which stage 2 handles without scoring). `_q_tile` (stage 2's query tile) is not used:
/// the routing sizes its own tile (see [`subgroup_shape`] and [`choose_shape`]); its output
/// does not depend on it.
/// Profiler stage "route". Errors: [`crate::GpuError::Limit`] (buffers, workgroup memory).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    plan: &Plan,
    q: &GpuTensor,
    pyr: &GpuPyramid,
    _q_tile: usize,
    prof: Option<&mut Profiler>,
) -> Result<GpuTensor> {
    let (gq, d, mc, g) = (
        plan.gq,
        plan.params.head_dim,
        plan.params.mc,
        plan.params.merge,
    );
    check_query_group(gq as usize)?;
    let mv = (plan.params.scoring == 2) as u32;
    let v4 = (d % 4 == 0) as u32;
    let lim = ctx.limits();
    let mem = lim.max_compute_workgroup_storage_size as u64;
    let t = ctx.tuning();
    let max_wg = t
        .route_max_workgroup
        .min(lim.max_compute_invocations_per_workgroup)
        .min(lim.max_compute_workgroup_size_x);
    let tile = t.route_tile.map(|t| t.min(MAX_TILE));
    let sg = subgroup_shape(ctx, plan);
    let shape = sg
        .or_else(|| choose_shape(t.route_lanes, tile, max_wg, mem, gq, d, mc, g, mv))
        .ok_or_else(|| crate::GpuError::Limit {
            what: "workgroup memory of route".into(),
            needed: wg_bytes(1, 1, gq, d, mc, g, mv, false),
            limit: mem,
            unit: "bytes",
            hint: "use a smaller head dim, top_k, merge factor or GQA group",
        })?;
    let t = shape.tile;
    let len = plan.sched.candidates_len(&plan.shape);
    let cand = ctx.alloc("candidates", len, Storage::F32, POISON_I32)?;
    // The scalar (bindings 2, 3) or the vec4 (bindings 5, 6) views of means and second moments
    // are read (V4); the other pair, and sq without `meanvar`, get a 16-byte dummy.
    let dummy = ctx.alloc("unused", 4, Storage::F32, 0)?;
    let sq = pyr.sq.as_ref().map_or(&dummy.buffer, |s| &s.buffer);
    let (m1, s1, m4, s4) = if v4 != 0 {
        (&dummy.buffer, &dummy.buffer, &pyr.means.buffer, sq)
    } else {
        (&pyr.means.buffer, sq, &dummy.buffer, &dummy.buffer)
    };
    let qh = queries_as_f16(plan.storage);
    let consts = consts(shape, gq, d, mc, g, mv, qh, sg.is_some());
    let shader = if sg.is_some() { &SG_SHADER } else { &SHADER };
    let pipe = ctx
        .pipelines
        .get(&ctx.device, shader, "route", plan.storage, &consts, &[])?;
    let q_len = plan.params.q_len;
    let table = table_plan(ctx, plan, t);
    let (chunk, lt, tn) = match table {
        Some(tp) => (tp.chunk, tp.lt, tp.tn),
        None => (q_len, u32::MAX, 0),
    };
    // Written before read: the routing reads the entries of its chunk's complete-past nodes,
    // which the table kernel writes (the NVIDIA one, per query tile, every node up to the
    // tile's last query's complete past).
    // (no table: the routing's table binding gets the dummy)
    let tbuf = match table {
        Some(_) => Some(ctx.scratch(
            "routing table",
            (plan.bh * chunk as u64 * tn as u64) as usize,
            Storage::F32,
        )?),
        None => None,
    };
    let tb = tbuf.as_ref().map_or(&dummy.buffer, |t| &t.buffer);
    let table_pipe = match table.map(|tp| tp.kernel) {
        Some(k @ TableKernel::Nv(nv)) => Some((k, ctx.nv_pipeline(&nv)?.0)),
        Some(k @ TableKernel::Portable) => Some((
            k,
            ctx.pipelines.get(
                &ctx.device,
                &TABLE_SHADER,
                "route_table",
                plan.storage,
                &[],
                &[],
            )?,
        )),
        None => None,
    };
    let mut prof = prof;
    let mut i0 = 0;
    while i0 < q_len {
        let nq = chunk.min(q_len - i0);
        let tiles = nq.div_ceil(t);
        let p = SelParams {
            tiles,
            wg_count: plan.bh as u32 * tiles,
            ..plan.params
        };
        let mut tp = TableParams {
            i0,
            nq,
            lt,
            tn,
            ..Default::default()
        };
        // The table kernel's grid (the routing reads the chunk and the table's shape only).
        let workgroups = match table_pipe.as_ref().map(|x| x.0) {
            Some(TableKernel::Nv(_)) => {
                tp.tiles = nq.div_ceil(NV_TABLE_ROWS / gq);
                tp.items = plan.bh as u32 * tp.tiles;
                tp.items as u64
            }
            Some(TableKernel::Portable) => {
                tp.items = (plan.bh * nq as u64 * tn as u64) as u32;
                (tp.items as u64).div_ceil(TABLE_WG as u64)
            }
            None => 0,
        };
        let u = ctx.uniform("route params", &p)?;
        let ut = ctx.uniform("route table params", &tp)?;
        if let Some((kernel, tpipe)) = &table_pipe {
            let b: [(u32, Bind<'_>); 5] = [
                (0, (&u).into()),
                (1, q.into()),
                (2, (&pyr.means.buffer).into()),
                (3, tb.into()),
                (4, (&ut).into()),
            ];
            let timer = prof.as_deref_mut().map(|pr| (pr, "route_table"));
            ctx.dispatch(enc, tpipe, &b, workgroups, timer)?;
            TABLE_DISPATCHES.with(|c| {
                let (a, n) = c.get();
                c.set(match kernel {
                    TableKernel::Portable => (a + 1, n),
                    TableKernel::Nv(_) => (a, n + 1),
                });
            });
        }
        let b: [(u32, Bind<'_>); 9] = [
            (0, (&u).into()),
            (1, q.into()),
            (2, m1.into()),
            (3, s1.into()),
            (4, (&cand.buffer).into()),
            (5, m4.into()),
            (6, s4.into()),
            (7, tb.into()),
            (8, (&ut).into()),
        ];
        let timer = prof.as_deref_mut().map(|pr| (pr, "route"));
        ctx.dispatch(enc, &pipe, &b, p.wg_count as u64, timer)?;
        if sg.is_some() {
            SG_DISPATCHES.with(|c| c.set(c.get() + 1));
        }
        i0 += nq;
    }
    Ok(cand)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::pipeline::assert_workgroup_fits;

    #[test]
    fn portable_table_iterations() {
        // GQ 4, g 2, D 128 (the bench shape): 4 * (1 + 2 * 129) + 64.
        assert_eq!(portable_iterations(4, 2, 0, 128), 1100);
        // `mean` scores a node's own row.
        assert_eq!(portable_iterations(4, 2, 1, 128), 4 * 130 + 64);
        // Past llvmpipe's 65535: 32 heads, g 4, D 512.
        assert!(portable_iterations(32, 4, 0, 512) > 65535);
    }

    #[test]
    fn shapes_fill_the_workgroup_and_fit_memory() {
        // The bench shape (GQ 4, D 128, K 16, g 2: MC 34), `lse`, 48 KiB.
        let s = choose_shape(4, None, 256, 48 << 10, 4, 128, 34, 2, 0).unwrap();
        assert_eq!((s.lanes, s.tile, s.wg), (4, 1, 160));
        let s = choose_shape(2, None, 256, 48 << 10, 4, 128, 34, 2, 0).unwrap();
        assert_eq!((s.lanes, s.tile, s.wg), (2, 3, 224));
        let s = choose_shape(4, Some(4), 256, 48 << 10, 4, 128, 34, 2, 0).unwrap();
        assert_eq!((s.lanes, s.tile, s.wg), (4, 4, 256));
        for (asked, gq, d, mc, g, mv) in [
            (1, 1, 64, 10, 2, 0),
            (8, 32, 128, 34, 2, 0),
            (16, 32, 512, 34, 2, 1),
            (4, 7, 30, 9, 3, 1),
            (2, 2, 6, 16, 4, 0),
        ] {
            for mem in [16u64 << 10, 32 << 10, 48 << 10] {
                for (max_wg, tile) in [(64, None), (256, None), (1024, None), (256, Some(16))] {
                    let Some(s) = choose_shape(asked, tile, max_wg, mem, gq, d, mc, g, mv) else {
                        assert!(wg_bytes(1, 1, gq, d, mc, g, mv, false) > mem);
                        continue;
                    };
                    assert!(wg_bytes(s.tile, s.lanes, gq, d, mc, g, mv, false) <= mem);
                    assert!(s.lanes <= asked && d.div_ceil(4).is_multiple_of(s.lanes));
                    assert!(s.wg.is_multiple_of(WG_STEP) && s.wg <= max_wg && s.wg >= s.tile);
                    let fills = s.tile * mc * gq.div_ceil(4) * s.lanes <= s.wg;
                    assert!(s.tile == 1 || tile.is_some() || fills);
                }
            }
        }
    }

    /// The subgroup kernel's loop count ([`sg_iterations`]) keeps the benchmark shape within
    /// llvmpipe's loop limit up to 16M tokens, and leaves it to the workgroup-memory kernel for
    /// top_k 64 with four head groups of 2 lanes there (a count past 65535).
    #[test]
    fn subgroup_loops_against_the_llvmpipe_limit() {
        let shape = sg_shape;
        // GQ 4, D 128, K 16, g 2: MC 34; 16M tokens of C 64 have 18 levels, the start one 5.
        let small = sg_iterations(shape(8, 1), 14, 34, 2, 128, 1);
        assert!(small < 65535 / 2, "{small}");
        // GQ 16 on subgroups of 8 (2 lanes), K 64 (MC 130), 16 levels.
        let big = sg_iterations(shape(2, 4), 16, 130, 2, 128, 4);
        assert!(big > 65535, "{big}");
    }

    /// The kernel's workgroup variables (naga's sizes, the constants [`record`] builds
    /// substituted) fit what [`wg_bytes`] charges, for the shapes [`choose_shape`] picks: GQA
    /// groups 1 to 32, head dims 6 to 512 (scalar and vec4 reads), MC 9 to 34, merge factors 2
    /// to 4, `meanvar` on and off, 1 to 16 lanes, chosen and fixed tiles, at 16 and 48 KiB; and
    /// the subgroup kernel's fixed shape (which `subgroup_shape` checks against the device).
    #[test]
    fn wg_bytes_covers_the_shader() {
        let mut checked = 0;
        for (asked, gq, d, mc, g, mv) in [
            (4, 4, 128, 34, 2, 0),
            (1, 1, 64, 10, 2, 0),
            (8, 32, 128, 34, 2, 0),
            (16, 32, 512, 34, 2, 1),
            (4, 7, 30, 9, 3, 1),
            (2, 2, 6, 16, 4, 0),
        ] {
            for mem in [16u64 << 10, 48 << 10] {
                for (max_wg, tile) in [(256, None), (1024, None), (256, Some(16))] {
                    let Some(s) = choose_shape(asked, tile, max_wg, mem, gq, d, mc, g, mv) else {
                        continue;
                    };
                    checked += 1;
                    let charged = wg_bytes(s.tile, s.lanes, gq, d, mc, g, mv, false);
                    for (st, qh) in [(Storage::F32, false), (Storage::F16, true)] {
                        let c = consts(s, gq, d, mc, g, mv, qh, false);
                        assert_workgroup_fits(&SHADER, "route", st, &c, charged, "wg_bytes");
                    }
                }
            }
        }
        assert!(checked >= 25, "only {checked} shapes checked");
        // The subgroup kernel's shape (fixed), for the selections it takes.
        for (gq, d, mc, g, lanes) in [
            (4, 128, 34, 2, 8),
            (1, 32, 10, 3, 8),
            (3, 96, 20, 4, 8),
            (2, 64, 9, 2, 8),
            (8, 128, 34, 2, 4),
            (7, 64, 34, 2, 8),
            (16, 128, 34, 2, 2),
        ] {
            let s = sg_shape(lanes, sg_groups(gq));
            let charged = wg_bytes(s.tile, s.lanes, gq, d, mc, g, 0, true);
            for (st, qh) in [(Storage::F32, false), (Storage::F16, true)] {
                let c = consts(s, gq, d, mc, g, 0, qh, true);
                assert_workgroup_fits(&SG_SHADER, "route", st, &c, charged, "wg_bytes (SG)");
            }
        }
    }
}
