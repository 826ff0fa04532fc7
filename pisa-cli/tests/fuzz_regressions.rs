//! Regression corpus of the tensor file parsers (`docs/reliability.md`): every file under
//! `tests/corpus/npy` and `tests/corpus/safetensors` goes through the float and the index reader of
//! `pisa_cli::io`, by bytes and by path. None may panic; files listed in
//! `tests/corpus/expect.txt` must give the stated result (`ok`, or an error whose full chain
//! contains the stated text). New crashers from `fuzz/` go into the corpus directories (with a
//! line in `expect.txt` once the fix decides what they should give).
//!
//! `PISA_CORPUS_PRINT=1 cargo test -p pisa-cli --test fuzz_regressions -- --nocapture` prints
//! what every file gives, to write new expectation lines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pisa_cli::io::{
    parse_index_tensor_bytes, parse_safetensors_header_bytes, parse_tensor_bytes,
    read_index_tensor, read_metadata, read_tensor, tensor_names, Format,
};

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

/// `ok`, or `err: <full error chain>`.
fn outcome<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => format!("err: {e:#}"),
    }
}

fn files() -> Vec<(String, Format)> {
    let mut out = Vec::new();
    for (dir, fmt) in [("npy", Format::Npy), ("safetensors", Format::Safetensors)] {
        let mut names: Vec<String> = std::fs::read_dir(corpus().join(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        out.extend(names.into_iter().map(|n| (format!("{dir}/{n}"), fmt)));
    }
    out
}

/// `path -> (float expectation, index expectation)` from `expect.txt`
/// (`path <TAB> float <TAB> index`; `#` comments).
fn expectations() -> BTreeMap<String, (String, String)> {
    let text = std::fs::read_to_string(corpus().join("expect.txt")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(
                f.len(),
                3,
                "expect.txt line {l:?}: want 3 tab-separated fields"
            );
            (f[0].to_string(), (f[1].to_string(), f[2].to_string()))
        })
        .collect()
}

fn matches(got: &str, want: &str) -> bool {
    if want == "ok" {
        got == "ok"
    } else {
        got.starts_with("err: ") && got.contains(want)
    }
}

/// Runs every reader on one file's bytes and path, catching panics.
fn run_all(rel: &str, fmt: Format) -> (String, String) {
    let path = corpus().join(rel);
    let bytes = std::fs::read(&path).unwrap();
    let name = "x";
    let r = std::panic::catch_unwind(|| {
        let f = outcome(parse_tensor_bytes(fmt, &bytes, name));
        let i = outcome(parse_index_tensor_bytes(fmt, &bytes, name));
        // The path readers add context but must agree on ok / error.
        let fp = outcome(read_tensor(&path, name));
        let ip = outcome(read_index_tensor(&path, name));
        assert_eq!(f == "ok", fp == "ok", "{rel}: bytes {f} vs path {fp}");
        assert_eq!(i == "ok", ip == "ok", "{rel}: bytes {i} vs path {ip}");
        if fmt == Format::Safetensors {
            let _ = parse_safetensors_header_bytes(&bytes);
            let _ = tensor_names(&path);
            let _ = read_metadata(&path);
        }
        // Successful reads are self-consistent.
        if let Ok(t) = parse_tensor_bytes(fmt, &bytes, name) {
            assert_eq!(t.data.len(), t.shape.iter().product::<usize>(), "{rel}");
        }
        if let Ok(t) = parse_index_tensor_bytes(fmt, &bytes, name) {
            assert_eq!(t.data.len(), t.shape.iter().product::<usize>(), "{rel}");
        }
        (f, i)
    });
    r.unwrap_or_else(|_| panic!("{rel}: a reader panicked"))
}

#[test]
fn corpus_gives_clear_errors_and_never_panics() {
    let expect = expectations();
    let print = std::env::var_os("PISA_CORPUS_PRINT").is_some();
    let files = files();
    assert!(
        files.len() >= 50,
        "corpus went missing: {} files",
        files.len()
    );
    let mut failures = Vec::new();
    for (rel, fmt) in &files {
        let (f, i) = run_all(rel, *fmt);
        if print {
            println!("{rel}\n  float: {f}\n  index: {i}");
        }
        match expect.get(rel) {
            Some((wf, wi)) => {
                if !matches(&f, wf) {
                    failures.push(format!("{rel}: float reader gave {f:?}, expected {wf:?}"));
                }
                if !matches(&i, wi) {
                    failures.push(format!("{rel}: index reader gave {i:?}, expected {wi:?}"));
                }
            }
            // Fuzzer finds without an expectation: must not panic, and an error must say
            // something (not an empty message).
            None => {
                for r in [&f, &i] {
                    assert!(r == "ok" || r.len() > "err: ".len() + 10, "{rel}: {r}");
                }
            }
        }
    }
    for k in expect.keys() {
        if !files.iter().any(|(r, _)| r == k) {
            failures.push(format!("{k}: listed in expect.txt but missing"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every error message names the file when read by path (the CLI prints it as is).
#[test]
fn path_errors_name_the_file() {
    for (rel, fmt) in files() {
        let path = corpus().join(&rel);
        if let Err(e) = read_tensor(&path, "x") {
            let msg = format!("{e:#}");
            assert!(msg.contains(&rel), "{rel}: {msg}");
        }
        let _ = fmt;
    }
}
