//! Tensor file IO for the `pisa` command line.
//!
//! Reads Q/K/V (and index tensors such as `token_ids`) from `.safetensors` or `.npy` files,
//! converting every float dtype to `f32`, and writes the outputs O, LSE and the selected block
//! indices back as `.safetensors` (several named tensors plus metadata in one file) or `.npy`
//! (one tensor per file).
//!
//! Choices, written down:
//! - The format is chosen by the file extension: `.safetensors` or `.npy`.
//! - Whole files are read into memory; every size declared in a header is checked against the
//!   real byte length before anything is sliced or allocated from it, and no input bytes make
//!   these readers panic (a proptest feeds random and mutated bytes to both parsers).
//! - Tensors with a zero dimension are rejected: the CLI has no use for them.
//! - bf16 is read only from safetensors (numpy has no standard bf16 descr) and written only
//!   to safetensors.
//! - `.npy` output: one file per tensor, named as siblings of the requested path
//!   (see [`npy_sibling`]): `out.npy` gives `out.o.npy`, `out.lse.npy`, `out.indices.npy`.
//!   npy has no metadata, so metadata is dropped for npy outputs.
//! - Every output file is written to a temporary file in the same directory and renamed into
//!   place, so a failure never leaves a partial output file.
#![allow(dead_code)]

mod npy;
mod st;
mod tensor;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_bad_input;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

pub(crate) use tensor::unravel;
pub use tensor::{check_finite, DType, HostTensor, IndexTensor};

/// File format of a tensor file, chosen by its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `.safetensors`: several named tensors plus a string metadata map.
    Safetensors,
    /// `.npy`: one unnamed tensor, no metadata.
    Npy,
}

impl Format {
    /// The format of `path` from its extension (`.safetensors` or `.npy`, any case).
    pub fn from_path(path: &Path) -> Result<Format> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("safetensors") => Ok(Format::Safetensors),
            Some("npy") => Ok(Format::Npy),
            _ => bail!(
                "{}: unknown tensor file format (expected a .safetensors or .npy extension)",
                path.display()
            ),
        }
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read tensor file {}", path.display()))
}

/// Reads the float tensor `name` from `path` and converts it to `f32`.
///
/// For `.safetensors` the tensor is looked up by name (the error lists the available names);
/// dtypes F32, F16, BF16 and F64 are accepted. A `.npy` file holds a single tensor, so `name`
/// only labels the result; descrs `<f4`, `<f2`, `<f8` are accepted.
pub fn read_tensor(path: &Path, name: &str) -> Result<HostTensor> {
    let bytes = read_file(path)?;
    let t = match Format::from_path(path)? {
        Format::Safetensors => st::read_float(&bytes, name),
        Format::Npy => npy::read_float(&bytes, name),
    };
    t.with_context(|| format!("{}: cannot read tensor `{name}`", path.display()))
}

/// Reads the integer tensor `name` from `path` (e.g. `token_ids`, or selected block indices).
///
/// Accepts I32 and I64 (`<i4`, `<i8` in npy); I64 values outside the `i32` range are an error.
pub fn read_index_tensor(path: &Path, name: &str) -> Result<IndexTensor> {
    let bytes = read_file(path)?;
    let t = match Format::from_path(path)? {
        Format::Safetensors => st::read_index(&bytes, name),
        Format::Npy => npy::read_index(&bytes, name),
    };
    t.with_context(|| format!("{}: cannot read tensor `{name}`", path.display()))
}

/// Names of the tensors in a `.safetensors` file, sorted; for `.npy` an empty list.
pub fn tensor_names(path: &Path) -> Result<Vec<String>> {
    match Format::from_path(path)? {
        Format::Npy => Ok(Vec::new()),
        Format::Safetensors => st::names(&read_file(path)?)
            .with_context(|| format!("{}: corrupt safetensors file", path.display())),
    }
}

/// The `__metadata__` map of a `.safetensors` file (empty if it has none); `.npy` files have
/// no metadata and give an empty map.
pub fn read_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
    match Format::from_path(path)? {
        Format::Npy => Ok(BTreeMap::new()),
        Format::Safetensors => st::metadata(&read_file(path)?)
            .with_context(|| format!("{}: corrupt safetensors file", path.display())),
    }
}

/// Parses float tensor `name` from the bytes of a whole tensor file of format `format`: the
/// parser behind [`read_tensor`], without the file system (used by the fuzz targets in `fuzz/`).
pub fn parse_tensor_bytes(format: Format, bytes: &[u8], name: &str) -> Result<HostTensor> {
    match format {
        Format::Safetensors => st::read_float(bytes, name),
        Format::Npy => npy::read_float(bytes, name),
    }
}

/// Parses integer tensor `name` from the bytes of a whole tensor file: the parser behind
/// [`read_index_tensor`], without the file system.
pub fn parse_index_tensor_bytes(format: Format, bytes: &[u8], name: &str) -> Result<IndexTensor> {
    match format {
        Format::Safetensors => st::read_index(bytes, name),
        Format::Npy => npy::read_index(bytes, name),
    }
}

/// The sorted tensor names and the metadata map of a `.safetensors` file's bytes: the parsers
/// behind [`tensor_names`] and [`read_metadata`], without the file system.
pub fn parse_safetensors_header_bytes(
    bytes: &[u8],
) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    Ok((st::names(bytes)?, st::metadata(bytes)?))
}

/// Looks up the softmax scale in a metadata map.
///
/// Lookup order: `layer{layer}.scale`; then the key `layers`, a JSON object such as
/// `{"15": {"scale": 0.125, ...}}` (the layout of `smollm2-rustbook-8k.safetensors`); then the
/// plain key `scale`. Returns `Ok(None)` when none is present, and an error when a present value
/// is not a finite positive number.
pub fn softmax_scale(meta: &BTreeMap<String, String>, layer: Option<usize>) -> Result<Option<f32>> {
    let check = |key: &str, v: f64| -> Result<Option<f32>> {
        if v.is_finite() && v > 0.0 {
            Ok(Some(v as f32))
        } else {
            bail!("metadata `{key}` = {v} is not a finite positive softmax scale")
        }
    };
    let parse = |key: &str, s: &str| -> Result<Option<f32>> {
        let v: f64 = s
            .trim()
            .parse()
            .with_context(|| format!("metadata `{key}` = {s:?} is not a number"))?;
        check(key, v)
    };
    if let Some(l) = layer {
        let key = format!("layer{l}.scale");
        if let Some(s) = meta.get(&key) {
            return parse(&key, s);
        }
        if let Some(s) = meta.get("layers") {
            let j: serde_json::Value =
                serde_json::from_str(s).context("metadata `layers` is not valid JSON")?;
            if let Some(v) = j.get(l.to_string()).and_then(|e| e.get("scale")) {
                let key = format!("layers[{l}].scale");
                let v = v
                    .as_f64()
                    .with_context(|| format!("metadata `{key}` = {v} is not a number"))?;
                return check(&key, v);
            }
        }
    }
    match meta.get("scale") {
        Some(s) => parse("scale", s),
        None => Ok(None),
    }
}

/// One tensor to write: floats with the dtype to store them in, or i32 indices.
#[derive(Clone, Copy, Debug)]
pub enum OutTensor<'a> {
    /// Float values, stored as the given dtype (values out of f16 range become ±inf).
    Float(&'a HostTensor, DType),
    /// Integer values, stored as i32.
    Index(&'a IndexTensor),
}

impl OutTensor<'_> {
    /// The tensor's name (its key in a safetensors file).
    pub fn name(&self) -> &str {
        match self {
            OutTensor::Float(t, _) => &t.name,
            OutTensor::Index(t) => &t.name,
        }
    }
}

/// The outputs of an attention run, as written by [`write_outputs`].
#[derive(Clone, Copy, Debug)]
pub struct Outputs<'a> {
    /// Attention output O, written under the name `o` in the dtype given to [`write_outputs`].
    pub o: &'a HostTensor,
    /// Log-sum-exp per query row, written under the name `lse`, always f32.
    pub lse: Option<&'a HostTensor>,
    /// Selected leaf block indices, written under the name `indices` as i32.
    pub indices: Option<&'a IndexTensor>,
}

/// The sibling path for tensor `name` of an `.npy` output: `dir/out.npy` → `dir/out.{name}.npy`.
pub fn npy_sibling(path: &Path, name: &str) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{stem}.{name}.npy"))
}

/// The files [`write_outputs`] writes for `path`: `path` itself for `.safetensors`, the
/// [`npy_sibling`] of each of `names` for `.npy` (an unknown extension is an error).
pub fn output_paths(path: &Path, names: &[&str]) -> Result<Vec<PathBuf>> {
    Ok(match Format::from_path(path)? {
        Format::Safetensors => vec![path.to_path_buf()],
        Format::Npy => names.iter().map(|n| npy_sibling(path, n)).collect(),
    })
}

/// Whether `a` and `b` are the same existing file (hard and symbolic links included).
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        }
    }
}

/// Checks, before any work is done, that `outputs` can be written: each one's directory
/// exists, none is a directory, and none is one of the `inputs` (writing it would destroy the
/// input). The error names the output file and the problem.
pub fn check_output_paths(outputs: &[PathBuf], inputs: &[&Path]) -> Result<()> {
    for out in outputs {
        let dir = match out.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            bail!(
                "cannot write {}: directory {} does not exist",
                out.display(),
                dir.display()
            );
        }
        if out.is_dir() {
            bail!("cannot write {}: it is a directory", out.display());
        }
        if let Some(inp) = inputs.iter().find(|i| same_file(out, i)) {
            bail!(
                "cannot write {}: it is the input file {}; choose another output path",
                out.display(),
                inp.display()
            );
        }
    }
    Ok(())
}

/// Writes O (as `o_dtype`), LSE (f32) and indices (i32) to `path`, atomically.
///
/// `.safetensors`: one file with tensors `o`, `lse`, `indices` and `metadata`.
/// `.npy`: one file per tensor at [`npy_sibling`] paths; metadata is dropped.
/// Returns the paths written.
pub fn write_outputs(
    path: &Path,
    out: &Outputs,
    o_dtype: DType,
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<PathBuf>> {
    let o = HostTensor {
        name: "o".into(),
        ..out.o.clone()
    };
    let lse = out.lse.map(|t| HostTensor {
        name: "lse".into(),
        ..t.clone()
    });
    let idx = out.indices.map(|t| IndexTensor {
        name: "indices".into(),
        ..t.clone()
    });
    let mut list = vec![OutTensor::Float(&o, o_dtype)];
    list.extend(lse.as_ref().map(|t| OutTensor::Float(t, DType::F32)));
    list.extend(idx.as_ref().map(OutTensor::Index));
    match Format::from_path(path)? {
        Format::Safetensors => {
            write_safetensors(path, &list, metadata)?;
            Ok(vec![path.to_path_buf()])
        }
        Format::Npy => {
            let files: Vec<(PathBuf, Vec<u8>)> = list
                .iter()
                .map(|t| Ok((npy_sibling(path, t.name()), npy::encode(t)?)))
                .collect::<Result<_>>()?;
            write_atomic_all(&files)?;
            Ok(files.into_iter().map(|(p, _)| p).collect())
        }
    }
}

/// Writes several named tensors and a metadata map into one `.safetensors` file, atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[OutTensor],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let bytes = st::encode(tensors, metadata)
        .with_context(|| format!("{}: cannot encode safetensors", path.display()))?;
    write_atomic_all(&[(path.to_path_buf(), bytes)])
}

/// Writes one tensor to an `.npy` file, atomically (bf16 is refused: npy has no bf16).
pub fn write_npy(path: &Path, tensor: OutTensor) -> Result<()> {
    let bytes =
        npy::encode(&tensor).with_context(|| format!("{}: cannot encode npy", path.display()))?;
    write_atomic_all(&[(path.to_path_buf(), bytes)])
}

/// Writes every file to a temporary file beside it first, and renames them into place only
/// when all were written; on error the temporary files are removed.
fn write_atomic_all(files: &[(PathBuf, Vec<u8>)]) -> Result<()> {
    // Each rename is atomic, the set is not: refuse a target that cannot be replaced (a
    // directory) before anything is renamed, so such a failure leaves the old set whole.
    for (path, _) in files {
        if path.is_dir() {
            bail!("cannot write {}: it is a directory", path.display());
        }
    }
    let mut temps = Vec::with_capacity(files.len());
    for (path, bytes) in files {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let mut builder = tempfile::Builder::new();
        builder.prefix(".pisa-tmp-");
        // Ordinary file permissions (0666 less the umask), not tempfile's private 0600.
        #[cfg(unix)]
        builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
        let mut tmp = builder
            .tempfile_in(dir)
            .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
        tmp.write_all(bytes)
            .and_then(|_| tmp.as_file().sync_all())
            .with_context(|| format!("cannot write {}", path.display()))?;
        temps.push((tmp, path));
    }
    for (tmp, path) in temps {
        // `map_err` drops the temporary file now (the error would otherwise keep it alive).
        tmp.persist(path)
            .map_err(|e| e.error)
            .with_context(|| format!("cannot rename output into place: {}", path.display()))?;
    }
    Ok(())
}
