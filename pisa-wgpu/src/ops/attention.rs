//! Block-sparse attention over selected leaves and the dense FlashAttention baseline on the GPU
//! (PISA.md section 4); shader `shaders/attention.wgsl`.
//!
//! Both kernels share one workgroup design (see [`Tiling`]): a workgroup owns some query heads
//! of one KV head times some consecutive queries, streams key tiles through workgroup memory
//! once for all of them, and keeps the online softmax (running max, running sum, f32
//! accumulators) per row. Sparse attention walks the ascending union of the tile's selected
//! leaves; dense attention walks every visible key tile, so the benchmark compares the same
//! inner loop. Host-slice entry points with binding-size splitting are in [`host`].
//!
//! Which kernel runs is one rule, [`attention_kernel`] (also what reports name); a prefill
//! whose queries select every leaf they see runs dense attention by its own,
//! [`prefill_attention_kernel`]. On a context
//! whose [`crate::KernelPath`] is CoopMat, f16-storage calls with the default tiling run
//! the tensor-core twin in [`coop`] (same inputs, outputs and semantics) when the shape suits it.
//! Sparse attention may instead run leaf-major ([`by_leaf`]: the selection bucketed by leaf,
//! per-leaf partial states merged per query), chosen by the context's [`crate::LeafOrder`]: by
//! default on tensor cores for sequences of at least 512 queries. Dense attention of few
//! queries against many keys (decode) runs split-K ([`split_k`], FlashDecoding) instead.

pub mod by_leaf;
pub mod coop;
pub mod host;
mod kernel;
mod launch;
pub mod nv_dense;
pub mod split_k;
pub mod tiling;

use pisa_core::{AttentionShape, PisaError, SelectionConfig, TensorLayout};

pub use host::{dense_attention_host, sparse_attention_host};
pub use kernel::{attention_kernel, prefill_attention_kernel, AttentionKernel};
pub use tiling::Tiling;

use crate::error::{GpuError, Result};
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;
use crate::runtime::view::KernelLayout;
use kernel::Plan;
use launch::Launch;

/// `shaders/attention.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "attention",
    wgsl: concat!(
        include_str!("../../../shaders/attention.wgsl"),
        include_str!("../../../shaders/attention_common.wgsl")
    ),
};

/// Head dims the kernels accept (the tested ones are 64, 80, 96, 128 and 256).
pub const SUPPORTED_HEAD_DIMS: &str = "multiples of 16 from 16 to 256";

/// Checks that the prefill kernels (attention, selection stage 2) take head dim `d`
/// ([`SUPPORTED_HEAD_DIMS`]), for a caller that wants to refuse a shape before it builds
/// anything; every operation makes the same check itself. Errors: [`PisaError::HeadDim`].
///
/// ```
/// use pisa_wgpu::check_head_dim;
/// assert!(check_head_dim(128).is_ok());
/// assert!(check_head_dim(24).is_err()); // not a multiple of 16
/// assert!(check_head_dim(0).is_err());
/// ```
pub fn check_head_dim(d: usize) -> Result<()> {
    if d == 0 || !d.is_multiple_of(16) || d > 256 {
        return Err(PisaError::HeadDim {
            head_dim: d,
            supported: SUPPORTED_HEAD_DIMS,
        }
        .into());
    }
    Ok(())
}

/// Layouts of Q, K, V and of the output O (which the kernels allocate: contiguous).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QkvLayouts {
    /// Layout of Q `[B, Hq, Nq, D]`.
    pub q: KernelLayout,
    /// Layout of K `[B, Hkv, Nk, D]`.
    pub k: KernelLayout,
    /// Layout of V `[B, Hkv, Nk, D]`.
    pub v: KernelLayout,
    /// Layout of O `[B, Hq, Nq, D]`, the same shape as Q.
    pub o: TensorLayout,
}

impl QkvLayouts {
    /// Q, K and V contiguous in their layouts, O in Q's.
    pub const fn contiguous(q: TensorLayout, k: TensorLayout, v: TensorLayout) -> Self {
        Self {
            q: KernelLayout::Contiguous(q),
            k: KernelLayout::Contiguous(k),
            v: KernelLayout::Contiguous(v),
            o: q,
        }
    }
}

impl From<TensorLayout> for QkvLayouts {
    fn from(l: TensorLayout) -> Self {
        Self {
            q: l.into(),
            k: l.into(),
            v: l.into(),
            o: l,
        }
    }
}

/// Which attention to run.
#[derive(Debug, Clone, Copy)]
pub enum AttentionKind<'a> {
    /// Block-sparse over `selection` `[B, Hkv, Nq, K]` i32 (`K = cfg.top_k`, ascending leaf
    /// indices, -1 padded); leaf size, masking and scale from `cfg`.
    Sparse {
        /// Selected leaves.
        selection: &'a GpuTensor,
        /// Block size C, top_k K, causal flag and softmax scale.
        cfg: &'a SelectionConfig,
    },
    /// Every key (`t <= p_i` when `causal`), scores `scale * q.k`.
    Dense {
        /// Causal masking.
        causal: bool,
        /// Softmax scale s.
        scale: f32,
    },
}

fn u32_of(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        GpuError::Input(PisaError::TooLarge {
            what,
            value: v as u64,
            limit: u32::MAX as u64,
        })
    })
}

/// Strides of a strided layout the kernels can address: multiples of 4 elements (the tile
/// kernels and the route read rows as vec4s; the tensor-core kernels, which need multiples of
/// 8, are skipped for other strides). Errors: [`GpuError::Unsupported`] naming the tensor.
pub(crate) fn check_strided(what: &str, l: KernelLayout) -> Result<()> {
    if let KernelLayout::Strided { batch, head, token } = l {
        if [batch, head, token].iter().any(|s| !s.is_multiple_of(4)) {
            return Err(GpuError::Unsupported(format!(
                "{what}: strides ({batch}, {head}, {token}) elements: the kernels need multiples of 4"
            )));
        }
    }
    Ok(())
}

/// The kernel that writes O at Q's strides (split-K's merge) needs O in Q's layout,
/// contiguous. Errors: [`GpuError::Unsupported`] otherwise.
pub(crate) fn check_o_is_q(layouts: QkvLayouts) -> Result<()> {
    if layouts.q != KernelLayout::Contiguous(layouts.o) {
        return Err(GpuError::Unsupported(format!(
            "dense attention with O ({:?}) in another layout than Q ({:?}): use a contiguous Q and O in its layout",
            layouts.o, layouts.q
        )));
    }
    Ok(())
}

/// Checks the head dim, buffer lengths, storages, configuration and u32 indexing of a call.
pub(crate) fn validate(
    shape: &AttentionShape,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
) -> Result<()> {
    shape.validate()?;
    let d = shape.head_dim;
    check_head_dim(d)?;
    u32_of("query elements", shape.q_elems())?;
    u32_of("key elements", shape.kv_elems())?;
    // Elements from the first to past the last (the element count when contiguous).
    let (b, hq, hkv) = (shape.batch, shape.q_heads, shape.kv_heads);
    let spans = [
        ("q", q, layouts.q.span(b, hq, shape.q_len, d)),
        ("k", k, layouts.k.span(b, hkv, shape.k_len, d)),
        ("v", v, layouts.v.span(b, hkv, shape.k_len, d)),
    ];
    for (what, t, span) in spans {
        u32_of("elements of a strided q, k or v", span)?;
        t.check_shape(what, span)?;
    }
    for (what, l) in [("q", layouts.q), ("k", layouts.k), ("v", layouts.v)] {
        check_strided(what, l)?;
    }
    if k.storage != q.storage || v.storage != q.storage {
        return Err(GpuError::Unsupported(format!(
            "q, k, v in different storage precisions ({:?}, {:?}, {:?}); use one",
            q.storage, k.storage, v.storage
        )));
    }
    match kind {
        AttentionKind::Sparse { selection, cfg } => {
            cfg.validate()?;
            let n = shape.batch * shape.kv_heads * shape.q_len * cfg.top_k;
            u32_of("selection elements", n)?;
            selection.check_shape("selection", n)?;
            // Read as i32 words: a selection of 4-byte elements (Storage::F32), as pisa's are.
            if selection.storage != Storage::F32 {
                return Err(GpuError::Unsupported(format!(
                    "the selection is {:?}; it must be of 4-byte elements (i32, in a tensor of \
                     Storage::F32 as pisa's selections are)",
                    selection.storage
                )));
            }
        }
        AttentionKind::Dense { scale, .. } => {
            if !scale.is_finite() || *scale <= 0.0 {
                return Err(PisaError::InvalidValue {
                    what: "softmax scale must be finite and positive",
                }
                .into());
            }
        }
    }
    Ok(())
}

/// Where sparse attention writes O instead of a new tensor of its own: a caller's tensor (a
/// range of its buffer) at `layout`'s element strides (D contiguous; strides multiples of 8,
/// as a view read in place: `PrefillPlan::new_in_place`), of Q's [`crate::Storage::output`].
pub(crate) struct OutTarget {
    /// The tensor O is written into.
    pub o: GpuTensor,
    /// O's strides.
    pub layout: KernelLayout,
}

/// Element strides (batch, head, token) of a `[B, heads, tokens, d]` tensor in layout `l`, as
/// the kernels' parameters hold them (callers have checked the element counts fit u32).
pub(crate) fn element_strides(
    l: impl Into<KernelLayout>,
    heads: usize,
    tokens: usize,
    d: usize,
) -> [u32; 3] {
    let (a, b, c) = l.into().strides(heads, tokens, d);
    [a as u32, b as u32, c as u32]
}

/// Records block-sparse attention (PISA.md section 4): `O_i = sum_{t in selected leaves,
/// t <= p_i if causal} softmax(s q_i.k_t) v_t`, with the default [`Tiling`].
///
/// `q`: `[B, Hq, Nq, D]` in `layouts.q`; `k`, `v`: `[B, Hkv, Nk, D]` in `layouts.k` /
/// `layouts.v`, all three in one storage precision; `selection`: `[B, Hkv, Nq, K]` i32 with
/// `K = cfg.top_k`, ascending leaf indices padded with -1 (a -1, an index past the last leaf,
/// or an entry not above its predecessor is ignored). Returns `(O, LSE)`: O contiguous in
/// `layouts.o`, of Q's [`crate::Storage::output`] (Q's storage; f32 for bf16), LSE f32 `[B, Hq, Nq]` = ln sum exp(s q.k) over the attended keys
/// (natural log); a row attending to no key gets zeros and -inf. Outputs are freshly allocated (poisoned, then
/// fully written). Profiler stage "attention" (leaf-major: its parts, [`by_leaf::PARTS`]).
///
/// Errors: shape errors as [`AttentionShape::new`] (checked again: the fields are public),
/// [`PisaError::HeadDim`] (see [`SUPPORTED_HEAD_DIMS`]), [`PisaError::BufferLen`],
/// configuration errors, [`GpuError::Unsupported`] for Q, K and V in different storages, a
/// selection not of 4-byte elements (a tensor of `Storage::F32` holding i32) or strides that
/// are not multiples of 4 elements, [`GpuError::Limit`] for outputs above the binding limit
/// (split with [`sparse_attention_host`]), a workgroup-memory shortfall or, on devices that cap
/// a shader invocation's loop iterations (llvmpipe), loops past the cap.
#[allow(clippy::too_many_arguments)]
pub fn record_sparse_attention(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    selection: &GpuTensor,
    shape: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    let _call = ctx.public_call()?;
    let kind = AttentionKind::Sparse { selection, cfg };
    record_attention(ctx, enc, q, k, v, shape, layouts, &kind, None, prof)
}

/// Records dense attention (the baseline of PISA.md section 4): every key, masked to
/// `t <= p_i` when `causal`, scores `scale * q.k`. Shapes, layouts, outputs and errors as
/// [`record_sparse_attention`] (no selection), plus [`PisaError::InvalidValue`] for a `scale`
/// that is not finite and positive, and [`GpuError::Unsupported`] where the kernel chosen
/// writes O at Q's strides (split-K, the NVIDIA dense kernel) and O's layout is not Q's;
/// profiler stage "dense".
#[allow(clippy::too_many_arguments)]
pub fn record_dense_attention(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    shape: &AttentionShape,
    layouts: QkvLayouts,
    causal: bool,
    scale: f32,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    let _call = ctx.public_call()?;
    let kind = AttentionKind::Dense { causal, scale };
    record_attention(ctx, enc, q, k, v, shape, layouts, &kind, None, prof)
}

/// Records sparse or dense attention with an explicit [`Tiling`] (`None`: the default for the
/// kind, shrunk to the device's workgroup memory). Everything else as
/// [`record_sparse_attention`].
///
/// The kernel (split-K, leaf-major, the cooperative-matrix or the portable tile kernel) is the
/// one [`attention_kernel`] reports for these arguments: both read one rule (see there).
#[allow(clippy::too_many_arguments)]
pub fn record_attention(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    shape: &AttentionShape,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
    tiling: Option<Tiling>,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    let _call = ctx.public_call()?;
    record_attention_to(
        ctx,
        enc,
        [q, k, v],
        shape,
        layouts,
        kind,
        tiling,
        None,
        prof,
    )
}

/// [`record_attention`] writing O into `out` when given (sparse attention only: a dense call
/// with a target is [`GpuError::Unsupported`]); the returned O is then `out.o`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_attention_to(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    [q, k, v]: [&GpuTensor; 3],
    shape: &AttentionShape,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
    tiling: Option<Tiling>,
    out: Option<&OutTarget>,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    validate(shape, q, k, v, layouts, kind)?;
    if let Some(t) = out {
        if matches!(kind, AttentionKind::Dense { .. }) {
            return Err(GpuError::Unsupported(
                "dense attention into a caller's O (sparse attention only)".into(),
            ));
        }
        check_out_target(shape, q, t)?;
    }
    let plan = kernel::plan(ctx, shape, q.storage, layouts, kind, tiling);
    let target = (out, None);
    record_plan(
        ctx,
        enc,
        [q, k, v],
        shape,
        layouts,
        kind,
        tiling,
        plan,
        target,
        prof,
    )
}

/// The attention stage of a prefill in which every query selects every leaf it sees
/// ([`crate::ops::select::every_leaf_selected`]: at most K leaves of keys): sparse attention
/// over those leaves is dense attention over the same keys, causal as `cfg`, at `cfg`'s scale,
/// so a dense kernel runs it ([`kernel::prefill_dense_plan`]: the NVIDIA dense kernel where
/// there is one, else the tile kernels; never split-K, and the choice does not depend on
/// `layouts`, so a plan's runs replay the kernel it recorded). Shapes and outputs as
/// [`record_attention_to`] (O into `out` when given); profiler stage "attention".
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_every_leaf(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    [q, k, v]: [&GpuTensor; 3],
    shape: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
    out: Option<&OutTarget>,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    let kind = every_leaf_kind(shape, cfg);
    validate(shape, q, k, v, layouts, &kind)?;
    if let Some(t) = out {
        check_out_target(shape, q, t)?;
    }
    let plan = kernel::prefill_dense_plan(ctx, shape, q.storage, &kind);
    let target = (out, Some("attention"));
    record_plan(
        ctx,
        enc,
        [q, k, v],
        shape,
        layouts,
        &kind,
        None,
        plan,
        target,
        prof,
    )
}

/// The dense attention equal to sparse attention under `cfg` where every query selects every
/// leaf it sees ([`record_every_leaf`]): causal as `cfg`, at `cfg`'s scale.
fn every_leaf_kind(shape: &AttentionShape, cfg: &SelectionConfig) -> AttentionKind<'static> {
    AttentionKind::Dense {
        causal: cfg.causal,
        scale: cfg.softmax_scale(shape.head_dim),
    }
}

/// A caller's O checked for the kernels that write into it: of Q's output storage, strides of
/// whole 16-byte pieces, long enough. Errors: [`GpuError::Unsupported`], buffer length errors.
fn check_out_target(shape: &AttentionShape, q: &GpuTensor, t: &OutTarget) -> Result<()> {
    let (b, hq, d) = (shape.batch, shape.q_heads, shape.head_dim);
    if t.o.storage != q.storage.output() {
        return Err(GpuError::Unsupported(format!(
            "O of {:?} for inputs of {:?} (O is {:?})",
            t.o.storage,
            q.storage,
            q.storage.output()
        )));
    }
    // The NVIDIA kernels write O 8 elements (16 bytes of f16) at a time: strides of
    // dimensions of extent above 1 are multiples of 8, as for a view read in place.
    let (sb, sh, sn) = t.layout.strides(hq, shape.q_len, d);
    let used = [(b, sb), (hq, sh), (shape.q_len, sn)];
    if used.iter().any(|&(n, st)| n > 1 && st % 8 != 0) {
        return Err(GpuError::Unsupported(format!(
            "O written in place needs strides that are multiples of 8 elements (strides {sb}, {sh}, {sn})"
        )));
    }
    t.o.check_shape("o", t.layout.span(b, hq, shape.q_len, d))
}

/// Records the kernel of `plan` (O into `target.0` when given, timed as `target.1` when given).
#[allow(clippy::too_many_arguments)]
fn record_plan(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    [q, k, v]: [&GpuTensor; 3],
    shape: &AttentionShape,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
    tiling: Option<Tiling>,
    plan: Plan<'_>,
    (out, label): (Option<&OutTarget>, Option<&'static str>),
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    match plan {
        Plan::SplitK {
            plan,
            causal,
            scale,
        } => {
            // (Never chosen with a target: dense calls with one take the tile kernels.)
            if out.is_some() {
                return Err(GpuError::Unsupported(
                    "split-K attention into a caller's O".into(),
                ));
            }
            let qkv = [q, k, v];
            split_k::record(ctx, enc, qkv, shape, layouts, (causal, scale), &plan, prof)
        }
        Plan::LeafMajor {
            plan,
            selection,
            cfg,
        } => by_leaf::record(
            ctx, enc, q, k, v, selection, shape, layouts, cfg, &plan, out, prof,
        ),
        Plan::CoopTile(cv) => {
            let target = (out, label);
            coop::record(ctx, enc, [q, k, v], shape, layouts, kind, &cv, target, prof)
        }
        Plan::NvDense {
            kernel,
            causal,
            scale,
        } => nv_dense::record(
            ctx,
            enc,
            (q, k, v),
            shape,
            layouts,
            (causal, scale),
            kernel,
            (out, label.unwrap_or("dense")),
            prof,
        ),
        Plan::PortableTile => {
            let target = (out, label);
            record_tiles(
                ctx,
                enc,
                [q, k, v],
                shape,
                layouts,
                kind,
                tiling,
                target,
                prof,
            )
        }
    }
}

/// `want` fitted to the device ([`Tiling::fit`]) and, where the driver caps an invocation's loop
/// iterations ([`Context::loop_limit`]), to that cap: query tiles halved until the kernel's
/// count ([`tiling::Variant::loop_iterations`]) fits (a query tile changes no result), else
/// [`GpuError::Limit`]. The count: the union of QT * top_k selection entries (sparse), then the
/// key tiles walked: up to min(QT * top_k, blocks) blocks of C keys (sparse), or all Nk keys
/// (dense).
fn fit_loops(
    ctx: &Context,
    mut want: Tiling,
    s: &AttentionShape,
    sparse_c: Option<usize>,
    top_k: usize,
) -> Result<(Tiling, tiling::Variant)> {
    let g = s.gqa_group();
    loop {
        let (t, var) = want.fit(ctx, s.head_dim, g, top_k)?;
        let Some(limit) = ctx.loop_limit() else {
            return Ok((t, var));
        };
        let kt = var.kt as u64;
        let (tiles, blocks) = match sparse_c {
            Some(c) => {
                let blocks = s.k_len.div_ceil(c.max(1)) as u64;
                let walked = blocks.min((var.qt as u64) * top_k as u64);
                (walked * (c as u64).min(s.k_len as u64).div_ceil(kt), blocks)
            }
            None => ((s.k_len as u64).div_ceil(kt), 0),
        };
        let needed = var.loop_iterations(sparse_c.is_some(), tiles, blocks);
        if needed <= limit {
            return Ok((t, var));
        }
        if t.query_tile > 1 {
            want = Tiling {
                query_tile: t.query_tile / 2,
                ..t
            };
            continue;
        }
        return Err(ctx.loop_limit_error(
            "attention",
            "output",
            (needed, limit),
            "use a GPU, fewer keys or a smaller top_k, or, for sparse attention over blocks of \
             at most 64 keys, the leaf-major order (LeafOrder::Leaves: tuning knob \
             leaf_order=leaves, PISA_LEAF_ORDER=leaves)",
        ));
    }
}

/// Records the portable tile kernel (`shaders/attention.wgsl`) with `tiling` (`None`: the
/// default for the kind); inputs validated by the caller. O written into `out` when given, the
/// pass timed as `label` when given (else the kind's stage).
#[allow(clippy::too_many_arguments)]
fn record_tiles(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    [q, k, v]: [&GpuTensor; 3],
    shape: &AttentionShape,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
    tiling: Option<Tiling>,
    (out, label): (Option<&OutTarget>, Option<&'static str>),
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    let s = shape;
    let g = s.gqa_group();
    let top_k = match kind {
        AttentionKind::Sparse { cfg, .. } => cfg.top_k,
        AttentionKind::Dense { .. } => 1,
    };
    let sparse_c = match kind {
        AttentionKind::Sparse { cfg, .. } => Some(cfg.block_size),
        AttentionKind::Dense { .. } => None,
    };
    let want = tiling.unwrap_or_else(|| Tiling::default_for(g, sparse_c));
    let (_, var) = fit_loops(ctx, want, s, sparse_c, top_k)?;
    let l = Launch::new(ctx, q, s, layouts, kind, (var.gh, var.qt, var.kt), out)?.labelled(label);
    let pipe = ctx.pipelines.get(
        &ctx.device,
        &SHADER,
        l.entry(),
        q.storage,
        &var.consts(),
        &[],
    )?;
    l.dispatch(ctx, enc, &pipe, [q, k, v], kind, &[], prof)
}
