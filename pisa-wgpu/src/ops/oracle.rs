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
        // A reserve below the limit, as the backward pass keeps: the count follows llvmpipe's
        // loop limiter and its unrolling as measured, not as specified. A refusal reports the
        // count with the reserve against the device's cap (as the backward pass does).
        let reserve = Context::loop_reserve(limit);
        if needed > limit - reserve {
            return Err(ctx.loop_limit_error(
                "oracle",
                "selection",
                (needed + reserve, limit),
                "use a GPU, or fewer keys, a smaller head dim or GQA group, or a smaller block \
                 size (each invocation walks whole leaves: fewer than 64 leaves give each one \
                 leaf of C keys)",
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

/// GQA groups up to which llvmpipe (LLVM 15) unrolls the oracle's loops over the group's heads
/// (their trip count is the shader constant GQ): measured on lavapipe (2026-12-07), a group of
/// 32 over 4000 keys at D 16 gave the reference's masses, a group of 33 rows summing to 0.63.
const GQ_UNROLLED: u64 = 32;

/// The loop iterations one invocation of the oracle's kernels runs, at most (the larger of its
/// two entry points, `shaders/oracle.wgsl`), for `nk` keys in `nb0` leaves of `c`, head dim `d`,
/// GQA group `gq` and `k` picks, as llvmpipe's loop limiter counts them: every loop an
/// invocation enters costs one count more than its iterations (its exit test), and the loops
/// over the group's heads count only past [`GQ_UNROLLED`] heads (below it llvmpipe unrolls
/// them). `oracle_mass`: Q's load, the pass over its strided keys (each a dot product of D
/// terms), the group's LSEs, then its strided leaves (each every key of the leaf);
/// `oracle_topk`: K rounds over its strided leaves and the tree, then the picks' order.
/// Checked on lavapipe (2026-12-07, two queries against the CPU reference): at D 128, GQA 4,
/// C 64, K 16, 15600 keys (65,151 by this count) right and 15800 (65,541) wrong, where the
/// count without exit tests put both below 65535; a group of 33 at D 16 over 2000 keys
/// (60,694) right and over 4000 (80,224) wrong. [`record`] keeps a reserve of 1/16 of the limit below it, as the backward pass does.
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
    // A loop of n iterations, each of `body` counts: n (1 + body) + 1 (the exit test).
    let lp = |n: u64, body: u64| n * (1 + body) + 1;
    // A loop over the group's heads: none where llvmpipe unrolls it.
    let heads = if gq > GQ_UNROLLED { lp(gq, 0) } else { 0 };
    // One key's score for every head: the accumulators' reset, the dot product (its loop over
    // the heads inside each of D steps), the heads' update.
    let key = heads + lp(d, heads) + heads;
    let mass = lp((gq * d).div_ceil(wg), 0)
        + heads
        + lp(nk.div_ceil(wg), key)
        + heads
        + lp(gq.div_ceil(wg), 2 * lp(wg, 0))
        + lp(nb0.div_ceil(wg), lp(c, key));
    let n = k.min(nb0);
    let tree = lp(wg.ilog2() as u64, 0);
    let topk = lp(n, lp(nb0.div_ceil(wg), 0) + tree) + lp(k.div_ceil(wg), lp(n, 0));
    mass.max(topk)
}

#[cfg(test)]
mod tests {
    use super::loop_iterations;

    /// The count against llvmpipe's 65535 less the reserve (61,441): 12000 keys at D 128 (GQA
    /// 4, C 64) and 7000 leaves of one key at D 16 (which the old top-k pass, a rank over every
    /// leaf for each, ran past) fit; 15800 keys at D 128, which came out wrong, do not; a
    /// group of 33 heads, whose loops llvmpipe does not unroll, counts them.
    #[test]
    fn oracle_loops_against_the_llvmpipe_cap() {
        let cap = 65535 - 65535 / 16;
        assert!(loop_iterations(12000, 188, 64, 128, 4, 16) <= cap);
        assert!(loop_iterations(7000, 7000, 1, 16, 1, 64) <= cap);
        assert!(loop_iterations(15800, 247, 64, 128, 4, 16) > 65535);
        assert!(loop_iterations(4000, 63, 64, 16, 33, 4) > cap);
        assert!(loop_iterations(4000, 63, 64, 16, 32, 4) <= cap);
    }
}
