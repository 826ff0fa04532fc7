//! The key-block-major index of a selection (shader `shaders/backward_index.wgsl`), the input
//! of the dK/dV pass of the backward (PISA.md section 4): for every (b, KV head) the selection's
//! entries as `(block, query)` pairs, stably sorted by block, so the queries that selected a
//! block are contiguous and in query order.
//!
//! Built on the GPU by a least-significant-digit radix sort on 4-bit digits of the block index
//! (`ceil(bits(nb_0) / 4)` passes of count, exclusive scan and stable scatter, the ranks from
//! integer workgroup scans): O(Nq * K) work per pass and bitwise deterministic.

use bytemuck::{Pod, Zeroable};
use pisa_core::{AttentionShape, SelectionConfig};

use crate::error::Result;
use crate::runtime::buffers::{GpuTensor, Stage, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/backward_index.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "backward_index",
    wgsl: include_str!("../../../../shaders/backward_index.wgsl"),
};

/// Invocations per workgroup (`WG` of the shader).
const WG: u64 = 128;
/// Entries per sort tile (`TILE` = WG * ITEMS of the shader).
const TILE: usize = 1024;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct Params {
    q_len: u32,
    top_k: u32,
    entries: u32,
    num_bh: u32,
    nb0: u32,
    block_size: u32,
    q_offset: u32,
    causal: u32,
    tiles: u32,
    shift: u32,
    wg_count: u32,
    pad: u32,
}

/// The sorted index of one selection.
#[derive(Debug)]
pub struct BlockIndex {
    /// `(block, query)` u32 pairs, `[B * Hkv, Nq * K, 2]`: per (b, KV head), sorted by block
    /// and, within a block, by query. Entries that select nothing (padding -1, an index outside
    /// `0..nb_0`, a block wholly after the query when causal, a slot repeating an earlier one
    /// of its row) carry block `nb_0` and sort last. `len` counts u32 words.
    pub pairs: GpuTensor,
    /// Entries per (b, KV head): `Nq * K`.
    pub entries: usize,
}

/// Records the passes that build the [`BlockIndex`] of `selection` (i32 `[B, Hkv, Nq, K]`,
/// `K = cfg.top_k`, the layout of a selection op's output) for `shape` and `cfg` (block size,
/// causality). Passes are labelled "backward" in `prof`.
///
/// Errors: shape errors as [`AttentionShape::new`], [`crate::GpuError::Limit`] when the pairs (8 bytes per entry) exceed a storage
/// binding, [`pisa_core::PisaError::TooLarge`] past u32 indexing, configuration errors,
/// [`crate::GpuError::Validation`] for a selection the passes cannot bind (a buffer without
/// STORAGE usage, of another device, or destroyed). Everything is built before anything is
/// recorded: nothing is recorded on error.
pub fn record_block_index(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    selection: &GpuTensor,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
    mut prof: Option<&mut Profiler>,
) -> Result<BlockIndex> {
    let (index, stages) = ctx.scope_now("backward block index", || {
        build_block_index(ctx, selection, shape, cfg)
    })?;
    ctx.check_step()?;
    for stage in &stages {
        ctx.record_pass(enc, "backward", [stage], prof.as_deref_mut());
    }
    Ok(index)
}

/// The [`BlockIndex`] of [`record_block_index`] and the dispatches that build it, in order
/// (one pass each), built but not recorded; the caller runs it under an error scope, where the
/// bind groups' validation errors are caught.
pub(super) fn build_block_index(
    ctx: &Context,
    selection: &GpuTensor,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> Result<(BlockIndex, Vec<Stage>)> {
    cfg.validate()?;
    shape.validate()?;
    let entries = shape.q_len * cfg.top_k;
    let num_bh = shape.batch * shape.kv_heads;
    let total = super::check_u32("selection entries", num_bh as u64 * entries as u64 * 2)?;
    selection.check_shape("selection", total / 2)?;
    let nb0 = shape.k_len.div_ceil(cfg.block_size);
    let tiles = entries.div_ceil(TILE);
    let a = ctx.alloc("backward index a", total, Storage::F32, POISON_I32)?;
    let b = ctx.alloc("backward index b", total, Storage::F32, POISON_I32)?;
    let hist = ctx.alloc("backward index hist", num_bh * 16 * tiles, Storage::F32, 0)?;
    let base = Params {
        q_len: shape.q_len as u32,
        top_k: cfg.top_k as u32,
        entries: entries as u32,
        num_bh: num_bh as u32,
        nb0: nb0 as u32,
        block_size: cfg.block_size as u32,
        q_offset: (shape.k_len - shape.q_len) as u32,
        causal: cfg.causal as u32,
        tiles: tiles as u32,
        ..Default::default()
    };
    let pipe = |entry| {
        ctx.pipelines
            .get(&ctx.device, &SHADER, entry, Storage::F32, &[], &[])
    };
    let (init, digit_hist) = (pipe("init_pairs")?, pipe("digit_hist")?);
    let (digit_scan, digit_scatter) = (pipe("digit_scan")?, pipe("digit_scatter")?);
    let u = ctx.uniform("backward index params", &base)?;
    let bits = 32 - (nb0 as u32).leading_zeros();
    let tiles_wg = (num_bh * tiles) as u64;
    let groups = (total as u64 / 2).div_ceil(WG);
    let bind = [(0, &u), (1, &selection.buffer), (3, &a.buffer)];
    let mut stages = vec![ctx.stage(&init, &bind, groups)?];
    let (mut src, mut dst) = (&a, &b);
    for pass in 0..bits.div_ceil(4) {
        let p = Params {
            shift: 4 * pass,
            wg_count: tiles_wg as u32,
            ..base
        };
        let u = ctx.uniform("backward index params", &p)?;
        let bind = [(0, &u), (2, &src.buffer), (4, &hist.buffer)];
        stages.push(ctx.stage(&digit_hist, &bind, tiles_wg)?);
        let bind = [(0, &u), (4, &hist.buffer)];
        stages.push(ctx.stage(&digit_scan, &bind, num_bh as u64)?);
        let bind = [
            (0, &u),
            (2, &src.buffer),
            (3, &dst.buffer),
            (4, &hist.buffer),
        ];
        stages.push(ctx.stage(&digit_scatter, &bind, tiles_wg)?);
        std::mem::swap(&mut src, &mut dst);
    }
    let pairs = if std::ptr::eq(src, &a) { a } else { b };
    Ok((BlockIndex { pairs, entries }, stages))
}
