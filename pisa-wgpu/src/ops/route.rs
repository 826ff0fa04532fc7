//! Stage 1 of PISA prefill selection (PISA.md sections 3 and 5): routes every query through the
//! intermediate pyramid levels and writes its leaf candidates; shader `shaders/route.wgsl`.

use super::pyramid::GpuPyramid;
use super::select::Plan;
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_I32};
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
fn wg_bytes(t: u32, l: u32, gq: u32, d: u32, mc: u32, g: u32, mv: u32) -> u64 {
    let gq4 = gq.div_ceil(4) as u64;
    let (t, l, gq, d4) = (t as u64, l as u64, gq as u64, d.div_ceil(4) as u64);
    let (mc, g, mv) = (mc as u64, g as u64, mv as u64);
    let queries = (16 * t * gq * d4).max(16 * t * gq4 * 2 * d4) + 32;
    queries
        + 16 * t * mc * gq4 * l * g
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
) -> [(&'static str, u32); 10] {
    [
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
                if wg_bytes(t, l, gq, d, mc, g, mv) > mem {
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

/// Records stage 1 and returns the candidates `[B, Hkv, Nq, g*(K+1)]` i32: per query its
/// level-0 candidate leaves, ascending, -1 padded (all -1 for a query that sees K or fewer
/// leaves, which stage 2 handles without scoring). `_q_tile` (stage 2's query tile) is not used:
/// the routing sizes its own tile (see [`choose_shape`]); its output does not depend on it.
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
    let lim = ctx.limits();
    let mem = lim.max_compute_workgroup_storage_size as u64;
    let t = ctx.tuning();
    let max_wg = t
        .route_max_workgroup
        .min(lim.max_compute_invocations_per_workgroup)
        .min(lim.max_compute_workgroup_size_x);
    let tile = t.route_tile.map(|t| t.min(MAX_TILE));
    let shape =
        choose_shape(t.route_lanes, tile, max_wg, mem, gq, d, mc, g, mv).ok_or_else(|| {
            crate::GpuError::Limit {
                what: "workgroup memory of route".into(),
                needed: wg_bytes(1, 1, gq, d, mc, g, mv),
                limit: mem,
                hint: "use a smaller head dim, top_k, merge factor or GQA group",
            }
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
    let consts = consts(shape, gq, d, mc, g, mv, queries_as_f16(plan.storage));
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "route", plan.storage, &consts, &[])?;
    let p = plan.tiled(t);
    let u = ctx.uniform("route params", &p)?;
    let b: [(u32, Bind<'_>); 7] = [
        (0, (&u).into()),
        (1, q.into()),
        (2, m1.into()),
        (3, s1.into()),
        (4, (&cand.buffer).into()),
        (5, m4.into()),
        (6, s4.into()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::pipeline::assert_workgroup_fits;

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
                        assert!(wg_bytes(1, 1, gq, d, mc, g, mv) > mem);
                        continue;
                    };
                    assert!(wg_bytes(s.tile, s.lanes, gq, d, mc, g, mv) <= mem);
                    assert!(s.lanes <= asked && d.div_ceil(4).is_multiple_of(s.lanes));
                    assert!(s.wg.is_multiple_of(WG_STEP) && s.wg <= max_wg && s.wg >= s.tile);
                    let fills = s.tile * mc * gq.div_ceil(4) * s.lanes <= s.wg;
                    assert!(s.tile == 1 || tile.is_some() || fills);
                }
            }
        }
    }

    /// The kernel's workgroup variables (naga's sizes, the constants [`record`] builds
    /// substituted) fit what [`wg_bytes`] charges, for the shapes [`choose_shape`] picks: GQA
    /// groups 1 to 32, head dims 6 to 512 (scalar and vec4 reads), MC 9 to 34, merge factors 2
    /// to 4, `meanvar` on and off, 1 to 16 lanes, chosen and fixed tiles, at 16 and 48 KiB.
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
                    let charged = wg_bytes(s.tile, s.lanes, gq, d, mc, g, mv);
                    for (st, qh) in [(Storage::F32, false), (Storage::F16, true)] {
                        let c = consts(s, gq, d, mc, g, mv, qh);
                        assert_workgroup_fits(&SHADER, "route", st, &c, charged, "wg_bytes");
                    }
                }
            }
        }
        assert!(checked >= 25, "only {checked} shapes checked");
    }
}
