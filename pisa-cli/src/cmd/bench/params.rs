//! The shape and selection parameters of a `pisa bench` run: as numbers in the JSON
//! ([`Params`]), as the report's readable `shape` line, and read back from older files.

use pisa_core::SelectionConfig;
use pisa_wgpu::Context;
use serde::{Deserialize, Serialize};

use super::report::Report;
use super::BenchArgs;

/// The shape and selection parameters of a `pisa bench` run, as numbers and names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub block_size: usize,
    pub top_k: usize,
    pub merge_factor: usize,
    /// `lse`, `mean` or `meanvar`.
    pub scoring: String,
    pub q_tile: usize,
    /// Layout of the prefill's Q, K, V and O: `bhnd` or `bnhd`; empty in files written before
    /// it was recorded (they ran `bhnd`).
    #[serde(default)]
    pub layout: String,
    /// `auto`, `tiles` or `leaves`.
    pub leaf_order: String,
    /// The prefill's inputs: `random`, or the `--input` file (and `--layer`); empty in files
    /// written before it was recorded (random).
    #[serde(default)]
    pub input: String,
    /// The context's kernel path: `portable` or `coopmat`.
    pub kernel_path: String,
    /// The shaders' runtime checks (`driver_bounded`, `bounds`, `all`, `none`: see
    /// `pisa_wgpu::runtime::checks`); empty in files written before it was recorded.
    #[serde(default)]
    pub shader_checks: String,
    /// The tuning knobs that differ from the adapter's defaults (`--tune`, `PISA_*`), as
    /// `name=value`, but the leaf order (its own field); empty in files written before they
    /// were recorded.
    #[serde(default)]
    pub tuning: Vec<String>,
    /// `--queries`: each prefill ran this many queries (at most N) over its N keys; absent for
    /// whole prompts and in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queries: Option<usize>,
    /// The GPU warm-up before each timed submission, ms of GPU time as calibrated
    /// (`--warmup-ms`); absent when none ran and in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_ms: Option<f64>,
}

impl Params {
    /// The parameters of a run of `a` with `cfg` on `ctx`.
    pub fn of(a: &BenchArgs, cfg: &SelectionConfig, ctx: &Context) -> Self {
        Params {
            hq: a.hq,
            hkv: a.hkv,
            d: a.d,
            block_size: a.block_size,
            top_k: a.top_k,
            merge_factor: cfg.merge_factor,
            scoring: crate::text::scoring(cfg.scoring).into(),
            q_tile: a.q_tile,
            layout: crate::text::layout(a.layout.into()).into(),
            leaf_order: format!("{:?}", ctx.leaf_order()).to_ascii_lowercase(),
            input: match &a.input {
                None => "random".into(),
                Some(p) => {
                    let mut s = p.display().to_string();
                    if let Some(l) = a.layer {
                        s += &format!(" layer {l}");
                    }
                    if let Some(t) = a.tokens {
                        s += &format!(", first {t} tokens");
                    }
                    s
                }
            },
            kernel_path: match ctx.nv_cm2() {
                true => format!("{}+nv-cm2", ctx.kernel_path()),
                false => ctx.kernel_path().to_string(),
            },
            shader_checks: ctx.shader_checks().to_string(),
            // (the leaf order has its own field)
            tuning: ctx
                .tuning()
                .changes_from(&pisa_wgpu::Tuning::for_adapter(ctx.report()))
                .into_iter()
                .filter(|c| !c.starts_with("leaf_order="))
                .collect(),
            queries: a
                .queries
                .as_deref()
                .and_then(|q| super::args::parse_sizes(q).ok()?.first().copied()),
            // (set by the run once the warm-up is calibrated)
            warmup_ms: None,
        }
    }

    /// The prefill's layout, `bhnd` in files written before it was recorded.
    pub fn layout_name(&self) -> &str {
        if self.layout.is_empty() {
            "bhnd"
        } else {
            &self.layout
        }
    }

    /// The prefill's inputs, `random` in files written before they were recorded.
    pub fn input_name(&self) -> &str {
        if self.input.is_empty() {
            "random"
        } else {
            &self.input
        }
    }

    /// The report's `shape` line, naming the kernel path that ran.
    pub fn line(&self) -> String {
        let what = if self.kernel_path == "coopmat+nv-cm2" {
            "f16 sparse and dense attention on VK_NV_cooperative_matrix2, leaf scoring on tensor cores, the rest portable"
        } else if self.kernel_path == "coopmat" {
            "f16 attention and leaf scoring on tensor cores, the rest portable"
        } else {
            "every kernel portable"
        };
        let mut tuning = match self.tuning.is_empty() {
            true => String::new(),
            false => format!(", tuning {}", self.tuning.join(" ")),
        };
        if let Some(q) = self.queries {
            tuning += &format!(", prefill of the last min({q}, N) queries over N keys");
        }
        if let Some(ms) = self.warmup_ms {
            tuning += &format!(", GPU warm-up {ms:.1} ms before each timed submission");
        }
        format!(
            "Hq {}, Hkv {}, D {}, C {}, top_k {}, g {}, {}, Qtile {}, layout {}, inputs {}, leaf order {}, kernel path {} ({what}), shader checks {}{tuning}",
            self.hq, self.hkv, self.d, self.block_size, self.top_k, self.merge_factor,
            self.scoring, self.q_tile,
            self.layout_name(), self.input_name(), self.leaf_order, self.kernel_path,
            if self.shader_checks.is_empty() { "unrecorded" } else { &self.shader_checks }
        )
    }
}

/// Hq, Hkv, D, C, top_k of a report: from [`Report::params`], or parsed from the `shape` line
/// of older files (`Hq=32 Hkv=8 D=128 C=64 K=16 ...`).
pub fn params(r: &Report) -> Option<[usize; 5]> {
    if let Some(p) = &r.params {
        return Some([p.hq, p.hkv, p.d, p.block_size, p.top_k]);
    }
    let get = |key: &str| {
        r.shape
            .split([' ', ','])
            .find_map(|t| t.strip_prefix(key)?.parse::<usize>().ok())
    };
    Some([
        get("Hq=")?,
        get("Hkv=")?,
        get("D=")?,
        get("C=")?,
        get("K=")?,
    ])
}
