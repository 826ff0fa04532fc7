//! CPU reference of every PISA operation (feature `alloc`): straightforward loops, f64
//! accumulation, one function per operation. Everything on the GPU is tested against this.
//!
//! Tensors are f32 slices of logical shape `[B, H, N, D]` in a [`crate::TensorLayout`]; Q has
//! Hq heads and Nq tokens, K and V have Hkv heads and Nk tokens; outputs are f64.
//!
//! - [`pyramid`]: the key pyramid (PISA.md 1);
//! - [`select`]: PISA, BSA and oracle selection (PISA.md 2 and 3);
//! - [`attention`]: block-sparse and dense attention (PISA.md 4);
//! - [`backward`]: the backward pass of block-sparse attention (PISA.md 4);
//! - [`decode`]: the incremental decode state (PISA.md 1 and 5);
//! - [`metrics`]: Recall@K and mass recall (PISA.md 3, "Quality").

pub mod attention;
pub mod backward;
pub mod decode;
pub mod metrics;
pub mod pyramid;
pub mod select;
mod tensor;

pub use attention::{dense_attention, sparse_attention};
pub use backward::{sparse_attention_backward, Gradients};
pub use decode::{DecodeOutput, DecodeState};
pub use metrics::{recall, recall_per_kv_head, try_recall, try_recall_per_kv_head, Recall};
pub use pyramid::{build_pyramid, Pyramid};
pub use select::{
    block_mass, select_bsa, select_oracle, select_oracle_from_mass, select_pisa, select_pisa_with,
    Selection,
};
