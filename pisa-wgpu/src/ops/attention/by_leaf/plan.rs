//! The plan of a leaf-major attention call ([`super`]): which kernel, chunk size and rows, the
//! queries per range (so that a range's partial states fit one storage binding), and whether
//! the default order (Auto) takes it.

use pisa_core::{AttentionShape, SelectionConfig};

use super::super::{element_strides, QkvLayouts};
use crate::runtime::context::{Context, KernelPath, LeafOrder, COOP_SUBGROUPS};
use crate::runtime::nv::NvKernel;
use crate::runtime::pipeline::Storage;

/// Most keys per leaf (one invocation per key in the portable kernel; at most 4 16-key tiles,
/// one per subgroup, in the tensor-core one).
const MAX_BLOCK: usize = 64;
/// Most rows of a portable chunk (entries * g_q), at least one entry.
const PORTABLE_ROWS: u32 = 16;
/// Fewest queries for which the default order (Auto) runs leaf-major. On the H200 it was 2.4x /
/// 2.7x faster than the tile kernel at 64K / 256K tokens; on the H100 (2026-12-05,
/// docs/benchmarks.md A.52) faster at every size measured from 1024 queries: whole prompts of
/// 2K and 4K tokens (0.98 against 1.30 ms, 1.59 against 3.93), and prompt chunks of 1K and 4K
/// queries over 64K and 256K keys (4K over 256K: 3.05 against 8.14 ms); with ranges of several
/// heads (A.53) also at 512, 768 and 1000-token prompts (0.110 against 0.146 ms, 0.155 against
/// 0.254, 0.211 against 0.388) and slower at 256 and 128 (0.064 against 0.058, 0.061 against
/// 0.024). (It was 8192, from whole prompts of earlier kernels, then 1024.)
const AUTO_MIN_QUERIES: usize = 512;

/// The plan of one leaf-major attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeafAttention {
    /// Tensor-core kernel (with its subgroup size) or portable.
    pub coop: Option<u32>,
    /// Entries per chunk.
    pub qpc: u32,
    /// Rows of a chunk's partial states (16 * subgroups on tensor cores, qpc * g_q portable).
    pub rows: u32,
    /// Queries per range.
    pub nq: u32,
    /// (b, KV head)s per range: several where a range holds every query ([`heads_per_range`]),
    /// else 1.
    pub heads: u32,
    /// The NVIDIA chunk kernel and merge, where they run ([`super::nv_kernel_for`], chosen
    /// once here for the recorder).
    pub nv: Option<(NvKernel, Option<NvKernel>)>,
    /// Sibling pairs attended as one entry ([`crate::Tuning::attention_pairs`]): with a pair
    /// kernel, the bucketing's pair buckets after the leaf buckets and that second chunk kernel
    /// over them; [`PairKernel::Off`] without.
    pub pairs: PairKernel,
}

/// The chunk kernel of a leaf-major plan over sibling pairs (a query that selected both leaves
/// of a pair is one entry over their 2C keys; `leaf_bucket.wgsl` APAIR).
#[derive(Debug, Clone, Copy)]
pub(crate) enum PairKernel {
    /// No pairs: every entry is one leaf (the knob is off, the chunk kernel has no pair
    /// variant, or the pairs' keys or buckets do not fit the device).
    Off,
    /// The portable chunk kernel with PAIR = 1 (`attention_leaf.wgsl`).
    Portable,
    /// An NVIDIA pair kernel ([`super::nv_pair_kernel_for`]).
    Nv(NvKernel),
}

impl PairKernel {
    /// Whether pairs are attended as one entry.
    pub fn on(self) -> bool {
        !matches!(self, PairKernel::Off)
    }
}

impl LeafAttention {
    /// Leaf chunks dispatched for a range of `nq` queries (an upper bound: each leaf's last
    /// chunk may be partial).
    pub fn chunk_bound(&self, nq: u32, top_k: usize, nb0: usize) -> u64 {
        (nq as u64 * top_k as u64).div_ceil(self.qpc as u64) + nb0 as u64
    }

    /// Pair chunks dispatched for a range of `nq` queries (a pair entry takes two of a query's
    /// `top_k` slots); 0 without pairs.
    pub fn pair_chunk_bound(&self, nq: u32, top_k: usize, nb0: usize) -> u64 {
        match self.pairs.on() {
            true => {
                (nq as u64 * (top_k / 2) as u64).div_ceil(self.qpc as u64) + self.pair_buckets(nb0)
            }
            false => 0,
        }
    }

    /// Chunks a range of `nq` queries can fill, leaf and pair chunks together (the partial
    /// states' rows): its entries take at most `nq * top_k` slots, a pair entry two, and each
    /// bucket adds at most one partial chunk.
    pub fn row_chunk_bound(&self, nq: u32, top_k: usize, nb0: usize) -> u64 {
        self.chunk_bound(nq, top_k, nb0) + self.pair_buckets(nb0)
    }

    /// Buckets of the bucketing: a leaf's, then with pairs a pair's.
    pub fn buckets(&self, nb0: usize) -> u64 {
        nb0 as u64 + self.pair_buckets(nb0)
    }

    /// Pair buckets of `nb0` leaves: one per pair with pairs, else none.
    fn pair_buckets(&self, nb0: usize) -> u64 {
        match self.pairs.on() {
            true => nb0.div_ceil(2) as u64,
            false => 0,
        }
    }

    /// Workgroup bytes of the chunk kernel for head dim `d` and block size `c` (mirrors the
    /// `var<workgroup>` lists of `attention_leaf_coop.wgsl` and `attention_leaf.wgsl`, with the
    /// chunk lookup's four words).
    pub fn shared_bytes(&self, d: usize, c: usize) -> u64 {
        match self.coop {
            Some(sg) => {
                let (cw, wg) = (16 * c.div_ceil(16) as u64, (COOP_SUBGROUPS * sg) as u64);
                let rt64 = self.rows as u64;
                // qsh (Q rows, K rows, then V^T [d][key]), psh (P^T [key][row]), fsh (S).
                let qsh = (rt64 * (d as u64 + 8)).max(d as u64 * (cw + 8));
                let mem = 2 * qsh + 2 * cw * (rt64 + 8) + 4 * rt64 * (cw + 4);
                mem + 4 * wg + 4 * rt64 + 16
            }
            None => {
                // The pair kernel's keys: 128 (PAIR = 1, WG 128).
                let (r, keys) = (self.rows as u64, if self.pairs.on() { 128 } else { 64 });
                16 + 4 * self.qpc as u64 + 4 * r * keys + 8 * r
            }
        }
    }
}

/// Whether a sparse-attention call of this shape, layouts, configuration and storage on `ctx`
/// runs leaf-major (else the tile kernels), and on tensor cores: `None` (tiles),
/// `Some(KernelPath)` (leaf-major on that path). The same answer as
/// [`crate::ops::attention::attention_kernel`] (the whole choice) gives for such a call.
pub fn leaf_major_path(
    ctx: &Context,
    storage: Storage,
    s: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
) -> Option<KernelPath> {
    plan(ctx, storage, s, layouts, cfg).map(|la| match la.coop {
        Some(_) => KernelPath::CoopMat,
        None => KernelPath::Portable,
    })
}

/// Whether a sparse-attention call of this shape, layouts, configuration and storage on `ctx`
/// runs leaf-major with sibling pairs as one entry ([`crate::Tuning::attention_pairs`]; false
/// where it does not run leaf-major, or its kernel has no pair variant).
pub fn leaf_major_pairs(
    ctx: &Context,
    storage: Storage,
    s: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
) -> bool {
    plan(ctx, storage, s, layouts, cfg).is_some_and(|la| la.pairs.on())
}

/// The ranges a leaf-major sparse-attention call of this shape, layouts, configuration and
/// storage on `ctx` runs in, as (queries, (b, KV head)s) per range: each range is one
/// bucketing, chunk dispatch and merge, its partial states within one storage binding. Several
/// (b, KV head)s share a range only where it holds every query. `None` where the call does not
/// run leaf-major.
pub fn leaf_major_range(
    ctx: &Context,
    storage: Storage,
    s: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
) -> Option<(usize, usize)> {
    plan(ctx, storage, s, layouts, cfg).map(|la| (la.nq as usize, la.heads as usize))
}

/// The leaf-major plan for a validated sparse-attention call, or `None` (the tile kernels run;
/// also for a shape or configuration the attention refuses, which the public questions above
/// may be asked about: their fields are public).
pub(crate) fn plan(
    ctx: &Context,
    storage: Storage,
    s: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
) -> Option<LeafAttention> {
    s.validate().ok()?;
    cfg.validate().ok()?;
    let (g, d) = (s.gqa_group() as u32, s.head_dim);
    let order = ctx.leaf_order();
    if order == LeafOrder::Tiles || layouts.k != layouts.v {
        return None;
    }
    let sg = ctx.report().subgroup_size.0;
    let aligned = element_strides(layouts.q, s.q_heads, s.q_len, d)
        .into_iter()
        .chain(element_strides(layouts.k, s.kv_heads, s.k_len, d))
        .all(|x| x % 8 == 0);
    let coop_ok = ctx.kernel_path() == KernelPath::CoopMat
        && storage == Storage::F16
        && d % 16 == 0
        && d <= 128
        && g <= 16 * COOP_SUBGROUPS
        && sg >= 16
        && s.k_len >= 16
        && aligned;
    // Auto: leaf-major on tensor cores only, from AUTO_MIN_QUERIES queries on (its docs say
    // what was measured); Leaves: everywhere it fits, the portable kernel included.
    if order == LeafOrder::Auto && (!coop_ok || s.q_len < AUTO_MIN_QUERIES) {
        return None;
    }
    let nv = coop_ok.then(|| super::nv_kernel_for(ctx, s, cfg)).flatten();
    // Pairs where the chunk kernel has a pair variant: the portable one, the NVIDIA ones (not
    // the WGSL tensor-core one).
    let nv_pair = nv
        .as_ref()
        .and_then(|nv| super::nv_pair_kernel_for(ctx, nv));
    let pairs = match (ctx.tuning().attention_pairs, coop_ok, nv_pair) {
        (false, ..) => PairKernel::Off,
        (true, false, _) => PairKernel::Portable,
        (true, true, Some(k)) => PairKernel::Nv(k),
        (true, true, None) => PairKernel::Off,
    };
    let mut la = choose(
        ctx.limits(),
        ctx.max_binding_bytes(),
        s,
        cfg,
        coop_ok.then_some(sg),
        opart_bytes(nv.as_ref()),
        pairs,
    )?;
    la.nv = nv;
    // Ranges of several heads take the NVIDIA kernels' multi-head twins (one head per range
    // where the driver built no twin).
    if la.heads > 1 {
        if let Some((k, merge)) = la.nv {
            let twin = super::nv_multi_head_kernel(ctx, &k);
            let pair_twin = match la.pairs {
                PairKernel::Nv(p) => super::nv_multi_head_kernel(ctx, &p).map(PairKernel::Nv),
                other => Some(other),
            };
            match (twin, pair_twin) {
                (Some(t), Some(pt)) => {
                    la.nv = Some((t, merge));
                    la.pairs = pt;
                }
                _ => la.heads = 1,
            }
        }
    }
    Some(la)
}

/// Bytes of one partial O element: 2 where the NVIDIA chunk kernel stores its rows as f16 for
/// its merge (`attention_leaf_d128_h` with `attention_leaf_merge_h`, and the `_d64` ones), else
/// 4 (f32).
pub(crate) fn opart_bytes(nv: Option<&(NvKernel, Option<NvKernel>)>) -> u64 {
    match nv {
        Some((_, Some(_))) => 2,
        _ => 4,
    }
}

/// The merge's workgroup bytes (`attention_leaf_merge.wgsl`): the slot rows (`top_k`), an (m,
/// weight) pair per (slot, head of the group `g`) and a (max, 1 / sum) pair per head, plus 16
/// bytes to spare (the chunk lookup's four words, which the merge does not use).
fn merge_bytes(top_k: usize, g: u32) -> u64 {
    4 * top_k as u64 + 8 * top_k as u64 * g as u64 + 8 * g as u64 + 16
}

/// [`plan`] once the order took leaf-major, for a device with limits `l` and storage bindings
/// of at most `max_binding` bytes: on tensor cores with subgroup size `coop`, or portable
/// (`None`); partial O elements of `elem_bytes` bytes ([`opart_bytes`]); sibling pairs as one
/// entry by the kernel `pairs` where they fit.
fn choose(
    l: &wgpu::Limits,
    max_binding: u64,
    s: &AttentionShape,
    cfg: &SelectionConfig,
    coop: Option<u32>,
    elem_bytes: u64,
    pairs: PairKernel,
) -> Option<LeafAttention> {
    let (g, d, c) = (s.gqa_group() as u32, s.head_dim, cfg.block_size);
    if c > MAX_BLOCK {
        return None;
    }
    let limit = l.max_compute_workgroup_storage_size as u64;
    if merge_bytes(cfg.top_k, g) > limit {
        return None;
    }
    let (qpc, rows) = match coop {
        Some(_) => {
            let rt = 16 * COOP_SUBGROUPS;
            (rt / g, rt)
        }
        None => {
            if g > 32 {
                return None;
            }
            let qpc = (PORTABLE_ROWS / g).max(1);
            (qpc, qpc * g)
        }
    };
    let mut la = LeafAttention {
        coop,
        qpc,
        rows,
        nq: 0,
        heads: 1,
        nv: None,
        pairs,
    };
    // Without pairs where the pair kernel's keys do not fit.
    if la.shared_bytes(d, c) > limit {
        la.pairs = PairKernel::Off;
    }
    if la.shared_bytes(d, c) > limit {
        return None;
    }
    // Queries per range: the partial states of its chunks within one binding (without pairs
    // where their buckets' partial chunks leave no room for a query).
    let row_bytes = elem_bytes * d as u64;
    let max_chunks = max_binding / row_bytes / rows as u64;
    let queries = |la: &LeafAttention| {
        let chunks = max_chunks.checked_sub(la.buckets(s.k_len.div_ceil(c)) + 1)?;
        let nq = (chunks * qpc as u64 / cfg.top_k as u64).min(s.q_len as u64);
        (nq > 0 && nq < u32::MAX as u64).then_some(nq as u32)
    };
    if la.pairs.on() && queries(&la).is_none() {
        la.pairs = PairKernel::Off;
    }
    let nq = queries(&la)?;
    let heads = heads_per_range(&la, s, cfg, nq, max_chunks);
    Some(LeafAttention { nq, heads, ..la })
}

/// (b, KV head)s one range of plan `la` covers: 1 where a range holds part of the queries
/// (`nq < q_len`), else as many as the partial states of their chunks leave within one binding
/// (`max_chunks` chunks; the bounds of [`LeafAttention::row_chunk_bound`] per head), and whose
/// entries stay below 2^31 (the bucketing's entry index). A range of many heads is one
/// bucketing, one chunk dispatch (two with pairs) and one merge, where each head took its own
/// five or six small dependent dispatches: on the H100 (2026-12-05, docs/benchmarks.md A.53)
/// the attention of 1K queries over 64K keys took 0.66 against 1.25 ms, of a 2K-token prompt
/// 0.47 against 0.98; prompts whose heads each fill a binding (64K tokens) keep one per range.
fn heads_per_range(
    la: &LeafAttention,
    s: &AttentionShape,
    cfg: &SelectionConfig,
    nq: u32,
    max_chunks: u64,
) -> u32 {
    let all = (s.batch * s.kv_heads) as u64;
    if (nq as usize) < s.q_len {
        return 1;
    }
    let nb0 = s.k_len.div_ceil(cfg.block_size);
    let per_head = la.row_chunk_bound(nq, cfg.top_k, nb0) + 1;
    let by_entries = (i32::MAX as u64) / (nq as u64 * cfg.top_k as u64).max(1);
    (max_chunks / per_head).min(by_entries).clamp(1, all) as u32
}

#[cfg(test)]
mod tests {
    use super::super::{
        attend_consts, merge_consts, pair_consts, COOP_SHADER, MERGE_SHADER, SHADER,
    };
    use super::*;
    use crate::ops::leaf_select::by_leaf::{bucket_consts, bucket_window_for, BUCKET_SHADER};
    use crate::runtime::pipeline::{
        assert_workgroup_fits, limits_with_memory, MIN_WORKGROUP_BYTES,
    };

    /// The chunk kernels' workgroup variables (naga's sizes, the constants
    /// [`super::super::record`] builds substituted; the tensor-core kernel in f16, the
    /// portable one in f32 and f16) fit what [`LeafAttention::shared_bytes`] charges, and the
    /// merge's fit [`merge_bytes`], for the plans [`plan`] makes: head dims 16 to 256 (30 and
    /// 256: portable only), GQA groups 1 to 64 (portable: up to 32), C 8 to 64, top_k 1 to 64,
    /// subgroups of 16 to 64 invocations, at 16, 32 and 48 KiB. The bucket kernels (fixed
    /// arrays, not planned) fit WebGPU's minimum of 16 KiB.
    #[test]
    fn workgroup_bytes_cover_the_shaders() {
        let mut checked = 0;
        for (d, g, c, top_k) in [
            (128, 4, 64, 16),
            (64, 1, 16, 8),
            (80, 16, 32, 40),
            (16, 64, 48, 1),
            (96, 8, 8, 64),
            (128, 2, 50, 24),
            (256, 32, 64, 16),
            (30, 7, 64, 3),
        ] {
            let s = AttentionShape::new(1, g, 1, 64, 4096, d).unwrap();
            let cfg = SelectionConfig::new(c, top_k).unwrap();
            // The plan's own conditions for the tensor-core kernel (the device's aside).
            let coop_ok = d % 16 == 0 && d <= 128 && g as u32 <= 16 * COOP_SUBGROUPS;
            for mem in [16u32 << 10, 32 << 10, 48 << 10] {
                let lim = limits_with_memory(mem);
                let mut runs = vec![];
                for pairs in [PairKernel::Off, PairKernel::Portable] {
                    runs.extend([(None, Storage::F32, pairs), (None, Storage::F16, pairs)]);
                }
                if coop_ok {
                    runs.extend([16, 32, 64].map(|sg| (Some(sg), Storage::F16, PairKernel::Off)));
                }
                for (coop, storage, pairs) in runs {
                    let Some(la) = choose(&lim, 1 << 31, &s, &cfg, coop, 4, pairs) else {
                        continue;
                    };
                    checked += 1;
                    let shader = if coop.is_some() {
                        &COOP_SHADER
                    } else {
                        &SHADER
                    };
                    let consts = attend_consts(&la, &s, &cfg);
                    let what = format!("{la:?} at {mem} bytes");
                    let charged = la.shared_bytes(d, c);
                    assert_workgroup_fits(shader, "attend_leaf", storage, &consts, charged, &what);
                    if la.pairs.on() {
                        let consts = pair_consts(&la, &s, &cfg);
                        assert_workgroup_fits(
                            shader,
                            "attend_leaf",
                            storage,
                            &consts,
                            charged,
                            &what,
                        );
                    }
                    let consts = merge_consts(g as u32, top_k as u32);
                    let charged = merge_bytes(top_k, g as u32);
                    assert_workgroup_fits(&MERGE_SHADER, "merge", storage, &consts, charged, &what);
                    for entry in ["count", "scan", "scatter"] {
                        let min = MIN_WORKGROUP_BYTES;
                        let w = bucket_window_for(min as u32, la.pairs.on());
                        let c = bucket_consts(top_k as u32, la.qpc, true, la.pairs.on(), w);
                        assert_workgroup_fits(&BUCKET_SHADER, entry, Storage::F32, &c, min, &what);
                    }
                }
            }
        }
        assert!(checked >= 90, "only {checked} plans checked");
    }

    /// Every NVIDIA chunk kernel has its multi-head twin under the name
    /// [`super::super::nv_multi_head_kernel`] looks for (`<name>_mh`), so a range of several
    /// heads never falls back to one head for want of an embedded twin.
    #[test]
    fn every_nv_chunk_kernel_has_a_multi_head_twin() {
        use super::super::NV_ATTENTION;
        let chunk = |n: &str| !n.contains("merge") && !n.ends_with("_mh");
        let kernels: Vec<_> = NV_ATTENTION.iter().filter(|k| chunk(k.name)).collect();
        assert_eq!(kernels.len(), 8);
        for k in kernels {
            let twin = NV_ATTENTION
                .iter()
                .any(|t| t.name.strip_suffix("_mh") == Some(k.name));
            assert!(twin, "{} has no multi-head twin", k.name);
        }
    }

    /// Pairs are dropped, not leaf-major attention, where their buckets' partial chunks leave
    /// a binding no room for a query: 80 chunks of 16 rows x 64 f32 fit, 64 leaves and 32 pairs
    /// need 97, the leaves alone 65 (then 15 chunks, 3 queries of K 16 per range).
    #[test]
    fn pairs_give_way_where_the_binding_is_short() {
        let s = AttentionShape::new(1, 4, 1, 4096, 4096, 64).unwrap();
        let cfg = SelectionConfig::new(64, 16).unwrap();
        let lim = limits_with_memory(48 << 10);
        let pairs = PairKernel::Portable;
        let short = choose(&lim, 80 * 16 * 64 * 4, &s, &cfg, None, 4, pairs).unwrap();
        assert!(!short.pairs.on());
        assert_eq!(short.nq, 3);
        let long = choose(&lim, 1 << 31, &s, &cfg, None, 4, pairs).unwrap();
        assert!(long.pairs.on());
    }
}
