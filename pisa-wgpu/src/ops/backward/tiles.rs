//! Tile sizes of the backward kernels (`shaders/backward.wgsl`), from the device's workgroup
//! memory (PISA.md section 4).

use crate::error::{GpuError, Result};
use crate::runtime::context::Context;

/// Workgroup memory the kernels plan with at most (NVIDIA's 48 KiB).
const MAX_SHARED: u64 = 48 * 1024;

/// Tile sizes of the gradient kernels, from the device's workgroup memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardTiles {
    /// Keys per workgroup-memory tile of `grad_q` (a block is walked in `ceil(C / this)`).
    pub q_keys: usize,
    /// Keys per `grad_kv` workgroup (a block is split into `ceil(C / this)` workgroups).
    pub kv_keys: usize,
    /// Query rows (query, head) per `grad_kv` round.
    pub kv_rows: usize,
}

/// Workgroup memory of a variant with `keys` keys and `rows` query rows, bytes (mirrors the
/// `var<workgroup>` list of the shader).
fn shared_bytes(hd: usize, keys: usize, rows: usize) -> u64 {
    let (hd, k, r) = (hd as u64, keys as u64, rows as u64);
    4 * (2 * k * (hd + 1) + 2 * r * hd + 2 * r * k + 3 * r) + 12
}

/// The shader constants of a variant with `keys` keys and `rows` query rows, head dim `hd`
/// and GQA group `g`.
pub(crate) fn consts(hd: usize, g: usize, keys: usize, rows: usize) -> [(&'static str, u32); 4] {
    [
        ("HD", hd as u32),
        ("G", g as u32),
        ("KTILE", keys as u32),
        ("QROWS", rows as u32),
    ]
}

/// `keys` spread evenly over the `ceil(C / keys)` tiles a block needs.
fn balance(c: usize, keys: usize) -> usize {
    c.div_ceil(c.div_ceil(keys))
}

impl BackwardTiles {
    /// The largest tiles that fit `budget` bytes of workgroup memory for head dim `hd`, GQA
    /// group `g` and block size `c`. Errors: [`GpuError::Unsupported`] when the g_q query rows
    /// of `grad_q` alone do not fit.
    pub fn plan(budget: u64, hd: usize, g: usize, c: usize) -> Result<Self> {
        let cap = c.clamp(1, 32);
        let q_keys = (1..=cap)
            .rev()
            .find(|&k| shared_bytes(hd, k, g) <= budget)
            .ok_or_else(|| {
                GpuError::Unsupported(format!(
                    "backward: head dim {hd} x GQA group {g} needs more than {budget} bytes of \
                     workgroup memory"
                ))
            })?;
        let fit = |rows: &[usize]| {
            (1..=cap).rev().find_map(|k| {
                let r = rows.iter().find(|&&r| shared_bytes(hd, k, r) <= budget)?;
                Some((k, *r))
            })
        };
        let (kv_keys, kv_rows) = fit(&[8, 4]).or_else(|| fit(&[2, 1])).unwrap_or((1, 1));
        Ok(Self {
            q_keys: balance(c, q_keys),
            kv_keys: balance(c, kv_keys),
            kv_rows,
        })
    }

    /// [`Self::plan`] with the device's workgroup memory (at most 48 KiB).
    pub fn for_device(ctx: &Context, hd: usize, g: usize, c: usize) -> Result<Self> {
        let budget = (ctx.limits().max_compute_workgroup_storage_size as u64).min(MAX_SHARED);
        Self::plan(budget, hd, g, c)
    }

    /// The most loop iterations one `grad_q` invocation runs (every loop of the shader counted,
    /// each selection slot valid) for head dim `hd`, GQA group `g`, block size `c` and `top_k`:
    /// what a device that caps an invocation's loop iterations ([`Context::loop_limit`]) must
    /// allow. Each loop is charged one trip more than it runs (its exit test); the backward
    /// pass keeps a sixteenth of the cap free besides, as naga's GLSL loops run a few trips
    /// more than this model charges.
    pub fn grad_q_iterations(&self, hd: usize, g: usize, c: usize, top_k: usize) -> u64 {
        let (hd, g, c, k) = (hd as u64, g as u64, c as u64, top_k as u64);
        let (kt, wg) = (self.q_keys as u64, WG);
        let eq = (g * hd).div_ceil(wg);
        let scores = (g * kt).div_ceil(wg);
        let tile = 1
            + loop_trips((kt * hd).div_ceil(wg))
            + loop_trips(scores)
            + scores * loop_trips(hd)
            + loop_trips(eq)
            + eq * loop_trips(kt);
        // Q and dO rows, the row statistics, the accumulators' start and end; per slot the
        // loop step, valid_block's scan of the earlier slots and the block's key tiles.
        let slot = 1 + loop_trips(k) + loop_trips(c.div_ceil(kt)) + c.div_ceil(kt) * tile;
        3 * loop_trips(eq) + loop_trips(g.div_ceil(wg)) + loop_trips(k) + k * slot
    }

    /// The loop iterations of one `grad_kv` invocation walking the (query, head) rows of a
    /// block whose index segment holds `entries` entries, charged as
    /// [`Self::grad_q_iterations`] charges them: a fixed part, then one round per
    /// [`Self::kv_rows`] rows. Returns `(fixed, per round)`.
    pub fn grad_kv_iterations(&self, hd: usize, entries: usize) -> (u64, u64) {
        let (hd, kt, qr, wg) = (hd as u64, self.kv_keys as u64, self.kv_rows as u64, WG);
        let ek = (kt * hd).div_ceil(wg);
        let scores = (qr * kt).div_ceil(wg);
        // Two binary searches of the segment (one invocation), the key tile's loads, the
        // accumulators' start and end, the rounds' loop exit.
        let search = 2 * loop_trips((u64::BITS - (entries as u64).leading_zeros()) as u64 + 1);
        let fixed = loop_trips((kt * hd).div_ceil(wg)) + search + 2 * loop_trips(ek) + 1;
        let round = 1
            + loop_trips((qr * hd).div_ceil(wg))
            + loop_trips(scores)
            + scores * loop_trips(hd)
            + loop_trips(ek)
            + ek * loop_trips(qr);
        (fixed, round)
    }
}

/// What a loop of `n` trips is charged: its trips and its exit test.
fn loop_trips(n: u64) -> u64 {
    n + 1
}

/// Invocations per workgroup of the gradient kernels (`WG` of `shaders/backward.wgsl`).
pub(super) const WG: u64 = 128;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::backward::SHADER;
    use crate::runtime::pipeline::{assert_workgroup_fits, Storage, MIN_WORKGROUP_BYTES};

    /// The workgroup variables of `grad_q` and `grad_kv` (naga's sizes, the constants
    /// `record_backward` builds substituted) fit what [`shared_bytes`] charges for the tiles
    /// [`BackwardTiles::plan`] picks: head dims 16 to 256, GQA groups 1 to 16, C 7 to 128, at
    /// 8, 16 and 48 KiB. `row_dot` (fixed arrays, not planned) fits WebGPU's minimum of 16 KiB.
    #[test]
    fn shared_bytes_covers_the_shader() {
        let mut checked = 0;
        for (hd, g, c) in [
            (128, 4, 64),
            (64, 1, 16),
            (256, 8, 128),
            (16, 16, 7),
            (80, 2, 32),
        ] {
            for budget in [8u64 << 10, 16 << 10, 48 << 10] {
                let Ok(t) = BackwardTiles::plan(budget, hd, g, c) else {
                    continue;
                };
                checked += 1;
                for (entry, keys, rows) in
                    [("grad_q", t.q_keys, g), ("grad_kv", t.kv_keys, t.kv_rows)]
                {
                    let c = consts(hd, g, keys, rows);
                    let charged = shared_bytes(hd, keys, rows);
                    assert_workgroup_fits(
                        &SHADER,
                        entry,
                        Storage::F32,
                        &c,
                        charged,
                        "shared_bytes",
                    );
                }
            }
        }
        assert!(checked >= 12, "only {checked} plans checked");
        let (c, min) = (consts(128, 4, 1, 1), MIN_WORKGROUP_BYTES);
        assert_workgroup_fits(&SHADER, "row_dot", Storage::F32, &c, min, "fixed arrays");
    }
}
