//! `pisa decode`.

use clap::Args;

/// Arguments of `pisa decode`.
#[derive(Args, Debug)]
pub struct DecodeArgs {}

/// Runs `pisa decode`.
pub fn run(_a: DecodeArgs) -> anyhow::Result<()> {
    anyhow::bail!("pisa decode: not built yet")
}

/// The decode part of `pisa demo` (filled in with the KV cache).
pub fn demo(
    _ctx: &pisa_wgpu::Context,
    _l: &crate::input::Loaded,
    _cfg: &pisa_core::SelectionConfig,
    _steps: usize,
) -> anyhow::Result<()> {
    println!("decode: not built yet");
    Ok(())
}
