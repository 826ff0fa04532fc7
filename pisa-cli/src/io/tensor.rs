//! In-memory tensors, dtypes and byte conversions shared by the npy and safetensors code.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, ensure, Result};
use half::{bf16, f16};

/// Storage dtype of a float tensor in a file. All tensors are `f32` in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum DType {
    /// IEEE binary32.
    #[value(name = "f32")]
    F32,
    /// IEEE binary16.
    #[value(name = "f16")]
    F16,
    /// bfloat16 (safetensors only).
    #[value(name = "bf16")]
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Encodes `values` as little-endian bytes of this dtype (round to nearest even).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * self.size_bytes());
        for &v in values {
            match self {
                DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                DType::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
                DType::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            }
        }
        out
    }

    /// Decodes little-endian bytes of this dtype to `f32`; the length must be a multiple of
    /// [`DType::size_bytes`] (trailing bytes are ignored).
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

impl FromStr for DType {
    type Err = anyhow::Error;
    /// Parses `f32`, `f16` or `bf16` (any case).
    fn from_str(s: &str) -> Result<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => bail!("unknown dtype `{s}` (expected f32, f16 or bf16)"),
        }
    }
}

/// Checks that `shape` has no zero dimension and that its element count does not overflow;
/// returns the element count.
pub(crate) fn checked_numel(shape: &[usize]) -> Result<usize> {
    if let Some(axis) = shape.iter().position(|&d| d == 0) {
        bail!("shape {shape:?} has a zero dimension (axis {axis})");
    }
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| anyhow::anyhow!("shape {shape:?} has too many elements"))
}

/// A float tensor in host memory: row-major (C order) `f32` values.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Name, e.g. `layer15.q` or `o`.
    pub name: String,
    /// Dimensions, outermost first (Q/K/V: `[heads, tokens, dim]`).
    pub shape: Vec<usize>,
    /// Values in row-major order; `data.len()` is the product of `shape`.
    pub data: Vec<f32>,
}

/// An integer tensor in host memory (selected block indices, token ids), row-major `i32`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexTensor {
    /// Name, e.g. `indices` or `token_ids`.
    pub name: String,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Values in row-major order; `data.len()` is the product of `shape`.
    pub data: Vec<i32>,
}

impl HostTensor {
    /// A tensor, checking that `shape` has no zero dimension and matches `data.len()`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Result<HostTensor> {
        let name = name.into();
        let n = checked_numel(&shape)?;
        ensure!(
            n == data.len(),
            "tensor `{name}`: shape {shape:?} needs {n} values, got {}",
            data.len()
        );
        Ok(HostTensor { name, shape, data })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The sub-tensor `start..start + len` along `axis` (e.g. the first N tokens of Q: axis 1).
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<HostTensor> {
        let Some(&dim) = self.shape.get(axis) else {
            bail!(
                "tensor `{}`: axis {axis} out of range for shape {:?}",
                self.name,
                self.shape
            );
        };
        ensure!(
            len > 0 && start.checked_add(len).is_some_and(|e| e <= dim),
            "tensor `{}`: range {start}..{} out of bounds for axis {axis} of size {dim}",
            self.name,
            start.saturating_add(len)
        );
        let inner: usize = self.shape[axis + 1..].iter().product();
        let outer: usize = self.shape[..axis].iter().product();
        let mut data = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            let base = (o * dim + start) * inner;
            data.extend_from_slice(&self.data[base..base + len * inner]);
        }
        let mut shape = self.shape.clone();
        shape[axis] = len;
        Ok(HostTensor {
            name: self.name.clone(),
            shape,
            data,
        })
    }
}

impl IndexTensor {
    /// A tensor, checking that `shape` has no zero dimension and matches `data.len()`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<i32>) -> Result<IndexTensor> {
        let name = name.into();
        let n = checked_numel(&shape)?;
        ensure!(
            n == data.len(),
            "tensor `{name}`: shape {shape:?} needs {n} values, got {}",
            data.len()
        );
        Ok(IndexTensor { name, shape, data })
    }
}

/// The row-major multi-index of flat position `flat` in `shape`.
pub(crate) fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (i, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            idx[i] = flat % d;
            flat /= d;
        }
    }
    idx
}

/// Little-endian f64 values as f32, for the readers of `<f8` / F64 tensors. Errors where a
/// finite value lies beyond f32's range (it would become an infinity, which the finite check
/// would then blame on the file), naming the tensor, the value and its multi-index in `shape`.
/// NaN and infinities pass as they are (the finite check decides on them).
pub(super) fn decode_f64(bytes: &[u8], name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(bytes.len() / 8);
    for (i, c) in bytes.chunks_exact(8).enumerate() {
        let x = f64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        let y = x as f32;
        if x.is_finite() && !y.is_finite() {
            bail!(
                "tensor `{name}` (shape {shape:?}) holds {x:e} at {:?}, beyond f32's range \
                 (magnitudes up to {:e}): scale the input or store it as f32",
                unravel(i, shape),
                f32::MAX
            );
        }
        out.push(y);
    }
    Ok(out)
}

/// Errors if `t` holds a NaN or an infinity, naming the tensor and the multi-index of the
/// first such value, e.g. ``tensor `q` has NaN at [2, 17, 5]``.
pub fn check_finite(t: &HostTensor) -> Result<()> {
    match t.data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => bail!(
            "tensor `{}` (shape {:?}) has {} at {:?}",
            t.name,
            t.shape,
            t.data[i],
            unravel(i, &t.shape)
        ),
    }
}
