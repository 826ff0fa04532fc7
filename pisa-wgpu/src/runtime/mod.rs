//! The runtime, split by role: [`context`] (adapter, device, limits, features, errors),
//! [`pipeline`] (shader variants and the pipeline cache), [`buffers`] (storage buffers, upload,
//! readback, binding-size checks) and [`profiler`] (GPU timestamps).

pub mod buffers;
pub mod context;
pub mod pipeline;
pub mod profiler;
