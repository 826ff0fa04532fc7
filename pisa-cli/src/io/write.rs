//! Writing outputs: the tensors to write ([`OutTensor`], [`Outputs`]), [`write_outputs`],
//! [`write_safetensors`], [`write_npy`], and the temporary-file-and-rename step that makes every
//! write atomic (a failure never leaves a partial output file).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::paths::npy_sibling;
use super::{npy, st, DType, Format, HostTensor, IndexTensor};

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
    stage_outputs(path, out, o_dtype, metadata)?.commit()
}

/// Output files written to temporary files beside their paths, not yet in place: a command
/// stages its outputs, reports (stdout), then [`Staged::commit`]s, so that a report that fails
/// (a full disk, a closed pipe) leaves no output file written or changed; dropped, the
/// temporary files are removed.
#[derive(Debug)]
pub struct Staged {
    temps: Vec<(tempfile::NamedTempFile, PathBuf)>,
    paths: Vec<PathBuf>,
}

impl Staged {
    /// The paths the outputs will have (as given, before following links).
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Renames every temporary file into place; returns the paths. Errors: a rename that
    /// failed (the files renamed before it stay in place).
    pub fn commit(self) -> Result<Vec<PathBuf>> {
        for (tmp, path) in self.temps {
            // `map_err` drops the temporary file now (the error would otherwise keep it alive).
            tmp.persist(&path)
                .map_err(|e| e.error)
                .with_context(|| format!("cannot rename output into place: {}", path.display()))?;
        }
        Ok(self.paths)
    }
}

/// [`write_outputs`] up to the renames: the files staged, to [`Staged::commit`] once the
/// command's report is out.
pub fn stage_outputs(
    path: &Path,
    out: &Outputs,
    o_dtype: DType,
    metadata: &BTreeMap<String, String>,
) -> Result<Staged> {
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
    let files: Vec<(PathBuf, Vec<u8>)> = match Format::from_path(path)? {
        Format::Safetensors => vec![(
            path.to_path_buf(),
            encode_safetensors(path, &list, metadata)?,
        )],
        Format::Npy => list
            .iter()
            .map(|t| Ok((npy_sibling(path, t.name()), npy::encode(t)?)))
            .collect::<Result<_>>()?,
    };
    stage_all(&files)
}

/// The bytes of a `.safetensors` file of `tensors` and `metadata` (`path` names it in errors).
fn encode_safetensors(
    path: &Path,
    tensors: &[OutTensor],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    st::encode(tensors, metadata)
        .with_context(|| format!("{}: cannot encode safetensors", path.display()))
}

/// Writes several named tensors and a metadata map into one `.safetensors` file, atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[OutTensor],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let bytes = encode_safetensors(path, tensors, metadata)?;
    write_atomic_all(&[(path.to_path_buf(), bytes)])
}

/// Writes one tensor to an `.npy` file, atomically (bf16 is refused: npy has no bf16).
pub fn write_npy(path: &Path, tensor: OutTensor) -> Result<()> {
    let bytes =
        npy::encode(&tensor).with_context(|| format!("{}: cannot encode npy", path.display()))?;
    write_atomic_all(&[(path.to_path_buf(), bytes)])
}

/// Writes `bytes` to `path` atomically ([`write_atomic_all`] of one file).
pub fn write_file_atomic(path: &Path, bytes: Vec<u8>) -> Result<()> {
    write_atomic_all(&[(path.to_path_buf(), bytes)])
}

/// The file a write to `path` replaces: `path` itself, or where its chain of symbolic links
/// ends (a rename onto a link would replace the link with a regular file and leave the file
/// it names as it was). Errors: a chain longer than 40 links (a loop).
pub(crate) fn link_target(path: &Path) -> Result<PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p)
                    .with_context(|| format!("cannot read the link {}", p.display()))?;
                p = match p.parent() {
                    Some(d) if to.is_relative() => d.join(to),
                    _ => to,
                };
            }
            _ => return Ok(p),
        }
    }
    bail!(
        "cannot write {}: too many levels of symbolic links",
        path.display()
    )
}

/// Refuses an output path that exists (through links) and cannot be replaced: a directory, a
/// FIFO, device or socket (the rename of the finished output would replace the node: a link
/// to `/dev/null` would make the device node a regular file), or a read-only (write-protected)
/// file, which the rename would overwrite all the same where the directory allows it, so it is
/// refused as `cp` or `>` would.
pub(crate) fn refuse_unreplaceable(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => bail!("cannot write {}: it is a directory", path.display()),
        Ok(m) if !m.is_file() => bail!(
            "cannot write {}: it exists and is not a regular file (a FIFO, device or socket)",
            path.display()
        ),
        Ok(m) if m.permissions().readonly() => bail!(
            "cannot write {}: the file is read-only (write-protected)",
            path.display()
        ),
        _ => Ok(()),
    }
}

/// Writes every file to a temporary file beside it first, and renames them into place only
/// when all were written; on error the temporary files are removed. A path that is a symbolic
/// link is written through it: the file it names is replaced, the link kept.
fn write_atomic_all(files: &[(PathBuf, Vec<u8>)]) -> Result<()> {
    stage_all(files)?.commit().map(drop)
}

/// [`write_atomic_all`] up to the renames.
fn stage_all(files: &[(PathBuf, Vec<u8>)]) -> Result<Staged> {
    let targets = (files.iter())
        .map(|(p, _)| link_target(p))
        .collect::<Result<Vec<_>>>()?;
    // Each rename is atomic, the set is not: refuse a target that cannot be replaced (a
    // directory, a FIFO or device) before anything is renamed, so such a failure leaves the
    // old set whole.
    for path in &targets {
        refuse_unreplaceable(path)?;
    }
    let mut temps = Vec::with_capacity(files.len());
    for (path, (_, bytes)) in targets.iter().zip(files) {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let mut builder = tempfile::Builder::new();
        builder.prefix(".pisa-tmp-");
        // Ordinary file permissions (0666 less the umask), not tempfile's private 0600; a file
        // replaced keeps its own (a private output stays private).
        #[cfg(unix)]
        builder.permissions(match std::fs::metadata(path) {
            Ok(m) => m.permissions(),
            Err(_) => std::os::unix::fs::PermissionsExt::from_mode(0o666),
        });
        let mut tmp = builder
            .tempfile_in(dir)
            .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
        tmp.write_all(bytes)
            .and_then(|_| tmp.as_file().sync_all())
            .with_context(|| format!("cannot write {}", path.display()))?;
        temps.push((tmp, path.clone()));
    }
    Ok(Staged {
        temps,
        paths: files.iter().map(|(p, _)| p.clone()).collect(),
    })
}
