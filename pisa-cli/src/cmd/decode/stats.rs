//! What a decode run measured and how it compares: latency [`percentiles`] and the `--check`
//! comparison with `forward` ([`check`], [`CheckResult`]).

use anyhow::Result;
use pisa_core::SelectionConfig;
use pisa_wgpu::ops::prefill::PrefillOptions;
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
    let f = crate::cmd::embed::prefill(ctx, &l.q, &l.k, &l.v, &s, &opts, false)?;
    let (mut o_acc, mut l_acc) = (ErrAcc::default(), ErrAcc::default());
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            for t in p..s.q_len {
                let i = l.layout.index(s.q_heads, s.q_len, s.head_dim, b, h, t, 0);
                for x in 0..s.head_dim {
                    o_acc.add(r.out[i + x], f.out[i + x]);
                }
                let j = (b * s.q_heads + h) * s.q_len + t;
                l_acc.add(r.lse[j], f.lse[j]);
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
        out_err: o_acc.rel_err(),
        lse_err: l_acc.rel_err(),
        differing: (diff, total),
    })
}

/// Relative L2 error of decoded values against forward's. A pair of equal non-finite values
/// (NaN and NaN, or the same infinity: `--allow-nonfinite` inputs reach both paths alike)
/// matches and is left out of the sums; a pair where only one is finite, or of different
/// non-finite values, makes the error infinite.
#[derive(Default)]
struct ErrAcc {
    num: f64,
    den: f64,
    mismatch: bool,
}

impl ErrAcc {
    fn add(&mut self, got: f32, want: f32) {
        if got.is_finite() && want.is_finite() {
            self.num += ((got - want) as f64).powi(2);
            self.den += (want as f64).powi(2);
        } else if !(got.is_nan() && want.is_nan() || got == want) {
            self.mismatch = true;
        }
    }

    fn rel_err(&self) -> f64 {
        if self.mismatch {
            return f64::INFINITY;
        }
        (self.num / self.den.max(1e-300)).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::ErrAcc;

    #[test]
    fn equal_non_finite_values_match_and_others_do_not() {
        let mut a = ErrAcc::default();
        for (g, w) in [
            (1.0, 1.0),
            (f32::NAN, f32::NAN),
            (f32::INFINITY, f32::INFINITY),
        ] {
            a.add(g, w);
        }
        assert_eq!(a.rel_err(), 0.0);
        a.add(2.0, 1.0);
        assert!(a.rel_err() > 0.0 && a.rel_err().is_finite());
        for (g, w) in [
            (f32::NAN, 1.0),
            (1.0, f32::INFINITY),
            (f32::INFINITY, -f32::INFINITY),
        ] {
            let mut b = ErrAcc::default();
            b.add(g, w);
            assert_eq!(b.rel_err(), f64::INFINITY, "{g} against {w}");
        }
    }
}
