//! Split-K dense attention (FlashDecoding; PISA.md sections 4 and 5) for few queries against
//! many keys: the decode baseline (one query, up to a million keys), where the tile kernel
//! gives one workgroup per (KV head, query tile) and walks every key serially.
//!
//! Two dispatches, recorded as ONE compute pass labelled "dense" (the tile kernel's label):
//! 1. `partial` (`shaders/attention_split.wgsl`): one workgroup per (batch, KV head, split of
//!    `split_keys` keys, block of 4 rows (query head, query)) writes the partial online-softmax
//!    state (unnormalised O, running max m, sum l; f32) of each of its rows over the split's
//!    visible keys to scratch ([`Context::scratch`]). Memory-bound design: K and V rows are
//!    read with contiguous 16-byte loads by D / 8 lanes per key, the next batch of keys in
//!    flight in registers while one is used, and the 4 rows are vector components, never a
//!    dynamically indexed array (register spills);
//! 2. `merge` (`shaders/attention_split_merge.wgsl`): per (batch, query head, query), M = max m,
//!    L = sum l e^(m - M), O = sum O e^(m - M) / L, LSE = M + ln L.
//!
//! Outputs, layouts, storages, head dims, masking, the empty-row convention (O = 0, LSE = -inf)
//! and errors are those of [`super::record_dense_attention`]. The (batch, KV head) pairs run in
//! ranges whose partial states fit one storage binding, reusing one scratch buffer.
//! Deterministic: every sum is in a fixed order.
//!
//! [`super::record_attention`] runs this path for dense calls with `tiling: None` where
//! `plan` returns a plan (the rule is on `plan`); [`record_split_k`] runs it with an
//! explicit plan.

use bytemuck::{Pod, Zeroable};
use pisa_core::{AttentionShape, PisaError};

use super::{element_strides, u32_of, validate, AttentionKind, QkvLayouts};
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_F32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

mod plan;

pub use plan::{
    plan, tile_workgroups, SplitK, MAX_ROWS, MIN_KEYS, MIN_SPLIT, TARGET_WORKGROUPS,
    TILE_WORKGROUPS_BELOW,
};
use plan::{variant, ROWS_PER_WG};

/// `shaders/attention_split.wgsl` (the partial states).
pub const SHADER: ShaderSource = ShaderSource {
    name: "attention_split",
    wgsl: concat!(
        include_str!("../../../../shaders/attention_split.wgsl"),
        include_str!("../../../../shaders/attention_split_common.wgsl")
    ),
};

/// `shaders/attention_split_merge.wgsl` (the merge over the splits).
pub const MERGE_SHADER: ShaderSource = ShaderSource {
    name: "attention_split_merge",
    wgsl: concat!(
        include_str!("../../../../shaders/attention_split_merge.wgsl"),
        include_str!("../../../../shaders/attention_split_common.wgsl")
    ),
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct SplitParams {
    q_s: [u32; 3],
    k_s: [u32; 3],
    v_s: [u32; 3],
    kv_heads: u32,
    q_heads: u32,
    group: u32,
    q_len: u32,
    k_len: u32,
    rows: u32,
    rblocks: u32,
    rb: u32,
    split_keys: u32,
    n_splits: u32,
    causal: u32,
    pair0: u32,
    wg_count: u32,
    scale_log2: f32,
    head_dim: u32,
}

/// Records split-K dense attention with an explicit plan (tests and tuning; the default path
/// picks one with `plan`; f32 or f16 storage). Arguments, outputs (O in Q's layout and storage, LSE f32
/// `[B, Hq, Nq]`, freshly allocated and poisoned), profiler stage ("dense") and errors as
/// [`super::record_dense_attention`], plus [`PisaError::InvalidValue`] for a zero
/// `split_keys` or `pairs_per_range`, [`crate::GpuError::Limit`] when one range's partial states
/// exceed the storage-binding limit or the kernel does not fit the workgroup memory, and
/// [`PisaError::TooLarge`] past u32 indexing.
#[allow(clippy::too_many_arguments)]
pub fn record_split_k(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    shape: &AttentionShape,
    layouts: QkvLayouts,
    (causal, scale): (bool, f32),
    plan: &SplitK,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    validate(
        shape,
        q,
        k,
        v,
        layouts,
        &AttentionKind::Dense { causal, scale },
    )?;
    if plan.split_keys == 0 || plan.pairs_per_range == 0 {
        return Err(PisaError::InvalidValue {
            what: "split-K split_keys and pairs_per_range must be positive",
        }
        .into());
    }
    record(
        ctx,
        enc,
        [q, k, v],
        shape,
        layouts,
        (causal, scale),
        plan,
        prof,
    )
}

/// [`record_split_k`] after validation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    [q, k, v]: [&GpuTensor; 3],
    s: &AttentionShape,
    layouts: QkvLayouts,
    (causal, scale): (bool, f32),
    plan: &SplitK,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    super::check_o_is_q(layouts)?;
    let (g, d) = (s.gqa_group(), s.head_dim);
    let rows = g * s.q_len;
    let var = variant(ctx, d, q.storage)?;
    let (rb, pairs) = (ROWS_PER_WG, s.batch * s.kv_heads);
    let rblocks = rows.div_ceil(rb);
    let n_splits = s.k_len.div_ceil(plan.split_keys);
    let ppr = plan.pairs_per_range.min(pairs);
    let states = [ppr, rblocks, n_splits, rb]
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .and_then(|n| n.checked_mul(d))
        .ok_or(PisaError::TooLarge {
            what: "split-K partial states",
            value: u64::MAX,
            limit: u32::MAX as u64,
        })?;
    u32_of("split-K partial elements", states)?;
    let o = ctx.alloc("attention O", s.q_elems(), q.storage.output(), POISON_F32)?;
    let lse = ctx.alloc("attention LSE", s.lse_elems(), Storage::F32, POISON_F32)?;
    // Written before read: the merge reads only states the partial dispatch wrote.
    let opart = ctx.scratch("split-K partial O", states, Storage::F32)?;
    let ml = ctx.scratch("split-K partial m, l", 2 * (states / d), Storage::F32)?;
    // Element strides (below the element counts, which `validate` checked to fit u32).
    let base = SplitParams {
        q_s: element_strides(layouts.q, s.q_heads, s.q_len, d),
        k_s: element_strides(layouts.k, s.kv_heads, s.k_len, d),
        v_s: element_strides(layouts.v, s.kv_heads, s.k_len, d),
        kv_heads: s.kv_heads as u32,
        q_heads: s.q_heads as u32,
        group: g as u32,
        q_len: s.q_len as u32,
        k_len: s.k_len as u32,
        rows: u32_of("split-K rows", rows)?,
        rblocks: rblocks as u32,
        rb: rb as u32,
        split_keys: u32_of("split-K split size", plan.split_keys.min(s.k_len))?,
        n_splits: n_splits as u32,
        causal: causal as u32,
        scale_log2: scale * std::f32::consts::LOG2_E,
        head_dim: d as u32,
        ..Default::default()
    };
    let partial = ctx.pipelines.get(
        &ctx.device,
        &SHADER,
        "partial",
        q.storage,
        &var.consts(),
        &[],
    )?;
    let merge = ctx
        .pipelines
        .get(&ctx.device, &MERGE_SHADER, "merge", q.storage, &[], &[])?;
    let (op, mb) = (&opart.buffer, &ml.buffer);
    let mut steps = Vec::new();
    for pair0 in (0..pairs).step_by(ppr) {
        let np = ppr.min(pairs - pair0);
        let mut pp = base;
        pp.pair0 = pair0 as u32;
        pp.wg_count = u32_of("split-K workgroups", np * rblocks * n_splits)?;
        let wg = pp.wg_count as u64;
        let u_part = ctx.uniform("split-K params", &pp)?;
        pp.wg_count = u32_of("split-K merge workgroups", np * rows)?;
        let u_merge = ctx.uniform("split-K merge params", &pp)?;
        let b: [(u32, Bind<'_>); 6] = [
            (0, (&u_part).into()),
            (1, q.into()),
            (2, k.into()),
            (3, v.into()),
            (4, op.into()),
            (5, mb.into()),
        ];
        steps.push(ctx.stage(&partial, &b, wg)?);
        let b = [
            (0, &u_merge),
            (4, op),
            (5, mb),
            (6, &o.buffer),
            (7, &lse.buffer),
        ];
        steps.push(ctx.stage(&merge, &b, pp.wg_count as u64)?);
    }
    ctx.record_pass(enc, "dense", &steps, prof);
    Ok((o, lse))
}
