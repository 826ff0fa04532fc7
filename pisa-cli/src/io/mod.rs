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
//!
//! Split by role: this file holds [`Format`] and the re-exports; `read.rs` the readers (and
//! the softmax-scale lookup in metadata), `paths.rs` output path naming and checks, `write.rs`
//! the atomic writers; `npy.rs`, `st.rs` and `tensor.rs` the formats and in-memory tensors.
#![allow(dead_code)]

mod npy;
mod paths;
mod read;
mod st;
mod tensor;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_bad_input;
mod write;

use std::path::Path;

use anyhow::{bail, Result};

pub use paths::{check_output_paths, npy_sibling, output_paths, paths_text};
pub use read::{
    parse_index_tensor_bytes, parse_safetensors_header_bytes, parse_tensor_bytes, read_file,
    read_index_tensor, read_metadata, read_tensor, sliding_window, softmax_scale, tensor_names,
};
pub(crate) use tensor::unravel;
pub use tensor::{check_finite, DType, HostTensor, IndexTensor};
pub use write::{
    stage_outputs, write_file_atomic, write_npy, write_outputs, write_safetensors, OutTensor,
    Outputs, Staged,
};

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
