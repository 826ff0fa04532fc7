//! LogSumExp and online-softmax math (PISA.md sections 2 and 4), in `f32` and `f64`, plus
//! conversions from the f16 and bf16 storage formats.

/// The float operations the LSE math needs; implemented for `f32` and `f64`.
pub trait Real:
    Copy
    + PartialOrd
    + core::ops::Add<Output = Self>
    + core::ops::Sub<Output = Self>
    + core::ops::Mul<Output = Self>
    + core::ops::Div<Output = Self>
{
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
    /// Minus infinity: the LSE of an empty set.
    const NEG_INFINITY: Self;
    /// `e^x`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// `ln(1 + x)`, accurate near 0.
    fn ln_1p(self) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    fn exp(self) -> Self {
        libm::expf(self)
    }
    fn ln(self) -> Self {
        libm::logf(self)
    }
    fn ln_1p(self) -> Self {
        libm::log1pf(self)
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    fn exp(self) -> Self {
        libm::exp(self)
    }
    fn ln(self) -> Self {
        libm::log(self)
    }
    fn ln_1p(self) -> Self {
        libm::log1p(self)
    }
}

/// `log(e^a + e^b)` without overflow; `-inf` is the identity.
pub fn log_add_exp<T: Real>(a: T, b: T) -> T {
    // (NaN propagates: a NaN is not ordered with anything, and x != x holds only for it.)
    #[allow(clippy::eq_op)]
    if a != a || b != b {
        return a + b;
    }
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    // -inf (nothing) and +inf (dominates) are their own sums; inf - inf would be NaN.
    if hi == T::NEG_INFINITY || hi == T::ZERO - T::NEG_INFINITY {
        return hi;
    }
    hi + (lo - hi).exp().ln_1p()
}

/// `log sum_i e^{x_i}`, stable (max-shifted); `-inf` for an empty slice (or one of `-inf`s
/// only), `+inf` where an element is `+inf`, NaN where one is NaN.
pub fn logsumexp<T: Real>(xs: &[T]) -> T {
    let mut m = T::NEG_INFINITY;
    for &x in xs {
        #[allow(clippy::eq_op)]
        if x != x {
            return x;
        }
        if x > m {
            m = x;
        }
    }
    if m == T::NEG_INFINITY || m == T::ZERO - T::NEG_INFINITY {
        return m;
    }
    let mut s = T::ZERO;
    for &x in xs {
        s = s + (x - m).exp();
    }
    m + s.ln()
}

/// Online (FlashAttention) softmax state of one row: running max `m` and running sum `l` of
/// `e^{score - m}`. The caller keeps the accumulator `acc` (D values, `sum_t e^{s_t - m} v_t`)
/// beside it, so the state works without allocation (PISA.md section 4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OnlineSoftmax<T> {
    /// Running max of the scores seen (`-inf` before any).
    pub max: T,
    /// Running sum of `e^{score - max}`.
    pub sum: T,
}

impl<T: Real> Default for OnlineSoftmax<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Real> OnlineSoftmax<T> {
    /// The empty state.
    pub fn new() -> Self {
        Self {
            max: T::NEG_INFINITY,
            sum: T::ZERO,
        }
    }

    /// Adds one key with score `s` (already scaled) and value row `v` into `acc`. A score of
    /// `-inf` is a masked key (nothing added); a NaN one makes the row's state, LSE and output
    /// NaN, and so does a `+inf` one (its weight is `e^{inf - inf}`), where [`logsumexp`] of a
    /// `+inf` score is `+inf`. Panics when `v` and `acc` differ in length (a row of another
    /// head dim: zipped, it would be truncated silently).
    pub fn push(&mut self, s: T, v: &[T], acc: &mut [T]) {
        assert_eq!(v.len(), acc.len(), "value row and accumulator lengths");
        if s == T::NEG_INFINITY {
            return;
        }
        // A NaN score makes the row NaN (its LSE and output), not a masked key: the state
        // stays NaN whatever comes after (every comparison with NaN is false, and NaN - x is
        // NaN).
        #[allow(clippy::eq_op)]
        if s != s {
            self.max = s;
            self.sum = s;
            for a in acc.iter_mut() {
                *a = s;
            }
            return;
        }
        if s > self.max {
            let alpha = if self.max == T::NEG_INFINITY {
                T::ZERO
            } else {
                (self.max - s).exp()
            };
            for a in acc.iter_mut() {
                *a = *a * alpha;
            }
            self.sum = self.sum * alpha;
            self.max = s;
        }
        let p = (s - self.max).exp();
        self.sum = self.sum + p;
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = *a + p * x;
        }
    }

    /// Merges another partial state (`other`, `other_acc`) into this one (`acc`): the result is
    /// as if every key of both had been pushed here. Panics when `acc` and `other_acc` differ
    /// in length.
    pub fn merge(&mut self, acc: &mut [T], other: &Self, other_acc: &[T]) {
        assert_eq!(acc.len(), other_acc.len(), "accumulator lengths");
        if other.max == T::NEG_INFINITY {
            return;
        }
        if self.max == T::NEG_INFINITY {
            *self = *other;
            acc.copy_from_slice(other_acc);
            return;
        }
        let m = if self.max >= other.max {
            self.max
        } else {
            other.max
        };
        let a = (self.max - m).exp();
        let b = (other.max - m).exp();
        for (x, &y) in acc.iter_mut().zip(other_acc) {
            *x = *x * a + y * b;
        }
        self.sum = self.sum * a + other.sum * b;
        self.max = m;
    }

    /// The row's LogSumExp `m + ln l` (`-inf` if nothing was pushed).
    pub fn lse(&self) -> T {
        if self.max == T::NEG_INFINITY {
            T::NEG_INFINITY
        } else {
            self.max + self.sum.ln()
        }
    }

    /// Divides `acc` by the running sum, turning it into the attention output; returns the LSE.
    /// An empty row gives zeros and `-inf`.
    pub fn finish(&self, acc: &mut [T]) -> T {
        if self.max == T::NEG_INFINITY {
            for a in acc.iter_mut() {
                *a = T::ZERO;
            }
            return T::NEG_INFINITY;
        }
        let inv = T::ONE / self.sum;
        for a in acc.iter_mut() {
            *a = *a * inv;
        }
        self.lse()
    }
}

/// f16 bits to f32.
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}
/// bf16 bits to f32.
pub fn bf16_to_f32(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}
/// f32 to f16 bits (round to nearest even).
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}
/// f32 to bf16 bits (round to nearest even).
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}
/// Rounds every value through f16 storage and back (what f16 storage does to an input).
pub fn round_through_f16(xs: &mut [f32]) {
    for x in xs {
        *x = f16_to_f32(f32_to_f16(*x));
    }
}

/// Widens bf16 storage (raw bits, e.g. a model's activations) to the f32 the GPU operations
/// take; the GPU then stores them as f32, f16 or bf16 (`Storage`). Exact: every bf16 is an f32.
#[cfg(feature = "alloc")]
pub fn bf16_to_f32_vec(bits: &[u16]) -> alloc::vec::Vec<f32> {
    bits.iter().map(|&b| bf16_to_f32(b)).collect()
}

/// Widens f16 storage (raw bits) to f32. Exact.
#[cfg(feature = "alloc")]
pub fn f16_to_f32_vec(bits: &[u16]) -> alloc::vec::Vec<f32> {
    bits.iter().map(|&b| f16_to_f32(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Value rows and accumulators of another length panic (2026-12-07).
    #[test]
    fn rows_of_another_length_panic() {
        extern crate std;
        // (zipped, a shorter accumulator dropped the value row's tail without a word)
        let mut st = OnlineSoftmax::<f64>::new();
        let mut acc = [0.0; 2];
        assert!(
            std::panic::catch_unwind(move || st.push(1.0, &[1.0, 2.0, 3.0], &mut acc)).is_err()
        );
        let other = OnlineSoftmax { max: 0.0, sum: 1.0 };
        let mut st = OnlineSoftmax::<f64> { max: 1.0, sum: 1.0 };
        let mut acc = [0.0; 2];
        assert!(std::panic::catch_unwind(move || st.merge(&mut acc, &other, &[1.0])).is_err());
        // +inf scores: the row is NaN (documented), logsumexp +inf.
        let mut st = OnlineSoftmax::<f64>::new();
        let mut acc = [0.0];
        st.push(f64::INFINITY, &[1.0], &mut acc);
        assert!(acc[0].is_nan() || st.sum.is_nan());
    }

    /// Regression: NaN was taken for "no score" (logsumexp([NaN]) and a row of NaN scores gave
    /// -inf, an empty row's LSE, and the output zeros), and +inf with another +inf or a finite
    /// value gave NaN (inf - inf).
    #[test]
    fn non_finite_scores() {
        let (nan, inf) = (f64::NAN, f64::INFINITY);
        assert!(logsumexp(&[nan]).is_nan() && logsumexp(&[nan, -inf]).is_nan());
        assert!(logsumexp(&[0.0, nan, 1.0]).is_nan());
        assert_eq!(logsumexp(&[inf, 0.0]), inf);
        assert_eq!(logsumexp(&[-inf, -inf]), -inf);
        assert_eq!(logsumexp::<f64>(&[]), -inf);
        assert_eq!(log_add_exp(inf, inf), inf);
        assert_eq!(log_add_exp(inf, 3.0), inf);
        assert_eq!(log_add_exp(-inf, -inf), -inf);
        assert!(log_add_exp(nan, 1.0).is_nan() && log_add_exp(-inf, nan).is_nan());
        let mut st = OnlineSoftmax::<f64>::new();
        let mut acc = [0.0; 2];
        st.push(1.0, &[1.0, 2.0], &mut acc);
        st.push(nan, &[1.0, 2.0], &mut acc);
        st.push(5.0, &[1.0, 2.0], &mut acc);
        assert!(st.lse().is_nan());
        assert!(st.finish(&mut acc).is_nan() && acc.iter().all(|a| a.is_nan()));
    }

    #[test]
    #[cfg(feature = "alloc")]
    fn half_conversions_are_exact_widenings() {
        let xs = [1.5f32, -0.0, 65504.0, 1e-3, -3.25];
        let bf: alloc::vec::Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
        let h: alloc::vec::Vec<u16> = xs.iter().map(|&x| f32_to_f16(x)).collect();
        for (i, (a, b)) in bf16_to_f32_vec(&bf)
            .iter()
            .zip(f16_to_f32_vec(&h))
            .enumerate()
        {
            assert_eq!(*a, bf16_to_f32(bf[i]));
            assert_eq!(b, f16_to_f32(h[i]));
            assert!(
                (a - xs[i]).abs() <= xs[i].abs() / 128.0,
                "bf16 keeps 8 bits: {a} vs {}",
                xs[i]
            );
        }
        assert_eq!(bf16_to_f32(f32_to_bf16(1.5)), 1.5);
        assert_eq!(f16_to_f32(f32_to_f16(65504.0)), 65504.0);
    }

    #[test]
    fn lse_is_stable() {
        assert_eq!(logsumexp::<f64>(&[]), f64::NEG_INFINITY);
        let v = logsumexp(&[1000.0f64, 1000.0]);
        assert!((v - (1000.0 + core::f64::consts::LN_2)).abs() < 1e-12);
        assert!(
            (log_add_exp(-1000.0f32, -1000.0) - (-1000.0 + core::f32::consts::LN_2)).abs() < 1e-3
        );
        assert_eq!(log_add_exp(f64::NEG_INFINITY, 3.0), 3.0);
    }

    #[test]
    fn online_softmax_merge_equals_sequential() {
        let s = [0.3f64, -2.0, 5.0, 1.0, 4.9];
        let v = [
            [1.0f64, 2.0],
            [-1.0, 0.5],
            [3.0, 3.0],
            [0.0, -4.0],
            [2.0, 1.0],
        ];
        let mut all = OnlineSoftmax::new();
        let mut acc = [0.0; 2];
        for i in 0..5 {
            all.push(s[i], &v[i], &mut acc);
        }
        let (mut a, mut b) = (OnlineSoftmax::new(), OnlineSoftmax::new());
        let (mut acc_a, mut acc_b) = ([0.0; 2], [0.0; 2]);
        for i in 0..2 {
            a.push(s[i], &v[i], &mut acc_a);
        }
        for i in 2..5 {
            b.push(s[i], &v[i], &mut acc_b);
        }
        a.merge(&mut acc_a, &b, &acc_b);
        let lse_all = all.finish(&mut acc);
        let lse_m = a.finish(&mut acc_a);
        assert!((lse_all - lse_m).abs() < 1e-12);
        assert!((lse_all - logsumexp(&s)).abs() < 1e-12);
        for d in 0..2 {
            assert!((acc[d] - acc_a[d]).abs() < 1e-12);
        }
    }
}
