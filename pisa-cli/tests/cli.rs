//! The `pisa` binary on small inputs: `--help` of every command, `info` (text and
//! JSON), `decode --check`, `recall --json`, a tiny `bench --json` (with the burst decode
//! records) and `bench --compare`, and `demo`. `forward` against the CPU reference is in
//! `cli_forward.rs`, bad inputs in `cli_bad_*.rs`. Everything runs on the default adapter
//! (lavapipe in CI) at N <= 300.

mod common;

use std::path::Path;

use common::{run_in, usage_fails, write_input, write_npy_input, write_st, Spec, TINY_BENCH};
use pisa_cli::io::HostTensor;
use pisa_cli::io::{read_index_tensor, read_tensor};

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

/// A reader that closes the pipe (`pisa info | head -0`) ends `pisa` quietly (SIGPIPE's default,
/// as other Unix tools), not with a panic in `println!`.
#[cfg(unix)]
#[test]
fn closed_stdout_pipe_is_not_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let mut child = common::pisa()
        .current_dir(dir.path())
        .args(["info", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let ok = out.status.code() == Some(0) || out.status.signal() == Some(13);
    assert!(ok, "{:?}\n{stderr}", out.status);
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
        let path = a["kernel_path"].as_str().unwrap_or_default();
        assert!(["portable", "coopmat", "nv_cm2"].contains(&path), "{a}");
        for k in ["routing", "decode_route", "decode_leaf_attention"] {
            let v = a[k].as_str().unwrap_or_default();
            assert!(["subgroups", "workgroup_memory"].contains(&v), "{k}: {a}");
        }
        assert!(a["memory_coherent"].is_boolean(), "{a}");
        let step = a["decode_step"].as_str().unwrap_or_default();
        let steps = [
            "fused",
            "one_dispatch",
            "route_leaf_and_merge",
            "three_dispatches",
        ];
        assert!(steps.contains(&step), "decode_step: {a}");
    }
    // The JSON's kernel paths are the text's, adapter by adapter.
    let portable = list
        .iter()
        .filter(|a| a["kernel_path"] == "portable")
        .count();
    let text_portable = text.stdout.matches("    kernel path: portable").count();
    assert_eq!(portable, text_portable, "{}", text.stdout);
    // Off by name, every adapter's JSON says portable.
    let off = run_in(dir.path(), &["--tune", "tensor_cores=0", "info", "--json"])
        .ok()
        .json();
    for a in off.as_array().unwrap() {
        assert_eq!(a["kernel_path"], "portable", "{a}");
    }
}

/// Regression: `pisa --tune tensor_cores=1 info` on an adapter without cooperative matrices
/// said nothing of the knob having no effect there (the commands that open a device warn); it
/// warns on stderr for each such adapter, and only when the knob is set by name.
#[test]
fn info_warns_of_tensor_cores_asked_where_there_are_none() {
    let dir = tempfile::tempdir().unwrap();
    let j = run_in(dir.path(), &["info", "--json"]).ok().json();
    let plain = run_in(dir.path(), &["info"]).ok();
    assert!(!plain.stderr.contains("tensor_cores"), "{}", plain.stderr);
    let asked = run_in(dir.path(), &["--tune", "tensor_cores=1", "info"]).ok();
    assert_eq!(asked.stdout, plain.stdout);
    for (i, a) in j.as_array().unwrap().iter().enumerate() {
        let line = format!(
            "warning: tensor_cores asks for tensor cores, but [{i}] {} has no cooperative matrices",
            a["name"].as_str().unwrap()
        );
        let none = a["cooperative_matrix"] == false;
        assert_eq!(asked.stderr.contains(&line), none, "{a}\n{}", asked.stderr);
    }
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
    // As forward's: the shape, the configuration and the scale used; the check's verdict.
    assert_eq!(j["check"]["passed"], true, "{j}");
    assert_eq!(j["check"]["tolerance"], 1e-4, "{j}");
    assert_eq!(j["config"]["top_k"], 4, "{j}");
    assert!(
        j["shape"].is_object() && j["softmax_scale"].is_number(),
        "{j}"
    );
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
    let rows = j["methods"].as_array().unwrap();
    let methods: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(methods, ["pisa-lse", "pisa-mean", "pisa-meanvar", "bsa"]);
    for r in rows {
        for key in ["recall_at_k", "mass_recall"] {
            let x = r[key].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&x), "{r}");
        }
        assert_eq!(r["per_kv_head"].as_array().unwrap().len(), 2, "{r}");
        assert!(r["queries"].as_u64().unwrap() > 0, "{r}");
        // How much the rows share: a fraction, and a union of at least one query's K leaves
        // over 16 queries' slots.
        let sib = r["sibling_fraction"].as_f64().unwrap();
        let union = r["tile_union"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&sib), "{r}");
        assert!((1.0 / 16.0..=1.0).contains(&union), "{r}");
    }
    let text = run_in(dir.path(), &args).ok();
    assert!(text.stdout.contains("pisa-lse"), "{}", text.stdout);
    assert!(text.stdout.contains("16q union"), "{}", text.stdout);
}

/// `recall` selects with Q and K only: V is neither required nor read (a file of Q and K, .npy
/// inputs without `--v-file`, a V holding inf), and the figures equal those of the full input.
/// Regression: V was required, checked against K and refused when non-finite.
#[test]
fn recall_needs_no_v() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec::small();
    let [q, k, v] = spec.qkv();
    write_st(
        dir.path(),
        "in.safetensors",
        &[q.clone(), k.clone(), v.clone()],
        spec.dtype,
    );
    write_st(
        dir.path(),
        "qk.safetensors",
        &[q.clone(), k.clone()],
        spec.dtype,
    );
    let bad_v = HostTensor::new("v", v.shape.clone(), vec![f32::INFINITY; v.data.len()]).unwrap();
    write_st(
        dir.path(),
        "qk_inf_v.safetensors",
        &[q, k, bad_v],
        spec.dtype,
    );
    let [qn, kn, _] = write_npy_input(dir.path(), &spec);
    let (qn, kn) = (qn.to_str().unwrap(), kn.to_str().unwrap());
    let cfg = ["--block-size", "16", "--top-k", "4", "--json"];
    let run = |input: &[&str]| {
        let mut a = vec!["recall"];
        a.extend_from_slice(input);
        a.extend_from_slice(&cfg);
        run_in(dir.path(), &a).ok().json()["methods"].clone()
    };
    let full = run(&["-i", "in.safetensors"]);
    assert!(full.as_array().is_some_and(|m| m.len() == 4), "{full}");
    assert_eq!(run(&["-i", "qk.safetensors"]), full);
    assert_eq!(run(&["-i", "qk_inf_v.safetensors"]), full);
    let npy = run(&["-i", qn, "--k-file", kn]);
    assert_eq!(npy.as_array().map(Vec::len), Some(4), "{npy}");
    // (K is still required)
    usage_fails(dir.path(), &["recall", "-i", qn], &["--k-file"]);
    // A V file is refused by name (it was accepted and never read, a missing one included).
    usage_fails(
        dir.path(),
        &[
            "recall",
            "-i",
            qn,
            "--k-file",
            kn,
            "--v-file",
            "missing.npy",
        ],
        &["--v-file", "reads no V"],
    );
}

/// A method the device cannot run at the configuration is left out with a warning and the
/// others are reported. Regression: blocks of one key with top_k 256 over 600 tokens need more
/// workgroup memory for `meanvar`'s routing than lavapipe has (33116 of 32768 bytes), and the
/// whole command failed after computing the other three. On a device with more, all four run.
#[test]
fn recall_reports_the_methods_that_run() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        hq: 1,
        hkv: 1,
        n: 600,
        d: 16,
        ..Spec::small()
    };
    write_input(dir.path(), "in.safetensors", &spec);
    let args = [
        "recall",
        "-i",
        "in.safetensors",
        "--block-size",
        "1",
        "--top-k",
        "256",
        "--json",
    ];
    let r = run_in(dir.path(), &args).ok();
    let j = r.json();
    let methods: Vec<&str> = (j["methods"].as_array().unwrap().iter())
        .map(|m| m["method"].as_str().unwrap())
        .collect();
    for m in ["pisa-lse", "pisa-mean", "bsa"] {
        assert!(methods.contains(&m), "{methods:?}\n{}", r.stderr);
    }
    // A method left out is named on stderr and in the JSON's left_out, with the reason.
    let left: Vec<&str> = (j["left_out"].as_array().unwrap().iter())
        .map(|m| m["method"].as_str().unwrap())
        .collect();
    assert_eq!(methods.len() + left.len(), 4, "{j}");
    if !methods.contains(&"pisa-meanvar") {
        assert!(
            r.stderr.contains("warning: pisa-meanvar left out"),
            "{}",
            r.stderr
        );
        assert_eq!(left, ["pisa-meanvar"], "{j}");
        let why = j["left_out"][0]["reason"].as_str().unwrap();
        assert!(why.contains("workgroup memory"), "{why}");
    }
    // PISA's selection is right there (rows past ~380 came out wrong on lavapipe's loop limit).
    let lse = &j["methods"][0];
    assert!(lse["recall_at_k"].as_f64().unwrap() > 0.9, "{lse}");
}

/// Regression: `recall --json` printed the methods' rows alone, without the configuration they
/// were measured with; it records it as `forward` and `decode` do (the adapter, source, tensors,
/// shape, configuration, softmax scale and storage), the scoring null (every scoring is one row
/// of `methods`).
#[test]
fn recall_json_records_the_configuration() {
    let dir = tempfile::tempdir().unwrap();
    write_input(dir.path(), "in.safetensors", &Spec::small());
    // One run's options, given to recall and then to forward.
    let opts = [
        "-i",
        "in.safetensors",
        "--block-size",
        "16",
        "--top-k",
        "5",
        "--merge",
        "4",
        "--sink-blocks",
        "1",
        "--local-blocks",
        "2",
        "--non-causal",
        "--scale",
        "0.25",
        "--tokens",
        "140",
        "--storage",
        "f16",
        "--json",
    ];
    let j = run_in(dir.path(), &[&["recall"][..], &opts[..]].concat())
        .ok()
        .json();
    let c = &j["config"];
    assert_eq!(c["block_size"], 16, "{j}");
    assert_eq!(c["top_k"], 5, "{j}");
    assert_eq!(c["merge_factor"], 4, "{j}");
    assert!(c["scoring"].is_null(), "{j}");
    assert_eq!(c["causal"], false, "{j}");
    assert_eq!(c["sink_blocks"], 1, "{j}");
    assert_eq!(c["local_blocks"], 2, "{j}");
    assert_eq!(c["scale"], 0.25, "{j}");
    assert_eq!(j["softmax_scale"], 0.25, "{j}");
    assert_eq!(j["storage"], "f16", "{j}");
    assert_eq!(j["source"], "in.safetensors", "{j}");
    assert_eq!(j["tensors"], serde_json::json!(["q", "k", "v"]), "{j}");
    let shape = serde_json::json!({
        "batch": 1, "q_heads": 4, "kv_heads": 2, "q_len": 140, "k_len": 140, "head_dim": 32,
    });
    assert_eq!(j["shape"], shape, "{j}");
    assert!(j["adapter"].as_str().is_some_and(|a| !a.is_empty()), "{j}");
    assert_eq!(j["methods"].as_array().unwrap().len(), 4, "{j}");
    // The same fields as forward's, with the same values for the same run.
    let f = run_in(dir.path(), &[&["forward"][..], &opts[..]].concat())
        .ok()
        .json();
    for key in [
        "adapter",
        "source",
        "tensors",
        "shape",
        "softmax_scale",
        "storage",
    ] {
        assert_eq!(j[key], f[key], "{key}:\nrecall {j}\nforward {f}");
    }
    assert_eq!(f["config"]["scoring"], "lse", "{f}");
    let mut fc = f["config"].clone();
    fc["scoring"] = serde_json::Value::Null;
    assert_eq!(j["config"], fc, "recall {j}\nforward {f}");
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
    // Nothing counted: a dash, not "n/a%" or NaN.
    assert!(
        r.stdout.contains(" - ") && !r.stdout.contains("n/a"),
        "{}",
        r.stdout
    );
    assert!(
        !r.stdout.contains("NaN") && !r.stdout.contains("-0.00"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("smaller --top-k"), "{}", r.stdout);
    let j = run_in(dir.path(), &[&args[..], &["--json"]].concat())
        .ok()
        .json();
    assert!(j["methods"][0]["recall_at_k"].is_null(), "{j}");
    assert_eq!(j["methods"][0]["queries"], 0, "{j}");
}

/// `--queries`: each prefill runs the last Q queries over its N keys, every prefill row
/// included; the JSON records Q and the table's shape line says so. A count of 0, or a list,
/// is refused.
#[test]
fn bench_queries_runs_a_prefill_over_a_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let rest = ["--decode-sizes=", "--backward-max", "0", "--sizes", "128"];
    for (q, file) in [(None, "whole.json"), (Some("40"), "chunk.json")] {
        let mut args = vec!["bench", "--json", file];
        if let Some(q) = q {
            args.extend(["--queries", q]);
        }
        let r = run_in(dir.path(), &[&args[..], &TINY_BENCH, &rest].concat()).ok();
        assert_eq!(
            r.stdout
                .contains("prefill of the last min(40, N) queries over N keys"),
            q.is_some(),
            "{}",
            r.stdout
        );
    }
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(f)).unwrap()).unwrap()
    };
    let (whole, chunk) = (read("whole.json"), read("chunk.json"));
    assert!(whole["params"].get("queries").is_none());
    assert_eq!(chunk["params"]["queries"], 40);
    for j in [&whole, &chunk] {
        let ops: Vec<&str> = j["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["op"].as_str().unwrap())
            .collect();
        for op in [
            "pisa_select",
            "bsa_select",
            "attention",
            "pisa_prefill",
            "dense",
        ] {
            assert!(ops.contains(&op), "{op} missing: {ops:?}");
        }
    }
    // (a list where one count goes is a usage error, exit 2, as for --dense-max)
    for (bad, says, code) in [("0", "at least 1", 1), ("1k,2k", "one positive count", 2)] {
        let e = run_in(
            dir.path(),
            &[&["bench", "--queries", bad][..], &TINY_BENCH, &rest].concat(),
        );
        assert_eq!(e.code, Some(code), "{}", e.stderr);
        assert!(
            e.stderr.contains("--queries") && e.stderr.contains(says),
            "{}",
            e.stderr
        );
    }
}

#[test]
fn bench_tiny_json_then_compare() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = ["bench", "--sizes", "128", "--decode-sizes", "128,4k"];
    let rest = ["--backward-max", "0", "--json", "a.json"];
    let r = run_in(dir.path(), &[&sizes[..], &TINY_BENCH, &rest].concat()).ok();
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
    // With GPU timestamps the decode step is also split into its three timed passes.
    let timed = j["records"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["gpu_timed"] == true);
    for op in ["decode_route", "decode_leaf", "decode_merge"] {
        assert_eq!(ops.contains(&op), timed, "{op}: {ops:?}");
    }
    // The burst decode (10 back-to-back steps in one submission, ms per step), beside the
    // isolated step: finite, positive, and printed in the decode table.
    for op in ["decode_pisa_burst", "decode_dense_burst"] {
        let rec = j["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["op"] == op && r["n"] == 128)
            .unwrap_or_else(|| panic!("{op} missing: {ops:?}"));
        let ms = rec["ms"].as_f64().unwrap();
        assert!(ms.is_finite() && ms > 0.0, "{op}: {rec}");
    }
    assert!(r.stdout.contains("PISA burst"), "{}", r.stdout);
    // The attention records name the kernel that ran (`attention_kernel`): the tile kernel for
    // 128 tokens, split-K for the one query against 4096 keys; the table lists them. (Prefill
    // records per op exist with GPU timestamps only.)
    let kernel = |op: &str, n: usize| {
        let recs = j["records"].as_array().unwrap();
        let rec = recs.iter().find(|r| r["op"] == op && r["n"] == n);
        rec.and_then(|r| r["kernel"].as_str()).map(str::to_string)
    };
    let mut want = vec![
        ("decode_dense", 128, "portable-tile"),
        ("decode_dense", 4096, "split-k"),
        ("decode_dense_burst", 4096, "split-k"),
    ];
    if timed {
        want.push(("dense", 128, "portable-tile"));
        assert!(kernel("attention", 128).is_some(), "attention: no kernel");
        assert_eq!(kernel("pisa_select", 128), None);
    }
    for (op, n, want) in want {
        assert_eq!(kernel(op, n).as_deref(), Some(want), "{op} N {n}");
    }
    assert!(
        r.stdout.contains("attention kernels: attention "),
        "{}",
        r.stdout
    );
    // The header names the kernel path that ran (lavapipe: portable, no tensor cores) and the
    // parameters as numbers, not Debug text.
    let p = &j["params"];
    assert_eq!(
        (p["hq"].as_u64(), p["top_k"].as_u64()),
        (Some(2), Some(4)),
        "{p}"
    );
    let path = p["kernel_path"].as_str().unwrap();
    let head = r.stdout.lines().next().unwrap();
    assert!(head.contains(&format!("kernel path {path} (")), "{head}");
    assert_eq!(path == "portable", !head.contains("tensor cores"), "{head}");
    assert!(dir.path().join("a.svg").exists());
    let c = run_in(
        dir.path(),
        &[
            "bench",
            "--compare",
            "a.json",
            "a.json",
            "--plot",
            "compare.svg",
        ],
    )
    .ok();
    assert!(c.stdout.contains("pisa_select"), "{}", c.stdout);
    let svg = std::fs::read_to_string(dir.path().join("compare.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{svg}");
}

/// `--leaf-order leaves` runs selection stage 2 and the sparse attention leaf-major (on lavapipe
/// the portable leaf-major kernels): the report names the order, and with GPU timestamps the
/// leaf stage's three parts are recorded apart. The inputs are [B, N, H, D] (`--layout bnhd`),
/// which the report and the JSON name.
#[test]
fn bench_leaf_order_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = ["bench", "--sizes", "300", "--decode-sizes", ""];
    let rest = [
        "--backward-max",
        "0",
        "--leaf-order",
        "leaves",
        "--layout",
        "bnhd",
        "--json",
        "l.json",
    ];
    let r = run_in(dir.path(), &[&sizes[..], &TINY_BENCH, &rest].concat()).ok();
    assert!(r.stdout.contains("leaf order leaves"), "{}", r.stdout);
    assert!(r.stdout.contains("layout bnhd"), "{}", r.stdout);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(
            &std::fs::read_to_string(dir.path().join("l.json")).unwrap()
        )
        .unwrap()["params"]["leaf_order"],
        "leaves"
    );
    let params = &serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(dir.path().join("l.json")).unwrap(),
    )
    .unwrap()["params"];
    assert_eq!(params["layout"], "bnhd", "{params}");
    let text = std::fs::read_to_string(dir.path().join("l.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let recs = j["records"].as_array().unwrap();
    let timed = recs.iter().all(|r| r["gpu_timed"] == true);
    let ops: Vec<&str> = recs.iter().map(|r| r["op"].as_str().unwrap()).collect();
    for op in ["leaf_bucket", "leaf_score", "leaf_pick"] {
        assert_eq!(ops.contains(&op), timed, "{op}: {ops:?}");
    }
    for op in ["pisa_select", "attention", "pisa_prefill"] {
        let rec = recs.iter().find(|r| r["op"] == op);
        assert!(rec.is_some() || !timed, "{op} missing: {ops:?}");
    }
    // The sparse attention's record names the leaf-major kernel (portable: f32 storage).
    if let Some(rec) = recs.iter().find(|r| r["op"] == "attention") {
        assert_eq!(rec["kernel"], "leaf-major-portable", "{rec}");
    }
}

/// `bench --input` times the prefill on a file's Q, K, V at the file's length and shape (150
/// tokens, Hq 4, Hkv 2, D 32 here), records the file as the inputs, and refuses the options
/// that would give another shape.
#[test]
fn bench_on_a_file() {
    let dir = tempfile::tempdir().unwrap();
    write_input(dir.path(), "in.safetensors", &Spec::small());
    let args = [
        "bench",
        "-i",
        "in.safetensors",
        "--block-size",
        "16",
        "--top-k",
        "4",
        "--storages",
        "f32",
        "--dense-max",
        "0",
        "--backward-max",
        "0",
        "--reps",
        "1",
        "--json",
        "f.json",
    ];
    let r = run_in(dir.path(), &args).ok();
    assert!(r.stdout.contains("inputs in.safetensors"), "{}", r.stdout);
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("f.json")).unwrap()).unwrap();
    assert_eq!(j["params"]["input"], "in.safetensors", "{}", j["params"]);
    assert_eq!(
        (
            j["params"]["hq"].as_u64(),
            j["params"]["hkv"].as_u64(),
            j["params"]["d"].as_u64()
        ),
        (Some(4), Some(2), Some(32))
    );
    let recs = j["records"].as_array().unwrap();
    assert!(!recs.is_empty());
    assert!(recs.iter().all(|r| r["n"] == 150), "{recs:?}");
    for other in [["--sizes", "1k"], ["--hq", "8"], ["--decode-sizes", "4k"]] {
        let r = run_in(dir.path(), &[&args[..], &other].concat());
        assert_eq!(r.code, Some(2), "{other:?}: {}", r.stderr);
        assert!(r.stderr.contains("--input"), "{other:?}: {}", r.stderr);
    }
    // An empty --decode-sizes (no decode, as for random inputs) goes with it, and --tokens
    // shortens the file.
    let r = run_in(
        dir.path(),
        &[&args[..], &["--decode-sizes=", "--tokens", "100"]].concat(),
    )
    .ok();
    assert!(
        r.stdout.contains("inputs in.safetensors, first 100 tokens"),
        "{}",
        r.stdout
    );
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("f.json")).unwrap()).unwrap();
    let recs = j["records"].as_array().unwrap();
    assert!(
        !recs.is_empty() && recs.iter().all(|r| r["n"] == 100),
        "{recs:?}"
    );
    // Regression: --layer and --tokens without --input were ignored (a random-input run, exit
    // 0) when --sizes was given, since clap waives `requires` beside a conflicting option.
    for extra in [&["--layer", "3"][..], &["--tokens", "5"]] {
        common::usage_fails(
            dir.path(),
            &[&["bench", "--sizes", "256"][..], &TINY_BENCH[..], extra].concat(),
            &["--input"],
        );
    }
    // Regression: bench's errors on a file it will not run named forward's options
    // (--allow-nonfinite, --storage), which bench does not have.
    let s = Spec::small();
    let [q, k, mut v] = s.qkv();
    v.data[7] = f32::NAN;
    common::write_st(
        dir.path(),
        "nan.safetensors",
        &[q, k, v],
        pisa_cli::io::DType::F32,
    );
    let [q, k, mut v] = s.qkv();
    v.data[7] = 1e6;
    common::write_st(
        dir.path(),
        "big.safetensors",
        &[q, k, v],
        pisa_cli::io::DType::F32,
    );
    for (file, storage, want) in [
        ("nan.safetensors", "f32", "refusing non-finite input"),
        ("big.safetensors", "f16", "bench it with --storages f32"),
    ] {
        let e = common::fails(
            dir.path(),
            &["bench", "-i", file, "--storages", storage, "--reps", "1"],
            &[file, want],
        );
        assert!(
            !e.contains("--allow-nonfinite") && !e.contains("--storage "),
            "{e}"
        );
    }
    // Only a .safetensors file: not a .npy (whose K and V options bench does not have).
    std::fs::write(dir.path().join("q.npy"), b"").unwrap();
    common::usage_fails(
        dir.path(),
        &["bench", "-i", "q.npy", "--storages", "f32"],
        &["q.npy", ".safetensors"],
    );
    common::fails(
        dir.path(),
        &[
            "bench",
            "-i",
            "missing.safetensors",
            "--storages",
            "f32",
            "--reps",
            "1",
        ],
        &["missing.safetensors"],
    );
}

/// Regression: `pisa bench` ran sizes above lavapipe's loop limit without the warning that
/// forward, decode and recall give; it warns over its largest prefill or decode size. (Shapes
/// the kernels do not take skip every size at once: a GQA group of 128 the prefill, of 512
/// the decode; only the warning is looked at.)
#[test]
fn bench_on_llvmpipe_warns_above_its_loop_limit() {
    let dir = tempfile::tempdir().unwrap();
    let bench = |sizes: &str, decode_sizes: &str| {
        let hq = if sizes.is_empty() { "512" } else { "128" };
        let tiny = ["--hq", hq, "--hkv", "1", "--d", "32", "--storages", "f32"];
        let sizes = ["--sizes", sizes, "--decode-sizes", decode_sizes];
        let adapter = ["--adapter", "llvmpipe"];
        run_in(
            dir.path(),
            &[&["bench"][..], &tiny, &sizes, &adapter].concat(),
        )
        .stderr
    };
    let small = bench("64", "");
    if small.contains("no GPU adapter found") {
        eprintln!("no llvmpipe adapter: skipped ({small})");
        return;
    }
    assert!(!small.contains("65535"), "{small}");
    for (sizes, decode_sizes) in [("64,9000", ""), ("", "9000")] {
        let big = bench(sizes, decode_sizes);
        assert!(
            big.contains("warning: llvmpipe") && big.contains("over 9000 keys"),
            "{sizes} / {decode_sizes}: {big}"
        );
    }
}

/// Regression: `--compare` of a report without records wrote a plot with coordinates from
/// `f64::MAX`, and printed a table of headers alone; now both say there is nothing to show.
#[test]
fn bench_compare_of_an_empty_report() {
    let dir = tempfile::tempdir().unwrap();
    write_empty_report(dir.path());
    let out = run_in(
        dir.path(),
        &["bench", "--compare", "e.json", "--plot", "c.svg"],
    )
    .ok();
    assert!(out.stdout.contains("no timed results"), "{}", out.stdout);
    let svg = std::fs::read_to_string(dir.path().join("c.svg")).unwrap();
    assert!(svg.contains("no timed results"), "{svg}");
}

/// `--compare` without `--plot` prints the table and writes no file (it wrote compare.svg
/// beside the first file compared, into whatever folder held it, replacing one there).
#[test]
fn bench_compare_writes_nothing_without_plot() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("runs");
    std::fs::create_dir(&data).unwrap();
    write_empty_report(&data);
    let r = run_in(dir.path(), &["bench", "--compare", "runs/e.json"]).ok();
    assert!(!r.stdout.contains("plot:"), "{}", r.stdout);
    let mut files: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.extend(
        std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name()),
    );
    files.sort();
    assert_eq!(files, ["e.json", "runs"], "files written");
}

/// Writes `e.json` in `dir`: a bench report with no records.
fn write_empty_report(dir: &Path) {
    std::fs::write(
        dir.join("e.json"),
        r#"{"adapter":"x","vendor":1,"backend":"b","driver":"d","command":"c","shape":"s","records":[]}"#,
    )
    .unwrap();
}

/// `--plot` names the comparison's plot; it must be an .svg and goes with --compare only.
#[test]
fn bench_compare_plot_path() {
    let dir = tempfile::tempdir().unwrap();
    write_empty_report(dir.path());
    let r = run_in(
        dir.path(),
        &["bench", "--compare", "e.json", "--plot", "mine.svg"],
    )
    .ok();
    assert!(r.stdout.contains("plot: mine.svg"), "{}", r.stdout);
    assert!(dir.path().join("mine.svg").exists());
    assert!(!dir.path().join("compare.svg").exists());
    common::usage_fails(
        dir.path(),
        &["bench", "--compare", "e.json", "--plot", "p.png"],
        &["--plot p.png", "*.svg"],
    );
    let r = run_in(dir.path(), &["bench", "--plot", "p.svg"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("--compare"), "{}", r.stderr);
    // Beside measuring options too (clap's `requires` alone let that run).
    common::usage_fails(
        dir.path(),
        &[&["bench", "--plot", "p.svg"][..], &TINY_BENCH].concat(),
        &["--plot", "--compare"],
    );
}

/// `-v` logs the device opened, its kernel path and shader checks; `-vv` each pipeline built.
#[test]
fn verbose_logs_say_what_ran() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["demo", "--tokens", "160", "--steps", "2"];
    let r = run_in(dir.path(), &[&args[..], &["-v"]].concat()).ok();
    assert!(
        r.stderr.contains("opened ") && r.stderr.contains("shader checks"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("built pipeline"), "{}", r.stderr);
    let r = run_in(dir.path(), &[&args[..], &["-vv"]].concat()).ok();
    assert!(r.stderr.contains("built pipeline"), "{}", r.stderr);
    let r = run_in(dir.path(), &args).ok();
    assert!(!r.stderr.contains("opened "), "{}", r.stderr);
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

/// Regression: `pisa demo --tokens 64` (or any --tokens up to 64) failed with "--steps 64 is
/// too many", an option the user never gave: the default number of steps now fits the tokens.
#[test]
fn demo_default_steps_fit_short_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["demo", "--tokens", "40"]).ok();
    assert!(
        r.stdout.contains("decode: prefill 1 token, then 39 steps"),
        "{}",
        r.stdout
    );
}

fn snapshot_is_empty(dir: &Path) -> bool {
    common::snapshot(dir).is_empty()
}

/// `pisa --tune decode_route_subgroups=1 info` warns for each adapter without subgroups of 8
/// lanes or more (where the decode route's subgroup level steps cannot run), and only when the
/// knob is set by name; `pisa info` names the decode route's steps on every adapter; the same
/// for `decode_leaf_subgroups` (the decode leaf attention on shuffles). Run on the
/// default backends and on wgpu's OpenGL backend (`WGPU_BACKEND=gl`, no subgroups: the warning
/// shows there), where it is available.
#[test]
fn info_warns_of_decode_route_subgroups_asked_where_there_are_none() {
    let dir = tempfile::tempdir().unwrap();
    let mut warned = 0;
    for backend in [None, Some("gl")] {
        let run = |args: &[&str]| {
            let mut c = common::pisa();
            c.current_dir(dir.path()).args(args);
            if let Some(b) = backend {
                c.env("WGPU_BACKEND", b);
            }
            common::run_cmd(&mut c)
        };
        let listed = run(&["info", "--json"]);
        if backend.is_some() && listed.code != Some(0) {
            continue; // (no OpenGL adapter here)
        }
        let j = listed.ok().json();
        let plain = run(&["info"]).ok();
        assert!(
            !plain.stderr.contains("decode_route_subgroups"),
            "{}",
            plain.stderr
        );
        let adapters = j.as_array().unwrap();
        assert_eq!(
            plain.stdout.matches("    decode route: ").count(),
            adapters.len(),
            "{}",
            plain.stdout
        );
        let asked = run(&["--tune", "decode_route_subgroups=1", "info"]).ok();
        assert_eq!(asked.stdout, plain.stdout);
        // The decode leaf attention's knob (off by default) the same way.
        assert_eq!(
            plain.stdout.matches("    decode leaf attention: ").count(),
            adapters.len(),
            "{}",
            plain.stdout
        );
        let leaf = run(&["--tune", "decode_leaf_subgroups=1", "info"]).ok();
        for (knob, asks, out) in [
            (
                "decode_route_subgroups",
                "the decode route's subgroup level steps",
                &asked,
            ),
            (
                "decode_leaf_subgroups",
                "the decode leaf attention on subgroup shuffles",
                &leaf,
            ),
        ] {
            for (i, a) in adapters.iter().enumerate() {
                let line = format!(
                    "warning: {knob} asks for {asks}, but [{i}] {} has no subgroups of 8 lanes or more",
                    a["name"].as_str().unwrap()
                );
                let none = a["subgroups"] == false || a["subgroup_size"][0].as_u64().unwrap() < 8;
                assert_eq!(out.stderr.contains(&line), none, "{a}\n{}", out.stderr);
                if knob == "decode_route_subgroups" {
                    warned += usize::from(none);
                }
            }
        }
    }
    eprintln!("adapters without subgroups of 8 lanes (warned): {warned}");
}

/// Regression: a path that is not UTF-8 panicked `pisa bench` (its command line, recorded in
/// the JSON, was read with `std::env::args`) and `forward --json` / `decode --json` after their
/// outputs were written (the JSON's `written` list); now the JSON lists it with U+FFFD.
#[cfg(unix)]
#[test]
fn paths_that_are_not_utf8() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_input(d, "in.safetensors", &Spec::small());
    let odd = std::ffi::OsStr::from_bytes(b"o\xff.safetensors");
    let r = common::run_cmd(
        common::pisa()
            .current_dir(d)
            .args([
                "forward",
                "-i",
                "in.safetensors",
                "--block-size",
                "16",
                "--top-k",
                "4",
            ])
            .args(["--json", "-o"])
            .arg(odd),
    )
    .ok();
    assert!(d.join(odd).exists());
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["written"][0], "o\u{fffd}.safetensors", "{j}");
    let json = std::ffi::OsStr::from_bytes(b"b\xff.json");
    common::run_cmd(
        common::pisa()
            .current_dir(d)
            .args(["bench", "--sizes", "256", "--decode-sizes="])
            .args(["--dense-max", "0", "--backward-max", "0"])
            .args(TINY_BENCH)
            .arg("--json")
            .arg(json),
    )
    .ok();
    let text = std::fs::read_to_string(d.join(json)).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        j["command"]
            .as_str()
            .unwrap()
            .ends_with("--json b\u{fffd}.json"),
        "{}",
        j["command"]
    );
}

/// Regression: at a size whose every query keeps every leaf it sees (N <= top_k x C: no route or
/// leaf stage, PISA's selection a list of the leaves), the prefill table gave BSA/PISA as a
/// speedup of 20x over a selection that never ran; now no ratio there and a line that says why,
/// while a routed size keeps its ratio. The decode table notes such caches too.
#[test]
fn bench_gives_no_bsa_ratio_where_nothing_is_selected() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = ["bench", "--sizes", "48,128", "--decode-sizes", "40,128"];
    let rest = ["--backward-max", "0"];
    let r = run_in(dir.path(), &[&sizes[..], &TINY_BENCH, &rest].concat()).ok();
    let out = &r.stdout;
    assert!(out.contains("GPU timestamps"), "{out}");
    let row = |n: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(n))
            .unwrap_or_else(|| panic!("no row {n}: {out}"))
            .split_whitespace()
            .nth(6)
            .unwrap()
            .to_string()
    };
    assert_eq!(row("48"), "-", "{out}");
    assert!(row("128").ends_with('x'), "{out}");
    assert!(
        out.contains("(N = 48: every query keeps every leaf it sees"),
        "{out}"
    );
    // The decode table says the same of a cache of at most top_k x C tokens (40, not 128).
    assert!(
        out.contains("(cache 40: a decoded token keeps every leaf it sees"),
        "{out}"
    );
}
