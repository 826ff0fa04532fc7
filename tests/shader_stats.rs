//! Ignored diagnostic: what the Vulkan driver's shader compiler made of each of our pipelines
//! (registers per invocation, spills, shared memory, instruction counts, as the driver names
//! them), through `VK_KHR_pipeline_executable_properties`. wgpu does not expose these, so this
//! builds each pipeline again on a raw Vulkan device (ash) from the SPIR-V naga writes with
//! wgpu's options for our default runtime checks (`runtime/pipeline.rs`: bounds checks on, index
//! `Restrict`, buffer `Unchecked` under `robustBufferAccess2`; no loop bounding and no
//! integer-division guards; workgroup memory not zero-initialised).
//!
//! Why: how many workgroups an SM holds, and whether private arrays stay in registers, decide
//! these kernels' speed, and only the driver knows the register and local-memory counts. This
//! test found the tensor-core kernels' arrays of cooperative matrices in local memory
//! (docs/benchmarks.md, A.7: 2026-11-29, fixed in commit d77f45f).
//!
//! Input: the preprocessed WGSL of every pipeline a real run built, dumped by the tuning's
//! `dump_wgsl` folder (`Tuning::dump_wgsl`, variable `PISA_DUMP_WGSL=<dir>`), e.g.
//! `PISA_DUMP_WGSL=$PWD/wgsl pisa bench --storages f16 --sizes 64k --decode-sizes 64k`.
//! Run: `PISA_WGSL_DIR=$PWD/wgsl cargo test --release -p pisa-wgpu --test shader_stats -- --ignored --nocapture`.
//! Prints one line per pipeline: file name, then each statistic as `name=value`, as the driver
//! reports it (NVIDIA 580 reports `Local Memory Size` as 2^36 plus the bytes per invocation:
//! 68719476736 means none; docs/benchmarks.md, A.7). Without the
//! extension (lavapipe) it still turns every file into SPIR-V, which checks the dump.

use ash::vk;
use std::ffi::{CStr, CString};

/// A dumped pipeline compiled: its SPIR-V and the bindings of group 0 it declares.
struct Compiled {
    words: Vec<u32>,
    /// (binding, descriptor type: uniform or storage buffer); a layout may list more bindings
    /// than the entry point uses.
    bindings: Vec<(u32, vk::DescriptorType)>,
}

/// naga's SPIR-V for `entry` of `src`, with the options wgpu 30 uses on a Vulkan 1.3 device
/// for our default runtime checks (see the module docs; `robust2`: the device has
/// `robustBufferAccess2`, so buffer accesses need no checks of their own), and its bindings.
fn compile(src: &str, entry: &str, robust2: bool) -> Result<Compiled, String> {
    use naga::back::spv;
    use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| format!("{e:?}"))?;
    // The pipeline's override constants, from the dump's second line.
    let mut consts = naga::back::PipelineConstants::default();
    let line = src
        .lines()
        .nth(1)
        .and_then(|l| l.strip_prefix("// overrides: "));
    for kv in line.unwrap_or("").split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or("bad overrides line")?;
        consts.insert(k.to_string(), v.parse().map_err(|_| "bad override value")?);
    }
    let stage = Some((naga::ShaderStage::Compute, entry));
    let (module, info) =
        naga::back::pipeline_constants::process_overrides(&module, &info, stage, &consts)
            .map_err(|e| format!("overrides: {e}"))?;
    let options = spv::Options {
        lang_version: (1, 6),
        flags: spv::WriterFlags::FORCE_POINT_SIZE | spv::WriterFlags::LABEL_VARYINGS,
        capabilities: None,
        bounds_check_policies: BoundsCheckPolicies {
            index: BoundsCheckPolicy::Restrict,
            buffer: if robust2 {
                BoundsCheckPolicy::Unchecked
            } else {
                BoundsCheckPolicy::Restrict
            },
            image_load: BoundsCheckPolicy::Unchecked,
            binding_array: BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: false,
        emit_int_div_checks: false,
        ..Default::default()
    };
    let pipe = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    let words = spv::write_vec(&module, &info, &options, Some(&pipe)).map_err(|e| e.to_string())?;
    let mut bindings = Vec::new();
    for (_, var) in module.global_variables.iter() {
        let Some(rb) = &var.binding else { continue };
        if rb.group != 0 {
            return Err(format!(
                "binding group {} (pisa's shaders use group 0)",
                rb.group
            ));
        }
        let ty = match var.space {
            naga::AddressSpace::Uniform => vk::DescriptorType::UNIFORM_BUFFER,
            _ => vk::DescriptorType::STORAGE_BUFFER,
        };
        bindings.push((rb.binding, ty));
    }
    Ok(Compiled { words, bindings })
}

/// A raw device with every feature the physical device offers in the structures our shaders
/// need (16-bit storage, f16, memory model, subgroup size control, cooperative matrix,
/// robustness 2) and pipeline statistics.
struct Raw {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    stats: ash::khr::pipeline_executable_properties::Device,
    /// The device has cooperative matrices (else those shaders are only turned into SPIR-V).
    coop: bool,
    /// The device has `robustBufferAccess2` (wgpu then leaves buffer accesses unchecked).
    robust2: bool,
    /// The device has `VK_NV_cooperative_matrix2` with the features pisa's NVIDIA kernels use
    /// (enabled: then those kernels' pipelines are built too).
    nv: bool,
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: every object made on the device is destroyed by pipeline_stats before it
        // returns; nothing else holds the device or the instance.
        unsafe {
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// The raw device, or a reason to print statistics-free output.
fn raw() -> Result<Raw, String> {
    let entry = unsafe { ash::Entry::load() }.map_err(|e| format!("no Vulkan loader: {e}"))?;
    let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
    let info = vk::InstanceCreateInfo::default().application_info(&app);
    let instance = unsafe { entry.create_instance(&info, None) }
        .map_err(|e| format!("create_instance: {e}"))?;
    match open_device(&instance) {
        Ok((device, coop, robust2, nv)) => Ok(Raw {
            stats: ash::khr::pipeline_executable_properties::Device::new(&instance, &device),
            _entry: entry,
            instance,
            device,
            coop,
            robust2,
            nv,
        }),
        Err(e) => {
            // SAFETY: no device was made on the instance.
            unsafe { instance.destroy_instance(None) };
            Err(e)
        }
    }
}

/// `VkPhysicalDeviceCooperativeMatrix2FeaturesNV` (ash 0.38 predates it; the same layout as
/// `runtime/nv.rs`'s private copy).
#[repr(C)]
struct CoopMat2Features {
    s_type: vk::StructureType,
    p_next: *mut std::ffi::c_void,
    /// workgroup scope, flexible dimensions, reductions, conversions, per-element operations,
    /// tensor addressing, block loads.
    flags: [vk::Bool32; 7],
}

/// The device of [`Raw`] on `instance` (the discrete GPU if there is one, else the first), with
/// whether it has cooperative matrices, robustness 2 and `VK_NV_cooperative_matrix2` (enabled
/// with every feature the driver offers of it).
fn open_device(instance: &ash::Instance) -> Result<(ash::Device, bool, bool, bool), String> {
    let pds = unsafe { instance.enumerate_physical_devices() }.map_err(|e| e.to_string())?;
    let pd = *pds
        .iter()
        .find(|&&pd| {
            let p = unsafe { instance.get_physical_device_properties(pd) };
            p.device_type == vk::PhysicalDeviceType::DISCRETE_GPU
        })
        .or(pds.first())
        .ok_or("no Vulkan device")?;
    let props = unsafe { instance.get_physical_device_properties(pd) };
    let name = props.device_name_as_c_str().unwrap_or(c"?").to_owned();
    let exts =
        unsafe { instance.enumerate_device_extension_properties(pd) }.map_err(|e| e.to_string())?;
    let has = |n: &CStr| exts.iter().any(|e| e.extension_name_as_c_str() == Ok(n));
    let pep = ash::khr::pipeline_executable_properties::NAME;
    if !has(pep) {
        return Err(format!("{name:?} lacks {pep:?}"));
    }
    let mut names = vec![pep.as_ptr()];
    let coop = has(ash::khr::cooperative_matrix::NAME);
    if coop {
        names.push(ash::khr::cooperative_matrix::NAME.as_ptr());
    }
    let robust2 = has(ash::ext::robustness2::NAME);
    if robust2 {
        names.push(ash::ext::robustness2::NAME.as_ptr());
    }
    const CM2: &CStr = c"VK_NV_cooperative_matrix2";
    let mut nv = coop && has(CM2);
    if nv {
        names.push(CM2.as_ptr());
    }
    let mut fcm2 = CoopMat2Features {
        s_type: vk::StructureType::from_raw(1_000_593_000),
        p_next: std::ptr::null_mut(),
        flags: [0; 7],
    };
    let mut f11 = vk::PhysicalDeviceVulkan11Features::default();
    let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut f13 = vk::PhysicalDeviceVulkan13Features::default();
    let mut fpep = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
    let mut fcoop = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
    let mut fr2 = vk::PhysicalDeviceRobustness2FeaturesEXT::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default()
        .push_next(&mut f11)
        .push_next(&mut f12)
        .push_next(&mut f13)
        .push_next(&mut fpep);
    if coop {
        f2 = f2.push_next(&mut fcoop);
    }
    if robust2 {
        f2 = f2.push_next(&mut fr2);
    }
    if nv {
        // SAFETY: a feature structure of the layout the specification gives, chained in front
        // of the rest (p_next set before the query and device creation read the chain).
        fcm2.p_next = f2.p_next;
        f2.p_next = (&mut fcm2 as *mut CoopMat2Features).cast();
    }
    unsafe { instance.get_physical_device_features2(pd, &mut f2) };
    // pisa's kernels need all but block loads.
    nv = nv && fcm2.flags[..6].iter().all(|&f| f != 0);
    // Enable what the device offers in these structures (as queried), as wgpu would for ours.
    let qfs = unsafe { instance.get_physical_device_queue_family_properties(pd) };
    let qf = qfs
        .iter()
        .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
        .ok_or("no compute queue")? as u32;
    let prio = [1.0f32];
    let queues = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(qf)
        .queue_priorities(&prio)];
    let info = vk::DeviceCreateInfo::default()
        .queue_create_infos(&queues)
        .enabled_extension_names(&names)
        .push_next(&mut f2);
    let device = unsafe { instance.create_device(pd, &info, None) }
        .map_err(|e| format!("create_device: {e}"))?;
    eprintln!(
        "device {name:?}, cooperative matrix {coop}, robustness2 {robust2}, \
         VK_NV_cooperative_matrix2 {nv}"
    );
    Ok((device, coop, robust2, nv))
}

/// The statistic `s` as `name=value`.
fn stat(s: &vk::PipelineExecutableStatisticKHR<'_>) -> String {
    let n = s
        .name_as_c_str()
        .unwrap_or(c"?")
        .to_string_lossy()
        .replace(' ', "_");
    // SAFETY: the union member read is the one `format` names.
    let v = unsafe {
        match s.format {
            vk::PipelineExecutableStatisticFormatKHR::BOOL32 => s.value.b32.to_string(),
            vk::PipelineExecutableStatisticFormatKHR::INT64 => s.value.i64.to_string(),
            vk::PipelineExecutableStatisticFormatKHR::UINT64 => s.value.u64.to_string(),
            _ => format!("{:.1}", s.value.f64),
        }
    };
    format!("{n}={v}")
}

/// The driver's statistics of `entry` of `src`, as `name=value` strings. Every object it makes
/// is destroyed before it returns, whatever fails.
fn pipeline_stats(r: &Raw, src: &str, entry: &str) -> Result<Vec<String>, String> {
    let Compiled { words, bindings } = compile(src, entry, r.robust2)?;
    module_stats(r, &words, bindings, entry)
}

/// The driver's statistics of `entry` of the SPIR-V `words`, whose set 0 has `bindings`. Every
/// object it makes is destroyed before it returns, whatever fails.
fn module_stats(
    r: &Raw,
    words: &[u32],
    bindings: Vec<(u32, vk::DescriptorType)>,
    entry: &str,
) -> Result<Vec<String>, String> {
    let d = &r.device;
    let binds: Vec<_> = bindings
        .into_iter()
        .map(|(b, ty)| {
            vk::DescriptorSetLayoutBinding::default()
                .binding(b)
                .descriptor_type(ty)
                .descriptor_count(1)
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
        })
        .collect();
    let cname = CString::new(entry).map_err(|e| e.to_string())?;
    let mut module = vk::ShaderModule::null();
    let mut dsl = vk::DescriptorSetLayout::null();
    let mut layout = vk::PipelineLayout::null();
    let mut pipe = vk::Pipeline::null();
    let e = |e: vk::Result| e.to_string();
    // SAFETY: plain object creation on a live device; each handle is destroyed below (null
    // handles are valid to destroy).
    let out = (|| unsafe {
        let info = vk::ShaderModuleCreateInfo::default().code(words);
        module = d.create_shader_module(&info, None).map_err(e)?;
        let info = vk::DescriptorSetLayoutCreateInfo::default().bindings(&binds);
        dsl = d.create_descriptor_set_layout(&info, None).map_err(e)?;
        let sets = [dsl];
        let info = vk::PipelineLayoutCreateInfo::default().set_layouts(&sets);
        layout = d.create_pipeline_layout(&info, None).map_err(e)?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(&cname);
        let info = vk::ComputePipelineCreateInfo::default()
            .flags(vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR)
            .stage(stage)
            .layout(layout);
        let made = d.create_compute_pipelines(vk::PipelineCache::null(), &[info], None);
        pipe = made.map_err(|(_, err)| e(err))?[0];
        let pinfo = vk::PipelineInfoKHR::default().pipeline(pipe);
        let execs = r
            .stats
            .get_pipeline_executable_properties(&pinfo)
            .map_err(e)?;
        let mut lines = Vec::new();
        for i in 0..execs.len() as u32 {
            let einfo = vk::PipelineExecutableInfoKHR::default()
                .pipeline(pipe)
                .executable_index(i);
            let stats = r
                .stats
                .get_pipeline_executable_statistics(&einfo)
                .map_err(e)?;
            lines.extend(stats.iter().map(stat));
        }
        Ok(lines)
    })();
    unsafe {
        d.destroy_pipeline(pipe, None);
        d.destroy_pipeline_layout(layout, None);
        d.destroy_descriptor_set_layout(dsl, None);
        d.destroy_shader_module(module, None);
    }
    out
}

#[test]
#[ignore]
fn shader_stats() {
    let Ok(dir) = std::env::var("PISA_WGSL_DIR") else {
        eprintln!("PISA_WGSL_DIR unset: nothing to read (see the module docs)");
        return;
    };
    // Without the extension (lavapipe 22 in CI's image) every file is still turned into
    // SPIR-V, which checks the dump; so is a tensor-core shader on a device without
    // cooperative matrices. Only the driver's statistics are skipped.
    let r = raw()
        .map_err(|e| eprintln!("no statistics ({e}): SPIR-V only"))
        .ok();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("PISA_WGSL_DIR is a readable folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .wgsl files in {dir}");
    let mut failed = 0;
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap();
        let entry = src
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("// entry: "))
            .expect("first line names the entry point (PISA_DUMP_WGSL files)")
            .trim()
            .to_string();
        let name = f.file_name().unwrap().to_string_lossy();
        let coop_src = src.contains("enable wgpu_cooperative_matrix");
        let got = match &r {
            Some(r) if r.coop || !coop_src => pipeline_stats(r, &src, &entry),
            _ => {
                compile(&src, &entry, true).map(|c| vec![format!("spirv_words={}", c.words.len())])
            }
        };
        failed += usize::from(!print_stats(&name, got));
    }
    drop(r);
    assert_eq!(failed, 0, "{failed} of {} pipelines failed", files.len());
}

/// The NVIDIA kernels (`shaders/nv`, the SPIR-V embedded in the library) on a device with
/// `VK_NV_cooperative_matrix2`: one line per kernel, as [`shader_stats`] prints a WGSL
/// pipeline's. Registers and shared memory decide how many of a kernel's workgroups an SM
/// holds, which these latency-bound kernels live on. Run:
/// `PISA_REQUIRE_NV_CM2=1 cargo test --release -p pisa-wgpu --test shader_stats -- --ignored
/// --nocapture nv_kernel_stats`; with `PISA_NV_SPV_DIR=<dir>`, also each `<kernel>@<tag>.spv`
/// there (a variant built outside the library, bound as `<kernel>`). Without the extension it prints why and passes, unless
/// `PISA_REQUIRE_NV_CM2=1` (then it fails: the statistics were asked for).
#[test]
#[ignore]
fn nv_kernel_stats() {
    let require = std::env::var("PISA_REQUIRE_NV_CM2").is_ok_and(|v| v == "1");
    let r = match raw() {
        Ok(r) if r.nv => r,
        Ok(_) => {
            assert!(!require, "the device lacks VK_NV_cooperative_matrix2");
            eprintln!("no VK_NV_cooperative_matrix2: nothing to report");
            return;
        }
        Err(e) => {
            assert!(!require, "no statistics: {e}");
            eprintln!("no statistics ({e})");
            return;
        }
    };
    use pisa_wgpu::runtime::nv::{NvBinding, NvKernel};
    let kernels = pisa_wgpu::runtime::nv::embedded_kernels();
    assert!(!kernels.is_empty());
    // (name, SPIR-V words or why not, the kernel whose layout it has)
    type Module<'a> = (String, Result<Vec<u32>, String>, &'a NvKernel);
    let mut modules: Vec<Module> = kernels
        .iter()
        .map(|k| (k.name.to_string(), k.words(), k))
        .collect();
    // Variants of a kernel built outside the library (`<kernel>@<tag>.spv` in
    // PISA_NV_SPV_DIR): statistics of a change before it is benchmarked.
    if let Ok(dir) = std::env::var("PISA_NV_SPV_DIR") {
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("PISA_NV_SPV_DIR is a readable folder")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "spv"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no .spv files in {dir}");
        for f in files {
            let name = f.file_stem().unwrap().to_string_lossy().to_string();
            let base = name.split('@').next().unwrap_or("");
            let k = kernels.iter().find(|k| k.name == base);
            let k = k.unwrap_or_else(|| panic!("{name}: no embedded kernel {base:?}"));
            let words = std::fs::read(&f).map_err(|e| e.to_string()).map(|b| {
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            });
            modules.push((name, words, k));
        }
    }
    let (count, mut failed) = (modules.len(), 0);
    for (name, words, k) in modules {
        let binds = k
            .bindings
            .iter()
            .enumerate()
            .map(|(i, (_, kind))| {
                let ty = match kind {
                    NvBinding::Uniform => vk::DescriptorType::UNIFORM_BUFFER,
                    _ => vk::DescriptorType::STORAGE_BUFFER,
                };
                // Dense Vulkan numbers, as wgpu's backend gives them (shaders/nv/common.glsl).
                (i as u32, ty)
            })
            .collect();
        let got = words.and_then(|w| module_stats(&r, &w, binds, "main"));
        failed += usize::from(!print_stats(&name, got));
    }
    drop(r);
    assert_eq!(failed, 0, "{failed} of {count} kernels failed");
}

/// Prints a pipeline's line: its statistics, or the error that stopped them. Returns whether
/// it got them.
fn print_stats(name: &str, got: Result<Vec<String>, String>) -> bool {
    match &got {
        Ok(s) => println!("{name}: {}", s.join(" ")),
        Err(e) => println!("{name}: ERROR {e}"),
    }
    got.is_ok()
}
