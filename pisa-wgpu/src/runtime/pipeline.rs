//! Shader variants and the pipeline cache.
//!
//! Shaders are plain `.wgsl` files under `shaders/`, one family per file, loaded with
//! `include_str!`. Two conventions make one file serve every variant:
//! - storage precision: each file declares `alias store_t = f32;`; the f16 variant prepends
//!   `enable f16;` and turns the alias into `f16`. Arithmetic is always f32 (loads convert).
//! - 16-bit inputs and caches: every read-only binding `var<storage, read> x: array<store_t>;`
//!   (or `array<vec4<store_t>>`) gets generated accessors `in_x(i) -> f32` and
//!   `raw_x(i) -> store_t` (or `in4_x(i) -> vec4<f32>` and `raw4_x(i) -> vec4<store_t>`, `i`
//!   counting vec4s); every read-write binding `var<storage, read_write> x: array<cache_t>;`
//!   (`alias cache_t = store_t;`: a tensor kept in the storage type, the decode cache) gets
//!   `in_x(i) -> f32` and `out2_x(i, a, b)`, which writes elements `i` (even) and `i + 1`. The
//!   bf16 variant binds those as `array<u32>` (`array<vec2<u32>>`), two bf16 per word: the
//!   loads widen them (exact: a bf16 is the upper half of an f32), `out2_x` rounds to nearest
//!   even and writes one whole word (so no two invocations share one). `store_t` stays f32
//!   there, so what a kernel writes as `store_t` (O, intermediates) is f32. A shader opts in to
//!   the bf16 variant by declaring `const BF16_READY: bool = true;` (once per module); the
//!   bf16 variant of any other shader is refused ([`GpuError::Unsupported`]: those bind their
//!   data as raw words or f16 matrices), and so is one that still indexes such a binding
//!   directly instead of through its accessors, or has a read-only binding of the storage type
//!   the preprocessor does not recognise.
//! - sizes that WGSL needs as true constants (private array lengths) are declared
//!   `const NAME: u32 = <default>u;` and substituted per variant; everything else that varies
//!   is an `override` set through pipeline constants.
//!
//! Pipelines are cached by (shader, entry point, storage, substituted constants, overrides).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::checks::ShaderChecks;
use crate::error::{GpuError, Result};

/// Element type of Q, K, V (and, for f32 and f16, of O) in GPU memory. Arithmetic is f32
/// either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
pub enum Storage {
    /// 4-byte floats.
    #[default]
    F32,
    /// 2-byte IEEE half floats (needs SHADER_F16); bf16 views are converted to this (exact
    /// within f16's range) on the tensor-core paths, which read f16.
    F16,
    /// bfloat16 (2 bytes, the upper half of an f32): Q, K, V and the decode cache are read as
    /// 16-bit words and widened in the kernels (exact); what the kernels write as O is f32
    /// ([`Storage::output`]), which a prefill plan converts into the caller's O view (bf16
    /// included). The portable kernels of the prefill (pyramid, route, stage-2 scoring, sparse
    /// and dense tile attention) and of decode read it, on every device, no feature needed. The
    /// cooperative-matrix, split-K and NVIDIA kernels do not and are not picked for it (f16
    /// storage with bf16 views is the fast path there: converted on the GPU, exact within f16's
    /// range); the baseline selectors and the backward pass refuse it with
    /// [`GpuError::Unsupported`]. Views of another dtype given to a bf16 plan or cache (f32,
    /// f16) are rounded to bf16 (nearest even) as they are gathered in: the widening is exact,
    /// the narrowing is not.
    Bf16,
}

impl Storage {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Storage::F32 => 4,
            Storage::F16 | Storage::Bf16 => 2,
        }
    }

    /// The element type the kernels write O in for inputs of this storage: the storage itself,
    /// except f32 for bf16 (WGSL has no 16-bit store of bf16).
    pub fn output(self) -> Storage {
        match self {
            Storage::Bf16 => Storage::F32,
            s => s,
        }
    }
}

/// One shader family: a name (for labels and errors) and its WGSL text.
#[derive(Debug, Clone, Copy)]
pub struct ShaderSource {
    /// File stem under `shaders/`.
    pub name: &'static str,
    /// WGSL source.
    pub wgsl: &'static str,
}

/// The WGSL text of `shader` for `storage`, with the `const NAME: u32 = ...;` lines of `consts`
/// replaced and the inputs' load accessors generated (module docs). Errors if a named constant
/// is not declared in the file, or, for bf16, if the shader indexes an input directly.
pub fn preprocess(
    shader: &ShaderSource,
    storage: Storage,
    consts: &[(&str, u32)],
) -> Result<String> {
    let mut out = String::with_capacity(shader.wgsl.len() + 64);
    if storage == Storage::F16 {
        out.push_str("enable f16;\n");
    }
    let mut seen = vec![false; consts.len()];
    let mut inputs = Vec::new();
    let mut caches = false;
    for line in shader.wgsl.lines() {
        let t = line.trim_start();
        let mut replaced = false;
        if t.starts_with("alias store_t = f32;") && storage == Storage::F16 {
            out.push_str("alias store_t = f16;\n");
            continue;
        }
        if let Some((name, kind)) = binding_16(t) {
            let (words, fns) = accessors(name, kind, storage);
            let line = match storage {
                Storage::Bf16 => line.replace(kind.array(), words),
                _ => line.to_string(),
            };
            out.push_str(&line);
            out.push('\n');
            out.push_str(&fns);
            caches |= kind == Binding16::Cache;
            inputs.push(name);
            continue;
        }
        for (i, (name, val)) in consts.iter().enumerate() {
            if t.starts_with(&format!("const {name}: u32 =")) {
                out.push_str(&format!("const {name}: u32 = {val}u;\n"));
                seen[i] = true;
                replaced = true;
            }
        }
        if !replaced {
            out.push_str(line);
            out.push('\n');
        }
    }
    if let Some(i) = seen.iter().position(|s| !s) {
        return Err(GpuError::Unsupported(format!(
            "shader {} declares no constant {}",
            shader.name, consts[i].0
        )));
    }
    if storage == Storage::Bf16 && caches {
        out.push_str(BF16_BITS);
    }
    if storage == Storage::Bf16 {
        let ready = shader
            .wgsl
            .lines()
            .any(|l| l.trim_start().starts_with("const BF16_READY: bool = true;"));
        // A read-only binding of the storage type that `binding_16` did not take.
        let unrecognised = shader.wgsl.lines().find(|l| {
            l.contains("var<storage, read>")
                && l.contains("store_t")
                && binding_16(l.trim_start()).is_none()
        });
        let direct = inputs.iter().find(|n| indexes_directly(shader.wgsl, n));
        let why = match (ready, unrecognised, direct) {
            (false, ..) => Some("it does not read bf16".to_string()),
            (_, Some(l), _) => Some(format!(
                "binding `{}` is not one of the forms it converts",
                l.trim()
            )),
            (_, _, Some(name)) => Some(format!("it indexes `{name}` directly")),
            _ => None,
        };
        if let Some(why) = why {
            return Err(GpuError::Unsupported(format!(
                "bf16 storage for the {} kernel: {why}; use f16 or f32 storage (bf16 views are converted on the GPU)",
                shader.name
            )));
        }
    }
    Ok(out)
}

/// f32 -> bf16 bits, rounded to nearest even (a NaN stays a NaN): the bf16 variant's
/// `out2_*` accessors call it (appended once to a module that has any).
const BF16_BITS: &str = "fn bf16_bits(v: f32) -> u32 { let b = bitcast<u32>(v); \
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) { return (b >> 16u) | 0x40u; } \
    return (b + 0x7FFFu + ((b >> 16u) & 1u)) >> 16u; }\n";

/// A binding that holds the storage type (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binding16 {
    /// `var<storage, read> x: array<store_t>;`
    Input,
    /// `var<storage, read> x: array<vec4<store_t>>;`
    Input4,
    /// `var<storage, read_write> x: array<cache_t>;`
    Cache,
}

impl Binding16 {
    fn array(self) -> &'static str {
        match self {
            Binding16::Input => "array<store_t>",
            Binding16::Input4 => "array<vec4<store_t>>",
            Binding16::Cache => "array<cache_t>",
        }
    }
}

/// The name and kind of a binding line that holds the storage type, if `t` is one.
fn binding_16(t: &str) -> Option<(&str, Binding16)> {
    let (rest, read_only) = match t.split_once("var<storage, read> ") {
        Some((_, r)) => (r, true),
        None => (t.split_once("var<storage, read_write> ")?.1, false),
    };
    let (name, ty) = rest.split_once(':')?;
    let kind = match (ty.trim(), read_only) {
        ("array<store_t>;", true) => Binding16::Input,
        ("array<vec4<store_t>>;", true) => Binding16::Input4,
        ("array<cache_t>;", false) => Binding16::Cache,
        _ => return None,
    };
    Some((name.trim(), kind))
}

/// The array type a binding of `kind` is bound as in the bf16 variant, and its accessors for
/// `storage`.
fn accessors(x: &str, kind: Binding16, storage: Storage) -> (&'static str, String) {
    let bf16 = storage == Storage::Bf16;
    match (kind, bf16) {
        (Binding16::Input, true) => (
            "array<u32>",
            format!(
                "fn in_{x}(i: u32) -> f32 {{ let w = {x}[i >> 1u]; \
                 return bitcast<f32>(select(w << 16u, w & 0xFFFF0000u, (i & 1u) == 1u)); }}\n\
                 fn raw_{x}(i: u32) -> store_t {{ return in_{x}(i); }}\n"
            ),
        ),
        (Binding16::Input4, true) => (
            "array<vec2<u32>>",
            format!(
                "fn in4_{x}(i: u32) -> vec4<f32> {{ let w = {x}[i]; \
                 return bitcast<vec4<f32>>(vec4<u32>(w.x << 16u, w.x & 0xFFFF0000u, \
                 w.y << 16u, w.y & 0xFFFF0000u)); }}\n\
                 fn raw4_{x}(i: u32) -> vec4<store_t> {{ return in4_{x}(i); }}\n"
            ),
        ),
        (Binding16::Cache, true) => (
            "array<u32>",
            format!(
                "fn in_{x}(i: u32) -> f32 {{ let w = {x}[i >> 1u]; \
                 return bitcast<f32>(select(w << 16u, w & 0xFFFF0000u, (i & 1u) == 1u)); }}\n\
                 fn out2_{x}(i: u32, a: f32, b: f32) {{ \
                 {x}[i >> 1u] = bf16_bits(a) | (bf16_bits(b) << 16u); }}\n"
            ),
        ),
        (Binding16::Input, false) => (
            "",
            format!(
                "fn in_{x}(i: u32) -> f32 {{ return f32({x}[i]); }}\n\
                 fn raw_{x}(i: u32) -> store_t {{ return {x}[i]; }}\n"
            ),
        ),
        (Binding16::Input4, false) => (
            "",
            format!(
                "fn in4_{x}(i: u32) -> vec4<f32> {{ return vec4<f32>({x}[i]); }}\n\
                 fn raw4_{x}(i: u32) -> vec4<store_t> {{ return {x}[i]; }}\n"
            ),
        ),
        (Binding16::Cache, false) => (
            "",
            format!(
                "fn in_{x}(i: u32) -> f32 {{ return f32({x}[i]); }}\n\
                 fn out2_{x}(i: u32, a: f32, b: f32) {{ \
                 {x}[i] = cache_t(a); {x}[i + 1u] = cache_t(b); }}\n"
            ),
        ),
    }
}

/// Whether `src` indexes `name` directly (`name[`, not part of a longer identifier).
fn indexes_directly(src: &str, name: &str) -> bool {
    let pat = format!("{name}[");
    src.match_indices(&pat).any(|(i, _)| {
        !src[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    name: &'static str,
    entry: &'static str,
    storage: Storage,
    consts: Vec<(String, u32)>,
    overrides: Vec<(String, u64)>,
}

/// Compute pipelines built so far, shared by every operation of a context, all built with the
/// context's shader runtime checks ([`super::checks`]).
pub struct PipelineCache {
    map: Mutex<HashMap<Key, Arc<wgpu::ComputePipeline>>>,
    checks: ShaderChecks,
    /// Where [`dump_wgsl`] writes (the context's `Tuning::dump_wgsl`).
    dump: Option<std::path::PathBuf>,
    /// Where [`override_wgsl`] reads (the context's `Tuning::shader_override`).
    replace: Option<std::path::PathBuf>,
}

/// The text of the file named as [`dump_wgsl`] names `key`'s in `dir` (the context's
/// `Tuning::shader_override`, which documents it) when there is one, else `None`. Errors:
/// [`GpuError::Unsupported`] for a file that is there but cannot be read.
fn override_wgsl(dir: Option<&std::path::Path>, key: &Key) -> Result<Option<String>> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    // (a folder removed after the context was made would otherwise run every original)
    if !dir.is_dir() {
        return Err(GpuError::Unsupported(format!(
            "the shader override folder {} is not there",
            dir.display()
        )));
    }
    let path = dir.join(file_name(key));
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            log::warn!(
                "pipeline {}.{} built from {}",
                key.name,
                key.entry,
                path.display()
            );
            Ok(Some(text))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(GpuError::Unsupported(format!(
            "WGSL override {}: {e}",
            path.display()
        ))),
    }
}

/// The file name of `key`'s pipeline in a WGSL dump (`Tuning::dump_wgsl`):
/// `<shader>.<entry>.<storage>.<hash of constants and overrides>.wgsl`. (The hash is std's
/// `DefaultHasher`, whose output may change between Rust releases: an override folder is
/// made from a dump of the same build.)
fn file_name(key: &Key) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.consts.hash(&mut h);
    key.overrides.hash(&mut h);
    format!(
        "{}.{}.{:?}.{:016x}.wgsl",
        key.name,
        key.entry,
        key.storage,
        h.finish()
    )
}

/// Writes the preprocessed WGSL of a pipeline into `dir` when given (the context's
/// `Tuning::dump_wgsl`, which documents the files); a write that fails is reported on stderr
/// and otherwise ignored: the dump never changes what runs.
fn dump_wgsl(dir: Option<&std::path::Path>, key: &Key, src: &str) {
    let Some(dir) = dir else {
        return;
    };
    if let Err(e) = dump_to(dir, key, src) {
        eprintln!("pisa: WGSL dump: cannot write into {}: {e}", dir.display());
    }
}

/// [`dump_wgsl`] into `dir` (made if missing); returns the file written.
fn dump_to(dir: &std::path::Path, key: &Key, src: &str) -> std::io::Result<std::path::PathBuf> {
    let path = dir.join(file_name(key));
    let overrides: Vec<String> = (key.overrides.iter())
        .map(|(n, b)| format!("{n}={}", f64::from_bits(*b)))
        .collect();
    let text = format!(
        "// entry: {}\n// overrides: {}\n{src}",
        key.entry,
        overrides.join(",")
    );
    std::fs::create_dir_all(dir)?;
    std::fs::write(&path, text)?;
    Ok(path)
}

impl PipelineCache {
    /// An empty cache whose pipelines will be built with `checks`, their WGSL written into
    /// `dump` when given ([`dump_wgsl`]) and read from `replace` where a file there names
    /// them ([`override_wgsl`]).
    pub fn new(
        checks: ShaderChecks,
        dump: Option<std::path::PathBuf>,
        replace: Option<std::path::PathBuf>,
    ) -> Self {
        Self {
            map: Mutex::default(),
            checks,
            dump,
            replace,
        }
    }

    /// The shader runtime checks of this cache's pipelines.
    pub fn checks(&self) -> ShaderChecks {
        self.checks
    }

    /// The pipeline of `shader`'s entry point `entry` for this variant, built on first use.
    pub fn get(
        &self,
        device: &wgpu::Device,
        shader: &ShaderSource,
        entry: &'static str,
        storage: Storage,
        consts: &[(&str, u32)],
        overrides: &[(&str, f64)],
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        if storage == Storage::F16 && !device.features().contains(wgpu::Features::SHADER_F16) {
            return Err(GpuError::Unsupported(format!(
                "f16 storage ({} kernel) on a device without SHADER_F16; use f32 storage",
                shader.name
            )));
        }
        let key = Key {
            name: shader.name,
            entry,
            storage,
            consts: consts.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
            overrides: overrides
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_bits()))
                .collect(),
        };
        if let Some(p) = self.map.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(p.clone());
        }
        let t0 = web_time::Instant::now();
        let mut src = preprocess(shader, storage, consts)?;
        dump_wgsl(self.dump.as_deref(), &key, &src);
        if let Some(text) = override_wgsl(self.replace.as_deref(), &key)? {
            src = text;
        }
        check_bindings(&device.limits(), shader.name, entry, &src)?;
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(shader.name),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        };
        // SAFETY: see `super::checks`: buffer accesses stay bounded (by naga's checks, or by the
        // driver's robustBufferAccess2) unless the tuning asks for no checks; workgroup and private
        // array indices are in range by each kernel's invariants (sizes from the host's plan,
        // tested against the reference); every loop of our shaders is a counted loop over
        // host-validated sizes, and every integer divisor is a size the host checked to be
        // non-zero.
        let checks = self.checks.runtime_checks();
        let module = unsafe { device.create_shader_module_trusted(desc, checks) };
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(shader.name),
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: overrides,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        log::debug!(
            "built pipeline {}.{} ({storage:?}, {:?}) in {:.1} ms, constants {consts:?}",
            shader.name,
            entry,
            self.checks,
            t0.elapsed().as_secs_f64() * 1e3
        );
        // Two threads may build the same pipeline at once: the first one stored wins and both
        // return it, so every caller of a key holds one pipeline (bind groups made for one
        // pipeline's layout are kept by plans and decode caches, and would not fit another's).
        let p = Arc::new(pipeline);
        Ok(self
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_insert(p)
            .clone())
    }
}

impl crate::Context {
    /// The shaders ([`ShaderSource::name`]) this context has built pipelines of so far, sorted,
    /// each once: the kernels it has recorded (diagnostics; the tests check with it that the
    /// kernel [`crate::ops::attention::attention_kernel`] reports is the one that runs).
    pub fn built_shaders(&self) -> Vec<&'static str> {
        let map = self.pipelines.map.lock().unwrap_or_else(|p| p.into_inner());
        let mut names: Vec<&'static str> = map.keys().map(|k| k.name).collect();
        names.sort_unstable();
        names.dedup();
        names
    }
}

/// The hint of a [`GpuError::Limit`] in "bindings": a device opened with lower limits.
pub(crate) const BINDINGS_HINT: &str = "open the device with the adapter's limits \
    (`required_limits: adapter.limits()`); wgpu's default limits allow 8 storage buffers per \
    shader stage, its downlevel defaults 4";

/// The hint of a [`GpuError::Limit`] in uniform-buffer "bindings" (native: wasm32 leaves the
/// count to the browser, see [`check_bindings`]).
#[cfg(not(target_arch = "wasm32"))]
const UNIFORM_BINDINGS_HINT: &str =
    "open the device with the adapter's limits (`required_limits: adapter.limits()`)";

/// Refuses, with [`GpuError::Limit`] (unit "bindings"), an entry point that binds more storage
/// or uniform buffers than the device allows per shader stage: wgpu would fail its pipeline
/// with a validation error naming neither the kernel nor the remedy. (wgpu's downlevel limits,
/// which some apps open their device with, allow 4 storage buffers per stage, fewer than the
/// routing and decode kernels bind; pisa's plans size everything else against the device.) The
/// declared bindings are counted in the text first; only a module declaring more than a limit
/// is parsed and validated by naga ([`entry_globals`]), to count the ones `entry` uses (an
/// implicit layout binds only those). A module naga does not validate is left to wgpu, which reports it. (Native targets,
/// through wgpu's naga; on wasm32 the browser's WebGPU reports it, as a validation error.)
#[cfg(target_arch = "wasm32")]
fn check_bindings(_: &wgpu::Limits, _: &str, _: &str, _: &str) -> Result<()> {
    Ok(())
}
#[cfg(not(target_arch = "wasm32"))]
fn check_bindings(limits: &wgpu::Limits, name: &str, entry: &str, src: &str) -> Result<()> {
    use wgpu::naga;
    let storage_limit = limits.max_storage_buffers_per_shader_stage;
    let uniform_limit = limits.max_uniform_buffers_per_shader_stage;
    let declared = |pat: &str| src.matches(pat).count() as u32;
    if declared("var<storage") <= storage_limit && declared("var<uniform") <= uniform_limit {
        return Ok(());
    }
    let Ok(EntryGlobals { module, used }) = entry_globals(src, entry) else {
        return Ok(());
    };
    let used = |space: fn(&naga::AddressSpace) -> bool| {
        (used.iter())
            .filter(|&&h| space(&module.global_variables[h].space))
            .count() as u64
    };
    let storage = used(|s| matches!(s, naga::AddressSpace::Storage { .. }));
    let uniform = used(|s| matches!(s, naga::AddressSpace::Uniform));
    for (kind, needed, limit, hint) in [
        ("storage", storage, storage_limit, BINDINGS_HINT),
        ("uniform", uniform, uniform_limit, UNIFORM_BINDINGS_HINT),
    ] {
        if needed > limit as u64 {
            return Err(GpuError::Limit {
                what: format!("{kind} buffers per shader stage of the {name} kernel ({entry})"),
                needed,
                limit: limit as u64,
                unit: "bindings",
                hint,
            });
        }
    }
    Ok(())
}

/// A preprocessed module, parsed and validated by naga, and the globals its entry point uses.
#[cfg(not(target_arch = "wasm32"))]
struct EntryGlobals {
    module: wgpu::naga::Module,
    used: Vec<wgpu::naga::Handle<wgpu::naga::GlobalVariable>>,
}

/// The globals entry point `entry` of the WGSL `src` uses (naga's validation of the module);
/// shared by [`check_bindings`] and the workgroup-memory accounting of the tests. Errors: the
/// parse or validation error (rendered against `src`), or the missing entry point.
#[cfg(not(target_arch = "wasm32"))]
fn entry_globals(src: &str, entry: &str) -> std::result::Result<EntryGlobals, String> {
    use wgpu::naga;
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(src))?;
    let ep = (module.entry_points.iter())
        .position(|e| e.name == entry)
        .ok_or_else(|| format!("no entry point {entry}"))?;
    let uses = info.get_entry_point(ep);
    let used = (module.global_variables.iter())
        .filter(|(h, _)| !uses[*h].is_empty())
        .map(|(h, _)| h)
        .collect();
    Ok(EntryGlobals { module, used })
}

/// Bytes of the `var<workgroup>` globals that entry point `entry` of `shader` uses, for
/// `storage` with `consts` substituted: naga's own type sizes of the validated module, so the
/// unit tests can check each op's hand-written workgroup-memory accounting against the shader.
/// Panics (a test failure) if the shader does not preprocess, parse or validate, or has no such
/// entry point.
#[cfg(test)]
pub(crate) fn workgroup_bytes(
    shader: &ShaderSource,
    entry: &str,
    storage: Storage,
    consts: &[(&str, u32)],
) -> u64 {
    let src = preprocess(shader, storage, consts).unwrap();
    let EntryGlobals { module, used } =
        entry_globals(&src, entry).unwrap_or_else(|e| panic!("{} {consts:?}: {e}", shader.name));
    (used.iter())
        .map(|&h| &module.global_variables[h])
        .filter(|v| v.space == wgpu::naga::AddressSpace::WorkGroup)
        .map(|v| module.types[v.ty].inner.size(module.to_ctx()) as u64)
        .sum()
}

/// WebGPU's guaranteed minimum of workgroup memory, bytes: the bound for kernels whose arrays
/// are fixed (not planned against the device).
#[cfg(test)]
pub(crate) const MIN_WORKGROUP_BYTES: u64 = 16 << 10;

/// Asserts that entry point `entry` of `shader` (for `storage`, `consts` substituted) uses at
/// most `charged` bytes of workgroup memory ([`workgroup_bytes`]); `what` names the case in the
/// failure message. The check every op's accounting test makes.
#[cfg(test)]
pub(crate) fn assert_workgroup_fits(
    shader: &ShaderSource,
    entry: &str,
    storage: Storage,
    consts: &[(&str, u32)],
    charged: u64,
    what: impl std::fmt::Display,
) {
    let used = workgroup_bytes(shader, entry, storage, consts);
    assert!(
        used <= charged,
        "{what}: {}::{entry} ({storage:?}, {consts:?}) uses {used} bytes of workgroup memory, \
         the host charges {charged}",
        shader.name
    );
}

/// Device limits with `bytes` of workgroup memory and wgpu's defaults otherwise (the accounting
/// tests' devices).
#[cfg(test)]
pub(crate) fn limits_with_memory(bytes: u32) -> wgpu::Limits {
    wgpu::Limits {
        max_compute_workgroup_storage_size: bytes,
        ..Default::default()
    }
}

/// A dumped pipeline (`PISA_DUMP_WGSL`) names its entry point and overrides on its first two
/// lines, as `tests/shader_stats.rs` reads them, and the rest is the preprocessed source, which
/// parses and validates; variants differing only in their constants get different files.
#[cfg(test)]
#[test]
fn dump_names_the_entry_and_overrides() {
    let dir = std::env::temp_dir().join(format!("pisa-dump-test-{}", std::process::id()));
    let shader = &crate::ops::pyramid::SHADER;
    let key = |wsq: f64, d: u32| Key {
        name: shader.name,
        entry: "pool_level",
        storage: Storage::F16,
        consts: vec![("D".to_string(), d)],
        overrides: vec![("WITH_SQ".to_string(), wsq.to_bits())],
    };
    let src = preprocess(shader, Storage::F16, &[]).unwrap();
    let a = dump_to(&dir, &key(1.0, 64), &src).unwrap();
    let b = dump_to(&dir, &key(1.0, 128), &src).unwrap();
    assert_ne!(a, b, "variants share a file");
    let text = std::fs::read_to_string(&a).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("// entry: pool_level"));
    assert_eq!(lines.next(), Some("// overrides: WITH_SQ=1"));
    let module = naga::front::wgsl::parse_str(&text).expect("the dump parses");
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .expect("the dump validates");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// No tensor-core shader declares an array of cooperative matrices, private or function-local:
/// NVIDIA's driver (580, on the H200) keeps such arrays in local memory even when every index
/// is a constant-trip loop counter, which cost the scorer 11% and dense attention 16%
/// (docs/benchmarks.md, A.7: 2026-11-29, fixed in commit d77f45f); `shaders/coop_qa.wgsl` shows
/// the form to use instead.
/// Fails naming the shader and the variable.
#[cfg(test)]
#[test]
fn no_shader_holds_an_array_of_cooperative_matrices() {
    use crate::ops::{attention, leaf_select};
    let shaders = [
        &attention::coop::SHADER,
        &attention::by_leaf::COOP_SHADER,
        &leaf_select::coop::SHADER,
        &leaf_select::by_leaf::SCORE_COOP_SHADER,
    ];
    for shader in shaders {
        let src = preprocess(shader, Storage::F16, &[]).unwrap();
        let m = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(&src)));
        let bad = |ty: naga::Handle<naga::Type>| match m.types[ty].inner {
            naga::TypeInner::Array { base, .. } => matches!(
                m.types[base].inner,
                naga::TypeInner::CooperativeMatrix { .. }
            ),
            _ => false,
        };
        let globals = m.global_variables.iter().map(|(_, v)| (&v.name, v.ty));
        let functions = m.functions.iter().map(|(_, f)| f);
        let entries = m.entry_points.iter().map(|e| &e.function);
        let locals = functions
            .chain(entries)
            .flat_map(|f| f.local_variables.iter().map(|(_, v)| (&v.name, v.ty)));
        for (name, ty) in globals.chain(locals) {
            assert!(
                !bad(ty),
                "{}: {name:?} is an array of cooperative matrices (kept in local memory)",
                shader.name
            );
        }
    }
}
