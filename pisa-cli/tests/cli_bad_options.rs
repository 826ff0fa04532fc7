//! Bad options and outputs given to the `pisa` binary: selection options, an output
//! path over an input or that cannot be written, `demo` and `bench` arguments, a benchmark that
//! measures nothing, and malformed command lines (clap's exit code 2). Bad files are in
//! `cli_bad_input.rs`, bad shapes and sizes in `cli_bad_shapes.rs`.
//!
//! Every case is one `error: ` line naming the file (where there is one) and the problem, exit
//! code 1, no panic, and no file written or changed (see [`common::fails`]). Cases marked
//! "regression" broke before the fix named there.

mod common;

use common::{args, fails, forward_fails, run_in, setup, SMALL, TINY_BENCH};
use std::path::Path;

#[test]
fn bad_selection_options() {
    let dir = setup();
    let d = dir.path();
    forward_fails(d, &["--tokens", "0"], &["--tokens 0", "in.safetensors"]);
    forward_fails(
        d,
        &["--tokens", "1000000000"],
        &["--tokens 1000000000", "1..=150"],
    );
    // The core's message names the field; the CLI names the option that set it.
    forward_fails(d, &["--top-k", "0"], &["--top-k must be at least 1"]);
    forward_fails(
        d,
        &["--block-size", "0"],
        &["--block-size must be at least 1"],
    );
    forward_fails(d, &["--merge", "1"], &["merge factor"]);
    // Regressions: a top_k, merge factor or block size near usize::MAX
    // overflowed into a division by zero in the routing plan (a panic); each is now refused by
    // name, with its limit. (A block of 65536 tokens over 150 gave NaN with exit 0: see
    // `block_far_above_the_sequence` in cli_forward.rs.)
    let max = "18446744073709551615";
    forward_fails(
        d,
        &["--top-k", max],
        &["--top-k 18446744073709551615 is above the limit of 16777216"],
    );
    forward_fails(
        d,
        &["--merge", "65"],
        &["--merge 65 is above the limit of 64"],
    );
    forward_fails(
        d,
        &["--merge", "9223372036854775808"],
        &["--merge 9223372036854775808 is above the limit of 64"],
    );
    forward_fails(
        d,
        &["--block-size", "4294967296", "--top-k", "1"],
        &["--block-size 4294967296 is above the limit of 1048576"],
    );
    fails(
        d,
        &["decode", "-i", "in.safetensors", "--top-k", max],
        &["--top-k 18446744073709551615 is above the limit of 16777216"],
    );
    forward_fails(d, &["--q-tile", "0"], &["--q-tile"]);
    forward_fails(
        d,
        &["--sink-blocks", "4"],
        &[
            "--top-k 4 is smaller than the 5 forced blocks",
            "--sink-blocks",
        ],
    );
    // Regression: `--scale -1` was taken for a flag (clap usage error, exit 2); now parsed
    // and refused by name (`allow_hyphen_values` on --scale).
    forward_fails(
        d,
        &["--scale", "-1"],
        &["--scale -1", "finite and positive"],
    );
    forward_fails(
        d,
        &["--scale", "-0.5e-3"],
        &["--scale", "finite and positive"],
    );
    forward_fails(d, &["--scale=0"], &["--scale 0"]);
    // A value past f32's range is named as given (it read as its f32 rounding, 0 or inf).
    forward_fails(d, &["--scale", "1e-50"], &["--scale 1e-50", "underflows"]);
    forward_fails(d, &["--scale", "3.5e38"], &["--scale 3.5e38", "overflows"]);
    forward_fails(d, &["--adapter", "nosuch"], &["nosuch", "adapter"]);
    fails(
        d,
        &["recall", "-i", "in.safetensors", "--top-k", "0"],
        &["--top-k must be at least 1"],
    );
    // Regression: recall took --scoring and ignored it. It has no such option: a usage error
    // (exit 2).
    not_an_option(
        d,
        &["recall", "-i", "in.safetensors", "--scoring", "mean"],
        "--scoring",
    );
    // The oracle reads f32 or f16: bf16 storage is a usage error, not a library message.
    common::usage_fails(
        d,
        &["recall", "-i", "in.safetensors", "--storage", "bf16"],
        &["--storage bf16 does not apply to recall"],
    );
}

/// Regression: `recall --help` listed bf16 among its storages, which recall then refused; it
/// lists only f32 and f16 (forward's still lists bf16).
#[test]
fn recall_help_lists_only_the_storages_it_takes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let short = run_in(d, &["recall", "-h"]).ok().stdout;
    let line = short.lines().find(|l| l.contains("--storage")).unwrap();
    assert!(line.contains("[possible values: f32, f16]"), "{line}");
    let long = run_in(d, &["recall", "--help"]).ok().stdout;
    assert!(long.contains("- f16") && !long.contains("- bf16"), "{long}");
    let forward = run_in(d, &["forward", "--help"]).ok().stdout;
    assert!(forward.contains("- bf16"), "{forward}");
}

/// Regression: an output path equal to an input file replaced the input with the results (the
/// atomic rename happily renamed over it); now refused before any work
/// (`io::check_output_paths`), also through a symbolic link and for `.npy` siblings.
#[test]
fn output_over_an_input_is_refused() {
    let dir = setup();
    let d = dir.path();
    let base = ["-i", "in.safetensors"];
    for cmd in ["forward", "decode"] {
        fails(
            d,
            &[&[cmd][..], &base[..], &["-o", "in.safetensors"], &SMALL[..]].concat(),
            &["cannot write in.safetensors", "input file"],
        );
        fails(
            d,
            &[
                &[cmd][..],
                &base[..],
                &["-o", "./in.safetensors"],
                &SMALL[..],
            ]
            .concat(),
            &["input file in.safetensors"],
        );
    }
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink("in.safetensors", d.join("link.safetensors")).unwrap();
        fails(
            d,
            &["forward", "-i", "link.safetensors", "-o", "in.safetensors"],
            &["input file link.safetensors"],
        );
    }
    // `-o q.npy` writes q.o.npy and q.lse.npy: K given as q.o.npy would be overwritten.
    std::fs::copy(d.join("k.npy"), d.join("q.o.npy")).unwrap();
    fails(
        d,
        &[
            "forward", "-i", "q.npy", "--k-file", "q.o.npy", "--v-file", "v.npy", "--layout",
            "bnhd", "-o", "q.npy",
        ],
        &["cannot write q.o.npy", "input file q.o.npy"],
    );
}

/// Regression: an output in a missing directory, a directory as output, or bf16 in npy failed
/// only after the whole computation (with a temporary-file path in the message); now refused
/// first, naming the output.
#[test]
fn unwritable_outputs_are_refused_first() {
    let dir = setup();
    let d = dir.path();
    for cmd in ["forward", "decode"] {
        let run = |o: &str, extra: &[&str], want: &[&str]| {
            fails(
                d,
                &[
                    &[cmd, "-i", "in.safetensors", "-o", o][..],
                    &SMALL[..],
                    extra,
                ]
                .concat(),
                want,
            )
        };
        run(
            "nodir/out.safetensors",
            &[],
            &[
                "cannot write nodir/out.safetensors",
                "directory nodir does not exist",
            ],
        );
        std::fs::create_dir_all(d.join("sub.safetensors")).unwrap();
        run(
            "sub.safetensors",
            &[],
            &["sub.safetensors", "is a directory"],
        );
        // Regression: a FIFO (or a device, through a link) as output was replaced by a
        // regular file, and the command said it wrote it.
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            let fifo = d.join(format!("{cmd}-fifo.safetensors"));
            let ok = std::process::Command::new("mkfifo").arg(&fifo).status();
            assert!(ok.is_ok_and(|s| s.success()), "mkfifo");
            let link = d.join(format!("{cmd}-link.safetensors"));
            std::os::unix::fs::symlink(&fifo, &link).unwrap();
            for o in [&fifo, &link] {
                let name = o.file_name().unwrap().to_str().unwrap();
                run(name, &[], &[name, "not a regular file"]);
            }
            let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
            assert!(kind.is_fifo(), "{kind:?}");
            // Regression: a dangling link into a missing directory passed the check of the
            // link's own directory, and the write through it failed after the run.
            let dangling = format!("{cmd}-dangling.safetensors");
            std::os::unix::fs::symlink("gone/target.safetensors", d.join(&dangling)).unwrap();
            run(
                &dangling,
                &[],
                &[
                    &format!("cannot write {dangling} (a link to"),
                    "directory gone does not exist",
                ],
            );
        }
        // bf16 and an npy output do not go together: a usage error, exit 2.
        common::usage_fails(
            d,
            &[
                &[cmd, "-i", "in.safetensors", "-o", "out.npy"][..],
                &SMALL[..],
                &["--out-dtype", "bf16"],
            ]
            .concat(),
            &["out.npy", "bf16"],
        );
        // Regression: exit 1 without naming the option, where a --json name of another
        // extension is a usage error (exit 2).
        common::usage_fails(
            d,
            &[
                &[cmd, "-i", "in.safetensors", "-o", "out.txt"][..],
                &SMALL[..],
            ]
            .concat(),
            &["-o/--output out.txt", "unknown tensor file format"],
        );
        assert!(!d.join("out.txt").exists());
    }
}

#[test]
fn bad_demo_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fails(d, &["demo", "--tokens", "0"], &["--tokens 0"]);
    // Regression: `--tokens 1` panicked (`clamp` with min > max in the decode part).
    fails(d, &["demo", "--tokens", "1"], &["--tokens 1", "at least 2"]);
    fails(
        d,
        &["demo", "--tokens", "99999"],
        &["--tokens 99999", "2..=4096"],
    );
    fails(d, &["demo", "--steps", "0"], &["--steps"]);
    // Regression: more steps than the tokens allow silently ran `tokens - 1` steps.
    fails(
        d,
        &["demo", "--tokens", "256", "--steps", "1000"],
        &["--steps 1000", "at most 255"],
    );
    fails(d, &["demo", "--adapter", "nosuch"], &["nosuch"]);
}

#[test]
fn bad_bench_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bench =
        |extra: &[&str], want: &[&str]| fails(d, &args(&["bench"], &TINY_BENCH, extra), want);
    // A value that does not parse (a size, a storage name, a list where one size goes) is a
    // usage error, exit 2, as clap's own (`--top-k abc`); one out of range exits 1.
    let usage = |extra: &[&str], want: &[&str]| {
        common::usage_fails(d, &args(&["bench"], &TINY_BENCH, extra), want)
    };
    usage(&["--sizes", "abc"], &["--sizes", "bad size \"abc\""]);
    usage(
        &["--decode-sizes", "4k,x"],
        &["--decode-sizes", "bad size \"x\""],
    );
    // Regression: a size whose k/m suffix overflowed panicked (attempt to multiply with overflow).
    bench(
        &["--sizes", "18446744073709551615k"],
        &["--sizes", "too large"],
    );
    bench(&["--sizes", "0"], &["at least 1"]);
    // Options that do not go together are usage errors too (exit 2).
    usage(
        &["--sizes", "", "--decode-sizes", ""],
        &["nothing to measure"],
    );
    usage(&["--storages", "f64"], &["unknown storage \"f64\""]);
    // Regression: a negative warm-up was "unexpected argument '-1'", naming no option; a
    // number out of range is then exit code 1 as every option's range (it was clap's 2), what
    // is not a number clap's usage error; the first line names the option and the range.
    for (bad, code) in [("-1", 1), ("nan", 1), ("1001", 1), ("abc", 2)] {
        let r = run_in(d, &args(&["bench"], &TINY_BENCH, &["--warmup-ms", bad]));
        let first = r.stderr.lines().next().unwrap_or_default();
        assert_eq!(r.code, Some(code), "{bad}: {}", r.stderr);
        assert!(
            first.starts_with("error: ")
                && first.contains("--warmup-ms")
                && first.contains("from 0 to 1000"),
            "{bad}: {}",
            r.stderr
        );
    }
    // Regression: --tune (a global option) was accepted and ignored by --compare.
    let saved = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/runs/h100-2026-12-07y5-bench.json"
    );
    common::usage_fails(
        d,
        &["--tune", "leaf_order=tiles", "bench", "--compare", saved],
        &["--tune leaf_order=tiles", "--compare prints saved runs"],
    );
    usage(&["--dense-max", "x"], &["--dense-max"]);
    usage(&["--backward-max", "x"], &["--backward-max"]);
    // Regressions: a list was read as its first size, an empty value as 0 (never); each ran.
    for (opt, value, want) in [
        (
            "--dense-max",
            "1k,64k",
            "--dense-max 1k,64k: takes one size",
        ),
        (
            "--backward-max",
            "4k,8k",
            "--backward-max 4k,8k: takes one size",
        ),
        ("--dense-max", "", "--dense-max is empty"),
        ("--backward-max", " ", "--backward-max is empty"),
    ] {
        let tiny = ["--sizes", "64", "--decode-sizes", ""];
        usage(&[&tiny[..], &[opt, value]].concat(), &[want]);
    }
    bench(&["--hkv", "3"], &["--hq 2", "--hkv 3"]);
    // Regression: `--hkv 0` read "--hq 2 must be a positive multiple of --hkv 0".
    bench(&["--hkv", "0"], &["--hkv must be at least 1"]);
    // Regression: `--hq 0` "skipped" every size and exited 0 with an empty table.
    bench(&["--hq", "0"], &["--hq"]);
    bench(
        &["--decode-burst", "0"],
        &["--decode-burst must be at least 1"],
    );
    bench(
        &["--decode-burst", "5000"],
        &["--decode-burst must be at most 2048"],
    );
    // Regressions: each "skipped" every size (naming the library's field, not the option)
    // before `nothing was measured`, where the other commands refuse it up front.
    bench(&["--q-tile", "0"], &["--q-tile must be at least 1"]);
    bench(&["--d", "24"], &["--d 24", "head dim 24"]);
    // A decode-only run too (its dense baseline takes the prefill's head dims): refused up
    // front, with one message whatever D (it named the decode step's wider set at D 1028).
    for d in ["20", "1028"] {
        bench(
            &["--sizes=", "--decode-sizes", "256", "--d", d],
            &[
                &format!("--d {d} for the decode sizes"),
                "multiples of 16 from 16 to 256",
            ],
        );
    }
    bench(
        &["--top-k", "18446744073709551615"],
        &["--top-k 18446744073709551615 is above the limit of 16777216"],
    );
    // Regressions: each was accepted and ignored or misreported.
    usage(&["--storages="], &["--storages is empty"]);
    // Regressions: an empty list entry was dropped without a word (`1,,` ran as `1`), `,` was
    // read as no sizes (exit 1), and a repeated entry exited 1: malformed lists exit 2.
    usage(&["--sizes", "64,,"], &["--sizes", "has an empty entry"]);
    usage(&["--sizes", ","], &["--sizes", "has an empty entry"]);
    usage(
        &["--decode-sizes", ",4k"],
        &["--decode-sizes", "has an empty entry"],
    );
    usage(
        &["--storages", "f32,,f16"],
        &["--storages", "has an empty entry"],
    );
    usage(
        &["--storages", "f32,f32"],
        &["--storages: storage f32 is listed twice"],
    );
    bench(
        &["--sizes", "18446744073709551615"],
        &["too large: at most 4294967295"],
    );
    bench(&["--reps", "0"], &["--reps must be at least 1"]);
    bench(&["--top-k", "0"], &["--top-k must be at least 1"]);
    bench(
        &["--decode-reps", "0"],
        &["--decode-reps must be at least 1"],
    );
    for b in ["nan", "inf", "-1"] {
        bench(&["--budget-s", b], &["--budget-s", "finite"]);
    }
    usage(&["--json", "b.safetensors"], &["must end in .json"]);
    std::fs::write(d.join("in.json"), b"[1, 2]").unwrap();
    bench(
        &["--json", "in.json"],
        &["in.json", "not a pisa bench JSON file"],
    );
    std::fs::write(d.join("p.json"), br#"{"adapter":"x","vendor":1,"backend":"b","driver":"d","command":"c","shape":"s","records":[]}"#).unwrap();
    std::fs::write(d.join("p.svg"), b"mine").unwrap();
    bench(&["--json", "p.json"], &["p.svg", "not an SVG plot"]);
    // Regression: `--json` into a missing directory failed only after the whole benchmark.
    bench(
        &["--sizes", "64", "--json", "nodir/b.json"],
        &["nodir/b.json", "does not exist"],
    );
    // Regression: a directory that exists but takes no new files (root writes anywhere else)
    // also failed only after the whole benchmark, naming the temporary file.
    if Path::new("/proc/self").is_dir() {
        bench(
            &["--sizes", "64", "--json", "/proc/b.json"],
            &["/proc/b.json", "does not take new files"],
        );
    }
    fails(
        d,
        &["bench", "--compare", "missing.json"],
        &["missing.json", "No such file"],
    );
    std::fs::write(d.join("bad.json"), b"{\"adapter\": 1}").unwrap();
    fails(
        d,
        &["bench", "--compare", "bad.json"],
        &["bad.json", "not a pisa bench JSON file"],
    );
    std::fs::write(d.join("compare.svg"), b"<svg/>").unwrap();
    fails(d, &["bench", "--compare", "compare.svg"], &["compare.svg"]);

    // Regression: times no run writes (negative, 1e300 ms) were tabled and
    // plotted as they came.
    for (file, ms) in [("neg.json", "-1.5"), ("huge.json", "1e300")] {
        let rec = format!(
            r#"{{"op":"pisa_select","n":4096,"storage":"f32","ms":{ms},"reps":1,"gpu_timed":true,"tflops":null,"gbps":null,"path":"portable"}}"#
        );
        let json = format!(
            r#"{{"adapter":"x","vendor":1,"backend":"b","driver":"d","command":"c","shape":"s","records":[{rec}]}}"#
        );
        std::fs::write(d.join(file), json).unwrap();
        // (in exponent form past 1e6: the plain form printed 301 digits)
        let want = format!("record pisa_select at N 4096 has {ms} ms");
        fails(d, &["bench", "--compare", file], &[file, &want]);
    }
    // Regression: a record with N 0 made the plot's log axis start at i32::MIN (the command
    // hung, writing gigabytes of axis lines).
    let rec = r#"{"op":"pisa_prefill","n":0,"storage":"f32","ms":1.5,"reps":1,"gpu_timed":true,"tflops":null,"gbps":null,"path":"portable"}"#;
    std::fs::write(
        d.join("n0.json"),
        format!(r#"{{"adapter":"x","vendor":1,"backend":"b","driver":"d","command":"c","shape":"s","records":[{rec}]}}"#),
    )
    .unwrap();
    fails(
        d,
        &["bench", "--compare", "n0.json", "--plot", "n0.svg"],
        &["n0.json", "record pisa_prefill has N 0"],
    );
    assert!(!d.join("n0.svg").exists());
    // Regression: two records of one (op, N, storage) were tabled as one cell, the other
    // dropped without a word.
    let rec = |ms: f64| {
        format!(
            r#"{{"op":"pyramid","n":1024,"storage":"f32","ms":{ms},"reps":1,"gpu_timed":true,"tflops":null,"gbps":null,"path":"portable"}}"#
        )
    };
    std::fs::write(
        d.join("dup.json"),
        format!(
            r#"{{"adapter":"x","vendor":1,"backend":"b","driver":"d","command":"c","shape":"s","records":[{},{}]}}"#,
            rec(0.57),
            rec(999.0)
        ),
    )
    .unwrap();
    fails(
        d,
        &["bench", "--compare", "dup.json"],
        &[
            "dup.json",
            "record pyramid at N 1024 (f32) appears more than once",
        ],
    );
    // Regression: --plot replaced any file of that name, where --json refuses to.
    std::fs::write(d.join("notes.svg"), b"precious").unwrap();
    fails(
        d,
        &["bench", "--compare", "p.json", "--plot", "notes.svg"],
        &["--plot", "notes.svg", "not an SVG plot"],
    );
    assert_eq!(std::fs::read(d.join("notes.svg")).unwrap(), b"precious");
    // Regression: a size or storage listed twice was measured twice, and tabled once (a
    // malformed list: exit 2).
    usage(
        &["--sizes", "256,256"],
        &["--sizes", "size 256 is listed twice"],
    );
    usage(&["--sizes", "1k,1024"], &["size 1024 is listed twice"]);
    usage(
        &["--decode-sizes", "4k,4k"],
        &["--decode-sizes", "listed twice"],
    );
}

/// Regression: a head dim the kernels do not support "skipped" every size and exited 0; now the
/// skip reasons are printed and the run fails. (A head dim is now refused before any size, as
/// `--d` in `bad_bench_arguments`; a GQA group past the routing's rows still skips each size.)
#[test]
fn bench_where_every_size_is_skipped_fails() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(
        dir.path(),
        &[
            "bench",
            "--sizes",
            "64",
            "--decode-sizes",
            "",
            "--hq",
            "128",
            "--hkv",
            "1",
            "--d",
            "32",
            "--storages",
            "f32",
            "--reps",
            "1",
        ],
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("N=64 f32: skipped"), "{}", r.stderr);
    assert!(
        r.stderr.contains("128 query heads per KV head"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .lines()
            .last()
            .unwrap()
            .contains("nothing was measured"),
        "{}",
        r.stderr
    );
    assert!(common::snapshot(dir.path()).is_empty());
}

/// Command-line syntax errors are clap's: exit code 2, the first line says what is wrong.
#[test]
fn malformed_command_lines() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["forward", "--scale", "abc"][..],
        &["forward", "--layout", "nhd"],
        &["nosuch"],
        &["forward", "--bogus"],
        // Regression: --compare ignored the measuring flags given with it.
        &["bench", "--compare", "a.json", "--sizes", "4k"],
        &["bench", "--compare", "a.json", "--json", "b.json"],
        // Regression: an empty adapter name matched every adapter and ran on the first.
        &["bench", "--adapter", "", "--sizes", "64"],
        &["demo", "--adapter", " "],
        &["forward", "--adapter", ""],
    ] {
        let r = run_in(dir.path(), args);
        assert_eq!(r.code, Some(2), "{args:?}: {}", r.stderr);
        assert!(r.stderr.starts_with("error: "), "{args:?}: {}", r.stderr);
        assert!(!r.stderr.contains("panicked"));
    }
}

/// Regressions: `decode --non-causal` ran and gave wrong rows; `--out-dtype`
/// and `--save-selection` without `-o` were ignored.
#[test]
fn decode_non_causal_and_flags_without_output_are_refused() {
    let dir = setup();
    let d = dir.path();
    let decode = ["decode", "-i", "in.safetensors"];
    not_an_option(
        d,
        &[&decode[..], &SMALL, &["--non-causal"]].concat(),
        "--non-causal",
    );
    for cmd in ["forward", "decode"] {
        let base = [cmd, "-i", "in.safetensors"];
        for (flag, want) in [
            (&["--save-selection"][..], "--save-selection requires -o"),
            (&["--out-dtype", "f16"], "--out-dtype requires -o"),
        ] {
            common::usage_fails(d, &[&base[..], &SMALL, flag].concat(), &[want]);
        }
    }
}

/// Runs `pisa args...` in `dir` and checks that clap refused `flag` as an option the command
/// does not have: exit code 2, no panic, nothing on stdout, and `dir` unchanged.
fn not_an_option(dir: &Path, args: &[&str], flag: &str) {
    let before = common::snapshot(dir);
    let r = run_in(dir, args);
    let what = format!("`pisa {}`", args.join(" "));
    assert_eq!(r.code, Some(2), "{what}: exit code\nstderr: {}", r.stderr);
    let want = format!("error: unexpected argument '{flag}'");
    assert!(r.stderr.starts_with(&want), "{what}: {want}:\n{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{what}:\n{}", r.stderr);
    assert!(r.stdout.is_empty(), "{what}: stdout:\n{}", r.stdout);
    assert!(before == common::snapshot(dir), "{what}: files changed");
}

/// Regression: `decode --help` offered `--non-causal` and `recall --help` offered `--scoring`,
/// options those commands then refused. Each command offers, and takes, only the options it
/// applies: `forward` both, `decode` `--scoring` (decode is causal), `recall` `--non-causal`
/// (it measures every scoring); `--no-warmup` only `forward` (and `demo`), which time a
/// warmed-up prefill.
#[test]
fn commands_offer_only_the_options_they_apply() {
    let dir = setup();
    let d = dir.path();
    let base = |cmd| {
        [
            cmd,
            "-i",
            "in.safetensors",
            "--block-size",
            "16",
            "--top-k",
            "4",
        ]
    };
    for (cmd, scoring, non_causal, no_warmup) in [
        ("forward", true, true, true),
        ("decode", true, false, false),
        ("recall", false, true, false),
    ] {
        let help = run_in(d, &[cmd, "--help"]).ok().stdout;
        assert_eq!(help.contains("--scoring"), scoring, "{cmd}:\n{help}");
        assert_eq!(help.contains("--non-causal"), non_causal, "{cmd}:\n{help}");
        assert_eq!(help.contains("--no-warmup"), no_warmup, "{cmd}:\n{help}");
        let base = base(cmd);
        if !scoring {
            not_an_option(
                d,
                &[&base[..], &["--scoring", "mean"]].concat(),
                "--scoring",
            );
        }
        if !non_causal {
            not_an_option(d, &[&base[..], &["--non-causal"]].concat(), "--non-causal");
        }
        if !no_warmup {
            not_an_option(d, &[&base[..], &["--no-warmup"]].concat(), "--no-warmup");
        }
    }
    let help = run_in(d, &["demo", "--help"]).ok().stdout;
    assert!(help.contains("--no-warmup"), "demo:\n{help}");
    // The options a command offers still reach it.
    let j = run_in(
        d,
        &[&base("decode")[..], &["--scoring", "meanvar", "--json"]].concat(),
    )
    .ok()
    .json();
    assert_eq!(j["config"]["scoring"], "meanvar", "{j}");
    run_in(d, &[&base("recall")[..], &["--non-causal"]].concat()).ok();
}
