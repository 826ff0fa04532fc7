//! The error type of every validating constructor in `pisa-core`.

use core::fmt;

/// What is wrong with a shape or a configuration. Every variant carries the offending values, and
/// its `Display` names them with the accepted range.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // fields are named by what they hold; each variant's doc says what it means
pub enum PisaError {
    /// A length or count that must be at least 1 was 0 (`what` names it: "batch", "q_len", ...).
    Zero { what: &'static str },
    /// `q_heads` is not a multiple of `kv_heads` (GQA needs Hq = g_q * Hkv).
    GqaNotDivisible { q_heads: usize, kv_heads: usize },
    /// `q_len > k_len`: queries sit at positions `k_len - q_len + i`, so there must be at least
    /// as many keys as queries.
    QueryLongerThanKeys { q_len: usize, k_len: usize },
    /// The merge factor g of the pyramid must be at least 2.
    MergeFactor { merge_factor: usize },
    /// `top_k` is smaller than the number of forced leaves (own block + sink + local).
    TopKBelowForced { top_k: usize, forced: usize },
    /// A head dimension outside what the caller supports.
    HeadDim {
        head_dim: usize,
        supported: &'static str,
    },
    /// A buffer's length does not match the shape it is used with.
    BufferLen {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// `value` is larger than `limit`, the largest value allowed (for example a device limit
    /// or `u32` indexing); a `value` of `u64::MAX` not above `limit` stands for a count that
    /// overflows 64 bits.
    TooLarge {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    /// A non-finite softmax scale or a value out of its domain.
    InvalidValue { what: &'static str },
    /// A NaN or an infinity in an input tensor (`what` names it) at flat `index`, its first
    /// non-finite element: the reference's results are defined for finite inputs only.
    NonFinite { what: &'static str, index: usize },
}

impl fmt::Display for PisaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PisaError::Zero { what } => write!(f, "{what} must be at least 1, got 0"),
            PisaError::GqaNotDivisible { q_heads, kv_heads } => write!(
                f,
                "query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads}) for GQA"
            ),
            PisaError::QueryLongerThanKeys { q_len, k_len } => write!(
                f,
                "query length {q_len} exceeds key length {k_len}: queries are the last q_len positions of the keys"
            ),
            PisaError::MergeFactor { merge_factor } => {
                write!(f, "merge factor must be at least 2, got {merge_factor}")
            }
            PisaError::TopKBelowForced { top_k, forced } => write!(
                f,
                "top_k {top_k} is smaller than the {forced} forced blocks (own block + sink_blocks + local_blocks)"
            ),
            PisaError::HeadDim { head_dim, supported } => {
                write!(f, "head dim {head_dim} is not supported (supported: {supported})")
            }
            PisaError::BufferLen { what, expected, actual } => {
                write!(f, "{what} has {actual} elements, the shape needs {expected}")
            }
            // A value not above its limit is one that saturated at u64::MAX (a count past 64
            // bits, whose limit is u64::MAX too): it has no value to print.
            PisaError::TooLarge { what, value, limit } if value <= limit => {
                write!(f, "{what} overflows 64 bits (the limit is {limit})")
            }
            PisaError::TooLarge { what, value, limit } => {
                write!(f, "{what} is {value}, above the limit of {limit}")
            }
            PisaError::InvalidValue { what } => write!(f, "invalid value: {what}"),
            PisaError::NonFinite { what, index } => write!(
                f,
                "{what} holds a NaN or an infinity at flat index {index} (its first non-finite \
                 element)"
            ),
        }
    }
}

impl core::error::Error for PisaError {}

/// Result alias of `pisa-core`.
pub type Result<T> = core::result::Result<T, PisaError>;

/// Checks that every element of `data` is finite: [`PisaError::NonFinite`] naming `what` and the
/// flat index of the first NaN or infinity otherwise. The reference functions run it on their
/// input tensors (Q, K, V, dO, the forward's O); it is public for a caller that checks its own
/// buffers first, as `pisa_wgpu::ops::check_finite` does for the GPU functions.
///
/// ```
/// use pisa_core::{check_finite, PisaError};
/// assert!(check_finite("q", &[1.0, -2.5]).is_ok());
/// assert_eq!(
///     check_finite("q", &[1.0, f32::NAN]),
///     Err(PisaError::NonFinite { what: "q", index: 1 })
/// );
/// ```
pub fn check_finite(what: &'static str, data: &[f32]) -> Result<()> {
    match data.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(index) => Err(PisaError::NonFinite { what, index }),
    }
}
