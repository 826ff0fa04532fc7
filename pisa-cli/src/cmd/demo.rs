//! `pisa demo`: forward, decode and recall on the embedded default input (SmolLM2-135M layer
//! 15, tokens 0..4096, see data/README.md) and a short report. No arguments needed.

use anyhow::Result;
use clap::Args;
use pisa_core::{reference, AttentionShape, SelectionConfig};
use pisa_wgpu::ops::prefill::PrefillOptions;

use crate::args::{DeviceArgs, LayoutArg, SelectArgs, StorageArg};
use crate::input::InputArgs;

/// Decode steps of `pisa demo` when `--steps` is not given (fewer for a shorter `--tokens`).
const DEFAULT_STEPS: usize = 64;

/// Arguments of `pisa demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Tokens of the embedded input to use (at most 4096).
    #[arg(long, default_value_t = 2048)]
    pub tokens: usize,
    /// Decode steps after a prefill of `tokens - steps` tokens [default: 64, or `tokens - 1`
    /// when that is fewer].
    #[arg(long)]
    pub steps: Option<usize>,
    /// Adapter name fragment or index.
    #[arg(long, value_parser = crate::args::adapter_arg)]
    pub adapter: Option<String>,
    /// Skip the untimed warm-up prefill: the forward's times then include the shader compilation
    /// and pipeline creation that drivers do at a pipeline's first dispatch (a cold start).
    #[arg(long)]
    pub no_warmup: bool,
}

/// Runs `pisa demo`.
pub fn run(a: DemoArgs) -> Result<()> {
    if !(2..=4096).contains(&a.tokens) {
        anyhow::bail!(
            "--tokens {} is out of the demo's range 2..=4096: it prefills and then decodes \
             (at least 2 tokens) the embedded input's 4096 tokens at most",
            a.tokens
        );
    }
    // The default fits any --tokens; a number given is checked.
    let steps = a.steps.unwrap_or(DEFAULT_STEPS.min(a.tokens - 1));
    if steps == 0 {
        anyhow::bail!("--steps must be at least 1");
    }
    if steps >= a.tokens {
        anyhow::bail!(
            "--steps {} is too many for --tokens {}: at most {} (the first token is prefilled)",
            steps,
            a.tokens,
            a.tokens - 1
        );
    }
    let input = InputArgs {
        input: None,
        k_file: None,
        v_file: None,
        q_name: None,
        k_name: None,
        v_name: None,
        layer: None,
        tokens: Some(a.tokens),
        layout: LayoutArg::Bhnd,
        allow_nonfinite: false,
        // The embedded input: no file to refuse.
        advice: crate::input::InputAdvice::FLAGS,
    };
    let l = input.load(true)?;
    let sel = SelectArgs {
        block_size: 64,
        top_k: 8,
        merge: 2,
        sink_blocks: 0,
        local_blocks: 0,
        scale: None,
        q_tile: 4,
    };
    let cfg = sel.config(pisa_core::Scoring::Lse, true, &l.file_scale)?;
    let dev = DeviceArgs {
        adapter: a.adapter.clone(),
        storage: StorageArg::F32,
        json: false,
    };
    let ctx = dev.context()?;
    let s = &l.shape;
    crate::args::outln!(
        "pisa demo on {} ({}, {})",
        ctx.report().name,
        ctx.report().backend,
        ctx.report().driver_info
    )?;
    crate::args::outln!(
        "input: {} - SmolLM2-135M-Instruct layer 15, {} tokens, {} query heads, {} KV heads (GQA {}), D={}, scale {}",
        l.source,
        s.q_len,
        s.q_heads,
        s.kv_heads,
        s.gqa_group(),
        s.head_dim,
        cfg.softmax_scale(s.head_dim)
    )?;
    crate::args::outln!("config: {}\n", crate::text::config(&cfg))?;

    // 1. forward (prefill), checked against the f64 CPU reference on the GPU's selection.
    let opts = PrefillOptions {
        cfg,
        layout: l.layout,
        storage: pisa_wgpu::Storage::F32,
        q_tile: 4,
        return_selection: true,
    };
    let r = super::embed::prefill(&ctx, &l.q, &l.k, &l.v, s, &opts, !a.no_warmup)?;
    let sel_gpu = r.selection.clone().unwrap_or_default();
    let want = reference::select_pisa(&l.q, &l.k, s, l.layout, &cfg)?;
    let same = want
        .indices
        .chunks(cfg.top_k)
        .zip(sel_gpu.chunks(cfg.top_k))
        .filter(|(a, b)| a == b)
        .count();
    let (o_ref, _) = reference::sparse_attention(&l.q, &l.k, &l.v, s, l.layout, &cfg, &sel_gpu)?;
    let err = rel_err(&r.out, &o_ref);
    let stages: Vec<String> = r
        .times
        .stages
        .iter()
        .map(|(n, ms)| format!("{n} {ms:.2}"))
        .collect();
    crate::args::outln!(
        "forward: {} ms {} ({})",
        fmt(r.times.total()),
        if r.times.gpu { "GPU" } else { "wall" },
        stages.join(", ")
    )?;
    crate::args::outln!("  selection equal to the CPU reference for {same} of {} (query, KV head) rows; output rel. error {err:.2e}", want.rows())?;
    let visible = attended_fraction(&sel_gpu, s, &cfg);
    // (at most top_k blocks, and never more keys than the input has)
    let most = (cfg.top_k * cfg.block_size).min(s.k_len);
    let blocks = cfg.top_k.min(s.k_len.div_ceil(cfg.block_size));
    crate::args::outln!("  each query attends to at most {most} keys ({} of {}); mean fraction of its causal keys: {:.1}%\n", crate::text::plural(blocks, "block"), cfg.block_size, 100.0 * visible)?;

    // 2. decode
    super::decode::demo(&ctx, &l, &cfg, steps)?;

    // 3. recall
    crate::args::outln!(
        "\nselection quality against the full-attention oracle (PISA.md section 3):"
    )?;
    let (rows, _left_out) =
        super::recall::measure(&ctx, &l, &cfg, sel.q_tile, pisa_wgpu::Storage::F32)?;
    let hint = format!(
        "use --tokens above {} (the demo selects {} blocks of {} tokens)",
        cfg.top_k * cfg.block_size,
        cfg.top_k,
        cfg.block_size
    );
    crate::args::out!("{}", super::recall::table(&rows, cfg.top_k, &hint))?;
    Ok(())
}

fn fmt(ms: f64) -> String {
    format!("{ms:.2}")
}

/// Relative L2 error of `a` against `b`.
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let (mut n, mut d) = (0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        n += (x as f64 - y).powi(2);
        d += y * y;
    }
    (n / d.max(1e-300)).sqrt()
}

/// The mean over (KV head, query) rows of `selection` (`[B, Hkv, Nq, K]`, -1 padded) of the
/// fraction of a query's causal keys (positions 0 ..= p_i) that its selected blocks hold.
fn attended_fraction(selection: &[i32], s: &AttentionShape, cfg: &SelectionConfig) -> f64 {
    let (c, k) = (cfg.block_size, cfg.top_k);
    let rows = selection.chunks(k).enumerate().map(|(r, row)| {
        let seen = s.k_len - s.q_len + r % s.q_len + 1; // keys 0 ..= p_i
        let held: usize = (row.iter().filter(|&&b| b >= 0))
            .map(|&b| seen.saturating_sub(b as usize * c).min(c))
            .sum();
        held as f64 / seen as f64
    });
    let (sum, n) = rows.fold((0.0, 0usize), |(a, n), f| (a + f, n + 1));
    sum / n.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One KV head, 5 queries, C = 2, K = 2: the fractions of keys held, by hand.
    #[test]
    fn attended_fraction_counts_the_keys_each_query_sees() {
        let s = AttentionShape::new(1, 1, 1, 5, 5, 16).unwrap();
        let cfg = SelectionConfig::new(2, 2).unwrap();
        // p = 0..4 see 1..5 keys; blocks: {0}, {0}, {0, 1}, {0, 1}, {0, 2}.
        let sel = [0, -1, 0, -1, 0, 1, 0, 1, 0, 2];
        // held: 1 of 1, 2 of 2, 3 of 3, 4 of 4, 2 + 1 of 5.
        let want = (1.0 + 1.0 + 1.0 + 1.0 + 3.0 / 5.0) / 5.0;
        assert!((attended_fraction(&sel, &s, &cfg) - want).abs() < 1e-12);
    }
}
