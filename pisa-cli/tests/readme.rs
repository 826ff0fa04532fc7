//! README.md stays true: its library example compiles against the real API (the lines below are
//! the README's, checked verbatim), and every `pisa ...` command line in it parses (run with
//! `--help` appended, which exits 0 only when every flag before it is known and well-formed);
//! docs/gl-backend.md's sample `pisa info` output has the lines `pisa info` prints.

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

/// The README's library example (compiled, not run: it needs the app's device and buffers;
/// `pisa-wgpu/tests/embedding.rs` runs the same flow).
#[allow(dead_code, unused_variables, clippy::too_many_arguments)]
#[rustfmt::skip]
fn readme_library_example(
    adapter: pisa_wgpu::wgpu::Adapter,
    device: pisa_wgpu::wgpu::Device,
    queue: pisa_wgpu::wgpu::Queue,
    qkv: pisa_wgpu::wgpu::Buffer,
    o: pisa_wgpu::TensorView,
    lse: pisa_wgpu::TensorView,
    k_rows: pisa_wgpu::TensorView,
    v_rows: pisa_wgpu::TensorView,
    q_row: pisa_wgpu::TensorView,
    o_row: pisa_wgpu::TensorView,
    lse_row: pisa_wgpu::TensorView,
) -> anyhow::Result<()> {
    let (hq, hkv, d, t, batch, capacity) = (32usize, 8usize, 128usize, 4096usize, 1usize, 8192usize);
    let mut encoder = device.create_command_encoder(&Default::default());
    // ---- README.md "Library use", verbatim ----
use pisa_core::{AttentionShape, SelectionConfig};
use pisa_wgpu::ops::decode::{KvCache, StepOutputs};
use pisa_wgpu::ops::prefill::{PlanViews, PrefillOptions, PrefillOutputs, PrefillPlan};
use pisa_wgpu::{Context, DType, Storage, TensorView};

// The app's device: adapter.request_device(&pisa_wgpu::app_device_descriptor(&adapter)), or
// your own descriptor with pisa_wgpu::wanted_features(&adapter) and adapter.limits() (less
// EXPERIMENTAL_COOPERATIVE_MATRIX unless it enables wgpu's experimental features).
// pisa never replaces its callbacks; pisa's errors come back as Results (error scopes).
let ctx = Context::from_device(&adapter, device.clone(), queue.clone())?;

// Views of the app's buffers: byte offset, dtype (f32, f16, bf16), shape [B, H, N, D], strides.
// A packed QKV projection [T, (Hq + 2 Hkv) * D] is read as it is:
let row = (hq + 2 * hkv) * d;
let q = TensorView::new(&qkv, 0, DType::F32, [1, hq, t, d], [t * row, d, row, 1])?;
let k = TensorView::new(&qkv, (hq * d * 4) as u64, DType::F32, [1, hkv, t, d], [t * row, d, row, 1])?;
let v = TensorView::new(&qkv, ((hq + hkv) * d * 4) as u64, DType::F32, [1, hkv, t, d], [t * row, d, row, 1])?;

// Prefill: plan once per shape (pipelines, scratch, parameters, bind groups), run every call.
// Views the kernels read in place need no copy: plan for them (O, in another buffer, written
// in place too); PrefillPlan::new(&ctx, &shape, &opts) plans for views of any layout.
let shape = AttentionShape::prefill(1, hq, hkv, t, d)?;
let opts = PrefillOptions { cfg: SelectionConfig::new(64, 16)?, storage: Storage::F32, ..Default::default() };
let plan = PrefillPlan::new_in_place(&ctx, &shape, &opts, &PlanViews { q: &q, k: &k, v: &v, out: Some(&o) })?;
plan.run(&mut encoder, &q, &k, &v, &PrefillOutputs { out: &o, lse: &lse, selection: None }, None)?;
// Varlen (as flash_attn_varlen_func): VarlenPrefillPlan::run(&mut encoder, &cu_seqlens, ...).

// Decode: a cache owns a clone of the context (an engine struct can own both).
let mut cache = KvCache::new(&ctx, batch, capacity, hq, hkv, d, opts.cfg, Storage::F32)?;
cache.record_prefill_from_plan(&mut encoder, 0, &plan, 0)?; // take over the prefill's K/V and pyramid
cache.record_append_view(&mut encoder, &k_rows, &v_rows, &vec![true; batch], None)?;
cache.record_step_into(&mut encoder, &q_row, Some(&StepOutputs { out: &o_row, lse: &lse_row, selection: None }), None)?;
queue.submit([encoder.finish()]);
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

/// docs/gl-backend.md's sample `pisa info` output has the lines `pisa info` prints (by their
/// first word, in order; the adapter-specific NVIDIA line aside). Regression: it lacked the
/// `routing:` line added to `pisa info`.
#[test]
fn gl_backend_info_sample_has_the_lines_of_pisa_info() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/gl-backend.md"),
    )
    .unwrap();
    let labels = |text: &str| -> Vec<String> {
        (text.lines())
            .skip_while(|l| !l.starts_with("[0] "))
            .skip(1)
            .take_while(|l| l.starts_with("    "))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|w| !w.starts_with("VK_NV"))
            .map(str::to_string)
            .collect()
    };
    let sample = labels(&doc);
    assert!(
        sample.len() >= 4,
        "no `pisa info` sample in docs/gl-backend.md"
    );
    let dir = tempfile::tempdir().unwrap();
    let info = common::run_in(dir.path(), &["info"]).ok().stdout;
    assert_eq!(sample, labels(&info), "pisa info prints:\n{info}");
}
