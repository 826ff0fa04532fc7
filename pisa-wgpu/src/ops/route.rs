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

/// Queries per routing workgroup at most (fewer when workgroup memory is short).
pub const ROUTE_TILE: usize = 4;

const WG: u32 = 64;
const DC: u32 = 32;
/// Most query heads per KV head the routing kernel unrolls (four vec4 accumulators).
pub const MAX_GQ: u32 = 32;

/// Vec4 slots of the query buffer for a tile of `t` queries.
fn q_slots(t: u32, gq: u32, d: u32) -> u32 {
    t * gq.div_ceil(4) * d.div_ceil(DC) * DC
}

/// Workgroup bytes of the routing kernel for a tile of `t` queries (see the shader's
/// `var<workgroup>`s); `mv`: 1 for `meanvar`.
fn wg_bytes(t: u32, gq: u32, d: u32, mc: u32, g: u32, mv: u32) -> u64 {
    let gq4 = gq.div_ceil(4);
    let stage = WG * (DC + 1);
    let words = 4 * q_slots(t, gq, d)
        + stage
        + mv * stage
        + 1
        + 4 * t * mc * g * gq4
        + 4 * mv * t * mc * gq4
        + 4
        + t * mc * g
        + 1
        + 4 * t * mc
        + 3 * t;
    4 * words as u64
}

/// Records stage 1 and returns the candidates `[B, Hkv, Nq, g*(K+1)]` i32: per query its
/// level-0 candidate leaves, ascending, -1 padded (all -1 for a query that sees K or fewer
/// leaves, which stage 2 handles without scoring). `q_tile` bounds the queries per workgroup.
/// Profiler stage "route". Errors: [`crate::GpuError::Limit`] (buffers, workgroup memory).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    plan: &Plan,
    q: &GpuTensor,
    pyr: &GpuPyramid,
    q_tile: usize,
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
    let t = fit_tile(ctx, "route", q_tile.clamp(1, ROUTE_TILE), |t| {
        wg_bytes(t, gq, d, mc, g, mv)
    })?;
    let len = plan.sched.candidates_len(&plan.shape);
    let cand = ctx.alloc("candidates", len, Storage::F32, POISON_I32)?;
    let dummy;
    let sq = match &pyr.sq {
        Some(s) => &s.buffer,
        None => {
            dummy = ctx.alloc("unused", 1, Storage::F32, 0)?;
            &dummy.buffer
        }
    };
    let consts = [
        ("GQ", gq),
        ("QT", t),
        ("MC", mc),
        ("G", g),
        ("MV", mv),
        ("QBUF", q_slots(t, gq, d)),
    ];
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "route", plan.storage, &consts, &[])?;
    let p = plan.tiled(t);
    let u = ctx.uniform("route params", &p)?;
    let b = [
        (0, &u),
        (1, &q.buffer),
        (2, &pyr.means.buffer),
        (3, sq),
        (4, &cand.buffer),
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
