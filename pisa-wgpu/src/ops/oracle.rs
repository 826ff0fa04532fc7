//! Oracle block selection for quality measurement (PISA.md section 3, "Quality"): full-attention
//! leaf mass averaged over the GQA group, top K by mass; shader `shaders/oracle.wgsl`.

use super::select::{fit_tile, Plan};
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_F32, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/oracle.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "oracle",
    wgsl: concat!(
        include_str!("../../../shaders/select_common.wgsl"),
        include_str!("../../../shaders/oracle.wgsl")
    ),
};

const WG: u32 = 64;

/// Records the oracle: returns the selection `[B, Hkv, Nq, K]` i32 (ascending, -1 padded, no
/// forced leaves) and, when `want_mass`, the mass `[B, Hkv, Nq, nb0]` f32 (each row sums to 1;
/// causal when configured). Cost O(B * Hq * Nq * Nk * D). Profiler stage "oracle".
/// Errors: [`crate::GpuError::Limit`] when the mass matrix or workgroup memory is too large.
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    plan: &Plan,
    q: &GpuTensor,
    k: &GpuTensor,
    want_mass: bool,
    mut prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, Option<GpuTensor>)> {
    let (gq, d, kk) = (plan.gq, plan.params.head_dim, plan.params.top_k);
    fit_tile(ctx, "oracle", 1, |_| {
        4 * (gq * d + 2 * WG * gq + gq + kk) as u64
    })?;
    let rows = plan.bh as usize * plan.shape.q_len;
    let nb0 = plan.params.nb0 as usize;
    let mass = ctx.alloc("oracle mass", rows * nb0, Storage::F32, POISON_F32)?;
    let sel = ctx.alloc(
        "selection",
        plan.sched.selection_len(&plan.shape),
        Storage::F32,
        POISON_I32,
    )?;
    let consts = [("GQ", gq), ("KS", kk), ("QBUF", gq * d)];
    let get = |entry| {
        ctx.pipelines
            .get(&ctx.device, &SHADER, entry, plan.storage, &consts, &[])
    };
    let (pm, pt) = (get("oracle_mass")?, get("oracle_topk")?);
    let p = plan.tiled(1);
    let u = ctx.uniform("oracle params", &p)?;
    let b: [(u32, Bind<'_>); 4] = [
        (0, (&u).into()),
        (1, q.into()),
        (2, k.into()),
        (3, (&mass.buffer).into()),
    ];
    let timer = prof.as_deref_mut().map(|pr| (pr, "oracle"));
    ctx.dispatch(enc, &pm, &b, p.wg_count as u64, timer)?;
    let b = [(0, &u), (3, &mass.buffer), (4, &sel.buffer)];
    ctx.dispatch(
        enc,
        &pt,
        &b,
        p.wg_count as u64,
        prof.map(|pr| (pr, "oracle")),
    )?;
    Ok((sel, want_mass.then_some(mass)))
}
