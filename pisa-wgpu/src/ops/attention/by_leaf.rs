//! Leaf-major block-sparse attention (PISA.md 4 and 5): the selection is bucketed by leaf, and
//! each leaf's keys and values are multiplied against chunks of the queries that selected it;
//! the per-(query, leaf) partial softmax states are then merged per query (FlashDecoding).
//!
//! Why: the tile kernels multiply a tile of Qtile queries x g_q heads (16 rows) against the
//! union of the tile's selected leaves. Where neighbouring queries share few leaves (random
//! inputs) about a quarter of each multiply is useful; here every row of a multiply belongs to
//! a query that selected the leaf. The price is the partial states: `D + 2` floats per (query
//! head, selected leaf), written and read once.
//!
//! One compute pass ("attention"; profiled, three timed passes per range, [`PARTS`], where the
//! profiler has room for all of them) holds,
//! for every range (sized so its partial states fit one storage binding: a range of queries of
//! one (b, KV head), or, where every query fits, all queries of as many (b, KV head)s as fit,
//! [`leaf_major_range`]) five dispatches (six with sibling pairs):
//! 1. `count`, `scan`, `scatter` of `shaders/leaf_bucket.wgsl` with `ATTEND = 1` (a bucket is a
//!    leaf of one (b, KV head); -1 padding, repeats and out-of-order entries are skipped as the
//!    tile kernels' union skips them);
//! 2. `attend_leaf` (`shaders/attention_leaf_coop.wgsl` on tensor cores, f16; else the portable
//!    `shaders/attention_leaf.wgsl`; on a device with `VK_NV_cooperative_matrix2`
//!    `shaders/nv/attention_leaf.comp`, see [`nv_kernel_for`]): a chunk's partial states;
//! 3. `merge` (`shaders/attention_leaf_merge.wgsl`, or `shaders/nv/attention_leaf_merge.comp`
//!    after the NVIDIA kernel's f16 rows): O and LSE of the range's queries.
//!
//! Chosen by `plan` ([`leaf_major_path`] tells the outcome) through the context's
//! [`crate::LeafOrder`], the same switch as selection stage 2: by default (Auto) for sequences
//! of at least 512 queries where the tensor-core kernel applies (f16 storage, D a multiple of
//! 16 up to 128, g_q <= 64, 16-byte aligned strides, subgroups of at least 16, Nk >= 16);
//! with `Leaves` wherever it fits, the portable kernel included; never with `Tiles`. In every case only where
//! V has K's layout, C <= 64, and the scratch and workgroup memory fit. Same outputs and
//! semantics as [`super::record_sparse_attention`] (the same entries skipped). Deterministic: a
//! state depends only on its own rows. Memory: the partial states of a range take up to one
//! storage binding (2 GiB on the H200) of scratch, reused by every range of the call.

use pisa_core::{AttentionShape, SelectionConfig};

use super::{element_strides, QkvLayouts};
use crate::error::Result;
use crate::ops::leaf_select::by_leaf::{
    bucket_consts, bucket_window_for, Buckets, BUCKET_SHADER, BUCKET_TILE,
};
use crate::ops::select::SelParams;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_F32, POISON_I32};
use crate::runtime::context::{Context, COOP_SUBGROUPS};
use crate::runtime::nv::{NvBinding, NvKernel};
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;

mod plan;

/// The profiler stages of a profiled leaf-major attention, in order (their sum is the
/// "attention" stage of the other kernels): steps 1 (bucketing), 2 (chunk kernel) and 3 (merge).
pub const PARTS: [&str; 3] = ["attention_bucket", "attention_leaf", "attention_merge"];

pub use plan::{leaf_major_pairs, leaf_major_path, leaf_major_range};
pub(crate) use plan::{plan, LeafAttention, PairKernel};

/// `shaders/attention_leaf.wgsl` (portable) with the chunk lookup.
pub const SHADER: ShaderSource = ShaderSource {
    name: "attention_leaf",
    wgsl: concat!(
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/attention_leaf.wgsl"),
        include_str!("../../../../shaders/leaf_chunk.wgsl")
    ),
};

/// `shaders/attention_leaf_coop.wgsl` (tensor cores; its `enable` first) with the chunk lookup
/// and the row loads it shares with the leaf-major scorer (`shaders/leaf_rows_coop.wgsl`).
pub const COOP_SHADER: ShaderSource = ShaderSource {
    name: "attention_leaf_coop",
    wgsl: concat!(
        include_str!("../../../../shaders/attention_leaf_coop.wgsl"),
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_chunk.wgsl"),
        include_str!("../../../../shaders/leaf_rows_coop.wgsl"),
        include_str!("../../../../shaders/coop_qa.wgsl")
    ),
};

/// `shaders/attention_leaf_merge.wgsl`.
pub const MERGE_SHADER: ShaderSource = ShaderSource {
    name: "attention_leaf_merge",
    wgsl: concat!(
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/attention_leaf_merge.wgsl"),
        include_str!("../../../../shaders/leaf_chunk.wgsl")
    ),
};

/// The bindings of `shaders/nv/attention_leaf.comp` (those of the WGSL chunk kernels).
const NV_BINDINGS: &[(u32, NvBinding)] = &[
    (0, NvBinding::Uniform),
    (1, NvBinding::Read),
    (2, NvBinding::Read),
    (3, NvBinding::Read),
    (7, NvBinding::Read),
    (8, NvBinding::Read),
    (10, NvBinding::Uniform),
    (11, NvBinding::Read),
    (12, NvBinding::Write),
    (13, NvBinding::Write),
    (14, NvBinding::Write),
];

/// The NVIDIA kernels of leaf-major attention for a tensor-core plan on a device with
/// `VK_NV_cooperative_matrix2` ([`Context::nv_cm2`]): the chunk kernel
/// (`shaders/nv/attention_leaf.comp`, 64 rows of a chunk against the 64 key rows of a leaf;
/// built for head dims 64 and 128, for leaves of at most 64 keys) and, where it applies, the
/// merge that reads the partial O rows as f16 (`shaders/nv/attention_leaf_merge.comp`: head dim
/// 128, GQA groups up to 16, top_k up to 64, in two variants by their product; half the
/// partial-state traffic of the f32 rows the WGSL merge reads). Only kernels the driver built
/// are chosen. `None` keeps the WGSL kernels. Same chunks (64 rows: `COOP_SUBGROUPS` x 16),
/// partial states and outputs.
pub fn nv_kernel_for(
    ctx: &Context,
    s: &AttentionShape,
    cfg: &SelectionConfig,
) -> Option<(NvKernel, Option<NvKernel>)> {
    if !ctx.nv_cm2() || cfg.block_size > 64 || 16 * COOP_SUBGROUPS != 64 {
        return None;
    }
    let find = |name: &str| ctx.nv_kernel_named(&NV_ATTENTION, name);
    // The merges' limits (shaders/nv/kernels.txt: GQMAX, MCMAX, MHMAX): the variant for at
    // most 256 (slot, head) pairs where it applies (a quarter of the other's workgroup memory).
    let (g, k) = (s.gqa_group(), cfg.top_k);
    let d = if s.head_dim == 64 { "_d64" } else { "" };
    let merge = match g * k {
        _ if g > 16 || k > 64 => None,
        0..=256 => find(&format!("attention_leaf_merge_h{d}")),
        _ => find(&format!("attention_leaf_merge_h1k{d}")),
    };
    match s.head_dim {
        // The f16 rows only with a merge that reads them (a driver that refused the merge
        // gets the f32 rows and the WGSL merge).
        128 if merge.is_some() => Some((find("attention_leaf_d128_h")?, merge)),
        128 => Some((find("attention_leaf_d128")?, None)),
        64 if merge.is_some() => Some((find("attention_leaf_d64_h")?, merge)),
        64 => Some((find("attention_leaf_d64")?, None)),
        _ => None,
    }
}

/// The NVIDIA chunk kernel over sibling pairs that goes with chunk kernel `nv.0`
/// (`attention_leaf_pair_*`: the same kernel with PAIR = 1, 2C keys per chunk, the same
/// partial states), where the driver built it.
pub fn nv_pair_kernel_for(ctx: &Context, nv: &(NvKernel, Option<NvKernel>)) -> Option<NvKernel> {
    let name =
        nv.0.name
            .replacen("attention_leaf_", "attention_leaf_pair_", 1);
    ctx.nv_kernel_named(&NV_ATTENTION, &name)
}

/// The twin of NVIDIA chunk kernel `k` (a leaf or pair kernel of [`NV_ATTENTION`]) for ranges of
/// several (b, KV head)s (`_mh`, MULTI = 1 in `shaders/nv/attention_leaf.comp`), where the
/// driver built it.
pub(crate) fn nv_multi_head_kernel(ctx: &Context, k: &NvKernel) -> Option<NvKernel> {
    // (Found by the name's suffix: no name is built on the recording path.)
    NV_ATTENTION
        .iter()
        .find(|t| t.name.strip_suffix("_mh") == Some(k.name))
        .filter(|t| ctx.nv_kernel_ok(t))
        .copied()
}

/// The embedded NVIDIA kernels of leaf-major attention (`shaders/nv/kernels.txt`).
pub const NV_ATTENTION: [NvKernel; 20] = [
    crate::nv_kernel!("attention_leaf_d128", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_d128_h", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_d64", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d128", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d128_h", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d64", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_d128_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_d128_h_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_d64_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d128_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d128_h_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d64_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_merge_h", NV_MERGE_BINDINGS),
    crate::nv_kernel!("attention_leaf_merge_h1k", NV_MERGE_BINDINGS),
    crate::nv_kernel!("attention_leaf_d64_h", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d64_h", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_d64_h_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_pair_d64_h_mh", NV_BINDINGS),
    crate::nv_kernel!("attention_leaf_merge_h_d64", NV_MERGE_BINDINGS),
    crate::nv_kernel!("attention_leaf_merge_h1k_d64", NV_MERGE_BINDINGS),
];

/// The bindings of `shaders/nv/attention_leaf_merge.comp` (those of the WGSL merge).
const NV_MERGE_BINDINGS: &[(u32, NvBinding)] = &[
    (0, NvBinding::Uniform),
    (5, NvBinding::Write),
    (10, NvBinding::Uniform),
    (12, NvBinding::Read),
    (13, NvBinding::Read),
    (14, NvBinding::Write),
    (15, NvBinding::Write),
];

/// The chunk kernel's constants for plan `la` (the tensor-core kernel's when `la.coop`).
fn attend_consts(
    la: &LeafAttention,
    s: &AttentionShape,
    cfg: &SelectionConfig,
) -> Vec<(&'static str, u32)> {
    let (g, kk) = (s.gqa_group() as u32, cfg.top_k as u32);
    let multi = u32::from(la.heads > 1);
    match la.coop {
        Some(sg) => vec![
            ("GQ", g),
            ("QPC", la.qpc),
            ("MC", kk),
            ("HD", s.head_dim as u32),
            ("CT", cfg.block_size.div_ceil(16) as u32),
            ("SG", sg),
            ("NSG", COOP_SUBGROUPS),
            ("MULTI", multi),
        ],
        None => vec![("GQ", g), ("QPC", la.qpc), ("MC", kk), ("MULTI", multi)],
    }
}

/// The portable chunk kernel's constants over sibling pairs (PAIR = 1: 2C <= 128 keys, one
/// invocation each).
fn pair_consts(
    la: &LeafAttention,
    s: &AttentionShape,
    cfg: &SelectionConfig,
) -> Vec<(&'static str, u32)> {
    let mut c = attend_consts(la, s, cfg);
    c.extend([("PAIR", 1), ("WG", 128)]);
    c
}

/// The merge's constants for GQA group `g` and `top_k` `kk`.
fn merge_consts(g: u32, kk: u32) -> [(&'static str, u32); 2] {
    [("GQ", g), ("MC", kk)]
}

/// Records leaf-major sparse attention of plan `la`: arguments, outputs and errors as
/// [`super::record_sparse_attention`] (`selection`: `[B, Hkv, Nq, K]` i32). Profiler stages
/// [`PARTS`] (three timed passes per range; "attention", one pass, where the profiler has no
/// room for them all; one untimed pass without a profiler).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    selection: &GpuTensor,
    s: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
    la: &LeafAttention,
    out: Option<&super::OutTarget>,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    let (g, d, kk) = (s.gqa_group() as u32, s.head_dim as u32, cfg.top_k as u32);
    let nb0 = s.k_len.div_ceil(cfg.block_size);
    let (o, o_layout) = match out {
        Some(t) => (t.o.alias(), t.layout),
        None => (
            ctx.alloc("attention O", s.q_elems(), q.storage.output(), POISON_F32)?,
            layouts.o.into(),
        ),
    };
    let lse = ctx.alloc("attention LSE", s.lse_elems(), Storage::F32, POISON_F32)?;
    let qs = element_strides(layouts.q, s.q_heads, s.q_len, s.head_dim);
    let ks = element_strides(layouts.k, s.kv_heads, s.k_len, s.head_dim);
    let mut params: SelParams = bytemuck::Zeroable::zeroed();
    [params.q_sb, params.q_sh, params.q_sn] = qs;
    [params.k_sb, params.k_sh, params.k_sn] = ks;
    [params.o_sb, params.o_sh, params.o_sn] =
        element_strides(o_layout, s.q_heads, s.q_len, s.head_dim);
    params.q_heads = s.q_heads as u32;
    params.kv_heads = s.kv_heads as u32;
    params.q_len = s.q_len as u32;
    params.k_len = s.k_len as u32;
    params.head_dim = d;
    params.block_size = cfg.block_size as u32;
    params.top_k = kk;
    params.causal = cfg.causal as u32;
    params.nb0 = nb0 as u32;
    params.scale = cfg.softmax_scale(s.head_dim);
    params.q_pos0 = (s.k_len - s.q_len) as u32;
    params.mc = kk;
    let u_params = ctx.uniform("attention params", &params)?;
    // Scratch, sized for the largest range and reused by every range: the counts return to
    // zero after each scatter, and the merge zeroes the slot table it reads. With pairs the
    // pair buckets follow the leaf buckets, and the pair kernel's workgroups read descriptors
    // from the first pair chunk on (at most the leaf chunks' bound), so `cdesc` holds both
    // dispatch bounds.
    let hr = la.heads as u64; // (b, KV head)s per range
    let (chunks, pair_chunks) = (
        hr * la.chunk_bound(la.nq, cfg.top_k, nb0),
        hr * la.pair_chunk_bound(la.nq, cfg.top_k, nb0),
    );
    let buckets = (hr * la.buckets(nb0)) as usize;
    let slots = (hr * la.nq as u64) as usize * cfg.top_k;
    let cnt = ctx.alloc("attention buckets", buckets, Storage::F32, 0)?;
    let off = ctx.alloc(
        "attention bucket offsets",
        buckets + 1,
        Storage::F32,
        POISON_I32,
    )?;
    let coff = ctx.alloc(
        "attention bucket chunks",
        buckets + 1,
        Storage::F32,
        POISON_I32,
    )?;
    // Written before read: lists and chunk descriptors (scatter), partial states (chunk
    // kernel). A descriptor is four words (bucket, first entry, entries, 0; leaf_chunk.wgsl),
    // far less than the chunk's partial O rows that bound `chunks` to one binding.
    let list = ctx.scratch("attention bucket lists", slots, Storage::F32)?;
    let cdesc = ctx.scratch(
        "attention chunks",
        4 * (chunks + pair_chunks) as usize,
        Storage::F32,
    )?;
    let spos = ctx.alloc("attention slot rows", slots, Storage::F32, 0)?;
    let n_rows = (hr * la.row_chunk_bound(la.nq, cfg.top_k, nb0)) as usize * la.rows as usize;
    // f32 words: the NVIDIA kernel's f16 rows take half (`opart_bytes`; d is even).
    let opart_words = n_rows * d as usize * plan::opart_bytes(la.nv.as_ref()) as usize / 4;
    let opart = ctx.scratch("attention partial O", opart_words, Storage::F32)?;
    let mlpart = ctx.scratch("attention partial m, l", 2 * n_rows, Storage::F32)?;

    let pipe = |shader: &ShaderSource, entry: &'static str, st: Storage, c: &[(&str, u32)]| {
        ctx.pipelines.get(&ctx.device, shader, entry, st, c, &[])
    };
    let pairs = la.pairs.on();
    let window = bucket_window_for(ctx.limits().max_compute_workgroup_storage_size, pairs);
    let bucket = bucket_consts(kk, la.qpc, true, pairs, window);
    let count = pipe(&BUCKET_SHADER, "count", Storage::F32, &bucket)?;
    let scan = pipe(&BUCKET_SHADER, "scan", Storage::F32, &bucket)?;
    let scatter = pipe(&BUCKET_SHADER, "scatter", Storage::F32, &bucket)?;
    let consts = attend_consts(la, s, cfg);
    let nv = la.nv;
    let attend = match (la.coop, nv) {
        (Some(_), Some((k, _))) => ctx.nv_pipeline(&k)?.0,
        (Some(_), None) => pipe(&COOP_SHADER, "attend_leaf", Storage::F16, &consts)?,
        (None, _) => pipe(&SHADER, "attend_leaf", q.storage, &consts)?,
    };
    let attend_pair = match la.pairs {
        PairKernel::Off => None,
        PairKernel::Nv(k) => Some(ctx.nv_pipeline(&k)?.0),
        PairKernel::Portable => Some(pipe(
            &SHADER,
            "attend_leaf",
            q.storage,
            &pair_consts(la, s, cfg),
        )?),
    };
    let merge = match nv.and_then(|(_, m)| m) {
        Some(m) => ctx.nv_pipeline(&m)?.0,
        None => pipe(&MERGE_SHADER, "merge", q.storage, &merge_consts(g, kk))?,
    };

    let (c, of, co, l) = (&cnt.buffer, &off.buffer, &coff.buffer, &list.buffer);
    let (cd, sp, op, ml) = (&cdesc.buffer, &spos.buffer, &opart.buffer, &mlpart.buffer);
    // Every range's five dispatches, in order: ONE pass ("attention") unprofiled; profiled,
    // three timed passes per range (`PARTS`: the bucketing, the chunk kernel, the merge), the
    // same dispatches and barriers with a timestamp pair around each part.
    // Each dispatch with its part (an index into `PARTS`).
    let mut steps: Vec<(usize, crate::runtime::buffers::Stage)> = Vec::new();
    let mut add = |part: usize,
                   p: &std::sync::Arc<wgpu::ComputePipeline>,
                   binds: &[(u32, Bind<'_>)],
                   n: u64|
     -> Result<()> {
        steps.push((part, ctx.stage(p, binds, n)?));
        Ok(())
    };
    fn whole<'a>(binds: &[(u32, &'a wgpu::Buffer)]) -> Vec<(u32, Bind<'a>)> {
        binds.iter().map(|&(i, b)| (i, b.into())).collect()
    }
    // Ranges: `la.heads` (b, KV head)s from bh on (several only where a range holds every
    // query), queries i0 .. i0 + nq of each.
    let bhs = s.batch * s.kv_heads;
    for bh in (0..bhs).step_by(la.heads as usize) {
        let heads = la.heads.min((bhs - bh) as u32);
        let h64 = heads as u64;
        for i0 in (0..s.q_len).step_by(la.nq as usize) {
            let nq = la.nq.min((s.q_len - i0) as u32);
            let entries = h64 * nq as u64 * kk as u64;
            let n_chunks = h64 * la.chunk_bound(nq, cfg.top_k, nb0);
            let n_pair_chunks = h64 * la.pair_chunk_bound(nq, cfg.top_k, nb0);
            let (leaf_buckets, buckets) = (heads as usize * nb0, (h64 * la.buckets(nb0)) as usize);
            // items; buckets (the leaf chunk kernel's: the leaf buckets, whose chunks come
            // first); first (the pair chunk kernel's first bucket).
            let uni = |items: u64, buckets: usize, first: usize| {
                ctx.uniform(
                    "attention buckets",
                    &Buckets {
                        items: items as u32,
                        buckets: buckets as u32,
                        i0: i0 as u32,
                        nq,
                        bh0: bh as u32,
                        first: first as u32,
                        heads,
                        pad: 0,
                    },
                )
            };
            let (u_e, u_b) = (uni(entries, buckets, 0)?, uni(buckets as u64, buckets, 0)?);
            let (u_c, u_q) = (uni(n_chunks, leaf_buckets, 0)?, uni(0, leaf_buckets, 0)?);
            let sel = &selection.buffer;
            let wgs = entries.div_ceil(BUCKET_TILE);
            add(
                0,
                &count,
                &whole(&[(0, &u_params), (3, sel), (5, c), (10, &u_e)]),
                wgs,
            )?;
            add(0, &scan, &whole(&[(5, c), (6, of), (7, co), (10, &u_b)]), 1)?;
            let b = [(0, &u_params), (3, sel), (5, c), (6, of), (7, co)];
            add(
                0,
                &scatter,
                &whole(&[&b[..], &[(8, l), (10, &u_e), (11, cd)]].concat()),
                wgs,
            )?;
            // Q, K, V bound as their ranges (in place from a caller's buffer, or whole).
            let b = [(1, q.into()), (2, k.into()), (3, v.into())];
            let rest = [(0, &u_params), (7, co), (8, l), (10, &u_c), (11, cd)];
            let rest2 = [(12, op), (13, ml), (14, sp)];
            let binds: Vec<(u32, Bind<'_>)> = [whole(&rest), whole(&rest2), b.to_vec()].concat();
            add(1, &attend, &binds, n_chunks)?;
            if let Some(pair) = &attend_pair {
                let u_p = uni(n_pair_chunks, buckets, leaf_buckets)?;
                // The leaf kernel's bindings, with the pair kernel's chunk uniform.
                let binds: Vec<(u32, Bind<'_>)> = binds
                    .iter()
                    .map(|&(i, b)| if i == 10 { (10, (&u_p).into()) } else { (i, b) })
                    .collect();
                add(1, pair, &binds, n_pair_chunks)?;
            }
            let b = [(0, &u_params), (10, &u_q), (12, op), (13, ml)];
            let rest = [(14, sp), (15, &lse.buffer)];
            // O bound as its range (a caller's tensor, or the whole of its own).
            let binds = [whole(&b), whole(&rest), vec![(5, (&o).into())]].concat();
            add(2, &merge, &binds, h64 * nq as u64)?;
        }
    }
    // Timed in parts only where the profiler has room for every part of every range (else
    // one timed pass, "attention", as the other kernels).
    let parts = steps.chunk_by(|a, b| a.0 == b.0).count() as u32;
    match prof {
        None => ctx.record_pass(enc, "attention", steps.iter().map(|s| &s.1), None),
        Some(prof) if prof.remaining() < parts => {
            ctx.record_pass(enc, "attention", steps.iter().map(|s| &s.1), Some(prof))
        }
        Some(prof) => {
            for run in steps.chunk_by(|a, b| a.0 == b.0) {
                let stages = run.iter().map(|s| &s.1);
                ctx.record_pass(enc, PARTS[run[0].0], stages, Some(&mut *prof));
            }
        }
    }
    Ok((o, lse))
}
