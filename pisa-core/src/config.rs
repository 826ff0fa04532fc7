//! Selection configuration (PISA.md "Notation", sections 2 and 3).

use crate::error::{PisaError, Result};

/// How an intermediate pyramid node (level >= 1) is scored for a query (PISA.md section 2).
/// Leaves are always scored by exact LSE over their raw keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Scoring {
    /// PISA (default): `log sum_{c in children} n_c * exp(s * q.mu_c)`.
    #[default]
    Lse,
    /// PISA-1 ablation: `s * q.mu_node + log n_node`.
    Mean,
    /// PISA-2 ablation: PISA-1 + `(s^2 / 2) * sum_d q_d^2 * var_d` (per-dimension key variance).
    MeanVar,
}

impl Scoring {
    /// Stable integer code shared with the GPU shaders (`0` lse, `1` mean, `2` meanvar).
    pub fn code(self) -> u32 {
        match self {
            Scoring::Lse => 0,
            Scoring::Mean => 1,
            Scoring::MeanVar => 2,
        }
    }
}

/// Largest leaf block size C accepted, in tokens (the paper's C is 64): a bound on absurd
/// values, which the kernels' u32 arithmetic could not hold. (Blocks of tens of thousands of
/// tokens once gave wrong outputs in tests; the cause was lavapipe's loop limiter, see
/// `tests/lavapipe_loops.rs`, not the kernels.)
pub const MAX_BLOCK_SIZE: usize = 1 << 20;
/// Largest `top_k` accepted. The selection buffers and the routing's candidate lists grow
/// with it (`g * (K + 1)` candidates per query and level; with [`MAX_MERGE_FACTOR`] that
/// count stays below 2^31); long before this limit a call meets the device's buffer limits,
/// which are reported as such.
pub const MAX_TOP_K: usize = 1 << 24;
/// Largest merge factor g the configuration accepts (the paper's g is 2; a routing candidate
/// reads g child rows). The GPU routing kernel keeps state per child of its g (K + 1)
/// candidates in workgroup memory, so devices refuse much smaller factors with a typed limit
/// error (pisa-wgpu's `GpuError::Limit`; g = 64 at every shape on 32 KiB of workgroup memory).
pub const MAX_MERGE_FACTOR: usize = 64;

/// Configuration of block selection and of the attention over the selection.
///
/// Build it with [`SelectionConfig::new`]`(C, K)` (the other fields at PISA.md's defaults: g = 2,
/// `lse`, causal, no sink or local blocks; [`Default`] is C = 64, K = 16 with those) and the
/// `with_*` builders, then call
/// [`SelectionConfig::validate`] (done by every operation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectionConfig {
    /// C: leaf block size in tokens (>= 1).
    pub block_size: usize,
    /// K: leaf blocks each query attends to, forced blocks included (>= 1).
    pub top_k: usize,
    /// g: merge factor of the pyramid (>= 2).
    pub merge_factor: usize,
    /// Intermediate-level scoring.
    pub scoring: Scoring,
    /// Forced first blocks (attention sinks), counted inside `top_k`: blocks
    /// `0..sink_blocks` that are at or before the query's own block. Without causal masking the
    /// same rule holds (PISA.md section 3: "the forced leaves are as in the causal case"), so for a
    /// query in block 0 only block 0 is forced; it may still select the other sinks by score.
    pub sink_blocks: usize,
    /// Forced blocks just before the query's own block, counted inside `top_k`.
    pub local_blocks: usize,
    /// Causal masking (decoders). `false`: every node is complete-past (encoders).
    pub causal: bool,
    /// Softmax scale s; `None` means `1 / sqrt(D)`.
    pub scale: Option<f32>,
}

impl Default for SelectionConfig {
    fn default() -> Self {
        Self {
            block_size: 64,
            top_k: 16,
            merge_factor: 2,
            scoring: Scoring::Lse,
            sink_blocks: 0,
            local_blocks: 0,
            causal: true,
            scale: None,
        }
    }
}

impl SelectionConfig {
    /// A validated configuration with block size C and top_k K, other fields at their defaults.
    pub fn new(block_size: usize, top_k: usize) -> Result<Self> {
        let c = Self {
            block_size,
            top_k,
            ..Self::default()
        };
        c.validate()?;
        Ok(c)
    }

    /// Sets the merge factor g.
    pub fn with_merge_factor(mut self, g: usize) -> Self {
        self.merge_factor = g;
        self
    }
    /// Sets the intermediate scoring.
    pub fn with_scoring(mut self, s: Scoring) -> Self {
        self.scoring = s;
        self
    }
    /// Sets sink and local forced blocks.
    pub fn with_forced(mut self, sink_blocks: usize, local_blocks: usize) -> Self {
        self.sink_blocks = sink_blocks;
        self.local_blocks = local_blocks;
        self
    }
    /// Sets causal masking.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
    /// Sets the softmax scale.
    pub fn with_scale(mut self, scale: Option<f32>) -> Self {
        self.scale = scale;
        self
    }

    /// Upper bound on forced leaves per query: own block + sink + local (PISA.md section 3.3),
    /// saturating at `usize::MAX` (which [`SelectionConfig::validate`] refuses).
    pub fn max_forced(&self) -> usize {
        1usize
            .saturating_add(self.sink_blocks)
            .saturating_add(self.local_blocks)
    }

    /// Checks every field. Errors: [`PisaError::Zero`] (block size or top_k 0),
    /// [`PisaError::MergeFactor`] (g < 2), [`PisaError::TopKBelowForced`] (forced > K),
    /// [`PisaError::TooLarge`] (block size above [`MAX_BLOCK_SIZE`], top_k above
    /// [`MAX_TOP_K`], g above [`MAX_MERGE_FACTOR`], or `1 + sink_blocks + local_blocks`
    /// overflowing `usize`: the larger of the two named, with the limit top_k - 1),
    /// [`PisaError::InvalidValue`] (non-finite or non-positive scale).
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(PisaError::Zero { what: "block_size" });
        }
        if self.top_k == 0 {
            return Err(PisaError::Zero { what: "top_k" });
        }
        if self.merge_factor < 2 {
            return Err(PisaError::MergeFactor {
                merge_factor: self.merge_factor,
            });
        }
        for (what, value, limit) in [
            ("block_size", self.block_size, MAX_BLOCK_SIZE),
            ("top_k", self.top_k, MAX_TOP_K),
            ("merge_factor", self.merge_factor, MAX_MERGE_FACTOR),
        ] {
            if value > limit {
                return Err(PisaError::TooLarge {
                    what,
                    value: value as u64,
                    limit: limit as u64,
                });
            }
        }
        let Some(forced) = 1usize
            .checked_add(self.sink_blocks)
            .and_then(|f| f.checked_add(self.local_blocks))
        else {
            // The sum overflows: name the larger of the two (each may be at most top_k - 1).
            let (what, value) = if self.sink_blocks >= self.local_blocks {
                ("sink_blocks", self.sink_blocks)
            } else {
                ("local_blocks", self.local_blocks)
            };
            return Err(PisaError::TooLarge {
                what,
                value: value as u64,
                limit: self.top_k as u64 - 1,
            });
        };
        if forced > self.top_k {
            return Err(PisaError::TopKBelowForced {
                top_k: self.top_k,
                forced,
            });
        }
        if let Some(s) = self.scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(PisaError::InvalidValue {
                    what: "softmax scale must be finite and positive",
                });
            }
        }
        Ok(())
    }

    /// The softmax scale s for head dim `head_dim`: the configured one, else `1 / sqrt(D)`
    /// (+inf for a head dim of 0, which no validated shape has).
    pub fn softmax_scale(&self, head_dim: usize) -> f32 {
        self.scale
            .unwrap_or_else(|| 1.0 / libm::sqrtf(head_dim as f32))
    }

    /// Forced leaves of a query whose own leaf is `own_block`, ascending, deduplicated: sink
    /// blocks `0..sink` (those <= own), local blocks `own-local..own`, and `own` itself
    /// (PISA.md section 3.3). Calls `f` once per forced leaf.
    pub fn for_each_forced(&self, own_block: usize, mut f: impl FnMut(usize)) {
        let local_start = own_block.saturating_sub(self.local_blocks);
        let sink_end = self.sink_blocks.min(local_start);
        for b in 0..sink_end {
            f(b);
        }
        for b in local_start..=own_block {
            f(b);
        }
    }

    /// Whether leaf `block` is forced for a query whose own leaf is `own_block`.
    pub fn is_forced(&self, own_block: usize, block: usize) -> bool {
        block <= own_block
            && (block < self.sink_blocks || block.saturating_add(self.local_blocks) >= own_block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_blocks_are_deduplicated_and_ascending() {
        let c = SelectionConfig::default().with_forced(2, 3);
        let mut v = [0usize; 8];
        let mut n = 0;
        c.for_each_forced(3, |b| {
            v[n] = b;
            n += 1;
        });
        assert_eq!(&v[..n], &[0, 1, 2, 3]);
        n = 0;
        c.for_each_forced(10, |b| {
            v[n] = b;
            n += 1;
        });
        assert_eq!(&v[..n], &[0, 1, 7, 8, 9, 10]);
        for own in 0..20 {
            for b in 0..25 {
                let mut hit = false;
                c.for_each_forced(own, |x| hit |= x == b);
                assert_eq!(hit, c.is_forced(own, b), "own {own} block {b}");
            }
        }
    }

    #[test]
    fn validation_names_the_problem() {
        assert_eq!(
            SelectionConfig::new(0, 4),
            Err(PisaError::Zero { what: "block_size" })
        );
        let e = SelectionConfig::default()
            .with_forced(10, 10)
            .validate()
            .unwrap_err();
        assert_eq!(
            e,
            PisaError::TopKBelowForced {
                top_k: 16,
                forced: 21
            }
        );
        assert!(SelectionConfig::default()
            .with_merge_factor(1)
            .validate()
            .is_err());
        assert!(SelectionConfig::default()
            .with_scale(Some(f32::NAN))
            .validate()
            .is_err());
    }

    /// Each size limit holds at its value and refuses one above it, naming the field; the
    /// largest values a command line can pass are refused the same way, not by an overflow.
    #[test]
    fn sizes_above_their_limits_are_refused() {
        assert!(SelectionConfig::new(MAX_BLOCK_SIZE, 4).is_ok());
        assert!(SelectionConfig::new(64, MAX_TOP_K).is_ok());
        assert!(SelectionConfig::default()
            .with_merge_factor(MAX_MERGE_FACTOR)
            .validate()
            .is_ok());
        let big = |what, value: usize, limit: usize| PisaError::TooLarge {
            what,
            value: value as u64,
            limit: limit as u64,
        };
        for c in [MAX_BLOCK_SIZE + 1, 1 << 32, usize::MAX] {
            let e = SelectionConfig::new(c, 4).unwrap_err();
            assert_eq!(e, big("block_size", c, MAX_BLOCK_SIZE));
        }
        for k in [MAX_TOP_K + 1, 1 << 60, usize::MAX] {
            let e = SelectionConfig::new(64, k).unwrap_err();
            assert_eq!(e, big("top_k", k, MAX_TOP_K));
        }
        for g in [MAX_MERGE_FACTOR + 1, usize::MAX / 2 + 1, usize::MAX] {
            let e = SelectionConfig::default()
                .with_merge_factor(g)
                .validate()
                .unwrap_err();
            assert_eq!(e, big("merge_factor", g, MAX_MERGE_FACTOR));
        }
        // Forced blocks whose count overflows: the larger field named, not the saturated sum.
        let e = SelectionConfig::new(64, 16)
            .unwrap()
            .with_forced(usize::MAX, 1)
            .validate()
            .unwrap_err();
        assert_eq!(e, big("sink_blocks", usize::MAX, 15));
        let e = SelectionConfig::new(64, 16)
            .unwrap()
            .with_forced(3, usize::MAX - 1)
            .validate()
            .unwrap_err();
        assert_eq!(e, big("local_blocks", usize::MAX - 1, 15));
    }
}
