//! Helpers shared by the command-line tests: running the real `pisa` binary, writing small
//! Q/K/V files, the small input directory and flags the runs share, and checking that a failing
//! run is one clear error line that left nothing behind.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use pisa_cli::io::{write_npy, write_safetensors, DType, HostTensor, OutTensor};
use pisa_core::TensorLayout;

/// The `pisa` binary built by cargo for these tests.
pub fn pisa() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pisa"))
}

/// What a run gave.
pub struct Run {
    /// Exit code (None: killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Run {
    /// Panics with the run's output unless it exited 0.
    pub fn ok(self) -> Run {
        assert_eq!(
            self.code,
            Some(0),
            "failed:\nstdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        self
    }

    /// The standard output parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", self.stdout))
    }
}

/// Runs `pisa args...` in `dir`.
pub fn run_in(dir: &Path, args: &[&str]) -> Run {
    run_cmd(pisa().current_dir(dir).args(args))
}

/// Runs a prepared command.
pub fn run_cmd(c: &mut Command) -> Run {
    let o = c.output().unwrap();
    Run {
        code: o.status.code(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// Names in `dir` (recursively, relative, sorted) with their contents, to see that a failing run
/// changed nothing.
pub fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            if p.is_dir() && !p.is_symlink() {
                out.push((rel + "/", Vec::new()));
                walk(root, &p, out);
            } else if std::fs::metadata(&p).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
                // A FIFO or device (or a link to one): named, never opened (a read would
                // block on a FIFO).
                out.push((rel + " (not a regular file)", Vec::new()));
            } else {
                out.push((rel, std::fs::read(&p).unwrap_or_default()));
            }
        }
    }
    let mut v = Vec::new();
    walk(dir, dir, &mut v);
    v.sort();
    v
}

/// Runs `pisa args...` in `dir` and checks that it failed the way every bad input must: exit
/// code 1, no panic, exactly one line on stderr starting with `error: ` and containing each of
/// `want`, nothing on stdout, and `dir` exactly as before. Returns the error line.
pub fn fails(dir: &Path, args: &[&str], want: &[&str]) -> String {
    fails_with(dir, args, want, 1)
}

/// As [`fails`] for an error of the command line itself (options that do not go together, a
/// missing input): exit code 2, as clap's usage errors.
pub fn usage_fails(dir: &Path, args: &[&str], want: &[&str]) -> String {
    fails_with(dir, args, want, 2)
}

/// [`fails`] with exit code `code`.
fn fails_with(dir: &Path, args: &[&str], want: &[&str], code: i32) -> String {
    let before = snapshot(dir);
    let r = run_in(dir, args);
    let what = format!("`pisa {}`", args.join(" "));
    assert!(
        !r.stderr.contains("panicked"),
        "{what} panicked:\n{}",
        r.stderr
    );
    assert_eq!(
        r.code,
        Some(code),
        "{what}: exit code\nstderr: {}",
        r.stderr
    );
    let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "{what}: want one error line, got:\n{}",
        r.stderr
    );
    let line = lines[0];
    assert!(line.starts_with("error: "), "{what}: {line}");
    for w in want {
        assert!(line.contains(w), "{what}: error line lacks {w:?}:\n{line}");
    }
    assert!(r.stdout.trim().is_empty(), "{what}: stdout:\n{}", r.stdout);
    let after = snapshot(dir);
    let names = |s: &[(String, Vec<u8>)]| s.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&before), names(&after), "{what}: files changed");
    assert!(before == after, "{what}: a file's contents changed");
    line.to_string()
}

/// Deterministic pseudo-random values in about [-2, 2] (sum of two uniforms), by seed.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n).map(|_| 2.0 * (next() + next()) - 2.0).collect()
}

/// A Q/K/V test input: logical shape `[B, H, N, D]` per tensor.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Batch; `None` writes 3-D tensors (batch 1 implied).
    pub batch: Option<usize>,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads.
    pub hkv: usize,
    /// Tokens.
    pub n: usize,
    /// Head dim.
    pub d: usize,
    /// Layout the files are written in.
    pub layout: TensorLayout,
    /// dtype in the file.
    pub dtype: DType,
}

impl Spec {
    /// Batch 1 (3-D), Hq 4, Hkv 2, N 150 (a partial last block at C = 16), D 32, BHND, f32.
    pub fn small() -> Spec {
        Spec {
            batch: None,
            hq: 4,
            hkv: 2,
            n: 150,
            d: 32,
            layout: TensorLayout::Bhnd,
            dtype: DType::F32,
        }
    }

    /// The file shape of a tensor with `h` heads.
    pub fn dims(&self, h: usize) -> Vec<usize> {
        let inner = match self.layout {
            TensorLayout::Bhnd => vec![h, self.n, self.d],
            TensorLayout::Bnhd => vec![self.n, h, self.d],
        };
        match self.batch {
            Some(b) => [vec![b], inner].concat(),
            None => inner,
        }
    }

    /// A tensor named `name` with `h` heads in this layout (values by seed).
    pub fn tensor(&self, name: &str, h: usize, seed: u64) -> HostTensor {
        let dims = self.dims(h);
        let n = dims.iter().product();
        HostTensor::new(name, dims, values(n, seed)).unwrap()
    }

    /// Q, K, V tensors (names `q`, `k`, `v`).
    pub fn qkv(&self) -> [HostTensor; 3] {
        [
            self.tensor("q", self.hq, 1),
            self.tensor("k", self.hkv, 2),
            self.tensor("v", self.hkv, 3),
        ]
    }
}

/// Writes `tensors` (stored as `dtype`) into a `.safetensors` file `dir/name`.
pub fn write_st(dir: &Path, name: &str, tensors: &[HostTensor], dtype: DType) -> PathBuf {
    write_st_meta(dir, name, tensors, dtype, &BTreeMap::new())
}

/// [`write_st`] with metadata.
pub fn write_st_meta(
    dir: &Path,
    name: &str,
    tensors: &[HostTensor],
    dtype: DType,
    meta: &BTreeMap<String, String>,
) -> PathBuf {
    let p = dir.join(name);
    let list: Vec<OutTensor> = tensors.iter().map(|t| OutTensor::Float(t, dtype)).collect();
    write_safetensors(&p, &list, meta).unwrap();
    p
}

/// Writes the spec's Q, K, V into `dir/name` (`.safetensors`).
pub fn write_input(dir: &Path, name: &str, spec: &Spec) -> PathBuf {
    write_st(dir, name, &spec.qkv(), spec.dtype)
}

/// Writes the spec's Q, K, V as `dir/{q,k,v}.npy`.
pub fn write_npy_input(dir: &Path, spec: &Spec) -> [PathBuf; 3] {
    let [q, k, v] = spec.qkv();
    let mut out = Vec::new();
    for t in [&q, &k, &v] {
        let p = dir.join(format!("{}.npy", t.name));
        write_npy(&p, OutTensor::Float(t, spec.dtype)).unwrap();
        out.push(p);
    }
    out.try_into().unwrap()
}

/// A temporary directory holding `in.safetensors` (the small spec) and `q/k/v.npy` (BNHD).
pub fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_input(dir.path(), "in.safetensors", &Spec::small());
    write_npy_input(
        dir.path(),
        &Spec {
            layout: TensorLayout::Bnhd,
            ..Spec::small()
        },
    );
    dir
}

/// The selection flags of the small runs: C = 16, K = 4.
pub const SMALL: [&str; 4] = ["--block-size", "16", "--top-k", "4"];

/// A tiny `pisa bench` configuration (Hq 2, Hkv 1, D 32, C 16, K 4, f32 storage, one
/// repetition), to add sizes to.
pub const TINY_BENCH: [&str; 14] = [
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
];

/// `base`, then the `(flag, value)` pairs of `defaults` whose flag `extra` does not give, then
/// `extra` (clap refuses a flag given twice).
pub fn args<'a>(base: &[&'a str], defaults: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = base.to_vec();
    for pair in defaults.chunks(2) {
        if !extra.iter().any(|e| e.split('=').next() == Some(pair[0])) {
            v.extend_from_slice(pair);
        }
    }
    v.extend_from_slice(extra);
    v
}

/// `pisa forward -i in.safetensors -o out.safetensors` + small config + `extra` must fail as
/// [`fails`] says.
pub fn forward_fails(dir: &Path, extra: &[&str], want: &[&str]) -> String {
    let base = ["forward", "-i", "in.safetensors", "-o", "out.safetensors"];
    fails(dir, &args(&base, &SMALL, extra), want)
}
