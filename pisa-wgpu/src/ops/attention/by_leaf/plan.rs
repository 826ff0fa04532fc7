//! The plan of a leaf-major attention call ([`super`]): which kernel, chunk size and rows, the
//! queries per range (so that a range's partial states fit one storage binding), and whether
//! the default order (Auto) takes it.

use pisa_core::{AttentionShape, SelectionConfig};

use super::super::{element_strides, QkvLayouts};
use crate::runtime::context::{Context, KernelPath, LeafOrder, COOP_SUBGROUPS};
use crate::runtime::pipeline::Storage;

/// Most keys per leaf (one invocation per key in the portable kernel; at most 4 16-key tiles,
/// one per subgroup, in the tensor-core one).
const MAX_BLOCK: usize = 64;
/// Most rows of a portable chunk (entries * g_q), at least one entry.
const PORTABLE_ROWS: u32 = 16;
/// Fewest queries for which the default order (Auto) runs leaf-major: its five dispatches per
/// (b, KV head) and range pay off on long sequences (measured from 16K tokens on); shorter ones
/// keep the tile kernel.
const AUTO_MIN_QUERIES: usize = 8192;

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
}

impl LeafAttention {
    /// Chunks dispatched for a range of `nq` queries (an upper bound: each leaf's last chunk
    /// may be partial).
    pub fn chunk_bound(&self, nq: u32, top_k: usize, nb0: usize) -> u64 {
        (nq as u64 * top_k as u64).div_ceil(self.qpc as u64) + nb0 as u64
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

/// The leaf-major plan for a validated sparse-attention call, or `None` (the tile kernels run).
pub(crate) fn plan(
    ctx: &Context,
    storage: Storage,
    s: &AttentionShape,
    layouts: QkvLayouts,
    cfg: &SelectionConfig,
) -> Option<LeafAttention> {
    let (g, d, c) = (s.gqa_group() as u32, s.head_dim, cfg.block_size);
    let order = ctx.leaf_order();
    if order == LeafOrder::Tiles || layouts.k != layouts.v || c > MAX_BLOCK {
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
    // Auto: leaf-major on tensor cores only, from AUTO_MIN_QUERIES queries on (2.4x / 2.7x
    // faster than the tile kernel at 64K / 256K on the H200, 1.13x at 16K; docs/benchmarks.md);
    // Leaves: everywhere it fits, the portable kernel included.
    if order == LeafOrder::Auto && (!coop_ok || s.q_len < AUTO_MIN_QUERIES) {
        return None;
    }
    // The merge's workgroup arrays: the slot rows (K) and a (max, sum) per head.
    let limit = ctx.limits().max_compute_workgroup_storage_size as u64;
    if 4 * cfg.top_k as u64 + 8 * g as u64 + 16 > limit {
        return None;
    }
    let (coop, qpc, rows, shared) = if coop_ok {
        let rt = 16 * COOP_SUBGROUPS;
        let (cw, wg) = (16 * c.div_ceil(16) as u64, (COOP_SUBGROUPS * sg) as u64);
        let rt64 = rt as u64;
        // qsh (Q rows, K rows, then V^T [d][key]), psh (P^T [key][row]), fsh (S).
        let qsh = (rt64 * (d as u64 + 8)).max(d as u64 * (cw + 8));
        let mem = 2 * qsh + 2 * cw * (rt64 + 8) + 4 * rt64 * (cw + 4);
        (Some(sg), rt / g, rt, mem + 4 * wg + 4 * rt64 + 16)
    } else {
        if g > 32 {
            return None;
        }
        let qpc = (PORTABLE_ROWS / g).max(1);
        let r = (qpc * g) as u64;
        (None, qpc, qpc * g, 16 + 4 * qpc as u64 + 4 * r * 64 + 8 * r)
    };
    if shared > ctx.limits().max_compute_workgroup_storage_size as u64 {
        return None;
    }
    // Queries per range: the partial states of its chunks within one binding.
    let nb0 = s.k_len.div_ceil(c) as u64;
    let row_bytes = 4 * d as u64;
    let max_rows = ctx.max_binding_bytes() / row_bytes;
    let chunks = (max_rows / rows as u64).checked_sub(nb0 + 1)?;
    let nq = (chunks * qpc as u64 / cfg.top_k as u64).min(s.q_len as u64);
    (nq > 0 && nq < u32::MAX as u64).then_some(LeafAttention {
        coop,
        qpc,
        rows,
        nq: nq as u32,
    })
}
