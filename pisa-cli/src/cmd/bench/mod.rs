//! `pisa bench`: GPU-timed comparison of PISA against BSA and dense attention on the same
//! inputs, in one run; `--compare` sets several runs (adapters, vendors) side by side.
//!
//! This module drives the run (sizes, storages, records, progress, saving); the arguments and
//! their parsing are in `args.rs`, the measurements in [`measure`] and [`decode`], the results
//! in [`report`] and [`compare`].

mod args;
mod burst;
pub mod compare;
pub mod decode;
pub mod kernels;
pub mod measure;
pub mod params;
pub mod report;
pub mod warm;

use std::path::PathBuf;

use anyhow::{bail, Context as _, Result};
use pisa_core::SelectionConfig;
use pisa_wgpu::Storage;

use self::args::storages;
pub use self::args::{parse_sizes, BenchArgs};
use crate::args::{progress, DeviceArgs, StorageArg};
use report::{Record, Report};
use std::sync::Arc;

/// FLOPs of causal dense attention of `nq` queries, the last of `nk` positions (QK^T and PV
/// over the (query, key) pairs the mask keeps: half the square for a whole prompt).
fn dense_flops(hq: usize, nq: usize, nk: usize, d: usize) -> f64 {
    let (nq, nk) = (nq as f64, nk as f64);
    4.0 * hq as f64 * (nq * (nk - nq) + nq * nq / 2.0) * d as f64
}

/// The decode cache sizes when `--decode-sizes` is not given.
const DECODE_SIZES: &str = "64k,256k,1m";

/// Reads `--input` (its shape becomes the run's: one prefill size, no decode sizes, `--hq`,
/// `--hkv`, `--d` from the file, which clap keeps from being given with it), with the f16
/// range check where f16 is measured.
fn load_input(a: &mut BenchArgs, path: std::path::PathBuf) -> Result<Arc<measure::HostInputs>> {
    if path
        .extension()
        .is_none_or(|e| !e.eq_ignore_ascii_case("safetensors"))
    {
        crate::args::usage_bail!(
            "--input {}: bench reads Q, K and V from one .safetensors file",
            path.display()
        );
    }
    let input = crate::input::InputArgs {
        input: Some(path),
        k_file: None,
        v_file: None,
        q_name: None,
        k_name: None,
        v_name: None,
        layer: a.layer,
        tokens: a.tokens,
        layout: a.layout,
        allow_nonfinite: false,
        // bench has neither --allow-nonfinite nor --storage.
        advice: crate::input::InputAdvice {
            nonfinite: "",
            f16_range: "bench it with --storages f32",
        },
    };
    let f16 = storages(&a.storages)?.contains(&Storage::F16);
    let storage = if f16 {
        StorageArg::F16
    } else {
        StorageArg::F32
    };
    let l = input.load_for(storage, true)?;
    let s = l.shape;
    if s.batch != 1 {
        bail!(
            "--input {}: batch {}; bench takes one sequence",
            l.source,
            s.batch
        );
    }
    a.hq = s.q_heads;
    a.hkv = s.kv_heads;
    a.d = s.head_dim;
    a.sizes = s.k_len.to_string();
    if a.decode_sizes
        .as_deref()
        .is_some_and(|d| !d.trim().is_empty())
    {
        crate::args::usage_bail!(
            "--input times the prefill of the file only: leave out --decode-sizes (or give it empty)"
        );
    }
    a.decode_sizes = Some(String::new());
    Ok(Arc::new(measure::HostInputs {
        q: l.q,
        k: l.k,
        v: l.v,
    }))
}

/// Runs `pisa bench`.
pub fn run(mut a: BenchArgs) -> Result<()> {
    if a.plot.is_some() && a.compare.is_empty() {
        crate::args::usage_bail!(
            "--plot names the plot of --compare; a measuring run writes its plot beside --json"
        );
    }
    // clap waives `requires = "input"` when an option that conflicts with --input (--sizes) is
    // given, so these are checked here: a random-input run would ignore them silently.
    if a.input.is_none() && (a.layer.is_some() || a.tokens.is_some()) {
        crate::args::usage_bail!(
            "--layer and --tokens choose what to read of --input; without --input the bench runs \
             on random inputs of --sizes"
        );
    }
    if !a.compare.is_empty() {
        // (--tune is a global option, outside the conflicts of --compare with every option
        // that measures: it was accepted and ignored)
        if let Some(p) = crate::args::tune_pairs().first() {
            crate::args::usage_bail!(
                "--tune {p}: --compare prints saved runs and measures nothing; each file records \
                 the tuning it ran with"
            );
        }
        let mut reports: Vec<Report> = a
            .compare
            .iter()
            .map(|p| Report::load(p))
            .collect::<Result<_>>()?;
        // The plot only where --plot names it: comparing files writes nothing by itself (it
        // wrote compare.svg beside the first file, into whatever folder held it).
        let svg = match &a.plot {
            Some(p) if p.extension().is_none_or(|e| !e.eq_ignore_ascii_case("svg")) => {
                crate::args::usage_bail!(
                    "--plot {}: the plot is SVG; name the file *.svg",
                    p.display()
                );
            }
            _ => a.plot.clone(),
        };
        let inputs: Vec<&std::path::Path> = a.compare.iter().map(PathBuf::as_path).collect();
        compare::name_apart(&mut reports, &inputs);
        if let Some(svg) = &svg {
            crate::io::check_output_paths(std::slice::from_ref(svg), &inputs)?;
            args::check_plot_path(svg, "--plot")?;
        }
        crate::args::out!("{}", compare::compare(&reports))?;
        if let Some(svg) = svg {
            std::fs::write(&svg, compare::svg(&reports))
                .with_context(|| format!("{}: cannot write", svg.display()))?;
            crate::args::outln!("plot: {}", svg.display())?;
        }
        return Ok(());
    }
    let inputs = match a.input.clone() {
        Some(path) => Some(load_input(&mut a, path)?),
        None => None,
    };
    let sizes = parse_sizes(&a.sizes).context("--sizes")?;
    let decode_sizes =
        parse_sizes(a.decode_sizes.as_deref().unwrap_or(DECODE_SIZES)).context("--decode-sizes")?;
    if sizes.is_empty() && decode_sizes.is_empty() {
        crate::args::usage_bail!("--sizes and --decode-sizes are both empty: nothing to measure");
    }
    if a.hq == 0 {
        bail!("--hq must be at least 1");
    }
    if a.d == 0 {
        bail!("--d must be at least 1");
    }
    // The prefill's head dims, checked before the device opens: the decode sizes take them
    // too (their dense baseline runs the dense attention kernel, which refused D 20 size by
    // size after the device had opened).
    pisa_wgpu::check_head_dim(a.d).map_err(|e| match &a.input {
        Some(path) => anyhow::anyhow!("{}: {e}", path.display()),
        None if sizes.is_empty() => anyhow::anyhow!(
            "--d {} for the decode sizes (--decode-sizes, whose dense baseline takes the \
             prefill's head dims): {e}",
            a.d
        ),
        None => anyhow::anyhow!("--d {} for the prefill sizes (--sizes): {e}", a.d),
    })?;
    if a.q_tile == 0 {
        bail!("--q-tile must be at least 1");
    }
    if a.decode_burst == 0 {
        bail!("--decode-burst must be at least 1");
    }
    let most = pisa_wgpu::Profiler::MAX_PASSES as usize;
    if a.decode_burst > most {
        bail!("--decode-burst must be at most {most} (the timed passes of one query set)");
    }
    args::check_reps(a.reps, a.budget_s, a.warmup_ms)?;
    if a.decode_reps == 0 {
        bail!("--decode-reps must be at least 1");
    }
    let sts = storages(&a.storages)?;
    if let Some(path) = &a.json {
        args::check_json_path(path)?;
    }
    let dense_max = args::max_size(&a.dense_max, "--dense-max")?;
    let queries = match &a.queries {
        Some(q) if q.contains(',') => {
            crate::args::usage_bail!(
                "--queries {q}: takes one positive count (4k, 8192), not a list"
            )
        }
        Some(q) => match parse_sizes(q).context("--queries")?[..] {
            [q] if q > 0 => Some(q),
            _ => bail!("--queries takes one positive count (4k, 8192)"),
        },
        None => None,
    };
    let backward_max = args::max_size(&a.backward_max, "--backward-max")?;
    let cfg = SelectionConfig {
        block_size: a.block_size,
        top_k: a.top_k,
        scoring: a.scoring.into(),
        ..SelectionConfig::default()
    };
    cfg.validate().map_err(crate::args::selection_error)?;
    if a.hkv == 0 {
        bail!("--hkv must be at least 1");
    }
    if !a.hq.is_multiple_of(a.hkv) {
        bail!(
            "--hq {} must be a positive multiple of --hkv {}",
            a.hq,
            a.hkv
        );
    }
    let dev = DeviceArgs {
        adapter: a.adapter.clone(),
        storage: StorageArg::F32,
        json: false,
    };
    let ctx = dev.context()?;
    // (as forward, decode and recall warn over their inputs' keys)
    let most_keys = sizes.iter().chain(&decode_sizes).copied().max();
    crate::limits::warn_llvmpipe(&ctx, most_keys.unwrap_or(0));
    a.leaf_order.apply(&ctx);
    let warmup = warm::for_run(&ctx, a.warmup_ms)?;
    let r = ctx.report().clone();
    let mut out = Report {
        adapter: r.name.clone(),
        vendor: r.vendor,
        backend: r.backend.clone(),
        driver: format!("{} {}", r.driver, r.driver_info),
        // Lossy: an argument that is not UTF-8 (a path) is recorded with U+FFFD in its place.
        command: std::env::args_os()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" "),
        decode_burst: a.decode_burst,
        shape: String::new(),
        params: Some(params::Params::of(&a, &cfg, &ctx)),
        records: Vec::new(),
    };
    if let Some(p) = out.params.as_mut() {
        p.warmup_ms = warmup.as_ref().map(|w| w.ms());
    }
    out.shape = out
        .params
        .as_ref()
        .map(params::Params::line)
        .unwrap_or_default();
    // Which attention kernels ran: the tensor-core family applies to f16 attention only.
    let path_of = |st: Storage| match (ctx.kernel_path(), st) {
        (pisa_wgpu::KernelPath::CoopMat, Storage::F16) => {
            "coopmat attention and leaf scoring, portable routing".to_string()
        }
        _ => "portable".to_string(),
    };
    let pb = progress(
        (sts.len() * (sizes.len() + decode_sizes.len())) as u64,
        "bench",
    );
    for &st in &sts {
        if st == Storage::F16 && !ctx.has_f16() {
            eprintln!("skipping f16: {} has no SHADER_F16", r.name);
            continue;
        }
        let stn = crate::text::storage(st);
        // The BSA baseline and the backward pass do not read bf16 (typed errors): left out.
        let baselines = st != Storage::Bf16;
        let path = path_of(st);
        for &n in &sizes {
            let mut plan = measure::Plan {
                n,
                q_len: queries.map_or(n, |q| q.min(n)),
                hq: a.hq,
                hkv: a.hkv,
                d: a.d,
                cfg,
                storage: st,
                q_tile: a.q_tile,
                layout: a.layout.into(),
                dense: n <= dense_max,
                backward: n <= backward_max && baselines,
                baselines,
                reps: a.reps,
                budget_s: a.budget_s,
                burst: a.decode_burst,
                inputs: inputs.clone(),
                warmup: warmup.clone(),
            };
            pb.set_message(format!("prefill {stn} N={n}"));
            let (measured, skipped) =
                without_failing_rows(&mut plan, |p| measure::prefill(&ctx, p));
            if let Some((left, e)) = skipped {
                eprintln!("N={n} {stn}: {left} skipped: {e}");
            }
            let (t, reps, kernels) = match measured {
                Ok(x) => x,
                Err(e) => {
                    eprintln!("N={n} {stn}: skipped: {e:#}");
                    pb.inc(1);
                    continue;
                }
            };
            if t.untimed > 0 {
                eprintln!(
                    "warning: N={n} {stn}: {} passes past the profiler's {} went untimed: the \
                     stage times leave them out",
                    t.untimed,
                    pisa_wgpu::Profiler::MAX_PASSES
                );
            }
            let rec = |op: &str, ms: f64, tflops: Option<f64>| Record {
                op: op.into(),
                n,
                storage: stn.into(),
                ms,
                reps,
                gpu_timed: t.gpu,
                tflops,
                gbps: None,
                path: path.clone(),
                kernel: kernels.of(op),
            };
            let g = |s: &str| t.get(s);
            let before = out.records.len();
            // Stage 2 is one "leaf_select" dispatch (tile order) or the leaf-major order's
            // three timed parts, recorded apart as well.
            let leaf_parts = ["leaf_bucket", "leaf_score", "leaf_pick"];
            let leaf = g("leaf_select") + leaf_parts.iter().map(|s| g(s)).sum::<f64>();
            // Stage 1 is the routing dispatches, and the routing table's where it runs
            // (recorded apart as well).
            let route = g("route") + g("route_table");
            // Leaf-major attention, profiled, is timed as three parts, recorded apart as well.
            let attn_parts = pisa_wgpu::ops::attention::by_leaf::PARTS;
            let attn = t.attention();
            // A prompt whose queries select every leaf they see writes the selection in one
            // dispatch ("select_all") instead of routing and scoring.
            let sel = g("pyramid") + g("select_all") + route + leaf;
            let attn_flops = 4.0
                * a.hq as f64
                * plan.q_len as f64
                * (a.top_k * a.block_size).min(n) as f64
                * a.d as f64;
            if t.gpu {
                out.records.push(rec("pyramid", g("pyramid"), None));
                // (None where the selection was written in one dispatch: no route ran.)
                if !t.has("select_all") {
                    out.records.push(rec("route", route, None));
                    out.records.push(rec("leaf_select", leaf, None));
                }
                if g("route_table") > 0.0 {
                    out.records.push(rec("route_table", g("route_table"), None));
                }
                for s in leaf_parts.into_iter().filter(|s| g(s) > 0.0) {
                    out.records.push(rec(s, g(s), None));
                }
                if t.has("select_all") {
                    out.records.push(rec("select_all", g("select_all"), None));
                }
                out.records.push(rec("pisa_select", sel, None));
                if plan.baselines {
                    out.records
                        .push(rec("bsa_select", g("pyramid") + g("bsa"), None));
                }
                out.records.push(rec(
                    "attention",
                    attn,
                    Some(attn_flops / attn.max(1e-9) * 1e-9),
                ));
                for s in attn_parts.into_iter().filter(|s| g(s) > 0.0) {
                    out.records.push(rec(s, g(s), None));
                }
                out.records.push(rec("pisa_prefill", sel + attn, None));
                if plan.backward {
                    let f = 2.5 * attn_flops / g("backward").max(1e-9) * 1e-9;
                    out.records.push(rec("backward", g("backward"), Some(f)));
                }
                if plan.dense {
                    out.records.push(rec(
                        "dense",
                        g("dense"),
                        Some(dense_flops(a.hq, plan.q_len, n, a.d) / g("dense").max(1e-9) * 1e-9),
                    ));
                }
            } else {
                out.records.push(rec("all_wall", g("wall"), None));
            }
            progress_line(&out, before);
            if let Some(path) = &a.json {
                save(path, &out)?;
            }
            pb.inc(1);
        }
        for &n in &decode_sizes {
            pb.set_message(format!("decode {stn} cache={n}"));
            let plan = measure::Plan {
                n,
                q_len: 1,
                hq: a.hq,
                hkv: a.hkv,
                d: a.d,
                cfg,
                storage: st,
                q_tile: a.q_tile,
                layout: a.layout.into(),
                dense: true,
                backward: false,
                baselines: false,
                reps: a.decode_reps,
                budget_s: a.budget_s,
                burst: a.decode_burst,
                inputs: None,
                warmup: warmup.clone(),
            };
            match decode::decode(&ctx, &plan) {
                Ok(t) => {
                    let before = out.records.len();
                    let recs = report::decode_records(&t, n, (a.hkv, a.d), st, &path);
                    out.records.extend(recs);
                    progress_line(&out, before);
                    if let Some(path) = &a.json {
                        save(path, &out)?;
                    }
                }
                Err(e) => eprintln!("decode cache={n} {stn}: skipped: {e:#}"),
            }
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    if out.records.is_empty() {
        bail!("nothing was measured: every size was skipped (the reasons are above)");
    }
    crate::args::out!("{}", report::table(&out))?;
    if let Some(path) = &a.json {
        save(path, &out)?;
        crate::args::outln!(
            "wrote {} and {}",
            path.display(),
            path.with_extension("svg").display()
        )?;
    }
    Ok(())
}

/// Writes the report (atomically) and its plot; called after every size, so a run that is cut
/// short keeps what it measured.
fn save(path: &std::path::Path, out: &Report) -> Result<()> {
    let json = serde_json::to_string_pretty(out)?.into_bytes();
    crate::io::write_file_atomic(path, json)?;
    let svg = compare::svg(std::slice::from_ref(out)).into_bytes();
    crate::io::write_file_atomic(&path.with_extension("svg"), svg)?;
    Ok(())
}

/// One line per measured size on stderr, as the run goes (the table comes at the end).
fn progress_line(out: &Report, first_new: usize) {
    let line: Vec<String> = out.records[first_new..]
        .iter()
        .map(|r| format!("{} {:.4} ms", r.op, r.ms))
        .collect();
    if let Some(r) = out.records.get(first_new) {
        eprintln!("[{} N={}] {}", r.storage, r.n, line.join(", "));
    }
}

/// Measures `plan` with `measure`; where that fails and the plan has a dense baseline or a
/// backward pass that may be what cannot run here (past a driver's loop limit, a binding or
/// buffer limit), measures it again without the dense baseline, then without the backward
/// pass, then without both, so that the size keeps its PISA rows. Returns the measurement (the
/// first error when every try failed) and, on a later try's success, what it left out with the
/// first error's text.
fn without_failing_rows<T>(
    plan: &mut measure::Plan,
    mut measure: impl FnMut(&measure::Plan) -> Result<T>,
) -> (Result<T>, Option<(&'static str, String)>) {
    let first = measure(plan);
    let Err(e) = &first else {
        return (first, None);
    };
    let (dense, backward) = (plan.dense, plan.backward);
    let tries = [(false, backward), (dense, false), (false, false)];
    for (d, b) in tries.into_iter().filter(|&t| t != (dense, backward)) {
        (plan.dense, plan.backward) = (d, b);
        if let Ok(x) = measure(plan) {
            let left = match (dense && !d, backward && !b) {
                (true, true) => "dense baseline and backward pass",
                (true, false) => "dense baseline",
                _ => "backward pass",
            };
            return (Ok(x), Some((left, format!("{e:#}"))));
        }
    }
    (plan.dense, plan.backward) = (dense, backward);
    (first, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A size whose backward pass (or dense baseline) fails keeps its other rows: the
    /// backward pass's refusal had thrown away the whole size (`pisa bench --sizes 4k` on
    /// lavapipe: "nothing was measured") while a failing dense baseline was retried without.
    #[test]
    fn a_failing_baseline_or_backward_pass_leaves_the_other_rows() {
        let plan = |dense, backward| measure::Plan {
            n: 4096,
            q_len: 4096,
            hq: 8,
            hkv: 2,
            d: 64,
            cfg: pisa_core::SelectionConfig::default(),
            storage: pisa_wgpu::Storage::F16,
            q_tile: 4,
            layout: pisa_core::TensorLayout::Bhnd,
            dense,
            backward,
            baselines: true,
            reps: 1,
            budget_s: 0.0,
            burst: 1,
            inputs: None,
            warmup: None,
        };
        // (what fails, what is left out)
        for (fails_dense, fails_backward, left) in [
            (false, true, Some("backward pass")),
            (true, false, Some("dense baseline")),
            (true, true, Some("dense baseline and backward pass")),
            (false, false, None),
        ] {
            let mut p = plan(true, true);
            let (r, skipped) = without_failing_rows(&mut p, |p| {
                if (p.dense && fails_dense) || (p.backward && fails_backward) {
                    anyhow::bail!("limit")
                }
                Ok((p.dense, p.backward))
            });
            assert_eq!(skipped.as_ref().map(|s| s.0), left);
            let (d, b) = r.unwrap();
            assert_eq!((d, b), (!fails_dense, !fails_backward));
            assert_eq!((p.dense, p.backward), (d, b));
        }
        // A failure of PISA itself: the first error, the plan as it was.
        let mut p = plan(true, false);
        let (r, skipped) =
            without_failing_rows(&mut p, |_| -> Result<()> { anyhow::bail!("pisa") });
        assert_eq!(format!("{:#}", r.unwrap_err()), "pisa");
        assert!(skipped.is_none());
        assert!(p.dense && !p.backward);
    }
}
