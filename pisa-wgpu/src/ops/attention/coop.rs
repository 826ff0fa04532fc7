//! Tensor-core attention: the cooperative-matrix twin of the portable kernels
//! (`shaders/attention_coop.wgsl`; PISA.md sections 4 and 5), for f16 storage on adapters whose
//! [`KernelPath`] is [`KernelPath::CoopMat`].
//!
//! [`super::record_attention`] first takes split-K (few queries, many keys) and leaf-major
//! sparse attention where their plans apply; for the remaining tile calls it asks [`plan`] and
//! dispatches here when that returns a variant; everything else (f32 storage, head dims that
//! are not a multiple of 16 or above 128, an explicit [`super::Tiling`], adapters without
//! cooperative matrices) runs the portable tile kernel. Same parameters, outputs and row
//! mapping as the portable kernels, and their bindings plus K and V again as f16 scalars (7,
//! 8); the differences
//! are the workgroup cut (16-row blocks of (head, query) pairs, one subgroup per 16x16 tile) and
//! the lazy softmax rescale described in the shader.

use super::launch::Launch;
use super::{validate, AttentionKind, QkvLayouts};
use crate::error::{GpuError, Result};
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::{Context, KernelPath, COOP_SUBGROUPS};
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::profiler::Profiler;
use pisa_core::{AttentionShape, SelectionConfig};

/// `shaders/attention_coop.wgsl` (f16 storage only; needs the cooperative-matrix capability).
pub const SHADER: ShaderSource = ShaderSource {
    name: "attention_coop",
    wgsl: concat!(
        include_str!("../../../../shaders/attention_coop.wgsl"),
        include_str!("../../../../shaders/attention_common.wgsl"),
        include_str!("../../../../shaders/coop_qa.wgsl")
    ),
};

/// Largest head dim of the cooperative-matrix kernels (a multiple of 16 up to this).
pub const MAX_COOP_HEAD_DIM: usize = 128;

/// Shader constants of one cooperative-matrix pipeline variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoopVariant {
    /// Head dim D (multiple of 16, <= 128).
    pub hd: u32,
    /// Row blocks of 16 (head, query) rows per workgroup: 1, 2 or 4.
    pub rb: u32,
    /// Keys per workgroup-memory tile (multiple of 16).
    pub kt: u32,
    /// Consecutive queries per workgroup.
    pub qt: u32,
    /// Query heads per workgroup (a GQA group above 16 is split into chunks).
    pub gh: u32,
    /// top_k (1 for dense).
    pub selk: u32,
    /// Subgroup size (fixed on the adapter).
    pub sg: u32,
    /// Load the next key tile into registers while this one computes (more registers, fewer
    /// stalls).
    pub prefetch: bool,
    /// K and V straight from the storage buffers to the tensor cores, no workgroup staging
    /// (sparse with one row block, where each key feeds one multiply; needs Nk >= 16).
    pub direct: bool,
}

impl CoopVariant {
    fn rt(&self) -> u32 {
        16 * self.rb
    }
    fn kvh(&self) -> u32 {
        if self.direct {
            return self.rt() * (self.hd + 8);
        }
        // K [key][d] (stride D + 8) and V^T [d][key] (stride KT + 8), or the Q staging.
        (self.kt * (self.hd + 8) + self.hd * (self.kt + 8)).max(self.rt() * (self.hd + 8))
    }

    /// Workgroup memory the shader declares, bytes (mirrors its `var<workgroup>` list).
    pub fn shared_bytes(&self) -> u64 {
        let (rt, kt) = (self.rt() as u64, self.kt as u64);
        let wg = (COOP_SUBGROUPS * self.sg) as u64;
        let halves = self.kvh() as u64 + kt * (rt + 8); // then P^T [key][row]
        let floats = rt * (kt + 4) + COOP_SUBGROUPS as u64 * 256 + wg + rt;
        let maxu4 = (self.qt * self.selk).div_ceil(4) as u64 * 4;
        // attention_common.wgsl: five arrays of MAXU4 words and the count; flag_sh.
        2 * halves + 4 * floats + 20 * maxu4 + 32
    }

    /// The `(name, value)` constants for [`crate::runtime::pipeline::preprocess`].
    pub fn consts(&self) -> [(&'static str, u32); 9] {
        [
            ("DIRECT", self.direct as u32),
            ("HD", self.hd),
            ("RB", self.rb),
            ("KT", self.kt),
            ("QT", self.qt),
            ("SELK", self.selk),
            ("SG", self.sg),
            ("KVH", self.kvh()),
            ("PF", self.prefetch as u32),
        ]
    }
}

/// The cooperative-matrix variant for an f16 call of this shape and kind on `ctx`, or `None`
/// when it must run the portable kernel (path not CoopMat, head dim not a multiple of 16 or
/// above [`MAX_COOP_HEAD_DIM`], or nothing fits the workgroup memory).
///
/// Choice: GH = min(g_q, 16) heads; sparse QT = max(4, 16 / GH) queries (the paper's Qtile of
/// 4 once the group fills a 16-row block) and KT = min(C rounded up to 16, 64); dense QT =
/// 64 / GH (64 rows) and KT = 32 (45.5 against 30.6 TFLOP/s for KT = 16 at 16K on the H200,
/// with V and P staged transposed; docs/benchmarks.md, A.4: 2026-11-29, commit 0b24e60). Rows
/// are padded to 16, 32 or 64 and at most the workgroup size; KT halves (down to 16), then QT
/// halves, until the workgroup memory fits. Sparse with one row block (g_q * QT <= 16) and
/// Nk >= 16 loads K and V straight from the storage buffers (`direct`: 2x at 16K on the H200,
/// 11.7 against 24.1 ms).
pub fn plan(
    ctx: &Context,
    shape: &AttentionShape,
    kind: &AttentionKind<'_>,
) -> Option<CoopVariant> {
    if ctx.kernel_path() != KernelPath::CoopMat {
        return None;
    }
    let sparse = match kind {
        AttentionKind::Sparse { cfg, .. } => Some(*cfg),
        AttentionKind::Dense { .. } => None,
    };
    choose(ctx.limits(), ctx.report().subgroup_size.0, shape, sparse)
}

/// [`plan`] on a CoopMat device with limits `l` and subgroup size `sg`, for a sparse call
/// (`sparse`: its configuration) or a dense one (`None`).
fn choose(
    l: &wgpu::Limits,
    sg: u32,
    shape: &AttentionShape,
    sparse: Option<&SelectionConfig>,
) -> Option<CoopVariant> {
    let d = shape.head_dim;
    if d == 0 || !d.is_multiple_of(16) || d > MAX_COOP_HEAD_DIM {
        return None;
    }
    let wg = COOP_SUBGROUPS * sg;
    let gh = shape.gqa_group().clamp(1, 16) as u32;
    let (mut qt, mut kt, selk) = match sparse {
        Some(cfg) => (
            (16 / gh).max(4),
            (cfg.block_size.div_ceil(16) * 16).clamp(16, 64) as u32,
            cfg.top_k as u32,
        ),
        None => ((64 / gh).max(1), 32, 1),
    };
    let budget = l.max_compute_workgroup_storage_size as u64;
    loop {
        let rb = (gh * qt).div_ceil(16).next_power_of_two();
        if rb <= 4 && 16 * rb <= wg {
            let v = CoopVariant {
                hd: d as u32,
                rb,
                kt,
                qt,
                gh,
                selk,
                sg,
                prefetch: true,
                direct: rb == 1 && sparse.is_some() && shape.k_len >= 16,
            };
            if v.shared_bytes() <= budget {
                return Some(v);
            }
            if kt > 16 {
                kt = (kt / 2).div_ceil(16) * 16;
                continue;
            }
        }
        if qt == 1 {
            return None;
        }
        qt /= 2;
    }
}

/// The kernel family [`super::record_attention`] runs for this call with the default tiling
/// and Q, K, V in the default layout ([`QkvLayouts::default`]): the path of
/// [`super::attention_kernel`] (which names the kernel itself, e.g. split-K, portable).
pub fn attention_path(
    ctx: &Context,
    shape: &AttentionShape,
    storage: Storage,
    kind: &AttentionKind<'_>,
) -> KernelPath {
    super::attention_kernel(ctx, shape, storage, QkvLayouts::default(), kind, None).path()
}

/// Records the cooperative-matrix kernel with an explicit variant (tuning and benchmarks; the
/// public API picks one with [`plan`]). Inputs as [`super::record_attention`] with f16 storage.
///
/// Errors: as [`super::record_attention`], plus [`GpuError::Unsupported`] when the context is
/// not on [`KernelPath::CoopMat`], the storage is not f16, or the variant does not suit the
/// shape and device (head dim, subgroup size, row blocks, key tile, workgroup memory).
#[allow(clippy::too_many_arguments)]
pub fn record_coop(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    shape: &AttentionShape,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
    var: &CoopVariant,
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    validate(shape, q, k, v, layouts, kind)?;
    let wg = COOP_SUBGROUPS * ctx.report().subgroup_size.0;
    let ok = ctx.kernel_path() == KernelPath::CoopMat
        && q.storage == Storage::F16
        && var.hd as usize == shape.head_dim
        && var.hd.is_multiple_of(16)
        && var.hd as usize <= MAX_COOP_HEAD_DIM
        && var.sg == ctx.report().subgroup_size.0
        && [1, 2, 4].contains(&var.rb)
        && 16 * var.rb <= wg
        && var.gh >= 1
        && var.gh as usize <= shape.gqa_group()
        && var.qt >= 1
        && var.gh * var.qt <= 16 * var.rb
        && var.kt >= 16
        && var.kt.is_multiple_of(16)
        && (!var.direct || shape.k_len >= 16)
        && var.shared_bytes() <= ctx.limits().max_compute_workgroup_storage_size as u64
        && match kind {
            AttentionKind::Sparse { cfg, .. } => var.qt <= 32 && var.selk as usize == cfg.top_k,
            AttentionKind::Dense { .. } => true,
        };
    if !ok {
        return Err(GpuError::Unsupported(format!(
            "cooperative-matrix variant {var:?} for {shape:?} on this context"
        )));
    }
    record(
        ctx,
        enc,
        [q, k, v],
        shape,
        layouts,
        kind,
        var,
        (None, None),
        prof,
    )
}

/// Records the cooperative-matrix kernel of variant `var` (from [`plan`]); inputs validated by
/// the caller. Shapes, layouts, outputs, profiler labels and errors as
/// [`super::record_attention`]; O written into `out` when given, the pass timed as `label`
/// when given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    [q, k, v]: [&GpuTensor; 3],
    s: &AttentionShape,
    layouts: QkvLayouts,
    kind: &AttentionKind<'_>,
    var: &CoopVariant,
    (out, label): (Option<&super::OutTarget>, Option<&'static str>),
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    let l = Launch::new(ctx, q, s, layouts, kind, (var.gh, var.qt, var.kt), out)?.labelled(label);
    let pipe = ctx.pipelines.get(
        &ctx.device,
        &SHADER,
        l.entry(),
        Storage::F16,
        &var.consts(),
        &[],
    )?;
    // K and V again as f16 scalars for the direct (unstaged) tensor-core loads.
    let extra = [(7, k.into()), (8, v.into())];
    l.dispatch(ctx, enc, &pipe, [q, k, v], kind, &extra, prof)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::pipeline::{assert_workgroup_fits, limits_with_memory};

    /// The workgroup variables of the sparse and dense entry points (naga's sizes, f16, the
    /// variant's constants substituted; naga 30 parses and validates the cooperative-matrix
    /// extension) fit what [`CoopVariant::shared_bytes`] charges, for the variants [`plan`]
    /// picks: head dims 16 to 128, GQA groups 1 to 32, sparse (C 16 and 64, direct and staged)
    /// and dense, subgroup sizes 8 to 64, at 16, 32 and 48 KiB (so KT and QT shrink in some).
    #[test]
    fn shared_bytes_covers_the_shader() {
        let sparse = [
            SelectionConfig::new(64, 16).unwrap(),
            SelectionConfig::new(16, 40).unwrap(),
        ];
        let mut checked = 0;
        for (d, g, nk) in [(128, 4, 4096), (64, 1, 4096), (80, 8, 8), (16, 32, 64)] {
            let shape = AttentionShape::new(1, g, 1, 4, nk, d).unwrap();
            for sg in [8, 32, 64] {
                for mem in [16u32 << 10, 32 << 10, 48 << 10] {
                    let lim = limits_with_memory(mem);
                    let kinds = [Some(&sparse[0]), Some(&sparse[1]), None];
                    for cfg in kinds {
                        let Some(v) = choose(&lim, sg, &shape, cfg) else {
                            continue;
                        };
                        checked += 1;
                        let entry = if cfg.is_some() { "sparse" } else { "dense" };
                        // (PF only picks the code path: the same arrays either way.)
                        for v in [
                            v,
                            CoopVariant {
                                prefetch: false,
                                ..v
                            },
                        ] {
                            assert_workgroup_fits(
                                &SHADER,
                                entry,
                                Storage::F16,
                                &v.consts(),
                                v.shared_bytes(),
                                format!("D {d} g {g} at {mem} bytes"),
                            );
                        }
                    }
                }
            }
        }
        assert!(checked >= 60, "only {checked} variants checked");
    }
}
