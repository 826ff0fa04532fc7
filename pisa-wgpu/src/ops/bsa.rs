//! The BSA selection baseline (PISA.md section 3): every complete-past leaf scored by
//! `s * q.mu_leaf` summed over the GQA group, top K - |forced| with the forced leaves; shader
//! `shaders/bsa.wgsl`.

use super::pyramid::GpuPyramid;
use super::select::{fit_tile, Plan};
use crate::error::Result;
use crate::runtime::buffers::{GpuTensor, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/bsa.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "bsa",
    wgsl: include_str!("../../../shaders/bsa.wgsl"),
};

/// Queries per BSA workgroup at most: each leaf mean read serves all of them.
pub const BSA_TILE: usize = 8;
const WG: u32 = 64;

fn wg_bytes(t: u32, d: u32, k: u32) -> u64 {
    4 * (t * d + 4 * t * k + t + 2 * t * WG + t) as u64
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
    let consts = [("GQ", gq), ("QB", t), ("KS", k), ("QBUF", t * d)];
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "bsa", plan.storage, &consts, &[])?;
    let p = plan.tiled(t);
    let u = ctx.uniform("bsa params", &p);
    let b = [
        (0, &u),
        (1, &q.buffer),
        (2, &pyr.means.buffer),
        (3, &sel.buffer),
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
