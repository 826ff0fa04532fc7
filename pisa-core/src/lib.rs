#![no_std]
#![warn(missing_docs)]
//! # pisa-core
//!
//! The pure math of PISA (Pyramid Top-K Selection Attention; `docs/PISA.md` of the project,
//! paper arXiv 2609.31093): shapes and configuration, the pyramid layout, complexity-bounded
//! candidate scheduling, LogSumExp / online-softmax math, and, with the `alloc` feature (on by
//! default), the CPU reference of every operation in [`mod@reference`]. No GPU types live here.

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
pub use error::{PisaError, Result};
pub use layout::{NodeClass, PyramidLayout, MAX_LEVELS};
pub use schedule::{grid_for, pyramid_len, Schedule};
pub use shape::{AttentionShape, TensorLayout};
