//! Loading Q, K, V for a command: from a `.safetensors` file (tensor names selectable, or
//! `--layer N` for `layer{N}.q/k/v`), from three `.npy` files, or from the embedded demo input.
//! Shapes are `[H, N, D]` (batch 1) or `[B, H, N, D]` in BHND, `[N, H, D]` or `[B, N, H, D]`
//! in BNHD. Every problem is one error naming the file and what is wrong.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context as _, Result};
use clap::Args;
use pisa_core::{AttentionShape, TensorLayout};

use crate::args::{usage_bail, LayoutArg, StorageArg};
use crate::io::{self, HostTensor};

/// The embedded default input: SmolLM2-135M-Instruct layer 15, tokens 0..4096, f16
/// (provenance in data/README.md).
pub const DEMO_INPUT: &[u8] = include_bytes!("../../data/demo-smollm2-layer15-4096.safetensors");

/// Where Q, K, V come from.
#[derive(Args, Clone, Debug)]
pub struct InputArgs {
    /// Input file: `.safetensors` holding Q, K and V, or a `.npy` holding Q (then --k-file, --v-file).
    #[arg(long, short = 'i')]
    pub input: Option<PathBuf>,
    /// File of K when --input is a `.npy`: a `.npy`, or a `.safetensors` (its tensor `k`).
    #[arg(long)]
    pub k_file: Option<PathBuf>,
    /// File of V when --input is a `.npy`: a `.npy`, or a `.safetensors` (its tensor `v`).
    #[arg(long)]
    pub v_file: Option<PathBuf>,
    /// Tensor name of Q in a safetensors file [default: q].
    #[arg(long, value_name = "NAME")]
    pub q_name: Option<String>,
    /// Tensor name of K [default: k].
    #[arg(long, value_name = "NAME")]
    pub k_name: Option<String>,
    /// Tensor name of V [default: v].
    #[arg(long, value_name = "NAME")]
    pub v_name: Option<String>,
    /// Read `layer{N}.q`, `layer{N}.k`, `layer{N}.v` (and that layer's scale from the metadata).
    #[arg(long)]
    pub layer: Option<usize>,
    /// Use only the first N tokens (default: all of them).
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Layout of the tensors in the files.
    #[arg(long, value_enum, default_value_t = LayoutArg::Bhnd)]
    pub layout: LayoutArg,
    /// Pass NaN/Inf inputs to the GPU instead of refusing them. What a row that reads one gets
    /// is unspecified and need not be NaN: a row whose query holds one can come out as zeros
    /// with LSE -inf, like a row with no keys (pisa_wgpu::ops::prefill, "Non-finite inputs").
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// What the loader's errors advise, in the terms of the command's own options: as parsed,
    /// [`InputAdvice::FLAGS`] (forward, decode, recall have `--allow-nonfinite` and
    /// `--storage`); a command without them (`pisa bench`) gives its own.
    #[arg(skip = InputAdvice::FLAGS)]
    pub advice: InputAdvice,
}

/// The advice of [`InputArgs`]' errors on an input the command refuses, which names options
/// of the command that loads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputAdvice {
    /// Appended to "refusing non-finite input", e.g. ` (--allow-nonfinite passes it on)`;
    /// empty for none.
    pub nonfinite: &'static str,
    /// Appended to the error on values out of f16's range, e.g. `use --storage f32`.
    pub f16_range: &'static str,
}

impl InputAdvice {
    /// The advice of commands with `--allow-nonfinite` and `--storage`.
    pub const FLAGS: Self = Self {
        nonfinite: " (--allow-nonfinite passes it on)",
        f16_range: "use --storage f32 (--allow-nonfinite passes it on as inf)",
    };
}

/// Q, K, V in f32 with their shape.
pub struct Loaded {
    /// Q, `shape.q_elems()` values in `layout`.
    pub q: Vec<f32>,
    /// K.
    pub k: Vec<f32>,
    /// V (empty where the command does not read it: `pisa recall`).
    pub v: Vec<f32>,
    /// Shape (prefill: q_len == k_len).
    pub shape: AttentionShape,
    /// Layout of q, k, v.
    pub layout: TensorLayout,
    /// Softmax scale from the file's metadata: `Ok(None)` when there is none, `Err` (a message
    /// naming the file) when it is unreadable or not a finite positive f32. Only consulted, so
    /// only an error, where `--scale` is not given ([`crate::args::SelectArgs::config`]).
    pub file_scale: std::result::Result<Option<f32>, String>,
    /// Where it came from (for messages).
    pub source: String,
    /// The names of the Q, K and V tensors read (`layer{N}.q` ... with `--layer`; the
    /// `--q-name` ... values otherwise, nominal for `.npy` files), recorded in outputs.
    pub tensors: [String; 3],
    /// Shape of the Q tensor as read (3-D without batch or 4-D), after `--tokens`.
    pub q_dims: Vec<usize>,
    /// Shape of K (and V) as read, after `--tokens`.
    pub kv_dims: Vec<usize>,
}

impl Loaded {
    /// The metadata of an output file made from these inputs with `cfg`: the softmax scale
    /// used, the configuration, the source file, the tensors read (`tensors`: the layer) and
    /// the tokens used (`tokens`, after `--tokens`).
    pub fn output_metadata(
        &self,
        cfg: &pisa_core::SelectionConfig,
    ) -> std::collections::BTreeMap<String, String> {
        [
            ("scale", cfg.softmax_scale(self.shape.head_dim).to_string()),
            ("config", crate::text::config(cfg)),
            ("source", self.source.clone()),
            ("tensors", self.tensors.join(", ")),
            ("tokens", self.shape.k_len.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The `--json` output of a command run on these inputs with `cfg` on the adapter named
    /// `adapter`, Q, K and V stored as `storage`: what `forward`, `decode` and `recall` record
    /// alike (the adapter, the source file, the tensors read, the shape, the configuration, the
    /// softmax scale the kernels used and the storage), then the command's own `fields` (a JSON
    /// object).
    pub fn run_json(
        &self,
        adapter: &str,
        cfg: &pisa_core::SelectionConfig,
        storage: pisa_wgpu::Storage,
        fields: serde_json::Value,
    ) -> serde_json::Value {
        let mut j = serde_json::json!({
            "adapter": adapter, "source": self.source, "tensors": self.tensors,
            "shape": crate::text::shape_json(&self.shape),
            "config": crate::text::config_json(cfg),
            // The scale the kernels used (config's `scale` is null when it defaults to 1/sqrt(D)).
            "softmax_scale": crate::text::f32_json(cfg.softmax_scale(self.shape.head_dim)),
            "storage": crate::text::storage(storage),
        });
        if let (Some(j), serde_json::Value::Object(f)) = (j.as_object_mut(), fields) {
            j.extend(f);
        }
        j
    }

    /// Whether the inputs had a batch dimension (4-D).
    pub fn batched(&self) -> bool {
        self.q_dims.len() == 4
    }
}

struct Axes {
    batch: Option<usize>,
    heads: usize,
    tokens: usize,
}

/// Tokens `t0 .. t1` of `x`, a `[B, H, N, D]` tensor (`dims`) in `layout`, as a tensor of
/// `t1 - t0` tokens in the same layout: per (b, h) rows in BHND, per b runs of every head in
/// BNHD (each a contiguous copy).
pub fn token_range(
    x: &[f32],
    layout: TensorLayout,
    [b, h, n, d]: [usize; 4],
    (t0, t1): (usize, usize),
) -> Vec<f32> {
    let mut out = Vec::with_capacity(b * h * (t1 - t0) * d);
    // The runs that hold the tokens: one per (b, h) in BHND, per b (every head) in BNHD.
    let (runs, run_heads) = match layout {
        TensorLayout::Bhnd => (b * h, 1),
        TensorLayout::Bnhd => (b, h),
    };
    for run in 0..runs {
        let (bi, hi) = match layout {
            TensorLayout::Bhnd => (run / h, run % h),
            TensorLayout::Bnhd => (run, 0),
        };
        let at = layout.index(h, n, d, bi, hi, t0, 0);
        out.extend_from_slice(&x[at..at + (t1 - t0) * run_heads * d]);
    }
    out
}

fn axes(rank: usize, layout: TensorLayout) -> Option<Axes> {
    match (rank, layout) {
        (3, TensorLayout::Bhnd) => Some(Axes {
            batch: None,
            heads: 0,
            tokens: 1,
        }),
        (4, TensorLayout::Bhnd) => Some(Axes {
            batch: Some(0),
            heads: 1,
            tokens: 2,
        }),
        (3, TensorLayout::Bnhd) => Some(Axes {
            batch: None,
            heads: 1,
            tokens: 0,
        }),
        (4, TensorLayout::Bnhd) => Some(Axes {
            batch: Some(0),
            heads: 2,
            tokens: 1,
        }),
        _ => None,
    }
}

/// (batch, heads, tokens, dim) of a tensor, or an error naming it.
fn dims(t: &HostTensor, layout: TensorLayout, src: &str) -> Result<(usize, usize, usize, usize)> {
    let a = axes(t.shape.len(), layout).with_context(|| {
        format!(
            "{src}: tensor `{}` has shape {:?}; expected 3 or 4 dimensions ({})",
            t.name,
            t.shape,
            crate::text::layout(layout)
        )
    })?;
    let b = a.batch.map_or(1, |i| t.shape[i]);
    Ok((
        b,
        t.shape[a.heads],
        t.shape[a.tokens],
        *t.shape.last().unwrap_or(&0),
    ))
}

/// ` (read as bnhd; as bhnd Q and K agree: is --layout right?)` when Q and K disagree in the
/// given layout but agree in the other one, else empty.
fn layout_hint(q: &HostTensor, k: &HostTensor, layout: TensorLayout) -> String {
    let other = match layout {
        TensorLayout::Bhnd => TensorLayout::Bnhd,
        TensorLayout::Bnhd => TensorLayout::Bhnd,
    };
    let agree = |l| match (dims(q, l, ""), dims(k, l, "")) {
        (Ok((qb, qh, qt, qd)), Ok((kb, kh, kt, kd))) => {
            qb == kb && qt == kt && qd == kd && kh > 0 && qh % kh == 0
        }
        _ => false,
    };
    let name = crate::text::layout;
    if !agree(layout) && agree(other) {
        format!(
            " (read as {}; as {} Q and K agree: is --layout right?)",
            name(layout),
            name(other)
        )
    } else {
        String::new()
    }
}

impl InputArgs {
    /// The Q, K and V tensor names to read: `layer{N}.q/k/v` with `--layer`, else the
    /// `--q-name`, `--k-name` and `--v-name` given, `q`, `k` and `v` where not given.
    fn names(&self) -> (String, String, String) {
        match self.layer {
            Some(l) => (
                format!("layer{l}.q"),
                format!("layer{l}.k"),
                format!("layer{l}.v"),
            ),
            None => {
                let name = |n: &Option<String>, default: &str| {
                    n.clone().unwrap_or_else(|| default.to_string())
                };
                (
                    name(&self.q_name, "q"),
                    name(&self.k_name, "k"),
                    name(&self.v_name, "v"),
                )
            }
        }
    }

    /// Whether any of `--q-name`, `--k-name`, `--v-name` was given (also with its default
    /// value: `--layer` and `.npy` inputs refuse them either way).
    fn names_given(&self) -> bool {
        self.q_name.is_some() || self.k_name.is_some() || self.v_name.is_some()
    }

    /// [`InputArgs::load`] of a file (no demo input) for GPU storage `storage`: with f16 storage,
    /// values that f16 cannot hold are refused unless `--allow-nonfinite`. `with_v`: V is used;
    /// without it (a selection only: `pisa recall`) V is neither required nor read, and
    /// [`Loaded::v`] is empty.
    pub fn load_for(&self, storage: StorageArg, with_v: bool) -> Result<Loaded> {
        let l = self.load_with(false, with_v)?;
        if storage == StorageArg::F16 && !self.allow_nonfinite {
            l.check_f16_range(with_v, self.advice.f16_range)?;
        }
        if storage == StorageArg::F16 {
            if let Some(note) = l.f16_underflow_note(with_v) {
                eprintln!("warning: {note}");
            }
        }
        Ok(l)
    }

    /// The input files named on the command line (`--input`, `--k-file`, `--v-file`).
    pub fn files(&self) -> Vec<&Path> {
        [&self.input, &self.k_file, &self.v_file]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
            .collect()
    }

    /// Loads Q, K, V (the embedded demo input when `--input` is absent and `allow_demo`).
    pub fn load(&self, allow_demo: bool) -> Result<Loaded> {
        self.load_with(allow_demo, true)
    }

    /// [`InputArgs::load`]; without `with_v` V is neither required (no `--v-file` needed, no
    /// tensor `v` in a safetensors file) nor read, and [`Loaded::v`] is empty.
    fn load_with(&self, allow_demo: bool, with_v: bool) -> Result<Loaded> {
        if self.layer.is_some() && self.names_given() {
            usage_bail!(
                "--layer N reads layer{{N}}.q/k/v: it cannot be combined with --q-name, --k-name or --v-name"
            );
        }
        let layout: TensorLayout = self.layout.into();
        let (qn, kn, vn) = self.names();
        if !with_v && self.v_file.is_some() {
            // (it was accepted and never read, a missing file included)
            usage_bail!("--v-file: this command reads no V (its selection is of Q and K)");
        }
        let demo_file;
        let (qp, kp, vp): (PathBuf, PathBuf, PathBuf) = match &self.input {
            Some(p) if io::Format::from_path(p)? == io::Format::Npy => {
                if self.layer.is_some() {
                    usage_bail!(
                        "{}: --layer picks tensors of a .safetensors file; a .npy file holds one tensor",
                        p.display()
                    );
                }
                if self.names_given() {
                    usage_bail!(
                        "{}: --q-name, --k-name and --v-name pick tensors of a .safetensors file; a .npy file holds one tensor",
                        p.display()
                    );
                }
                let missing = match (&self.k_file, &self.v_file) {
                    (None, _) if !with_v => "K with --k-file",
                    (None, None) => "K and V with --k-file and --v-file",
                    (None, Some(_)) => "K with --k-file",
                    _ => "V with --v-file",
                };
                let v = self.v_file.clone().or_else(|| (!with_v).then(PathBuf::new));
                let (Some(k), Some(v)) = (self.k_file.clone(), v) else {
                    usage_bail!("--input is a .npy file: give {missing}");
                };
                (p.clone(), k, v)
            }
            Some(p) => {
                if self.k_file.is_some() || self.v_file.is_some() {
                    usage_bail!(
                        "{}: --k-file and --v-file go with a .npy --input; a .safetensors input holds K and V (--k-name, --v-name)",
                        p.display()
                    );
                }
                (p.clone(), p.clone(), p.clone())
            }
            None if allow_demo => {
                demo_file = tempfile::Builder::new().suffix(".safetensors").tempfile()?;
                std::fs::write(demo_file.path(), DEMO_INPUT)?;
                let p = demo_file.path().to_path_buf();
                (p.clone(), p.clone(), p)
            }
            None => usage_bail!(
                "no input: give --input FILE (.safetensors with q/k/v, or .npy with --k-file/--v-file)"
            ),
        };
        // Messages name every file the tensors came from (K and V may have their own).
        let source = match &self.input {
            None => "embedded demo input".to_string(),
            Some(p) if kp == qp && (vp == qp || !with_v) => p.display().to_string(),
            Some(p) if !with_v => format!("{} (K {})", p.display(), kp.display()),
            Some(p) => format!("{} (K {}, V {})", p.display(), kp.display(), vp.display()),
        };
        let read = |p: &Path, n: &str| -> Result<HostTensor> { io::read_tensor(p, n) };
        let (mut q, mut k) = (read(&qp, &qn)?, read(&kp, &kn)?);
        // (unread without `with_v`: an empty V of K's shape stands for it in the checks)
        let mut v = match with_v {
            true => read(&vp, &vn)?,
            false => HostTensor {
                name: vn.clone(),
                shape: k.shape.clone(),
                data: Vec::new(),
            },
        };
        let meta = io::read_metadata(&qp)?;
        let file_scale = io::softmax_scale(&meta, self.layer).map_err(|e| {
            format!(
                "{}: bad softmax scale: {e:#} (--scale overrides it)",
                qp.display()
            )
        });
        let (qb, qh, qt, qd) = dims(&q, layout, &source)?;
        let (kb, kh, kt, kd) = dims(&k, layout, &source)?;
        ensure!(
            k.shape == v.shape,
            "{source}: K has shape {:?} but V has {:?}; they must match",
            k.shape,
            v.shape
        );
        ensure!(
            q.shape.len() == k.shape.len(),
            "{source}: Q has shape {:?}, K has {:?}: different ranks",
            q.shape,
            k.shape
        );
        let hint = layout_hint(&q, &k, layout);
        ensure!(qb == kb, "{source}: Q has batch {qb}, K has {kb}{hint}");
        ensure!(qd == kd, "{source}: Q has head dim {qd}, K has {kd}{hint}");
        ensure!(
            qt == kt,
            "{source}: Q has {}, K has {kt}; prefill needs the same length{hint}",
            crate::text::plural(qt, "token")
        );
        ensure!(
            kh > 0 && qh % kh == 0,
            "{source}: Q has {}, K has {kh}; query heads must be a multiple of key/value heads (GQA){hint}",
            crate::text::plural(qh, "head")
        );
        let mut n = qt;
        if let Some(t) = self.tokens {
            ensure!(
                t >= 1 && t <= qt,
                "--tokens {t} is out of range 1..={qt} for {source}"
            );
            let ax = axes(q.shape.len(), layout).map(|a| a.tokens).unwrap_or(1);
            q = q.narrow(ax, 0, t)?;
            k = k.narrow(ax, 0, t)?;
            if with_v {
                v = v.narrow(ax, 0, t)?;
            }
            n = t;
        }
        // (against the tokens used: --tokens within the window attends as the layer does)
        if let Some(w) = io::sliding_window(&meta, self.layer) {
            if (w as usize) < n {
                eprintln!(
                    "warning: {}: layer {} attends a sliding window of {w} tokens (metadata \
                     `layers`); pisa attends to every past block it selects, so its outputs \
                     are not that layer's over these {n} tokens",
                    qp.display(),
                    self.layer.unwrap_or_default()
                );
            }
        }
        // Only the tokens used are checked (a non-finite value past --tokens is never read).
        if !self.allow_nonfinite {
            for (t, p) in [(&q, &qp), (&k, &kp), (&v, &vp)]
                .into_iter()
                .take(2 + with_v as usize)
            {
                io::check_finite(t).with_context(|| {
                    let hint = self.advice.nonfinite;
                    format!("{}: refusing non-finite input{hint}", p.display())
                })?;
            }
        }
        let shape = AttentionShape::prefill(qb, qh, kh, n, qd)
            .with_context(|| format!("{source}: bad shapes"))?;
        Ok(Loaded {
            q_dims: q.shape.clone(),
            kv_dims: k.shape.clone(),
            q: q.data,
            k: k.data,
            v: v.data,
            shape,
            layout,
            file_scale,
            source,
            tensors: [qn, kn, vn],
        })
    }
}
