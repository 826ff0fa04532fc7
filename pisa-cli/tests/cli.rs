//! The `pisa` binary on small inputs (issue 4): `--help` of every command, `info` (text and
//! JSON), `forward` in f32/f16/bf16 files, BHND and BNHD, safetensors and `.npy` inputs, checked
//! against the CPU reference (`pisa_core::reference`), `decode --check`, `recall --json`, a tiny
//! `bench --json` and `bench --compare`, and `demo`. Bad inputs are in `cli_bad_input.rs`.
//! Everything runs on the default adapter (lavapipe in CI) at N <= 300.

mod common;

use std::path::Path;

use common::{run_in, write_input, write_npy_input, Spec};
use pisa_cli::io::{read_index_tensor, read_tensor, DType};
use pisa_core::reference::{select_pisa, sparse_attention};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};

#[test]
fn help_on_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let top = run_in(dir.path(), &["--help"]).ok();
    for cmd in ["info", "forward", "decode", "recall", "demo", "bench"] {
        assert!(top.stdout.contains(cmd), "`pisa --help` lacks {cmd}");
        let r = run_in(dir.path(), &[cmd, "--help"]).ok();
        assert!(
            r.stdout.contains(&format!("Usage: pisa {cmd}")),
            "{cmd}: {}",
            r.stdout
        );
    }
    for (cmd, flag) in [
        ("forward", "--save-selection"),
        ("decode", "--check"),
        ("recall", "--top-k"),
        ("bench", "--compare"),
        ("demo", "--tokens"),
        ("info", "--json"),
    ] {
        let r = run_in(dir.path(), &[cmd, "--help"]).ok();
        assert!(r.stdout.contains(flag), "`pisa {cmd} --help` lacks {flag}");
    }
    run_in(dir.path(), &["--version"]).ok();
}

#[test]
fn info_text_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let text = run_in(dir.path(), &["info"]).ok();
    assert!(text.stdout.starts_with("[0] "), "{}", text.stdout);
    assert!(
        text.stdout.contains("max storage binding"),
        "{}",
        text.stdout
    );
    let j = run_in(dir.path(), &["info", "--json"]).ok().json();
    let list = j.as_array().expect("a JSON array of adapters");
    assert!(!list.is_empty());
    for a in list {
        assert!(a["name"].is_string(), "{a}");
        assert!(a["max_storage_binding"].as_u64().unwrap() > 0, "{a}");
        assert!(a["shader_f16"].is_boolean(), "{a}");
    }
}

/// C = 16, K = 4: N = 150 has 10 leaf blocks, so most queries are selective.
fn cfg() -> SelectionConfig {
    SelectionConfig::new(16, 4).unwrap()
}

/// Relative L2 error of `a` against `b`.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut n, mut d) = (0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        n += (x as f64 - y).powi(2);
        d += y * y;
    }
    (n / d.max(1e-300)).sqrt()
}

/// Checks the O, LSE and indices written by `pisa forward` (`o`, `lse`, `indices` read through
/// `read`) against the CPU reference on the Q/K/V the CLI read from `input` (`q`, `k`, `v`, or
/// the three `.npy` files), with relative tolerance `tol` on O.
fn check_against_reference(
    spec: &Spec,
    qkv: [(&Path, &str); 3],
    o: Vec<f32>,
    o_shape: &[usize],
    lse: (Vec<f32>, &[usize]),
    indices: (Vec<i32>, &[usize]),
    tol: f64,
) {
    let [q, k, v] = qkv.map(|(p, n)| read_tensor(p, n).unwrap());
    let b = spec.batch.unwrap_or(1);
    let shape = AttentionShape::prefill(b, spec.hq, spec.hkv, spec.n, spec.d).unwrap();
    let lead: Vec<usize> = spec.batch.into_iter().collect();
    assert_eq!(o_shape, q.shape.as_slice(), "O mirrors Q's shape");
    assert_eq!(lse.1, [lead.clone(), vec![spec.hq, spec.n]].concat());
    assert_eq!(indices.1, [lead, vec![spec.hkv, spec.n, 4]].concat());
    let c = cfg();
    let want = select_pisa(&q.data, &k.data, &shape, spec.layout, &c).unwrap();
    // Selections may differ only where the reference's own margin is a rounding-level tie.
    let mut differ = 0;
    for (row, (a, w)) in indices.0.chunks(4).zip(want.indices.chunks(4)).enumerate() {
        if a != w {
            differ += 1;
            assert!(
                want.margin[row] < 1e-3,
                "row {row}: selection {a:?}, reference {w:?} (margin {})",
                want.margin[row]
            );
        }
    }
    assert!(
        differ * 100 <= want.rows(),
        "{differ} of {} rows differ",
        want.rows()
    );
    let (o_ref, lse_ref) = sparse_attention(
        &q.data,
        &k.data,
        &v.data,
        &shape,
        spec.layout,
        &c,
        &indices.0,
    )
    .unwrap();
    let e = rel_err(&o, &o_ref);
    assert!(e <= tol, "O rel. error {e:.2e} > {tol:.0e}");
    let e = rel_err(&lse.0, &lse_ref);
    assert!(e <= tol, "LSE rel. error {e:.2e} > {tol:.0e}");
}

/// `pisa forward` of `spec` written as a safetensors file: O/LSE/indices against the reference.
fn forward_safetensors(spec: Spec, extra: &[&str], out_name: &str, tol: f64) {
    let dir = tempfile::tempdir().unwrap();
    let inp = write_input(dir.path(), "in.safetensors", &spec);
    let layout = match spec.layout {
        TensorLayout::Bhnd => "bhnd",
        TensorLayout::Bnhd => "bnhd",
    };
    let args = [
        "forward",
        "-i",
        "in.safetensors",
        "-o",
        out_name,
        "--block-size",
        "16",
        "--top-k",
        "4",
        "--save-selection",
        "--layout",
        layout,
    ];
    let r = run_in(dir.path(), &[&args[..], extra].concat()).ok();
    assert!(r.stdout.contains("wrote"), "{}", r.stdout);
    let out = dir.path().join(out_name);
    let (o, lse, idx) = if out_name.ends_with(".npy") {
        let sib = |n: &str| pisa_cli::io::npy_sibling(&out, n);
        (
            read_tensor(&sib("o"), "o").unwrap(),
            read_tensor(&sib("lse"), "lse").unwrap(),
            read_index_tensor(&sib("indices"), "indices").unwrap(),
        )
    } else {
        (
            read_tensor(&out, "o").unwrap(),
            read_tensor(&out, "lse").unwrap(),
            read_index_tensor(&out, "indices").unwrap(),
        )
    };
    check_against_reference(
        &spec,
        [(&inp, "q"), (&inp, "k"), (&inp, "v")],
        o.data,
        &o.shape,
        (lse.data, &lse.shape),
        (idx.data, &idx.shape),
        tol,
    );
}

#[test]
fn forward_f32_bhnd_matches_the_reference() {
    forward_safetensors(Spec::small(), &[], "out.safetensors", 1e-4);
}

#[test]
fn forward_f16_file_bnhd_batched_matches_the_reference() {
    let spec = Spec {
        batch: Some(2),
        n: 96,
        layout: TensorLayout::Bnhd,
        dtype: DType::F16,
        ..Spec::small()
    };
    forward_safetensors(spec, &[], "out.npy", 1e-4);
}

#[test]
fn forward_bf16_file_with_f16_storage_matches_the_reference() {
    let spec = Spec {
        batch: Some(1),
        n: 120,
        dtype: DType::BF16,
        ..Spec::small()
    };
    // f16 storage on the GPU: inputs and O rounded to f16 (bf16 values are not all exact there).
    forward_safetensors(spec, &["--storage", "f16"], "out.safetensors", 3e-3);
}

#[test]
fn forward_npy_inputs_bnhd_with_json_output() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        layout: TensorLayout::Bnhd,
        n: 130,
        ..Spec::small()
    };
    let [q, k, v] = write_npy_input(dir.path(), &spec);
    let r = run_in(
        dir.path(),
        &[
            "forward",
            "-i",
            "q.npy",
            "--k-file",
            "k.npy",
            "--v-file",
            "v.npy",
            "--layout",
            "bnhd",
            "-o",
            "res.safetensors",
            "--block-size",
            "16",
            "--top-k",
            "4",
            "--save-selection",
            "--json",
        ],
    )
    .ok();
    let j = r.json();
    assert_eq!(j["written"][0], "res.safetensors", "{j}");
    assert!(j["total_ms"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["adapter"].is_string(), "{j}");
    let out = dir.path().join("res.safetensors");
    let meta = pisa_cli::io::read_metadata(&out).unwrap();
    assert_eq!(meta["scale"], (1.0 / 32f32.sqrt()).to_string());
    let (o, lse, idx) = (
        read_tensor(&out, "o").unwrap(),
        read_tensor(&out, "lse").unwrap(),
        read_index_tensor(&out, "indices").unwrap(),
    );
    assert_eq!(o.shape, [130, 4, 32]);
    check_against_reference(
        &spec,
        [(&q, "q"), (&k, "k"), (&v, "v")],
        o.data,
        &o.shape,
        (lse.data, &lse.shape),
        (idx.data, &idx.shape),
        1e-4,
    );
}

#[test]
fn forward_layer_and_scale_from_metadata_and_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec::small();
    let [q, k, v] = spec.qkv();
    let rename = |t: &pisa_cli::io::HostTensor, n: &str| pisa_cli::io::HostTensor {
        name: n.into(),
        ..t.clone()
    };
    let meta = [("layer3.scale".to_string(), "0.25".to_string())].into();
    common::write_st_meta(
        dir.path(),
        "layers.safetensors",
        &[
            rename(&q, "layer3.q"),
            rename(&k, "layer3.k"),
            rename(&v, "layer3.v"),
        ],
        DType::F32,
        &meta,
    );
    run_in(
        dir.path(),
        &[
            "forward",
            "-i",
            "layers.safetensors",
            "--layer",
            "3",
            "--tokens",
            "100",
            "-o",
            "o.safetensors",
            "--block-size",
            "16",
            "--top-k",
            "4",
        ],
    )
    .ok();
    let out = dir.path().join("o.safetensors");
    assert_eq!(pisa_cli::io::read_metadata(&out).unwrap()["scale"], "0.25");
    assert_eq!(read_tensor(&out, "o").unwrap().shape, [4, 100, 32]);
    assert_eq!(read_tensor(&out, "lse").unwrap().shape, [4, 100]);
    assert!(
        read_index_tensor(&out, "indices").is_err(),
        "no --save-selection"
    );
}

#[test]
fn decode_check_and_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        n: 140,
        ..Spec::small()
    };
    write_input(dir.path(), "in.safetensors", &spec);
    let j = run_in(
        dir.path(),
        &[
            "decode",
            "-i",
            "in.safetensors",
            "--block-size",
            "16",
            "--top-k",
            "4",
            "--prefill",
            "124",
            "--check",
            "--json",
            "-o",
            "dec.safetensors",
            "--save-selection",
        ],
    )
    .ok()
    .json();
    assert_eq!(j["prefill"], 124, "{j}");
    assert_eq!(j["steps"], 16, "{j}");
    assert!(j["check"]["out_rel_err"].as_f64().unwrap() <= 1e-4, "{j}");
    assert_eq!(j["check"]["rows"], 2 * 16, "{j}");
    let out = dir.path().join("dec.safetensors");
    assert_eq!(read_tensor(&out, "o").unwrap().shape, [4, 140, 32]);
    assert_eq!(read_tensor(&out, "lse").unwrap().shape, [4, 140]);
    assert_eq!(
        read_index_tensor(&out, "indices").unwrap().shape,
        [2, 140, 4]
    );
    // Text output, default prefill (half the input).
    let r = run_in(
        dir.path(),
        &[
            "decode",
            "-i",
            "in.safetensors",
            "--block-size",
            "16",
            "--top-k",
            "4",
            "--check",
        ],
    )
    .ok();
    assert!(
        r.stdout.contains("prefill 70 tokens, 70 steps"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("check vs forward"), "{}", r.stdout);
}

#[test]
fn recall_json() {
    let dir = tempfile::tempdir().unwrap();
    write_input(dir.path(), "in.safetensors", &Spec::small());
    let args = [
        "recall",
        "-i",
        "in.safetensors",
        "--block-size",
        "16",
        "--top-k",
        "4",
    ];
    let j = run_in(dir.path(), &[&args[..], &["--json"]].concat())
        .ok()
        .json();
    let rows = j.as_array().unwrap();
    let methods: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(methods, ["pisa-lse", "pisa-mean", "pisa-meanvar", "bsa"]);
    for r in rows {
        for key in ["recall_at_k", "mass_recall"] {
            let x = r[key].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&x), "{r}");
        }
        assert_eq!(r["per_kv_head"].as_array().unwrap().len(), 2, "{r}");
        assert!(r["queries"].as_u64().unwrap() > 0, "{r}");
    }
    let text = run_in(dir.path(), &args).ok();
    assert!(text.stdout.contains("pisa-lse"), "{}", text.stdout);
}

/// Regression: when no query sees more than K leaves there is nothing to measure; the table
/// printed `-0.00%` and `NaN/NaN`, now `n/a` (JSON `null`) and a hint.
#[test]
fn recall_with_nothing_to_count_says_so() {
    let dir = tempfile::tempdir().unwrap();
    write_input(dir.path(), "in.safetensors", &Spec::small());
    let args = [
        "recall",
        "-i",
        "in.safetensors",
        "--block-size",
        "64",
        "--top-k",
        "4",
    ];
    let r = run_in(dir.path(), &args).ok();
    assert!(r.stdout.contains("n/a"), "{}", r.stdout);
    assert!(
        !r.stdout.contains("NaN") && !r.stdout.contains("-0.00"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("smaller --top-k"), "{}", r.stdout);
    let j = run_in(dir.path(), &[&args[..], &["--json"]].concat())
        .ok()
        .json();
    assert!(j[0]["recall_at_k"].is_null(), "{j}");
    assert_eq!(j[0]["queries"], 0, "{j}");
}

#[test]
fn bench_tiny_json_then_compare() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(
        dir.path(),
        &[
            "bench",
            "--sizes",
            "128",
            "--decode-sizes",
            "128",
            "--hq",
            "2",
            "--hkv",
            "1",
            "--d",
            "32",
            "--block-size",
            "16",
            "--top-k",
            "4",
            "--storages",
            "f32",
            "--reps",
            "1",
            "--backward-max",
            "0",
            "--json",
            "a.json",
        ],
    )
    .ok();
    assert!(r.stdout.contains("wrote a.json"), "{}", r.stdout);
    let text = std::fs::read_to_string(dir.path().join("a.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ops: Vec<&str> = j["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["op"].as_str().unwrap())
        .collect();
    for op in ["pisa_select", "attention", "dense", "decode_pisa"] {
        assert!(ops.contains(&op), "{op} missing: {ops:?}");
    }
    assert!(dir.path().join("a.svg").exists());
    let c = run_in(dir.path(), &["bench", "--compare", "a.json", "a.json"]).ok();
    assert!(c.stdout.contains("pisa_select"), "{}", c.stdout);
    let svg = std::fs::read_to_string(dir.path().join("compare.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{svg}");
}

/// Regression: `--compare` of a report without records wrote a plot with coordinates from
/// `f64::MAX`; now a plot that says there is nothing to show.
#[test]
fn bench_compare_of_an_empty_report() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("e.json"),
        r#"{"adapter":"x","vendor":1,"backend":"b","driver":"d","command":"c","shape":"s","records":[]}"#,
    )
    .unwrap();
    run_in(dir.path(), &["bench", "--compare", "e.json"]).ok();
    let svg = std::fs::read_to_string(dir.path().join("compare.svg")).unwrap();
    assert!(svg.contains("no timed results"), "{svg}");
}

#[test]
fn demo_runs_on_a_short_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["demo", "--tokens", "160", "--steps", "4"]).ok();
    for want in ["forward:", "decode: prefill 156 tokens", "pisa-lse", "bsa"] {
        assert!(r.stdout.contains(want), "{want}:\n{}", r.stdout);
    }
    assert!(
        r.stdout
            .contains("selection equal to the CPU reference for 480 of 480"),
        "{}",
        r.stdout
    );
    assert!(snapshot_is_empty(dir.path()), "demo wrote files");
}

fn snapshot_is_empty(dir: &Path) -> bool {
    common::snapshot(dir).is_empty()
}
