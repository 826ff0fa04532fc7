//! Builds the NVIDIA cooperative-matrix-2 kernels of pisa (GLSL with `GL_NV_cooperative_matrix2`,
//! `shaders/nv/*.comp`) into the SPIR-V the library embeds (`shaders/nv/spv/*.spv`), with the
//! glslang this crate pins: `glslang = "=0.9.1"` in Cargo.toml and its `glslang-sys` (the C++
//! sources, built by cargo) in this crate's own Cargo.lock, used with `--locked` in CI. The same
//! compiler on every machine, so the output is byte-for-byte reproducible.
//!
//! `shaders/nv/kernels.txt` lists the variants, one a line: `name source.comp [NAME=VALUE ...]`
//! (the defines of that variant). `#include "file"` lines are expanded from `shaders/nv/`
//! before glslang sees the source, so glslang's include extension is not needed (glslang's line
//! numbers then count lines of the expanded source: `common.glsl` and the other includes come
//! first).
//!
//! Usage (from the repository root):
//! - `cargo run --release --manifest-path tools/spirv/Cargo.toml` writes every variant;
//! - `... -- --check` writes nothing and exits 1 when an embedded `.spv` differs from what its
//!   source makes, or when a `.spv` is missing or left over (CI runs this).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use glslang::{
    Compiler, CompilerOptions, ShaderInput, ShaderSource, ShaderStage, SourceLanguage,
    SpirvVersion, Target, VulkanVersion,
};

struct Variant {
    name: String,
    source: String,
    defines: Vec<(String, String)>,
}

fn variants(dir: &Path) -> Result<Vec<Variant>, String> {
    let list = dir.join("kernels.txt");
    let text = std::fs::read_to_string(&list).map_err(|e| format!("{}: {e}", list.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(name), Some(source)) = (words.next(), words.next()) else {
            return Err(format!(
                "kernels.txt:{}: expected `name source [DEFINES]`",
                i + 1
            ));
        };
        let defines = words
            .map(|w| {
                w.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .ok_or_else(|| format!("kernels.txt:{}: `{w}` is not NAME=VALUE", i + 1))
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push(Variant {
            name: name.to_string(),
            source: source.to_string(),
            defines,
        });
    }
    Ok(out)
}

/// `path`'s text with its `#include "file"` lines replaced by the files (from `dir`, once each).
fn expand(dir: &Path, file: &str, seen: &mut BTreeSet<String>) -> Result<String, String> {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("#include") {
            let inc = rest.trim().trim_matches('"');
            if seen.insert(inc.to_string()) {
                out.push_str(&expand(dir, inc, seen)?);
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    Ok(out)
}

fn compile(dir: &Path, v: &Variant) -> Result<Vec<u8>, String> {
    let text = expand(dir, &v.source, &mut BTreeSet::new())?;
    // The defines go right after the `#version` line (glslang wants it first).
    let (version, body) = text
        .split_once('\n')
        .filter(|(first, _)| first.starts_with("#version"))
        .ok_or_else(|| format!("{}: the first line must be #version", v.source))?;
    let defs: String = v
        .defines
        .iter()
        .map(|(k, val)| format!("#define {k} {val}\n"))
        .collect();
    let full = format!("{version}\n{defs}{body}");
    let compiler = Compiler::acquire().ok_or("glslang could not be initialised")?;
    let source = ShaderSource::from(full);
    let options = CompilerOptions {
        source_language: SourceLanguage::GLSL,
        target: Target::Vulkan {
            version: VulkanVersion::Vulkan1_3,
            spirv_version: SpirvVersion::SPIRV1_6,
        },
        ..Default::default()
    };
    let input = ShaderInput::new(
        &source,
        ShaderStage::Compute,
        &options,
        None::<&[(&str, Option<&str>)]>,
        None,
    )
    .map_err(|e| format!("{}: {e}", v.name))?;
    let shader = compiler
        .create_shader(input)
        .map_err(|e| format!("{} ({}): {e}", v.name, v.source))?;
    let words = shader
        .compile()
        .map_err(|e| format!("{} ({}): {e}", v.name, v.source))?;
    Ok(words.iter().flat_map(|w| w.to_le_bytes()).collect())
}

fn run(root: &Path, check: bool) -> Result<bool, String> {
    let dir = root.join("shaders/nv");
    let out_dir = dir.join("spv");
    let list = variants(&dir)?;
    let mut ok = true;
    let mut names = BTreeSet::new();
    for v in &list {
        let spv = compile(&dir, v)?;
        let path = out_dir.join(format!("{}.spv", v.name));
        let shown = format!("shaders/nv/spv/{}.spv", v.name);
        names.insert(format!("{}.spv", v.name));
        if check {
            match std::fs::read(&path) {
                Ok(old) if old == spv => println!("same     {shown}"),
                Ok(_) => {
                    println!("DIFFERS  {shown}");
                    ok = false;
                }
                Err(_) => {
                    println!("MISSING  {shown}");
                    ok = false;
                }
            }
        } else {
            std::fs::create_dir_all(&out_dir).map_err(|e| e.to_string())?;
            std::fs::write(&path, &spv).map_err(|e| format!("{}: {e}", path.display()))?;
            println!("wrote    {shown} ({} bytes)", spv.len());
        }
    }
    if let Ok(entries) = std::fs::read_dir(&out_dir) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.ends_with(".spv") && !names.contains(&n) {
                println!("LEFTOVER {} (not in kernels.txt)", e.path().display());
                ok = false;
            }
        }
    }
    Ok(ok)
}

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let root = std::env::var_os("PISA_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."));
    match run(&root, check) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!(
                "the embedded SPIR-V is not what shaders/nv makes: run \
                 `cargo run --release --manifest-path tools/spirv/Cargo.toml` and commit"
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
