//! Shader variants and the pipeline cache.
//!
//! Shaders are plain `.wgsl` files under `shaders/`, one family per file, loaded with
//! `include_str!`. Two conventions make one file serve every variant:
//! - storage precision: each file declares `alias store_t = f32;`; the f16 variant prepends
//!   `enable f16;` and turns the alias into `f16`. Arithmetic is always f32 (loads convert).
//! - loads of the inputs: every read-only binding `var<storage, read> x: array<store_t>;`
//!   (or `array<vec4<store_t>>`) gets a generated accessor `in_x(i) -> f32` (or
//!   `in4_x(i) -> vec4<f32>`, `i` counting vec4s). The bf16 variant binds such an input as
//!   `array<u32>` (`array<vec2<u32>>`), two bf16 per word, and its accessors widen them (exact:
//!   a bf16 is the upper half of an f32); `store_t` stays f32 there, so what a kernel writes
//!   (O, intermediates) is f32. A shader that indexes such an input directly instead of through
//!   its accessor does not read bf16: the bf16 variant refuses it ([`GpuError::Unsupported`]).
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
    /// 2-byte IEEE half floats (needs SHADER_F16); bf16 inputs are converted to this or f32.
    F16,
    /// bfloat16 inputs (2 bytes, the upper half of an f32), read as 16-bit words and widened
    /// in the kernels (exact); what the kernels write (O) is f32 ([`Storage::output`]), which a
    /// prefill plan converts into the caller's O view (bf16 included). The portable scalar
    /// kernels of the prefill read it (pyramid, route, stage-2 scoring, sparse attention, on
    /// every device, no feature needed); the cooperative-matrix, split-K and NVIDIA kernels and
    /// the decode cache do not, and refuse it with [`GpuError::Unsupported`] (use f16 storage
    /// with bf16 views there: they are converted on the GPU).
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
    for line in shader.wgsl.lines() {
        let t = line.trim_start();
        let mut replaced = false;
        if t.starts_with("alias store_t = f32;") && storage == Storage::F16 {
            out.push_str("alias store_t = f16;\n");
            continue;
        }
        if let Some((name, vec4)) = input_binding(t) {
            let (decl, load) = input_accessor(name, vec4, storage);
            let line = match storage {
                Storage::Bf16 => line.replace(
                    if vec4 {
                        "array<vec4<store_t>>"
                    } else {
                        "array<store_t>"
                    },
                    decl,
                ),
                _ => line.to_string(),
            };
            out.push_str(&line);
            out.push('\n');
            out.push_str(&load);
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
    if storage == Storage::Bf16 {
        if let Some(name) = inputs.iter().find(|n| indexes_directly(shader.wgsl, n)) {
            return Err(GpuError::Unsupported(format!(
                "bf16 storage: the {} kernel reads its input `{name}` as f32/f16 only; use f16 or f32 storage (bf16 views are converted on the GPU)",
                shader.name
            )));
        }
    }
    Ok(out)
}

/// `(name, is vec4)` of a read-only input binding line `... var<storage, read> name:
/// array<store_t>;` (or `array<vec4<store_t>>`).
fn input_binding(t: &str) -> Option<(&str, bool)> {
    let rest = t.split("var<storage, read> ").nth(1)?;
    let (name, ty) = rest.split_once(':')?;
    match ty.trim() {
        "array<store_t>;" => Some((name.trim(), false)),
        "array<vec4<store_t>>;" => Some((name.trim(), true)),
        _ => None,
    }
}

/// The array type an input is bound as for `storage` (bf16 only) and its load accessor.
fn input_accessor(name: &str, vec4: bool, storage: Storage) -> (&'static str, String) {
    match (storage, vec4) {
        (Storage::Bf16, false) => (
            "array<u32>",
            format!(
                "fn in_{name}(i: u32) -> f32 {{ let w = {name}[i >> 1u]; \
                 return bitcast<f32>(select(w << 16u, w & 0xFFFF0000u, (i & 1u) == 1u)); }}\n"
            ),
        ),
        (Storage::Bf16, true) => (
            "array<vec2<u32>>",
            format!(
                "fn in4_{name}(i: u32) -> vec4<f32> {{ let w = {name}[i]; \
                 return bitcast<vec4<f32>>(vec4<u32>(w.x << 16u, w.x & 0xFFFF0000u, \
                 w.y << 16u, w.y & 0xFFFF0000u)); }}\n"
            ),
        ),
        (_, false) => (
            "",
            format!("fn in_{name}(i: u32) -> f32 {{ return f32({name}[i]); }}\n"),
        ),
        (_, true) => (
            "",
            format!("fn in4_{name}(i: u32) -> vec4<f32> {{ return vec4<f32>({name}[i]); }}\n"),
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
}

/// `PISA_DUMP_WGSL=<dir>` (a diagnostic knob): writes the preprocessed WGSL of every pipeline
/// the process builds to `<dir>/<shader>.<entry>.<F16|F32>.<hash of constants and overrides>.wgsl`, its
/// first lines `// entry: <entry>` and `// overrides: <name>=<value>,...` (the pipeline's
/// override constants), for offline tools (`tests/shader_stats.rs` reads the driver's
/// register and memory statistics of each). A write that fails is reported on stderr and
/// otherwise ignored: the dump never changes what runs.
fn dump_wgsl(key: &Key, src: &str) {
    let Some(dir) = std::env::var_os("PISA_DUMP_WGSL") else {
        return;
    };
    if let Err(e) = dump_to(std::path::Path::new(&dir), key, src) {
        eprintln!(
            "PISA_DUMP_WGSL: cannot write into {}: {e}",
            dir.to_string_lossy()
        );
    }
}

/// [`dump_wgsl`] into `dir` (made if missing); returns the file written.
fn dump_to(dir: &std::path::Path, key: &Key, src: &str) -> std::io::Result<std::path::PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.consts.hash(&mut h);
    key.overrides.hash(&mut h);
    let name = format!(
        "{}.{}.{:?}.{:016x}.wgsl",
        key.name,
        key.entry,
        key.storage,
        h.finish()
    );
    let path = dir.join(name);
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
    /// An empty cache whose pipelines will be built with `checks`.
    pub fn new(checks: ShaderChecks) -> Self {
        Self {
            map: Mutex::default(),
            checks,
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
        let src = preprocess(shader, storage, consts)?;
        dump_wgsl(&key, &src);
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
    let module = naga::front::wgsl::parse_str(&src)
        .unwrap_or_else(|e| panic!("{} {consts:?}: {}", shader.name, e.emit_to_string(&src)));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{} {consts:?}: {}", shader.name, e.emit_to_string(&src)));
    let ep = module
        .entry_points
        .iter()
        .position(|e| e.name == entry)
        .unwrap_or_else(|| panic!("{} has no entry point {entry}", shader.name));
    let uses = info.get_entry_point(ep);
    module
        .global_variables
        .iter()
        .filter(|(h, v)| v.space == naga::AddressSpace::WorkGroup && !uses[*h].is_empty())
        .map(|(_, v)| module.types[v.ty].inner.size(module.to_ctx()) as u64)
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
