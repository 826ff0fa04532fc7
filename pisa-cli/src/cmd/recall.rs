//! `pisa recall`: selection quality on given Q/K (PISA.md section 3): Recall@K and mass recall
//! of PISA with each intermediate scoring (`lse`, `mean`, `meanvar`) and of BSA, against the
//! full-attention oracle, per KV head and averaged, and how much each selection's rows share
//! (sibling leaves, leaves common to neighbouring queries). All selections run on the GPU; the
//! metrics are `pisa_core::reference::metrics`.

use std::borrow::Cow;

use anyhow::{Context as _, Result};
use clap::Args;
use pisa_core::reference::metrics::{try_locality, try_recall_per_kv_head, Recall};
use pisa_core::reference::Selection;
use pisa_core::{AttentionShape, Scoring, SelectionConfig};
use pisa_wgpu::{oracle_host, select_host, GpuError, SelectionMethod as Method};

use crate::args::{progress, CausalArgs, DeviceArgs, SelectArgs, StorageArg};
use crate::input::{token_range, InputArgs};

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

/// A method [`measure`] left out: the device cannot run it at the configuration (a device
/// limit, an unsupported combination). Printed as a warning, and listed in `--json`'s
/// `left_out`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LeftOut {
    /// The method's name, as [`MethodRecall::method`].
    pub method: String,
    /// The device's refusal.
    pub reason: String,
}

/// The query tile of [`MethodRecall::tile_union`]: the 16 queries of a leaf-major chunk of the
/// GPU kernels at GQA group 4 (what one gathered key block can serve).
pub const LOCALITY_TILE: usize = 16;

/// Query-weighted averages; NaN (JSON `null`, "-" in the table) when no query counted. (A
/// counted row of non-finite scores, from inputs `--allow-nonfinite` let through, makes the
/// mass recall NaN too: `null` in JSON, `NaN` in the table, with a note.)
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

/// Most bytes of the oracle's block masses one call computes (f32 on the device, f64 on the
/// host for the metrics): longer causal inputs run the oracle over ranges of queries.
const ORACLE_CHUNK_BYTES: u64 = 1 << 30;

/// Queries per oracle call for `shape` and `cfg` on `ctx`: all of them where their block masses
/// (`[B, Hkv, Nq, nb0]` f32) fit one storage binding and [`ORACLE_CHUNK_BYTES`]; else as many
/// as fit, at least one. (Causal: query range `i0 .. i1` sees keys `0 .. i1` only, so its
/// oracle is that of a call with those keys; otherwise of a call with every key, its queries'
/// positions not read.)
fn oracle_queries(
    ctx: &pisa_wgpu::Context,
    shape: &AttentionShape,
    cfg: &SelectionConfig,
) -> usize {
    let row = (shape.batch * shape.kv_heads * shape.k_len.div_ceil(cfg.block_size) * 4) as u64;
    let limit = ctx.max_binding_bytes().min(ORACLE_CHUNK_BYTES);
    ((limit / row) as usize).clamp(1, shape.q_len)
}

/// Computes the quality table of `cfg` (every scoring, whatever its own) with query tiles of
/// `q_tile`; shared with `pisa demo`. The oracle runs over ranges of queries where its block
/// masses would not fit one call ([`oracle_queries`]), the metrics of the ranges added up per
/// KV head.
pub fn measure(
    ctx: &pisa_wgpu::Context,
    l: &crate::input::Loaded,
    cfg: &SelectionConfig,
    q_tile: usize,
    storage: pisa_wgpu::Storage,
) -> Result<(Vec<MethodRecall>, Vec<LeftOut>)> {
    let chunk = oracle_queries(ctx, &l.shape, cfg);
    measure_in_ranges(ctx, l, cfg, q_tile, storage, chunk)
}

/// [`measure`] with the oracle over ranges of `chunk` queries (`chunk` >= `q_len`: one call).
fn measure_in_ranges(
    ctx: &pisa_wgpu::Context,
    l: &crate::input::Loaded,
    cfg: &SelectionConfig,
    q_tile: usize,
    storage: pisa_wgpu::Storage,
    chunk: usize,
) -> Result<(Vec<MethodRecall>, Vec<LeftOut>)> {
    let s = &l.shape;
    let chunk = chunk.max(1);
    let ranges: Vec<(usize, usize)> = (0..s.q_len)
        .step_by(chunk)
        .map(|i0| (i0, (i0 + chunk).min(s.q_len)))
        .collect();
    let pb = progress(4 + ranges.len() as u64, "recall");
    let wrap = |indices: Vec<i32>| Selection {
        top_k: cfg.top_k,
        indices,
        margin: Vec::new(),
        scored_nodes: Vec::new(),
    };
    let runs = [
        ("pisa-lse", Method::Pisa, Scoring::Lse),
        ("pisa-mean", Method::Pisa, Scoring::Mean),
        ("pisa-meanvar", Method::Pisa, Scoring::MeanVar),
        ("bsa", Method::Bsa, Scoring::Lse),
    ];
    // A method the device cannot run at this configuration (a device limit, an unsupported
    // combination) is left out with a warning, so that the others' results are not lost; any
    // other error ends the command, as does every method failing (with the first one's error).
    let mut sels = Vec::new();
    let mut skipped = Vec::new();
    for (name, method, scoring) in runs {
        let c = cfg.with_scoring(scoring);
        match select_host(ctx, &l.q, &l.k, s, l.layout, &c, storage, method, q_tile) {
            Ok(sel) => sels.push((name, c, wrap(sel))),
            Err(e @ (GpuError::Limit { .. } | GpuError::Unsupported(_))) => skipped.push((name, e)),
            Err(e) => return Err(anyhow::Error::new(e).context(format!("{name} selection"))),
        }
        pb.inc(1);
    }
    if sels.is_empty() {
        let (name, e) = skipped.swap_remove(0);
        return Err(anyhow::Error::new(e).context(format!("{name} selection")));
    }
    for (name, e) in &skipped {
        pb.suspend(|| eprintln!("warning: {name} left out: {e}"));
    }
    // Per method and KV head: (recall sum, mass recall sum, queries) over the ranges.
    let mut sums = vec![vec![(0.0, 0.0, 0usize); s.kv_heads]; sels.len()];
    let (kq, kk) = (s.q_len, cfg.top_k);
    for &(i0, i1) in &ranges {
        let (q, k): (Cow<[f32]>, Cow<[f32]>) = if ranges.len() == 1 {
            (Cow::Borrowed(&l.q), Cow::Borrowed(&l.k))
        } else {
            let qs = [s.batch, s.q_heads, s.q_len, s.head_dim];
            let ks = [s.batch, s.kv_heads, s.k_len, s.head_dim];
            let q = Cow::Owned(token_range(&l.q, l.layout, qs, (i0, i1)));
            match cfg.causal {
                true => (q, Cow::Owned(token_range(&l.k, l.layout, ks, (0, i1)))),
                false => (q, Cow::Borrowed(&l.k[..])),
            }
        };
        // Causal: the range's queries at positions i0 .. i1 over keys 0 .. i1.
        let nk = if cfg.causal { i1 } else { s.k_len };
        let rs = AttentionShape::new(s.batch, s.q_heads, s.kv_heads, i1 - i0, nk, s.head_dim)?;
        let (oracle_idx, mass) =
            oracle_host(ctx, &q, &k, &rs, l.layout, cfg, storage).context("oracle selection")?;
        let mass: Vec<f64> = mass.iter().map(|&x| x as f64).collect();
        let oracle = wrap(oracle_idx);
        for (m, (_, c, sel)) in sels.iter().enumerate() {
            // The range's rows of the selection, [B, Hkv, i1 - i0, K].
            let rows = sel
                .indices
                .chunks(kq * kk)
                .flat_map(|bh| bh[i0 * kk..i1 * kk].iter().copied())
                .collect();
            let per = try_recall_per_kv_head(&wrap(rows), &oracle, &mass, &rs, c)?;
            for (acc, p) in sums[m].iter_mut().zip(&per) {
                if p.queries > 0 {
                    let w = p.queries as f64;
                    *acc = (
                        acc.0 + p.recall_at_k * w,
                        acc.1 + p.mass_recall * w,
                        acc.2 + p.queries,
                    );
                }
            }
        }
        pb.inc(1);
    }
    let mut out = Vec::new();
    for ((name, c, sel), sum) in sels.iter().zip(&sums) {
        let per: Vec<Recall> = sum
            .iter()
            .map(|&(r, m, n)| {
                let w = if n > 0 { 1.0 / n as f64 } else { f64::NAN };
                Recall {
                    recall_at_k: r * w,
                    mass_recall: m * w,
                    queries: n,
                }
            })
            .collect();
        let loc = try_locality(sel, s, c, LOCALITY_TILE)?;
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
    }
    pb.finish_and_clear();
    let left_out = (skipped.iter())
        .map(|(name, e)| LeftOut {
            method: name.to_string(),
            reason: e.to_string(),
        })
        .collect();
    Ok((out, left_out))
}

/// `x * scale` with `prec` decimals, `NaN` for NaN (a counted figure of non-finite scores).
fn num(x: f64, scale: f64, prec: usize) -> String {
    if x.is_nan() {
        "NaN".into()
    } else {
        format!("{:.prec$}", x * scale)
    }
}

/// `x` as a percentage with `prec` decimals, `NaN` for NaN.
fn pct(x: f64, prec: usize) -> String {
    if x.is_nan() {
        "NaN".into()
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
            // (a recall is a ratio of counts: NaN only where the head counted no query)
            .map(|&(a, b)| match a.is_nan() {
                true => "-".into(),
                false => format!("{}/{}", num(a, 1.0, 3), num(b, 1.0, 3)),
            })
            .collect();
        // "-": no query counted; NaN: counted rows whose scores were not finite.
        let cell = |x: f64, prec| match r.queries {
            0 => "-".to_string(),
            _ => pct(x, prec),
        };
        s.push_str(&format!(
            "{:<14} {:>10} {:>12} {:>9} {:>9}   {}\n",
            r.method,
            cell(r.recall_at_k, 2),
            cell(r.mass_recall, 2),
            cell(r.sibling_fraction, 1),
            cell(r.tile_union, 1),
            per.join("  ")
        ));
    }
    if rows.iter().any(|r| r.queries > 0 && r.mass_recall.is_nan()) {
        s.push_str(
            "(NaN: the mass of rows whose scores are not finite, from inputs --allow-nonfinite let through)\n",
        );
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
    let (rows, left_out) = measure(&ctx, &l, &cfg, a.select.q_tile, a.device.storage.into())
        .map_err(|e| crate::args::top_k_note(e, &cfg, l.shape.k_len))
        .with_context(|| format!("{}: recall failed", l.source))?;
    if a.device.json {
        // The run's configuration as forward and decode record it, but for the scoring: null,
        // as every scoring is measured (one row of `methods` each).
        let mut j = l.run_json(
            &ctx.report().name,
            &cfg,
            a.device.storage.into(),
            serde_json::json!({ "methods": rows, "left_out": left_out }),
        );
        j["config"]["scoring"] = serde_json::Value::Null;
        crate::args::outln!("{}", serde_json::to_string_pretty(&j)?)?;
    } else {
        crate::args::outln!(
            "selection quality on {} ({}), C={} K={}:",
            l.source,
            crate::text::shape(&l.shape),
            a.select.block_size,
            a.select.top_k
        )?;
        crate::args::out!(
            "{}",
            table(
                &rows,
                a.select.top_k,
                "use more tokens or a smaller --top-k or --block-size"
            )
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pisa_core::TensorLayout;

    /// The oracle over ranges of queries gives the table of one oracle call: the same rows
    /// counted and, within f32 rounding of the masses, the same recalls, in both layouts,
    /// causal and not, with a last range shorter than the others; and the ranges are taken
    /// where one call's masses exceed the binding limit.
    #[test]
    fn recall_over_query_ranges_equals_one_oracle_call() {
        // A missing adapter fails the test (as the library's tests do), never skips it.
        let ctx = pisa_wgpu::Context::new(&pisa_wgpu::AdapterChoice::HighPerformance)
            .expect("a GPU adapter (install mesa-vulkan-drivers)");
        let (b, hq, hkv, n, d) = (2, 6, 2, 300, 32);
        let causal = SelectionConfig::new(16, 3).unwrap();
        let shape = AttentionShape::prefill(b, hq, hkv, n, d).unwrap();
        for (layout, cfg) in [
            (TensorLayout::Bhnd, causal),
            (TensorLayout::Bnhd, causal),
            (TensorLayout::Bnhd, causal.with_causal(false)),
        ] {
            let l = crate::cmd::embed::tests::loaded(shape, layout, 5);
            let storage = pisa_wgpu::Storage::F32;
            let (one, none) = measure_in_ranges(&ctx, &l, &cfg, 4, storage, n).unwrap();
            let (many, _) = measure_in_ranges(&ctx, &l, &cfg, 4, storage, 70).unwrap();
            assert_eq!((one.len(), none.len()), (4, 0));
            for (a, z) in one.iter().zip(&many) {
                let what = format!("{layout:?} causal {} {}", cfg.causal, a.method);
                assert!(a.queries > 0, "{what}");
                assert_eq!(a.queries, z.queries, "{what}");
                let near = |x: f64, y: f64| (x - y).abs() <= 1e-5;
                assert!(near(a.recall_at_k, z.recall_at_k), "{what}: {a:?} {z:?}");
                assert!(near(a.mass_recall, z.mass_recall), "{what}: {a:?} {z:?}");
                for (p, r) in a.per_kv_head.iter().zip(&z.per_kv_head) {
                    assert!(near(p.0, r.0) && near(p.1, r.1), "{what}: {a:?} {z:?}");
                }
                assert_eq!(a.sibling_fraction, z.sibling_fraction, "{what}");
            }
        }
        // One row of masses: B * Hkv * nb0 f32 = 2 * 2 * 19 * 4 bytes.
        let row = 2 * 2 * 19 * 4;
        let before = ctx.max_binding_bytes();
        assert_eq!(oracle_queries(&ctx, &shape, &causal), n);
        ctx.set_max_binding_bytes(row * 70 + 5);
        assert_eq!(oracle_queries(&ctx, &shape, &causal), 70);
        ctx.set_max_binding_bytes(before);
    }

    /// "-" marks a figure of no counted query, `NaN` a counted one of non-finite scores (a
    /// mass recall of inputs `--allow-nonfinite` let through), with a note. Regression: both
    /// printed "-", which the table's line says means nothing was counted, beside 136 counted
    /// rows.
    #[test]
    fn table_tells_nothing_counted_from_non_finite() {
        let row = |queries, mass: f64| MethodRecall {
            method: "pisa-lse".into(),
            recall_at_k: if queries == 0 { f64::NAN } else { 0.75 },
            mass_recall: mass,
            per_kv_head: match queries {
                0 => vec![(f64::NAN, f64::NAN); 2],
                _ => vec![(f64::NAN, f64::NAN), (0.75, mass)],
            },
            queries,
            sibling_fraction: if queries == 0 { f64::NAN } else { 0.5 },
            tile_union: if queries == 0 { f64::NAN } else { 0.25 },
        };
        let t = table(&[row(136, f64::NAN)], 4, "hint");
        let line = t.lines().nth(1).unwrap();
        assert!(line.contains("75.00%") && line.contains("NaN"), "{t}");
        assert!(line.contains("  -  0.750/NaN"), "{t}");
        assert!(
            t.contains("(NaN: the mass of rows whose scores are not finite"),
            "{t}"
        );
        let t = table(&[row(0, f64::NAN)], 4, "hint");
        let line = t.lines().nth(1).unwrap();
        assert!(
            !line.contains("NaN") && line.matches(" -").count() >= 4,
            "{t}"
        );
        assert!(!t.contains("(NaN:"), "{t}");
        let t = table(&[row(136, 0.5)], 4, "hint");
        assert!(!t.contains("NaN") && t.contains("50.00%"), "{t}");
    }
}
