//! Attention shapes and tensor layouts (PISA.md "Notation").

use crate::error::{PisaError, Result};

/// Memory layout of a 4-D attention tensor of logical shape `[B, H, N, D]`
/// (batch, head, token, head dim). The last dimension `D` is always contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum TensorLayout {
    /// `[B, H, N, D]` row-major: all tokens of a head are contiguous (PyTorch SDPA's layout).
    #[default]
    Bhnd,
    /// `[B, N, H, D]` row-major: all heads of a token are contiguous (FlashAttention's layout).
    Bnhd,
}

impl TensorLayout {
    /// Element strides `(batch, head, token)` for a tensor of `heads` heads, `tokens` tokens and
    /// head dim `dim` (the stride of `d` is 1). Plain arithmetic, unchecked: for the sizes of a
    /// shape [`AttentionShape::validate`] accepts (its element counts fit `usize`) it cannot
    /// overflow; other sizes are the caller's to check.
    pub fn strides(self, heads: usize, tokens: usize, dim: usize) -> (usize, usize, usize) {
        match self {
            TensorLayout::Bhnd => (heads * tokens * dim, tokens * dim, dim),
            TensorLayout::Bnhd => (heads * tokens * dim, dim, heads * dim),
        }
    }

    /// Flat index of element `(b, h, n, d)` in a tensor with `heads` heads, `tokens` tokens and
    /// head dim `dim` (unchecked, as [`Self::strides`]: in range for the indices of a validated
    /// shape).
    #[inline]
    #[allow(clippy::too_many_arguments)] // one argument per tensor dimension, as in the math
    pub fn index(
        self,
        heads: usize,
        tokens: usize,
        dim: usize,
        b: usize,
        h: usize,
        n: usize,
        d: usize,
    ) -> usize {
        let (sb, sh, sn) = self.strides(heads, tokens, dim);
        b * sb + h * sh + n * sn + d
    }
}

/// The shape of one attention call. Query `i` sits at absolute position
/// `p_i = k_len - q_len + i` (PISA.md "Notation"): a whole prompt's prefill has
/// `q_len == k_len`, a prompt chunk over the keys of earlier chunks `q_len < k_len`, a decode
/// step `q_len == 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    /// B: independent sequences.
    pub batch: usize,
    /// Hq: query heads.
    pub q_heads: usize,
    /// Hkv: key/value heads; `q_heads % kv_heads == 0`.
    pub kv_heads: usize,
    /// Nq: query tokens.
    pub q_len: usize,
    /// Nk: key (and value) tokens, `k_len >= q_len`.
    pub k_len: usize,
    /// D: head dimension of queries, keys and values.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Validates and builds a shape.
    ///
    /// Errors: [`PisaError::Zero`] for any zero size, [`PisaError::GqaNotDivisible`] when
    /// `q_heads % kv_heads != 0`, [`PisaError::QueryLongerThanKeys`] when `q_len > k_len`,
    /// [`PisaError::TooLarge`] when an element count (of Q, of K/V or of the LSE) does not fit in
    /// `usize`.
    pub fn new(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        q_len: usize,
        k_len: usize,
        head_dim: usize,
    ) -> Result<Self> {
        for (what, v) in [
            ("batch", batch),
            ("q_heads", q_heads),
            ("kv_heads", kv_heads),
            ("q_len", q_len),
            ("k_len", k_len),
            ("head_dim", head_dim),
        ] {
            if v == 0 {
                return Err(PisaError::Zero { what });
            }
        }
        if !q_heads.is_multiple_of(kv_heads) {
            return Err(PisaError::GqaNotDivisible { q_heads, kv_heads });
        }
        if q_len > k_len {
            return Err(PisaError::QueryLongerThanKeys { q_len, k_len });
        }
        // Every element count must fit, so that `q_elems` and friends are exact and a buffer
        // length check against them cannot pass through an overflow.
        for (what, dims) in [
            (
                "query elements (B * Hq * Nq * D)",
                [batch, q_heads, q_len, head_dim],
            ),
            (
                "key/value elements (B * Hkv * Nk * D)",
                [batch, kv_heads, k_len, head_dim],
            ),
        ] {
            if checked_product(&dims).is_none() {
                // The count itself, or u64::MAX where it overflows 64 bits too.
                let value = dims
                    .iter()
                    .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
                    .unwrap_or(u64::MAX);
                return Err(PisaError::TooLarge {
                    what,
                    value,
                    limit: usize::MAX as u64,
                });
            }
        }
        Ok(Self {
            batch,
            q_heads,
            kv_heads,
            q_len,
            k_len,
            head_dim,
        })
    }

    /// Checks a shape as [`Self::new`] does: its fields are public, so a shape built field by
    /// field (or changed after `new`) has not been checked. Every pisa call that takes a shape
    /// checks it with this before using it. Errors as [`Self::new`].
    ///
    /// ```
    /// use pisa_core::AttentionShape;
    /// let mut s = AttentionShape::prefill(1, 8, 2, 128, 64).unwrap();
    /// s.kv_heads = 3; // 8 query heads do not split into 3 groups
    /// assert!(s.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<()> {
        Self::new(
            self.batch,
            self.q_heads,
            self.kv_heads,
            self.q_len,
            self.k_len,
            self.head_dim,
        )
        .map(|_| ())
    }

    /// A prefill shape: `q_len == k_len == len`.
    pub fn prefill(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        len: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::new(batch, q_heads, kv_heads, len, len, head_dim)
    }

    /// g_q = Hq / Hkv: query heads sharing one key/value head (and one selection). For a
    /// hand-built shape that [`Self::validate`] refuses: `Hq / max(Hkv, 1)` (never a division
    /// by zero; the shape is refused wherever it is used).
    pub fn gqa_group(&self) -> usize {
        self.q_heads / self.kv_heads.max(1)
    }

    /// Absolute position of query `i`: `k_len - q_len + i` (saturating for a hand-built shape
    /// with `q_len > k_len`, which [`Self::validate`] refuses).
    pub fn query_position(&self, i: usize) -> usize {
        self.k_len.saturating_sub(self.q_len).saturating_add(i)
    }

    /// Elements of Q (`B * Hq * Nq * D`), also of O. Exact for a shape from
    /// [`AttentionShape::new`]; for a hand-built shape whose count overflows, `usize::MAX`
    /// (saturated, never wrapped, so it matches no real buffer length).
    pub fn q_elems(&self) -> usize {
        saturating_product(&[self.batch, self.q_heads, self.q_len, self.head_dim])
    }

    /// Elements of K or V (`B * Hkv * Nk * D`); saturates like [`AttentionShape::q_elems`].
    pub fn kv_elems(&self) -> usize {
        saturating_product(&[self.batch, self.kv_heads, self.k_len, self.head_dim])
    }

    /// Elements of the per-row LSE (`B * Hq * Nq`), stored `[B, Hq, Nq]`; saturates like
    /// [`AttentionShape::q_elems`].
    pub fn lse_elems(&self) -> usize {
        saturating_product(&[self.batch, self.q_heads, self.q_len])
    }

    /// KV head serving query head `h` (`h / g_q`; for a hand-built shape of fewer query heads
    /// than KV heads, g_q is 0 and this is `h`, never a division by zero).
    pub fn kv_head_of(&self, h: usize) -> usize {
        h / self.gqa_group().max(1)
    }
}

fn checked_product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

fn saturating_product(dims: &[usize]) -> usize {
    checked_product(dims).unwrap_or(usize::MAX)
}
