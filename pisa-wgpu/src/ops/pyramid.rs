//! Pyramid build on the GPU (PISA.md section 1); shader `shaders/pyramid.wgsl`.
//!
//! One pass pools the leaf blocks from K, then one pass per coarser level pools the children.
//! Node counts follow [`PyramidLayout`] of the valid length, offsets that of the capacity (so a
//! KV cache can grow inside one allocation).

use bytemuck::{Pod, Zeroable};
use pisa_core::{PisaError, PyramidLayout};

use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_F32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;
use crate::runtime::view::KernelLayout;

/// `shaders/pyramid.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "pyramid",
    wgsl: include_str!("../../../shaders/pyramid.wgsl"),
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct Params {
    k_sb: u32,
    k_sh: u32,
    k_sn: u32,
    kv_heads: u32,
    head_dim: u32,
    k_len: u32,
    block_size: u32,
    merge: u32,
    num_bh: u32,
    nodes: u32,
    node_off: u32,
    child_off: u32,
    child_nodes: u32,
    child_tokens: u32,
    total_nodes: u32,
    wg_count: u32,
}

/// A key pyramid in GPU memory.
#[derive(Debug)]
pub struct GpuPyramid {
    /// Node means, f32 `[B*Hkv, capacity.total_nodes(), D]`.
    pub means: GpuTensor,
    /// Node second moments E[k^2] (same layout), present when built for `meanvar`.
    pub sq: Option<GpuTensor>,
    /// Layout of the allocation (the capacity).
    pub capacity: PyramidLayout,
}

/// Key geometry the pyramid kernels read: strides of K and its head/length counts.
#[derive(Debug, Clone, Copy)]
pub struct KeyGeometry {
    /// Batch.
    pub batch: usize,
    /// Hkv.
    pub kv_heads: usize,
    /// Tokens in the K buffer's token dimension (its allocated length).
    pub tokens: usize,
    /// D.
    pub head_dim: usize,
    /// Layout of K.
    pub layout: KernelLayout,
}

impl KeyGeometry {
    /// Element strides (batch, head, token).
    pub fn strides(&self) -> (u32, u32, u32) {
        let (a, b, c) = self
            .layout
            .strides(self.kv_heads, self.tokens, self.head_dim);
        (a as u32, b as u32, c as u32)
    }
}

/// Elements of a pyramid of `capacity` for `geo`'s `batch * kv_heads` rows of `head_dim`
/// (`TooLarge` past `usize`: the geometry's fields are public).
fn pyramid_elems(geo: &KeyGeometry, capacity: &PyramidLayout) -> Result<usize> {
    [
        geo.batch,
        geo.kv_heads,
        capacity.total_nodes(),
        geo.head_dim,
    ]
    .into_iter()
    .try_fold(1usize, |acc, x| acc.checked_mul(x))
    .ok_or_else(|| {
        PisaError::TooLarge {
            what: "elements of the pyramid for this key geometry",
            value: u64::MAX,
            limit: usize::MAX as u64,
        }
        .into()
    })
}

/// Allocates a pyramid for `capacity` (poisoned) for `batch * kv_heads` rows.
pub fn alloc(
    ctx: &Context,
    capacity: PyramidLayout,
    geo: &KeyGeometry,
    with_sq: bool,
) -> Result<GpuPyramid> {
    let _call = ctx.public_call()?;
    let len = pyramid_elems(geo, &capacity)?;
    let means = ctx.alloc("pyramid means", len, Storage::F32, POISON_F32)?;
    let sq = if with_sq {
        Some(ctx.alloc("pyramid second moments", len, Storage::F32, POISON_F32)?)
    } else {
        None
    };
    Ok(GpuPyramid {
        means,
        sq,
        capacity,
    })
}

/// Records the passes that build every level of `pyr` from the first `k_len` keys of `k`.
///
/// Errors: [`PisaError::TooLarge`] for a `k_len` past the pyramid's capacity or K's token
/// dimension (`geo.tokens`), [`PisaError::Zero`] for a geometry of zero batch, heads or head
/// dim, [`PisaError::BufferLen`] for a K shorter than its geometry's span or a pyramid shorter
/// than its capacity, layout errors of `k_len` (as [`PyramidLayout::new`]).
pub fn record_build(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    k: &GpuTensor,
    geo: &KeyGeometry,
    k_len: usize,
    pyr: &GpuPyramid,
    prof: Option<&mut Profiler>,
) -> Result<()> {
    let _call = ctx.public_call()?;
    let cap = pyr.capacity;
    let valid = PyramidLayout::new(k_len, cap.block_size(), cap.merge_factor())?;
    // Keys past the pyramid's capacity, or past K's token dimension, and a K of another length
    // than its geometry's span would index past the pyramid or K's binding (a panic of the
    // layout, or zeros averaged in).
    for (what, value, limit) in [
        (
            "keys to pool (k_len) against the pyramid's capacity",
            k_len,
            cap.key_len(),
        ),
        (
            "keys to pool (k_len) against K's token dimension",
            k_len,
            geo.tokens,
        ),
    ] {
        if value > limit {
            return Err(PisaError::TooLarge {
                what,
                value: value as u64,
                limit: limit as u64,
            }
            .into());
        }
    }
    for (what, v) in [
        ("batch", geo.batch),
        ("kv_heads", geo.kv_heads),
        ("head_dim", geo.head_dim),
    ] {
        if v == 0 {
            return Err(PisaError::Zero { what }.into());
        }
    }
    // The span and the pyramid's rows in checked arithmetic: the geometry's fields are public,
    // and a wrapped product would pass the length checks.
    let span = (geo.layout)
        .checked_span(geo.batch, geo.kv_heads, geo.tokens, geo.head_dim)
        .ok_or(PisaError::TooLarge {
            what: "elements of K for this key geometry",
            value: u64::MAX,
            limit: usize::MAX as u64,
        })?;
    let rows = pyramid_elems(geo, &cap)?;
    k.check_fits("k")?;
    if k.len < span {
        return Err(PisaError::BufferLen {
            what: "k (the key geometry's elements)",
            expected: span,
            actual: k.len,
        }
        .into());
    }
    for (what, t) in [
        ("pyramid means", Some(&pyr.means)),
        ("pyramid second moments", pyr.sq.as_ref()),
    ] {
        if let Some(t) = t {
            t.check_fits(what)?;
            if t.len < rows {
                return Err(PisaError::BufferLen {
                    what,
                    expected: rows,
                    actual: t.len,
                }
                .into());
            }
        }
    }
    let with_sq = pyr.sq.is_some();
    let dummy;
    let sq_buf = match &pyr.sq {
        Some(s) => &s.buffer,
        None => {
            dummy = ctx.alloc("unused", 1, Storage::F32, 0)?;
            &dummy.buffer
        }
    };
    let (k_sb, k_sh, k_sn) = geo.strides();
    let num_bh = (geo.batch * geo.kv_heads) as u32;
    let base = Params {
        k_sb,
        k_sh,
        k_sn,
        kv_heads: geo.kv_heads as u32,
        head_dim: geo.head_dim as u32,
        k_len: k_len as u32,
        block_size: cap.block_size() as u32,
        merge: cap.merge_factor() as u32,
        num_bh,
        total_nodes: cap.total_nodes() as u32,
        ..Default::default()
    };
    let ov = [("WITH_SQ", if with_sq { 1.0 } else { 0.0 })];
    let leaves = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "pool_leaves", k.storage, &[], &ov)?;
    let levels = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "pool_level", k.storage, &[], &ov)?;
    // Every level's dispatch in ONE compute pass (each sees the writes of the one before it,
    // see `Context::record_pass`): a pass per level cost its own start, most of a short
    // prompt's pyramid (H200, 2026-12-05: 0.044 -> 0.033 ms at 1K tokens, 0.122 -> 0.094 at
    // 64K; docs/benchmarks.md A.54).
    let mut stages = Vec::with_capacity(valid.num_levels());
    for l in 0..valid.num_levels() {
        let nodes = valid.nodes(l) as u32;
        let mut p = Params {
            nodes,
            node_off: cap.offset(l) as u32,
            wg_count: nodes * num_bh,
            ..base
        };
        if l > 0 {
            p.child_off = cap.offset(l - 1) as u32;
            p.child_nodes = valid.nodes(l - 1) as u32;
            p.child_tokens = (cap.block_size() * cap.leaves_per_node(l - 1)) as u32;
        }
        let u = ctx.uniform("pyramid params", &p)?;
        let stage = if l == 0 {
            let b: [(u32, Bind<'_>); 4] = [
                (0, (&u).into()),
                (1, k.into()),
                (2, (&pyr.means).into()),
                (3, sq_buf.into()),
            ];
            ctx.stage(&leaves, &b, p.wg_count as u64)?
        } else {
            let b = [(0, &u), (2, &pyr.means.buffer), (3, sq_buf)];
            ctx.stage(&levels, &b, p.wg_count as u64)?
        };
        stages.push(stage);
    }
    ctx.record_pass(enc, "pyramid", stages.iter(), prof);
    Ok(())
}
