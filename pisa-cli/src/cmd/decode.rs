//! `pisa decode`.

use clap::Args;

/// Arguments of `pisa decode`.
#[derive(Args, Debug)]
pub struct DecodeArgs {}

/// Runs `pisa decode`.
pub fn run(_a: DecodeArgs) -> anyhow::Result<()> {
    anyhow::bail!("pisa decode: not built yet")
}
