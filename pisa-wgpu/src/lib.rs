//! # pisa-wgpu
//!
//! PISA block-sparse attention (project `docs/PISA.md`) as WGSL compute shaders through wgpu:
//! runs on any Vulkan GPU, on Metal and DX12, and on Mesa's lavapipe CPU Vulkan driver. Every
//! kernel is tested against the CPU reference in `pisa-core`.
//!
//! Layout: [`runtime`] (device, pipelines, buffers, timestamps) and one module per kernel
//! family under [`ops`], each beside its shader in `shaders/` and its tests in `tests/`.
#![warn(missing_docs)]

pub mod error;
pub mod ops;
pub mod runtime;

pub use error::{GpuError, Result};
pub use runtime::adapter::{instance, list_adapters_async};
pub use runtime::buffers::{GpuTensor, POISON_F32, POISON_I32};
pub use runtime::context::{
    list_adapters, wanted_features, AdapterChoice, AdapterReport, Context, KernelPath, LeafOrder,
};
pub use runtime::pipeline::{ShaderSource, Storage};
pub use runtime::profiler::{Profiler, StageTimes};
pub use runtime::view::{DType, TensorView};
pub use wgpu;
