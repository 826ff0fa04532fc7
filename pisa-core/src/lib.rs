#![no_std]
#![warn(missing_docs)]
//! # pisa-core
//!
//! The pure math of PISA (Pyramid Top-K Selection Attention; `docs/PISA.md` of the project,
//! paper arXiv 2609.31093): shapes and configuration, the pyramid layout, complexity-bounded
//! candidate scheduling, LogSumExp / online-softmax math, and, with the `alloc` feature (on by
//! default), the CPU reference of every operation in the `reference` module. No GPU types live
//! here.
//!
//! The reference of a PISA prefill: the selection (PISA.md section 3), then attention over the
//! selected leaf blocks (section 4), in f64 from f32 inputs:
//!
//! ```
//! # #[cfg(feature = "alloc")] {
//! use pisa_core::reference::{select_pisa, sparse_attention};
//! use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
//! // One sequence of 300 tokens, 4 query heads over 2 KV heads (GQA group 2), head dim 16.
//! let shape = AttentionShape::prefill(1, 4, 2, 300, 16).unwrap();
//! // Leaf blocks of C = 64 tokens, top_k K = 3 of them per query (its own block included).
//! let cfg = SelectionConfig::new(64, 3).unwrap();
//! let x = |n: usize, seed: usize| -> Vec<f32> {
//!     (0..n).map(|i| (((i * 7919 + seed) % 1000) as f32 / 500.0) - 1.0).collect()
//! };
//! // Q [B, Hq, Nq, D], K and V [B, Hkv, Nk, D].
//! let (q, k, v) = (x(shape.q_elems(), 1), x(shape.kv_elems(), 2), x(shape.kv_elems(), 3));
//! let sel = select_pisa(&q, &k, &shape, TensorLayout::Bhnd, &cfg).unwrap();
//! // [B, Hkv, Nq, K] ascending leaf indices, -1 padded: query 299 sees leaves 0..=4.
//! let last = sel.row(2 * 300 - 1);
//! assert_eq!(last.len(), 3);
//! assert!(last.contains(&4)); // its own block is always selected
//! let (o, lse) = sparse_attention(&q, &k, &v, &shape, TensorLayout::Bhnd, &cfg, &sel.indices)
//!     .unwrap();
//! assert_eq!((o.len(), lse.len()), (shape.q_elems(), 4 * 300)); // O [B, Hq, Nq, D], LSE [B, Hq, Nq]
//! # }
//! ```

#[cfg(feature = "alloc")]
extern crate alloc;

pub mod config;
pub mod error;
pub mod layout;
pub mod lse;
pub mod schedule;
pub mod shape;

#[cfg(feature = "alloc")]
pub mod reference;

pub use config::{Scoring, SelectionConfig, MAX_BLOCK_SIZE, MAX_MERGE_FACTOR, MAX_TOP_K};
pub use error::{check_finite, PisaError, Result};
pub use layout::{NodeClass, PyramidLayout, MAX_LEVELS};
pub use schedule::{grid_for, pyramid_len, Schedule};
pub use shape::{AttentionShape, TensorLayout};
