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
/// Errors: [`crate::GpuError::Limit`] when the mass matrix or workgroup memory is too large,
/// or where the device caps an invocation's loop iterations ([`Context::loop_limit`]) below
/// what the kernels run ([`loop_iterations`]).
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
        4 * (gq * d + 2 * WG * gq + gq + kk + 2 * WG) as u64
    })?;
    let rows = plan.bh as usize * plan.shape.q_len;
    let nb0 = plan.params.nb0 as usize;
    let c = plan.params.block_size as usize;
    if let Some(limit) = ctx.loop_limit() {
        let needed = loop_iterations(
            plan.shape.k_len,
            nb0,
            c,
            d as usize,
            gq as usize,
            kk as usize,
        );
        if needed > limit {
            return Err(ctx.loop_limit_error(
                "oracle",
                "selection",
                (needed, limit),
                "use a GPU, or fewer keys, fewer leaves (a larger block size) or a smaller \
                 head dim",
            ));
        }
    }
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

/// The loop iterations one invocation of the oracle's kernels runs, at most (the larger of its
/// two entry points, `shaders/oracle.wgsl`), for `nk` keys in `nb0` leaves of `c`, head dim `d`,
/// GQA group `gq` and `k` picks: `oracle_mass`'s pass over its strided keys (each a dot product
/// of D terms) and over its strided leaves (each every key of the leaf), `oracle_topk`'s K rounds
/// over its strided leaves and the tree. The loops over the GQ heads, whose trip count is a
/// constant of the shader, are not counted: llvmpipe unrolls them. So measured on lavapipe
/// (2026-12-06, the last 256 of N queries, D 128, GQA 4, C 64, against the CPU reference):
/// N = 12000 (48.5K iterations by this count) right, N = 16384 (66.2K) wrong.
pub(crate) fn loop_iterations(
    nk: usize,
    nb0: usize,
    c: usize,
    d: usize,
    gq: usize,
    k: usize,
) -> u64 {
    let (nk, nb0, c, d, gq, k, wg) = (
        nk as u64, nb0 as u64, c as u64, d as u64, gq as u64, k as u64, WG as u64,
    );
    let key = 1 + d;
    let mass = (gq * d).div_ceil(wg)
        + nk.div_ceil(wg) * key
        + gq.div_ceil(wg) * (1 + 2 * wg)
        + nb0.div_ceil(wg) * (1 + c * key);
    let n = k.min(nb0);
    let topk = n * (1 + nb0.div_ceil(wg) + wg.ilog2() as u64) + k.div_ceil(wg) * (1 + n);
    mass.max(topk)
}

#[cfg(test)]
mod tests {
    use super::loop_iterations;

    /// The count against llvmpipe's 65535: 12000 keys at D 128 (GQA 4, C 64) and 7500 leaves of
    /// one key at D 16 (which the old top-k pass, a rank over every leaf for each, ran past) fit;
    /// 16384 keys at D 128 do not.
    #[test]
    fn oracle_loops_against_the_llvmpipe_cap() {
        assert!(loop_iterations(12000, 188, 64, 128, 4, 16) <= 65535);
        assert!(loop_iterations(7500, 7500, 1, 16, 1, 64) <= 65535);
        assert!(loop_iterations(16384, 256, 64, 128, 4, 16) > 65535);
    }
}
