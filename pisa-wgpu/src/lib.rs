//! # pisa-wgpu
//!
//! PISA block-sparse attention (`docs/PISA.md`) as WGSL compute shaders through wgpu: runs on
//! any Vulkan GPU and on Mesa's lavapipe CPU Vulkan driver, on OpenGL and in the browser's
//! WebGPU (its shaders are translated for Metal and DX12 and validated by naga, not yet run
//! there). Every kernel is tested against the CPU reference in `pisa-core`.
//!
//! ## The API an application uses
//!
//! - [`Context`]: the device pisa records on: the application's own
//!   ([`Context::from_device`], with [`wanted_features`]) or one pisa opens
//!   ([`Context::new`], [`Context::new_async`]). A cheap clone.
//! - [`TensorView`]: a tensor `[B, H, N, D]` in the application's `wgpu::Buffer` (byte offset,
//!   strides, [`DType`] f32 / f16 / bf16 / i32), checked once against its buffer.
//! - [`PrefillPlan`]: plan a prefill once per shape ([`PrefillOptions`]), then
//!   [`PrefillPlan::run`] into the application's encoder over its views ([`PrefillOutputs`]).
//!   A varlen batch (`cu_seqlens`, as `flash_attn_varlen_func`) is a [`VarlenPrefillPlan`].
//!   Views the kernels can read in place (a packed QKV projection at aligned offsets) need no
//!   staging: [`PrefillPlan::new_in_place`] plans for them alone.
//! - [`Storage`]: the element type the kernels read, f32, f16 (the tensor-core paths) or bf16
//!   (16-bit words widened in the kernels, O written in f32), for prefill and the decode cache.
//! - [`KvCache`]: the decode cache ([`KvCache::with_sizes`] names its sizes);
//!   [`KvCache::record_append_view`] and
//!   [`KvCache::record_step_into`] ([`StepOutputs`]) record a decode step, after the first
//!   call with a given set of buffers, with no GPU allocation (buffers, bind groups,
//!   pipelines), host write or wait (on the host, a few
//!   small heap allocations of the call's liveness probe, [`Context::check_alive`]);
//!   [`KvCache::record_chunk`] ([`ChunkOutputs`]) appends and attends T
//!   tokens per sequence (a chunked prefill into the cache).
//! - [`Tuning`]: the kernels' knobs (speed only: every setting gives the reference's results,
//!   selections up to near-ties of f32 rounding and outputs within f32 rounding; one
//!   diagnostic, the WGSL dump folder), with per-device defaults; [`Context::tuning`] / [`Context::set_tuning`], or
//!   [`Context::with_tuning`] before the device opens. Their names and `PISA_*` variables:
//!   [`TUNING_KNOBS`].
//! - [`Context::read_async`] reads a view back without blocking.
//! - [`Profiler`]: GPU time per stage from timestamp queries, handed to a `run` or `record_*`
//!   call of its own context, read after the submit ([`Profiler::finish`], or
//!   [`Profiler::finish_async`] in a browser).
//! - The kernels do not scan their inputs for NaN or infinities: [`ops::check_finite`] (host
//!   slices) and [`ops::check_finite_view`] (a view, on the GPU) do, where they cannot be ruled
//!   out upstream.
//! - Host conveniences for tools and tests (blocking; refused on wasm32): [`prefill_host`],
//!   [`KvCache::append_and_step`], [`Context::read_bytes`]; the selection alone, PISA's, the
//!   BSA baseline's or the full-attention oracle's ([`select_host`], [`SelectionMethod`];
//!   [`oracle_host`] with each leaf's attention mass), to measure selection quality.
//! - Errors are [`GpuError`]s, never panics of pisa's own checks (wgpu itself may panic on a
//!   buffer of another `wgpu::Instance`: README, "Not caught by pisa"): a view the operation cannot use is
//!   [`GpuError::View`], a profiler used with another context [`GpuError::Misuse`].
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
//! use pisa_wgpu::{wgpu, AdapterChoice, Context, DType, PrefillOptions, PrefillOutputs, PrefillPlan, TensorView};
//!
//! let Ok(ctx) = Context::new(&AdapterChoice::HighPerformance) else { return Ok(()) }; // no GPU
//! let (hq, hkv, n, d) = (4, 2, 100, 32);
//! let shape = AttentionShape::prefill(1, hq, hkv, n, d)?;
//! let opts = PrefillOptions { cfg: SelectionConfig::new(32, 2)?, ..Default::default() };
//! let plan = PrefillPlan::new(&ctx, &shape, &opts)?;
//!
//! // The application's buffers: Q, K, V, O and LSE, f32, BHND.
//! let buffer = |elems: usize| ctx.device().create_buffer(&wgpu::BufferDescriptor {
//!     label: None,
//!     size: (elems * 4) as u64,
//!     usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
//!     mapped_at_creation: false,
//! });
//! let view = |b: &wgpu::Buffer, h: usize, dd: usize| {
//!     TensorView::contiguous(b, 0, DType::F32, [1, h, n, dd], TensorLayout::Bhnd)
//! };
//! let (q, k, v) = (buffer(hq * n * d), buffer(hkv * n * d), buffer(hkv * n * d));
//! let (o, lse) = (buffer(hq * n * d), buffer(hq * n));
//! for (b, len) in [(&q, hq * n * d), (&k, hkv * n * d), (&v, hkv * n * d)] {
//!     let data: Vec<f32> = (0..len).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
//!     ctx.queue().write_buffer(b, 0, bytemuck::cast_slice(&data));
//! }
//! let (ov, lv) = (view(&o, hq, d)?, view(&lse, hq, 1)?);
//! let mut enc = ctx.device().create_command_encoder(&Default::default());
//! let outs = PrefillOutputs { out: &ov, lse: &lv, selection: None };
//! plan.run(&mut enc, &view(&q, hq, d)?, &view(&k, hkv, d)?, &view(&v, hkv, d)?, &outs, None)?;
//! ctx.queue().submit([enc.finish()]);
//! let lse_bytes = ctx.read_bytes(&lse)?;
//! assert!(bytemuck::cast_slice::<u8, f32>(&lse_bytes).iter().all(|x| x.is_finite()));
//! # Ok(()) }
//! ```
//!
//! ## Limits
//!
//! | | prefill ([`PrefillPlan`], [`prefill_host`]) | decode ([`KvCache`]) |
//! |---|---|---|
//! | head dim D | multiples of 16 from 16 to 256 | multiples of 4 up to 1024 |
//! | GQA group (Hq / Hkv) | up to 32 | up to 256 |
//! | storage | f32; f16 with SHADER_F16 (the tensor-core kernels); bf16 on the portable kernels | the same, bf16 as fast as f16 |
//! | sizes | each tensor of a plan in one storage binding ([`Context::max_binding_bytes`]; [`prefill_host`] splits by KV head) | K and V in at most two bindings |
//!
//! The selection configuration ([`pisa_core::SelectionConfig`]): block size C from 1 to
//! 2^20, `top_k` from 1 to 2^24 (at least the forced blocks), merge factor g from 2 to 64,
//! scoring `lse` (PISA), `mean` or `meanvar`, causal or not. Outside these a call returns a
//! typed error ([`GpuError::Input`], [`GpuError::Unsupported`] or [`GpuError::Limit`]) before
//! anything is recorded. The tensor-core kernels run where the device has
//! EXPERIMENTAL_COOPERATIVE_MATRIX (WGSL cooperative matrices) or `VK_NV_cooperative_matrix2`
//! (NVIDIA, [`request_device_nv_cm2`]), with f16 storage; every other case runs the portable
//! kernels, with the same results up to rounding. For bf16 models on tensor cores, plan with
//! f16 storage and give it the bf16 views: they are converted on the GPU (exact within f16's
//! range), where a bf16 plan's portable kernels are tens of times slower.
//!
//! ## Threads
//!
//! On native targets [`Context`], [`PrefillPlan`], [`VarlenPrefillPlan`], [`KvCache`] and
//! [`TensorView`] are `Send + Sync` (asserted at compile time): share a context and its plans
//! across threads; a plan's `run` only records into the caller's encoder, and the calls that
//! change a cache take `&mut self`. On wasm32 this follows wgpu's own types there.
//!
//! - A plan's intermediates are the plan's, not the thread's: runs of one plan from several
//!   threads are right (the queue runs them one after another), but a decode cache's take-over
//!   ([`KvCache::record_prefill_from_plan`], [`VarlenPrefillPlan::run_into_cache`]) loads what
//!   the plan's last recorded run left, whichever thread recorded it. Record the take-over in
//!   the encoder of its run, with no other thread's run of that plan recorded in between
//!   (hold a lock of yours across the two), or give each thread its own plan.
//! - The settings ([`Context::set_tuning`], [`Context::set_kernel_path`],
//!   [`Context::set_leaf_order`]) are the context's: a change waits for the calls running on
//!   other threads, so a call sees one set of settings from start to end; afterwards a
//!   [`PrefillPlan`] made before refuses to run (make a new one), a [`VarlenPrefillPlan`]
//!   re-plans, a [`KvCache`] keeps what it was made with
//!   (`tests/threads.rs`).
//!
//! ## Layout
//!
//! `runtime` (device, pipelines, buffers, plans' arenas, timestamps) and one module per kernel
//! family under [`ops`], each beside its shader in `shaders/` and its tests in `tests/`.
#![warn(missing_docs)]

pub mod error;
pub mod ops;
#[doc(hidden)]
pub mod runtime;

pub use error::{GpuError, Result};
pub use ops::attention::{check_head_dim, SUPPORTED_HEAD_DIMS};
pub use ops::decode::{CacheSizes, ChunkOutputs, DecodeOutput, DecodeStep, KvCache, StepOutputs};
pub use ops::prefill::{
    prefill_host, PlanViews, PrefillOptions, PrefillOutput, PrefillOutputs, PrefillPlan,
    VarlenPrefillPlan,
};
pub use ops::select::{oracle_host, select_host, Method as SelectionMethod};
pub use runtime::adapter::{instance, list_adapters_async, INSTALL_HINT};
#[doc(hidden)]
pub use runtime::buffers::{GpuTensor, POISON_F32, POISON_I32};
pub use runtime::checks::ShaderChecks;
pub use runtime::context::{
    app_device_descriptor, list_adapters, wanted_features, AdapterChoice, AdapterReport, Context,
    KernelPath, LeafOrder,
};
pub use runtime::nv::{
    device_has_nv_cm2, nv_cm2_supported, request_device_nv_cm2, NV_CM2_FEATURES,
};
#[doc(hidden)]
pub use runtime::pipeline::ShaderSource;
pub use runtime::pipeline::Storage;
pub use runtime::profiler::{Profiler, StageTimes};

// What the "Threads" section of the crate docs says, checked by the compiler.
#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Context>();
    send_sync::<PrefillPlan>();
    send_sync::<VarlenPrefillPlan>();
    send_sync::<KvCache>();
    send_sync::<TensorView>();
};
pub use runtime::tuning::{Tuning, KNOBS as TUNING_KNOBS};
pub use runtime::view::{DType, TensorView};
pub use wgpu;
