//! The GPU context: adapter choice, device with the adapter's own limits, optional features,
//! and the conversion of wgpu's error channels (error scopes, the uncaptured-error handler, the
//! device-lost callback) into [`GpuError`] results.
//!
//! Invariant: after construction no wgpu error reaches wgpu's default uncaptured-error handler
//! (which panics); every submission is wrapped in validation and out-of-memory error scopes,
//! and a lost device is reported by every later call.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::pipeline::PipelineCache;
use crate::error::{GpuError, Result};

/// Which adapter to open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AdapterChoice {
    /// The highest-performance adapter wgpu finds (discrete GPU first).
    #[default]
    HighPerformance,
    /// The first adapter whose name contains this text (case-insensitive).
    Name(String),
    /// The adapter at this index of [`list_adapters`].
    Index(usize),
}

/// What an adapter is and can do, as far as PISA cares (printed by `pisa info`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AdapterReport {
    /// Adapter name, e.g. "NVIDIA H200" or "llvmpipe (LLVM 15.0.6, 256 bits)".
    pub name: String,
    /// PCI vendor id.
    pub vendor: u32,
    /// PCI device id.
    pub device: u32,
    /// Backend: Vulkan, Metal, Dx12, Gl.
    pub backend: String,
    /// Device type: DiscreteGpu, IntegratedGpu, Cpu, ...
    pub device_type: String,
    /// Driver name.
    pub driver: String,
    /// Driver version / info string.
    pub driver_info: String,
    /// SHADER_F16: f16 storage and arithmetic in shaders.
    pub shader_f16: bool,
    /// SUBGROUP operations.
    pub subgroups: bool,
    /// Smallest and largest subgroup size the adapter reports.
    pub subgroup_size: (u32, u32),
    /// TIMESTAMP_QUERY: GPU time per stage.
    pub timestamps: bool,
    /// EXPERIMENTAL_COOPERATIVE_MATRIX (tensor cores from WGSL).
    pub cooperative_matrix: bool,
    /// Largest storage buffer binding, bytes.
    pub max_storage_binding: u64,
    /// Largest buffer, bytes.
    pub max_buffer: u64,
    /// Workgroup (shared) memory per workgroup, bytes.
    pub workgroup_memory: u32,
    /// Workgroups per grid dimension.
    pub max_workgroups_per_dim: u32,
    /// Invocations per workgroup.
    pub max_invocations: u32,
}

impl AdapterReport {
    fn of(adapter: &wgpu::Adapter) -> Self {
        let i = adapter.get_info();
        let f = adapter.features();
        let l = adapter.limits();
        Self {
            name: i.name.clone(),
            vendor: i.vendor,
            device: i.device,
            backend: format!("{:?}", i.backend),
            device_type: format!("{:?}", i.device_type),
            driver: i.driver.clone(),
            driver_info: i.driver_info.clone(),
            shader_f16: f.contains(wgpu::Features::SHADER_F16),
            subgroups: f.contains(wgpu::Features::SUBGROUP),
            subgroup_size: (i.subgroup_min_size, i.subgroup_max_size),
            timestamps: f.contains(wgpu::Features::TIMESTAMP_QUERY),
            cooperative_matrix: f.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX),
            max_storage_binding: l.max_storage_buffer_binding_size as u64,
            max_buffer: l.max_buffer_size,
            workgroup_memory: l.max_compute_workgroup_storage_size,
            max_workgroups_per_dim: l.max_compute_workgroups_per_dimension,
            max_invocations: l.max_compute_invocations_per_workgroup,
        }
    }
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    if wgpu::Backends::from_env().is_none() {
        desc.backends = wgpu::Backends::PRIMARY;
    }
    wgpu::Instance::new(desc)
}

/// Every adapter wgpu finds (the primary backends, or those named by `WGPU_BACKEND`).
pub fn list_adapters() -> Vec<AdapterReport> {
    let inst = instance();
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
        .iter()
        .map(AdapterReport::of)
        .collect()
}

/// Which family of attention kernels a context runs (chosen at [`Context::new`] from the
/// adapter's features; see [`Context::kernel_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum KernelPath {
    /// The portable WGSL kernels (any adapter, lavapipe included).
    Portable,
    /// Tensor cores through WGSL cooperative matrices (`coop_mat16x16`, f16 inputs, f32
    /// accumulators) for f16-storage attention; everything else stays portable.
    CoopMat,
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KernelPath::Portable => "portable",
            KernelPath::CoopMat => "coopmat",
        })
    }
}

/// Subgroups per workgroup of the cooperative-matrix kernels.
pub const COOP_SUBGROUPS: u32 = 4;

/// Whether a device with these features, limits, subgroup sizes and cooperative-matrix
/// configurations can run the cooperative-matrix kernels: EXPERIMENTAL_COOPERATIVE_MATRIX,
/// SHADER_F16 and SUBGROUP enabled, a 16x16x16 configuration with f16 inputs and f32
/// accumulators, one fixed subgroup size (min = max, 4..=64, so the workgroup's subgroup count
/// is known), [`COOP_SUBGROUPS`] subgroups per workgroup within the invocation limit, and at
/// least 16 KiB of workgroup memory.
pub fn coop_supported(
    features: wgpu::Features,
    limits: &wgpu::Limits,
    subgroup_size: (u32, u32),
    props: &[wgpu::CooperativeMatrixProperties],
) -> bool {
    let need = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP;
    let f16_f32 = props.iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    let (lo, hi) = subgroup_size;
    features.contains(need)
        && f16_f32
        && lo == hi
        && (4..=64).contains(&lo)
        && lo * COOP_SUBGROUPS <= limits.max_compute_invocations_per_workgroup
        && lo * COOP_SUBGROUPS <= limits.max_compute_workgroup_size_x
        && limits.max_compute_workgroup_storage_size >= 16 * 1024
}

/// An open GPU device with its queue, its report and the pipeline cache. `Send + Sync`: calls
/// from several threads are serialised by wgpu's queue (see `docs/reliability.md`).
pub struct Context {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) pipelines: PipelineCache,
    report: AdapterReport,
    features: wgpu::Features,
    limits: wgpu::Limits,
    lost: Arc<Mutex<Option<String>>>,
    uncaptured: Arc<Mutex<Option<String>>>,
    binding_limit: AtomicU64,
    /// Storage buffers returned by [`Context::recycle`], by byte size, for reuse by the next
    /// call of the same shape (see `buffers.rs`).
    pub(crate) pool: Mutex<super::buffers::BufferPool>,
    coop_props: Vec<wgpu::CooperativeMatrixProperties>,
    coop_ok: bool,
    coop_on: AtomicBool,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("adapter", &self.report.name)
            .finish()
    }
}

impl Context {
    /// Opens the adapter `choice` and a device with the adapter's own limits and the optional
    /// features PISA uses (SHADER_F16, SUBGROUP, TIMESTAMP_QUERY, and the experimental
    /// EXPERIMENTAL_COOPERATIVE_MATRIX) where present. The experimental feature is requested
    /// only when the adapter has it; the kernel path follows ([`Context::kernel_path`]).
    ///
    /// Errors: [`GpuError::NoAdapter`] (none found or none matches), [`GpuError::RequestDevice`].
    pub fn new(choice: &AdapterChoice) -> Result<Self> {
        let inst = instance();
        let adapters = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()));
        let adapter = match choice {
            AdapterChoice::HighPerformance => {
                let best = pollster::block_on(inst.request_adapter(&wgpu::RequestAdapterOptions {
                    power_preference: wgpu::PowerPreference::HighPerformance,
                    ..Default::default()
                }));
                best.ok().or_else(|| adapters.into_iter().next())
            }
            AdapterChoice::Name(n) => {
                let n = n.to_lowercase();
                adapters
                    .into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&n))
            }
            AdapterChoice::Index(i) => adapters.into_iter().nth(*i),
        };
        let adapter = adapter.ok_or_else(|| {
            GpuError::NoAdapter(match choice {
                AdapterChoice::HighPerformance => String::new(),
                AdapterChoice::Name(n) => format!(" matching {n:?} (see `pisa info`)"),
                AdapterChoice::Index(i) => format!(" at index {i} (see `pisa info`)"),
            })
        })?;
        Self::from_adapter(adapter)
    }

    fn from_adapter(adapter: wgpu::Adapter) -> Result<Self> {
        let wanted = wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        let features = adapter.features() & wanted;
        let limits = adapter.limits();
        let coop = features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        // SAFETY: the experimental-features token is only handed to wgpu when the adapter
        // reports EXPERIMENTAL_COOPERATIVE_MATRIX, the one experimental feature requested; the
        // cooperative-matrix shaders are tested against the CPU reference (tests/coopmat.rs).
        let experimental = if coop {
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("pisa"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: experimental,
            ..Default::default()
        }))
        .map_err(|e| GpuError::RequestDevice(e.to_string()))?;
        let coop_props = if coop {
            adapter.cooperative_matrix_properties()
        } else {
            Vec::new()
        };
        let lost = Arc::new(Mutex::new(None));
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
        let uncaptured = Arc::new(Mutex::new(None));
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            log::error!("uncaptured wgpu error: {e}");
            *sink.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }));
        let mut report = AdapterReport::of(&adapter);
        report.shader_f16 = features.contains(wgpu::Features::SHADER_F16);
        let coop_ok = coop_supported(features, &limits, report.subgroup_size, &coop_props);
        // On by default where the adapter supports them (their reference tests passed on an
        // NVIDIA H200: docs/runs/h200-2026-11-29b-coopmat.txt); `PISA_KERNEL_PATH=portable` or
        // `set_kernel_path` keeps the portable kernels.
        let coop_on = coop_ok && std::env::var("PISA_KERNEL_PATH").as_deref() != Ok("portable");
        Ok(Self {
            device,
            queue,
            pipelines: PipelineCache::default(),
            report,
            features,
            binding_limit: AtomicU64::new(limits.max_storage_buffer_binding_size as u64),
            limits,
            lost,
            uncaptured,
            coop_props,
            coop_ok,
            coop_on: AtomicBool::new(coop_on),
            pool: Mutex::new(Default::default()),
        })
    }

    /// The adapter's report (name, backend, driver, features, limits).
    pub fn report(&self) -> &AdapterReport {
        &self.report
    }
    /// Features enabled on the device.
    pub fn features(&self) -> wgpu::Features {
        self.features
    }
    /// Limits of the device (the adapter's own).
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

    /// The cooperative-matrix configurations of the adapter (empty without
    /// EXPERIMENTAL_COOPERATIVE_MATRIX).
    pub fn cooperative_matrix_properties(&self) -> &[wgpu::CooperativeMatrixProperties] {
        &self.coop_props
    }

    /// The kernel family in force: [`KernelPath::CoopMat`] when the adapter can run it (see
    /// [`coop_supported`]) unless `PISA_KERNEL_PATH=portable` was set at [`Context::new`] or
    /// [`Context::set_kernel_path`] chose Portable; [`KernelPath::Portable`] otherwise. With
    /// CoopMat, f16-storage attention (sparse and dense) and PISA leaf scoring (selection stage
    /// 2) of a supported shape run on tensor cores, everything else on the portable kernels.
    pub fn kernel_path(&self) -> KernelPath {
        if self.coop_on.load(Ordering::Relaxed) {
            KernelPath::CoopMat
        } else {
            KernelPath::Portable
        }
    }

    /// Chooses the kernel family for later calls (benchmarks compare both on one device) and
    /// returns the one now in force: asking for CoopMat where it is unsupported keeps Portable.
    pub fn set_kernel_path(&self, path: KernelPath) -> KernelPath {
        self.coop_on.store(
            path == KernelPath::CoopMat && self.coop_ok,
            Ordering::Relaxed,
        );
        self.kernel_path()
    }

    /// Largest storage binding the kernels may use, bytes (the device limit unless lowered).
    pub fn max_binding_bytes(&self) -> u64 {
        self.binding_limit
            .load(Ordering::Relaxed)
            .min(self.limits.max_buffer_size)
    }

    /// Lowers the storage-binding limit the operations plan with (never raises it above the
    /// device's). Used by tests to exercise the split paths on small inputs.
    pub fn set_max_binding_bytes(&self, bytes: u64) {
        let cap = self.limits.max_storage_buffer_binding_size as u64;
        self.binding_limit
            .store(bytes.min(cap).max(256), Ordering::Relaxed);
    }

    /// Fails with [`GpuError::DeviceLost`] once the device is lost or destroyed.
    ///
    /// wgpu runs the device-lost callback from its maintenance, so a device destroyed since the
    /// last poll is noticed through a non-blocking poll here. Called at the start of every
    /// entry point that creates or reads GPU resources ([`Context::upload`], [`Context::alloc`],
    /// [`Context::uniform`], [`Context::read_bytes`], [`Context::dispatch`],
    /// [`Context::scoped`]).
    pub fn check_alive(&self) -> Result<()> {
        self.lost_error()?;
        // A failed poll means the device is gone; its callback has then usually run too.
        let polled = self.device.poll(wgpu::PollType::Poll);
        self.lost_error()?;
        polled
            .map(|_| ())
            .map_err(|e| GpuError::Poll(e.to_string()))
    }

    fn lost_error(&self) -> Result<()> {
        if let Some(m) = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(GpuError::DeviceLost(m));
        }
        Ok(())
    }

    /// Runs `f` (which creates resources and submits work) inside validation and out-of-memory
    /// error scopes, waits for the queue, and turns any error into a [`GpuError`] naming `op`.
    pub fn scoped<T>(&self, op: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.check_alive()?;
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let wait = self.wait();
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        self.check_alive()?;
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
        if let Some(m) = self
            .uncaptured
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return Err(GpuError::Validation { op, message: m });
        }
        wait?;
        out
    }

    /// Blocks until all submitted work finished. Errors: [`GpuError::DeviceLost`] when the
    /// device is lost or destroyed, [`GpuError::Poll`] for another failed wait.
    pub fn wait(&self) -> Result<()> {
        let r = self.device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: None,
        });
        self.lost_error()?;
        r.map(|_| ()).map_err(|e| GpuError::Poll(e.to_string()))
    }
}

impl Context {
    /// The wgpu device (for callers that record their own passes).
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }
    /// The wgpu queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }
}
