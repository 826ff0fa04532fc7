//! Stage 1 of PISA prefill selection (PISA.md sections 3 and 5): routes every query through the
//! intermediate pyramid levels and writes its leaf candidates; shader `shaders/route.wgsl`.

use super::pyramid::GpuPyramid;
use super::select::{fit_tile, Plan};
use crate::error::Result;
use crate::runtime::buffers::{GpuTensor, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/route.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "route",
    wgsl: concat!(
        include_str!("../../../shaders/select_common.wgsl"),
        include_str!("../../../shaders/route.wgsl")
    ),
};

/// Invocations per routing workgroup.
const WG: u32 = 256;
/// Most queries per routing workgroup (the tile is sized so that its (query, candidate, head
/// group) work items roughly fill the workgroup; nothing is shared between the tile's queries,
/// so the output does not depend on the tile).
const MAX_TILE: u32 = 16;
/// Most query heads per KV head the routing kernel supports.
pub const MAX_GQ: u32 = 32;

/// Workgroup bytes of the routing kernel for a tile of `t` queries (see the shader's
/// `var<workgroup>`s).
fn wg_bytes(t: u32, gq: u32, d: u32, mc: u32) -> u64 {
    let gq4 = gq.div_ceil(4) as u64;
    let (t, gq, d4, mc) = (t as u64, gq as u64, d.div_ceil(4) as u64, mc as u64);
    16 * t * gq * d4 + 4 * (2 * t * mc + t * mc + t * mc * gq4 + t * mc + 3 * t)
}

/// Queries per workgroup wanted before the memory fit: enough (query, candidate, head group)
/// items to fill the workgroup.
fn wanted_tile(gq: u32, mc: u32) -> u32 {
    (WG / (mc * gq.div_ceil(4)).max(1)).clamp(1, MAX_TILE)
}

/// Records stage 1 and returns the candidates `[B, Hkv, Nq, g*(K+1)]` i32: per query its
/// level-0 candidate leaves, ascending, -1 padded (all -1 for a query that sees K or fewer
/// leaves, which stage 2 handles without scoring). `_q_tile` (stage 2's query tile) is not used:
/// the routing sizes its own tile (see [`wanted_tile`]); its output does not depend on it.
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
    if gq > MAX_GQ {
        return Err(crate::GpuError::Unsupported(format!(
            "PISA routing with {gq} query heads per KV head (at most {MAX_GQ})"
        )));
    }
    let mv = (plan.params.scoring == 2) as u32;
    let v4 = (d % 4 == 0) as u32;
    let t = fit_tile(ctx, "route", wanted_tile(gq, mc) as usize, |t| {
        wg_bytes(t, gq, d, mc)
    })?;
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
    let consts = [
        ("GQ", gq),
        ("QT", t),
        ("MC", mc),
        ("G", g),
        ("MV", mv),
        ("D4", d.div_ceil(4)),
        ("V4", v4),
        ("WG", WG),
    ];
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "route", plan.storage, &consts, &[])?;
    let p = plan.tiled(t);
    let u = ctx.uniform("route params", &p)?;
    let b = [
        (0, &u),
        (1, &q.buffer),
        (2, m1),
        (3, s1),
        (4, &cand.buffer),
        (5, m4),
        (6, s4),
    ];
    ctx.dispatch(
        enc,
        &pipe,
        &b,
        p.wg_count as u64,
        prof.map(|pr| (pr, "route")),
    )?;
    Ok(cand)
}
