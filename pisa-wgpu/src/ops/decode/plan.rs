//! Sizing of the fused decode kernel (`shaders/decode.wgsl`): workgroup size, the constants
//! substituted per pipeline, and the workgroup memory they need, checked against the device.

use bytemuck::{Pod, Zeroable};
use pisa_core::{PisaError, PyramidLayout, Scoring, SelectionConfig};

use crate::error::{GpuError, Result};

/// Uniform parameters shared by `decode.wgsl` and `decode_append.wgsl` (same field order).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
pub(super) struct Params {
    pub batch: u32,
    pub kv_heads: u32,
    pub q_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub merge: u32,
    pub top_k: u32,
    pub scoring: u32,
    pub causal: u32,
    pub sink: u32,
    pub local: u32,
    pub capacity: u32,
    pub cap_nodes: u32,
    pub wg_count: u32,
    pub scale: f32,
    pub seq: u32,
    pub src_sh: u32,
    pub src_sn: u32,
    pub count: u32,
    pub src_len: u32,
    pub cap_off: [[u32; 4]; 16],
}

impl Params {
    /// Every field that depends only on the cache's geometry and configuration.
    pub fn base(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        layout: &PyramidLayout,
        cfg: &SelectionConfig,
    ) -> Self {
        let mut cap_off = [[0u32; 4]; 16];
        for l in 0..layout.num_levels() {
            cap_off[l / 4][l % 4] = layout.offset(l) as u32;
        }
        Self {
            batch: batch as u32,
            kv_heads: kv_heads as u32,
            q_heads: q_heads as u32,
            head_dim: head_dim as u32,
            block_size: cfg.block_size as u32,
            merge: cfg.merge_factor as u32,
            top_k: cfg.top_k as u32,
            scoring: cfg.scoring.code(),
            causal: cfg.causal as u32,
            sink: cfg.sink_blocks as u32,
            local: cfg.local_blocks as u32,
            capacity: layout.key_len() as u32,
            cap_nodes: layout.total_nodes() as u32,
            scale: cfg.softmax_scale(head_dim),
            cap_off,
            ..Default::default()
        }
    }
}

/// Invocations per decode workgroup (lowered to the device's limit).
const WG: u32 = 256;

/// The constants of one decode pipeline and the workgroup memory they take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    pub wg: u32,
    pub gq: u32,
    pub kmax: u32,
    pub maxc: u32,
    pub xs: u32,
    pub dd: u32,
    pub parts: u32,
    /// Workgroup memory of the step kernel, bytes.
    pub smem: u64,
}

impl Plan {
    /// Sizes the step kernel for group `gq`, head dim `d` and `cfg`. The P.V phase splits the
    /// keys into as many parts as there are invocations per output vec4 (`WG / (D/4)`) and
    /// memory allows; the attention scratch holds all K*C selected keys' scores when the
    /// device's workgroup memory allows (one chunk), else as many as fit.
    /// Errors: [`PisaError::HeadDim`] unless D is a multiple of 4 up to `4 * WG`;
    /// [`GpuError::Limit`] when even the minimum does not fit; [`GpuError::Unsupported`] for a
    /// GQA group above the workgroup size.
    pub fn new(limits: &wgpu::Limits, gq: usize, d: usize, cfg: &SelectionConfig) -> Result<Self> {
        let max_wg = limits
            .max_compute_invocations_per_workgroup
            .min(limits.max_compute_workgroup_size_x);
        let wg = WG.min(1 << (31 - max_wg.max(1).leading_zeros())) as u64;
        if !d.is_multiple_of(4) || d > 4 * wg as usize {
            return Err(GpuError::Input(PisaError::HeadDim {
                head_dim: d,
                supported: "multiples of 4 up to 4 * the workgroup size (1024)",
            }));
        }
        let (gq, d) = (gq as u64, d as u64);
        let (k, c, g) = (
            cfg.top_k as u64,
            cfg.block_size as u64,
            cfg.merge_factor as u64,
        );
        if gq > wg {
            return Err(GpuError::Unsupported(format!(
                "decode with {gq} query heads per KV head (at most {wg})"
            )));
        }
        if k * c > u32::MAX as u64 {
            return Err(GpuError::Input(PisaError::TooLarge {
                what: "top_k * block_size",
                value: k * c,
                limit: u32::MAX as u64,
            }));
        }
        let maxc = g * (k + 1);
        let sub = (wg / maxc).max(1);
        // Scratch uses besides the merge: level scores, partial leaf LSEs, one attention key.
        let need = (maxc * g * gq).max(maxc * sub * gq).max(gq);
        let merge = |parts: u64| parts * gq * (d + 1);
        let fixed = 4 * (gq * d + 3 * maxc + 2 * k + wg + 2 * gq + 1);
        let limit = limits.max_compute_workgroup_storage_size as u64;
        let budget = limit.saturating_sub(fixed) / 4;
        let mut parts = (wg / (d / 4)).max(1);
        while parts > 1 && need.max(merge(parts)) > budget {
            parts -= 1;
        }
        let floor = need.max(merge(parts));
        let xs = floor.max((k * c * gq).min(budget));
        let smem = fixed + 4 * xs;
        if smem > limit {
            return Err(GpuError::Limit {
                what: "decode workgroup memory".into(),
                needed: fixed + 4 * floor,
                limit,
                hint: "use a smaller top_k, merge factor, GQA group or head dim",
            });
        }
        Ok(Self {
            wg: wg as u32,
            gq: gq as u32,
            kmax: k as u32,
            maxc: maxc as u32,
            xs: xs as u32,
            dd: d as u32,
            parts: parts as u32,
            smem,
        })
    }

    /// The `const` substitutions of `decode.wgsl`.
    pub fn consts(&self) -> [(&'static str, u32); 7] {
        [
            ("WG", self.wg),
            ("GQ", self.gq),
            ("KMAX", self.kmax),
            ("MAXC", self.maxc),
            ("XS", self.xs),
            ("DD", self.dd),
            ("PARTS", self.parts),
        ]
    }
}

/// Whether the pyramid keeps second moments (needed by the `meanvar` scoring only).
pub(super) fn needs_sq(cfg: &SelectionConfig) -> bool {
    cfg.scoring == Scoring::MeanVar
}
