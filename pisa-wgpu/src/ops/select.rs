//! Block selection on the GPU (PISA.md sections 3 and 5): the host API over the PISA two-stage
//! prefill selection ([`super::route`] then [`super::leaf_select`]), the BSA baseline
//! ([`super::bsa`]) and the full-attention oracle ([`super::oracle`]).
//!
//! Every selection is `[B, Hkv, Nq, K]` i32: per (sequence, KV head, query) the selected leaf
//! blocks in ascending order, padded with -1 (PISA.md 3.4), equal to the CPU reference
//! (`pisa_core::reference::select_pisa`, `select_bsa`, `select_oracle`) up to near-ties.

use pisa_core::{AttentionShape, PisaError, PyramidLayout, SelectionConfig, TensorLayout};

use super::pyramid::{self, GpuPyramid, KeyGeometry};
use super::{bsa, leaf_select, oracle, route};
use crate::error::Result;
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;
use crate::runtime::view::KernelLayout;

pub(crate) mod all_leaves;
mod plan;

pub(crate) use all_leaves::{every_leaf_selected, record as record_all_leaves};
pub(crate) use plan::{fit_tile, plan, Plan, SelParams};

/// Largest head dimension the selection kernels accept.
pub const MAX_HEAD_DIM: usize = 512;
/// Default query tile of stage 2 (PISA.md 5: Qtile = 4).
pub const DEFAULT_Q_TILE: usize = 4;

/// Which block selection to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Method {
    /// PISA: stage 1 routing through the pyramid, stage 2 exact leaf LSE (PISA.md 3, 5).
    #[default]
    Pisa,
    /// The BSA baseline: every complete-past leaf scored by `s * q.mu` (PISA.md 3).
    Bsa,
    /// The full-attention oracle: top K leaves by softmax mass, no forced leaves.
    Oracle,
}

/// Memory layouts of Q and K, and the allocated token length of K's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layouts {
    /// Layout of Q (`Hq` heads, `Nq` tokens).
    pub q: KernelLayout,
    /// Layout of K (`Hkv` heads, `k_tokens` tokens, of which the first `Nk` are valid).
    pub k: KernelLayout,
    /// Tokens of K's token dimension (`>= Nk`; `Nk` for prefill, a capacity for a KV cache).
    pub k_tokens: usize,
}

impl Layouts {
    /// Q and K both in `layout`, K holding exactly `shape.k_len` tokens.
    pub fn new(layout: TensorLayout, shape: &AttentionShape) -> Self {
        Self {
            q: layout.into(),
            k: layout.into(),
            k_tokens: shape.k_len,
        }
    }
}

/// Records the selection `method` into `enc` and returns the indices tensor
/// `[B, Hkv, Nq, K]` i32 (ascending, -1 padded; PISA.md 3.4).
///
/// `q`: `[B, Hq, Nq, D]` in `layouts.q`; `k`: `[B, Hkv, layouts.k_tokens, D]` in `layouts.k`,
/// same storage; `pyramid`: built over the first `Nk` keys of `k` (needed by PISA and BSA, with
/// second moments for `meanvar`); `q_tile`: queries per workgroup of PISA stage 2 (at least 1,
/// for every method; clamped to what fits in workgroup memory; results do not depend on it).
/// Profiler stages: "route", "leaf_select" (tile order) or "leaf_bucket", "leaf_score" and
/// "leaf_pick" (leaf-major order), "bsa", "oracle".
///
/// Errors: configuration and shape errors ([`crate::GpuError::Input`]: buffer lengths, head dim
/// above [`MAX_HEAD_DIM`], forced blocks above K, missing or mismatched pyramid,
/// [`PisaError::Zero`] `{ what: "q_tile" }` for a `q_tile` of 0, as [`super::prefill::prefill_host`]),
/// [`crate::GpuError::Unsupported`] (q and k in different storages; PISA with more than
/// [`super::route::MAX_GQ`] query heads per KV head), [`crate::GpuError::Limit`] for buffers or
/// workgroup memory beyond the device's limits, or, on a device that caps a shader
/// invocation's loop iterations ([`crate::Context::loop_limit`]: llvmpipe), for a selection
/// whose kernel would pass the cap even one query at a time (BSA and the oracle over many
/// leaves, the tile order's leaf stage past its leaf-major fallback).
///
/// Performance note: the kernels stage key / mean rows through workgroup memory with coalesced
/// reads and unroll their accumulators by hand; on NVIDIA through Vulkan they run several times
/// faster when the pipeline cache creates modules without wgpu's runtime checks (loop bounding
/// keeps the driver from unrolling).
#[allow(clippy::too_many_arguments)]
pub fn select(
    ctx: &Context,
    q: &GpuTensor,
    k: &GpuTensor,
    pyramid: Option<&GpuPyramid>,
    shape: &AttentionShape,
    layouts: &Layouts,
    cfg: &SelectionConfig,
    method: Method,
    q_tile: usize,
    enc: &mut wgpu::CommandEncoder,
    mut prof: Option<&mut Profiler>,
) -> Result<GpuTensor> {
    let _call = ctx.public_call()?;
    check_q_tile(q_tile)?;
    let plan = plan(q, k, pyramid, shape, layouts, cfg, method)?;
    match method {
        Method::Pisa => {
            let pyr = pyramid.expect("checked by plan");
            let cand = route::record(ctx, enc, &plan, q, pyr, q_tile, prof.as_deref_mut())?;
            leaf_select::record(ctx, enc, &plan, q, k, &cand, q_tile, prof)
        }
        Method::Bsa => bsa::record(ctx, enc, &plan, q, pyramid.expect("checked by plan"), prof),
        Method::Oracle => Ok(oracle::record(ctx, enc, &plan, q, k, false, prof)?.0),
    }
}

/// Uploads host tensors, builds the pyramid (PISA, BSA), runs `method` and reads the selection
/// back: `[B, Hkv, Nq, K]` i32. `q`, `k`: `[B, Hq, Nq, D]`, `[B, Hkv, Nk, D]` in `layout`,
/// stored on the GPU as `storage`. Errors as [`select`] (a `q_tile` of 0 included, refused
/// before any upload), plus upload and device errors.
#[allow(clippy::too_many_arguments)]
pub fn select_host(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
    storage: Storage,
    method: Method,
    q_tile: usize,
) -> Result<Vec<i32>> {
    let _call = ctx.public_call()?;
    shape.validate()?;
    check_host(q, k, shape)?;
    check_q_tile(q_tile)?;
    let qt = ctx.upload("q", q, storage)?;
    let kt = ctx.upload("k", k, storage)?;
    let layouts = Layouts::new(layout, shape);
    let out = ctx.scoped("select", || {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let pyr = match method {
            Method::Oracle => None,
            _ => Some(build_pyramid(ctx, &mut enc, &kt, shape, layout, cfg)?),
        };
        let sel = select(
            ctx,
            &qt,
            &kt,
            pyr.as_ref(),
            shape,
            &layouts,
            cfg,
            method,
            q_tile,
            &mut enc,
            None,
        )?;
        ctx.queue.submit([enc.finish()]);
        Ok(sel)
    })?;
    ctx.read_i32(&out)
}

/// The oracle on host tensors: the selection `[B, Hkv, Nq, K]` i32 and the leaf mass
/// `[B, Hkv, Nq, nb0]` f32 (rows sum to 1). Arguments and errors as [`select_host`].
pub fn oracle_host(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
    storage: Storage,
) -> Result<(Vec<i32>, Vec<f32>)> {
    let _call = ctx.public_call()?;
    shape.validate()?;
    cfg.validate()?;
    check_host(q, k, shape)?;
    let qt = ctx.upload("q", q, storage)?;
    let kt = ctx.upload("k", k, storage)?;
    let layouts = Layouts::new(layout, shape);
    let (sel, mass) = ctx.scoped("oracle", || {
        let plan = plan(&qt, &kt, None, shape, &layouts, cfg, Method::Oracle)?;
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let r = oracle::record(ctx, &mut enc, &plan, &qt, &kt, true, None)?;
        ctx.queue.submit([enc.finish()]);
        Ok(r)
    })?;
    let mass = mass.expect("requested");
    Ok((ctx.read_i32(&sel)?, ctx.read_f32(&mass)?))
}

/// A `q_tile` of 0 is refused ([`PisaError::Zero`]), by selection and prefill alike.
fn check_q_tile(q_tile: usize) -> Result<()> {
    if q_tile == 0 {
        return Err(PisaError::Zero { what: "q_tile" }.into());
    }
    Ok(())
}

fn check_host(q: &[f32], k: &[f32], shape: &AttentionShape) -> Result<()> {
    for (what, actual, expected) in [
        ("q", q.len(), shape.q_elems()),
        ("k", k.len(), shape.kv_elems()),
    ] {
        crate::runtime::buffers::check_len(what, actual, expected)?;
    }
    Ok(())
}

/// Allocates and records the pyramid of `k` (`[B, Hkv, Nk, D]` in `layout`) for `cfg`, with
/// second moments when `cfg.scoring` is `meanvar`.
pub fn build_pyramid(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    k: &GpuTensor,
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
) -> Result<GpuPyramid> {
    let _call = ctx.public_call()?;
    shape.validate()?;
    cfg.validate()?;
    let lay = PyramidLayout::new(shape.k_len, cfg.block_size, cfg.merge_factor)?;
    let geo = KeyGeometry {
        batch: shape.batch,
        kv_heads: shape.kv_heads,
        tokens: shape.k_len,
        head_dim: shape.head_dim,
        layout: layout.into(),
    };
    let with_sq = cfg.scoring == pisa_core::Scoring::MeanVar;
    let pyr = pyramid::alloc(ctx, lay, &geo, with_sq)?;
    pyramid::record_build(ctx, enc, k, &geo, shape.k_len, &pyr, None)?;
    Ok(pyr)
}
