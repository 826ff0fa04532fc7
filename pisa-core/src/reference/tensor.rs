//! Strided read-only views of `[B, H, N, D]` f32 tensors and the dot products of the reference
//! (PISA.md "Notation"). Internal to the reference.

use crate::config::SelectionConfig;
use crate::error::{PisaError, Result};
use crate::shape::{AttentionShape, TensorLayout};

/// A validated view of one `[B, H, N, D]` tensor in a [`TensorLayout`].
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    data: &'a [f32],
    layout: TensorLayout,
    heads: usize,
    tokens: usize,
    dim: usize,
}

/// `a * b * ...` with overflow reported as [`PisaError::TooLarge`].
pub(crate) fn checked_elems(what: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d).ok_or(PisaError::TooLarge {
            what,
            value: u64::MAX,
            limit: usize::MAX as u64,
        })
    })
}

/// A vector of `n` copies of `value`, allocated fallibly: [`PisaError::TooLarge`] naming `what`
/// (with `n` and the most elements of that type an allocation may hold) when it cannot be,
/// instead of the allocation failure that aborts the process.
pub(crate) fn filled<T: Clone>(
    what: &'static str,
    n: usize,
    value: T,
) -> Result<alloc::vec::Vec<T>> {
    let most = isize::MAX as usize / core::mem::size_of::<T>().max(1);
    let mut v = alloc::vec::Vec::new();
    if n > most || v.try_reserve_exact(n).is_err() {
        return Err(PisaError::TooLarge {
            what,
            value: n as u64,
            limit: most as u64,
        });
    }
    v.resize(n, value);
    Ok(v)
}

/// The error of a selection entry that names no leaf ([`check_block_indices`]).
pub(crate) const SELECTION_INDEX: &str =
    "selection holds a block index below -1 or past the last leaf";

/// Checks that every entry of a selection (`indices`) names a leaf of `nb0` or is -1 (the
/// padding): an index below -1 or past the last leaf is [`PisaError::InvalidValue`] `what`.
pub(crate) fn check_block_indices(indices: &[i32], nb0: usize, what: &'static str) -> Result<()> {
    if indices.iter().any(|&j| j < -1 || j as i64 >= nb0 as i64) {
        return Err(PisaError::InvalidValue { what });
    }
    Ok(())
}

/// Checks `data.len() == expected`, naming the buffer.
pub(crate) fn check_len(what: &'static str, actual: usize, expected: usize) -> Result<()> {
    if actual != expected {
        return Err(PisaError::BufferLen {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Re-validates a shape (its fields are public, so it may not come from
/// [`AttentionShape::new`]) and, with a configuration, that leaf indices fit in i32 and that a
/// `[B, Hkv, Nq, K]` selection's size fits in `usize`.
pub(crate) fn check_shape(s: &AttentionShape, cfg: Option<&SelectionConfig>) -> Result<()> {
    AttentionShape::new(s.batch, s.q_heads, s.kv_heads, s.q_len, s.k_len, s.head_dim)?;
    if let Some(cfg) = cfg {
        cfg.validate()?;
        let leaves = s.k_len.div_ceil(cfg.block_size);
        if leaves > i32::MAX as usize {
            return Err(PisaError::TooLarge {
                what: "leaf blocks (i32 indices)",
                value: leaves as u64,
                limit: i32::MAX as u64,
            });
        }
        checked_elems("selection", &[s.batch, s.kv_heads, s.q_len, cfg.top_k])?;
    }
    Ok(())
}

impl<'a> View<'a> {
    /// A view of an input tensor. Errors: [`PisaError::BufferLen`] when `data.len() != batch *
    /// heads * tokens * dim`, [`PisaError::NonFinite`] for a NaN or an infinity in it (the
    /// reference is defined for finite inputs; with them, a +inf key scored as masked and a NaN
    /// ranked by its sign bit, with `Ok`).
    pub(crate) fn new(
        what: &'static str,
        data: &'a [f32],
        layout: TensorLayout,
        dims: [usize; 4],
    ) -> Result<Self> {
        let v = Self::checked_len(what, data, layout, dims)?;
        crate::error::check_finite(what, data)?;
        Ok(v)
    }

    /// [`Self::new`] without the finiteness scan, for data checked as it was added (a decode
    /// state's keys and values, checked row by row on append: a scan per step would make a
    /// step O(N)).
    pub(crate) fn checked_len(
        what: &'static str,
        data: &'a [f32],
        layout: TensorLayout,
        [batch, heads, tokens, dim]: [usize; 4],
    ) -> Result<Self> {
        let expected = checked_elems(what, &[batch, heads, tokens, dim])?;
        check_len(what, data.len(), expected)?;
        Ok(Self {
            data,
            layout,
            heads,
            tokens,
            dim,
        })
    }

    /// The `D` values of `(b, h, n)`.
    #[inline]
    pub(crate) fn row(&self, b: usize, h: usize, n: usize) -> &'a [f32] {
        let i = self
            .layout
            .index(self.heads, self.tokens, self.dim, b, h, n, 0);
        &self.data[i..i + self.dim]
    }
}

/// `sum_d a_d * b_d` accumulated in f64.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// `sum_d a_d * b_d` of an f32 query row and an f64 pyramid row, in f64.
#[inline]
pub(crate) fn dot_mean(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y).sum()
}
