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

/// Records BSA selection from the pyramid's leaf means and returns `[B, Hkv, Nq, K]` i32,
/// ascending, -1 padded. Profiler stage "bsa". Errors: [`crate::GpuError::Limit`].
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
