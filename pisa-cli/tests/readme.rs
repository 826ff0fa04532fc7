//! README.md stays true: its library example compiles against the real API (the lines below are
//! the README's, checked verbatim), and every `pisa ...` command line in it parses (run with
//! `--help` appended, which exits 0 only when every flag before it is known and well-formed).

mod common;

use std::path::Path;

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap()
}

/// The lines of the README's fenced blocks of language `lang`.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("```") {
            inside = !inside && line.trim_start_matches('`') == lang;
        } else if inside {
            out.push(line.to_string());
        }
    }
    out
}

/// The README's library example (compiled, not run: its shape is a real model's, too slow for
/// lavapipe; `cli_forward.rs` runs `prefill_host` through `pisa forward`).
#[allow(dead_code)]
#[rustfmt::skip]
fn readme_library_example() -> anyhow::Result<()> {
    let (q, k, v) = (vec![0f32; 32 * 4096 * 128], vec![0f32; 8 * 4096 * 128], vec![0f32; 8 * 4096 * 128]);
    // ---- README.md "Library use", verbatim ----
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::{AdapterChoice, Context, Storage};
use pisa_wgpu::ops::prefill::{prefill_host, PrefillOptions};

let ctx = Context::new(&AdapterChoice::HighPerformance)?;      // errors clearly when no adapter
let shape = AttentionShape::prefill(1, 32, 8, 4096, 128)?;       // B, Hq, Hkv, N, D (GQA group 4)
let cfg = SelectionConfig::new(64, 16)?;                          // C = 64, top_k = 16, causal, lse
let opts = PrefillOptions { cfg, layout: TensorLayout::Bhnd, storage: Storage::F16, q_tile: 4, return_selection: true };
let out = prefill_host(&ctx, &q, &k, &v, &shape, &opts)?;         // q: [B,Hq,N,D] f32, k/v: [B,Hkv,N,D]
println!("O {} values, LSE {}, GPU {:.3} ms", out.out.len(), out.lse.len(), out.times.total());
    // ---- end ----
    Ok(())
}

#[test]
fn library_example_is_the_compiled_one() {
    let lines = blocks(&readme(), "rust");
    assert!(!lines.is_empty(), "README has no rust block");
    let this = include_str!("readme.rs");
    for l in lines.iter().filter(|l| !l.trim().is_empty()) {
        assert!(
            this.lines().any(|t| t == l),
            "README line not in readme_library_example(): {l}"
        );
    }
}

#[test]
fn command_lines_parse() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    for line in blocks(&readme(), "sh") {
        let cmd = line.split('#').next().unwrap().trim();
        let Some(args) = cmd.strip_prefix("pisa ") else {
            continue;
        };
        let mut args: Vec<&str> = args.split_whitespace().collect();
        args.push("--help");
        let r = common::run_in(dir.path(), &args);
        assert_eq!(r.code, Some(0), "README: `{cmd}`: {}", r.stderr);
        n += 1;
    }
    assert!(n >= 6, "only {n} `pisa` command lines found in README.md");
}
