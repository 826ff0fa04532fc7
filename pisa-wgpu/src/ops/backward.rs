//! Backward pass of block-sparse attention on the GPU (PISA.md section 4); shaders
//! `shaders/backward.wgsl` and `shaders/backward_index.wgsl`.
//!
//! Gradients flow through the attention over the selected leaves only; the selection is an
//! input held fixed. FlashAttention-2 math: P is recomputed from Q, K and the forward's LSE,
//! `D_i = rowsum(dO_i * O_i)`, `dS = P * (dO V^T - D)`, `dQ = s dS K`, `dK = s dS^T Q`,
//! `dV = P^T dO`; the dK and dV of a KV head sum over its GQA group. Passes:
//!
//! 1. `row_dot`: D (and a copy of the LSE beside it), 16 rows per workgroup.
//! 2. [`index::record_block_index`]: the key-block-major index of the selection.
//! 3. `grad_q`, a gather: one workgroup per (b, KV head, query) holds the query's g_q heads and
//!    walks its selected blocks; nothing else writes its dQ rows.
//! 4. `grad_kv`: one workgroup per (b, KV head, leaf block, sub-tile of keys) keeps its keys' dK
//!    and dV in registers and loops over the queries that selected the block (times their g_q
//!    heads), read from the index.
//!
//! Why a transposed index for dK/dV: every query that selected a block contributes to it, a
//! scatter. Float atomics (absent from WGSL anyway) or an order decided by scheduling would make
//! the sums, hence the gradients, differ from run to run; a block-major list lets one
//! workgroup own each key and add its queries in a fixed order, and costs O(Nq * K) to build.
//! The list is built on the GPU by a stable radix sort (see [`index`]) rather than by each block
//! scanning all selections in query order, which would cost O(nb_0 * Nq * K), quadratic in N.
//! Every sum runs in a fixed order, so two runs are bitwise equal.
//!
//! Known cost: a block selected by every query (a sink) gives its workgroups `Nq * g_q` rows
//! while the average is about `K * C * g_q`. Only on devices that cap an invocation's loop
//! iterations are the rows split over several workgroups (sized for that worst case), their
//! partial sums added in order by a fifth pass, `sum_splits`; elsewhere one workgroup walks
//! them all (splitting by the actual list lengths would balance the load, not built).

pub mod index;
mod tiles;

pub use tiles::BackwardTiles;

use bytemuck::{Pod, Zeroable};
use pisa_core::{AttentionShape, PisaError, SelectionConfig, TensorLayout};

use crate::error::{GpuError, Result};
use crate::runtime::buffers::{GpuTensor, POISON_F32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

/// `shaders/backward.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "backward",
    wgsl: include_str!("../../../shaders/backward.wgsl"),
};

/// Rows of D per `row_dot` workgroup (`DROWS` of the shader).
const DROWS: u64 = 16;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct Params {
    q_sb: u32,
    q_sh: u32,
    q_sn: u32,
    k_sb: u32,
    k_sh: u32,
    k_sn: u32,
    q_heads: u32,
    kv_heads: u32,
    q_len: u32,
    k_len: u32,
    top_k: u32,
    block_size: u32,
    nb0: u32,
    q_offset: u32,
    causal: u32,
    scale: f32,
    entries: u32,
    ksub: u32,
    wg_count: u32,
    rows: u32,
    splits: u32,
    split_rows: u32,
    kv_elems: u32,
    pad: u32,
}

pub(crate) fn check_u32(what: &'static str, n: u64) -> Result<usize> {
    if n > u32::MAX as u64 {
        return Err(PisaError::TooLarge {
            what,
            value: n,
            limit: u32::MAX as u64,
        }
        .into());
    }
    Ok(n as usize)
}

/// Records the backward pass of block-sparse attention (PISA.md section 4) into `enc`.
///
/// Inputs, as the forward's: `q`, `o`, `d_o` (dL/dO): `[B, Hq, Nq, D]`; `k`, `v`:
/// `[B, Hkv, Nk, D]`; all in `layout` and one storage precision (f32 or f16). `lse`: the
/// forward's per-row LSE, f32 `[B, Hq, Nq]`. `selection`: i32 `[B, Hkv, Nq, K]`, `K =
/// cfg.top_k` (-1 padding; a repeated block counts once; indices outside `0..nb_0` and, when
/// causal, blocks wholly after the query are ignored).
///
/// Returns `(dQ, dK, dV)`, f32 storage: dQ `[B, Hq, Nq, D]`, dK and dV `[B, Hkv, Nk, D]`, in
/// `layout`; keys no query attended to get exactly 0. Deterministic: two runs are bitwise
/// equal. Passes are labelled "backward" in `prof`.
///
/// The LSE is taken as given: a row whose LSE is NaN, or -inf while it selects a block, gets
/// non-finite gradients (its dQ, and the dK and dV of the keys it attended), as the forward
/// of such a row would not have produced it.
///
/// On a device that caps an invocation's loop iterations ([`Context::loop_limit`]: lavapipe)
/// the dK/dV kernel walks a block's rows in as many workgroups as a block every query selected
/// needs, their partial sums added in a fixed order by one more pass (still deterministic).
///
/// Errors (checked before anything is recorded into `enc`): shape errors as
/// [`AttentionShape::new`] (the shape is checked again: its fields are public),
/// [`PisaError::BufferLen`] for a tensor of the wrong length, [`GpuError::Unsupported`] for
/// mixed storage precisions, bf16 storage (f32 and f16 only), an LSE or selection tensor not of
/// 4-byte elements, or a head dim and GQA group that do not fit workgroup memory,
/// [`GpuError::Limit`] / [`PisaError::TooLarge`] for tensors past a storage binding or u32
/// indexing, [`GpuError::Limit`] where the dQ kernel's loops for one query (top_k blocks)
/// pass the device's loop limit, configuration errors, [`GpuError::Validation`] for a tensor
/// its passes cannot bind (a buffer without STORAGE usage, of another device, or destroyed).
#[allow(clippy::too_many_arguments)] // the forward's inputs and outputs, dO and the selection
pub fn record_backward(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    o: &GpuTensor,
    lse: &GpuTensor,
    d_o: &GpuTensor,
    selection: &GpuTensor,
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
    mut prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor, GpuTensor)> {
    let _call = ctx.public_call()?;
    cfg.validate()?;
    shape.validate()?;
    let s = shape;
    let (hd, g, c) = (s.head_dim, s.gqa_group(), cfg.block_size);
    check_u32("Q elements", s.q_elems() as u64)?;
    check_u32("K elements", s.kv_elems() as u64)?;
    for (what, t, n) in [
        ("q", q, s.q_elems()),
        ("o", o, s.q_elems()),
        ("d_o", d_o, s.q_elems()),
    ]
    .into_iter()
    .chain([("k", k, s.kv_elems()), ("v", v, s.kv_elems())])
    {
        // The length against the shape first: a tensor claiming more elements than its buffer
        // holds is then named by the shape's need, not by its own claim.
        t.check_shape(what, n)?;
        if t.storage != q.storage {
            return Err(GpuError::Unsupported(format!(
                "backward: {what} is {:?} but q is {:?}; use one storage for q, k, v, o, d_o",
                t.storage, q.storage
            )));
        }
    }
    lse.check_shape("lse", s.lse_elems())?;
    // The kernels read the LSE as f32 and the selection as i32 words (a tensor of 4-byte
    // elements, `Storage::F32`, as pisa's selections are), whatever the inputs' storage.
    for (what, t) in [("lse", lse), ("selection", selection)] {
        if t.storage != Storage::F32 {
            return Err(GpuError::Unsupported(format!(
                "backward: {what} is {:?}; it must be of 4-byte elements (Storage::F32: the LSE \
                 as f32, the selection as i32)",
                t.storage
            )));
        }
    }
    // Every check before anything is recorded: a refused call leaves `enc` as it was.
    let entries = s.q_len * cfg.top_k;
    selection.check_shape("selection", s.batch * s.kv_heads * entries)?;
    let tiles = BackwardTiles::for_device(ctx, hd, g, c)?;
    let split = KvSplit::plan(ctx, &tiles, s, cfg)?;
    let nb0 = s.k_len.div_ceil(c);
    let ksub = c.div_ceil(tiles.kv_keys);
    let kv_wgs = s.batch as u64 * s.kv_heads as u64 * nb0 as u64 * ksub as u64 * split.splits;
    check_u32("grad_kv workgroups", kv_wgs)?;
    let (q_sb, q_sh, q_sn) = layout.strides(s.q_heads, s.q_len, hd);
    let (k_sb, k_sh, k_sn) = layout.strides(s.kv_heads, s.k_len, hd);
    let base = Params {
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
        top_k: cfg.top_k as u32,
        block_size: c as u32,
        nb0: nb0 as u32,
        q_offset: (s.k_len - s.q_len) as u32,
        causal: cfg.causal as u32,
        scale: cfg.softmax_scale(hd),
        entries: entries as u32,
        ksub: ksub as u32,
        rows: s.lse_elems() as u32,
        wg_count: 0,
        splits: split.splits as u32,
        split_rows: split.rows as u32,
        kv_elems: s.kv_elems() as u32,
        pad: 0,
    };
    let stats = ctx.alloc(
        "backward stats",
        2 * s.lse_elems(),
        Storage::F32,
        POISON_F32,
    )?;
    let dq = ctx.alloc("dq", s.q_elems(), Storage::F32, POISON_F32)?;
    let dk = ctx.alloc("dk", s.kv_elems(), Storage::F32, POISON_F32)?;
    let dv = ctx.alloc("dv", s.kv_elems(), Storage::F32, POISON_F32)?;
    // grad_kv's partial sums, one set of dK and dV per split, where it runs several.
    let parts = if split.splits > 1 {
        let n = check_u32("backward dK/dV parts", split.splits * s.kv_elems() as u64)?;
        Some((
            ctx.alloc("dk parts", n, Storage::F32, POISON_F32)?,
            ctx.alloc("dv parts", n, Storage::F32, POISON_F32)?,
        ))
    } else {
        None
    };
    let st = q.storage;
    let pipe = |entry, keys: usize, rows: usize| {
        let consts = tiles::consts(hd, g, keys, rows);
        ctx.pipelines
            .get(&ctx.device, &SHADER, entry, st, &consts, &[])
    };
    let uni = |wg: u64| {
        let p = Params {
            wg_count: wg as u32,
            ..base
        };
        ctx.uniform("backward params", &p)
    };
    // Every pipeline, parameter buffer and bind group (the block index's too) built before the
    // first pass, under an error scope: a call refused by a device limit, or given a buffer its
    // passes cannot bind, records nothing.
    let (idx_stages, stages) = ctx.scope_now("backward", || {
        let (idx, idx_stages) = index::build_block_index(ctx, selection, s, cfg)?;
        let qkv = [
            (1, &q.buffer),
            (2, &k.buffer),
            (3, &v.buffer),
            (5, &d_o.buffer),
        ];
        let wgs = (s.lse_elems() as u64).div_ceil(DROWS);
        let u = uni(wgs)?;
        let bind = [
            (0, &u),
            (4, &o.buffer),
            (5, &d_o.buffer),
            (6, &lse.buffer),
            (7, &stats.buffer),
        ];
        let mut stages = vec![ctx.stage(&pipe("row_dot", 1, 1)?, &bind, wgs)?];
        let wgs = (s.batch * s.kv_heads * s.q_len) as u64;
        let u = uni(wgs)?;
        let mut bind = vec![(0, &u), (7, &stats.buffer)];
        bind.extend(qkv);
        bind.extend([(9, &selection.buffer), (10, &dq.buffer)]);
        stages.push(ctx.stage(&pipe("grad_q", tiles.q_keys, g)?, &bind, wgs)?);
        let (kv_out_k, kv_out_v) = match &parts {
            Some((pk, pv)) => (&pk.buffer, &pv.buffer),
            None => (&dk.buffer, &dv.buffer),
        };
        let u = uni(kv_wgs)?;
        let mut bind = vec![(0, &u), (7, &stats.buffer), (8, &idx.pairs.buffer)];
        bind.extend(qkv);
        bind.extend([(11, kv_out_k), (12, kv_out_v)]);
        let grad_kv = pipe("grad_kv", tiles.kv_keys, tiles.kv_rows)?;
        stages.push(ctx.stage(&grad_kv, &bind, kv_wgs)?);
        if let Some((pk, pv)) = &parts {
            let wgs = (s.kv_elems() as u64).div_ceil(tiles::WG);
            let u = uni(wgs)?;
            let bind = [
                (0, &u),
                (11, &dk.buffer),
                (12, &dv.buffer),
                (13, &pk.buffer),
                (14, &pv.buffer),
            ];
            stages.push(ctx.stage(&pipe("sum_splits", 1, 1)?, &bind, wgs)?);
        }
        Ok((idx_stages, stages))
    })?;
    ctx.check_step()?;
    for stage in idx_stages.iter().chain(&stages) {
        ctx.record_pass(enc, "backward", [stage], prof.as_deref_mut());
    }
    Ok((dq, dk, dv))
}

/// How `grad_kv` walks a block's (query, head) rows: in `splits` workgroups of at most `rows`
/// rows each. One split (all rows) unless the device caps an invocation's loop iterations
/// ([`Context::loop_limit`]) below what a block every query selected (a sink: `Nq * g_q` rows)
/// needs; then as many splits as that worst case needs, summed by `sum_splits`.
struct KvSplit {
    splits: u64,
    rows: u64,
}

impl KvSplit {
    /// Errors: [`GpuError::Limit`] where even `grad_q`, or one round of `grad_kv`, passes the
    /// device's loop limit.
    fn plan(
        ctx: &Context,
        tiles: &BackwardTiles,
        s: &AttentionShape,
        cfg: &SelectionConfig,
    ) -> Result<Self> {
        let (hd, g) = (s.head_dim, s.gqa_group());
        let max_rows = (s.q_len * g) as u64;
        let Some(limit) = ctx.loop_limit() else {
            return Ok(Self {
                splits: 1,
                rows: max_rows,
            });
        };
        // A sixteenth of the cap kept free: the counts model the shader's loops, and naga's
        // GLSL (wgpu's OpenGL backend) runs a few more trips than they charge (llvmpipe's GL,
        // D 256, 4 rows a round: 177 rounds fit the cap, the 178 the model allowed did not).
        // A refusal reports the count with the reserve against the device's cap.
        let reserve = Context::loop_reserve(limit);
        let budget = limit - reserve;
        let q_iters = tiles.grad_q_iterations(hd, g, cfg.block_size, cfg.top_k);
        if q_iters > budget {
            return Err(ctx.loop_limit_error(
                "backward grad_q",
                "dQ",
                (q_iters + reserve, limit),
                "use a GPU, or a smaller top_k, head dim or GQA group",
            ));
        }
        let (fixed, round) = tiles.grad_kv_iterations(hd, s.q_len * cfg.top_k);
        let rounds = budget.saturating_sub(fixed) / round;
        if rounds == 0 {
            return Err(ctx.loop_limit_error(
                "backward grad_kv",
                "dK and dV",
                (fixed + round + reserve, limit),
                "use a GPU, or a smaller head dim or block size",
            ));
        }
        let rows = (rounds * tiles.kv_rows as u64).min(max_rows).max(1);
        Ok(Self {
            splits: max_rows.div_ceil(rows).max(1),
            rows,
        })
    }
}

/// Uploads the inputs (Q, K, V, O, dO in `storage`; LSE f32; the selection as i32), runs
/// [`record_backward`] and reads `(dQ, dK, dV)` back as f32 (shapes as there). The selection
/// is read as the kernels read it (a -1, an index past the last leaf or below -1 is ignored;
/// a repeated block counts once), where the CPU reference
/// `pisa_core::reference::sparse_attention_backward` refuses an index below -1 or past the
/// last leaf: the two agree on every selection the reference accepts, as
/// [`crate::ops::attention::host::sparse_attention_host`] and its reference do. Errors: as
/// [`record_backward`], plus [`GpuError::Unsupported`] for f16 without SHADER_F16 and wgpu
/// validation, memory or device-loss errors.
#[allow(clippy::too_many_arguments)] // as record_backward, with host slices
pub fn backward_host(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
    storage: Storage,
    selection: &[i32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let _call = ctx.public_call()?;
    let t = |name, x: &[f32], st| ctx.upload(name, x, st);
    let (qt, kt, vt) = (
        t("q", q, storage)?,
        t("k", k, storage)?,
        t("v", v, storage)?,
    );
    let (ot, dot) = (t("o", o, storage)?, t("d_o", d_o, storage)?);
    let lt = t("lse", lse, Storage::F32)?;
    let sel = ctx.upload_u32("selection", selection)?;
    let (dq, dk, dv) = ctx.scoped("backward", || {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let out = record_backward(
            ctx, &mut enc, &qt, &kt, &vt, &ot, &lt, &dot, &sel, shape, layout, cfg, None,
        )?;
        ctx.queue().submit([enc.finish()]);
        Ok(out)
    })?;
    Ok((ctx.read_f32(&dq)?, ctx.read_f32(&dk)?, ctx.read_f32(&dv)?))
}
