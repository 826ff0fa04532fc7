//! Output paths: the `.npy` sibling naming ([`npy_sibling`]), the files an output path stands
//! for ([`output_paths`]), and the check, before any work, that they can be written without
//! destroying an input ([`check_output_paths`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use super::Format;

/// The sibling path for tensor `name` of an `.npy` output: `dir/out.npy` → `dir/out.{name}.npy`.
pub fn npy_sibling(path: &Path, name: &str) -> PathBuf {
    // The stem's bytes as they are (an OsStr: a name that is not UTF-8 keeps its bytes, not
    // replacement characters that could name another, existing file).
    let mut file = path.file_stem().unwrap_or_default().to_os_string();
    file.push(format!(".{name}.npy"));
    path.with_file_name(file)
}

/// The files [`write_outputs`](super::write_outputs) writes for `path`: `path` itself for `.safetensors`, the
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
/// (through a symbolic link: its target's directory) exists and takes a new file (a probe file
/// is made there and removed: outputs are written
/// through a temporary file beside them, and a long benchmark should not learn at its end that
/// it cannot save its report), none is a directory or another file that is not a regular one
/// (a FIFO, a device), and none is one of the `inputs` (writing
/// it would destroy the input). The error names the output file and the problem.
pub fn check_output_paths(outputs: &[PathBuf], inputs: &[&Path]) -> Result<()> {
    for out in outputs {
        // An output that is a symbolic link is written through it (`write::link_target`), so
        // its target's directory is the one that must take the file: a dangling link into a
        // missing directory passed the check of the link's own and failed after the run.
        let target = super::write::link_target(out)?;
        let via = if target != *out {
            format!(" (a link to {})", target.display())
        } else {
            String::new()
        };
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            bail!(
                "cannot write {}{via}: directory {} does not exist",
                out.display(),
                dir.display()
            );
        }
        super::write::refuse_unreplaceable(out)?;
        if let Err(e) = tempfile::Builder::new()
            .prefix(".pisa-probe-")
            .tempfile_in(dir)
        {
            bail!(
                "cannot write {}{via}: directory {} does not take new files ({e})",
                out.display(),
                dir.display()
            );
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

/// `paths` as text for a report (JSON's `written`): lossy, so a path that is not UTF-8 is
/// listed with U+FFFD in place of its bad bytes instead of failing the report after its files
/// were written.
pub fn paths_text(paths: &[std::path::PathBuf]) -> Vec<String> {
    paths
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}
