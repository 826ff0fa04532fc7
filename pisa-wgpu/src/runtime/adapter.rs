//! Adapters: which one to open ([`AdapterChoice`]), what each can do ([`AdapterReport`],
//! [`list_adapters`], printed by `pisa info`), and the lookup [`Context::new`] opens.
//!
//! [`Context::new`]: super::context::Context::new

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
    /// `VK_NV_cooperative_matrix2` with the features pisa's NVIDIA kernels use
    /// ([`crate::nv_cm2_supported`]).
    pub nv_cooperative_matrix2: bool,
    /// MEMORY_DECORATION_COHERENT (`@coherent` storage: the decode step as one dispatch,
    /// [`crate::Tuning::decode_merge_in_route`]).
    pub memory_coherent: bool,
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
    /// The most consecutive invocations of a subgroup that pisa's kernels exchange values
    /// across with `subgroupShuffleXor` (the routing's score step and the decode route's level
    /// steps plan their lanes within it): the smallest subgroup size, except on Mesa's llvmpipe
    /// (lavapipe), where it is at most 16. llvmpipe's `subgroupShuffleXor` returns wrong values
    /// for masks of 16 and above, in the subgroups of 32 and 64 invocations it makes with
    /// `LP_NATIVE_VECTOR_WIDTH` 1024 and 2048 (Mesa 22.3, LLVM 15; found by
    /// `tests/select_route.rs` at GQA group 16, whose query spans 32 lanes there; probed in
    /// `tests/subgroup_shuffle.rs`). Kernels planned for 16 lanes are right in larger subgroups.
    pub fn shuffle_lanes(&self) -> u32 {
        let sg = self.subgroup_size.0;
        if self.name.contains("llvmpipe") {
            sg.min(16)
        } else {
            sg
        }
    }

    /// `Err(why)` where a device of this adapter cannot run the decode step as one dispatch
    /// ([`crate::Tuning::decode_merge_in_route`]), `why` in words after the adapter's name. The
    /// rule: Vulkan and [`Self::memory_coherent`] (the adapter's feature here; the device's in
    /// a context's report, [`crate::Context::report`]). The last workgroup's view of the other
    /// workgroups' block states rests on SPIR-V's device-scope barriers and `Coherent`
    /// decoration; naga's Metal and HLSL barriers order one workgroup's memory only. (The
    /// plan's workgroup memory and storage bindings, which every such adapter has, are checked
    /// per cache.)
    pub fn one_dispatch_decode(&self) -> std::result::Result<(), &'static str> {
        if self.backend != format!("{:?}", wgpu::Backend::Vulkan) {
            return Err("is not a Vulkan adapter");
        }
        self.memory_coherent
            .then_some(())
            .ok_or("has no MEMORY_DECORATION_COHERENT")
    }

    /// The report of `adapter` (its own features and limits, before a device is opened).
    pub(super) fn of(adapter: &wgpu::Adapter) -> Self {
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
            nv_cooperative_matrix2: super::nv::nv_cm2_supported(adapter),
            memory_coherent: f.contains(wgpu::Features::MEMORY_DECORATION_COHERENT),
            max_storage_binding: l.max_storage_buffer_binding_size,
            max_buffer: l.max_buffer_size,
            workgroup_memory: l.max_compute_workgroup_storage_size,
            max_workgroups_per_dim: l.max_compute_workgroups_per_dimension,
            max_invocations: l.max_compute_invocations_per_workgroup,
        }
    }
}

/// The wgpu instance every context pisa opens itself ([`Context::new`](crate::Context::new)) is made on, made once
/// per process: the backends named by `WGPU_BACKEND`, else the primary ones. (With the GL
/// backend each context gets an instance of its own instead: see `find_adapter`.) wgpu's resource
/// ids belong to an instance, so buffers of one instance cannot be used on a device of another;
/// an application that opens its own devices on this instance (or hands its device to
/// [`Context::from_device`](super::context::Context::from_device)) never mixes them.
pub fn instance() -> wgpu::Instance {
    static INSTANCE: std::sync::OnceLock<wgpu::Instance> = std::sync::OnceLock::new();
    INSTANCE.get_or_init(new_instance).clone()
}

/// A new wgpu instance of the backends named by `WGPU_BACKEND`, else the primary ones.
fn new_instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    if wgpu::Backends::from_env().is_none() {
        desc.backends = wgpu::Backends::PRIMARY;
    }
    wgpu::Instance::new(desc)
}

/// Every adapter wgpu finds (the primary backends, or those named by `WGPU_BACKEND`). Blocks;
/// on wasm32 it returns an empty list: use [`list_adapters_async`] there.
pub fn list_adapters() -> Vec<AdapterReport> {
    super::block::block_on(list_adapters_async()).unwrap_or_default()
}

/// [`list_adapters`] without blocking.
pub async fn list_adapters_async() -> Vec<AdapterReport> {
    instance()
        .enumerate_adapters(wgpu::Backends::all())
        .await
        .iter()
        .map(AdapterReport::of)
        .collect()
}

/// How to get an adapter where there is none: the text [`crate::GpuError::NoAdapter`] ends
/// with when no adapter was found (for a tool that finds none itself).
pub const INSTALL_HINT: &str = ": install a Vulkan/Metal/DX12 driver, or Mesa's lavapipe CPU Vulkan driver (Debian/Ubuntu: apt-get install -y mesa-vulkan-drivers)";

/// The adapter `choice` names: for [`AdapterChoice::HighPerformance`] wgpu's high-performance
/// pick, else the first adapter found. Errors: [`GpuError::NoAdapter`] (none found or none
/// matches).
pub(super) async fn find_adapter(choice: &AdapterChoice) -> Result<wgpu::Adapter> {
    // wgpu-hal's GL backend keeps ONE EGL context per instance, shared by every device opened on
    // it, each behind its own lock: two devices of one instance used from two threads at once
    // make eglMakeCurrent fail (EGL_BAD_ACCESS, a panic inside wgpu-hal 30's gles/egl.rs). So
    // with the GL backend every context pisa opens gets an instance (and EGL context) of its
    // own.
    let gl = wgpu::Backends::from_env().is_some_and(|b| b.contains(wgpu::Backends::GL));
    let inst = if gl { new_instance() } else { instance() };
    let adapters = inst.enumerate_adapters(wgpu::Backends::all()).await;
    let found: Vec<String> = (adapters.iter().enumerate())
        .map(|(i, a)| format!("[{i}] {}", a.get_info().name))
        .collect();
    let adapter = match choice {
        AdapterChoice::HighPerformance => {
            let best = inst
                .request_adapter(&wgpu::RequestAdapterOptions {
                    power_preference: wgpu::PowerPreference::HighPerformance,
                    ..Default::default()
                })
                .await;
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
    adapter.ok_or_else(|| {
        let asked = match choice {
            AdapterChoice::HighPerformance => String::new(),
            AdapterChoice::Name(n) => format!(" matching {n:?}"),
            AdapterChoice::Index(i) => format!(" at index {i}"),
        };
        GpuError::NoAdapter(if found.is_empty() {
            format!("{asked}{INSTALL_HINT}")
        } else {
            format!("{asked}; adapters found: {}", found.join(", "))
        })
    })
}
