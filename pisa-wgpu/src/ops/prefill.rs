//! PISA prefill end to end (PISA.md section 5): pyramid build, stage-1 routing, stage-2 leaf
//! scoring (leaf-major or in query tiles, [`crate::LeafOrder`]), and block-sparse attention,
//! each stage with a GPU timestamp. [`PrefillPlan`] plans once per shape and records each run
//! into the caller's encoder; [`prefill_host`] uploads, records into one submission and reads
//! back.
//!
//! Short prompts: where every query sees at most K leaves (`ceil(Nk / C) <= K`: up to 1024 keys
//! at C 64, K 16), each keeps every leaf it sees whatever the scores (PISA.md 3.3). There the
//! route and the leaf stage are skipped, one dispatch writes the selection (profiler stage
//! "select_all") and dense attention runs as the attention stage ("attention"; the NVIDIA
//! dense kernel where there is one): the same selection, and the same output within rounding,
//! as the sparse stages would give. The pyramid is built as always, for a decode cache.
//!
//! Binding-size splitting ([`prefill_host`]; a [`PrefillPlan`] refuses tensors past one binding
//! with [`GpuError::Limit`], to be planned per head group instead): a call whose tensors do not
//! fit one storage binding ([`Context::max_binding_bytes`]) runs in chunks of KV heads (each chunk taking its heads'
//! query heads along), since every (batch, KV head) is independent; a single head too large for
//! a binding is refused with [`GpuError::Limit`]. Results are identical with or without chunks.
//! The host-side chunking is in the private `chunks` submodule.
//!
//! # Non-finite inputs (NaN, ±inf)
//!
//! Nothing here scans the inputs; [`check_finite`] is the opt-in check (one host-side pass,
//! [`GpuError::NonFinite`] with the tensor and the flat index of the first bad value). WGSL
//! leaves NaN and infinity arithmetic to the implementation, so with a non-finite element in
//! Q, K or V the following holds on every adapter (portable kernels; tested in
//! `tests/reliability_nonfinite*.rs`):
//!
//! - the call succeeds (no error, no panic);
//! - every selection row is well formed: exactly `min(K, visible leaves)` leaves, strictly
//!   ascending, none in the query's future, every forced leaf (own block, sinks, locals) present,
//!   `-1` padded. Scores are ranked as a strict total order in which a NaN score counts as
//!   `-inf` (ties go to the lower block index) and `+inf` beats every finite score; which
//!   scores come out NaN or infinite is up to the adapter;
//! - a bad **key or value** at position `t` reaches only the rows that attend it (their
//!   selection holds its block and, causal, their position is `>= t`; without the causal mask
//!   any row may select its block, and a bad key can change any row's selection): causal,
//!   rows at earlier positions (earlier blocks, and earlier rows of its own block) are bitwise
//!   unchanged, and a row whose selection skips its block only reads finite data. A bad value
//!   leaves every selection unchanged, so those rows are bitwise unchanged too; a bad key can
//!   change the selection (and so the finite output) of later rows, because it enters the
//!   scores of its block and of the block's ancestors in the pyramid;
//! - a bad **query** element reaches only its own row, and the selection of its token for its
//!   KV head (shared by the GQA group), which can change the other heads' rows of that token.
//!
//! What a row that attends the bad value gets is unspecified. On Mesa lavapipe (llvmpipe, LLVM
//! 15) it is: NaN key: a **finite** result equal to attention without that key (the NaN is
//! silently dropped); +inf or -inf key: either that (finite) or, where the score is +inf or NaN
//! after scaling, **zeros with LSE -inf**, which looks like an empty row; NaN or ±inf value:
//! NaN; NaN or ±inf in a query row: that row **zeros with LSE -inf** (all its scores are
//! non-finite and rank as -inf), like a row that sees nothing. So a non-finite input need not
//! show up as NaN in the output: check the inputs where it cannot be ruled out upstream.
//!
//! Also: with `Storage::F16`, finite values above 65504 in magnitude become ±inf on upload
//! ([`check_finite`] sees the f32 input, not the f16 copy). Finite inputs whose scores
//! overflow (`s q.k` or a pyramid mean's product past f32's 3.4e38, as with elements near
//! 1e19 and above) behave as the non-finite cases above: on lavapipe a row all of whose scores
//! overflow comes out zeros with LSE -inf, and [`check_finite`] cannot see it, as every input
//! is finite. On the cooperative-matrix
//! path ([`crate::KernelPath::CoopMat`]), the tensor-core P·V multiplies masked probabilities
//! (zeros) by the whole value tile, so a non-finite **value** can also reach the rows of its
//! query tile that mask it (earlier rows of its block, rows that skip its block).

mod chunks;
mod plan;

pub use self::plan::{PlanViews, PrefillOutputs, PrefillPlan, VarlenPrefillPlan};

use pisa_core::{AttentionShape, PisaError, PyramidLayout, Scoring, SelectionConfig, TensorLayout};

use super::attention::{
    record_attention_to, record_every_leaf, AttentionKind, OutTarget, QkvLayouts,
};
use super::pyramid::{self, KeyGeometry};
use super::select::{self, every_leaf_selected, select, Layouts, Method};
use crate::error::Result;
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::{Profiler, StageTimes};

// Only named in the docs here (the chunk limit error is raised in `chunks`).
#[cfg(doc)]
use crate::error::GpuError;

/// Options of a prefill call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillOptions {
    /// Selection configuration (C, K, g, scoring, forced blocks, causal, scale).
    pub cfg: SelectionConfig,
    /// Layout of Q, K, V and O in the host slices of [`prefill_host`]. A [`PrefillPlan`] does not use it: the views given to its runs
    /// carry their own strides.
    pub layout: TensorLayout,
    /// GPU storage precision of Q, K, V and O: f32, f16, or bf16 ([`Storage::Bf16`]: the
    /// kernels read the 16-bit words and widen them exactly, O is written in f32). bf16 runs
    /// on the portable kernels only: on a cooperative-matrix or NVIDIA path, f16 storage with
    /// bf16 views (converted on the GPU, exact within f16's range) is the fast one.
    pub storage: Storage,
    /// Consecutive queries per stage-2 tile of the query-tile order (PISA.md section 5; 4 in
    /// the paper): at least 1 ([`PisaError::Zero`] for 0), clamped to what fits the device's
    /// workgroup memory; speed only, the results do not depend on it (the leaf-major order,
    /// the default on tensor cores, does not use it).
    pub q_tile: usize,
    /// [`prefill_host`] also returns the selected leaf indices. A [`PrefillPlan`] does not use
    /// it: a run writes the selection where [`PrefillOutputs::selection`] gives a view.
    pub return_selection: bool,
}

impl Default for PrefillOptions {
    fn default() -> Self {
        Self {
            cfg: SelectionConfig::default(),
            layout: TensorLayout::Bhnd,
            storage: Storage::F32,
            q_tile: 4,
            return_selection: false,
        }
    }
}

/// What a prefill returns.
#[derive(Debug, Clone)]
pub struct PrefillOutput {
    /// O, `[B, Hq, Nq, D]` in the input layout, f32 on the host.
    pub out: Vec<f32>,
    /// Per-row LSE (natural log of the sum of `exp(s q.k)` over the attended keys), `[B, Hq, Nq]`.
    pub lse: Vec<f32>,
    /// Selected leaves `[B, Hkv, Nq, K]` ascending, -1 padded (when requested).
    pub selection: Option<Vec<i32>>,
    /// GPU time per stage: "pyramid", "route", "leaf_select" (or, leaf-major, "leaf_bucket",
    /// "leaf_score", "leaf_pick"), "attention" (or, leaf-major, "attention_bucket",
    /// "attention_leaf", "attention_merge": [`crate::ops::attention::by_leaf::PARTS`]),
    /// summed over chunks; where every query selects every leaf it sees (see the
    /// [module docs](self)), "pyramid", "select_all" and "attention".
    pub times: StageTimes,
    /// Number of chunks the call was split into (1 when everything fit one binding).
    pub chunks: usize,
}

/// Records the whole prefill of device tensors: returns (O, LSE, selection). Shapes: `q`
/// `[B, Hq, Nq, D]`, `k`/`v` `[B, Hkv, Nk, D]` in `opts.layout`. Errors: shape and
/// configuration errors (as [`prefill_host`]), then the stages', and a
/// [`crate::GpuError::Validation`] for a tensor the passes cannot bind (nothing then to
/// submit: the encoder holds the failed recording). Non-finite inputs are not
/// checked: see the [module docs](self#non-finite-inputs-nan-inf) for what they produce.
#[allow(clippy::too_many_arguments)]
#[doc(hidden)]
pub fn record_prefill(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    shape: &AttentionShape,
    opts: &PrefillOptions,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor, GpuTensor)> {
    let _call = ctx.public_call()?;
    // (Its fields are public: checked again, as every entry point does.)
    let shape = &validated(shape, opts)?;
    let layouts = QkvLayouts::from(opts.layout);
    // Every pipeline, parameter buffer and bind group under an error scope, as a plan's run:
    // a tensor made from a buffer the passes cannot bind is a typed error, not an error left
    // to the device's uncaptured-error handler.
    ctx.scope_now("prefill", || {
        record_prefill_parts(ctx, enc, [q, k, v], layouts, shape, opts, None, prof)
            .map(|(o, lse, sel, _)| (o, lse, sel))
    })
}

/// [`record_prefill`] with Q, K, V in `layouts` (strided when a plan reads a caller's views in
/// place; O in `layouts.o`, or written into `out`), also returning the key pyramid it built
/// (layout of `shape.k_len`), for a decode cache to take over
/// ([`crate::ops::decode::KvCache::record_prefill_from_plan`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_prefill_parts(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    [q, k, v]: [&GpuTensor; 3],
    layouts: QkvLayouts,
    shape: &AttentionShape,
    opts: &PrefillOptions,
    out: Option<&OutTarget>,
    mut prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor, GpuTensor, pyramid::GpuPyramid)> {
    // The attention's head dims (a subset of the selection's), named first: a head dim the
    // selection takes and the attention does not was refused only after the selection's
    // check, with the selection's wider set in the message.
    super::attention::check_head_dim(shape.head_dim)?;
    let lay = PyramidLayout::new(shape.k_len, opts.cfg.block_size, opts.cfg.merge_factor)?;
    let geo = KeyGeometry {
        batch: shape.batch,
        kv_heads: shape.kv_heads,
        tokens: shape.k_len,
        head_dim: shape.head_dim,
        layout: layouts.k,
    };
    let pyr = pyramid::alloc(ctx, lay, &geo, opts.cfg.scoring == Scoring::MeanVar)?;
    pyramid::record_build(ctx, enc, k, &geo, shape.k_len, &pyr, prof.as_deref_mut())?;
    if every_leaf_selected(shape, &opts.cfg) {
        // Every query keeps every leaf it sees (PISA.md 3.3): nothing to score, and sparse
        // attention over all of them is dense attention over the same keys. The pyramid is
        // still built, for a decode cache to take over. The selection's GQA limit holds all
        // the same, so that a plan accepts the same GQA groups whatever the prompt's length;
        // the routing's workgroup memory (large merge factors or top_k) is checked only where
        // the route runs, so a short prompt may plan where a longer one is refused.
        super::route::check_query_group(shape.gqa_group())?;
        let sel = select::record_all_leaves(ctx, enc, shape, &opts.cfg, prof.as_deref_mut())?;
        let qkv = [q, k, v];
        let (o, lse) = record_every_leaf(ctx, enc, qkv, shape, layouts, &opts.cfg, out, prof)?;
        return Ok((o, lse, sel, pyr));
    }
    let sel_layouts = Layouts {
        q: layouts.q,
        k: layouts.k,
        k_tokens: shape.k_len,
    };
    let sel = select(
        ctx,
        q,
        k,
        Some(&pyr),
        shape,
        &sel_layouts,
        &opts.cfg,
        Method::Pisa,
        opts.q_tile,
        enc,
        prof.as_deref_mut(),
    )?;
    let kind = AttentionKind::Sparse {
        selection: &sel,
        cfg: &opts.cfg,
    };
    let (o, lse) =
        record_attention_to(ctx, enc, [q, k, v], shape, layouts, &kind, None, out, prof)?;
    Ok((o, lse, sel, pyr))
}

/// `shape` re-validated (its fields are public, so it may not come from a constructor) after
/// `opts.cfg`: the checks every prefill entry point starts with.
pub(crate) fn validated(shape: &AttentionShape, opts: &PrefillOptions) -> Result<AttentionShape> {
    opts.cfg.validate()?;
    shape.validate()?;
    // (A prompt whose queries keep every leaf never reaches the selection's own check.)
    if opts.q_tile == 0 {
        return Err(PisaError::Zero { what: "q_tile" }.into());
    }
    Ok(*shape)
}

/// Opt-in check of prefill inputs: `Ok` when every element of `q`, `k` and `v` is finite, else
/// [`GpuError::NonFinite`] naming the first tensor (in the order q, k, v) holding a NaN or
/// infinity, the flat index of its first such element (in the tensor's layout) and the value.
/// Host-side, one pass over each tensor; [`prefill_host`] does not call it (see the
/// [module docs](self#non-finite-inputs-nan-inf) for what non-finite inputs produce).
pub fn check_finite(q: &[f32], k: &[f32], v: &[f32]) -> Result<()> {
    super::check_finite("q", q)?;
    super::check_finite("k", k)?;
    super::check_finite("v", v)
}

/// Prefill of host tensors: uploads, records the prefill (in KV-head chunks when the
/// tensors exceed one storage binding), reads back. `q`: `[B, Hq, Nq, D]`, `k`, `v`:
/// `[B, Hkv, Nk, D]`, all in `opts.layout`. Errors: [`PisaError::BufferLen`] for wrong lengths,
/// configuration errors ([`PisaError::Zero`] for a `q_tile` of 0 included), [`GpuError::Limit`]
/// when one head alone exceeds a binding, device errors.
///
/// Non-finite values in `q`, `k` or `v` are **not** an error: the call succeeds, selections stay
/// well formed with every forced leaf, rows that do not attend a bad key or value are unaffected
/// by it, and rows that attend it get an unspecified result that can be finite and wrong (on
/// lavapipe a NaN key is silently dropped). Details in the
/// [module docs](self#non-finite-inputs-nan-inf); call [`check_finite`] first to refuse them.
pub fn prefill_host(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    opts: &PrefillOptions,
) -> Result<PrefillOutput> {
    let _call = ctx.public_call()?;
    let shape = validated(shape, opts)?;
    for (what, actual, expected) in [
        ("q", q.len(), shape.q_elems()),
        ("k", k.len(), shape.kv_elems()),
        ("v", v.len(), shape.kv_elems()),
    ] {
        crate::runtime::buffers::check_len(what, actual, expected)?;
    }
    let units = chunks::units_per_chunk(ctx, &shape, opts)?;
    if units >= shape.batch * shape.kv_heads {
        let r = run_once(ctx, q, k, v, &shape, opts)?;
        return Ok(PrefillOutput {
            out: r.out,
            lse: r.lse,
            selection: opts.return_selection.then_some(r.selection),
            times: r.times,
            chunks: 1,
        });
    }
    chunks::prefill_chunked(ctx, q, k, v, &shape, opts, units)
}

/// What one uploaded prefill (the whole call, or one chunk of KV heads) reads back: O and LSE
/// as [`PrefillOutput`] holds them, the selection (empty unless `return_selection`) and the
/// GPU time per stage.
struct HostRun {
    out: Vec<f32>,
    lse: Vec<f32>,
    selection: Vec<i32>,
    times: StageTimes,
}

/// Uploads `q`, `k`, `v` (shape `s`), records and submits [`record_prefill`] in one error
/// scope, reads the outputs back and returns the buffers to the context's pool.
fn run_once(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    opts: &PrefillOptions,
) -> Result<HostRun> {
    let (qt, kt, vt) = (
        ctx.upload("q", q, opts.storage)?,
        ctx.upload("k", k, opts.storage)?,
        ctx.upload("v", v, opts.storage)?,
    );
    // (as many passes as one query set times: a tuning of many routing-table chunks records
    // over a thousand, whose stages a capacity of 512 left out of the times)
    let mut prof = Profiler::new(ctx, Profiler::MAX_PASSES);
    let (o, lse, sel) = ctx.scoped("prefill", || {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let r = record_prefill(ctx, &mut enc, &qt, &kt, &vt, s, opts, Some(&mut prof))?;
        ctx.queue.submit([enc.finish()]);
        Ok(r)
    })?;
    let times = prof.finish(ctx)?;
    let sel_host = if opts.return_selection {
        ctx.read_i32(&sel)?
    } else {
        Vec::new()
    };
    let (o_host, lse_host) = (ctx.read_f32(&o)?, ctx.read_f32(&lse)?);
    // The next call of the same shape (a chunk, a later request) reuses these buffers.
    for t in [qt, kt, vt, o, lse, sel] {
        ctx.recycle(t);
    }
    Ok(HostRun {
        out: o_host,
        lse: lse_host,
        selection: sel_host,
        times,
    })
}
