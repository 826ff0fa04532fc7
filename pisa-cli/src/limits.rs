//! Checks of values the GPU kernels or the output format cannot represent faithfully: inputs
//! beyond the f16 range of `--storage f16`, possible attention scores beyond what the kernels
//! tell apart from their "masked" sentinel, and outputs beyond the f16 range of
//! `--out-dtype f16`. (Misspelled tuning knobs are errors of `pisa_wgpu::Tuning`.)

use anyhow::{bail, Result};

use crate::input::Loaded;
use crate::io;

/// The largest |score| (`scale * q . k`) accepted: the kernels' "no score" sentinel is -3e38
/// and they treat anything below -1e38 as masked, so scores must stay well inside that.
pub const MAX_SCORE: f64 = 1e29;

/// The largest L2 norm of the rows (of `d` values) of `x`, over rows that are all finite.
fn max_row_norm(x: &[f32], d: usize) -> f64 {
    x.chunks_exact(d.max(1))
        .filter(|r| r.iter().all(|v| v.is_finite()))
        .map(|r| r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt())
        .fold(0.0, f64::max)
}

/// The first finite value of `x` that f16 would round to infinity (beyond +-65504).
fn first_f16_overflow(x: &[f32]) -> Option<usize> {
    x.iter()
        .position(|&v| v.is_finite() && half::f16::from_f32(v).is_infinite())
}

impl Loaded {
    /// Errors when a value of Q, K or V (V only `with_v`) would overflow to infinity in f16
    /// storage (beyond +-65504 after rounding), naming the tensor and the position of the first,
    /// and ending with `advice` (what the command's options offer instead).
    pub fn check_f16_range(&self, with_v: bool, advice: &str) -> Result<()> {
        let mut list = vec![("q", &self.q, &self.q_dims), ("k", &self.k, &self.kv_dims)];
        if with_v {
            list.push(("v", &self.v, &self.kv_dims));
        }
        for (name, data, dims) in list {
            if let Some(i) = first_f16_overflow(data) {
                bail!(
                    "{}: tensor `{name}` has {} at {:?}, beyond the f16 range (+-65504) of f16 storage; {advice}",
                    self.source,
                    data[i],
                    io::unravel(i, dims)
                );
            }
        }
        Ok(())
    }

    /// A note when f16 storage turns nonzero values of Q, K or V (V only `with_v`) into zero
    /// (below half of f16's smallest subnormal, about 3e-8): how many, per tensor. `None`
    /// when there are none. Not an error: such values are usually negligible, but an input
    /// made only of them would attend to zeros.
    pub fn f16_underflow_note(&self, with_v: bool) -> Option<String> {
        let mut list = vec![("Q", &self.q), ("K", &self.k)];
        if with_v {
            list.push(("V", &self.v));
        }
        let counts: Vec<String> = (list.iter())
            .map(|(name, x)| {
                let n = (x.iter())
                    .filter(|&&v| {
                        v != 0.0 && v.is_finite() && half::f16::from_f32(v).to_f32() == 0.0
                    })
                    .count();
                (name, n)
            })
            .filter(|(_, n)| *n > 0)
            .map(|(name, n)| format!("{n} of {name}"))
            .collect();
        (!counts.is_empty()).then(|| {
            format!(
                "{}: --storage f16 rounds {} nonzero values to zero (below f16's range); --storage f32 keeps them",
                self.source,
                counts.join(", ")
            )
        })
    }

    /// Errors when a score `scale * q . k` could exceed [`MAX_SCORE`] in magnitude (bounded by
    /// `scale * max |q row| * max |k row|`): the kernels would take such scores for masked ones.
    pub fn check_score_bound(&self, scale: f32) -> Result<()> {
        let d = self.shape.head_dim;
        let (nq, nk) = (max_row_norm(&self.q, d), max_row_norm(&self.k, d));
        let bound = scale as f64 * nq * nk;
        if bound > MAX_SCORE {
            bail!(
                "{}: scores can reach {bound:.3e} (scale {} x largest Q row norm {nq:.3e} x largest K row norm {nk:.3e}), above the bound {MAX_SCORE:.0e} the kernels handle (larger scores read as masked); rescale Q/K or lower --scale",
                self.source,
                crate::text::number(scale)
            );
        }
        Ok(())
    }

    /// Errors when the output `out` (shaped like Q) holds a finite value that `--out-dtype f16`
    /// would write as infinity.
    pub fn check_out_range(&self, out: &[f32], dtype: io::DType) -> Result<()> {
        if dtype != io::DType::F16 {
            return Ok(());
        }
        if let Some(i) = first_f16_overflow(out) {
            bail!(
                "{}: output O has {} at {:?}, beyond the f16 range (+-65504) of --out-dtype f16; use --out-dtype f32 (nothing written)",
                self.source,
                out[i],
                io::unravel(i, &self.q_dims)
            );
        }
        Ok(())
    }
}

/// Keys above which a run on llvmpipe (lavapipe) is warned about: its loop limiter stops each
/// shader invocation's loops after 65535 iterations in all (`tests/lavapipe_loops.rs`), and
/// the tile attention kernels met it between 20000 and 24576 keys at D 64 in tests (sooner at
/// larger D). A margin below that.
pub const LLVMPIPE_KEYS: usize = 8192;

/// Prints [`llvmpipe_note`] for `ctx`'s adapter as a `warning: ` line on stderr, where it applies.
pub fn warn_llvmpipe(ctx: &pisa_wgpu::Context, keys: usize) {
    if let Some(note) = llvmpipe_note(&ctx.report().name, keys) {
        eprintln!("warning: {note}");
    }
}

/// The warning for a run over `keys` keys on adapter `name`, where it applies.
pub fn llvmpipe_note(name: &str, keys: usize) -> Option<String> {
    (name.contains("llvmpipe") && keys > LLVMPIPE_KEYS).then(|| {
        format!(
            "{name} stops every shader invocation's loops after 65535 iterations in all, so \
             a run over {keys} keys (above about {LLVMPIPE_KEYS}) may come out wrong on it \
             (the kernels refuse what they count, but not every loop is counted); use a GPU \
             for long sequences"
        )
    })
}

#[cfg(test)]
mod llvmpipe_tests {
    use super::*;

    #[test]
    fn llvmpipe_long_runs_are_warned_about() {
        let lp = "llvmpipe (LLVM 15.0.6, 256 bits)";
        assert!(llvmpipe_note(lp, LLVMPIPE_KEYS).is_none());
        assert!(llvmpipe_note(lp, LLVMPIPE_KEYS + 1)
            .unwrap()
            .contains("65535"));
        assert!(llvmpipe_note("NVIDIA H200", 1 << 20).is_none());
    }
}
