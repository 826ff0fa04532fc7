//! `pisa recall`.

use clap::Args;

/// Arguments of `pisa recall`.
#[derive(Args, Debug)]
pub struct RecallArgs {}

/// Runs `pisa recall`.
pub fn run(_a: RecallArgs) -> anyhow::Result<()> {
    anyhow::bail!("pisa recall: not built yet")
}
