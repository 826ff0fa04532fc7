//! Which attention kernel a call runs: ONE rule, [`plan`], that [`super::record_attention`]
//! dispatches on and that every report of the choice reads ([`attention_kernel`],
//! [`super::coop::attention_path`], `pisa bench`), so a reported kernel is the one that ran; and
//! for a prefill whose queries select every leaf they see, [`prefill_dense_plan`], which the
//! prefill dispatches on and [`prefill_attention_kernel`] reports.

use pisa_core::{AttentionShape, SelectionConfig};

use super::by_leaf::{self, LeafAttention};
use super::coop::{self, CoopVariant};
use super::nv_dense;
use super::split_k::{self, SplitK};
use super::{AttentionKind, QkvLayouts, Tiling};
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::{Context, KernelPath};
use crate::runtime::nv::NvKernel;
use crate::runtime::pipeline::Storage;
use crate::runtime::view::KernelLayout;

/// The kernel that runs one attention call (PISA.md sections 4 and 5); [`attention_kernel`]
/// gives it for a call's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKernel {
    /// Split-K dense attention, FlashDecoding ([`super::split_k`]): the keys cut into splits
    /// whose partial softmax states are merged per row; for few queries against many keys.
    SplitK,
    /// Leaf-major sparse attention ([`super::by_leaf`]): the selection bucketed by leaf, a
    /// partial state per (query, selected leaf), merged per query; on tensor cores
    /// ([`KernelPath::CoopMat`], `attention_leaf_coop.wgsl`) or portable
    /// (`attention_leaf.wgsl`).
    LeafMajor(KernelPath),
    /// Leaf-major sparse attention with the NVIDIA chunk kernel
    /// (`shaders/nv/attention_leaf.comp`, and its merge where it applies: see
    /// [`by_leaf::nv_kernel_for`]), where the device has `VK_NV_cooperative_matrix2`.
    LeafMajorNv,
    /// The cooperative-matrix (tensor-core) query-tile kernel ([`super::coop`],
    /// `attention_coop.wgsl`).
    CoopTile,
    /// The portable query-tile kernel (`attention.wgsl`, [`Tiling`]).
    PortableTile,
    /// Dense attention on NVIDIA cooperative matrices 2 ([`super::nv_dense`],
    /// `shaders/nv/attention_dense.comp`), where the device has `VK_NV_cooperative_matrix2`.
    NvDense,
}

impl AttentionKernel {
    /// The kernel family: [`KernelPath::CoopMat`] for the tensor-core kernels (the coop tile
    /// kernel, leaf-major on tensor cores), [`KernelPath::Portable`] for the others (split-K
    /// included: it has no tensor-core twin).
    pub fn path(self) -> KernelPath {
        match self {
            Self::CoopTile
            | Self::NvDense
            | Self::LeafMajorNv
            | Self::LeafMajor(KernelPath::CoopMat) => KernelPath::CoopMat,
            Self::SplitK | Self::LeafMajor(KernelPath::Portable) | Self::PortableTile => {
                KernelPath::Portable
            }
        }
    }

    /// A short stable name for reports: `split-k`, `leaf-major-coopmat`, `leaf-major-portable`,
    /// `leaf-major-nv`, `coop-tile`, `portable-tile` or `nv-dense`.
    pub fn name(self) -> &'static str {
        match self {
            Self::SplitK => "split-k",
            Self::LeafMajor(KernelPath::CoopMat) => "leaf-major-coopmat",
            Self::LeafMajor(KernelPath::Portable) => "leaf-major-portable",
            Self::LeafMajorNv => "leaf-major-nv",
            Self::CoopTile => "coop-tile",
            Self::PortableTile => "portable-tile",
            Self::NvDense => "nv-dense",
        }
    }
}

impl std::fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A kernel with its plan and the parts of the call's [`AttentionKind`] it runs on.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Plan<'a> {
    SplitK {
        plan: SplitK,
        causal: bool,
        scale: f32,
    },
    LeafMajor {
        plan: LeafAttention,
        selection: &'a GpuTensor,
        cfg: &'a SelectionConfig,
    },
    CoopTile(CoopVariant),
    NvDense {
        kernel: (NvKernel, u32),
        causal: bool,
        scale: f32,
    },
    PortableTile,
}

impl Plan<'_> {
    /// The kernel this plan runs.
    pub fn kernel(&self) -> AttentionKernel {
        match self {
            Self::SplitK { .. } => AttentionKernel::SplitK,
            Self::LeafMajor { plan, .. } if plan.nv.is_some() => AttentionKernel::LeafMajorNv,
            Self::LeafMajor { plan, .. } if plan.coop.is_some() => {
                AttentionKernel::LeafMajor(KernelPath::CoopMat)
            }
            Self::LeafMajor { .. } => AttentionKernel::LeafMajor(KernelPath::Portable),
            Self::CoopTile(_) => AttentionKernel::CoopTile,
            Self::NvDense { .. } => AttentionKernel::NvDense,
            Self::PortableTile => AttentionKernel::PortableTile,
        }
    }
}

/// The kernel and plan of an attention call (the rule of [`attention_kernel`]). Never panics on
/// an invalid call: [`super::record_attention`] rejects those before it asks.
pub(crate) fn plan<'a>(
    ctx: &Context,
    shape: &AttentionShape,
    storage: Storage,
    layouts: QkvLayouts,
    kind: &AttentionKind<'a>,
    tiling: Option<Tiling>,
) -> Plan<'a> {
    // A shape `record_attention` refuses (its fields are public) runs no kernel: any answer,
    // without the sizes below dividing by its zero heads.
    if tiling.is_some() || shape.validate().is_err() {
        return Plan::PortableTile;
    }
    // Split-K's merge and the NVIDIA dense kernel write O at Q's strides: only with O in Q's
    // layout, Q contiguous (the tile kernels write O at its own strides).
    let o_is_q = layouts.q == KernelLayout::Contiguous(layouts.o);
    match *kind {
        // (Split-K reads f32 or f16 only: its plan is None for bf16.)
        AttentionKind::Dense { causal, scale } if o_is_q => {
            if let Some(plan) = split_k::plan(ctx, shape, storage) {
                return Plan::SplitK {
                    plan,
                    causal,
                    scale,
                };
            }
        }
        AttentionKind::Dense { .. } => {}
        AttentionKind::Sparse { selection, cfg } => {
            if cfg.validate().is_ok() {
                if let Some(plan) = by_leaf::plan(ctx, storage, shape, layouts, cfg) {
                    return Plan::LeafMajor {
                        plan,
                        selection,
                        cfg,
                    };
                }
            }
        }
    }
    tile_plan(ctx, shape, storage, layouts, kind, !o_is_q)
}

/// The tile kernels' part of [`plan`] (its rules 4 and 5): the NVIDIA dense kernel (the build
/// writing O at its own strides when `own_o`, else the one writing at Q's, which needs O in
/// Q's layout), the WGSL tensor-core tile kernel, or the portable one.
fn tile_plan<'a>(
    ctx: &Context,
    shape: &AttentionShape,
    storage: Storage,
    layouts: QkvLayouts,
    kind: &AttentionKind<'a>,
    own_o: bool,
) -> Plan<'a> {
    if storage == Storage::F16 {
        if let Some(cv) = coop::plan(ctx, shape, kind) {
            if let AttentionKind::Dense { causal, scale } = *kind {
                if let Some(kernel) = nv_dense::kernel_of(ctx, shape, storage, layouts, own_o) {
                    return Plan::NvDense {
                        kernel,
                        causal,
                        scale,
                    };
                }
            }
            return Plan::CoopTile(cv);
        }
    }
    Plan::PortableTile
}

/// The kernel of a prefill's attention where every query selects every leaf it sees (dense
/// `kind`, [`super::record_every_leaf`]): [`plan`]'s tile kernels (never split-K, which needs O
/// in Q's layout). The choice is made for Q, K and V aligned as a prefill plan reads them (their
/// strides whole 16-byte pieces: the plan's staging, or views read in place), so the kernel a
/// plan records is the one every run replays, whatever the views' layouts.
pub(crate) fn prefill_dense_plan<'a>(
    ctx: &Context,
    shape: &AttentionShape,
    storage: Storage,
    kind: &AttentionKind<'a>,
) -> Plan<'a> {
    tile_plan(ctx, shape, storage, QkvLayouts::default(), kind, true)
}

/// The kernel that runs the attention of a prefill of `shape` with `storage` whose selection
/// and configuration are those of `sparse` (the selection tensor is not read), as
/// [`crate::ops::prefill::PrefillPlan`] and [`crate::ops::prefill::prefill_host`] record it
/// (Q, K, V staged in BHND or read in place): where every query selects every leaf it sees (at
/// most `cfg.top_k` leaves of keys, PISA.md 3.3), the dense kernel of `prefill_dense_plan`,
/// else [`attention_kernel`]'s for `sparse` in BHND. A dense `sparse` is answered as
/// [`attention_kernel`] answers it.
pub fn prefill_attention_kernel(
    ctx: &Context,
    shape: &AttentionShape,
    storage: Storage,
    sparse: &AttentionKind<'_>,
) -> AttentionKernel {
    if let AttentionKind::Sparse { cfg, .. } = sparse {
        if shape.validate().is_ok()
            && cfg.validate().is_ok()
            && crate::ops::select::every_leaf_selected(shape, cfg)
        {
            let kind = super::every_leaf_kind(shape, cfg);
            return prefill_dense_plan(ctx, shape, storage, &kind).kernel();
        }
    }
    plan(ctx, shape, storage, QkvLayouts::default(), sparse, None).kernel()
}

/// The kernel [`super::record_attention`] runs for these arguments (Q's storage as `storage`;
/// the selection tensor of a sparse `kind` is not read). The same function picks it there, so
/// the answer is the kernel that runs. Rule, first match:
///
/// 1. an explicit `tiling`: [`AttentionKernel::PortableTile`] (tests and tuning);
/// 2. dense with f32 or f16 storage, where [`split_k::plan`] says so: [`AttentionKernel::SplitK`] (FlashDecoding,
///    Dao et al. 2023). Few rows per (batch, KV head) (g_q * Nq <= [`split_k::MAX_ROWS`]), many
///    keys (Nk >= [`split_k::MIN_KEYS`]) and a tile launch of fewer than
///    [`split_k::TILE_WORKGROUPS_BELOW`] workgroups: the decode baseline, 287 -> 1.63 ms at 1M
///    keys on the H200 (`docs/benchmarks.md`, split-K dense decode);
/// 3. sparse, where the leaf-major plan takes it: [`AttentionKernel::LeafMajor`], or
///    [`AttentionKernel::LeafMajorNv`] where [`by_leaf::nv_kernel_for`] has an NVIDIA kernel. It follows
///    [`Context::leaf_order`]: Auto on tensor cores from 512 queries on (2.4x / 2.7x over the
///    tile kernel at 64K / 256K on the H200, `docs/benchmarks.md`), Leaves wherever it fits,
///    Tiles never; see [`by_leaf::leaf_major_path`];
/// 4. f16 storage where [`coop::plan`] finds a variant (the context on
///    [`KernelPath::CoopMat`], D a multiple of 16 up to 128): for dense calls where
///    [`nv_dense::kernel_for`] has a kernel (`VK_NV_cooperative_matrix2`, D 64 or 128),
///    [`AttentionKernel::NvDense`], else [`AttentionKernel::CoopTile`];
/// 5. otherwise [`AttentionKernel::PortableTile`].
///
/// A call that [`super::record_attention`] rejects (bad head dim, lengths, configuration)
/// runs no kernel; the answer for it means nothing (but this never panics).
pub fn attention_kernel(
    ctx: &Context,
    shape: &AttentionShape,
    storage: Storage,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
    tiling: Option<Tiling>,
) -> AttentionKernel {
    plan(ctx, shape, storage, layouts, kind, tiling).kernel()
}
