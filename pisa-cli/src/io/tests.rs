//! Unit tests of the tensor IO: round trips, outputs, metadata, the real data file.
//! Bad inputs and fuzzing are in `tests_bad_input.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::*;

pub(super) fn sample(name: &str, shape: &[usize]) -> HostTensor {
    let n: usize = shape.iter().product();
    // Multiples of 1/8 in [-8, 8): exact in f32, f16 and bf16.
    let data = (0..n)
        .map(|i| ((i * 37 % 128) as f32 - 64.0) / 8.0)
        .collect();
    HostTensor::new(name, shape.to_vec(), data).unwrap()
}

pub(super) fn indices() -> IndexTensor {
    IndexTensor::new("idx", vec![2, 3], vec![0, 5, -1, 7, i32::MAX, i32::MIN]).unwrap()
}

pub(super) fn err_text(r: Result<impl std::fmt::Debug>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

pub(super) fn st_bytes(header: &str, data_len: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.resize(b.len() + data_len, 0);
    b
}

pub(super) fn npy_bytes(header: &str, data_len: usize) -> Vec<u8> {
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.resize(b.len() + data_len, 0);
    b
}

#[test]
fn round_trip_every_dtype_and_format() {
    let dir = tempfile::tempdir().unwrap();
    let t = sample("x", &[3, 5, 4]);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let p = dir.path().join(format!("t-{dtype}.safetensors"));
        write_safetensors(&p, &[OutTensor::Float(&t, dtype)], &BTreeMap::new()).unwrap();
        assert_eq!(read_tensor(&p, "x").unwrap(), t, "safetensors {dtype}");
        let p = dir.path().join(format!("t-{dtype}.npy"));
        if dtype == DType::BF16 {
            assert!(err_text(write_npy(&p, OutTensor::Float(&t, dtype))).contains("bf16"));
            assert!(!p.exists());
        } else {
            write_npy(&p, OutTensor::Float(&t, dtype)).unwrap();
            assert_eq!(read_tensor(&p, "x").unwrap(), t, "npy {dtype}");
        }
    }
    for ext in ["safetensors", "npy"] {
        let p = dir.path().join(format!("i.{ext}"));
        if ext == "npy" {
            write_npy(&p, OutTensor::Index(&indices())).unwrap();
        } else {
            write_safetensors(&p, &[OutTensor::Index(&indices())], &BTreeMap::new()).unwrap();
        }
        assert_eq!(read_index_tensor(&p, "idx").unwrap(), indices());
    }
    // 1-d and rank-0 npy shapes.
    let p = dir.path().join("v.npy");
    write_npy(&p, OutTensor::Float(&sample("v", &[7]), DType::F32)).unwrap();
    assert_eq!(read_tensor(&p, "v").unwrap().shape, vec![7]);
    write_npy(&p, OutTensor::Float(&sample("s", &[]), DType::F32)).unwrap();
    assert_eq!(read_tensor(&p, "s").unwrap().shape, Vec::<usize>::new());
}

#[test]
fn f16_rounding_is_to_nearest() {
    let t = HostTensor::new("r", vec![3], vec![0.1, 1e5, -3.3]).unwrap();
    let back = DType::F16.decode(&DType::F16.encode(&t.data));
    assert!((back[0] - 0.1).abs() < 1e-4 && back[1].is_infinite() && (back[2] + 3.3).abs() < 2e-3);
}

#[test]
fn write_outputs_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    let (o, lse, idx) = (
        sample("whatever", &[2, 8, 4]),
        sample("l", &[2, 8]),
        indices(),
    );
    let out = Outputs {
        o: &o,
        lse: Some(&lse),
        indices: Some(&idx),
    };
    let meta = BTreeMap::from([("scale".to_string(), "0.125".to_string())]);

    let p = dir.path().join("out.safetensors");
    assert_eq!(
        write_outputs(&p, &out, DType::BF16, &meta).unwrap(),
        vec![p.clone()]
    );
    assert_eq!(tensor_names(&p).unwrap(), ["indices", "lse", "o"]);
    assert_eq!(read_metadata(&p).unwrap(), meta);
    assert_eq!(read_tensor(&p, "o").unwrap().data, o.data);
    assert_eq!(read_tensor(&p, "lse").unwrap().data, lse.data);
    assert_eq!(read_index_tensor(&p, "indices").unwrap().data, idx.data);

    let p = dir.path().join("out.npy");
    let written = write_outputs(&p, &out, DType::F16, &meta).unwrap();
    let want: Vec<PathBuf> = ["o", "lse", "indices"]
        .iter()
        .map(|n| dir.path().join(format!("out.{n}.npy")))
        .collect();
    assert_eq!(written, want);
    assert_eq!(read_tensor(&want[0], "o").unwrap().data, o.data);
    assert_eq!(read_index_tensor(&want[2], "i").unwrap().data, idx.data);

    // A failing npy write (bf16) leaves no file at all; no temporary files are left behind.
    let p = dir.path().join("bad.npy");
    assert!(write_outputs(&p, &out, DType::BF16, &meta).is_err());
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 4, "{left:?}");
    assert!(write_outputs(
        Path::new("/nonexistent-dir/x.safetensors"),
        &out,
        DType::F32,
        &meta
    )
    .is_err());
    assert!(err_text(write_outputs(
        &dir.path().join("o.txt"),
        &out,
        DType::F32,
        &meta
    ))
    .contains("format"));
}

#[test]
fn check_finite_names_the_position() {
    let mut t = sample("q", &[3, 4, 5]);
    check_finite(&t).unwrap();
    t.data[2 * 20 + 5 + 3] = f32::NAN; // [2, 1, 3]
    t.data[2 * 20 + 3 * 5 + 4] = f32::INFINITY;
    let e = err_text(check_finite(&t));
    assert!(e.contains("`q`") && e.contains("NaN at [2, 1, 3]"), "{e}");
}

#[test]
fn softmax_scale_lookup() {
    let m = |kv: &[(&str, &str)]| {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(softmax_scale(&m(&[]), Some(3)).unwrap(), None);
    assert_eq!(
        softmax_scale(&m(&[("scale", "0.125")]), None).unwrap(),
        Some(0.125)
    );
    let both = m(&[("scale", "0.5"), ("layer3.scale", "0.25")]);
    assert_eq!(softmax_scale(&both, Some(3)).unwrap(), Some(0.25));
    assert_eq!(softmax_scale(&both, Some(4)).unwrap(), Some(0.5));
    let layers = m(&[(
        "layers",
        r#"{"15": {"scale": 0.125, "sliding_window": null}}"#,
    )]);
    assert_eq!(softmax_scale(&layers, Some(15)).unwrap(), Some(0.125));
    assert_eq!(softmax_scale(&layers, Some(0)).unwrap(), None);
    assert!(softmax_scale(&m(&[("scale", "abc")]), None).is_err());
    assert!(softmax_scale(&m(&[("scale", "-1")]), None).is_err());
    // A `layers` that is valid JSON but not an object of layers is an error, not ignored.
    let e = err_text(softmax_scale(&m(&[("layers", "[1, 2]")]), Some(1)));
    assert!(e.contains("not a JSON object"), "{e}");
    // The sliding window the CLI warns about: a positive number only.
    assert_eq!(sliding_window(&layers, Some(15)), None);
    let win = m(&[("layers", r#"{"3": {"scale": 0.1, "sliding_window": 128}}"#)]);
    assert_eq!(sliding_window(&win, Some(3)), Some(128));
    assert_eq!(sliding_window(&win, Some(4)), None);
    assert_eq!(sliding_window(&win, None), None);
}

#[test]
fn narrow_and_dtype_parsing() {
    let t = sample("k", &[2, 6, 3]);
    let n = t.narrow(1, 2, 3).unwrap();
    assert_eq!(n.shape, vec![2, 3, 3]);
    assert_eq!(n.data[..3], t.data[6..9]);
    assert_eq!(n.data[9..12], t.data[24..27]);
    assert!(t.narrow(1, 4, 3).is_err() && t.narrow(3, 0, 1).is_err() && t.narrow(0, 0, 0).is_err());
    assert_eq!("BF16".parse::<DType>().unwrap(), DType::BF16);
    assert!("f64".parse::<DType>().is_err());
    assert_eq!(
        <DType as clap::ValueEnum>::from_str("bf16", false).unwrap(),
        DType::BF16
    );
    assert!(HostTensor::new("z", vec![2, 0], vec![]).is_err());
    assert!(HostTensor::new("z", vec![2, 2], vec![0.0; 3]).is_err());
}

/// The real capture in `../shared/data` (beside the repository, not in it: run with
/// `--ignored` where it is; its layer 15 is also `data/demo-smollm2-layer15-4096.safetensors`,
/// which the pisa-wgpu tests of real activations read).
#[test]
#[ignore = "needs ../shared/data/smollm2-rustbook-8k.safetensors beside the repository"]
fn reads_real_smollm2_file() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/smollm2-rustbook-8k.safetensors");
    let k = read_tensor(&p, "layer15.k").unwrap();
    assert_eq!(k.shape, vec![3, 8192, 64]);
    let k = k.narrow(1, 0, 128).unwrap();
    check_finite(&k).unwrap();
    assert!(k.data.iter().any(|&v| v != 0.0));
    assert_eq!(
        read_index_tensor(&p, "token_ids").unwrap().shape,
        vec![8192]
    );
    let meta = read_metadata(&p).unwrap();
    assert_eq!(softmax_scale(&meta, Some(15)).unwrap(), Some(0.125));
    assert!(err_text(read_tensor(&p, "layer16.q")).contains("layer15.q"));
}

/// An output path that is a symbolic link is written through it: the file it names (by a
/// relative or absolute link, or a chain of them) gets the bytes and the link stays a link;
/// a dangling link makes its file; a loop of links is an error, not a hang.
#[cfg(unix)]
#[test]
fn outputs_are_written_through_symbolic_links() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("data")).unwrap();
    std::fs::write(d.join("data/out.json"), b"old").unwrap();
    symlink("data/out.json", d.join("rel")).unwrap();
    symlink(d.join("rel"), d.join("chain")).unwrap();
    for (link, bytes) in [("rel", &b"one"[..]), ("chain", b"two")] {
        write_file_atomic(&d.join(link), bytes.to_vec()).unwrap();
        assert_eq!(std::fs::read(d.join("data/out.json")).unwrap(), bytes);
        let m = std::fs::symlink_metadata(d.join(link)).unwrap();
        assert!(m.file_type().is_symlink(), "{link} was replaced by a file");
    }
    symlink("data/new.npy", d.join("dangling")).unwrap();
    write_file_atomic(&d.join("dangling"), b"new".to_vec()).unwrap();
    assert_eq!(std::fs::read(d.join("data/new.npy")).unwrap(), b"new");
    symlink("loop_b", d.join("loop_a")).unwrap();
    symlink("loop_a", d.join("loop_b")).unwrap();
    let e = err_text(write_file_atomic(&d.join("loop_a"), b"x".to_vec()));
    assert!(e.contains("symbolic links"), "{e}");
}

/// A replaced output keeps the permissions of the file it replaces (a private 0600 file stays
/// private; a new one gets 0666 less the umask), and a read-only (write-protected) file is
/// refused, by the write and by the check before any work, and left as it was.
#[cfg(unix)]
#[test]
fn replaced_outputs_keep_their_mode_and_read_only_ones_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let private = dir.path().join("private.json");
    std::fs::write(&private, b"old").unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
    write_file_atomic(&private, b"new".to_vec()).unwrap();
    assert_eq!(std::fs::read(&private).unwrap(), b"new");
    let mode = std::fs::metadata(&private).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "mode {mode:o}");
    let locked = dir.path().join("locked.json");
    std::fs::write(&locked, b"keep").unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o444)).unwrap();
    let e = err_text(write_file_atomic(&locked, b"x".to_vec()));
    assert!(e.contains("read-only"), "{e}");
    let e = err_text(crate::io::check_output_paths(
        std::slice::from_ref(&locked),
        &[],
    ));
    assert!(e.contains("read-only"), "{e}");
    assert_eq!(std::fs::read(&locked).unwrap(), b"keep");
}

/// An `.npy` output whose name is not UTF-8 names its siblings with the same bytes (a lossy
/// name wrote `o\u{FFFD}.o.npy`, which could be another, existing file).
#[cfg(unix)]
#[test]
fn npy_siblings_keep_a_name_that_is_not_utf8() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let path = Path::new("dir").join(OsStr::from_bytes(b"o\xfe.npy"));
    let sib = npy_sibling(&path, "lse");
    assert_eq!(sib.parent(), Some(Path::new("dir")));
    assert_eq!(sib.file_name().unwrap().as_bytes(), b"o\xfe.lse.npy");
    assert_eq!(
        npy_sibling(Path::new("a/out.npy"), "o"),
        Path::new("a/out.o.npy")
    );
}
