//! Stage 2 of PISA prefill selection (PISA.md sections 3.3, 3.4 and 5): exact-LSE scoring of the
//! stage-1 leaf candidates and the final top-K, in one of two orders ([`LeafOrder`]):
//! - query tiles: `shaders/leaf_select.wgsl` (portable) or, on tensor cores, [`coop`]
//!   (`shaders/leaf_select_coop.wgsl`), one workgroup per Qtile consecutive queries over the
//!   union of their candidates; profiler stage "leaf_select";
//! - leaf-major ([`by_leaf`]): candidates bucketed by leaf, each leaf scored against chunks of
//!   the queries that listed it; profiler stages "leaf_bucket", "leaf_score", "leaf_pick".
//!
//! Both orders append `shaders/leaf_common.wgsl` (the union of a tile's candidates and the
//! rank-based pick) and give the same selection up to near-ties of f32 rounding.

pub mod by_leaf;
pub mod coop;

use super::select::{fit_tile, Plan};
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_I32};
use crate::runtime::context::{Context, KernelPath, LeafOrder};
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/leaf_select.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "leaf_select",
    wgsl: concat!(
        include_str!("../../../shaders/select_common.wgsl"),
        include_str!("../../../shaders/leaf_select.wgsl"),
        include_str!("../../../shaders/leaf_common.wgsl")
    ),
};

/// Invocations per workgroup (the shader's `WG`): key tokens per chunk.
const WG: u32 = 64;
/// Head dims staged per step (the shader's `DC`).
const DC: u32 = 32;
/// Most (query, head) pairs of a tile: the shader unrolls eight vec4 accumulators.
const MAX_QG: u32 = 32;

/// Vec4 slots of the query buffer for `qg` (query, head) pairs: `ceil(qg/4) * D rounded to DC`.
fn q_slots(qg: u32, d: u32) -> u32 {
    qg.div_ceil(4) * d.div_ceil(DC) * DC
}

/// Workgroup bytes of stage 2 for a tile of `t` queries (see the shader's `var<workgroup>`s).
fn wg_bytes(t: u32, gq: u32, d: u32, mc: u32) -> u64 {
    let qg = t * gq;
    let words = 4 * q_slots(qg, d) + WG * (DC + 1) + 4 * WG * qg.div_ceil(4) + 2 * qg + 2 * WG;
    4 * words as u64 + common_bytes(t, mc)
}

/// The shader constants of stage 2 for a tile of `t` queries.
fn consts(t: u32, gq: u32, d: u32, mc: u32) -> [(&'static str, u32); 4] {
    [
        ("GQ", gq),
        ("QT", t),
        ("MC", mc),
        ("QBUF", q_slots(t * gq, d)),
    ]
}

/// Which kernel family stage 2 (leaf scoring) runs for a PISA selection of this shape,
/// configuration, storage and query tile on `ctx` (see [`coop::plan_for`]).
pub fn leaf_path(
    ctx: &Context,
    shape: &pisa_core::AttentionShape,
    cfg: &pisa_core::SelectionConfig,
    storage: Storage,
    q_tile: usize,
) -> KernelPath {
    match coop::plan_for(ctx, shape, cfg, storage, q_tile) {
        Some(_) => KernelPath::CoopMat,
        None => KernelPath::Portable,
    }
}

/// The leaf-major plan ([`by_leaf`]) when the context's [`LeafOrder`] asks for it and it fits,
/// else `None` (query tiles). Auto: leaf-major where the scorer runs on tensor cores (`coop` is
/// a variant and the tensor-core scorer's plan fits). Leaves: the tensor-core scorer where it
/// fits, else the portable one (tiles only when neither fits).
fn leaf_major(
    ctx: &Context,
    plan: &Plan,
    coop: Option<coop::LeafCoopVariant>,
) -> Option<by_leaf::ByLeaf> {
    let order = ctx.leaf_order();
    if order == LeafOrder::Tiles {
        return None;
    }
    let on_tensor_cores = coop.and_then(|v| by_leaf::plan(ctx, plan, by_leaf::Scorer::Coop(v)));
    match order {
        LeafOrder::Leaves => {
            on_tensor_cores.or_else(|| by_leaf::plan(ctx, plan, by_leaf::Scorer::Portable))
        }
        _ => on_tensor_cores,
    }
}

/// Loop iterations of one invocation of the portable tile kernel (`leaf_select.wgsl` with
/// `leaf_common.wgsl`), an upper bound, for a tile of `t` queries of `gq` heads, head dim `d`,
/// `mc` candidates a query, blocks of `c` keys and `top_k`: what llvmpipe's loop limiter counts
/// ([`Context::loop_limit`]: it ends every loop of an invocation after 65535 iterations in all,
/// silently). Of E = t mc entries an invocation takes ceil(E / WG); the union's first-occurrence
/// and prefix loops run over the entries before each of its own (3 such loops); then per leaf
/// of the union (at most E) the key chunks of WG tokens, each with its head-dim steps of DC, the
/// column fold and the merge of its parts; then the pick: a rank over a query's candidates for
/// each entry (2 loops), the forced leaves (at most top_k, each over the candidates) and the
/// padding.
fn tile_iterations(t: u32, gq: u32, d: u32, mc: u32, c: u32, top_k: u32) -> u64 {
    let (t, gq, d, mc, c, k) = (
        t as u64,
        gq as u64,
        d as u64,
        mc as u64,
        c as u64,
        top_k as u64,
    );
    let (wg, dc) = (WG as u64, DC as u64);
    let e = t * mc;
    let ne = e.div_ceil(wg);
    // Sum over an invocation's entries lid + j WG of the entries before each.
    let before = ne * (wg - 1) + wg * ne * ne.saturating_sub(1) / 2;
    let qg = t * gq;
    let q_load = (qg.div_ceil(4) * 4 * d.div_ceil(dc) * dc).div_ceil(wg);
    let union = ne + mc + 3 * before + e;
    let parts = (wg / qg).max(1);
    let chunk =
        1 + d.div_ceil(dc) * (1 + dc) + wg.div_ceil(parts) + qg.div_ceil(wg) * (1 + 2 * parts);
    let per_leaf = 1 + c.div_ceil(wg) * chunk + gq;
    let pick = 2 * ne * (1 + mc) + mc + k * (1 + mc) + 2 * k;
    q_load + union + e * per_leaf + pick
}

/// Workgroup bytes of leaf_common.wgsl's arrays for a tile of `t` queries, `mc` candidates each.
fn common_bytes(t: u32, mc: u32) -> u64 {
    let qmc4 = (t * mc).div_ceil(4) * 4;
    4 * (4 * qmc4 + qmc4 * t + t.div_ceil(4) * 4 + 4) as u64
}

/// Records stage 2 over the candidates `cand` (`[B, Hkv, Nq, g*(K+1)]` from
/// [`super::route`]) and returns the selection `[B, Hkv, Nq, K]` i32, ascending, -1 padded.
/// `q_tile` (Qtile) consecutive queries share each loaded key block; it is clamped to what fits
/// in workgroup memory and does not change the result. The order follows [`leaf_major`]; on
/// the CoopMat path, f16 selections of a supported shape score on tensor cores ([`coop`],
/// [`by_leaf`]). Where the device caps an invocation's loop iterations
/// ([`Context::loop_limit`]), the portable tile kernel's tile shrinks until its count
/// ([`tile_iterations`]) fits; past it even at one query, the leaf-major order runs instead
/// unless [`LeafOrder::Tiles`] was asked for, as where the tile kernel's workgroup memory
/// passes the device's for one query (WebGPU's default 16 KiB with GQA 16 at D 128).
/// Profiler stages: see the module docs. Errors: [`crate::GpuError::Limit`] (buffers;
/// workgroup memory or loop iterations past the device's where the leaf-major order does not
/// fit either or [`LeafOrder::Tiles`] was asked for).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    plan: &Plan,
    q: &GpuTensor,
    k: &GpuTensor,
    cand: &GpuTensor,
    q_tile: usize,
    prof: Option<&mut Profiler>,
) -> Result<GpuTensor> {
    let (gq, d, mc) = (plan.gq, plan.params.head_dim, plan.params.mc);
    if gq > MAX_QG {
        return Err(crate::GpuError::Unsupported(format!(
            "PISA prefill selection with {gq} query heads per KV head: at most {MAX_QG} (stage 2 \
             keeps the running leaf scores of up to 32 (query, head) rows per workgroup; the \
             decode step takes up to 256)"
        )));
    }
    let len = plan.sched.selection_len(&plan.shape);
    let coop_var = coop::plan(ctx, plan, q_tile);
    if let Some(bl) = leaf_major(ctx, plan, coop_var) {
        return by_leaf::record(ctx, enc, plan, q, k, cand, &bl, prof);
    }
    if let Some(var) = coop_var {
        let sel = ctx.alloc("selection", len, Storage::F32, POISON_I32)?;
        let timer = prof.map(|pr| (pr, "leaf_select"));
        let b = [q.into(), k.into(), (&cand.buffer).into()];
        coop::record(ctx, enc, plan, b, &sel, &var, timer)?;
        return Ok(sel);
    }
    let max_tile = q_tile.clamp(1, (MAX_QG / gq) as usize);
    // The leaf-major order where the portable tile kernel cannot run (its workgroup memory
    // past the device's even for one query, or its loops past the device's cap), unless tiles
    // were asked for: it gives the same selection.
    let portable_by_leaf = || {
        (ctx.leaf_order() != LeafOrder::Tiles)
            .then(|| by_leaf::plan(ctx, plan, by_leaf::Scorer::Portable))
            .flatten()
    };
    let t = match fit_tile(ctx, "leaf_select", max_tile, |t| wg_bytes(t, gq, d, mc)) {
        Ok(t) => t,
        Err(e) => match portable_by_leaf() {
            Some(bl) => return by_leaf::record(ctx, enc, plan, q, k, cand, &bl, prof),
            None => return Err(tiles_asked(ctx, plan, e)),
        },
    };
    let p = &plan.params;
    let count = |t: u32| tile_iterations(t, gq, d, mc, p.block_size, p.top_k);
    let t = match ctx.loop_limit() {
        None => t,
        Some(limit) => match (1..=t).rev().find(|&t| count(t) <= limit) {
            Some(t) => t,
            // Past the loop limit even one query at a time: the leaf-major order, whose
            // invocations loop over one leaf's candidates or keys, unless tiles were asked for.
            None => {
                if let Some(bl) = portable_by_leaf() {
                    return by_leaf::record(ctx, enc, plan, q, k, cand, &bl, prof);
                }
                return Err(ctx.loop_limit_error(
                    "leaf_select",
                    "selection",
                    (count(1), limit),
                    "use a GPU, a smaller top_k or block size, or the leaf-major order \
                     (LeafOrder::Leaves or Auto: tuning knob leaf_order=leaves, \
                     PISA_LEAF_ORDER=leaves)",
                ));
            }
        },
    };
    let sel = ctx.alloc("selection", len, Storage::F32, POISON_I32)?;
    let consts = consts(t, gq, d, mc);
    let pipe = ctx.pipelines.get(
        &ctx.device,
        &SHADER,
        "leaf_select",
        plan.storage,
        &consts,
        &[],
    )?;
    let p = plan.tiled(t);
    let u = ctx.uniform("leaf_select params", &p)?;
    let b: [(u32, Bind<'_>); 5] = [
        (0, (&u).into()),
        (1, q.into()),
        (2, k.into()),
        (3, (&cand.buffer).into()),
        (4, (&sel.buffer).into()),
    ];
    let timer = prof.map(|pr| (pr, "leaf_select"));
    ctx.dispatch(enc, &pipe, &b, p.wg_count as u64, timer)?;
    Ok(sel)
}

/// What the tile kernel's refusal `e` says to do, where the tile order was asked for
/// ([`LeafOrder::Tiles`]) and the leaf-major order would run the shape: the knob, not the
/// model's shape (it told the app to shrink its head dim or GQA group, for a knob's choice).
fn tiles_asked(ctx: &Context, plan: &Plan, e: crate::GpuError) -> crate::GpuError {
    let leaf_major_runs = || by_leaf::plan(ctx, plan, by_leaf::Scorer::Portable).is_some();
    match e {
        crate::GpuError::Limit {
            what,
            needed,
            limit,
            unit,
            ..
        } if ctx.leaf_order() == LeafOrder::Tiles && leaf_major_runs() => crate::GpuError::Limit {
            what,
            needed,
            limit,
            unit,
            hint: "the query-tile order was asked for (tuning knob leaf_order=tiles, \
                   PISA_LEAF_ORDER, Context::set_leaf_order): the leaf-major order (auto or \
                   leaves) runs this shape, with the same selection",
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::pipeline::assert_workgroup_fits;

    /// The loop count against llvmpipe's 65535: the paper's configuration (C 64, K 16, g 2:
    /// 34 candidates, GQA 4, D 128, Qtile 4) well within it; blocks of one key with top_k 256
    /// (514 candidates) past it even one query at a time (`pisa forward --block-size 1
    /// --top-k 256` came out wrong there from row ~380 on); more queries, never fewer
    /// iterations.
    #[test]
    fn tile_iterations_against_the_llvmpipe_limit() {
        assert!(tile_iterations(4, 4, 128, 34, 64, 16) < 65535 / 2);
        assert!(tile_iterations(1, 1, 16, 514, 1, 256) > 65535);
        for t in 1..8 {
            assert!(
                tile_iterations(t + 1, 2, 64, 34, 64, 16) >= tile_iterations(t, 2, 64, 34, 64, 16)
            );
        }
    }

    /// The portable kernel's workgroup variables (naga's sizes, the constants [`record`]
    /// builds substituted) fit what [`wg_bytes`] charges, for every tile [`fit_tile`] may pick
    /// (1 to 32 / GQ queries): GQA groups 1 to 32, head dims 16 to 256 (some not multiples of
    /// the staging width), MC 9 to 130.
    #[test]
    fn wg_bytes_covers_the_shader() {
        let mut checked = 0;
        for (gq, d, mc) in [
            (4, 128, 34),
            (1, 64, 9),
            (32, 128, 34),
            (7, 80, 130),
            (2, 256, 51),
            (16, 16, 10),
        ] {
            for t in 1..=MAX_QG / gq {
                let c = consts(t, gq, d, mc);
                let charged = wg_bytes(t, gq, d, mc);
                assert_workgroup_fits(
                    &SHADER,
                    "leaf_select",
                    Storage::F32,
                    &c,
                    charged,
                    "wg_bytes",
                );
                checked += 1;
            }
        }
        assert!(checked >= 50, "only {checked} tiles checked");
    }
}
