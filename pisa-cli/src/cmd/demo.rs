//! `pisa demo`.

use clap::Args;

/// Arguments of `pisa demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {}

/// Runs `pisa demo`.
pub fn run(_a: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("pisa demo: not built yet")
}
