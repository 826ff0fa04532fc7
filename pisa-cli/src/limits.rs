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

/// The largest `max |v| x keys` accepted: attention adds up to `keys` value rows, each
/// weighted by at most 1, in f32 before it divides by the softmax sum, so that sum must stay
/// inside f32's range (3.4e38) with room for the merges of partial states.
pub const MAX_VALUE_SUM: f64 = 1e37;

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
                    crate::text::number(data[i]),
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

    /// Errors when the weighted sums of V rows could leave f32's range: `max |v|` over the
    /// finite values of V times the keys above [`MAX_VALUE_SUM`] (the outputs would read
    /// infinity where the reference's are finite).
    pub fn check_value_bound(&self) -> Result<()> {
        let keys = self.shape.k_len;
        let (i, vmax) = (self.v.iter().enumerate())
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i, v.abs() as f64))
            .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
        if vmax * keys as f64 > MAX_VALUE_SUM {
            bail!(
                "{}: tensor `v` has {:e} at {:?}: over {keys} keys its weighted sums can reach {:.3e}, above the bound {MAX_VALUE_SUM:.0e} the kernels' f32 sums hold; rescale V",
                self.source,
                self.v[i],
                io::unravel(i, &self.kv_dims),
                vmax * keys as f64
            );
        }
        Ok(())
    }

    /// Errors when the output `out` (O, shaped like Q) or `lse` holds a NaN or an infinity
    /// although Q, K and V are all finite as the kernels read them (`--allow-nonfinite`
    /// inputs pass theirs on; with `f16` storage, a value beyond f16's range is read as an
    /// infinity): such an output is never written. (LSE -inf, a row without keys, is an
    /// output of its own.)
    pub fn check_out_finite(&self, out: &[f32], lse: &[f32], f16: bool) -> Result<()> {
        // (as stored: f16 rounds a value past its range to an infinity)
        let finite = |x: &[f32]| match f16 {
            true => x.iter().all(|&v| half::f16::from_f32(v).is_finite()),
            false => x.iter().all(|v| v.is_finite()),
        };
        if !(finite(&self.q) && finite(&self.k) && finite(&self.v)) {
            return Ok(());
        }
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            bail!(
                "{}: output O has {} at {:?} from finite inputs (a value past f32's range in the kernels; nothing written)",
                self.source,
                out[i],
                io::unravel(i, &self.q_dims)
            );
        }
        if let Some(i) = lse.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
            bail!(
                "{}: output LSE has {} at row {i} from finite inputs (nothing written)",
                self.source,
                lse[i]
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
                crate::text::number(out[i]),
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
mod output_tests {
    use super::*;

    /// A [`Loaded`] of 1 x 2 x 3 x 4 (B, H, N, D) with finite values, or one NaN in V.
    fn loaded(nan_in_v: bool) -> Loaded {
        let shape = pisa_core::AttentionShape::prefill(1, 2, 2, 3, 4).unwrap();
        let mut v = vec![0.5f32; 24];
        if nan_in_v {
            v[5] = f32::NAN;
        }
        Loaded {
            q: vec![0.25; 24],
            k: vec![-0.5; 24],
            v,
            shape,
            layout: pisa_core::TensorLayout::Bhnd,
            file_scale: Ok(None),
            source: "in".into(),
            tensors: ["q".into(), "k".into(), "v".into()],
            q_dims: vec![1, 2, 3, 4],
            kv_dims: vec![1, 2, 3, 4],
        }
    }

    #[test]
    fn non_finite_outputs_of_finite_inputs_are_refused() {
        let (o, lse) = (vec![1.0f32; 24], vec![0.0f32; 6]);
        let l = loaded(false);
        l.check_out_finite(&o, &lse, false).unwrap();
        // LSE -inf is a row without keys: an output, not an overflow.
        let mut empty = lse.clone();
        empty[2] = f32::NEG_INFINITY;
        l.check_out_finite(&o, &empty, false).unwrap();
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut ob = o.clone();
            ob[13] = bad;
            let e = l
                .check_out_finite(&ob, &lse, false)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("output O has") && e.contains("[0, 1, 0, 1]"),
                "{e}"
            );
        }
        for bad in [f32::INFINITY, f32::NAN] {
            let mut lb = lse.clone();
            lb[4] = bad;
            let e = l.check_out_finite(&o, &lb, false).unwrap_err().to_string();
            assert!(e.contains("output LSE has") && e.contains("row 4"), "{e}");
        }
        // Non-finite inputs (--allow-nonfinite) pass theirs on, and so do inputs past f16's
        // range with f16 storage (read as infinities), not with f32 storage.
        let mut ob = o;
        ob[0] = f32::NAN;
        loaded(true).check_out_finite(&ob, &lse, false).unwrap();
        let mut big = loaded(false);
        big.v[3] = 1e5;
        big.check_out_finite(&ob, &lse, true).unwrap();
        let e = big.check_out_finite(&ob, &lse, false).unwrap_err();
        assert!(e.to_string().contains("from finite inputs"), "{e}");
    }

    #[test]
    fn values_past_the_sum_bound_are_refused() {
        let mut l = loaded(false);
        l.check_value_bound().unwrap();
        // 3 keys x 3.4e36 = 1.02e37 > 1e37; the NaN beside it is not counted.
        l.v[7] = -3.4e36;
        l.v[8] = f32::NAN;
        let e = l.check_value_bound().unwrap_err().to_string();
        assert!(e.contains("-3.4e36") && e.contains("[0, 0, 1, 3]"), "{e}");
        l.v[7] = 3.3e36;
        l.check_value_bound().unwrap();
    }
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
