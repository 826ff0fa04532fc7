//! The NVIDIA fast path: kernels written in GLSL with `GL_NV_cooperative_matrix2`
//! (`shaders/nv/*.comp`, built into SPIR-V by `tools/spirv` and embedded from
//! `shaders/nv/spv/`), loaded as passthrough SPIR-V (`wgpu::Features::PASSTHROUGH_SHADERS`) on a
//! Vulkan device opened with `VK_NV_cooperative_matrix2`.
//!
//! WGSL cannot express what this extension gives (workgroup-scope matrices that the driver
//! stages through shared memory itself, tensor-addressed loads with clamping, row reductions
//! and per-element operations on accumulators), so the path is chosen at run time: a context
//! runs these kernels only where [`device_has_nv_cm2`] holds, and the WGSL kernels stay the
//! path everywhere else (and are tested there).
//!
//! How a device gets the extension: wgpu does not enable it by itself, so pisa opens the device
//! through wgpu-hal ([`request_device_nv_cm2`]: `Adapter::open_with_callback` adds the
//! extension and its feature structure to `vkCreateDevice`, then
//! `Adapter::create_device_from_hal`). [`crate::Context::new`] does that where
//! [`nv_cm2_supported`] holds; an application that opens its own device calls
//! [`request_device_nv_cm2`] instead of `Adapter::request_device` to get the same.
//!
//! Invariants of the passthrough modules (wgpu validates nothing in them): every kernel names
//! its bindings in [`NvKernel::bindings`] (set 0, in order), its workgroup size is fixed in the
//! SPIR-V, and its sources are the only input of its SPIR-V (`tools/spirv --check` in CI).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{GpuError, Result};

/// `VK_NV_cooperative_matrix2`.
pub const NV_COOPERATIVE_MATRIX_2: &std::ffi::CStr = c"VK_NV_cooperative_matrix2";

/// What one binding of an NVIDIA kernel is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvBinding {
    /// A read-only storage buffer.
    Read,
    /// A read-write storage buffer.
    Write,
    /// A uniform buffer.
    Uniform,
}

/// One embedded NVIDIA kernel: its SPIR-V (`shaders/nv/spv/<name>.spv`) and bindings.
#[derive(Debug, Clone, Copy)]
pub struct NvKernel {
    /// The variant's name in `shaders/nv/kernels.txt`.
    pub name: &'static str,
    /// The SPIR-V bytes (little-endian words).
    pub spirv: &'static [u8],
    /// The bindings of set 0: (binding index, kind).
    pub bindings: &'static [(u32, NvBinding)],
}

impl NvKernel {
    /// The SPIR-V as words. Errors: a message when the bytes are not a SPIR-V module (length,
    /// magic number).
    pub fn words(&self) -> std::result::Result<Vec<u32>, String> {
        spirv_words(self.spirv).ok_or_else(|| {
            format!(
                "NVIDIA kernel {}: the embedded SPIR-V is not a SPIR-V module",
                self.name
            )
        })
    }
}

/// Little-endian SPIR-V bytes as words, or `None` when they are not a SPIR-V module (length,
/// magic number).
fn spirv_words(s: &[u8]) -> Option<Vec<u32>> {
    if !s.len().is_multiple_of(4) || s.len() < 20 || s[..4] != [0x03, 0x02, 0x23, 0x07] {
        return None;
    }
    Some(
        s.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// `include_bytes!` of `shaders/nv/spv/<name>.spv` as an [`NvKernel`].
#[macro_export]
#[doc(hidden)]
macro_rules! nv_kernel {
    ($name:literal, $bindings:expr) => {
        $crate::runtime::nv::NvKernel {
            name: $name,
            spirv: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../shaders/nv/spv/",
                $name,
                ".spv"
            )),
            bindings: $bindings,
        }
    };
}

/// The pipelines built from [`NvKernel`]s, by name.
#[derive(Default)]
pub(crate) struct NvPipelines {
    built: Mutex<HashMap<&'static str, (Arc<wgpu::ComputePipeline>, wgpu::BindGroupLayout)>>,
    /// Kernels the device refused, with the error: not tried again, and the choosers of the
    /// operations fall back to the WGSL kernels for them ([`crate::Context::nv_kernel_ok`]).
    refused: Mutex<HashMap<&'static str, String>>,
    /// Where [`override_words`] reads (the context's `Tuning::shader_override`).
    replace: Option<std::path::PathBuf>,
}

/// The SPIR-V words of `dir/<kernel>.spv` (the context's `Tuning::shader_override`, which
/// documents it) where `dir` is given and holds that file, else `None`. Errors (as text, for
/// [`GpuError::Unsupported`]): a file that cannot be read, is not a SPIR-V module, or whose
/// bindings are not the embedded kernel's ([`check_bindings`]).
pub fn override_words(
    dir: Option<&std::path::Path>,
    k: &NvKernel,
) -> std::result::Result<Option<Vec<u32>>, String> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let path = dir.join(format!("{}.spv", k.name));
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("NVIDIA kernel override {}: {e}", path.display())),
    };
    let words = spirv_words(&bytes).ok_or_else(|| {
        format!(
            "NVIDIA kernel {}: the override {} is not a SPIR-V module",
            k.name,
            path.display()
        )
    })?;
    check_bindings(k, &words).map_err(|e| format!("{e} (the override {})", path.display()))?;
    Ok(Some(words))
}

impl NvPipelines {
    /// No pipeline built yet; the kernels of `replace/<kernel>.spv` replace the embedded ones
    /// ([`override_words`]).
    pub(crate) fn new(replace: Option<std::path::PathBuf>) -> Self {
        Self {
            replace,
            ..Default::default()
        }
    }

    /// The pipeline of `k` on `device` (built once).
    pub(crate) fn get(
        &self,
        device: &wgpu::Device,
        k: &NvKernel,
    ) -> Result<(Arc<wgpu::ComputePipeline>, wgpu::BindGroupLayout)> {
        if let Some(e) = self
            .refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(k.name)
        {
            return Err(GpuError::Unsupported(e.clone()));
        }
        let out = self.build(device, k);
        if let Err(GpuError::Unsupported(e)) = &out {
            let mut refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
            refused.insert(k.name, e.clone());
        }
        out
    }

    fn build(
        &self,
        device: &wgpu::Device,
        k: &NvKernel,
    ) -> Result<(Arc<wgpu::ComputePipeline>, wgpu::BindGroupLayout)> {
        let mut built = self.built.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = built.get(k.name) {
            return Ok(p.clone());
        }
        // (An override refused here or by the driver leaves the kernel's WGSL fallback to run,
        // as for any refused kernel: said as a warning, so that a timing is not taken for the
        // variant's.)
        let replaced = override_words(self.replace.as_deref(), k).inspect_err(|e| {
            log::warn!("{e}: refused (the kernel's WGSL fallback runs where it has one)");
        });
        // (an override's bindings are checked as it is read)
        let (words, from_override) = match replaced {
            Ok(Some(words)) => (words, true),
            Ok(None) => {
                let words = k.words().map_err(GpuError::Unsupported)?;
                check_bindings(k, &words).map_err(GpuError::Unsupported)?;
                (words, false)
            }
            Err(e) => return Err(GpuError::Unsupported(e)),
        };
        let entries: Vec<wgpu::BindGroupLayoutEntry> = (k.bindings.iter())
            .map(|&(i, b)| wgpu::BindGroupLayoutEntry {
                binding: i,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match b {
                        NvBinding::Read => wgpu::BufferBindingType::Storage { read_only: true },
                        NvBinding::Write => wgpu::BufferBindingType::Storage { read_only: false },
                        NvBinding::Uniform => wgpu::BufferBindingType::Uniform,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        // A driver that cannot compile the module (too much workgroup memory for its staging,
        // say) reports an internal error, not a validation one: both are caught, so such a
        // kernel is a typed error here rather than a pipeline that silently never runs.
        let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(k.name),
            entries: &entries,
        });
        let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(k.name),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        // SAFETY: the module is SPIR-V built by tools/spirv from shaders/nv (checked in CI to
        // be what the sources make), run only on a device that enabled VK_NV_cooperative_matrix2
        // and its features (device_has_nv_cm2), with the bindings the kernel declares; every
        // kernel is tested against the CPU reference on such a device.
        let module = unsafe {
            device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
                label: Some(k.name),
                entry_points: std::borrow::Cow::Owned(vec![wgpu::PassthroughShaderEntryPoint {
                    name: "main".into(),
                    workgroup_size: (0, 0, 0),
                }]),
                spirv: Some(std::borrow::Cow::Owned(words)),
                ..Default::default()
            })
        };
        let pipe = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(k.name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let v = crate::runtime::block::ready(scope.pop()).flatten();
        let i = crate::runtime::block::ready(internal.pop()).flatten();
        if let Some(e) = v.or(i) {
            if from_override {
                log::warn!(
                    "NVIDIA kernel {}: the device refused its override: {e} (the kernel's WGSL \
                     fallback runs where it has one)",
                    k.name
                );
            }
            return Err(GpuError::Unsupported(format!(
                "NVIDIA kernel {}: the device refused it: {e}",
                k.name
            )));
        }
        if from_override {
            log::warn!("NVIDIA kernel {} built from its override", k.name);
        }
        let pipe = Arc::new(pipe);
        built.insert(k.name, (pipe.clone(), layout.clone()));
        Ok((pipe, layout))
    }
}

/// The instructions of a SPIR-V module's `words` (after its 5-word header), each as its words
/// (opcode and count in the first), in order; an `Err` (and nothing after it) where a count
/// is zero or runs past the end.
pub(crate) fn instructions(
    words: &[u32],
) -> impl Iterator<Item = std::result::Result<&[u32], String>> {
    let mut at = 5;
    std::iter::from_fn(move || {
        if at >= words.len() {
            return None;
        }
        let count = (words[at] >> 16) as usize;
        if count == 0 || at + count > words.len() {
            at = words.len();
            return Some(Err("malformed SPIR-V".to_string()));
        }
        let w = &words[at..at + count];
        at += count;
        Some(Ok(w))
    })
}

/// Every NVIDIA kernel embedded in the library (`shaders/nv/kernels.txt`): the GEMMs, the
/// probes, sparse attention's, the scorers, the routing tables and dense attention's. For tests and tools.
#[doc(hidden)]
pub fn embedded_kernels() -> Vec<NvKernel> {
    crate::ops::nv_gemm::VARIANTS
        .iter()
        .map(|v| v.0)
        .chain(crate::ops::nv_gemm::PROBES)
        .chain(crate::ops::attention::by_leaf::NV_ATTENTION)
        .chain(crate::ops::leaf_select::by_leaf::NV_SCORERS)
        .chain(crate::ops::route::NV_TABLES)
        .chain(crate::ops::attention::nv_dense::NV_DENSE.map(|k| k.0))
        .collect()
}

/// Checks kernel `k`'s SPIR-V `words` against its layout. wgpu's Vulkan backend numbers a
/// layout's bindings densely in ascending order of their wgpu numbers (see
/// `shaders/nv/common.glsl`) and does not rewrite passthrough modules, so: the layout must be
/// listed in ascending order, and every resource the module declares must be in set 0, at a
/// binding below the layout's count, of the kind the layout gives that position (a uniform
/// buffer in the `Uniform` storage class, a storage buffer in `StorageBuffer`). Errors: a
/// message naming the first mismatch.
#[doc(hidden)]
pub fn check_bindings(k: &NvKernel, words: &[u32]) -> std::result::Result<(), String> {
    const OP_VARIABLE: u32 = 59;
    const OP_DECORATE: u32 = 71;
    const BINDING: u32 = 33;
    const SET: u32 = 34;
    const UNIFORM: u32 = 2;
    const STORAGE_BUFFER: u32 = 12;
    if !k.bindings.windows(2).all(|w| w[0].0 < w[1].0) {
        return Err(format!(
            "NVIDIA kernel {}: layout not in ascending order",
            k.name
        ));
    }
    let (mut binding, mut set, mut class) = (Vec::new(), Vec::new(), Vec::new());
    for w in instructions(words) {
        let w = w.map_err(|e| format!("NVIDIA kernel {}: {e}", k.name))?;
        match (w[0] & 0xffff, w.len()) {
            (OP_DECORATE, 4..) if w[2] == BINDING => binding.push((w[1], w[3])),
            (OP_DECORATE, 4..) if w[2] == SET => set.push((w[1], w[3])),
            (OP_VARIABLE, 4..) => class.push((w[2], w[3])),
            _ => {}
        }
    }
    if binding.is_empty() {
        return Err(format!("NVIDIA kernel {}: declares no binding", k.name));
    }
    for (id, b) in binding {
        let Some(&(_, kind)) = k.bindings.get(b as usize) else {
            return Err(format!(
                "NVIDIA kernel {}: declares binding {b}, its layout has {}",
                k.name,
                k.bindings.len()
            ));
        };
        if set.iter().any(|&(i, s)| i == id && s != 0) {
            return Err(format!(
                "NVIDIA kernel {}: binding {b} outside set 0",
                k.name
            ));
        }
        let want = match kind {
            NvBinding::Uniform => UNIFORM,
            NvBinding::Read | NvBinding::Write => STORAGE_BUFFER,
        };
        let got = class.iter().find(|&&(i, _)| i == id).map(|&(_, c)| c);
        if got != Some(want) {
            return Err(format!(
                "NVIDIA kernel {}: binding {b} is storage class {got:?}, its layout says {kind:?}",
                k.name
            ));
        }
    }
    Ok(())
}

/// The feature structure of `VK_NV_cooperative_matrix2`
/// (`VkPhysicalDeviceCooperativeMatrix2FeaturesNV`, which ash 0.38 predates).
#[repr(C)]
#[derive(Clone, Copy)]
#[cfg(native_vulkan)]
struct CoopMat2Features {
    s_type: ash::vk::StructureType,
    p_next: *mut std::ffi::c_void,
    workgroup_scope: ash::vk::Bool32,
    flexible_dimensions: ash::vk::Bool32,
    reductions: ash::vk::Bool32,
    conversions: ash::vk::Bool32,
    per_element_operations: ash::vk::Bool32,
    tensor_addressing: ash::vk::Bool32,
    block_loads: ash::vk::Bool32,
}

#[cfg(native_vulkan)]
impl CoopMat2Features {
    /// `VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV`.
    const S_TYPE: ash::vk::StructureType = ash::vk::StructureType::from_raw(1_000_593_000);

    /// The features the kernels use (`on`), or none (for a query). Block loads are never
    /// requested: no kernel uses them, and a driver without them would refuse the device.
    fn new(on: bool) -> Self {
        let v = on as ash::vk::Bool32;
        Self {
            s_type: Self::S_TYPE,
            p_next: std::ptr::null_mut(),
            workgroup_scope: v,
            flexible_dimensions: v,
            reductions: v,
            conversions: v,
            per_element_operations: v,
            tensor_addressing: v,
            block_loads: 0,
        }
    }
    /// Every feature the kernels use (all of them but block loads).
    fn enough(&self) -> bool {
        [
            self.workgroup_scope,
            self.flexible_dimensions,
            self.reductions,
            self.conversions,
            self.per_element_operations,
            self.tensor_addressing,
        ]
        .iter()
        .all(|&b| b != 0)
    }
}

/// The wgpu features the NVIDIA kernels need besides the extension.
pub const NV_CM2_FEATURES: wgpu::Features = wgpu::Features::PASSTHROUGH_SHADERS
    .union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP);

/// Whether `adapter` (Vulkan) has `VK_NV_cooperative_matrix2` with the features the kernels use
/// (workgroup scope, flexible dimensions, reductions, conversions, per-element operations,
/// tensor addressing) and the wgpu features of [`NV_CM2_FEATURES`]. False on every other
/// backend and on targets without wgpu's Vulkan backend.
pub fn nv_cm2_supported(adapter: &wgpu::Adapter) -> bool {
    if !adapter.features().contains(NV_CM2_FEATURES) {
        return false;
    }
    #[cfg(native_vulkan)]
    {
        use ash::khr::get_physical_device_properties2 as props2;
        use wgpu::hal::api::Vulkan;
        // SAFETY: the raw handles are only read (extension lists, one feature query), never
        // stored, while `adapter` is alive.
        unsafe {
            let Some(ad) = adapter.as_hal::<Vulkan>() else {
                return false;
            };
            if !ad
                .physical_device_capabilities()
                .supports_extension(NV_COOPERATIVE_MATRIX_2)
            {
                return false;
            }
            let shared = ad.shared_instance();
            if !shared.extensions().contains(&props2::NAME) {
                return false;
            }
            let query = props2::Instance::new(shared.entry(), shared.raw_instance());
            let mut cm2 = CoopMat2Features::new(false);
            let mut f2 = ash::vk::PhysicalDeviceFeatures2 {
                p_next: (&mut cm2 as *mut CoopMat2Features).cast(),
                ..Default::default()
            };
            query.get_physical_device_features2(ad.raw_physical_device(), &mut f2);
            cm2.enough()
        }
    }
    #[cfg(not(native_vulkan))]
    {
        false
    }
}

/// Opens a device on `adapter` as `adapter.request_device(desc)` would, with
/// `VK_NV_cooperative_matrix2` and its features enabled and [`NV_CM2_FEATURES`] added to
/// `desc.required_features` (the experimental cooperative-matrix feature needs
/// `desc.experimental_features` enabled: this sets it). Hand the device to
/// [`crate::Context::from_device`] and pisa runs its NVIDIA kernels on it.
///
/// Errors: [`GpuError::Unsupported`] where [`nv_cm2_supported`] does not hold;
/// [`GpuError::RequestDevice`] for features or limits the adapter lacks, or when the driver
/// refuses the device.
///
/// ```no_run
/// # async fn app() -> Result<(), Box<dyn std::error::Error>> {
/// use pisa_wgpu::{wgpu, Context};
/// let instance = wgpu::Instance::default();
/// let adapter = instance.request_adapter(&Default::default()).await?;
/// let desc = wgpu::DeviceDescriptor {
///     required_features: pisa_wgpu::wanted_features(&adapter),
///     required_limits: adapter.limits(),
///     ..Default::default()
/// };
/// let (device, queue) = if pisa_wgpu::nv_cm2_supported(&adapter) {
///     pisa_wgpu::request_device_nv_cm2(&adapter, &desc)?
/// } else {
///     // (the experimental cooperative-matrix feature also needs `experimental_features`:
///     // see `Context::from_device`)
///     let plain = wgpu::DeviceDescriptor {
///         required_features: desc.required_features
///             - wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
///         ..desc.clone()
///     };
///     adapter.request_device(&plain).await?
/// };
/// let ctx = Context::from_device(&adapter, device, queue)?;
/// println!("NVIDIA kernels: {}", ctx.nv_cm2());
/// # Ok(()) }
/// ```
pub fn request_device_nv_cm2(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
) -> Result<(wgpu::Device, wgpu::Queue)> {
    if !nv_cm2_supported(adapter) {
        return Err(GpuError::Unsupported(
            "VK_NV_cooperative_matrix2: this adapter does not have it (NVIDIA Vulkan drivers \
             of Turing and later do)"
                .into(),
        ));
    }
    #[cfg(native_vulkan)]
    {
        use wgpu::hal::api::Vulkan;
        let features = desc.required_features | NV_CM2_FEATURES;
        let mut cm2 = CoopMat2Features::new(true);
        let cm2_ptr: *mut CoopMat2Features = &mut cm2;
        // SAFETY: the callback only adds an extension the adapter supports and its feature
        // structure, with the features nv_cm2_supported found on the adapter (block loads,
        // which it does not check, are not requested); `cm2` outlives
        // `open_with_callback`, the only user of the pointer chained into vkCreateDevice. The
        // hal device is handed to wgpu from the same adapter with features it supports.
        let open = unsafe {
            let Some(ad) = adapter.as_hal::<Vulkan>() else {
                return Err(GpuError::Unsupported("not a Vulkan adapter".into()));
            };
            ad.open_with_callback(
                features,
                &desc.required_limits,
                &desc.memory_hints,
                Some(Box::new(
                    move |args: wgpu::hal::vulkan::CreateDeviceCallbackArgs| {
                        args.extensions.push(NV_COOPERATIVE_MATRIX_2);
                        (*cm2_ptr).p_next = args.create_info.p_next as *mut _;
                        args.create_info.p_next = cm2_ptr.cast();
                    },
                )),
            )
            .map_err(|e| GpuError::RequestDevice(format!("VK_NV_cooperative_matrix2: {e}")))?
        };
        let desc = wgpu::DeviceDescriptor {
            required_features: features,
            // SAFETY: as in Context::new_async: the experimental feature is the cooperative
            // matrix one, whose kernels are tested against the CPU reference.
            experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
            ..desc.clone()
        };
        // SAFETY: `open` was made from this adapter's hal adapter with `features`.
        unsafe { adapter.create_device_from_hal(open, &desc) }
            .map_err(|e| GpuError::RequestDevice(e.to_string()))
    }
    #[cfg(not(native_vulkan))]
    {
        let _ = desc;
        Err(GpuError::Unsupported(
            "no Vulkan backend on this target".into(),
        ))
    }
}

/// Whether `device` was opened with `VK_NV_cooperative_matrix2` ([`request_device_nv_cm2`])
/// and [`NV_CM2_FEATURES`]: the condition for pisa's NVIDIA kernels. wgpu reports the enabled
/// extensions but not the extension's enabled features, so a device opened with the extension
/// by other means is taken to have the features [`request_device_nv_cm2`] enables (workgroup
/// scope, flexible dimensions, reductions, conversions, per-element operations, tensor
/// addressing); open it with that function to be sure.
pub fn device_has_nv_cm2(device: &wgpu::Device) -> bool {
    if !device.features().contains(NV_CM2_FEATURES) {
        return false;
    }
    #[cfg(native_vulkan)]
    {
        use wgpu::hal::api::Vulkan;
        // SAFETY: only the list of enabled extensions is read.
        unsafe {
            device.as_hal::<Vulkan>().is_some_and(|d| {
                d.enabled_device_extensions()
                    .contains(&NV_COOPERATIVE_MATRIX_2)
            })
        }
    }
    #[cfg(not(native_vulkan))]
    {
        false
    }
}
