//! The arguments of `pisa bench` ([`BenchArgs`]) and the parsing of their lists: sizes with
//! k/M suffixes ([`parse_sizes`]) and storage precisions.

use std::path::PathBuf;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use pisa_wgpu::Storage;

use crate::args::{LeafOrderArg, ScoringArg};

/// Arguments of `pisa bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Prefill lengths N (comma separated; k/K and m/M suffixes: 4k = 4096).
    #[arg(long, default_value = "4k,16k,64k,128k,256k")]
    pub sizes: String,
    /// KV-cache lengths of the decode benchmark (empty: none).
    #[arg(long, default_value = "64k,256k,1m")]
    pub decode_sizes: String,
    /// Decode steps per back-to-back burst (10, as the PyTorch peer; a long burst keeps the GPU
    /// busy long enough to reach its sustained clocks, as an inference loop does).
    #[arg(long, default_value_t = super::decode::BURST)]
    pub decode_burst: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub hq: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 8)]
    pub hkv: usize,
    /// Head dim.
    #[arg(long, default_value_t = 128)]
    pub d: usize,
    /// Leaf block size C.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// top_k K.
    #[arg(long, default_value_t = 16)]
    pub top_k: usize,
    /// Intermediate scoring.
    #[arg(long, value_enum, default_value_t = ScoringArg::Lse)]
    pub scoring: ScoringArg,
    /// Stage-2 query tile.
    #[arg(long, default_value_t = 4)]
    pub q_tile: usize,
    /// Order of selection stage 2 and sparse attention (query tiles or leaf-major).
    #[arg(long, value_enum, default_value_t = LeafOrderArg::Auto)]
    pub leaf_order: LeafOrderArg,
    /// Storage precisions to run (comma separated: f16,f32).
    #[arg(long, default_value = "f16,f32")]
    pub storages: String,
    /// Time dense attention only up to this N (the portable kernel is O(N^2)).
    #[arg(long, default_value = "64k")]
    pub dense_max: String,
    /// Time the backward pass only up to this N (0: never).
    #[arg(long, default_value = "64k")]
    pub backward_max: String,
    /// Timed repetitions per size (fewer when a size would exceed --budget-s).
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// Seconds one size may take.
    #[arg(long, default_value_t = 8.0)]
    pub budget_s: f64,
    /// Write the results as JSON here (and an SVG plot beside it).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Instead of measuring: print these result files side by side (and write compare.svg).
    #[arg(long, num_args = 1..)]
    pub compare: Vec<PathBuf>,
    /// Adapter name fragment or index.
    #[arg(long)]
    pub adapter: Option<String>,
}

/// Parses "4k,16K,1m,1000" into token counts.
pub fn parse_sizes(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            let (num, mul) = match x.chars().last() {
                Some('k' | 'K') => (&x[..x.len() - 1], 1024),
                Some('m' | 'M') => (&x[..x.len() - 1], 1024 * 1024),
                _ => (x, 1),
            };
            let n: usize = num
                .parse()
                .with_context(|| format!("bad size {x:?} (examples: 4096, 4k, 1m)"))?;
            if n == 0 {
                bail!("size {x:?} must be at least 1");
            }
            n.checked_mul(mul)
                .with_context(|| format!("size {x:?} is too large"))
        })
        .collect()
}

/// Parses "f16,f32" into storage precisions.
pub(super) fn storages(s: &str) -> Result<Vec<Storage>> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| match x {
            "f32" => Ok(Storage::F32),
            "f16" => Ok(Storage::F16),
            _ => bail!("unknown storage {x:?}: use f16 and/or f32"),
        })
        .collect()
}
