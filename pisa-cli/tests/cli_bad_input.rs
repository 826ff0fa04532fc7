//! Bad input files to the `pisa` binary: missing, unreadable, empty, truncated and
//! corrupt files, wrong tensor names and layers, unsupported dtypes and head dims, a non-finite
//! `.npy` value and bad metadata. Shapes, layouts and lengths are in `cli_bad_shapes.rs`, bad
//! options and outputs in `cli_bad_options.rs`, other non-finite values and failed writes in
//! `cli_reliability.rs`, parser crashers in `fuzz_regressions.rs`.
//!
//! Every case is one `error: ` line naming the file (where there is one) and the problem, exit
//! code 1, no panic, and no file written or changed (see [`common::fails`]). Cases marked
//! "regression" broke before the fix named there.

mod common;

use common::{args, fails, forward_fails, run_in, setup, usage_fails, write_input, Spec, SMALL};
use pisa_cli::io::{write_safetensors, DType, IndexTensor, OutTensor};
use pisa_core::TensorLayout;

#[test]
fn missing_unreadable_and_empty_files() {
    let dir = setup();
    let d = dir.path();
    let out = ["-o", "out.safetensors"];
    fails(
        d,
        &[&["forward", "-i", "nosuch.safetensors"][..], &out].concat(),
        &["nosuch.safetensors", "No such file"],
    );
    fails(
        d,
        &[
            "forward",
            "-i",
            "q.npy",
            "--k-file",
            "k.npy",
            "--v-file",
            "nosuch.npy",
            "--layout",
            "bnhd",
        ],
        &["nosuch.npy"],
    );
    // Errors of the command line itself exit with code 2, as clap's usage errors.
    usage_fails(
        d,
        &["forward", "-i", "q.npy", "--layout", "bnhd"],
        &["--k-file"],
    );
    usage_fails(d, &["forward"], &["no input"]);
    std::fs::create_dir(d.join("dir.safetensors")).unwrap();
    fails(
        d,
        &["forward", "-i", "dir.safetensors"],
        &["dir.safetensors", "directory"],
    );
    std::fs::write(d.join("empty.safetensors"), b"").unwrap();
    fails(
        d,
        &["forward", "-i", "empty.safetensors"],
        &["empty.safetensors", "truncated"],
    );
    std::fs::write(d.join("empty.npy"), b"").unwrap();
    fails(
        d,
        &[
            "forward",
            "-i",
            "empty.npy",
            "--k-file",
            "k.npy",
            "--v-file",
            "v.npy",
        ],
        &["empty.npy", "not an npy file"],
    );
    std::fs::write(d.join("qkv.txt"), b"q k v").unwrap();
    fails(
        d,
        &["forward", "-i", "qkv.txt"],
        &["qkv.txt", "unknown tensor file format"],
    );
    for cmd in ["decode", "recall"] {
        fails(
            d,
            &[cmd, "-i", "nosuch.safetensors"],
            &["nosuch.safetensors"],
        );
    }
}

#[test]
fn truncated_and_corrupt_files() {
    let dir = setup();
    let d = dir.path();
    let whole = std::fs::read(d.join("in.safetensors")).unwrap();
    std::fs::write(d.join("cut.safetensors"), &whole[..whole.len() / 2]).unwrap();
    fails(
        d,
        &["forward", "-i", "cut.safetensors"],
        &["cut.safetensors", "truncated"],
    );
    let mut bad = whole.clone();
    bad[8..24].copy_from_slice(b"!garbage header!");
    std::fs::write(d.join("bad.safetensors"), &bad).unwrap();
    fails(
        d,
        &["forward", "-i", "bad.safetensors"],
        &["bad.safetensors", "corrupt"],
    );
    let npy = std::fs::read(d.join("k.npy")).unwrap();
    std::fs::write(d.join("cut.npy"), &npy[..npy.len() - 10]).unwrap();
    fails(
        d,
        &[
            "forward", "-i", "q.npy", "--k-file", "cut.npy", "--v-file", "v.npy", "--layout",
            "bnhd",
        ],
        &["cut.npy", "data bytes"],
    );
}

#[test]
fn wrong_tensor_names_and_layers() {
    let dir = setup();
    let d = dir.path();
    forward_fails(
        d,
        &["--q-name", "query"],
        &["in.safetensors", "`query`", "available: k, q, v"],
    );
    forward_fails(d, &["--v-name", "values"], &["in.safetensors", "`values`"]);
    forward_fails(d, &["--layer", "7"], &["in.safetensors", "`layer7.q`"]);
    // --layer and --k-file/--v-file apply to one kind of input each: refused, not ignored.
    usage_fails(
        d,
        &[
            "forward", "-i", "q.npy", "--k-file", "k.npy", "--v-file", "v.npy", "--layout", "bnhd",
            "--layer", "3",
        ],
        &["q.npy", "--layer"],
    );
    // Regression: tensor names beside .npy inputs were silently ignored.
    for name in ["--q-name", "--k-name", "--v-name"] {
        usage_fails(
            d,
            &[
                "forward", "-i", "q.npy", "--k-file", "k.npy", "--v-file", "v.npy", "--layout",
                "bnhd", name, "foo",
            ],
            &["q.npy", "--q-name, --k-name and --v-name"],
        );
    }
    let forward = ["forward", "-i", "in.safetensors", "-o", "out.safetensors"];
    usage_fails(
        d,
        &args(&forward, &SMALL, &["--k-file", "k.npy"]),
        &["in.safetensors", "--k-file"],
    );
    // Regression: --q-name was silently ignored beside --layer.
    usage_fails(
        d,
        &args(&forward, &SMALL, &["--layer", "0", "--q-name", "query"]),
        &["--layer", "--q-name"],
    );
    // Regression: `-i q.npy --v-file v.npy` said "give K and V" although V was given.
    let npy = ["forward", "-i", "q.npy", "--layout", "bnhd"];
    let only_v = usage_fails(
        d,
        &[&npy[..], &["--v-file", "v.npy"]].concat(),
        &["give K with --k-file"],
    );
    assert!(!only_v.contains("V with"), "{only_v}");
    usage_fails(
        d,
        &[&npy[..], &["--k-file", "k.npy"]].concat(),
        &["give V with --v-file"],
    );
    usage_fails(d, &npy, &["give K and V"]);
}

/// Regression: a tensor name given with its default value (`--q-name q`) was taken for no name
/// at all, so `--layer` and `.npy` inputs, which refuse the names, let it through.
#[test]
fn default_tensor_names_given_explicitly_are_refused_too() {
    let dir = setup();
    let d = dir.path();
    let forward = ["forward", "-i", "in.safetensors", "-o", "out.safetensors"];
    for (name, value) in [("--q-name", "q"), ("--k-name", "k"), ("--v-name", "v")] {
        usage_fails(
            d,
            &args(&forward, &SMALL, &["--layer", "0", name, value]),
            &["--layer", "--q-name, --k-name or --v-name"],
        );
        usage_fails(
            d,
            &[
                "forward", "-i", "q.npy", "--k-file", "k.npy", "--v-file", "v.npy", "--layout",
                "bnhd", name, value,
            ],
            &["q.npy", "--q-name, --k-name and --v-name"],
        );
    }
}

#[test]
fn unsupported_dtypes_and_head_dims() {
    let dir = setup();
    let d = dir.path();
    let s = Spec::small();
    let [q, k, v] = s.qkv();
    let qi = IndexTensor::new("q", q.shape.clone(), vec![1; q.numel()]).unwrap();
    write_safetensors(
        &d.join("int.safetensors"),
        &[
            OutTensor::Index(&qi),
            OutTensor::Float(&k, DType::F32),
            OutTensor::Float(&v, DType::F32),
        ],
        &Default::default(),
    )
    .unwrap();
    fails(
        d,
        &["forward", "-i", "int.safetensors"],
        &["int.safetensors", "dtype I32"],
    );
    // A big-endian npy.
    let mut npy = std::fs::read(d.join("k.npy")).unwrap();
    let at = npy.windows(3).position(|w| w == b"<f4").unwrap();
    npy[at] = b'>';
    std::fs::write(d.join("be.npy"), &npy).unwrap();
    fails(
        d,
        &[
            "forward", "-i", "q.npy", "--k-file", "be.npy", "--v-file", "v.npy", "--layout", "bnhd",
        ],
        &["be.npy", "unsupported npy dtype"],
    );
    let odd = Spec { d: 24, ..s };
    write_input(d, "d24.safetensors", &odd);
    // (Selection alone supports D = 24, so `recall` runs.)
    for cmd in ["forward", "decode"] {
        fails(
            d,
            &[&[cmd, "-i", "d24.safetensors"][..], &SMALL[..]].concat(),
            &["d24.safetensors", "head dim 24 is not supported"],
        );
    }
}

#[test]
fn nonfinite_npy_input_names_the_file() {
    let dir = setup();
    let d = dir.path();
    let s = Spec {
        layout: TensorLayout::Bnhd,
        ..Spec::small()
    };
    let mut q = s.tensor("q", 4, 1);
    q.data[7] = f32::INFINITY;
    pisa_cli::io::write_npy(&d.join("inf.npy"), OutTensor::Float(&q, DType::F32)).unwrap();
    fails(
        d,
        &[
            "forward", "-i", "inf.npy", "--k-file", "k.npy", "--v-file", "v.npy", "--layout",
            "bnhd", "-o", "o.npy",
        ],
        &["inf.npy", "inf at [0, 0, 7]"],
    );
    // Regression: a non-finite value past --tokens, never read, was refused.
    // Bnhd 3-D Q is [n, hq, d]: element 7 of the last token.
    let mut q = s.tensor("q", 4, 1);
    q.data[(s.n - 1) * s.hq * s.d + 7] = f32::NAN;
    pisa_cli::io::write_npy(&d.join("late.npy"), OutTensor::Float(&q, DType::F32)).unwrap();
    let base = [
        "forward", "-i", "late.npy", "--k-file", "k.npy", "--v-file", "v.npy", "--layout", "bnhd",
        "-o", "o.npy",
    ];
    let late = format!("NaN at [{}, 0, 7]", s.n - 1);
    fails(d, &args(&base, &SMALL, &[]), &["late.npy", &late]);
    let n = (s.n - 1).to_string();
    let r = run_in(d, &args(&base, &SMALL, &["--tokens", &n])).ok();
    assert!(r.stdout.contains("wrote"), "{}", r.stdout);
}

/// Regression: a bad softmax scale in the metadata was reported without the file's name.
#[test]
fn bad_scale_metadata_names_the_file() {
    let dir = setup();
    let d = dir.path();
    // Regression: a scale finite in f64 but not in f32 (1e40) was refused
    // without the file's name.
    for (file, scale, want) in [
        (
            "meta.safetensors",
            "abc",
            "`scale` = \"abc\" is not a number",
        ),
        (
            "big.safetensors",
            "1e40",
            "not a finite positive softmax scale",
        ),
    ] {
        let meta = [("scale".to_string(), scale.to_string())].into();
        common::write_st_meta(d, file, &Spec::small().qkv(), DType::F32, &meta);
        fails(d, &["forward", "-i", file], &[file, want]);
    }
    // Regression: `--scale` could not override a bad metadata scale.
    for file in ["meta.safetensors", "big.safetensors"] {
        let base = [
            "forward",
            "-i",
            file,
            "-o",
            "out.safetensors",
            "--scale",
            "0.125",
        ];
        let r = run_in(d, &args(&base, &SMALL, &[])).ok();
        assert!(r.stdout.contains("wrote"), "{file}: {}", r.stdout);
        std::fs::remove_file(d.join("out.safetensors")).unwrap();
    }
}

/// Regression: without XDG_RUNTIME_DIR, Mesa's drivers printed several "error: XDG_RUNTIME_DIR
/// is invalid" lines around pisa's own error; `main` now sets it when unset.
#[test]
fn one_error_line_without_xdg_runtime_dir() {
    let dir = setup();
    let r = common::run_cmd(
        common::pisa()
            .current_dir(dir.path())
            .env_remove("XDG_RUNTIME_DIR")
            .args(["forward", "-i", "in.safetensors", "--adapter", "nosuch"]),
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
}

/// Regression: with `--storage f16`, inputs below f16's range became zeros
/// without a word; now a warning counts them (the run goes on), and f32 storage says nothing.
#[test]
fn f16_storage_warns_of_values_it_rounds_to_zero() {
    let dir = setup();
    let d = dir.path();
    let [mut q, k, v] = Spec::small().qkv();
    for x in q.data.iter_mut().take(10) {
        *x = 1e-30;
    }
    let meta = Default::default();
    common::write_st_meta(d, "tiny.safetensors", &[q, k, v], DType::F32, &meta);
    let base = ["forward", "-i", "tiny.safetensors", "-o", "out.safetensors"];
    let r = run_in(d, &args(&base, &SMALL, &["--storage", "f16"])).ok();
    assert!(
        r.stderr.contains("warning: ") && r.stderr.contains("rounds 10 of Q nonzero values"),
        "{}",
        r.stderr
    );
    std::fs::remove_file(d.join("out.safetensors")).unwrap();
    let r = run_in(d, &args(&base, &SMALL, &[])).ok();
    assert!(!r.stderr.contains("warning"), "{}", r.stderr);
}
