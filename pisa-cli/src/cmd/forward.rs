//! `pisa forward`.

use clap::Args;

/// Arguments of `pisa forward`.
#[derive(Args, Debug)]
pub struct ForwardArgs {}

/// Runs `pisa forward`.
pub fn run(_a: ForwardArgs) -> anyhow::Result<()> {
    anyhow::bail!("pisa forward: not built yet")
}
