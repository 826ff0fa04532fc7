//! `.safetensors` reading and writing through the `safetensors` crate.
//!
//! `SafeTensors::deserialize` checks the header length against the buffer, caps it at 100 MB,
//! checks that tensor offsets are contiguous, that each shape's byte size (overflow-checked)
//! matches its offsets, and that the data section ends exactly at the end of the file; so
//! slicing tensor data afterwards is safe.

use std::collections::{BTreeMap, HashMap};

use anyhow::{anyhow, bail, ensure, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use super::tensor::{checked_numel, decode_f64, DType, HostTensor, IndexTensor};
use super::OutTensor;

fn parse(bytes: &[u8]) -> Result<SafeTensors<'_>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| anyhow!("corrupt or truncated safetensors file: {e}"))
}

/// The sorted tensor names of a safetensors buffer.
pub(super) fn names(bytes: &[u8]) -> Result<Vec<String>> {
    let mut names: Vec<String> = parse(bytes)?
        .names()
        .into_iter()
        .map(str::to_string)
        .collect();
    names.sort();
    Ok(names)
}

/// The `__metadata__` map of a safetensors buffer (empty if absent).
pub(super) fn metadata(bytes: &[u8]) -> Result<BTreeMap<String, String>> {
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| anyhow!("corrupt or truncated safetensors file: {e}"))?;
    Ok(meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect())
}

fn view<'a>(st: &SafeTensors<'a>, name: &str) -> Result<TensorView<'a>> {
    match st.tensor(name) {
        Ok(v) => {
            checked_numel(v.shape())?;
            Ok(v)
        }
        Err(_) => {
            let mut names = st.names();
            names.sort();
            bail!("no tensor named `{name}`; available: {}", names.join(", "))
        }
    }
}

/// Reads float tensor `name` (F32, F16, BF16 or F64) as `f32`.
pub(super) fn read_float(bytes: &[u8], name: &str) -> Result<HostTensor> {
    let st = parse(bytes)?;
    let v = view(&st, name)?;
    let data = match v.dtype() {
        Dtype::F32 => DType::F32.decode(v.data()),
        Dtype::F16 => DType::F16.decode(v.data()),
        Dtype::BF16 => DType::BF16.decode(v.data()),
        Dtype::F64 => decode_f64(v.data(), name, v.shape())?,
        d => bail!("tensor `{name}` has dtype {d:?}; supported float dtypes: F32, F16, BF16, F64"),
    };
    Ok(HostTensor {
        name: name.to_string(),
        shape: v.shape().to_vec(),
        data,
    })
}

/// Reads integer tensor `name` (I32 or I64) as `i32`.
pub(super) fn read_index(bytes: &[u8], name: &str) -> Result<IndexTensor> {
    let st = parse(bytes)?;
    let v = view(&st, name)?;
    let data = match v.dtype() {
        Dtype::I32 => v
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::I64 => i64_to_i32(v.data())?,
        d => bail!("tensor `{name}` has dtype {d:?}; supported index dtypes: I32, I64"),
    };
    Ok(IndexTensor {
        name: name.to_string(),
        shape: v.shape().to_vec(),
        data,
    })
}

/// Converts little-endian i64 bytes to i32, failing on values out of range.
pub(super) fn i64_to_i32(bytes: &[u8]) -> Result<Vec<i32>> {
    bytes
        .chunks_exact(8)
        .enumerate()
        .map(|(i, c)| {
            let v = i64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            i32::try_from(v)
                .with_context(|| format!("i64 value {v} at flat index {i} does not fit in i32"))
        })
        .collect()
}

/// Encodes named tensors plus metadata as a safetensors file.
pub(super) fn encode(
    tensors: &[OutTensor],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for t in tensors {
        let name = t.name().to_string();
        ensure!(
            owned.iter().all(|o| o.0 != name),
            "duplicate tensor name `{name}`"
        );
        let (dtype, shape, bytes) = match *t {
            OutTensor::Float(h, d) => {
                let st_dtype = match d {
                    DType::F32 => Dtype::F32,
                    DType::F16 => Dtype::F16,
                    DType::BF16 => Dtype::BF16,
                };
                (st_dtype, h.shape.clone(), d.encode(&h.data))
            }
            OutTensor::Index(i) => (
                Dtype::I32,
                i.shape.clone(),
                i.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        };
        let n = checked_numel(&shape).with_context(|| format!("tensor `{name}`"))?;
        ensure!(
            n.checked_mul(dtype.bitsize() / 8) == Some(bytes.len()),
            "tensor `{name}`: shape {shape:?} does not match its {} data bytes",
            bytes.len()
        );
        owned.push((name, dtype, shape, bytes));
    }
    let views = owned
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let v = TensorView::new(*dtype, shape.clone(), bytes)
                .map_err(|e| anyhow!("tensor `{name}`: {e}"))?;
            Ok((name.clone(), v))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta: Option<HashMap<String, String>> = (!metadata.is_empty()).then(|| {
        metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    });
    safetensors::serialize(views, meta).map_err(|e| anyhow!("cannot serialize safetensors: {e}"))
}
