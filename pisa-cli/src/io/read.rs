//! Reading tensor files: float and index tensors, tensor names and the metadata map of
//! `.safetensors` / `.npy` files (and the same parsers on in-memory bytes, for the fuzz
//! targets), and the softmax-scale lookup in that metadata ([`softmax_scale`]).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::{npy, st, Format, HostTensor, IndexTensor};

/// The whole file at `path` (an input: a tensor file, a `pisa bench` report); the error names
/// it. Only a regular file (or a link to one) is read: a device such as `/dev/zero` would be
/// read until memory ran out.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    let what = || format!("cannot read {}", path.display());
    let meta = std::fs::metadata(path).with_context(what)?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        bail!("{}: {kind}", what());
    }
    std::fs::read(path).with_context(what)
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

/// The sliding window (tokens) of layer `layer` in a metadata map's `layers` object
/// (`{"15": {"sliding_window": 4096, ...}}`, as `scripts/capture_qkv.py` records it), when it
/// is a positive number; `None` for none, `null` or anything else. PISA attends to every past
/// block it selects, so a layer with a window shorter than the sequence gets other outputs
/// than its model computes: the CLI warns about it.
pub fn sliding_window(meta: &BTreeMap<String, String>, layer: Option<usize>) -> Option<u64> {
    let j: serde_json::Value = serde_json::from_str(meta.get("layers")?).ok()?;
    let w = j.get(layer?.to_string())?.get("sliding_window")?.as_u64()?;
    (w > 0).then_some(w)
}

/// Looks up the softmax scale in a metadata map.
///
/// Lookup order: `layer{layer}.scale`; then the key `layers`, a JSON object such as
/// `{"15": {"scale": 0.125, ...}}` (the layout of `smollm2-rustbook-8k.safetensors`); then the
/// plain key `scale`. Returns `Ok(None)` when none is present, and an error when a present value
/// is not a finite positive number.
pub fn softmax_scale(meta: &BTreeMap<String, String>, layer: Option<usize>) -> Result<Option<f32>> {
    let check = |key: &str, v: f64| -> Result<Option<f32>> {
        // As f32, the precision the kernels use: 1e40 is finite in f64 but not there.
        let f = v as f32;
        if f.is_finite() && f > 0.0 {
            Ok(Some(f))
        } else {
            bail!(
                "metadata `{key}` = {} is not a finite positive softmax scale",
                crate::text::number(v)
            )
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
            if !j.is_object() {
                bail!("metadata `layers` is not a JSON object of layers ({{\"{l}\": {{\"scale\": ...}}}})");
            }
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
