//! The selection of a call in which no query sees more than K leaves: every query keeps every
//! leaf it sees (PISA.md 3.3), so the route and the leaf stage, whose scores cannot change it,
//! are skipped and the rows are written directly (`shaders/select_all.wgsl`, one dispatch).
//! The prefill takes this path, with dense attention over the same keys, for prompts of at
//! most K * C tokens (`super::super::prefill`).

use bytemuck::{Pod, Zeroable};
use pisa_core::{AttentionShape, PisaError, SelectionConfig};

use crate::error::Result;
use crate::runtime::buffers::{GpuTensor, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/select_all.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "select_all",
    wgsl: include_str!("../../../../shaders/select_all.wgsl"),
};

/// Entries a workgroup writes, one an invocation (the shader's `WG`).
const ENTRIES_PER_WORKGROUP: u64 = 64;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    rows: u32,
    q_len: u32,
    q_pos0: u32,
    block_size: u32,
    top_k: u32,
    nb0: u32,
    causal: u32,
    pad: u32,
}

/// Whether every query of `shape` keeps every leaf it sees under `cfg`: the leaves of its keys,
/// `ceil(Nk / C)`, number at most K (PISA.md 3.3). Then every selection method gives the same
/// rows (all visible leaves, ascending), and sparse attention over them is dense attention
/// (causal as `cfg`) over the same keys.
pub(crate) fn every_leaf_selected(shape: &AttentionShape, cfg: &SelectionConfig) -> bool {
    shape.k_len.div_ceil(cfg.block_size) <= cfg.top_k
}

/// Records the selection `[B, Hkv, Nq, K]` i32 of a call for which [`every_leaf_selected`]
/// holds (the caller checks): per row, leaves `0 ..= last` ascending then -1, `last` the
/// query's own leaf `(Nk - Nq + i) / C` when causal, `ceil(Nk / C) - 1` otherwise. Profiler stage
/// "select_all". Errors: [`PisaError::TooLarge`] for a selection past u32 indexing, device
/// limits.
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
    prof: Option<&mut Profiler>,
) -> Result<GpuTensor> {
    let rows = shape.batch * shape.kv_heads * shape.q_len;
    let len = rows * cfg.top_k;
    if u32::try_from(len).is_err() {
        return Err(PisaError::TooLarge {
            what: "selection entries",
            value: len as u64,
            limit: u32::MAX as u64,
        }
        .into());
    }
    let sel = ctx.alloc("selection", len, Storage::F32, POISON_I32)?;
    let p = Params {
        rows: rows as u32,
        q_len: shape.q_len as u32,
        q_pos0: (shape.k_len - shape.q_len) as u32,
        block_size: cfg.block_size as u32,
        top_k: cfg.top_k as u32,
        nb0: shape.k_len.div_ceil(cfg.block_size) as u32,
        causal: cfg.causal as u32,
        pad: 0,
    };
    let u = ctx.uniform("select_all params", &p)?;
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "main", Storage::F32, &[], &[])?;
    let groups = (len as u64).div_ceil(ENTRIES_PER_WORKGROUP);
    let timer = prof.map(|pr| (pr, "select_all"));
    ctx.dispatch(enc, &pipe, &[(0, &u), (1, &sel.buffer)], groups, timer)?;
    Ok(sel)
}
