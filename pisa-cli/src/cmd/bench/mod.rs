//! `pisa bench`: GPU-timed comparison of PISA against BSA and dense attention.

pub mod report;

use clap::Args;

/// Arguments of `pisa bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {}

/// Runs `pisa bench`.
pub fn run(_a: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("pisa bench: not built yet")
}
