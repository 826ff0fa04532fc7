//! The split-K plan ([`super`]): the rule that sends a dense call to split-K, the split size,
//! the pairs per range, and the partial kernel's variant (its workgroup cut and memory).

use pisa_core::AttentionShape;

use super::super::Tiling;
use crate::error::{GpuError, Result};
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;

/// Most rows (g_q * Nq) per (batch, KV head) pair that [`plan`] sends to split-K.
pub const MAX_ROWS: usize = 64;
/// Fewest keys for which [`plan`] chooses split-K.
pub const MIN_KEYS: usize = 2048;
/// [`plan`] chooses split-K only while the tile kernel would launch fewer workgroups than this.
pub const TILE_WORKGROUPS_BELOW: u64 = 1024;
/// Workgroups (of the partial dispatch, all ranges together) the split size aims at.
pub const TARGET_WORKGROUPS: u64 = 2048;
/// Fewest keys per split that [`plan`] picks (so each workgroup streams several batches).
pub const MIN_SPLIT: usize = 512;

/// The work decomposition of a split-K call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitK {
    /// S: keys per split (>= 1); a call has `ceil(Nk / S)` splits.
    pub split_keys: usize,
    /// (batch, KV head) pairs per range (>= 1): one range's partial states share the scratch.
    pub pairs_per_range: usize,
}

/// Rows (query head, query) per partial workgroup: the columns of the shader's 4x4 matrices.
pub(super) const ROWS_PER_WG: usize = 4;
/// Most invocations of a partial workgroup (fewer, smaller workgroups: more of them resident
/// beside the registers each invocation holds).
const MAX_WG: u32 = 128;

/// Shader constants of the partial kernel (see `shaders/attention_split.wgsl`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Variant {
    f16: bool,
    dc: u32,
    kg: u32,
    nb: u32,
}

impl Variant {
    /// vec4s of the shader's `red`: a batch's lane partials, or half the key groups' O shares.
    fn red(&self) -> u32 {
        (self.kg * self.nb * (self.dc + 1)).max(self.kg / 2 * self.dc * 8)
    }
    /// Workgroup memory the shader declares, bytes: red, sc, mk and lk (vec4s).
    fn shared_bytes(&self) -> u64 {
        16 * (self.red() + self.kg * self.nb + 2 * self.kg) as u64
    }
    pub fn consts(&self) -> [(&'static str, u32); 5] {
        [
            ("F16", self.f16 as u32),
            ("DC", self.dc),
            ("KG", self.kg),
            ("NB", self.nb),
            ("RED", self.red()),
        ]
    }
    /// Keys per batch of one workgroup.
    fn batch_keys(&self) -> usize {
        (self.kg * self.nb) as usize
    }
}

/// The partial kernel's variant for head dim `head_dim` (a multiple of 16): D / 8 lanes per key
/// group, as many key groups as fit 128 invocations (8 for D 128), 4 (f16) or 2 (f32) keys per
/// key group per batch (128 bytes of K and V per invocation per batch, the next batch's in
/// flight while one is used); key groups halve until the workgroup memory fits. Errors with
/// [`GpuError::Limit`] when nothing fits.
pub(super) fn variant(ctx: &Context, head_dim: usize, storage: Storage) -> Result<Variant> {
    variant_for(ctx.limits(), head_dim, storage)
}

/// [`variant`] for a device with limits `l`.
fn variant_for(l: &wgpu::Limits, head_dim: usize, storage: Storage) -> Result<Variant> {
    // The kernel reads f32 or f16 words (raw vec4<u32>): not bf16.
    if storage == Storage::Bf16 {
        return Err(GpuError::Unsupported(
            "split-K attention with bf16 storage (it reads f32 or f16; the tile kernels read bf16)"
                .into(),
        ));
    }
    let wg_max = MAX_WG
        .min(l.max_compute_invocations_per_workgroup)
        .min(l.max_compute_workgroup_size_x);
    let f16 = storage == Storage::F16;
    let dc = (head_dim / 8) as u32;
    let mut v = Variant {
        f16,
        dc,
        kg: wg_max / dc.max(1),
        nb: if f16 { 4 } else { 2 },
    };
    let budget = l.max_compute_workgroup_storage_size as u64;
    while v.kg > 0 && v.shared_bytes() > budget {
        v.kg /= 2;
    }
    if v.kg == 0 || dc == 0 {
        return Err(GpuError::Limit {
            what: format!("split-K attention workgroup memory (head dim {head_dim})"),
            needed: Variant { kg: 1, ..v }.shared_bytes(),
            limit: budget,
            unit: "bytes",
            hint: "use a smaller head dim or the tile kernel (an explicit tiling)",
        });
    }
    Ok(v)
}

/// Workgroups the portable tile kernel launches for a dense call of this shape with the
/// default tiling ([`Tiling::default_for`]): B * Hkv * ceil(g_q / GH) * ceil(Nq / QT).
/// 0 for a shape [`AttentionShape::validate`] refuses.
pub fn tile_workgroups(s: &AttentionShape) -> u64 {
    if s.validate().is_err() {
        return 0;
    }
    let g = s.gqa_group();
    let t = Tiling::default_for(g, None);
    let heads = g.div_ceil(t.head_chunk.min(g)) as u64;
    (s.batch * s.kv_heads) as u64 * heads * s.q_len.div_ceil(t.query_tile) as u64
}

/// The split-K plan of a dense call with the default tiling, or `None` (the tile kernels run).
///
/// Rule: split-K when the tile kernel would launch fewer than [`TILE_WORKGROUPS_BELOW`]
/// workgroups ([`tile_workgroups`]; too few to fill a GPU while each walks all Nk keys), the
/// keys are many (Nk >= [`MIN_KEYS`]; below, the serial walk is short and a second dispatch
/// does not pay) and the rows per (batch, KV head) are few (g_q * Nq <= [`MAX_ROWS`], the
/// decode and short speculative-decode shapes; above, the tile kernel's row tiles reuse each
/// key better), and the kernel's workgroup memory fits the device.
///
/// Split size: S is chosen for about [`TARGET_WORKGROUPS`] partial workgroups in all (the
/// product B Hkv (row blocks) (splits)), at least [`MIN_SPLIT`] keys, rounded up to whole
/// batches of the kernel (32 keys for f16 D 128), and few enough splits that one pair's partial
/// states fit a storage binding; `pairs_per_range` is as many pairs as fit one binding. The
/// decode baseline (B 1, Hkv 8, g_q 4, Nq 1, Nk 1M) gets 256 splits of 4096 keys: 2048
/// workgroups of 4 rows, each streaming 2 MB of f16 K and V; 4 MB of partial states.
pub fn plan(ctx: &Context, s: &AttentionShape, storage: Storage) -> Option<SplitK> {
    // A shape the attention refuses (its fields are public) runs no kernel.
    s.validate().ok()?;
    let rows = s.gqa_group() * s.q_len;
    if rows > MAX_ROWS || s.k_len < MIN_KEYS || tile_workgroups(s) >= TILE_WORKGROUPS_BELOW {
        return None;
    }
    let var = variant(ctx, s.head_dim, storage).ok()?;
    let rblocks = rows.div_ceil(ROWS_PER_WG) as u64;
    let pairs = (s.batch * s.kv_heads) as u64;
    let per_split = rblocks * ROWS_PER_WG as u64 * s.head_dim as u64 * 4;
    let limit = ctx.max_binding_bytes();
    let most = (s.k_len.div_ceil(MIN_SPLIT) as u64).min(limit / per_split);
    let n = TARGET_WORKGROUPS
        .div_ceil(pairs * rblocks)
        .clamp(1, most.max(1));
    if n > limit / per_split {
        return None;
    }
    let kb = var.batch_keys();
    let split_keys = s.k_len.div_ceil(n as usize).div_ceil(kb) * kb;
    let n = s.k_len.div_ceil(split_keys) as u64;
    let pairs_per_range = (limit / (per_split * n)).clamp(1, pairs) as usize;
    Some(SplitK {
        split_keys,
        pairs_per_range,
    })
}

#[cfg(test)]
mod tests {
    use super::super::{MERGE_SHADER, SHADER};
    use super::*;
    use crate::runtime::pipeline::{assert_workgroup_fits, MIN_WORKGROUP_BYTES};

    /// The partial kernel's workgroup variables (naga's sizes, the variant's constants
    /// substituted) fit what [`Variant::shared_bytes`] charges, for the variants [`variant`]
    /// picks: head dims 16 to 256, f16 and f32, at 8, 16 and 48 KiB and 64 to 1024
    /// invocations (so the key groups halve for memory in some). The merge kernel's fixed
    /// arrays (not planned: no constants) fit WebGPU's minimum of 16 KiB.
    #[test]
    fn shared_bytes_covers_the_shader() {
        let mut checked = 0;
        for d in [16, 64, 80, 128, 256] {
            for storage in [Storage::F16, Storage::F32] {
                for (mem, inv) in [(8u32 << 10, 256u32), (16 << 10, 64), (48 << 10, 1024)] {
                    let lim = wgpu::Limits {
                        max_compute_workgroup_storage_size: mem,
                        max_compute_invocations_per_workgroup: inv,
                        max_compute_workgroup_size_x: inv,
                        ..Default::default()
                    };
                    let Ok(v) = variant_for(&lim, d, storage) else {
                        continue;
                    };
                    checked += 1;
                    let what = format!("D {d} at {mem} bytes: {v:?}");
                    assert_workgroup_fits(
                        &SHADER,
                        "partial",
                        storage,
                        &v.consts(),
                        v.shared_bytes(),
                        what,
                    );
                }
            }
        }
        assert!(checked >= 25, "only {checked} variants checked");
        let min = MIN_WORKGROUP_BYTES;
        assert_workgroup_fits(
            &MERGE_SHADER,
            "merge",
            Storage::F32,
            &[],
            min,
            "split-K merge",
        );
    }
}
