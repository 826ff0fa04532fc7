//! What a decode run measured and how it compares: latency [`percentiles`] and the `--check`
//! comparison with `forward` ([`check`], [`CheckResult`]).

use anyhow::Result;
use pisa_core::SelectionConfig;
use pisa_wgpu::ops::prefill::{prefill_host, PrefillOptions};
use pisa_wgpu::{Context, Storage};

use super::DecodeRun;
use crate::input::Loaded;

/// Median and 99th percentile.
pub fn percentiles(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    (
        s[s.len() / 2],
        s[((s.len() as f64 * 0.99).ceil() as usize)
            .saturating_sub(1)
            .min(s.len() - 1)],
    )
}

/// What `--check` found: relative errors of the decoded rows against `forward`, and rows whose
/// selection differs.
pub struct CheckResult {
    /// Relative L2 error of O over the decoded rows.
    pub out_err: f64,
    /// Relative L2 error of LSE over the decoded rows.
    pub lse_err: f64,
    /// (query, KV head) rows whose selections differ / rows compared.
    pub differing: (usize, usize),
}

/// Compares the decoded rows (positions `p..N`) with a full prefill of the same input.
pub fn check(
    ctx: &Context,
    l: &Loaded,
    cfg: &SelectionConfig,
    storage: Storage,
    p: usize,
    r: &DecodeRun,
) -> Result<CheckResult> {
    let s = l.shape;
    let opts = PrefillOptions {
        cfg: *cfg,
        layout: l.layout,
        storage,
        q_tile: 4,
        return_selection: true,
    };
    let f = prefill_host(ctx, &l.q, &l.k, &l.v, &s, &opts)?;
    let (mut num, mut den, mut ln, mut ld) = (0f64, 0f64, 0f64, 0f64);
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            for t in p..s.q_len {
                let i = l.layout.index(s.q_heads, s.q_len, s.head_dim, b, h, t, 0);
                for x in 0..s.head_dim {
                    num += ((r.out[i + x] - f.out[i + x]) as f64).powi(2);
                    den += (f.out[i + x] as f64).powi(2);
                }
                let j = (b * s.q_heads + h) * s.q_len + t;
                ln += ((r.lse[j] - f.lse[j]) as f64).powi(2);
                ld += (f.lse[j] as f64).powi(2);
            }
        }
    }
    let fsel = f.selection.as_ref().expect("requested");
    let k = cfg.top_k;
    let (mut diff, mut total) = (0, 0);
    for row in 0..s.batch * s.kv_heads {
        for t in p..s.q_len {
            let o = (row * s.q_len + t) * k;
            total += 1;
            diff += usize::from(r.selection[o..o + k] != fsel[o..o + k]);
        }
    }
    Ok(CheckResult {
        out_err: (num / den.max(1e-300)).sqrt(),
        lse_err: (ln / ld.max(1e-300)).sqrt(),
        differing: (diff, total),
    })
}
