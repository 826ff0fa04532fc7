//! Bad-input tests: missing files, wrong names, truncated and corrupt files, lying sizes,
//! and proptests feeding random and mutated bytes to both parsers (which must never panic).

use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;

use super::tests::{err_text, indices, npy_bytes, sample, st_bytes};
use super::*;

#[test]
fn missing_file_and_wrong_name() {
    let e = err_text(read_tensor(Path::new("/no/such/q.safetensors"), "q"));
    assert!(e.contains("/no/such/q.safetensors"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.safetensors");
    let (a, b) = (sample("alpha", &[2]), sample("beta", &[2]));
    write_safetensors(
        &p,
        &[
            OutTensor::Float(&a, DType::F32),
            OutTensor::Float(&b, DType::F32),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    let e = err_text(read_tensor(&p, "gamma"));
    assert!(e.contains("gamma") && e.contains("alpha, beta"), "{e}");
    let e = err_text(read_index_tensor(&p, "alpha"));
    assert!(e.contains("F32"), "{e}");
}

/// Regression: a link to `/dev/zero` named `.safetensors` was read until memory ran out; a
/// path that is not a regular file is refused before it is read, naming it.
#[test]
fn only_regular_files_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("d.safetensors");
    std::fs::create_dir(&sub).unwrap();
    let e = err_text(read_tensor(&sub, "q"));
    assert!(
        e.contains("d.safetensors") && e.contains("a directory"),
        "{e}"
    );
    #[cfg(unix)]
    if Path::new("/dev/zero").exists() {
        let link = dir.path().join("zero.safetensors");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        for e in [
            err_text(read_tensor(&link, "q")),
            err_text(read_metadata(&link)),
        ] {
            assert!(
                e.contains("zero.safetensors") && e.contains("not a regular file"),
                "{e}"
            );
        }
    }
}

#[test]
fn truncated_files() {
    let t = sample("x", &[4, 4]);
    let st = st::encode(&[OutTensor::Float(&t, DType::F32)], &BTreeMap::new()).unwrap();
    let np = npy::encode(&OutTensor::Float(&t, DType::F32)).unwrap();
    for cut in [0, 4, 9, 20, st.len() / 2, st.len() - 1] {
        assert!(
            st::read_float(&st[..cut], "x").is_err(),
            "safetensors cut at {cut}"
        );
    }
    for cut in [0, 5, 9, 11, 40, np.len() / 2, np.len() - 1] {
        assert!(
            npy::read_float(&np[..cut], "x").is_err(),
            "npy cut at {cut}"
        );
    }
    let mut long = np.clone();
    long.push(0);
    assert!(err_text(npy::read_float(&long, "x")).contains("data bytes"));
}

#[test]
fn corrupt_headers_and_lying_sizes() {
    // safetensors: bad JSON, header length past the end, shape/offset mismatch, zero dim.
    assert!(st::read_float(&st_bytes("{not json", 0), "x").is_err());
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    assert!(st::read_float(&huge, "x").is_err());
    let mut past = 1000u64.to_le_bytes().to_vec();
    past.extend_from_slice(b"{}");
    assert!(st::read_float(&past, "x").is_err());
    let lying = r#"{"x":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,16]}}"#;
    assert!(st::read_float(&st_bytes(lying, 16), "x").is_err());
    let short = r#"{"x":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    assert!(st::read_float(&st_bytes(short, 8), "x").is_err());
    let zero = r#"{"x":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}}"#;
    assert!(err_text(st::read_float(&st_bytes(zero, 0), "x")).contains("zero dimension"));
    let int8 = r#"{"x":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}}"#;
    assert!(err_text(st::read_float(&st_bytes(int8, 4), "x")).contains("I8"));

    // npy: bad magic, bad dict, lying shape, huge header length, zero dim, unsupported dtypes.
    let ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
    assert!(npy::read_float(&npy_bytes(ok, 16), "x").is_ok());
    let mut bad_magic = npy_bytes(ok, 16);
    bad_magic[1] = b'X';
    assert!(err_text(npy::read_float(&bad_magic, "x")).contains("magic"));
    assert!(npy::read_float(&npy_bytes("{'descr': '<f4', 'shape': (2, 2)", 16), "x").is_err());
    assert!(npy::read_float(
        &npy_bytes("{'descr': '<f4', 'fortran_order': False}", 16),
        "x"
    )
    .is_err());
    let lie = "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999), }";
    assert!(err_text(npy::read_float(&npy_bytes(lie, 16), "x")).contains("too many"));
    let lie = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }";
    assert!(err_text(npy::read_float(&npy_bytes(lie, 16), "x")).contains("data bytes"));
    let mut huge = npy_bytes(ok, 16);
    huge[8..10].copy_from_slice(&u16::MAX.to_le_bytes());
    assert!(err_text(npy::read_float(&huge, "x")).contains("exceeds"));
    let zero = "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 2), }";
    assert!(err_text(npy::read_float(&npy_bytes(zero, 0), "x")).contains("zero dimension"));
    for d in [">f4", "<u2", "|b1", "V2"] {
        let h = format!("{{'descr': '{d}', 'fortran_order': False, 'shape': (2,), }}");
        assert!(
            err_text(npy::read_float(&npy_bytes(&h, 8), "x")).contains("unsupported"),
            "{d}"
        );
    }
    let fortran = "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }";
    assert!(err_text(npy::read_float(&npy_bytes(fortran, 16), "x")).contains("Fortran"));
    let i64_big = "{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }";
    let mut b = npy_bytes(i64_big, 0);
    b.extend_from_slice(&(1i64 << 40).to_le_bytes());
    assert!(err_text(npy::read_index(&b, "x")).contains("i32"));
}

fn valid_files() -> Vec<Vec<u8>> {
    let t = sample("x", &[2, 3]);
    let meta = BTreeMap::from([("scale".to_string(), "0.125".to_string())]);
    vec![
        st::encode(
            &[
                OutTensor::Float(&t, DType::BF16),
                OutTensor::Index(&indices()),
            ],
            &meta,
        )
        .unwrap(),
        npy::encode(&OutTensor::Float(&t, DType::F16)).unwrap(),
        npy::encode(&OutTensor::Index(&indices())).unwrap(),
    ]
}

fn all_parsers(b: &[u8]) {
    let _ = st::read_float(b, "x");
    let _ = st::read_index(b, "idx");
    let _ = st::metadata(b);
    let _ = npy::read_float(b, "x");
    let _ = npy::read_index(b, "x");
}

proptest! {
    #[test]
    fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..300)) {
        all_parsers(&b);
        let mut npy_prefixed = b"\x93NUMPY\x01\x00".to_vec();
        npy_prefixed.extend_from_slice(&b);
        all_parsers(&npy_prefixed);
    }

    #[test]
    fn mutated_files_never_panic(
        which in 0usize..3,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut b = valid_files().swap_remove(which);
        // Most edits land in the header, where the parsing happens.
        for (k, (at, byte)) in edits.into_iter().enumerate() {
            let span = if k % 3 == 2 { b.len() } else { b.len().min(160) };
            let i = at.index(span);
            b[i] = byte;
        }
        if truncate {
            b.truncate(cut.index(b.len()));
        }
        all_parsers(&b);
    }
}

/// An f64 value past f32's range is refused by name and position (as a value that does not fit,
/// not as an infinity the file does not hold); f64 values within range, and the f64 NaN and
/// infinities (left to the finite check), are read as they are.
#[test]
fn f64_values_beyond_f32() {
    let shape = [2usize, 3];
    let bytes = |vals: &[f64]| -> (Vec<u8>, Vec<u8>) {
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut npy = npy_bytes(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }",
            0,
        );
        npy.extend_from_slice(&data);
        let h = r#"{"x":{"dtype":"F64","shape":[2,3],"data_offsets":[0,48]}}"#;
        let mut st = st_bytes(h, 0);
        st.extend_from_slice(&data);
        (npy, st)
    };
    let ok = [1.5, -2.25e38, 3.0e-40, f64::NAN, f64::INFINITY, 0.125];
    let (npy, st) = bytes(&ok);
    for t in [
        npy::read_float(&npy, "x").unwrap(),
        st::read_float(&st, "x").unwrap(),
    ] {
        assert_eq!(t.shape, shape);
        assert_eq!(t.data[0], 1.5);
        assert_eq!(t.data[1], -2.25e38);
        assert!(t.data[3].is_nan() && t.data[4] == f32::INFINITY);
    }
    let bad = [1.5, -2.25e38, 3.0e-40, 0.0, -1e300, 0.125];
    let (npy, st) = bytes(&bad);
    for e in [
        err_text(npy::read_float(&npy, "x")),
        err_text(st::read_float(&st, "x")),
    ] {
        assert!(
            e.contains("`x`") && e.contains("-1e300 at [1, 1]") && e.contains("f32"),
            "{e}"
        );
        assert!(!e.contains("inf"), "{e}");
    }
}
