//! Validation of a selection call and the parameters its kernels share (the `Params` uniform
//! every selection shader declares), plus the workgroup-memory tile fitting.

use bytemuck::{Pod, Zeroable};
use pisa_core::{AttentionShape, PisaError, PyramidLayout, Schedule, SelectionConfig};

use super::super::pyramid::GpuPyramid;
use super::{Layouts, Method, MAX_HEAD_DIM};
use crate::error::{GpuError, Result};
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;

/// The uniform block every selection shader declares as `Params` (one layout for all four).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct SelParams {
    pub q_sb: u32,
    pub q_sh: u32,
    pub q_sn: u32,
    pub k_sb: u32,
    pub k_sh: u32,
    pub k_sn: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub q_len: u32,
    pub k_len: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub merge: u32,
    pub top_k: u32,
    pub causal: u32,
    pub sink: u32,
    pub local: u32,
    pub nb0: u32,
    pub total_nodes: u32,
    pub start_level: u32,
    pub scoring: u32,
    pub tiles: u32,
    pub wg_count: u32,
    pub scale: f32,
    pub q_pos0: u32,
    pub mc: u32,
    pub routed: u32,
    pub pad1: u32,
    /// O's strides in elements (the attention merge kernels; O is contiguous, Q may not be).
    pub o_sb: u32,
    pub o_sh: u32,
    pub o_sn: u32,
    pub pad2: u32,
    /// Per level: (node offset in the allocation, valid nodes, leaves per node, tokens per node).
    pub levels: [[u32; 4]; 64],
}

/// A validated selection call: parameters, schedule and sizes shared by the kernels.
pub(crate) struct Plan {
    pub params: SelParams,
    pub sched: Schedule,
    pub shape: AttentionShape,
    pub cfg: SelectionConfig,
    pub storage: Storage,
    /// B * Hkv.
    pub bh: u64,
    pub gq: u32,
}

impl Plan {
    /// Parameters with the tile fields of a kernel processing `tile` queries per workgroup.
    pub fn tiled(&self, tile: u32) -> SelParams {
        let tiles = (self.shape.q_len as u32).div_ceil(tile);
        SelParams {
            tiles,
            wg_count: self.bh as u32 * tiles,
            ..self.params
        }
    }
}

fn sat(x: usize) -> u32 {
    x.min(u32::MAX as usize) as u32
}

/// Validates a selection call and builds its [`Plan`]. `pyr` is required for PISA and BSA
/// (with second moments for `meanvar`).
pub(crate) fn plan(
    q: &GpuTensor,
    k: &GpuTensor,
    pyr: Option<&GpuPyramid>,
    shape: &AttentionShape,
    layouts: &Layouts,
    cfg: &SelectionConfig,
    method: Method,
) -> Result<Plan> {
    cfg.validate()?;
    shape.validate()?;
    let s = shape;
    let d = s.head_dim;
    if d > MAX_HEAD_DIM {
        return Err(PisaError::HeadDim {
            head_dim: d,
            supported: "1 to 512",
        }
        .into());
    }
    if layouts.k_tokens < s.k_len {
        return Err(PisaError::BufferLen {
            what: "k tokens (allocated length below k_len)",
            expected: s.k_len,
            actual: layouts.k_tokens,
        }
        .into());
    }
    let len_check = crate::runtime::buffers::check_len;
    crate::ops::attention::check_strided("q", layouts.q)?;
    crate::ops::attention::check_strided("k", layouts.k)?;
    q.check_fits("q")?;
    k.check_fits("k")?;
    // The elements from the first to past the last (the element count when contiguous).
    len_check("q", q.len, layouts.q.span(s.batch, s.q_heads, s.q_len, d))?;
    len_check(
        "k",
        k.len,
        layouts.k.span(s.batch, s.kv_heads, layouts.k_tokens, d),
    )?;
    if q.storage != k.storage {
        return Err(GpuError::Unsupported(
            "q and k in different storage precisions".into(),
        ));
    }
    let valid = PyramidLayout::new(s.k_len, cfg.block_size, cfg.merge_factor)?;
    let sched = Schedule::new(&valid, cfg)?;
    let mut cap = valid;
    if method != Method::Oracle {
        let p = pyr.ok_or(PisaError::InvalidValue {
            what: "PISA and BSA selection need the key pyramid",
        })?;
        cap = p.capacity;
        if cap.block_size() != cfg.block_size
            || cap.merge_factor() != cfg.merge_factor
            || cap.key_len() < s.k_len
        {
            return Err(PisaError::InvalidValue {
                what: "pyramid block size / merge factor / capacity does not match the call",
            }
            .into());
        }
        p.means.check_fits("pyramid means")?;
        if let Some(sq) = &p.sq {
            sq.check_fits("pyramid second moments")?;
        }
        len_check(
            "pyramid means",
            p.means.len,
            s.batch * s.kv_heads * cap.total_nodes() * d,
        )?;
        if method == Method::Pisa && cfg.scoring == pisa_core::Scoring::MeanVar && p.sq.is_none() {
            return Err(PisaError::InvalidValue {
                what: "meanvar scoring needs a pyramid built with second moments",
            }
            .into());
        }
    }
    let (q_sb, q_sh, q_sn) = layouts.q.strides(s.q_heads, s.q_len, d);
    let (k_sb, k_sh, k_sn) = layouts.k.strides(s.kv_heads, layouts.k_tokens, d);
    let mut levels = [[0u32; 4]; 64];
    for (l, lv) in levels.iter_mut().enumerate().take(valid.num_levels()) {
        let lpn = valid.leaves_per_node(l);
        *lv = [
            sat(cap.offset(l)),
            sat(valid.nodes(l)),
            sat(lpn),
            sat(lpn.saturating_mul(cfg.block_size)),
        ];
    }
    let params = SelParams {
        q_sb: q_sb as u32,
        q_sh: q_sh as u32,
        q_sn: q_sn as u32,
        k_sb: k_sb as u32,
        k_sh: k_sh as u32,
        k_sn: k_sn as u32,
        q_heads: s.q_heads as u32,
        kv_heads: s.kv_heads as u32,
        q_len: s.q_len as u32,
        k_len: s.k_len as u32,
        head_dim: d as u32,
        block_size: cfg.block_size as u32,
        merge: cfg.merge_factor as u32,
        top_k: cfg.top_k as u32,
        causal: cfg.causal as u32,
        sink: sat(cfg.sink_blocks),
        local: sat(cfg.local_blocks),
        nb0: valid.leaves() as u32,
        total_nodes: cap.total_nodes() as u32,
        start_level: sched.start_level.unwrap_or(0) as u32,
        scoring: cfg.scoring.code(),
        tiles: 0,
        wg_count: 0,
        scale: cfg.softmax_scale(d),
        q_pos0: (s.k_len - s.q_len) as u32,
        mc: sched.max_candidates as u32,
        routed: sched.start_level.is_some() as u32,
        pad1: 0,
        o_sb: 0,
        o_sh: 0,
        o_sn: 0,
        pad2: 0,
        levels,
    };
    Ok(Plan {
        params,
        sched,
        shape: *s,
        cfg: *cfg,
        storage: q.storage,
        bh: (s.batch * s.kv_heads) as u64,
        gq: s.gqa_group() as u32,
    })
}

/// The largest query tile `t <= max_tile` whose workgroup memory `bytes(t)` fits the device
/// limit. Errors with [`GpuError::Limit`] when even one query does not fit.
pub(crate) fn fit_tile(
    ctx: &Context,
    what: &str,
    max_tile: usize,
    bytes: impl Fn(u32) -> u64,
) -> Result<u32> {
    let dev = ctx.limits().max_compute_workgroup_storage_size as u64;
    (1..=max_tile.max(1) as u32)
        .rev()
        .find(|&t| bytes(t) <= dev)
        .ok_or_else(|| GpuError::Limit {
            what: format!("workgroup memory of {what}"),
            needed: bytes(1),
            limit: dev,
            unit: "bytes",
            hint: "use a smaller head dim, top_k, merge factor or GQA group",
        })
}
