//! Every pipeline pisa builds, translated by naga for the backends other than Vulkan: Metal
//! (MSL), DirectX 12 (HLSL) and OpenGL / OpenGL ES (GLSL), and the GLSL compiled with glslang
//! (docs/portability.md).
//!
//! Which pipelines: the ones a real run builds. `every_built_pipeline_translates` runs the
//! operations (prefill in f32 and f16 in query-tile and leaf-major order, Lse and MeanVar
//! scoring; dense attention on the tile kernel and split-K; the backward pass; the BSA and
//! oracle selections; decode steps split and fused with appends; gathers and scatters of f32,
//! f16 and bf16 views; random fills) with `PISA_DUMP_WGSL` set, and translates each pipeline's
//! dumped WGSL with the override values the pipeline was built with (the dump's second line).
//! `every_shader_family_translates` adds every shader family in f32 and f16 with its default
//! constants and overrides, the tensor-core families included (no lavapipe device runs them).
//!
//! Options follow what wgpu 30 gives naga for pisa's pipelines off Vulkan (pisa's
//! `ShaderChecks::Bounds`): array and buffer indices `Restrict`ed (MSL, HLSL; wgpu's GL backend
//! leaves them to GLSL), no loop bounding, no integer-division guards, workgroup memory not
//! zero-initialised. MSL 2.4; HLSL shader model 6.0 (6.2 for f16, which needs it); GLSL ES 3.10
//! (the least wgpu's GL backend runs compute on), desktop GLSL 4.30 core (OpenGL 4.3, the first
//! with compute shaders) and 4.50 core (what wgpu asks of an OpenGL 4.5 or later driver).
//!
//! What is compiled: the GLSL, every version, with `glslangValidator` (Debian `glslang-tools`,
//! installed by scripts/test.sh); the step is skipped, with a message, when the tool is missing.
//! The MSL and the HLSL are only emitted (naga validates the module it translates, and its back
//! ends refuse what they cannot express): Debian packages no Metal compiler and no DXC, and
//! glslang's HLSL front end stops at shader model 5.
//!
//! Known exclusions ([`excluded`]), each with its reason:
//! - f16 pipelines in GLSL: naga 30's GLSL back end has no 16-bit float type
//!   (`UnsupportedScalar`), and wgpu's GL backend never offers SHADER_F16, so pisa never builds
//!   them there (it stores f32 instead);
//! - the cooperative-matrix (tensor-core) shaders in HLSL and GLSL: naga 30 writes cooperative
//!   matrices for SPIR-V and MSL (simdgroup matrices) only; pisa builds them only on an adapter
//!   that reports cooperative-matrix support.
//!
//! No known compile failure ([`known_glslang_failure`]): the routing kernel's integer vector
//! `select`, which desktop GLSL 4.30 could not take from naga, is written without it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use naga::back::{glsl, hlsl, msl};
use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::select::{oracle_host, select_host, Method};
use pisa_wgpu::ops::{attention, backward, fill};
use pisa_wgpu::runtime::pipeline::{preprocess, Storage};
use pisa_wgpu::{
    wgpu, AdapterChoice, Context, DType, KvCache, LeafOrder, PrefillOptions, PrefillOutputs,
    PrefillPlan, TensorView,
};

/// A backend naga writes for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Backend {
    Msl,
    Hlsl,
    /// GLSL ES 3.10.
    GlslEs310,
    /// Desktop GLSL 4.30 core (OpenGL 4.3, the first with compute shaders).
    Glsl430,
    /// Desktop GLSL 4.50 core (what wgpu asks of any OpenGL 4.5 or later driver).
    Glsl450,
}

const BACKENDS: [Backend; 5] = [
    Backend::Msl,
    Backend::Hlsl,
    Backend::GlslEs310,
    Backend::Glsl430,
    Backend::Glsl450,
];

impl Backend {
    fn is_glsl(self) -> bool {
        matches!(
            self,
            Backend::GlslEs310 | Backend::Glsl430 | Backend::Glsl450
        )
    }
}

/// One pipeline to translate: a label, its WGSL, its entry point and its override values.
struct Pipeline {
    label: String,
    src: String,
    entry: String,
    overrides: naga::back::PipelineConstants,
}

impl Pipeline {
    fn f16(&self) -> bool {
        self.src.starts_with("enable f16;") || self.src.contains("\nenable f16;")
    }
    fn coop(&self) -> bool {
        self.src.contains("enable wgpu_cooperative_matrix")
    }
}

/// The reason `p` is not translated for `b`, for the known-unsupported cases only.
fn excluded(p: &Pipeline, b: Backend) -> Option<&'static str> {
    if p.coop() && b != Backend::Msl {
        return Some("cooperative matrices: naga writes them for SPIR-V and MSL only");
    }
    if p.f16() && b.is_glsl() {
        return Some("f16: no 16-bit floats in naga's GLSL, no SHADER_F16 on wgpu's GL backend");
    }
    None
}

/// pisa's bounds checks off Vulkan (`ShaderChecks::Bounds`): indices clamped.
fn restrict() -> BoundsCheckPolicies {
    BoundsCheckPolicies {
        index: BoundsCheckPolicy::Restrict,
        buffer: BoundsCheckPolicy::Restrict,
        image_load: BoundsCheckPolicy::Unchecked,
        binding_array: BoundsCheckPolicy::Unchecked,
    }
}

/// `p`'s module, validated, with its overrides applied: what naga's back ends take.
fn prepare(p: &Pipeline) -> Result<(naga::Module, naga::valid::ModuleInfo), String> {
    let src = &p.src;
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(src))?;
    let stage = Some((naga::ShaderStage::Compute, p.entry.as_str()));
    let (module, info) =
        naga::back::pipeline_constants::process_overrides(&module, &info, stage, &p.overrides)
            .map_err(|e| format!("overrides: {e}"))?;
    Ok((module.into_owned(), info.into_owned()))
}

/// naga's translation of `p` (`prepared` by [`prepare`]) for `b`: the source text, or naga's
/// error.
fn translate(
    p: &Pipeline,
    (module, info): &(naga::Module, naga::valid::ModuleInfo),
    b: Backend,
) -> Result<String, String> {
    let (module, info) = (module, info);
    let entry = (naga::ShaderStage::Compute, p.entry.clone());
    match b {
        Backend::Msl => {
            let options = msl::Options {
                lang_version: (2, 4),
                bounds_check_policies: restrict(),
                zero_initialize_workgroup_memory: false,
                force_loop_bounding: false,
                emit_int_div_checks: false,
                fake_missing_bindings: true,
                ..Default::default()
            };
            let pipe = msl::PipelineOptions {
                entry_point: Some(entry),
                ..Default::default()
            };
            msl::write_string(module, info, &options, &pipe)
                .map(|(s, _)| s)
                .map_err(|e| format!("{e:?}"))
        }
        Backend::Hlsl => {
            let options = hlsl::Options {
                shader_model: if p.f16() {
                    hlsl::ShaderModel::V6_2
                } else {
                    hlsl::ShaderModel::V6_0
                },
                restrict_indexing: true,
                force_loop_bounding: false,
                zero_initialize_workgroup_memory: false,
                fake_missing_bindings: true,
                ..Default::default()
            };
            let pipe = hlsl::PipelineOptions {
                entry_point: Some(entry),
            };
            let mut out = String::new();
            hlsl::Writer::new(&mut out, &options, &pipe)
                .write(module, info, None)
                .map_err(|e| format!("{e:?}"))?;
            Ok(out)
        }
        Backend::GlslEs310 | Backend::Glsl430 | Backend::Glsl450 => {
            let version = match b {
                Backend::GlslEs310 => glsl::Version::Embedded {
                    version: 310,
                    is_webgl: false,
                },
                Backend::Glsl430 => glsl::Version::Desktop(430),
                _ => glsl::Version::Desktop(450),
            };
            let options = glsl::Options {
                version,
                writer_flags: glsl::WriterFlags::empty(),
                zero_initialize_workgroup_memory: false,
                ..Default::default()
            };
            let pipe = glsl::PipelineOptions {
                shader_stage: naga::ShaderStage::Compute,
                entry_point: p.entry.clone(),
                multiview: None,
            };
            let mut out = String::new();
            let mut w = glsl::Writer::new(
                &mut out,
                module,
                info,
                &options,
                &pipe,
                BoundsCheckPolicies::default(),
            )
            .map_err(|e| format!("{e:?}"))?;
            w.write().map_err(|e| format!("{e:?}"))?;
            Ok(out)
        }
    }
}

/// Whether `glslangValidator` runs here.
fn glslang() -> bool {
    Command::new("glslangValidator")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// glslang's messages for each of `files` (compute shaders, each compiled on its own) that
/// fails to compile, by file; one process for all of them.
fn glslang_failures(files: &[PathBuf]) -> BTreeMap<PathBuf, String> {
    let mut failed = BTreeMap::new();
    for chunk in files.chunks(200) {
        let out = Command::new("glslangValidator")
            .args(chunk)
            .output()
            .expect("glslangValidator runs");
        if out.status.success() {
            continue;
        }
        // Each file's messages follow a line holding its path.
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let mut current: Option<&PathBuf> = None;
        for line in text.lines() {
            if let Some(f) = chunk.iter().find(|f| f.as_os_str() == line.trim()) {
                current = Some(f);
            } else if let Some(f) = current.filter(|_| !line.trim().is_empty()) {
                let msg: &mut String = failed.entry(f.clone()).or_default();
                msg.push_str(line);
                msg.push('\n');
            }
        }
        assert!(
            !failed.is_empty(),
            "glslangValidator failed without naming a file:\n{text}"
        );
    }
    failed
}

/// The GLSL outputs glslang refuses for a known reason, and the message it gives: none. (The
/// routing kernel's `select` of `vec4<u32>`, which naga 30 writes as GLSL `mix` and desktop
/// GLSL has for integers only from 4.50, is written as a bool-vector conversion and a mask in
/// shaders/route.wgsl, so it compiles for OpenGL 4.3 too.)
fn known_glslang_failure(_label: &str, _b: Backend) -> Option<&'static str> {
    None
}

/// Translates every pipeline for every backend (and compiles the GLSL where glslang is
/// installed); panics listing every failure.
fn check_all(what: &str, pipelines: &[Pipeline]) {
    let tool = glslang();
    if !tool {
        eprintln!(
            "{what}: glslangValidator is not installed (Debian: glslang-tools): the GLSL is \
             emitted but not compiled"
        );
    }
    let dir = std::env::temp_dir().join(format!("pisa-translate-{}-{what}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    let mut done: BTreeMap<Backend, usize> = BTreeMap::new();
    let mut skipped: BTreeMap<String, usize> = BTreeMap::new();
    // GLSL files to compile: (path, pipeline label, backend).
    let mut glsl_files: Vec<(PathBuf, &str, Backend)> = Vec::new();
    let t0 = std::time::Instant::now();
    for (i, p) in pipelines.iter().enumerate() {
        let prepared = match prepare(p) {
            Ok(m) => m,
            Err(e) => {
                failures.push(format!("{}: {e}", p.label));
                continue;
            }
        };
        for b in BACKENDS {
            if let Some(why) = excluded(p, b) {
                *skipped.entry(format!("{b:?}: {why}")).or_default() += 1;
                continue;
            }
            match translate(p, &prepared, b) {
                Err(e) => failures.push(format!("{} -> {b:?}: {e}", p.label)),
                Ok(text) => {
                    *done.entry(b).or_default() += 1;
                    if b.is_glsl() && tool {
                        let path = dir.join(format!("p{i}.{b:?}.comp"));
                        std::fs::write(&path, text).unwrap();
                        glsl_files.push((path, &p.label, b));
                    }
                }
            }
        }
    }
    let t1 = std::time::Instant::now();
    let paths: Vec<PathBuf> = glsl_files.iter().map(|f| f.0.clone()).collect();
    let mut refused = if tool {
        glslang_failures(&paths)
    } else {
        BTreeMap::new()
    };
    let mut known = 0;
    for (path, label, b) in &glsl_files {
        let msg = refused.remove(path);
        match (known_glslang_failure(label, *b), msg) {
            (None, None) => {}
            (None, Some(m)) => failures.push(format!("{label} -> {b:?}: glslangValidator: {m}")),
            (Some(k), Some(m)) if m.contains(k) => known += 1,
            (Some(k), m) => failures.push(format!(
                "{label} -> {b:?}: glslang was expected to refuse it for {k} (known_glslang_failure), \
                 got {m:?}: update the list"
            )),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{what}: translated in {:.1} s, compiled in {:.1} s",
        (t1 - t0).as_secs_f64(),
        t1.elapsed().as_secs_f64()
    );
    eprintln!(
        "{what}: {} pipelines; translated {done:?}; GLSL compiled by glslang: {} ({known} refused \
         as known); excluded {skipped:?}",
        pipelines.len(),
        if tool { glsl_files.len() } else { 0 },
    );
    assert!(
        failures.is_empty(),
        "{what}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A dumped pipeline (`PISA_DUMP_WGSL`): entry point and overrides from its first two lines.
fn read_dump(path: &Path) -> Pipeline {
    let src = std::fs::read_to_string(path).unwrap();
    let mut lines = src.lines();
    let entry = lines
        .next()
        .and_then(|l| l.strip_prefix("// entry: "))
        .expect("first line names the entry point")
        .trim()
        .to_string();
    let line = lines
        .next()
        .and_then(|l| l.strip_prefix("// overrides: "))
        .expect("second line lists the overrides");
    let mut overrides = naga::back::PipelineConstants::default();
    for kv in line.split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').expect("name=value");
        overrides.insert(k.to_string(), v.parse().expect("a number"));
    }
    // The comment lines stay: the source still parses, and "enable" stays first of the code.
    let label = path.file_name().unwrap().to_string_lossy().into_owned();
    Pipeline {
        label,
        src,
        entry,
        overrides,
    }
}

/// Deterministic values in [-1, 1).
fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104729) % 1999) as f32 / 999.5 - 1.0)
        .collect()
}

/// A storage buffer of `bytes` holding `init` (zero-padded).
fn buffer(ctx: &Context, init: &[u8], bytes: usize) -> wgpu::Buffer {
    let b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("translate"),
        size: bytes.next_multiple_of(4) as u64,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let mut bytes_in = init.to_vec();
    bytes_in.resize(bytes.next_multiple_of(4), 0);
    ctx.queue().write_buffer(&b, 0, &bytes_in);
    b
}

/// A contiguous BHND view of `[1, h, n, d]` `dtype` values from `vals`.
fn view_of(
    ctx: &Context,
    vals: &[f32],
    dtype: DType,
    shape: [usize; 4],
) -> (wgpu::Buffer, TensorView) {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => bytemuck::cast_slice(vals).to_vec(),
        DType::F16 => (vals.iter())
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        DType::BF16 => (vals.iter())
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        DType::I32 => unreachable!(),
    };
    let n: usize = shape.iter().product();
    let b = buffer(ctx, &bytes, n * dtype.bytes() as usize);
    let v = TensorView::contiguous(&b, 0, dtype, shape, TensorLayout::Bhnd).unwrap();
    (b, v)
}

/// The operations whose pipelines are dumped, at small shapes, for `storage`.
fn run_operations(ctx: &Context, storage: Storage) {
    let (hq, hkv, n, d) = (4, 2, 96, 32);
    let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
    let (q, k, v) = (
        data(shape.q_elems(), 1),
        data(shape.kv_elems(), 2),
        data(shape.kv_elems(), 3),
    );
    let cfg = SelectionConfig::new(16, 3).unwrap().with_forced(1, 1);
    let layout = TensorLayout::Bhnd;
    // Prefill (pyramid, routing, leaf selection, sparse attention) in both orders of stage 2
    // and attention, both scorings.
    let mut last = None;
    for order in [LeafOrder::Tiles, LeafOrder::Leaves, LeafOrder::Auto] {
        ctx.set_leaf_order(order);
        for scoring in [Scoring::Lse, Scoring::MeanVar] {
            let opts = PrefillOptions {
                cfg: cfg.with_scoring(scoring),
                storage,
                return_selection: true,
                ..Default::default()
            };
            let out = pisa_wgpu::prefill_host(ctx, &q, &k, &v, &shape, &opts)
                .unwrap_or_else(|e| panic!("prefill {storage:?} {order:?} {scoring:?}: {e}"));
            last = Some(out);
        }
    }
    ctx.set_leaf_order(LeafOrder::Auto);
    let out = last.unwrap();
    let sel = out.selection.unwrap();
    // Baselines: BSA, the oracle (selection, and with the leaf mass).
    for method in [Method::Bsa, Method::Oracle, Method::Pisa] {
        select_host(ctx, &q, &k, &shape, layout, &cfg, storage, method, 4)
            .unwrap_or_else(|e| panic!("select {method:?} {storage:?}: {e}"));
    }
    oracle_host(ctx, &q, &k, &shape, layout, &cfg, storage).expect("oracle with mass");
    // Dense attention: query tiles, and split-K (few queries, many keys).
    attention::dense_attention_host(ctx, &q, &k, &v, &shape, layout, true, 0.2, storage)
        .expect("dense attention");
    let nk = attention::split_k::MIN_KEYS + 64;
    let dshape = AttentionShape::new(1, hq, hkv, 1, nk, d).unwrap();
    let (dq, dk, dv) = (
        data(dshape.q_elems(), 4),
        data(dshape.kv_elems(), 5),
        data(dshape.kv_elems(), 6),
    );
    attention::dense_attention_host(ctx, &dq, &dk, &dv, &dshape, layout, false, 0.2, storage)
        .expect("split-K attention");
    // Backward over the prefill's selection.
    let d_o = data(shape.q_elems(), 7);
    backward::backward_host(
        ctx, &q, &k, &v, &out.out, &out.lse, &d_o, &shape, layout, &cfg, storage, &sel,
    )
    .expect("backward");
    // Decode: prefilled caches, appends and steps, split and fused.
    for fused in [false, true] {
        let (b, cap) = (2, 160);
        let mut cache = KvCache::new(ctx, b, cap, hq, hkv, d, cfg, storage).expect("cache");
        cache.set_fused(fused);
        for seq in 0..b {
            let p = 100 + 17 * seq;
            let (kk, vv) = (data(hkv * p * d, 8 + seq), data(hkv * p * d, 9 + seq));
            cache.prefill(seq, &kk, &vv, layout).expect("cache prefill");
        }
        for step in 0..2 {
            let rows = b * hkv * d;
            let qd = data(b * hq * d, 20 + step);
            cache
                .append_and_step(
                    &data(rows, 10 + step),
                    &data(rows, 11 + step),
                    &[true, step == 0],
                    &qd,
                    true,
                )
                .unwrap_or_else(|e| panic!("decode fused={fused} {storage:?}: {e}"));
        }
    }
    // A planned prefill over views of other dtypes: gathers in, scatters out.
    let plan_opts = PrefillOptions {
        cfg,
        storage,
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &shape, &plan_opts).expect("plan");
    for (in_t, out_t) in [(DType::BF16, DType::F32), (DType::F16, DType::BF16)] {
        let (_qb, qv) = view_of(ctx, &q, in_t, [1, hq, n, d]);
        let (_kb, kv) = view_of(ctx, &k, in_t, [1, hkv, n, d]);
        let (_vb, vv) = view_of(ctx, &v, in_t, [1, hkv, n, d]);
        let (_ob, ov) = view_of(ctx, &q, out_t, [1, hq, n, d]);
        let (lb, lv) = view_of(ctx, &q[..hq * n], DType::F32, [1, hq, n, 1]);
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let outs = PrefillOutputs {
            out: &ov,
            lse: &lv,
            selection: None,
        };
        plan.run(&mut enc, &qv, &kv, &vv, &outs, None)
            .unwrap_or_else(|e| panic!("planned prefill {in_t:?} -> {out_t:?}: {e}"));
        ctx.queue().submit([enc.finish()]);
        ctx.read_bytes(&lb).expect("planned prefill ran");
    }
    // Random fills.
    fill::random_tensor(ctx, "fill", 1000, storage, 1, 1.0).expect("fill");
}

/// Every pipeline built by a run of pisa's operations (f32 and, where the adapter has
/// SHADER_F16, f16 storage) translates for MSL, HLSL and GLSL, and the GLSL compiles.
#[test]
fn every_built_pipeline_translates() {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("pisa-translate-dump-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Read by Context::new (Tuning::dump_wgsl); this binary's only test that builds pipelines.
    std::env::set_var("PISA_DUMP_WGSL", &dir);
    let ctx = Context::new(&AdapterChoice::HighPerformance)
        .expect("a GPU adapter (install mesa-vulkan-drivers)");
    let t0 = std::time::Instant::now();
    run_operations(&ctx, Storage::F32);
    if ctx.has_f16() {
        run_operations(&ctx, Storage::F16);
    } else {
        eprintln!("adapter without SHADER_F16: f16 pipelines not built");
    }
    ctx.wait().unwrap();
    eprintln!("operations ran in {:.1} s", t0.elapsed().as_secs_f64());
    std::env::remove_var("PISA_DUMP_WGSL");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("pipelines were dumped")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
        .collect();
    files.sort();
    let pipelines: Vec<Pipeline> = files.iter().map(|f| read_dump(f)).collect();
    let mut families: Vec<&str> = (files.iter())
        .map(|f| {
            f.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .split('.')
                .next()
                .unwrap()
        })
        .collect();
    families.dedup();
    eprintln!("built: {families:?}");
    check_all("built", &pipelines);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every shader family (`ops::all_shaders`, the decode lengths shader and the tensor-core
/// shaders), f32 and f16, each entry point with the default constants and overrides.
#[test]
fn every_shader_family_translates() {
    use pisa_wgpu::ops::{attention as at, decode, leaf_select as ls};
    let mut shaders = pisa_wgpu::ops::all_shaders();
    shaders.extend([
        decode::LENS_SHADER,
        at::coop::SHADER,
        at::by_leaf::COOP_SHADER,
        ls::coop::SHADER,
        ls::by_leaf::SCORE_COOP_SHADER,
    ]);
    let mut pipelines = Vec::new();
    for s in &shaders {
        for storage in [Storage::F32, Storage::F16] {
            if storage == Storage::F32 && s.name.contains("coop") {
                continue;
            }
            let src = preprocess(s, storage, &[]).unwrap();
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{} {storage:?}: {}", s.name, e.emit_to_string(&src)));
            for ep in &module.entry_points {
                pipelines.push(Pipeline {
                    label: format!("{}.{}.{storage:?} (defaults)", s.name, ep.name),
                    src: src.clone(),
                    entry: ep.name.clone(),
                    overrides: Default::default(),
                });
            }
        }
    }
    check_all("families", &pipelines);
}
