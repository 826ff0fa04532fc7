//! A small, strict `.npy` reader and writer (format versions 1.0, 2.0 and 3.0).
//!
//! Hand-written rather than taken from a crate: `npyz` 0.8, the obvious candidate, allocates
//! the header buffer from the declared header length before checking it against the file,
//! multiplies shape dimensions without overflow checks (a panic in debug builds) and
//! pre-allocates the data vector from the declared shape. This parser works on the file's
//! bytes in memory, checks every declared size against them, and never panics.
//!
//! Accepted: little-endian `<f4`, `<f2`, `<f8` (floats), `<i4`, `<i8` (indices), C order.

use anyhow::{bail, ensure, Context, Result};

use super::tensor::{checked_numel, decode_f64, DType, HostTensor, IndexTensor};
use super::OutTensor;

const MAGIC: &[u8] = b"\x93NUMPY";

/// A parsed header: dtype descr, shape, and the raw data bytes that follow the header.
struct Npy<'a> {
    descr: String,
    shape: Vec<usize>,
    data: &'a [u8],
}

/// Which reader parses the file: the float reader accepts `<f4`, `<f2`, `<f8`, the index
/// reader `<i4`, `<i8`; an error names only the dtypes of the reader asked.
#[derive(Clone, Copy)]
enum Kind {
    Float,
    Index,
}

/// The dtypes the `kind` reader accepts, for error messages.
fn supported(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "supported float dtypes: '<f4', '<f2', '<f8'",
        Kind::Index => "supported index dtypes: '<i4', '<i8'",
    }
}

/// Bytes per element of a dtype either reader knows (the wrong reader's dtype is refused
/// after the size checks, by [`read_float`] / [`read_index`]).
fn item_size(descr: &str, kind: Kind) -> Result<usize> {
    Ok(match descr {
        "<f2" => 2,
        "<f4" | "<i4" => 4,
        "<f8" | "<i8" => 8,
        _ => bail!("unsupported npy dtype {descr:?} ({})", supported(kind)),
    })
}

fn parse(bytes: &[u8], kind: Kind) -> Result<Npy<'_>> {
    ensure!(
        bytes.len() >= 10 && bytes.starts_with(MAGIC),
        "not an npy file (bad magic or truncated)"
    );
    let (len_bytes, header_start): (usize, usize) = match bytes[6] {
        1 => (2, 10),
        2 | 3 => (4, 12),
        v => bail!("unsupported npy format version {v}.{}", bytes[7]),
    };
    let Some(len_field) = bytes.get(8..8 + len_bytes) else {
        bail!("truncated npy header")
    };
    let header_len = len_field
        .iter()
        .rev()
        .fold(0usize, |n, &b| (n << 8) | b as usize);
    let Some(header) = header_start
        .checked_add(header_len)
        .and_then(|end| bytes.get(header_start..end))
    else {
        bail!(
            "npy header length {header_len} exceeds the file size {}",
            bytes.len()
        );
    };
    let data = &bytes[header_start + header_len..];
    let text = std::str::from_utf8(header).context("npy header is not UTF-8")?;
    let (descr, fortran, shape) =
        parse_dict(text).with_context(|| format!("corrupt npy header {:?}", text.trim_end()))?;
    ensure!(
        !fortran,
        "Fortran-order npy arrays are not supported (save with C order)"
    );
    let numel = checked_numel(&shape)?;
    let need = numel
        .checked_mul(item_size(&descr, kind)?)
        .with_context(|| format!("npy shape {shape:?} of {descr} is too large (bytes overflow)"))?;
    ensure!(
        need == data.len(),
        "npy header declares shape {shape:?} of {descr} ({need} bytes) but the file holds {} data bytes",
        data.len()
    );
    Ok(Npy { descr, shape, data })
}

/// A cursor over the header dict literal, e.g.
/// `{'descr': '<f4', 'fortran_order': False, 'shape': (9, 4096, 64), }`.
struct Lexer<'a>(&'a str);

impl<'a> Lexer<'a> {
    fn skip_ws(&mut self) {
        self.0 = self.0.trim_start();
    }
    fn eat(&mut self, c: char) -> bool {
        self.skip_ws();
        match self.0.strip_prefix(c) {
            Some(rest) => {
                self.0 = rest;
                true
            }
            None => false,
        }
    }
    fn expect(&mut self, c: char) -> Result<()> {
        ensure!(self.eat(c), "expected `{c}`");
        Ok(())
    }
    fn string(&mut self) -> Result<&'a str> {
        self.skip_ws();
        let quote = self
            .0
            .chars()
            .next()
            .filter(|&c| c == '\'' || c == '"')
            .context("expected a string")?;
        let rest = &self.0[1..];
        let end = rest.find(quote).context("unterminated string")?;
        self.0 = &rest[end + 1..];
        Ok(&rest[..end])
    }
    /// A run of ASCII letters, digits and signs (signs so that a negative dimension is
    /// reported as itself, not as an empty word).
    fn word(&mut self) -> &'a str {
        self.skip_ws();
        let end = self
            .0
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '+'))
            .unwrap_or(self.0.len());
        let (w, rest) = self.0.split_at(end);
        self.0 = rest;
        w
    }
}

fn parse_dict(text: &str) -> Result<(String, bool, Vec<usize>)> {
    let mut lx = Lexer(text);
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    lx.expect('{')?;
    while !lx.eat('}') {
        let key = lx.string()?;
        lx.expect(':')?;
        match key {
            "descr" => descr = Some(lx.string()?.to_string()),
            "fortran_order" => {
                fortran = Some(match lx.word() {
                    "True" => true,
                    "False" => false,
                    w => bail!("fortran_order must be True or False, got {w:?}"),
                })
            }
            "shape" => {
                lx.expect('(')?;
                let mut dims = Vec::new();
                while !lx.eat(')') {
                    let w = lx.word();
                    let w = w.strip_suffix('L').unwrap_or(w);
                    dims.push(
                        w.parse::<usize>()
                            .with_context(|| format!("bad shape dimension {w:?}"))?,
                    );
                    if !lx.eat(',') {
                        lx.expect(')')?;
                        break;
                    }
                }
                shape = Some(dims);
            }
            k => bail!("unexpected key {k:?}"),
        }
        if !lx.eat(',') {
            lx.expect('}')?;
            break;
        }
    }
    Ok((
        descr.context("missing 'descr'")?,
        fortran.context("missing 'fortran_order'")?,
        shape.context("missing 'shape'")?,
    ))
}

/// Reads a float npy file (`<f4`, `<f2`, `<f8`) as an `f32` tensor named `name`.
pub(super) fn read_float(bytes: &[u8], name: &str) -> Result<HostTensor> {
    let npy = parse(bytes, Kind::Float)?;
    let data = match npy.descr.as_str() {
        "<f4" => DType::F32.decode(npy.data),
        "<f2" => DType::F16.decode(npy.data),
        "<f8" => decode_f64(npy.data, name, &npy.shape)?,
        d => bail!(
            "npy dtype {d:?} is not a float dtype ({})",
            supported(Kind::Float)
        ),
    };
    Ok(HostTensor {
        name: name.to_string(),
        shape: npy.shape,
        data,
    })
}

/// Reads an integer npy file (`<i4`, `<i8`) as an `i32` tensor named `name`.
pub(super) fn read_index(bytes: &[u8], name: &str) -> Result<IndexTensor> {
    let npy = parse(bytes, Kind::Index)?;
    let data = match npy.descr.as_str() {
        "<i4" => npy
            .data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "<i8" => super::st::i64_to_i32(npy.data)?,
        d => bail!(
            "npy dtype {d:?} is not an integer dtype ({})",
            supported(Kind::Index)
        ),
    };
    Ok(IndexTensor {
        name: name.to_string(),
        shape: npy.shape,
        data,
    })
}

/// Encodes one tensor as a version 1.0 npy file (header padded to 64 bytes, as numpy does).
pub(super) fn encode(t: &OutTensor) -> Result<Vec<u8>> {
    let (descr, shape, body) = match *t {
        OutTensor::Float(h, DType::F32) => ("<f4", &h.shape, DType::F32.encode(&h.data)),
        OutTensor::Float(h, DType::F16) => ("<f2", &h.shape, DType::F16.encode(&h.data)),
        OutTensor::Float(h, DType::BF16) => {
            bail!("tensor `{}`: bf16 cannot be stored in npy (no standard descr); use f16, f32 or .safetensors", h.name)
        }
        OutTensor::Index(i) => (
            "<i4",
            &i.shape,
            i.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    };
    let n = checked_numel(shape).with_context(|| format!("tensor `{}`", t.name()))?;
    ensure!(
        n.checked_mul(item_size(descr, Kind::Float)?) == Some(body.len()),
        "tensor `{}`: shape {shape:?} does not match its {} data bytes",
        t.name(),
        body.len()
    );
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    ensure!(header.len() <= u16::MAX as usize, "npy header too long");
    let mut out = Vec::with_capacity(10 + header.len() + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}
