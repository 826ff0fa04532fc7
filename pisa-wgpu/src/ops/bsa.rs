//! The BSA selection baseline (PISA.md section 3): every complete-past leaf scored by
//! `s * q.mu_leaf` summed over the GQA group, top K - |forced| with the forced leaves; shader
//! `shaders/bsa.wgsl`.

use super::pyramid::GpuPyramid;
use super::select::{fit_tile, Plan};
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/bsa.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "bsa",
    wgsl: concat!(
        include_str!("../../../shaders/select_common.wgsl"),
        include_str!("../../../shaders/bsa.wgsl")
    ),
};

/// Queries per BSA workgroup at most: each staged leaf mean serves all of them (the shader
/// unrolls eight vec4 accumulators, so at most 32).
pub const BSA_TILE: usize = 16;
const WG: u32 = 64;
const DC: u32 = 32;

/// Vec4 slots of the query-sum buffer for a tile of `t` queries.
fn q_slots(t: u32, d: u32) -> u32 {
    t.div_ceil(4) * d.div_ceil(DC) * DC
}

/// Workgroup bytes of the BSA kernel for a tile of `t` queries and top_k `k`.
fn wg_bytes(t: u32, d: u32, k: u32) -> u64 {
    let words =
        4 * q_slots(t, d) + WG * (DC + 1) + 4 * WG * t.div_ceil(4) + 4 * t * k + 5 * t + 2 * t * WG;
    4 * words as u64
}

/// The shader constants of the BSA kernel for a tile of `t` queries.
fn consts(t: u32, gq: u32, d: u32, k: u32) -> [(&'static str, u32); 4] {
    [("GQ", gq), ("QB", t), ("KS", k), ("QBUF", q_slots(t, d))]
}

/// The most loop iterations one invocation of the BSA kernel runs, for a tile of `t` queries,
/// group `gq`, head dim `d`, top_k `k` and `nb0` leaves (the most a tile's queries see): the
/// query-sum staging; per chunk of WG leaves, the head-dim steps, the candidate pass over the
/// tile's queries and the merge, whose rank loops run over at most K kept and WG new
/// candidates; then the output: the kept leaves, each placed among at most K, and for one
/// query the forced leaves, F of them each placed among the at most K - F kept (at most
/// ((K + 1) / 2)^2 in all), and the padding. An upper bound: the merge's rank loops run only
/// for a query that had new candidates in a chunk.
fn tile_iterations(t: u32, gq: u32, d: u32, k: u32, nb0: u64) -> u64 {
    let (t, gq, d, k, wg, dc) = (
        t as u64, gq as u64, d as u64, k as u64, WG as u64, DC as u64,
    );
    let d_p = d.div_ceil(dc) * dc;
    let staging = (t.div_ceil(4) * 4 * d_p).div_ceil(wg) * (1 + gq);
    let merge = (t * (k + wg)).div_ceil(wg) * (1 + k + wg);
    let chunk = 1 + (d_p / dc) * (1 + dc) + t + merge;
    let output = (t * k).div_ceil(wg) * (1 + k) + (k + 1).div_ceil(2).pow(2) + k;
    staging + nb0.div_ceil(wg) * chunk + output
}

/// Records BSA selection from the pyramid's leaf means and returns `[B, Hkv, Nq, K]` i32,
/// ascending, -1 padded. Profiler stage "bsa". Errors: [`crate::GpuError::Limit`], also where
/// the device caps an invocation's loop iterations ([`Context::loop_limit`]) below what one
/// query a workgroup needs (on such a device the tile shrinks until it fits).
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    plan: &Plan,
    q: &GpuTensor,
    pyr: &GpuPyramid,
    prof: Option<&mut Profiler>,
) -> Result<GpuTensor> {
    let (gq, d, k) = (plan.gq, plan.params.head_dim, plan.params.top_k);
    let t = fit_tile(ctx, "bsa", BSA_TILE, |t| wg_bytes(t, d, k))?;
    let count = |t: u32| tile_iterations(t, gq, d, k, plan.params.nb0 as u64);
    let t =
        match ctx.loop_limit() {
            None => t,
            Some(limit) => match (1..=t).rev().find(|&t| count(t) <= limit) {
                Some(t) => t,
                None => return Err(ctx.loop_limit_error(
                    "bsa",
                    "selection",
                    (count(1), limit),
                    "use a GPU, or fewer leaves (fewer keys or a larger block size), a smaller \
                     top_k or a smaller head dim",
                )),
            },
        };
    let len = plan.sched.selection_len(&plan.shape);
    let sel = ctx.alloc("selection", len, Storage::F32, POISON_I32)?;
    let consts = consts(t, gq, d, k);
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "bsa", plan.storage, &consts, &[])?;
    let p = plan.tiled(t);
    let u = ctx.uniform("bsa params", &p)?;
    let b: [(u32, Bind<'_>); 4] = [
        (0, (&u).into()),
        (1, q.into()),
        (2, (&pyr.means.buffer).into()),
        (3, (&sel.buffer).into()),
    ];
    ctx.dispatch(
        enc,
        &pipe,
        &b,
        p.wg_count as u64,
        prof.map(|pr| (pr, "bsa")),
    )?;
    Ok(sel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::pipeline::assert_workgroup_fits;

    /// The loop count against llvmpipe's 65535: the bench's configuration (GQA 4, D 128, K 16)
    /// over 512 leaves (32K keys at C 64) fits with the whole tile, 2560 leaves only with a
    /// smaller one, and 70000 leaves of one key (D 16, K 4) not even one query at a time; the
    /// count grows with the tile.
    #[test]
    fn bsa_loops_against_the_llvmpipe_cap() {
        let cap = 65535;
        assert!(tile_iterations(BSA_TILE as u32, 4, 128, 16, 512) <= cap);
        assert!(tile_iterations(BSA_TILE as u32, 4, 128, 16, 2560) > cap);
        assert!(tile_iterations(1, 4, 128, 16, 2560) <= cap);
        assert!(tile_iterations(1, 1, 16, 4, 70000) > cap);
        // `pisa recall --block-size 1 --top-k 256` over 600 keys at D 16 (tests/cli.rs): one
        // a smaller tile.
        assert!(tile_iterations(BSA_TILE as u32, 1, 16, 256, 600) > cap);
        assert!(tile_iterations(1, 1, 16, 256, 600) <= cap);
        for t in 1..BSA_TILE as u32 {
            assert!(
                tile_iterations(t, 4, 128, 16, 2560) < tile_iterations(t + 1, 4, 128, 16, 2560)
            );
        }
    }

    /// The kernel's workgroup variables (naga's sizes, the constants [`record`] builds
    /// substituted) fit what [`wg_bytes`] charges, for every tile [`fit_tile`] may pick (1 to
    /// [`BSA_TILE`] queries): head dims 16 to 256 (some not multiples of the staging width),
    /// top_k 1 to 64, GQA groups 1 to 8 (not in the accounting: the group only sums scores).
    #[test]
    fn wg_bytes_covers_the_shader() {
        let mut checked = 0;
        for (gq, d, k) in [
            (4, 128, 16),
            (1, 64, 1),
            (8, 80, 64),
            (2, 256, 7),
            (3, 16, 33),
        ] {
            for t in 1..=BSA_TILE as u32 {
                let c = consts(t, gq, d, k);
                let charged = wg_bytes(t, d, k);
                assert_workgroup_fits(&SHADER, "bsa", Storage::F32, &c, charged, "wg_bytes");
                checked += 1;
            }
        }
        assert!(checked >= 50, "only {checked} tiles checked");
    }
}
