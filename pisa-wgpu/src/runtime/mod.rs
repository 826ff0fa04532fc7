//! The runtime, split by role:
//! - [`context`]: device, limits, features, errors; [`adapter`]: adapter choice and reports;
//! - [`view`]: the application's tensors ([`crate::TensorView`]), checked against their buffers;
//! - [`checks`]: the shaders' runtime checks per device; [`coop`]: kernel paths,
//!   cooperative-matrix support; [`tuning`]: the kernels' tuning knobs; `gate`: settings
//!   changes against running calls;
//! - [`pipeline`]: shader variants and the pipeline cache; [`buffers`]: storage buffers,
//!   upload, poisoned outputs, scratch, binding-size checks, dispatch; `arena`: a plan's
//!   recorded buffers and bind groups, replayed by its runs; [`readback`]: reading tensors
//!   back; `block`: blocking waits (refused on wasm32);
//! - [`profiler`]: GPU timestamps; [`nv`]: the NVIDIA cooperative-matrix-2 device and kernels.

pub mod adapter;
pub(crate) mod arena;
pub(crate) mod block;
pub mod buffers;
pub mod checks;
pub mod context;
pub mod coop;
pub(crate) mod gate;
pub mod nv;
#[cfg(test)]
mod nv_uniforms;
pub mod pipeline;
pub mod profiler;
pub mod readback;
pub mod tuning;
pub mod view;
