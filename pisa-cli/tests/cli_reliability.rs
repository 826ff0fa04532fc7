//! Reliability of the `pisa` command line and its output writing (`docs/reliability.md`):
//! non-finite inputs are refused by default with the position of the first bad value,
//! `--allow-nonfinite` passes them on, a failing run (bad input, no adapter, bad configuration)
//! writes nothing and leaves an existing output file untouched, and a failed write leaves no
//! partial or temporary files.
//! Also cases that used to be silent or misleading: misspelled `PISA_*` knobs warn, the
//! `bench` decode measurement keeps to `--reps` and `--budget-s`, and `demo`'s recall hint
//! names its own flags. The `pisa forward` runs use the default adapter (lavapipe in CI).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{args, pisa, run_cmd, run_in, setup, snapshot, SMALL, TINY_BENCH};
use pisa_cli::io::{
    write_outputs, write_safetensors, DType, HostTensor, IndexTensor, OutTensor, Outputs,
};

/// Q `[2, 64, 32]`, K and V `[1, 64, 32]`, finite, in `dir/name`, with `edit` applied to K and
/// V.
fn input(dir: &Path, name: &str, edit: impl FnOnce(&mut [f32], &mut [f32])) -> PathBuf {
    let vals = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32) * s).sin()).collect() };
    let q = HostTensor::new("q", vec![2, 64, 32], vals(2 * 64 * 32, 0.37)).unwrap();
    let mut k = HostTensor::new("k", vec![1, 64, 32], vals(64 * 32, 0.11)).unwrap();
    let mut v = HostTensor::new("v", vec![1, 64, 32], vals(64 * 32, 0.53)).unwrap();
    edit(&mut k.data, &mut v.data);
    let p = dir.join(name);
    write_safetensors(
        &p,
        &[
            OutTensor::Float(&q, DType::F32),
            OutTensor::Float(&k, DType::F32),
            OutTensor::Float(&v, DType::F32),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    p
}

/// Names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn forward(inp: &Path, out: &Path, extra: &[&str]) -> (bool, String) {
    let o = pisa()
        .args(["forward", "-i"])
        .arg(inp)
        .arg("-o")
        .arg(out)
        .args(["--block-size", "16", "--top-k", "2"])
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn nonfinite_input_is_refused_with_its_position_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    // K is [1, 64, 32]: flat index 5 * 32 + 2 is [0, 5, 2].
    let inp = input(dir.path(), "in.safetensors", |k, _| {
        k[5 * 32 + 2] = f32::NAN
    });
    let out = dir.path().join("out.safetensors");
    let (ok, err) = forward(&inp, &out, &[]);
    assert!(!ok, "accepted a NaN input");
    assert!(err.contains("NaN at [0, 5, 2]"), "{err}");
    assert!(err.contains("--allow-nonfinite"), "{err}");
    assert!(err.contains("in.safetensors"), "{err}");
    assert_eq!(
        listing(dir.path()),
        ["in.safetensors"],
        "something was written"
    );
    // An existing output survives the failed run untouched.
    std::fs::write(&out, b"previous result").unwrap();
    let (ok, _) = forward(&inp, &out, &[]);
    assert!(!ok);
    assert_eq!(std::fs::read(&out).unwrap(), b"previous result");
    // Infinity too, reported as such.
    let inf = input(dir.path(), "inf.safetensors", |k, _| {
        k[64 * 32 - 1] = f32::NEG_INFINITY
    });
    let (ok, err) = forward(&inf, &dir.path().join("o2.safetensors"), &[]);
    assert!(!ok);
    assert!(err.contains("-inf at [0, 63, 31]"), "{err}");
}

#[test]
fn allow_nonfinite_passes_the_input_on() {
    let dir = tempfile::tempdir().unwrap();
    let inp = input(dir.path(), "in.safetensors", |k, _| {
        k[5 * 32 + 2] = f32::NAN
    });
    let out = dir.path().join("out.safetensors");
    let (ok, err) = forward(&inp, &out, &["--allow-nonfinite"]);
    assert!(ok, "{err}");
    let o = pisa_cli::io::read_tensor(&out, "o").unwrap();
    assert_eq!(o.shape, [2, 64, 32]);
    // Rows before the NaN key's block never see it (causal): finite.
    assert!(o.data[..16 * 32].iter().all(|x| x.is_finite()));
    // A V value past f16's range with f16 storage: refused (naming --allow-nonfinite), then
    // passed on as the infinity f16 makes of it, which reaches O; not taken for an overflow
    // of the kernels from finite inputs.
    let big = input(dir.path(), "big.safetensors", |_, v| v[10 * 32] = 1e5);
    let out = dir.path().join("big-out.safetensors");
    let (ok, err) = forward(&big, &out, &["--storage", "f16"]);
    assert!(!ok && err.contains("beyond the f16 range"), "{err}");
    assert!(err.contains("--allow-nonfinite"), "{err}");
    let (ok, err) = forward(&big, &out, &["--storage", "f16", "--allow-nonfinite"]);
    assert!(ok, "{err}");
    let o = pisa_cli::io::read_tensor(&out, "o").unwrap();
    assert!(o.data[..10 * 32].iter().all(|x| x.is_finite()));
    assert!(
        o.data.iter().any(|x| !x.is_finite()),
        "the infinity of V vanished"
    );
}

#[test]
fn failing_runs_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let inp = input(dir.path(), "in.safetensors", |_, _| {});
    let out = dir.path().join("out.npy");
    for (what, extra) in [
        ("no adapter", &["--adapter", "no-such-gpu"][..]),
        ("top_k below forced", &["--sink-blocks", "2"][..]),
        ("bad scale", &["--scale", "-1"][..]),
        ("block size 0", &["--block-size", "0"][..]),
    ] {
        let (ok, err) = forward(&inp, &out, extra);
        assert!(!ok, "{what}: accepted");
        assert!(!err.trim().is_empty(), "{what}: no message");
        assert_eq!(
            listing(dir.path()),
            ["in.safetensors"],
            "{what}: something was written"
        );
        eprintln!("{what}: {}", err.trim());
    }
    let (ok, err) = forward(&inp, &out, &["--adapter", "no-such-gpu"]);
    assert!(!ok && err.contains("no-such-gpu"), "{err}");
    // And a good run writes exactly the npy siblings.
    let (ok, err) = forward(&inp, &out, &[]);
    assert!(ok, "{err}");
    assert_eq!(
        listing(dir.path()),
        ["in.safetensors", "out.lse.npy", "out.o.npy"]
    );
}

/// Small O, LSE and indices tensors for `write_outputs`.
struct Tensors(HostTensor, HostTensor, IndexTensor);

impl Tensors {
    fn new() -> Tensors {
        Tensors(
            HostTensor::new("o", vec![2, 3], vec![1.0; 6]).unwrap(),
            HostTensor::new("lse", vec![2], vec![0.5; 2]).unwrap(),
            IndexTensor::new("indices", vec![2, 1], vec![0, 1]).unwrap(),
        )
    }

    /// All three, as one output set.
    fn outputs(&self) -> Outputs<'_> {
        Outputs {
            o: &self.0,
            lse: Some(&self.1),
            indices: Some(&self.2),
        }
    }
}

/// Makes `dir/out.lse.npy` a non-empty directory: renaming a file onto it fails.
fn block_lse_target(dir: &Path) {
    std::fs::create_dir(dir.join("out.lse.npy")).unwrap();
    std::fs::write(dir.join("out.lse.npy/x"), b"").unwrap();
}

/// Asserts that no temporary file of an atomic write is left in `dir`.
fn assert_no_temporary_files(dir: &Path) {
    let names = listing(dir);
    assert!(
        !names.iter().any(|n| n.starts_with(".pisa-tmp-")),
        "temporary files left: {names:?}"
    );
}

#[test]
fn a_failed_encode_writes_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = Tensors::new();
    let out = tensors.outputs();
    // bf16 cannot be stored in npy: refused before any file is created.
    let p = dir.path().join("out.npy");
    assert!(write_outputs(&p, &out, DType::BF16, &BTreeMap::new()).is_err());
    assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));
    // A directory that does not exist: error naming it, nothing created.
    let p = dir.path().join("missing/out.safetensors");
    let e = write_outputs(&p, &out, DType::F32, &BTreeMap::new()).unwrap_err();
    assert!(format!("{e:#}").contains("missing"), "{e:#}");
    assert!(listing(dir.path()).is_empty());
}

/// An npy output is several files, each renamed into place atomically. A target that cannot be
/// replaced (here a directory) used to fail after the first rename, leaving a set that mixed new
/// and old results; it is now refused before any rename (fixed in `io::write_atomic_all`).
#[test]
fn a_failed_rename_leaves_the_old_output_set_intact() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = Tensors::new();
    let out = tensors.outputs();
    let p = dir.path().join("out.npy");
    std::fs::write(dir.path().join("out.o.npy"), b"old o").unwrap();
    // `out.lse.npy` is a non-empty directory: renaming a file onto it fails.
    block_lse_target(dir.path());
    assert!(write_outputs(&p, &out, DType::F32, &BTreeMap::new()).is_err());
    assert_no_temporary_files(dir.path());
    assert_eq!(
        std::fs::read(dir.path().join("out.o.npy")).unwrap(),
        b"old o",
        "out.o.npy was replaced although the output set failed"
    );
}

/// A failed write leaves no temporary file behind, even while its error is alive (the error of
/// a failed rename used to hold the temporary file open and undeleted).
#[test]
fn a_failed_rename_leaves_no_temporary_files() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = Tensors::new();
    let out = tensors.outputs();
    block_lse_target(dir.path());
    let e = write_outputs(
        &dir.path().join("out.npy"),
        &out,
        DType::F32,
        &BTreeMap::new(),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("out.lse.npy"), "{e:#}");
    assert_no_temporary_files(dir.path());
}

/// Regression: misspelled values of the environment knobs were ignored (first silently, then
/// with a warning); a tuning knob the library cannot take is now a usage error naming it, from
/// the environment or from `--tune`, and nothing runs.
#[test]
fn misspelled_tuning_knobs_are_errors() {
    let bad_env = [
        (
            "PISA_KERNEL_PATH",
            "portabel",
            "coopmat, portable or a switch",
        ),
        ("PISA_LEAF_ORDER", "tile", "auto, tiles or leaves"),
        ("PISA_DECODE", "fuse", "a switch"),
        ("PISA_SHADER_CHECKS", "off", "all, bounds, none"),
        ("PISA_ROUTE_LANES", "3", "1, 2, 4, 8 or 16"),
    ];
    for (name, val, ok) in bad_env {
        let r = run_cmd(pisa().arg("info").env(name, val));
        assert_eq!(r.code, Some(2), "{name}={val}: {}", r.stderr);
        let want = format!("error: bad tuning: {name}={val}: ");
        assert!(r.stderr.starts_with(&want), "{want}:\n{}", r.stderr);
        assert!(r.stderr.contains(ok), "{ok}:\n{}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(r.stdout.is_empty(), "{}", r.stdout);
    }
    for (arg, want) in [
        ("route_lane=4", "unknown knob `route_lane`"),
        ("route_lanes", "expected KNOB=VALUE"),
        ("leaf_subgroups=3", "`3` is not 2 or 4"),
    ] {
        let r = run_cmd(pisa().args(["info", "--tune", arg]));
        assert_eq!(r.code, Some(2), "--tune {arg}: {}", r.stderr);
        assert!(
            r.stderr.contains(want),
            "--tune {arg}: {want}:\n{}",
            r.stderr
        );
    }
    let r = run_cmd(
        pisa()
            .args([
                "info",
                "--tune",
                "leaf_order=tiles",
                "--tune",
                "route_lanes=8",
            ])
            .env("PISA_LEAF_ORDER", "leaves")
            .env("PISA_DECODE", "split"),
    )
    .ok();
    assert!(!r.stderr.contains("error"), "{}", r.stderr);
    // A pair overrides its knob's variable even where the variable's value is bad (the help
    // says the pairs apply after the variables); without the pair the value is an error.
    let bad = || {
        let mut c = pisa();
        c.env("PISA_LEAF_ORDER", "bogus").arg("info");
        c
    };
    let r = run_cmd(bad().args(["--tune", "leaf_order=tiles"])).ok();
    assert!(!r.stderr.contains("error"), "{}", r.stderr);
    let r = run_cmd(bad().args(["--tune", "PISA_LEAF_ORDER=auto"])).ok();
    assert!(!r.stderr.contains("error"), "{}", r.stderr);
    let r = run_cmd(&mut bad());
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("PISA_LEAF_ORDER=bogus"), "{}", r.stderr);
}

/// A `--tune` value out of its knob's range is a usage error like a misspelled one (exit code
/// 2, one line naming the pair and the range), for every numeric knob, `route_tile` included.
#[test]
fn out_of_range_tuning_values_are_usage_errors() {
    for (arg, range) in [
        ("route_tile=99", "from 1 to 16"),
        ("route_tile=0", "from 1 to 16"),
        ("decode_key_lanes=128", "1, 2, 4, 8, 16, 32, 64 or auto"),
        ("leaf_tiles_per_iteration=5", "from 1 to 4"),
        ("leaf_subgroups=8", "2 or 4"),
        ("route_lanes=32", "1, 2, 4, 8 or 16"),
        ("route_max_workgroup=2048", "from 32 to 1024"),
        ("route_table_nodes=5000", "from 0 to 4096"),
        ("route_table_queries=16777217", "from 1 to 16777216"),
    ] {
        for cmd in ["info", "forward"] {
            let r = run_cmd(pisa().args([cmd, "--tune", arg]));
            assert_eq!(r.code, Some(2), "{cmd} --tune {arg}: {}", r.stderr);
            let want = format!("error: --tune {arg}: ");
            assert!(r.stderr.starts_with(&want), "{want}:\n{}", r.stderr);
            assert!(r.stderr.contains(range), "{range}:\n{}", r.stderr);
            assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
            assert!(r.stdout.is_empty(), "{}", r.stdout);
        }
    }
}

/// `--tune` reaches the kernels' context: `pisa bench` records the knobs that differ from the
/// defaults, and its results are those of the default tuning (the knobs change speed only).
#[test]
fn tune_is_recorded_by_bench() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("b.json");
    let mut args = vec!["bench", "--sizes", "128", "--decode-sizes", "128"];
    args.extend(TINY_BENCH);
    args.extend(["--backward-max", "0", "--dense-max", "0"]); // 0: never
    args.extend(["--json", json.to_str().unwrap(), "--tune", "route_lanes=2"]);
    args.extend(["--leaf-order", "leaves"]); // recorded in its own field, not twice
    args.extend(["--tune", "leaf_order=tiles"]); // overridden by --leaf-order, with a warning
    let r = run_in(dir.path(), &args).ok();
    assert!(
        r.stderr
            .contains("warning: --leaf-order leaves overrides the tuning's leaf_order=tiles"),
        "{}",
        r.stderr
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(
        v["params"]["tuning"],
        serde_json::json!(["route_lanes=2"]),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("tuning route_lanes=2;"), "{}", r.stdout);
    assert_eq!(v["params"]["leaf_order"], "leaves");
    // --dense-max 0: no dense timing at all.
    let ops: Vec<_> = v["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["op"])
        .collect();
    assert!(ops.iter().any(|o| *o == "pisa_prefill"), "{ops:?}");
    assert!(!ops.iter().any(|o| *o == "dense"), "{ops:?}");
}

/// Regression: the decode measurement of `bench` forced at least 20 (then 5) repetitions
/// whatever `--reps` and `--budget-s` said; now prefill keeps to `--reps`, decode to
/// `--decode-reps` (default 20), both cut by `--budget-s` (to no fewer than 3), and a rerun may
/// replace its own results file.
#[test]
fn bench_decode_keeps_to_reps_and_budget() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = ["bench", "--sizes", "128", "--decode-sizes", "128"];
    let rest = [
        "--backward-max",
        "0",
        "--dense-max",
        "1",
        "--json",
        "b.json",
    ];
    for (reps, budget, want) in [("1", "8", 1), ("50", "0", 3)] {
        let mut a = [&sizes[..], &TINY_BENCH[..TINY_BENCH.len() - 2], &rest].concat();
        a.extend(["--reps", reps, "--decode-reps", reps, "--budget-s", budget]);
        run_in(dir.path(), &a).ok();
        let text = std::fs::read_to_string(dir.path().join("b.json")).unwrap();
        let j: serde_json::Value = serde_json::from_str(&text).unwrap();
        for r in j["records"].as_array().unwrap() {
            assert_eq!(r["reps"], want, "--reps {reps} --budget-s {budget}: {r}");
        }
    }
}

/// Regression: `demo` with too few tokens for any counted row hinted at `--top-k` and
/// `--block-size`, which `demo` does not have.
#[test]
fn demo_recall_hint_names_demo_flags() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["demo", "--tokens", "300", "--steps", "1"]).ok();
    assert!(r.stdout.contains("use --tokens above 512"), "{}", r.stdout);
    assert!(!r.stdout.contains("--top-k"), "{}", r.stdout);
}

/// A knob set by name that asks for hardware the adapter lacks is told on stderr (the library
/// falls back without an error, as an app's defaults need): `--tune tensor_cores=coopmat` (or
/// by its variable's name) where the context runs the portable kernels warns once and still
/// runs; where it runs the tensor-core kernels, and without `--tune`, there is no warning. What
/// the context runs is read from its own log line (`-v`: "kernel path ..."), with the default
/// tuning, whose `tensor_cores` is on; the caller's `PISA_*` variables are removed.
#[test]
fn tune_asking_for_missing_hardware_warns() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut c = pisa();
        c.current_dir(dir.path());
        for (_, var) in pisa_wgpu::TUNING_KNOBS {
            c.env_remove(var);
        }
        c.args(["demo", "--tokens", "64", "--steps", "2", "--adapter", "0"]);
        run_cmd(c.args(extra)).ok()
    };
    let plain = run(&["-v"]);
    let path = plain
        .stderr
        .split("kernel path ")
        .nth(1)
        .and_then(|t| t.split([',', ' ']).next())
        .unwrap_or_else(|| panic!("no kernel path in the log:\n{}", plain.stderr))
        .to_string();
    assert!(!plain.stderr.contains("warning:"), "{}", plain.stderr);
    let want = usize::from(path != "coopmat");
    for tune in ["tensor_cores=coopmat", "PISA_KERNEL_PATH=coopmat"] {
        let r = run(&["--tune", tune]);
        let warnings = r
            .stderr
            .matches("warning: tensor_cores asks for tensor cores")
            .count();
        assert_eq!(
            warnings, want,
            "--tune {tune}, kernel path {path}: {}",
            r.stderr
        );
    }
}

/// A stdout that cannot be written (a redirect to a full disk: `/dev/full`) is an error, exit
/// 1, with a one-line message, not a panic (exit 101); a closed pipe still ends `pisa` quietly.
#[cfg(target_os = "linux")]
#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("no /dev/full: skipped");
        return;
    };
    let mut c = pisa();
    c.args(["info", "--json"]).stdout(full);
    let r = run_cmd(&mut c);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("cannot write to stdout"), "{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    // `forward` and `decode` with an output file: the report cannot be written, so nothing is
    // written or changed either (the outputs are renamed into place only after the report),
    // in text and JSON, `.safetensors` and `.npy`.
    let dir = setup();
    for cmd in ["forward", "decode"] {
        for (out, json) in [
            ("o.safetensors", false),
            ("o.safetensors", true),
            ("o.npy", false),
        ] {
            let before = snapshot(dir.path());
            let mut c = pisa();
            c.current_dir(dir.path())
                .args([cmd, "-i", "in.safetensors", "-o", out, "--save-selection"])
                .args(SMALL)
                .args(json.then_some("--json"))
                .stdout(
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open("/dev/full")
                        .unwrap(),
                );
            let r = run_cmd(&mut c);
            let what = format!("{cmd} -o {out} (--json {json})");
            assert_eq!(r.code, Some(1), "{what}: {}", r.stderr);
            assert!(
                r.stderr.contains("cannot write to stdout"),
                "{what}: {}",
                r.stderr
            );
            let after = snapshot(dir.path());
            let names = |s: &[(String, Vec<u8>)]| s.iter().map(|f| f.0.clone()).collect::<Vec<_>>();
            assert!(
                after == before,
                "{what}: files written or changed: {:?} -> {:?}",
                names(&before),
                names(&after)
            );
        }
    }
    // And with a stdout that takes the report, the files are there.
    let r = run_in(
        dir.path(),
        &args(
            &["forward", "-i", "in.safetensors", "-o", "o.npy"],
            &SMALL,
            &[],
        ),
    )
    .ok();
    assert!(r.stdout.contains("wrote"), "{}", r.stdout);
    assert!(dir.path().join("o.o.npy").is_file() && dir.path().join("o.lse.npy").is_file());
}

/// The sliding-window warning (a layer whose metadata says it attends a window of W tokens)
/// compares W with the tokens used: over all 150 tokens a window of 100 warns, with `--tokens
/// 64` (inside the window, where pisa attends as the layer does) it does not (it warned,
/// naming the file's 150 tokens).
#[test]
fn sliding_window_warning_counts_the_tokens_used() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = common::Spec::small();
    let [q, k, v] = spec.qkv();
    let named = |t: &pisa_cli::io::HostTensor, n: &str| pisa_cli::io::HostTensor {
        name: format!("layer0.{n}"),
        ..t.clone()
    };
    let meta = BTreeMap::from([(
        "layers".to_string(),
        r#"{"0": {"scale": 0.2, "sliding_window": 100}}"#.to_string(),
    )]);
    common::write_st_meta(
        d,
        "win.safetensors",
        &[named(&q, "q"), named(&k, "k"), named(&v, "v")],
        pisa_cli::io::DType::F32,
        &meta,
    );
    let base = ["forward", "-i", "win.safetensors", "--layer", "0"];
    let all = run_in(d, &args(&base, &SMALL, &[])).ok();
    assert!(
        all.stderr.contains("sliding window of 100"),
        "{}",
        all.stderr
    );
    let some = run_in(d, &args(&base, &SMALL, &["--tokens", "64"])).ok();
    assert!(!some.stderr.contains("sliding window"), "{}", some.stderr);
}

/// `info` and `info --json` agree on the exit code: with no adapter both fail (the JSON listing,
/// `[]`, still printed) where `info --json` used to print `[]` and exit 0. The Vulkan loader is
/// pointed at no driver; where another backend still finds an adapter, both succeed.
#[test]
fn info_text_and_json_agree_without_an_adapter() {
    let none = || {
        let mut c = pisa();
        c.env("VK_ICD_FILENAMES", "/nonexistent/icd.json")
            .env("VK_DRIVER_FILES", "/nonexistent/icd.json")
            .arg("info");
        c
    };
    let text = run_cmd(&mut none());
    let json = run_cmd(none().arg("--json"));
    assert_eq!(text.code, json.code, "{}\n{}", text.stderr, json.stderr);
    if text.code != Some(0) {
        assert!(text.stderr.contains("no GPU adapter"), "{}", text.stderr);
        assert!(json.stderr.contains("no GPU adapter"), "{}", json.stderr);
        assert_eq!(json.stdout.trim(), "[]", "{}", json.stdout);
    }
}

/// A knob set by name that shapes a kernel the other choices leave out is said (11 of the 23
/// were taken and recorded without effect or a word), on every adapter `pisa info` lists; a
/// `PISA_*` variable pisa does not read (a misspelt knob variable) is said too; `info --json`'s
/// decode leaf attention is the one that runs (it said `subgroups` where the leaf runs as its
/// own dispatch).
#[test]
fn knobs_without_effect_and_unknown_variables_are_said() {
    let run = |args: &[&str], envs: &[(&str, &str)]| {
        let mut c = pisa();
        for (_, var) in pisa_wgpu::TUNING_KNOBS {
            c.env_remove(var);
        }
        for (k, v) in envs {
            c.env(k, v);
        }
        run_cmd(c.args(args)).ok()
    };
    let listed = run(&["info", "--json"], &[]);
    let adapters: serde_json::Value = serde_json::from_str(&listed.stdout).unwrap();
    let adapters = adapters.as_array().unwrap();
    assert!(!listed.stderr.contains("warning:"), "{}", listed.stderr);
    // The split decode step is every adapter's default: the fused step's lane count is unused.
    let r = run(&["--tune", "decode_key_lanes=8", "info"], &[]);
    assert!(
        r.stderr
            .contains("warning: decode_key_lanes shapes the fused decode step"),
        "{}",
        r.stderr
    );
    let r = run(
        &[
            "--tune",
            "decode_fused=1",
            "--tune",
            "decode_key_lanes=8",
            "info",
        ],
        &[],
    );
    assert!(!r.stderr.contains("decode_key_lanes"), "{}", r.stderr);
    // The one-dispatch route and leaf's value rows loaded in the P.V loop: unused where that
    // dispatch does not run, used where it does (the workgroup-memory attention).
    let prefetch = |more: &[&str]| {
        let mut args = vec!["--tune", "decode_leaf_prefetch=0"];
        args.extend(more);
        args.push("info");
        run(&args, &[])
            .stderr
            .contains("warning: decode_leaf_prefetch applies")
    };
    assert!(prefetch(&["--tune", "decode_route_workgroups=0"]));
    assert!(!prefetch(&["--tune", "decode_route_workgroups=64"]));
    assert!(prefetch(&[
        "--tune",
        "decode_route_workgroups=64",
        "--tune",
        "decode_fused=1"
    ]));
    // The WGSL tensor-core scorer's subgroups and key staging, on an adapter without
    // cooperative matrices (or with the NVIDIA scorer).
    for (knob, says) in [
        (
            "leaf_subgroups=2",
            "leaf_subgroups sizes the WGSL tensor-core leaf scorer",
        ),
        (
            "leaf_stage_keys=0",
            "leaf_stage_keys stages the keys of the WGSL tensor-core leaf-major scorer",
        ),
    ] {
        let r = run(&["--tune", knob, "info"], &[]);
        for (i, a) in adapters.iter().enumerate() {
            let name = a["name"].as_str().unwrap();
            let line = format!("warning: {says}, which does not run on [{i}] {name}");
            let unused = a["cooperative_matrix"] == false || a["nv_cooperative_matrix2"] == true;
            assert_eq!(r.stderr.contains(&line), unused, "{a}\n{}", r.stderr);
        }
    }
    // Sibling pairs of leaf-major attention, where the query-tile order is asked for (not
    // otherwise).
    let pairs = |order: &str| {
        let order = format!("leaf_order={order}");
        let r = run(
            &["--tune", "attention_pairs=0", "--tune", &order, "info"],
            &[],
        );
        r.stderr.matches("warning: attention_pairs pairs").count()
    };
    assert_eq!(pairs("tiles"), adapters.len());
    assert_eq!(pairs("leaves"), 0);
    // The workgroup-memory routing's lanes, where the subgroup routing runs; not once it is off.
    let r = run(&["--tune", "route_lanes=2", "info"], &[]);
    let sg = adapters
        .iter()
        .filter(|a| a["routing"] == "subgroups")
        .count();
    assert_eq!(
        r.stderr.matches("warning: route_lanes shapes").count(),
        sg,
        "{}",
        r.stderr
    );
    let r = run(
        &[
            "--tune",
            "route_subgroups=0",
            "--tune",
            "route_lanes=2",
            "info",
        ],
        &[],
    );
    assert!(!r.stderr.contains("route_lanes"), "{}", r.stderr);
    // A knob asked at its default changes nothing, used or not: no line (route_lanes and
    // route_tile where the subgroup routing runs, decode_merge_in_route=0 where the route and
    // leaf are not one dispatch, the default off the H100 and H200).
    let r = run(
        &[
            "--tune",
            "route_lanes=4",
            "--tune",
            "route_tile=auto",
            "--tune",
            "decode_merge_in_route=0",
            "--tune",
            "decode_route_workgroups=0",
            "info",
        ],
        &[],
    );
    assert!(!r.stderr.contains("warning:"), "{}", r.stderr);
    // The decode leaf attention on shuffles needs the one-dispatch route and leaf.
    let r = run(
        &["--tune", "decode_leaf_subgroups=1", "info", "--json"],
        &[],
    );
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    for a in j.as_array().unwrap() {
        assert_eq!(a["decode_leaf_attention"], "workgroup_memory", "{a}");
    }
    let r = run(
        &[
            "--tune",
            "decode_leaf_subgroups=1",
            "--tune",
            "decode_route_workgroups=64",
            "info",
            "--json",
        ],
        &[],
    );
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    for a in j.as_array().unwrap() {
        let sg8 = a["subgroups"] == true && a["subgroup_size"][0].as_u64().unwrap() >= 8;
        let want = if sg8 { "subgroups" } else { "workgroup_memory" };
        assert_eq!(a["decode_leaf_attention"], want, "{a}");
    }
    // A misspelt knob variable is said; the knobs' and the tools' variables are not.
    let r = run(&["info"], &[("PISA_ROUTE_LANE", "3"), ("PISA_SEED", "1")]);
    assert!(
        r.stderr
            .contains("warning: PISA_ROUTE_LANE is not a variable pisa reads")
            && r.stderr.contains("PISA_ROUTE_LANES")
            && !r.stderr.contains("PISA_SEED is not"),
        "{}",
        r.stderr
    );
}
