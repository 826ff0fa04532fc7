//! Operations, one module per kernel family; each names its shader file in `shaders/`.
//!
//! The application-facing operations are [`prefill`] ([`prefill::PrefillPlan`], and the host
//! convenience [`prefill::prefill_host`]) and [`decode`] ([`decode::KvCache`]). The stage-level
//! kernels (pyramid, routing, leaf selection, attention, backward, baselines, gather) are public
//! for the project's tests, benchmarks and tools, and hidden from the documentation: their
//! signatures follow the kernels and may change.

#[doc(hidden)]
pub mod attention;
#[doc(hidden)]
pub mod backward;
#[doc(hidden)]
pub mod bsa;
pub mod decode;
#[doc(hidden)]
pub mod fill;
#[doc(hidden)]
pub mod gather;
#[doc(hidden)]
pub mod leaf_select;
#[doc(hidden)]
pub mod nv_gemm;
#[doc(hidden)]
pub mod oracle;
pub mod prefill;
#[doc(hidden)]
pub mod pyramid;
#[doc(hidden)]
pub mod route;
#[doc(hidden)]
pub mod select;

use crate::error::{GpuError, Result};
use crate::runtime::pipeline::ShaderSource;
pub use gather::{check_finite_view, check_finite_view_async};

/// Opt-in finiteness check of a host tensor: [`GpuError::NonFinite`] naming `tensor`, the flat
/// index of the first NaN or infinite element and its value; `Ok` when every element is finite.
/// One pass over the data (branch-free inside blocks of 1024 elements), no allocation.
///
/// The GPU functions do not check their inputs: what a non-finite input produces is documented
/// on [`prefill::prefill_host`] and [`decode::KvCache`]. Call this first where non-finite
/// activations cannot be ruled out upstream (the `pisa` CLI refuses them by default); for
/// inputs already in GPU buffers, [`check_finite_view`] scans a view on the GPU.
pub fn check_finite(tensor: &'static str, data: &[f32]) -> Result<()> {
    const BLOCK: usize = 1024;
    for (i, chunk) in data.chunks(BLOCK).enumerate() {
        if chunk.iter().fold(true, |ok, x| ok & x.is_finite()) {
            continue;
        }
        let j = chunk
            .iter()
            .position(|x| !x.is_finite())
            .expect("the block holds a non-finite value");
        return Err(GpuError::NonFinite {
            tensor,
            index: i * BLOCK + j,
            value: chunk[j],
        });
    }
    Ok(())
}

/// Every shader family, for the naga validation test.
#[doc(hidden)]
pub fn all_shaders() -> Vec<ShaderSource> {
    vec![
        attention::SHADER,
        attention::by_leaf::SHADER,
        attention::by_leaf::MERGE_SHADER,
        attention::split_k::SHADER,
        attention::split_k::MERGE_SHADER,
        backward::SHADER,
        backward::index::SHADER,
        fill::SHADER,
        gather::SHADER,
        pyramid::SHADER,
        route::SHADER,
        route::SG_SHADER,
        select::all_leaves::SHADER,
        route::TABLE_SHADER,
        leaf_select::SHADER,
        leaf_select::by_leaf::BUCKET_SHADER,
        leaf_select::by_leaf::SCORE_SHADER,
        leaf_select::by_leaf::PICK_SHADER,
        bsa::SHADER,
        oracle::SHADER,
        decode::ROUTE_SHADER,
        decode::ROUTE_SG_SHADER,
        decode::ROUTE_LEAF_SHADER,
        decode::ROUTE_LEAF_SG_SHADER,
        decode::ROUTE_LEAF_MERGE_SHADER,
        decode::ROUTE_LEAF_MERGE_SG_SHADER,
        decode::SHADER,
        decode::MERGE_SHADER,
        decode::FUSED_SHADER,
        decode::APPEND_SHADER,
    ]
}
