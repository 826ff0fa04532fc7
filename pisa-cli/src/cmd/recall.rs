//! `pisa recall`: selection quality on given Q/K (PISA.md section 3): Recall@K and mass recall
//! of PISA with each intermediate scoring (`lse`, `mean`, `meanvar`) and of BSA, against the
//! full-attention oracle, per KV head and averaged, and how much each selection's rows share
//! (sibling leaves, leaves common to neighbouring queries). All selections run on the GPU; the
//! metrics are `pisa_core::reference::metrics`.

use anyhow::{Context as _, Result};
use clap::Args;
use pisa_core::reference::metrics::{try_locality, try_recall_per_kv_head, Recall};
use pisa_core::reference::Selection;
use pisa_core::{Scoring, SelectionConfig};
use pisa_wgpu::ops::select::{oracle_host, select_host, Method};

use crate::args::{progress, CausalArgs, DeviceArgs, SelectArgs, StorageArg};
use crate::input::InputArgs;

/// Arguments of `pisa recall`.
#[derive(Args, Debug)]
#[command(mut_arg("storage", |a| a
    .help("GPU storage precision of Q and K: f32 or f16 (the oracle reads no bf16)")
    .value_parser(storage_parser())))]
pub struct RecallArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub select: SelectArgs,
    #[command(flatten)]
    pub causal: CausalArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// `--storage` of recall: the shared [`crate::args::StorageArg`] with bf16 hidden from the help
/// (the oracle does not read it); still parsed, so that [`run`] refuses it with the reason.
fn storage_parser() -> impl clap::builder::TypedValueParser<Value = StorageArg> {
    use clap::builder::TypedValueParser as _;
    use clap::ValueEnum;
    let values = StorageArg::value_variants().iter().filter_map(|v| {
        let pv = v.to_possible_value()?;
        Some(pv.hide(*v == StorageArg::Bf16))
    });
    clap::builder::PossibleValuesParser::new(values)
        .map(|s| StorageArg::from_str(&s, false).expect("a listed storage"))
}

/// One method's quality: per KV head and averaged.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MethodRecall {
    /// `pisa-lse`, `pisa-mean`, `pisa-meanvar`, `bsa`.
    pub method: String,
    /// Recall@K averaged over every counted query and KV head.
    pub recall_at_k: f64,
    /// Mass recall averaged likewise.
    pub mass_recall: f64,
    /// Per KV head `(recall@K, mass recall)`.
    pub per_kv_head: Vec<(f64, f64)>,
    /// Queries counted (those seeing more than K leaves) over all KV heads.
    pub queries: usize,
    /// Fraction of the selected leaves whose sibling (same level-1 node) the query selected
    /// too (`pisa_core::reference::metrics::Locality`); NaN when nothing counted.
    pub sibling_fraction: f64,
    /// Distinct leaves selected by [`LOCALITY_TILE`] consecutive queries of one KV head, over
    /// their `LOCALITY_TILE * K` slots (1: they share none); NaN when no whole tile counted.
    pub tile_union: f64,
}

/// The query tile of [`MethodRecall::tile_union`]: the 16 queries of a leaf-major chunk of the
/// GPU kernels at GQA group 4 (what one gathered key block can serve).
pub const LOCALITY_TILE: usize = 16;

/// Query-weighted averages; NaN (JSON `null`, "-" in the table) when no query counted.
fn average(per: &[Recall]) -> (f64, f64, usize) {
    let n: usize = per.iter().map(|r| r.queries).sum();
    if n == 0 {
        return (f64::NAN, f64::NAN, 0);
    }
    let w = |f: fn(&Recall) -> f64| {
        per.iter()
            .filter(|r| r.queries > 0)
            .map(|r| f(r) * r.queries as f64)
            .sum::<f64>()
            / n.max(1) as f64
    };
    (w(|r| r.recall_at_k), w(|r| r.mass_recall), n)
}

/// Computes the quality table of `cfg` (every scoring, whatever its own) with query tiles of
/// `q_tile`; shared with `pisa demo`.
pub fn measure(
    ctx: &pisa_wgpu::Context,
    l: &crate::input::Loaded,
    cfg: &SelectionConfig,
    q_tile: usize,
    storage: pisa_wgpu::Storage,
) -> Result<Vec<MethodRecall>> {
    let pb = progress(5, "recall");
    let (oracle_idx, mass) = oracle_host(ctx, &l.q, &l.k, &l.shape, l.layout, cfg, storage)
        .context("oracle selection")?;
    pb.inc(1);
    let mass: Vec<f64> = mass.iter().map(|&x| x as f64).collect();
    let wrap = |indices: Vec<i32>| Selection {
        top_k: cfg.top_k,
        indices,
        margin: Vec::new(),
        scored_nodes: Vec::new(),
    };
    let oracle = wrap(oracle_idx);
    let mut out = Vec::new();
    let runs = [
        ("pisa-lse", Method::Pisa, Scoring::Lse),
        ("pisa-mean", Method::Pisa, Scoring::Mean),
        ("pisa-meanvar", Method::Pisa, Scoring::MeanVar),
        ("bsa", Method::Bsa, Scoring::Lse),
    ];
    for (name, method, scoring) in runs {
        let c = cfg.with_scoring(scoring);
        let sel = select_host(
            ctx, &l.q, &l.k, &l.shape, l.layout, &c, storage, method, q_tile,
        )
        .with_context(|| format!("{name} selection"))?;
        let sel = wrap(sel);
        let per = try_recall_per_kv_head(&sel, &oracle, &mass, &l.shape, &c)?;
        let loc = try_locality(&sel, &l.shape, &c, LOCALITY_TILE)?;
        let (r, m, n) = average(&per);
        out.push(MethodRecall {
            method: name.to_string(),
            recall_at_k: r,
            mass_recall: m,
            per_kv_head: per.iter().map(|p| (p.recall_at_k, p.mass_recall)).collect(),
            queries: n,
            sibling_fraction: loc.sibling_fraction,
            tile_union: loc.tile_union,
        });
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(out)
}

/// `x * scale` with `prec` decimals, or `-` for NaN (nothing counted).
fn num(x: f64, scale: f64, prec: usize) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{:.prec$}", x * scale)
    }
}

/// `x` as a percentage with `prec` decimals, or `-` for NaN.
fn pct(x: f64, prec: usize) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        num(x, 100.0, prec) + "%"
    }
}

/// The table as text; `hint` ends the note shown when no query row was counted (what to change
/// on this command's line, e.g. "use more tokens or a smaller --top-k or --block-size").
pub fn table(rows: &[MethodRecall], top_k: usize, hint: &str) -> String {
    let mut s = format!(
        "{:<14} {:>10} {:>12} {:>9} {:>9}   per KV head: Recall@{top_k} / mass\n",
        "method",
        format!("Recall@{top_k}"),
        "mass recall",
        "siblings",
        format!("{LOCALITY_TILE}q union")
    );
    for r in rows {
        let per: Vec<String> = r
            .per_kv_head
            .iter()
            .map(|&(a, b)| match (a.is_nan(), b.is_nan()) {
                (true, true) => "-".into(),
                _ => format!("{}/{}", num(a, 1.0, 3), num(b, 1.0, 3)),
            })
            .collect();
        s.push_str(&format!(
            "{:<14} {:>10} {:>12} {:>9} {:>9}   {}\n",
            r.method,
            pct(r.recall_at_k, 2),
            pct(r.mass_recall, 2),
            pct(r.sibling_fraction, 1),
            pct(r.tile_union, 1),
            per.join("  ")
        ));
    }
    if let Some(r) = rows.first() {
        s.push_str(&format!(
            "({} counted: those seeing more than {top_k} leaves{})\n",
            crate::text::plural(r.queries, "query row"),
            if r.queries == 0 {
                format!("; none here: {hint}")
            } else {
                String::new()
            }
        ));
        s.push_str(&format!(
            "(siblings: selected leaves whose sibling leaf the query selected too; {LOCALITY_TILE}q \
             union: distinct leaves of {LOCALITY_TILE} consecutive queries over their \
             {LOCALITY_TILE} x {top_k} slots, 100% when they share none)\n"
        ));
    }
    s
}

/// Runs `pisa recall`.
pub fn run(a: RecallArgs) -> Result<()> {
    if a.device.storage == StorageArg::Bf16 {
        crate::args::usage_bail!(
            "--storage bf16 does not apply to recall: its oracle (full attention's mass per block) \
             reads f32 or f16; use --storage f32 or f16"
        );
    }
    let l = a.input.load_for(a.device.storage, false)?;
    // (Every scoring is measured: the configuration's own is not used.)
    let cfg = a
        .select
        .config(Scoring::Lse, !a.causal.non_causal, &l.file_scale)?;
    l.check_score_bound(cfg.softmax_scale(l.shape.head_dim))?;
    let ctx = a.device.context()?;
    crate::limits::warn_llvmpipe(&ctx, l.shape.k_len);
    let rows = measure(&ctx, &l, &cfg, a.select.q_tile, a.device.storage.into())
        .map_err(|e| crate::args::top_k_note(e, &cfg, l.shape.k_len))
        .with_context(|| format!("{}: recall failed", l.source))?;
    if a.device.json {
        // The run's configuration as forward and decode record it, but for the scoring: null,
        // as every scoring is measured (one row of `methods` each).
        let mut j = l.run_json(
            &ctx.report().name,
            &cfg,
            a.device.storage.into(),
            serde_json::json!({ "methods": rows }),
        );
        j["config"]["scoring"] = serde_json::Value::Null;
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "selection quality on {} ({}), C={} K={}:",
            l.source,
            crate::text::shape(&l.shape),
            a.select.block_size,
            a.select.top_k
        );
        print!(
            "{}",
            table(
                &rows,
                a.select.top_k,
                "use more tokens or a smaller --top-k or --block-size"
            )
        );
    }
    Ok(())
}
