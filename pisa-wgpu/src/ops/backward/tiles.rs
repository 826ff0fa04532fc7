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
}
