//! The GPU context: the device opened on the chosen adapter with the adapter's own limits,
//! optional features, and the conversion of wgpu's error channels (error scopes, the
//! uncaptured-error handler, the device-lost callback) into [`GpuError`] results.
//!
//! Adapter choice and reports live in [`adapter`](super::adapter), kernel paths and the
//! cooperative-matrix support check in [`coop`](super::coop); both are re-exported here.
//!
//! Invariant: after construction no wgpu error reaches wgpu's default uncaptured-error handler
//! (which panics); every submission is wrapped in validation and out-of-memory error scopes,
//! and a lost device is reported by every later call.
//!
//! Where the application's device is probed for its loss (`Context::app_device_lost`, a queue
//! write in an error scope: about 1 us and an error message each): once at the start of each
//! public call (`Context::public_call`), and again only after an error caught in a call (a
//! scope's error, a failed wait or map), to tell a lost device from other errors. The internal
//! steps of a call (allocations, uploads, dispatches, gathers, reads) check the lost flag and
//! poll the device, and probe only when called on their own, outside any public call.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::adapter::find_adapter;
use super::checks::{driver_bounds_buffers, ShaderChecks};
use super::pipeline::PipelineCache;
use super::tuning::Tuning;
use crate::error::{GpuError, Result};

pub use super::adapter::{list_adapters, AdapterChoice, AdapterReport};
pub use super::coop::{coop_supported, KernelPath, LeafOrder, COOP_SUBGROUPS};

/// An open GPU device with its queue, its report and the pipeline cache: pisa's own device
/// ([`Context::new`], [`Context::new_async`]) or the application's ([`Context::from_device`]).
///
/// Cloning is cheap (the state is shared, as `wgpu::Device` is): a [`crate::ops::decode::KvCache`]
/// or a plan keeps a clone, so an engine struct can own the context and its caches side by
/// side. `Send + Sync`: calls from several threads are serialised by wgpu's queue (see
/// `docs/reliability.md`).
#[derive(Clone)]
pub struct Context(Arc<ContextInner>);

/// The shared state behind [`Context`].
#[doc(hidden)]
pub struct ContextInner {
    /// [`Context::id`]: unique for the process's life (not an address, which a later context
    /// may reuse once this one is dropped).
    uid: usize,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) pipelines: PipelineCache,
    report: AdapterReport,
    /// [`Context::loop_limit`], from the adapter's name once.
    loop_limit: Option<u64>,
    features: wgpu::Features,
    /// Whether the adapter has SHADER_F16 (the device may have been opened without it).
    adapter_f16: bool,
    limits: wgpu::Limits,
    /// Set by the device-lost callback, which is installed only on pisa's own device, or, on
    /// the application's device, by [`Context::app_device_lost`].
    lost: Arc<Mutex<Option<String>>>,
    /// A 4-byte buffer for [`Context::app_device_lost`] (pisa's own device is probed too, after
    /// a call caught an error).
    probe: wgpu::Buffer,
    /// Probes run by [`Context::app_device_lost`] ([`Context::device_probes`]).
    probes: AtomicU64,
    /// Set by the uncaptured-error handler, which is installed only on pisa's own device.
    uncaptured: Arc<Mutex<Option<String>>>,
    /// Whether pisa opened the device (and so owns its callbacks).
    owned: bool,
    binding_limit: AtomicU64,
    /// Storage buffers returned by [`Context::recycle`], by byte size, for reuse by the next
    /// call of the same shape (see `buffers.rs`).
    pub(crate) pool: Mutex<super::buffers::BufferPool>,
    coop_props: Vec<wgpu::CooperativeMatrixProperties>,
    coop_ok: bool,
    /// Whether the device has `VK_NV_cooperative_matrix2` (see `nv.rs`).
    nv_ok: bool,
    /// Whether the driver bounds buffer accesses (see `checks.rs`).
    driver_bounds: bool,
    /// The knobs in force ([`Context::tuning`]).
    tuning: Mutex<Tuning>,
    /// Keeps a change of `tuning` out of a running call (see `gate.rs`).
    gate: Arc<super::gate::SettingsGate>,
    pub(crate) nv_pipelines: super::nv::NvPipelines,
}

impl std::ops::Deref for Context {
    type Target = ContextInner;
    fn deref(&self) -> &ContextInner {
        &self.0
    }
}

/// The features pisa uses where the adapter has them, for an application that opens the device
/// itself and hands it to [`Context::from_device`]: `SHADER_F16` (f16 storage; without it f32
/// and bf16 storage run, bf16 needing no feature), `SUBGROUP` (the routing kernels' subgroup variants, and the
/// cooperative-matrix kernels, use it; every kernel is right without it, the portable ones
/// running),
/// `TIMESTAMP_QUERY` (GPU time per stage; without it times read 0), and
/// `EXPERIMENTAL_COOPERATIVE_MATRIX` (the tensor-core kernels; without it the portable kernels
/// run), and `MEMORY_DECORATION_COHERENT` (the decode step as one dispatch,
/// [`crate::Tuning::decode_merge_in_route`]; without it two). Nothing is required: pisa runs
/// on a device with none of them. Request `wanted_features(&adapter)` and the adapter's limits
/// (`adapter.limits()`; the kernels size themselves to the device's limits, and larger storage
/// bindings mean fewer chunks). The
/// experimental feature also needs `wgpu::ExperimentalFeatures::enabled()` in the device
/// descriptor (unsafe in wgpu; the cooperative-matrix shaders are tested against the CPU
/// reference).
pub fn wanted_features(adapter: &wgpu::Adapter) -> wgpu::Features {
    adapter.features() & WANTED
}

/// A device descriptor for an application that opens its own device for pisa
/// ([`Context::from_device`]): the adapter's limits and [`wanted_features`] without the
/// experimental `EXPERIMENTAL_COOPERATIVE_MATRIX`, which needs the application's unsafe
/// opt-in (`wgpu::ExperimentalFeatures::enabled()` in the descriptor, then add the feature:
/// the tensor-core kernels). Without it the portable kernels run. Add the application's own
/// features and a label as needed.
///
/// ```no_run
/// # async fn open() -> Result<(), Box<dyn std::error::Error>> {
/// let instance = pisa_wgpu::instance();
/// let adapter = instance.request_adapter(&Default::default()).await?;
/// let (device, queue) = adapter
///     .request_device(&pisa_wgpu::app_device_descriptor(&adapter))
///     .await?;
/// let ctx = pisa_wgpu::Context::from_device(&adapter, device, queue)?;
/// # Ok(()) }
/// ```
pub fn app_device_descriptor(adapter: &wgpu::Adapter) -> wgpu::DeviceDescriptor<'static> {
    wgpu::DeviceDescriptor {
        required_features: wanted_features(adapter)
            - wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        required_limits: adapter.limits(),
        ..Default::default()
    }
}

const WANTED: wgpu::Features = wgpu::Features::SHADER_F16
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::TIMESTAMP_QUERY)
    .union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    .union(wgpu::Features::MEMORY_DECORATION_COHERENT);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("adapter", &self.report.name)
            .field("owned_device", &self.owned)
            .finish()
    }
}

impl Context {
    /// Opens the adapter `choice` and a device with the adapter's own limits and the optional
    /// features PISA uses ([`wanted_features`]) where present. The experimental feature is
    /// requested only when the adapter has it; the kernel path follows
    /// ([`Context::kernel_path`]). pisa owns this device: it installs the device-lost callback
    /// and an uncaptured-error handler on it. Blocks until the device is open (not on wasm32:
    /// use [`Context::new_async`] there; this returns [`GpuError::Unsupported`]).
    ///
    /// The tuning is the adapter's defaults with the `PISA_*` environment variables applied
    /// ([`Tuning::with_env`]): the one place the library reads them, a convenience for
    /// programs. [`Context::with_tuning`] takes a tuning instead and reads no variable.
    ///
    /// Errors: [`GpuError::NoAdapter`] (none found or none matches), [`GpuError::RequestDevice`],
    /// [`GpuError::Tuning`] (a `PISA_*` variable set to a value its knob does not take),
    /// [`GpuError::Unsupported`] for a device without compute shaders over storage buffers
    /// (WebGL2's limits).
    pub fn new(choice: &AdapterChoice) -> Result<Self> {
        super::block::block_on(Self::new_async(choice))?
    }

    /// [`Context::new`] without blocking (the browser's WebGPU, async apps).
    pub async fn new_async(choice: &AdapterChoice) -> Result<Self> {
        Self::open(choice, None).await
    }

    /// [`Context::new`] with `tuning` (checked, [`Tuning::check`]) instead of the defaults and
    /// the environment. Its `nv_cm2` decides whether the device is opened with
    /// `VK_NV_cooperative_matrix2`, its `shader_checks` the checks every pipeline is built with
    /// (both fixed for the context's life).
    ///
    /// Errors: those of [`Context::new`].
    pub fn with_tuning(choice: &AdapterChoice, tuning: Tuning) -> Result<Self> {
        super::block::block_on(Self::with_tuning_async(choice, tuning))?
    }

    /// [`Context::with_tuning`] without blocking.
    pub async fn with_tuning_async(choice: &AdapterChoice, tuning: Tuning) -> Result<Self> {
        tuning.check()?;
        Self::open(choice, Some(tuning)).await
    }

    /// Opens `choice` with `tuning`, or with the adapter's defaults and the environment.
    async fn open(choice: &AdapterChoice, tuning: Option<Tuning>) -> Result<Self> {
        let adapter = find_adapter(choice).await?;
        let features = wanted_features(&adapter);
        let tuning = match tuning {
            Some(t) => t,
            None => Tuning::for_adapter(&AdapterReport::of(&adapter)).with_env()?,
        };
        // The NVIDIA path (runtime/nv.rs) where the adapter has VK_NV_cooperative_matrix2;
        // `tuning.nv_cm2 = false` (`PISA_NV_CM2=0`) opens the device as everywhere else.
        if tuning.nv_cm2 && super::nv::nv_cm2_supported(&adapter) {
            let desc = wgpu::DeviceDescriptor {
                label: Some("pisa"),
                required_features: features,
                required_limits: adapter.limits(),
                ..Default::default()
            };
            match super::nv::request_device_nv_cm2(&adapter, &desc) {
                Ok((device, queue)) => return Self::build(&adapter, device, queue, true, tuning),
                Err(e) => {
                    log::warn!("VK_NV_cooperative_matrix2 device refused ({e}): opening without it")
                }
            }
        }
        let coop = features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        // SAFETY: the experimental-features token is only handed to wgpu when the adapter
        // reports EXPERIMENTAL_COOPERATIVE_MATRIX, the one experimental feature requested; the
        // cooperative-matrix shaders are tested against the CPU reference (tests/coopmat.rs).
        let experimental = if coop {
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("pisa"),
                required_features: features,
                required_limits: adapter.limits(),
                experimental_features: experimental,
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::RequestDevice(e.to_string()))?;
        Self::build(&adapter, device, queue, true, tuning)
    }

    /// A context on the application's own device and queue (opened from `adapter`, ideally
    /// with [`wanted_features`] and the adapter's limits). pisa never replaces the device's
    /// callbacks: the application's uncaptured-error handler and device-lost callback stay its
    /// own, and errors of pisa's own work come back as [`Result`]s through error scopes. The
    /// kernels use the features and limits the device was opened with (`device.features()`,
    /// `device.limits()`): without SHADER_F16, f32 and bf16 storage run (not f16), without
    /// EXPERIMENTAL_COOPERATIVE_MATRIX the portable kernels run.
    ///
    /// Buffers given to pisa ([`crate::TensorView`]) must be of this device; one of another
    /// device of the same `wgpu::Instance` is a [`GpuError::Validation`] of the call that binds
    /// it, copies into it or reads it back ([`Context::read_bytes`], [`Context::read_async`]).
    /// `queue` must be `device`'s own (the pair `request_device` returned): wgpu gives no way
    /// to tell a queue's device, so a queue of another device is not detected, and the first
    /// write through it (this call's probe of the device, below) is a wgpu error of that other
    /// device, reported to its uncaptured-error handler (wgpu's default handler panics).
    ///
    /// A device lost (or destroyed) after the context is made is the application's to see,
    /// through its own device-lost callback; pisa notices it without one (by a probe of the
    /// device at the start of each of its calls, see [`Context::check_alive`]): its later calls
    /// return [`GpuError::DeviceLost`], as on pisa's own device. Not on wasm32: a browser's
    /// error scopes answer asynchronously, so the probe is off there and a lost device shows
    /// as the error of the call that meets it (a failed readback is [`GpuError::Poll`]); the
    /// application's device-lost callback is what tells. (A call during which the
    /// device is lost may still return `Ok`, a recording call such as a
    /// [`crate::PrefillPlan::run`] or [`crate::KvCache::record_step_into`] in particular: its
    /// commands fail where the application finishes or submits the encoder.)
    ///
    /// The tuning is the adapter's defaults ([`Tuning::for_adapter`]); no environment variable
    /// is read. [`Context::from_device_with_tuning`] takes another.
    ///
    /// Errors: [`GpuError::DeviceLost`] for a device already lost; [`GpuError::Unsupported`]
    /// for a device opened without compute shaders over storage buffers (WebGL2's limits, or
    /// limits of 0).
    ///
    /// ```no_run
    /// # async fn app() -> Result<(), Box<dyn std::error::Error>> {
    /// use pisa_wgpu::{wgpu, Context};
    /// let instance = wgpu::Instance::default();
    /// let adapter = instance.request_adapter(&Default::default()).await?;
    /// let (device, queue) = adapter
    ///     .request_device(&wgpu::DeviceDescriptor {
    ///         required_features: pisa_wgpu::wanted_features(&adapter)
    ///             - wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
    ///         required_limits: adapter.limits(),
    ///         ..Default::default()
    ///     })
    ///     .await?;
    /// let ctx = Context::from_device(&adapter, device.clone(), queue.clone())?;
    /// assert!(!ctx.owns_device());
    /// # Ok(()) }
    /// ```
    pub fn from_device(
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
    ) -> Result<Self> {
        let tuning = Tuning::for_adapter(&AdapterReport::of(adapter));
        Self::build(adapter, device, queue, false, tuning)
    }

    /// [`Context::from_device`] with `tuning` (checked, [`Tuning::check`]); its
    /// `shader_checks` are fixed for the context's life. (Its `nv_cm2` only chooses the
    /// kernels: whether the device has `VK_NV_cooperative_matrix2` is the application's choice,
    /// [`crate::request_device_nv_cm2`].)
    ///
    /// Errors: [`GpuError::Tuning`], and those of [`Context::from_device`].
    pub fn from_device_with_tuning(
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
        tuning: Tuning,
    ) -> Result<Self> {
        tuning.check()?;
        Self::build(adapter, device, queue, false, tuning)
    }

    /// The wgpu device (create the buffers and encoders given to pisa with it; record your own
    /// passes).
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }
    /// The wgpu queue (submit the encoders pisa recorded into with it).
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// The context's identity, shared by its clones and never reused by another context of
    /// the process: tells contexts apart (the plans' arenas, a profiler's context).
    pub(crate) fn id(&self) -> usize {
        self.uid
    }

    /// The last wgpu error that reached pisa's uncaptured-error handler (installed on pisa's own
    /// device only, [`Context::new`]), taken: work outside pisa's operations, or, in the
    /// browser, pisa's own work (see the plans' docs). `None` on an application's device, whose
    /// handler is the application's.
    pub fn take_uncaptured_error(&self) -> Option<String> {
        self.uncaptured
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Whether `self` and `other` are the same context (clones of one another).
    pub fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Whether pisa opened the device ([`Context::new`]) rather than the application
    /// ([`Context::from_device`]).
    pub fn owns_device(&self) -> bool {
        self.owned
    }

    fn build(
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
        owned: bool,
        tuning: Tuning,
    ) -> Result<Self> {
        let features = device.features() & WANTED;
        let limits = device.limits();
        check_compute_limits(&limits)?;
        let coop = features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        let coop_props = if coop {
            adapter.cooperative_matrix_properties()
        } else {
            Vec::new()
        };
        let driver_bounds = driver_bounds_buffers(adapter, &device);
        let checks = ShaderChecks::choose(tuning.shader_checks, driver_bounds);
        let lost = Arc::new(Mutex::new(None));
        let uncaptured = Arc::new(Mutex::new(None));
        if owned {
            Self::install_callbacks(&device, &lost, &uncaptured);
        }
        // (On a device already lost this buffer is invalid; the probe does not mind: the
        // queue checks the device first.)
        let probe = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pisa device-lost probe"),
            size: 4,
            usage: wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut report = AdapterReport::of(adapter);
        let adapter_f16 = report.shader_f16;
        // The feature flags are the device's: an app's device may lack what its adapter offers.
        use wgpu::Features as F;
        report.shader_f16 = features.contains(F::SHADER_F16);
        report.subgroups = features.contains(F::SUBGROUP);
        report.timestamps = features.contains(F::TIMESTAMP_QUERY);
        report.cooperative_matrix = features.contains(F::EXPERIMENTAL_COOPERATIVE_MATRIX);
        report.memory_coherent = features.contains(F::MEMORY_DECORATION_COHERENT);
        let coop_ok = coop_supported(features, &limits, report.subgroup_size, &coop_props);
        let nv_ok = coop_ok && super::nv::device_has_nv_cm2(&device);
        report.nv_cooperative_matrix2 = nv_ok;
        // On by default where the adapter supports them (their reference tests passed on an
        // NVIDIA H200: docs/runs/h200-2026-11-29b-coopmat.txt); `tuning.tensor_cores = false`
        // keeps the portable kernels.
        let coop_on = coop_ok && tuning.tensor_cores;
        log::info!(
            "opened {} ({}, {} {}): kernel path {}{}, shader checks {checks}, subgroup size \
             {}..{}, workgroup memory {} KiB, storage binding {} MiB",
            report.name,
            report.backend,
            report.driver,
            report.driver_info,
            if coop_on { "coopmat" } else { "portable" },
            if nv_ok {
                " + VK_NV_cooperative_matrix2"
            } else {
                ""
            },
            report.subgroup_size.0,
            report.subgroup_size.1,
            limits.max_compute_workgroup_storage_size / 1024,
            limits.max_storage_buffer_binding_size >> 20
        );
        static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let nv_pipelines = super::nv::NvPipelines::new(tuning.shader_override.clone());
        let ctx = Self(Arc::new(ContextInner {
            uid: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            device,
            queue,
            owned,
            pipelines: PipelineCache::new(
                checks,
                tuning.dump_wgsl.clone(),
                tuning.shader_override.clone(),
            ),
            loop_limit: report.name.contains("llvmpipe").then_some(65535),
            report,
            features,
            adapter_f16,
            binding_limit: AtomicU64::new(limits.max_storage_buffer_binding_size),
            limits,
            lost,
            probe,
            probes: AtomicU64::new(0),
            uncaptured,
            coop_props,
            coop_ok,
            pool: Mutex::new(Default::default()),
            nv_ok,
            driver_bounds,
            tuning: Mutex::new(tuning),
            gate: Default::default(),
            nv_pipelines,
        }));
        ctx.check_alive()?;
        Ok(ctx)
    }

    /// The device-lost callback and the uncaptured-error handler of pisa's own device
    /// ([`Context::new`]); never installed on an application's device.
    fn install_callbacks(
        device: &wgpu::Device,
        lost: &Arc<Mutex<Option<String>>>,
        uncaptured: &Arc<Mutex<Option<String>>>,
    ) {
        let l2 = lost.clone();
        // Every reason counts, `Destroyed` included: wgpu reports an explicit
        // `Device::destroy()` with it (at the next poll), and a destroyed device fails every
        // later call just like one lost to a driver reset.
        device.set_device_lost_callback(move |reason, msg| {
            let m = match reason {
                wgpu::DeviceLostReason::Destroyed if msg.is_empty() => {
                    "the device was destroyed (Device::destroy)".to_string()
                }
                _ if msg.is_empty() => format!("{reason:?}"),
                _ => format!("{reason:?}: {msg}"),
            };
            l2.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(m);
        });
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            log::error!("uncaptured wgpu error: {e}");
            *sink.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }));
    }

    /// The tuning knobs in force (see [`Tuning`]): per-device defaults, with `PISA_*` variables
    /// applied for a context of [`Context::new`], and whatever [`Context::set_tuning`] set.
    pub fn tuning(&self) -> Tuning {
        self.tuning_ref().clone()
    }

    /// Sets the tuning knobs for later calls (the results are the same for every setting: see
    /// [`Tuning`]); start from [`Context::tuning`]. A [`crate::PrefillPlan`] made before
    /// refuses to run once a knob it uses changed (make a new one); a
    /// [`crate::VarlenPrefillPlan`] re-plans; a [`crate::KvCache`] keeps the decode knobs it was
    /// made with. The settings are the context's, shared by every thread using it: a change
    /// waits until the calls of this context running on other threads have returned, and calls
    /// that start meanwhile wait for it, so that each call sees one set of settings from start
    /// to end (as [`Context::set_kernel_path`], [`Context::set_leaf_order`],
    /// [`Context::set_nv_cm2`] and [`Context::set_nv_scorer`]).
    ///
    /// Errors: [`GpuError::Tuning`] for a knob out of range ([`Tuning::check`]);
    /// [`GpuError::Unsupported`] for shader checks, a WGSL dump folder or a shader override
    /// folder other than those the context's pipelines are built with (fixed when it is made:
    /// [`Context::with_tuning`]).
    /// Nothing changes on error.
    pub fn set_tuning(&self, tuning: Tuning) -> Result<()> {
        tuning.check()?;
        let asked = ShaderChecks::choose(tuning.shader_checks, self.driver_bounds);
        if asked != self.shader_checks() {
            return Err(GpuError::Unsupported(format!(
                "shader checks are fixed when a context is made (this one: {}, asked: {asked}); make a new context (Context::with_tuning)",
                self.shader_checks()
            )));
        }
        if tuning.dump_wgsl != self.tuning_ref().dump_wgsl {
            return Err(GpuError::Unsupported(format!(
                "the WGSL dump folder is fixed when a context is made (this one: {:?}, asked: {:?}); make a new context (Context::with_tuning)",
                self.tuning_ref().dump_wgsl,
                tuning.dump_wgsl
            )));
        }
        if tuning.shader_override != self.tuning_ref().shader_override {
            return Err(GpuError::Unsupported(format!(
                "the shader override folder is fixed when a context is made (this one: {:?}, asked: {:?}); make a new context (Context::with_tuning)",
                self.tuning_ref().shader_override,
                tuning.shader_override
            )));
        }
        self.change_tuning(|t| *t = tuning);
        Ok(())
    }

    fn tuning_ref(&self) -> std::sync::MutexGuard<'_, Tuning> {
        self.tuning.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the tuning once no public call of this context runs on another thread (see
    /// gate.rs), so that a call sees one set of settings from its start to its end.
    fn change_tuning(&self, f: impl FnOnce(&mut Tuning)) {
        let own_call = IN_CALL.with(|c| c.borrow().contains(&self.id()));
        self.gate.change(own_call, || f(&mut self.tuning_ref()));
    }

    /// The shader runtime checks every pipeline of this context is built with: no checks in
    /// the shader where the driver bounds buffer accesses (Vulkan's robustBufferAccess2), naga's
    /// bounds checks elsewhere, or the context's [`Tuning::shader_checks`] (see
    /// [`super::checks`]).
    pub fn shader_checks(&self) -> ShaderChecks {
        self.pipelines.checks()
    }

    /// The adapter's report (name, backend, driver, limits), its feature flags those of this
    /// context's device (`shader_f16`, `subgroups`, `timestamps`, `cooperative_matrix`,
    /// `memory_coherent`; `nv_cooperative_matrix2` where the device has the extension and the
    /// cooperative matrices pisa's kernels need): a device an app opened may lack what its
    /// adapter offers, so [`AdapterReport::one_dispatch_decode`] of this report is
    /// [`Self::one_dispatch_decode`].
    pub fn report(&self) -> &AdapterReport {
        &self.report
    }
    /// `Err(why)` where this device cannot run the decode step as one dispatch
    /// ([`crate::Tuning::decode_merge_in_route`]; the two-dispatch step runs instead), `why` in
    /// words after the adapter's name: the rule of [`AdapterReport::one_dispatch_decode`] on
    /// [`Self::report`], whose `memory_coherent` is the device's own feature (an app's device
    /// may lack what its adapter offers).
    pub fn one_dispatch_decode(&self) -> std::result::Result<(), &'static str> {
        self.report.one_dispatch_decode()
    }
    /// The most consecutive invocations of a subgroup that the kernels exchange values across
    /// with `subgroupShuffleXor`: [`AdapterReport::shuffle_lanes`].
    pub fn shuffle_lanes(&self) -> u32 {
        self.report.shuffle_lanes()
    }
    /// The most loop iterations a shader invocation may run on this device, where the driver
    /// caps them: `Some(65535)` on Mesa's llvmpipe (lavapipe), whose loop limiter ends every loop
    /// of an invocation once it has run 65535 iterations in all, silently
    /// (`tests/lavapipe_loops.rs`); `None` elsewhere. The portable attention kernel checks its
    /// count against it before recording, and runs smaller query tiles or refuses with
    /// [`crate::GpuError::Limit`] rather than return a wrong result; the routing's portable
    /// table and its subgroup score step are left out past it (their other kernels run).
    pub fn loop_limit(&self) -> Option<u64> {
        self.loop_limit
    }
    /// Features enabled on the device.
    pub fn features(&self) -> wgpu::Features {
        self.features
    }
    /// Limits of the device: the adapter's own for [`Context::new`], the device's for
    /// [`Context::from_device`] (what the application opened it with).
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }
    /// Whether GPU timestamps are available.
    pub fn has_timestamps(&self) -> bool {
        self.features.contains(wgpu::Features::TIMESTAMP_QUERY)
    }
    /// Whether f16 storage is available.
    pub fn has_f16(&self) -> bool {
        self.features.contains(wgpu::Features::SHADER_F16)
    }

    /// The error for f16 storage (of `what`, e.g. " for decode keys", or "") where
    /// [`Context::has_f16`] is false: [`GpuError::Unsupported`], saying whether the adapter
    /// lacks SHADER_F16 or only the device was opened without it.
    pub(crate) fn no_f16(&self, what: &str) -> GpuError {
        let name = &self.report().name;
        GpuError::Unsupported(if self.0.adapter_f16 {
            format!(
                "f16 storage{what} on {name}: the device was opened without SHADER_F16, which \
                 the adapter has (open it with pisa_wgpu::wanted_features(&adapter)), or use f32 \
                 storage"
            )
        } else {
            format!("f16 storage{what} on {name}: the adapter has no SHADER_F16; use f32 storage")
        })
    }

    /// The cooperative-matrix configurations of the adapter (empty without
    /// EXPERIMENTAL_COOPERATIVE_MATRIX).
    pub fn cooperative_matrix_properties(&self) -> &[wgpu::CooperativeMatrixProperties] {
        &self.coop_props
    }

    /// The kernel family in force: [`KernelPath::CoopMat`] when the adapter can run it (see
    /// [`coop_supported`]) unless [`Tuning::tensor_cores`] is off ([`Context::set_kernel_path`]
    /// chose Portable); [`KernelPath::Portable`] otherwise. With
    /// CoopMat, f16-storage attention (sparse and dense) and PISA leaf scoring (selection stage
    /// 2) of a supported shape run on tensor cores, everything else on the portable kernels.
    pub fn kernel_path(&self) -> KernelPath {
        if self.coop_ok && self.tuning_ref().tensor_cores {
            KernelPath::CoopMat
        } else {
            KernelPath::Portable
        }
    }

    /// Chooses the kernel family for later calls (benchmarks compare both on one device) and
    /// returns the one now in force: asking for CoopMat where it is unsupported keeps Portable.
    pub fn set_kernel_path(&self, path: KernelPath) -> KernelPath {
        self.change_tuning(|t| t.tensor_cores = path == KernelPath::CoopMat);
        self.kernel_path()
    }

    /// The order of PISA selection's stage 2 and of block-sparse attention ([`LeafOrder`]):
    /// [`Tuning::leaf_order`] ([`Context::set_leaf_order`]); [`LeafOrder::Auto`] by default
    /// ([`LeafOrder::Leaves`] on a browser's fallback adapter, [`Tuning::for_adapter`]). Every
    /// order gives the same results (selections up to near-ties of f32 rounding, attention
    /// within f32 rounding).
    pub fn leaf_order(&self) -> LeafOrder {
        self.tuning_ref().leaf_order
    }

    /// Chooses the order of selection stage 2 and sparse attention for later calls (tests and benchmarks
    /// compare them on one device). The setting is the context's: it applies to every thread
    /// using this context, from the next call each makes (a plan made before refuses or
    /// re-plans, as for [`Context::set_tuning`], whose waiting for running calls it shares).
    pub fn set_leaf_order(&self, order: LeafOrder) {
        self.change_tuning(|t| t.leaf_order = order);
    }

    /// Largest storage binding the kernels may use, bytes (the device limit unless lowered).
    pub fn max_binding_bytes(&self) -> u64 {
        self.binding_limit
            .load(Ordering::Relaxed)
            .min(self.limits.max_buffer_size)
    }

    /// Lowers the storage-binding limit the operations plan with, in bytes (never above the
    /// device's `max_storage_buffer_binding_size`, never below 256), as
    /// [`Context::max_binding_bytes`] then reports. Plans made afterwards split their work, or
    /// refuse it with [`GpuError::Limit`], against this limit: a way to leave headroom for an
    /// application's own bindings, or to exercise the split paths on small inputs in tests.
    /// A change is a setting of the context as [`Context::set_tuning`]'s are: it waits for
    /// calls running on other threads, and a plan made before refuses to run
    /// ([`GpuError::Unsupported`]) until the limit is back to the one it was made with (a
    /// varlen plan re-plans).
    pub fn set_max_binding_bytes(&self, bytes: u64) {
        let cap = self.limits.max_storage_buffer_binding_size;
        let own_call = IN_CALL.with(|c| c.borrow().contains(&self.id()));
        self.gate.change(own_call, || {
            self.binding_limit
                .store(bytes.min(cap).max(256), Ordering::Relaxed)
        });
    }

    /// Fails with [`GpuError::DeviceLost`] once the device is lost or destroyed.
    ///
    /// wgpu runs the device-lost callback from its maintenance, so a device destroyed since the
    /// last poll is noticed through a non-blocking poll here; the application's device
    /// ([`Context::from_device`]), whose callback is the application's, is probed by a queue
    /// write that only a live device refuses (see `app_device_lost`). Run once at the start of
    /// each public call that records, runs, reads or allocates (`Context::public_call`), and
    /// after an error a call caught; the steps inside a call check only what is known already
    /// (see the module docs). pisa's own device destroyed while its queue still has work is
    /// not seen here until the queue drains (wgpu runs the callback then): a call that records
    /// meanwhile may return `Ok` (its work fails at submit), and a call that catches an error
    /// probes the device and reports the loss.
    pub fn check_alive(&self) -> Result<()> {
        self.alive(true)
    }

    /// [`Context::check_alive`] after a call caught an error, with the probe on pisa's own
    /// device too: wgpu runs its device-lost callback only once the queue is empty, so a device
    /// destroyed with work in flight showed as a `Validation` error of the next call (an
    /// invalid buffer) instead of [`GpuError::DeviceLost`].
    pub(crate) fn check_alive_after_error(&self) -> Result<()> {
        // (`alive(false)`: the probe has run, on either kind of device.)
        self.app_device_lost();
        self.alive(false)
    }

    /// The part of a loop cap (`limit`, [`Context::loop_limit`]) kept free below it by the
    /// kernels whose counts model their loops rather than measure them (the backward pass, the
    /// oracle): a sixteenth. Their refusals report the count with this reserve against the cap.
    pub(crate) fn loop_reserve(limit: u64) -> u64 {
        limit / 16
    }

    /// The error of a `kernel` whose loops would pass the device's cap on an invocation's loop
    /// iterations ([`Context::loop_limit`], `limit`): `needed` iterations, the `result` that
    /// would be wrong, and `hint` what to change. One text for every kernel that checks.
    pub(crate) fn loop_limit_error(
        &self,
        kernel: &str,
        result: &str,
        (needed, limit): (u64, u64),
        hint: &'static str,
    ) -> GpuError {
        GpuError::Limit {
            what: format!(
                "one {kernel} shader invocation on {} (it ends every invocation's loops after \
                 {limit} in all, and the {result} would be wrong)",
                self.report().name
            ),
            needed,
            limit,
            unit: "loop iterations",
            hint,
        }
    }

    /// [`Context::check_alive`] without the probe of the application's device when `probe` is
    /// false: the lost flag, and a non-blocking poll (which runs the device-lost callback of
    /// pisa's own device).
    fn alive(&self, probe: bool) -> Result<()> {
        self.lost_error()?;
        // A failed poll means the device is gone; its callback has then usually run too.
        let polled = self.device.poll(wgpu::PollType::Poll);
        if probe && !self.owned {
            self.app_device_lost();
        }
        self.lost_error()?;
        polled
            .map(|_| ())
            .map_err(|e| GpuError::Poll(e.to_string()))
    }

    /// Starts a public call of pisa's on this context (one that records, runs, reads or
    /// allocates: the plans', the cache's, the reads'), to be kept until the call returns: the
    /// outermost one on this thread runs [`Context::check_alive`], probing the application's
    /// device once for the whole call; one nested in another call of this context (a varlen
    /// run's per-sequence runs, a read inside a host step) checks only the lost flag and
    /// polls. Errors: [`GpuError::DeviceLost`], [`GpuError::Poll`].
    pub(crate) fn public_call(&self) -> Result<PublicCall> {
        let id = self.id();
        if IN_CALL.with(|c| c.borrow().contains(&id)) {
            self.alive(false)?;
            return Ok(PublicCall {
                id: None,
                gate: None,
                _thread: PhantomData,
            });
        }
        self.check_alive()?;
        // The settings stay as they are until the call ends (see gate.rs).
        self.gate.enter();
        IN_CALL.with(|c| c.borrow_mut().push(id));
        Ok(PublicCall {
            id: Some(id),
            gate: Some(self.gate.clone()),
            _thread: PhantomData,
        })
    }

    /// The check at the start of an internal step (an allocation, upload, uniform, dispatch,
    /// gather or scatter): inside a public call (the public API's and the documentation-hidden
    /// stage-level operations' entry points each open one), the lost flag and a poll; called
    /// on its own (internal helpers that tests call directly), the step is a public call of
    /// its own and probes. Errors as
    /// [`Context::check_alive`].
    pub(crate) fn check_step(&self) -> Result<()> {
        self.public_call().map(drop)
    }

    /// How many times [`Context::check_alive`] (or a call that caught an error) probed the
    /// device so far (pisa's own only after a call caught an error). For tests of where the
    /// probe runs.
    #[doc(hidden)]
    pub fn device_probes(&self) -> u64 {
        self.probes.load(Ordering::Relaxed)
    }

    /// Whether the device is lost or destroyed, remembered for every later call once seen;
    /// `false` on wasm32 (whose error scopes resolve later). Run at every public call on the
    /// application's device, and on pisa's own only after a call caught an error
    /// ([`Context::check_alive_after_error`]: its device-lost callback reports the loss once
    /// the queue is empty).
    ///
    /// wgpu gives no error scope an error for a lost device (WebGPU generates none on a lost
    /// device; wgpu drops errors of `wgpu_types::error::ErrorType::DeviceLost`), and wgpu 30 has
    /// no query for it; pisa must not take over the application's device-lost callback. So the
    /// probe asks the queue for a write that a live device always refuses, in a validation
    /// scope: 1 byte at offset 1 of the 4-byte probe buffer (offset and size must be multiples
    /// of 4). A live device reports the validation error; a lost one fails the write on its
    /// device check, before looking at the buffer, and reports nothing. Either way nothing is
    /// allocated or written (`Queue::write_buffer_with` validates before it makes its staging
    /// buffer).
    pub(crate) fn app_device_lost(&self) -> bool {
        if cfg!(target_arch = "wasm32") {
            return false;
        }
        let probe = &self.probe;
        self.probes.fetch_add(1, Ordering::Relaxed);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let refused = self
            .queue
            .write_buffer_with(probe, 1, wgpu::BufferSize::MIN)
            .is_none();
        let reported = matches!(super::block::ready(scope.pop()), Some(Some(_)));
        let lost = refused && !reported;
        if lost {
            self.lost
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| {
                    if self.owned {
                        "the device is lost or destroyed".to_string()
                    } else {
                        "the application's device is lost or destroyed (its device-lost callback \
                         has the reason)"
                            .to_string()
                    }
                });
        }
        lost
    }

    fn lost_error(&self) -> Result<()> {
        if let Some(m) = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(GpuError::DeviceLost(m));
        }
        Ok(())
    }

    /// Runs `f` (which creates resources and submits work) inside validation and out-of-memory
    /// error scopes, waits for the queue, and turns any error into a [`GpuError`] naming `op`:
    /// for an application that records this library's work into its own encoders (for
    /// example [`PrefillPlan::run`](crate::PrefillPlan::run)) and wants a wgpu validation or
    /// out-of-memory error of that work as a `Result` rather than through the device's
    /// uncaptured-error handler. Blocking: it returns once the queue is idle. On wasm32 (the
    /// browser, where blocking is not allowed) it is refused before `f` runs: there, push and
    /// pop the device's error scopes asynchronously.
    ///
    /// # Errors
    /// `f`'s own error; [`GpuError::Validation`] for a validation error, [`GpuError::OutOfMemory`]
    /// for an allocation failure raised inside the scopes; [`GpuError::DeviceLost`] when the
    /// device is lost; [`GpuError::Unsupported`] on wasm32.
    pub fn scoped<T>(&self, op: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        super::block::refuse_on_wasm("Context::scoped")?;
        self.check_step()?;
        // (wgpu's error scopes are per thread: the scopes below catch this call's errors, and
        // the uncaptured-error slot, which holds errors of work outside any scope, on any
        // thread, is left to `take_uncaptured_error`: reading it here reported another
        // thread's error as this call's, and took it from its owner.)
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let wait = self.wait();
        let v = super::block::block_on(val.pop())?;
        let o = super::block::block_on(oom.pop())?;
        // A caught error or a failed wait may be a lost device: probe it then (as `scope_now`).
        if v.is_some() || o.is_some() || wait.is_err() {
            self.check_alive_after_error()?;
        } else {
            self.check_step()?;
        }
        scope_errors(op, v, o)?;
        wait?;
        out
    }

    /// Runs `f` (which creates resources or records commands, submitting nothing) inside
    /// validation and out-of-memory error scopes and returns what they caught as a
    /// [`GpuError`] naming `op`, without waiting for the GPU: wgpu reports these errors when the
    /// resource is created, so the scopes are ready at once on native backends. On wasm32 (the
    /// browser's WebGPU, whose scopes resolve later) no scope is pushed: an error goes to the
    /// device's uncaptured-error handler (the application's, or for pisa's own device the one
    /// [`Context::take_uncaptured_error`] reads). Used on the hot paths of plans.
    pub(crate) fn scope_now<T>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if cfg!(target_arch = "wasm32") {
            return f();
        }
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let v = super::block::ready(val.pop()).flatten();
        let o = super::block::ready(oom.pop()).flatten();
        // A lost device shows as validation errors about invalid objects (those created since
        // the loss; on pisa's own device too while its queue has work): probe it, only then.
        if (v.is_some() || o.is_some()) && self.app_device_lost() {
            self.lost_error()?;
        }
        scope_errors(op, v, o)?;
        out
    }

    /// Blocks until all submitted work finished. Errors: [`GpuError::DeviceLost`] when the
    /// device is lost or destroyed, [`GpuError::Poll`] for another failed wait.
    pub fn wait(&self) -> Result<()> {
        super::block::refuse_on_wasm("Context::wait")?;
        let r = self.device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: None,
        });
        self.lost_error()?;
        r.map(|_| ()).map_err(|e| GpuError::Poll(e.to_string()))
    }
}

thread_local! {
    /// The contexts (by `Context::id`) in a public call on this thread, whose device that
    /// call checked at its start ([`Context::public_call`]).
    static IN_CALL: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// A public call of pisa's in progress on this thread ([`Context::public_call`]), ended when
/// dropped. Not `Send`: the mark is the thread's.
#[must_use = "the call ends when this is dropped"]
pub(crate) struct PublicCall {
    /// The context this call marked; `None` for a call nested in another of the same context.
    id: Option<usize>,
    /// The context's settings gate, entered by an outermost call (left when it ends).
    gate: Option<Arc<super::gate::SettingsGate>>,
    _thread: PhantomData<*const ()>,
}

impl Drop for PublicCall {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            IN_CALL.with(|c| {
                let mut c = c.borrow_mut();
                if let Some(i) = c.iter().rposition(|&x| x == id) {
                    c.remove(i);
                }
            });
        }
        if let Some(gate) = &self.gate {
            gate.leave();
        }
    }
}

impl Context {
    /// Whether the NVIDIA cooperative-matrix-2 kernels run (runtime/nv.rs): the device has
    /// `VK_NV_cooperative_matrix2` ([`crate::request_device_nv_cm2`]), the tensor-core path is
    /// on ([`Context::kernel_path`] is [`KernelPath::CoopMat`]) and
    /// [`Context::set_nv_cm2`] did not turn them off.
    pub fn nv_cm2(&self) -> bool {
        let t = self.tuning();
        self.nv_ok && t.nv_cm2 && t.tensor_cores && self.coop_ok
    }

    /// Turns the NVIDIA kernels on or off (on by default where the device has the
    /// extension); returns whether they run now. A [`crate::PrefillPlan`] made before refuses
    /// to run after a change (make a new one); a [`crate::VarlenPrefillPlan`] re-plans.
    pub fn set_nv_cm2(&self, on: bool) -> bool {
        self.change_tuning(|t| t.nv_cm2 = on);
        self.nv_cm2()
    }

    /// Whether selection stage 2 scores leaves with the NVIDIA scorer
    /// (`shaders/nv/leaf_score.comp`) where [`Context::nv_cm2`] holds ([`Tuning::nv_scorer`];
    /// on by default: faster than the WGSL tensor-core scorer on the H200, 83.8 against
    /// 116.4 ms at 256K tokens when it came, 2026-12-01; 43.8 ms since A.57 of
    /// docs/benchmarks.md).
    pub fn nv_scorer(&self) -> bool {
        self.tuning_ref().nv_scorer
    }

    /// Turns the NVIDIA scorer on or off (see [`Context::nv_scorer`]).
    pub fn set_nv_scorer(&self, on: bool) {
        self.change_tuning(|t| t.nv_scorer = on);
    }

    /// The pipeline and bind group layout of an NVIDIA kernel (built once).
    pub(crate) fn nv_pipeline(
        &self,
        k: &super::nv::NvKernel,
    ) -> Result<(Arc<wgpu::ComputePipeline>, wgpu::BindGroupLayout)> {
        if !self.nv_ok {
            return Err(GpuError::Unsupported(format!(
                "NVIDIA kernel {}: the device has no VK_NV_cooperative_matrix2",
                k.name
            )));
        }
        self.nv_pipelines.get(&self.device, k)
    }

    /// Whether NVIDIA kernel `k` runs on this context: [`Context::nv_cm2`] holds and the
    /// driver built it (built on the first ask; a refusal is kept, and the operations then run
    /// their WGSL kernels).
    pub(crate) fn nv_kernel_ok(&self, k: &super::nv::NvKernel) -> bool {
        self.nv_cm2() && self.nv_pipeline(k).is_ok()
    }

    /// The kernel named `name` of `list` where it runs on this context
    /// ([`Context::nv_kernel_ok`]), else `None`.
    pub(crate) fn nv_kernel_named(
        &self,
        list: &[super::nv::NvKernel],
        name: &str,
    ) -> Option<super::nv::NvKernel> {
        list.iter()
            .find(|k| k.name == name)
            .filter(|k| self.nv_kernel_ok(k))
            .copied()
    }

    /// Builds an NVIDIA kernel's pipeline (tests: every embedded kernel builds).
    #[doc(hidden)]
    pub fn nv_pipeline_for_tests(&self, k: &super::nv::NvKernel) -> Result<()> {
        self.nv_pipeline(k).map(|_| ())
    }

    /// The compute pipeline of entry point `entry` of `shader` for `storage`, its `const`
    /// lines of `consts` substituted ([`super::pipeline::preprocess`]), built once per context
    /// exactly as the library's own kernels are: the runtime checks of
    /// [`Context::shader_checks`], the [`Tuning::dump_wgsl`] dump and the
    /// [`Tuning::shader_override`] files. For kernels kept outside
    /// the library (benchmarks, tests). Errors: a constant the shader does not declare.
    #[doc(hidden)]
    pub fn pipeline(
        &self,
        shader: &super::pipeline::ShaderSource,
        entry: &'static str,
        storage: super::pipeline::Storage,
        consts: &[(&str, u32)],
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        self.pipelines
            .get(&self.device, shader, entry, storage, consts, &[])
    }
}

/// What a validation scope (`v`) and an out-of-memory scope (`o`) caught around `op`, as a
/// [`GpuError`] (out of memory first).
fn scope_errors(op: &'static str, v: Option<wgpu::Error>, o: Option<wgpu::Error>) -> Result<()> {
    if let Some(e) = o {
        return Err(GpuError::OutOfMemory {
            op,
            message: e.to_string(),
        });
    }
    if let Some(e) = v {
        return Err(GpuError::Validation {
            op,
            message: e.to_string(),
        });
    }
    Ok(())
}

/// Refuses a device that can run no compute shader over storage buffers (wgpu's WebGL2
/// downlevel limits, `wgpu::Limits::downlevel_webgl2_defaults`, have none): every pisa kernel is
/// one, and without this check the first plan would fail with a `Limit` of 0 bytes. Devices
/// with fewer storage buffers per stage than a kernel binds are refused per kernel, when its
/// pipeline is built (`pipeline::check_bindings`).
fn check_compute_limits(limits: &wgpu::Limits) -> Result<()> {
    let l = limits;
    if l.max_storage_buffers_per_shader_stage == 0
        || l.max_storage_buffer_binding_size == 0
        || l.max_compute_invocations_per_workgroup == 0
        || l.max_compute_workgroups_per_dimension == 0
    {
        return Err(GpuError::Unsupported(format!(
            "a device without compute shaders over storage buffers (its limits: \
             max_storage_buffers_per_shader_stage {}, max_storage_buffer_binding_size {}, \
             max_compute_invocations_per_workgroup {}, max_compute_workgroups_per_dimension {}); \
             pisa's kernels are compute shaders: open the device with the adapter's limits \
             (WebGL2 has no compute shaders; WebGPU and native backends do)",
            l.max_storage_buffers_per_shader_stage,
            l.max_storage_buffer_binding_size,
            l.max_compute_invocations_per_workgroup,
            l.max_compute_workgroups_per_dimension
        )));
    }
    Ok(())
}
