//! Stage 2 of PISA prefill selection on tensor cores: the cooperative-matrix twin of the
//! portable leaf scorer (`shaders/leaf_select_coop.wgsl`; PISA.md sections 2, 3.3, 3.4 and 5),
//! for f16 storage on adapters whose [`KernelPath`] is [`KernelPath::CoopMat`].
//!
//! `super::record` calls `plan` (the crate-private twin of [`plan_for`]); when it returns a
//! variant, stage 2 runs on tensor cores: leaf-major ([`super::by_leaf`], whose scorer takes
//! this variant's constants) under the default [`crate::LeafOrder`], else this query-tile
//! kernel. Everything else (f32 storage, head dims that are not a multiple of 16 or above 128,
//! GQA groups above 16, fewer than 16 keys, adapters without cooperative matrices) runs the
//! portable kernels. Same bindings, parameters and output as the portable kernel: the
//! selection `[B, Hkv, Nq, K]` i32.
//!
//! Numerics: Q and K enter the tensor cores as the f16 values stored (exact), products are
//! accumulated in f32 and scaled afterwards, so the leaf scores differ from the portable
//! kernel's (f32 FMA order) only by f32 rounding; selections are equal except where two
//! candidates tie within that rounding (tests/coopmat.rs checks against the f64 reference).

use super::{common_bytes, Plan};
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor};
use crate::runtime::context::{Context, KernelPath, COOP_SUBGROUPS};
use crate::runtime::pipeline::{ShaderSource, Storage};
use pisa_core::{AttentionShape, SelectionConfig};

/// `shaders/leaf_select_coop.wgsl` (its `enable` first), the shared selection prelude and the
/// union / pick code of `shaders/leaf_common.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "leaf_select_coop",
    wgsl: concat!(
        include_str!("../../../../shaders/leaf_select_coop.wgsl"),
        include_str!("../../../../shaders/select_common.wgsl"),
        include_str!("../../../../shaders/leaf_common.wgsl"),
        include_str!("../../../../shaders/coop_qa.wgsl")
    ),
};

/// Largest head dim of the cooperative-matrix leaf scorer (a multiple of 16 up to this).
pub const MAX_COOP_HEAD_DIM: u32 = 128;

/// Shader constants of one cooperative-matrix leaf-scoring pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafCoopVariant {
    /// Query heads per KV head (g_q <= 16).
    pub gq: u32,
    /// Consecutive queries per workgroup (`qt * gq <= 16`: one 16-row block).
    pub qt: u32,
    /// Candidate slots per query, g * (K + 1).
    pub mc: u32,
    /// Head dim (multiple of 16, <= 128).
    pub hd: u32,
    /// 16-key column tiles per leaf block: ceil(C / 16).
    pub ct: u32,
    /// Leaves scored per iteration (1 to 4): more matrix loads in flight per barrier.
    pub lpi: u32,
    /// Subgroup size (fixed on the adapter).
    pub sg: u32,
}

impl LeafCoopVariant {
    /// Workgroup memory the shader declares, bytes (mirrors its `var<workgroup>` list).
    pub fn shared_bytes(&self) -> u64 {
        let qs = (self.hd + 8) as u64;
        let cw = 16 * self.ct as u64;
        let lpi = self.lpi as u64;
        let wg = (COOP_SUBGROUPS * self.sg) as u64;
        let halves = 16 * qs;
        let floats = 16 * (lpi * cw + 4) + COOP_SUBGROUPS as u64 * 256 + 2 * lpi * wg;
        2 * halves + 4 * floats + common_bytes(self.qt, self.mc)
    }

    /// The `(name, value)` constants for [`crate::runtime::pipeline::preprocess`].
    pub fn consts(&self) -> [(&'static str, u32); 7] {
        [
            ("LPI", self.lpi),
            ("GQ", self.gq),
            ("QT", self.qt),
            ("MC", self.mc),
            ("HD", self.hd),
            ("CT", self.ct),
            ("SG", self.sg),
        ]
    }
}

/// The cooperative-matrix variant for a PISA selection of this shape and configuration on
/// `ctx` (Q and K in the layouts of [`pisa_core::TensorLayout`], whose strides are multiples of
/// the head dim), or `None` when stage 2 runs the portable kernel: path not CoopMat, storage not
/// f16, head dim not a multiple of 16 or above [`MAX_COOP_HEAD_DIM`], g_q above 16, fewer than
/// 16 keys (the kernel loads 16-key tiles clamped to the last 16 keys), fewer than 16
/// invocations per workgroup, or workgroup memory too small.
///
/// Choice: QT = min(q_tile, 16 / g_q) queries (the paper's Qtile of 4 at g_q = 4), so that the
/// tile's (query, head) rows fill one 16-row block; LPI = 2 leaves per iteration
/// ([`crate::Tuning::leaf_tiles_per_iteration`] overrides it).
pub fn plan_for(
    ctx: &Context,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
    storage: Storage,
    q_tile: usize,
) -> Option<LeafCoopVariant> {
    if ctx.kernel_path() != KernelPath::CoopMat {
        return None;
    }
    let sg = ctx.report().subgroup_size.0;
    let lpi = ctx.tuning().leaf_tiles_per_iteration;
    choose(ctx.limits(), sg, shape, cfg, storage, q_tile, lpi)
}

/// [`plan_for`] on a CoopMat device with limits `l` and subgroup size `sg`, scoring `lpi`
/// leaves per iteration.
pub(super) fn choose(
    l: &wgpu::Limits,
    sg: u32,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
    storage: Storage,
    q_tile: usize,
    lpi: u32,
) -> Option<LeafCoopVariant> {
    let (gq, hd) = (shape.gqa_group(), shape.head_dim);
    if storage != Storage::F16
        || hd == 0
        || !hd.is_multiple_of(16)
        || hd > MAX_COOP_HEAD_DIM as usize
        || gq == 0
        || gq > 16
        || COOP_SUBGROUPS * sg < 16
        || cfg.block_size == 0
        || shape.k_len < 16
    {
        return None;
    }
    let v = LeafCoopVariant {
        gq: gq as u32,
        qt: (q_tile.max(1) as u32).min(16 / gq as u32),
        mc: (cfg.merge_factor * (cfg.top_k + 1)) as u32,
        hd: hd as u32,
        ct: cfg.block_size.div_ceil(16) as u32,
        lpi,
        sg,
    };
    let budget = l.max_compute_workgroup_storage_size as u64;
    (v.shared_bytes() <= budget).then_some(v)
}

/// [`plan_for`] of a validated selection call, with its strides checked (multiples of 4
/// elements: the shader reads Q and K as vec4).
pub(crate) fn plan(ctx: &Context, plan: &Plan, q_tile: usize) -> Option<LeafCoopVariant> {
    let p = &plan.params;
    let strides = [p.q_sb, p.q_sh, p.q_sn, p.k_sb, p.k_sh, p.k_sn];
    if strides.iter().any(|s| !s.is_multiple_of(4)) {
        return None;
    }
    let v = plan_for(ctx, &plan.shape, &plan.cfg, plan.storage, q_tile)?;
    (v.mc == p.mc).then_some(v)
}

/// Records the cooperative-matrix stage 2 of variant `var` (from [`plan`]); arguments, output and
/// errors as [`super::record`].
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    plan: &Plan,
    bindings: [Bind<'_>; 3],
    sel: &GpuTensor,
    var: &LeafCoopVariant,
    timer: Option<(&mut crate::runtime::profiler::Profiler, &'static str)>,
) -> Result<()> {
    let pipe = ctx.pipelines.get(
        &ctx.device,
        &SHADER,
        "leaf_select",
        Storage::F16,
        &var.consts(),
        &[],
    )?;
    let p = plan.tiled(var.qt);
    let u = ctx.uniform("leaf_select params", &p)?;
    let [q, k, cand] = bindings;
    let b = [
        (0, (&u).into()),
        (1, q),
        (2, k),
        (3, cand),
        (4, (&sel.buffer).into()),
    ];
    ctx.dispatch(enc, &pipe, &b, p.wg_count as u64, timer)?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::runtime::pipeline::{assert_workgroup_fits, limits_with_memory};

    /// (head dim, GQA group, C, K, merge factor) of the selection accounting tests (this one and
    /// the leaf-major scorer's, which adds cases of its own).
    pub(crate) const ACCOUNTING_CASES: [(usize, usize, usize, usize, usize); 4] = [
        (128, 4, 64, 16, 2),
        (64, 1, 16, 8, 4),
        (80, 16, 128, 64, 2),
        (16, 2, 32, 31, 3),
    ];

    /// The scorer's workgroup variables (naga's sizes, f16, the variant's constants
    /// substituted) fit what [`LeafCoopVariant::shared_bytes`] charges, for the variants
    /// [`plan_for`] picks: head dims 16 to 128, GQA groups 1 to 16, C 16 to 128, K 8 to 64,
    /// merge factors 2 to 4, q_tile 1 and 4, 1 to 4 leaves per iteration (the tuning knob),
    /// subgroup sizes 8 to 64, at 16 and 48 KiB.
    #[test]
    fn shared_bytes_covers_the_shader() {
        let mut checked = 0;
        for (d, g, c, k, merge) in ACCOUNTING_CASES {
            let shape = AttentionShape::new(1, g, 1, 64, 4096, d).unwrap();
            let cfg = SelectionConfig::new(c, k).unwrap().with_merge_factor(merge);
            for (sg, lpi, q_tile) in [(32, 2, 4), (8, 1, 1), (64, 4, 4), (16, 3, 4)] {
                for mem in [16u32 << 10, 48 << 10] {
                    let lim = limits_with_memory(mem);
                    let Some(v) = choose(&lim, sg, &shape, &cfg, Storage::F16, q_tile, lpi) else {
                        continue;
                    };
                    checked += 1;
                    assert_workgroup_fits(
                        &SHADER,
                        "leaf_select",
                        Storage::F16,
                        &v.consts(),
                        v.shared_bytes(),
                        format!("{v:?} at {mem} bytes"),
                    );
                }
            }
        }
        assert!(checked >= 20, "only {checked} variants checked");
    }
}
