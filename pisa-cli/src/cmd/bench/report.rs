//! Benchmark results: the JSON written by `pisa bench`, the printed table, `--compare` across
//! files (adapters, vendors), and a log-log SVG plot of time against N.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result};
use pisa_wgpu::Storage;
use serde::{Deserialize, Serialize};

use super::decode::DecodeTimes;

/// One measured quantity at one size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// What was timed: `pyramid`, `route` (with `route_table`, also recorded apart where the
    /// routing table runs), `leaf_select` (or, instead of both, `select_all`, where every
    /// query selects every leaf it sees), `pisa_select`, `bsa_select`,
    /// `attention` (leaf-major: also its parts `attention_bucket`, `attention_leaf`,
    /// `attention_merge`), `pisa_prefill`, `dense`, `backward`, `copy`; decode: `decode_pisa`,
    /// `decode_dense` (one isolated step per submission), `decode_route`, `decode_leaf`,
    /// `decode_merge` (its three dispatches timed apart), `decode_pisa_burst`,
    /// `decode_dense_burst` (ms per step of a burst of 10 back-to-back steps in one
    /// submission, timed first begin to last end, as the PyTorch peer times decode).
    pub op: String,
    /// Tokens (prefill length or KV-cache length).
    pub n: usize,
    /// `f32` or `f16`.
    pub storage: String,
    /// Median milliseconds over the repetitions.
    pub ms: f64,
    /// Repetitions behind the median.
    pub reps: usize,
    /// True when timed by GPU timestamps, false for wall-clock.
    pub gpu_timed: bool,
    /// Achieved TFLOP/s against the FLOPs counted for the op, if meaningful.
    pub tflops: Option<f64>,
    /// Achieved GB/s against the bytes counted for the op, if meaningful.
    pub gbps: Option<f64>,
    /// The kernel family in force for this storage: `portable`, or (f16 on a tensor-core
    /// context) `coopmat attention and leaf scoring, portable routing`. The attention kernel a
    /// record ran is [`Record::kernel`].
    pub path: String,
    /// The attention kernel that ran (`split-k`, `leaf-major-coopmat`, `leaf-major-portable`,
    /// `coop-tile`, `portable-tile`; see [`super::kernels`]) for `attention`, `dense`,
    /// `decode_dense` and `decode_dense_burst`; the PISA decode step's dispatches (`fused`,
    /// `one-dispatch`, `route-leaf+merge`, `route+leaf+merge`) for `decode_pisa` and
    /// `decode_pisa_burst`; absent for other ops and in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
}

/// A whole `pisa bench` run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Adapter name.
    pub adapter: String,
    /// PCI vendor id.
    pub vendor: u32,
    /// Backend (Vulkan, Metal, Dx12).
    pub backend: String,
    /// Driver and its version.
    pub driver: String,
    /// The command line.
    pub command: String,
    /// Shape parameters as a line of text: Hq, Hkv, D, C, top_k, g, scoring, Qtile, leaf
    /// order, kernel path.
    pub shape: String,
    /// The same parameters as numbers (absent in older files: [`super::params::params`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<super::params::Params>,
    /// Every measurement.
    pub records: Vec<Record>,
    /// Decode steps per burst (`--decode-burst`; files written before it existed used 10).
    #[serde(default = "default_burst")]
    pub decode_burst: usize,
}

fn default_burst() -> usize {
    super::decode::BURST
}

impl Report {
    /// Milliseconds of `op` at `n` in `storage`.
    pub fn ms(&self, op: &str, n: usize, storage: &str) -> Option<f64> {
        self.records
            .iter()
            .find(|r| r.op == op && r.n == n && r.storage == storage)
            .map(|r| r.ms)
    }

    /// Reads a report written by `pisa bench --json`. Errors: unreadable, not such a file, or
    /// a record whose time is negative, not finite or above a day, or whose N is 0, or two
    /// records of one (op, N, storage), which no run writes.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = crate::io::read_file(path)?;
        let s = String::from_utf8(bytes)
            .with_context(|| format!("{}: not a pisa bench JSON file", path.display()))?;
        let r: Report = serde_json::from_str(&s)
            .with_context(|| format!("{}: not a pisa bench JSON file", path.display()))?;
        if let Some(bad) = (r.records.iter()).find(|x| !(x.ms >= 0.0 && x.ms <= 86_400_000.0)) {
            anyhow::bail!(
                "{}: record {} at N {} has {} ms, not a time a run writes (finite, not negative, at most a day)",
                path.display(),
                bad.op,
                bad.n,
                crate::text::number(bad.ms)
            );
        }
        if let Some(bad) = r.records.iter().find(|x| x.n == 0) {
            anyhow::bail!(
                "{}: record {} has N 0, not a length a run writes (at least 1 token)",
                path.display(),
                bad.op
            );
        }
        // One record per (op, N, storage): a table cell shows one time, and a second record
        // of the same key was dropped without a word.
        let mut seen = std::collections::BTreeSet::new();
        if let Some(bad) = (r.records.iter()).find(|x| !seen.insert((&x.op, x.n, &x.storage))) {
            anyhow::bail!(
                "{}: record {} at N {} ({}) appears more than once, which no run writes",
                path.display(),
                bad.op,
                bad.n,
                bad.storage
            );
        }
        Ok(r)
    }
}

pub(super) fn cell(v: Option<f64>) -> String {
    match v {
        Some(x) if x >= 100.0 => format!("{x:.1}"),
        Some(x) if x >= 1.0 => format!("{x:.3}"),
        Some(x) => format!("{x:.4}"),
        None => "-".into(),
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".into(),
    }
}

/// The stages recorded in parts under the prefill table: selection stage 2 (leaf-major:
/// bucketing, scoring, pick) and sparse attention (leaf-major: bucketing, chunk kernel, merge),
/// for the lengths that have them.
fn parts_lines(s: &mut String, r: &Report, ns: &BTreeSet<usize>, st: &str) {
    let groups = [
        (
            "leaf",
            ["leaf_bucket", "leaf_score", "leaf_pick"],
            "bucketing / scoring / pick",
        ),
        (
            "attn",
            ["attention_bucket", "attention_leaf", "attention_merge"],
            "bucketing / chunk kernel / merge",
        ),
    ];
    for (name, ops, what) in groups {
        let rows: Vec<String> = ns
            .iter()
            .filter_map(|&n| {
                let v: Option<Vec<f64>> = ops.iter().map(|op| r.ms(op, n, st)).collect();
                v.map(|v| format!("{n}: {:.3} / {:.3} / {:.3}", v[0], v[1], v[2]))
            })
            .collect();
        if !rows.is_empty() {
            let _ = writeln!(s, "({name} = {what}, ms: {})", rows.join("; "));
        }
    }
}

/// The prefill and decode tables of one report.
pub fn table(r: &Report) -> String {
    let mut s = String::new();
    let timing = if r.records.iter().all(|x| x.gpu_timed) {
        "GPU timestamps"
    } else {
        "WALL-CLOCK (no timestamps on this adapter)"
    };
    let _ = writeln!(
        s,
        "{} ({}, {}), {}; times in ms, median, {timing}",
        r.adapter, r.backend, r.driver, r.shape
    );
    let storages: BTreeSet<&str> = r.records.iter().map(|x| x.storage.as_str()).collect();
    for st in storages {
        let ns: BTreeSet<usize> = r
            .records
            .iter()
            .filter(|x| x.storage == st && !x.op.starts_with("decode"))
            .map(|x| x.n)
            .collect();
        if !ns.is_empty() {
            let _ = writeln!(s, "\nprefill, {st} storage");
            let _ = writeln!(
                s,
                "{:>8} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8} {:>9} {:>10} {:>10} {:>8} {:>8}",
                "N",
                "pyramid",
                "route",
                "leaf",
                "PISA sel",
                "BSA sel",
                "BSA/PISA",
                "attn",
                "PISA pre",
                "dense",
                "dns/PISA",
                "TFLOP/s"
            );
            // Sizes whose every query keeps every leaf it sees (at most top_k x C tokens: the
            // prefill ran its `select_all` pass instead of the route and leaf stages): no
            // selection to set BSA's scoring against, so no ratio.
            let mut all_kept = Vec::new();
            for &n in &ns {
                let g = |op: &str| r.ms(op, n, st);
                let keeps_all = g("select_all").is_some();
                if keeps_all {
                    all_kept.push(n);
                }
                let tf = r
                    .records
                    .iter()
                    .find(|x| x.op == "dense" && x.n == n && x.storage == st)
                    .and_then(|x| x.tflops);
                let _ = writeln!(
                    s,
                    "{:>8} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8} {:>9} {:>10} {:>10} {:>8} {:>8}",
                    n,
                    cell(g("pyramid")),
                    cell(g("route")),
                    cell(g("leaf_select")),
                    cell(g("pisa_select")),
                    cell(g("bsa_select")),
                    if keeps_all {
                        "-".to_string()
                    } else {
                        ratio(g("bsa_select"), g("pisa_select"))
                    },
                    cell(g("attention")),
                    cell(g("pisa_prefill")),
                    cell(g("dense")),
                    ratio(g("dense"), g("pisa_prefill")),
                    tf.map_or("-".into(), |t| format!("{t:.1}")),
                );
            }
            if !all_kept.is_empty() {
                let list: Vec<String> = all_kept.iter().map(|n| n.to_string()).collect();
                let _ = writeln!(
                    s,
                    "(N = {}: every query keeps every leaf it sees (N <= top_k x C), so PISA \
                     selects nothing and BSA/PISA is not given)",
                    list.join(", ")
                );
            }
            parts_lines(&mut s, r, &ns, st);
        }
        let bw: Vec<&Record> = r
            .records
            .iter()
            .filter(|x| x.storage == st && x.op == "backward")
            .collect();
        if !bw.is_empty() {
            let _ = writeln!(
                s,
                "\nbackward (dQ, dK, dV through the selected blocks), {st} storage"
            );
            let _ = writeln!(s, "{:>8} {:>12} {:>10}", "N", "ms", "TFLOP/s");
            for x in bw {
                let _ = writeln!(
                    s,
                    "{:>8} {:>12} {:>10}",
                    x.n,
                    cell(Some(x.ms)),
                    x.tflops.map_or("-".into(), |t| format!("{t:.2}"))
                );
            }
        }
        let ds: BTreeSet<usize> = r
            .records
            .iter()
            .filter(|x| x.storage == st && x.op.starts_with("decode"))
            .map(|x| x.n)
            .collect();
        if !ds.is_empty() {
            let _ = writeln!(s, "\ndecode step (all heads, batch 1), {st} storage");
            let _ = writeln!(
                s,
                "{:>8} {:>12} {:>12} {:>10} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10}",
                "cache",
                "PISA ms",
                "dense ms",
                "dns/PISA",
                "PISA burst",
                "dense burst",
                "dns/PISA",
                "route",
                "leaf",
                "merge"
            );
            for &n in &ds {
                let g = |op| r.ms(op, n, st);
                let (p, d) = (g("decode_pisa"), g("decode_dense"));
                let (pb, db) = (g("decode_pisa_burst"), g("decode_dense_burst"));
                let _ = writeln!(
                    s,
                    "{:>8} {:>12} {:>12} {:>10} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10}",
                    n,
                    cell(p),
                    cell(d),
                    ratio(d, p),
                    cell(pb),
                    cell(db),
                    ratio(db, pb),
                    cell(g("decode_route")),
                    cell(g("decode_leaf")),
                    cell(g("decode_merge"))
                );
            }
            // Caches of at most top_k x C tokens: a decoded token keeps every leaf it sees,
            // as the prefill's sizes noted above (files without parameters: no note).
            let all_kept: Vec<String> = (r.params.as_ref())
                .map(|p| p.top_k.saturating_mul(p.block_size))
                .map(|most| {
                    ds.iter()
                        .filter(|&&n| n <= most)
                        .map(|n| n.to_string())
                        .collect()
                })
                .unwrap_or_default();
            if !all_kept.is_empty() {
                let _ = writeln!(
                    s,
                    "(cache {}: a decoded token keeps every leaf it sees (cache <= top_k x C), so \
                     PISA selects nothing there)",
                    all_kept.join(", ")
                );
            }
            let b = r.decode_burst;
            // Where the route and the leaf slots run as one dispatch (the default on NVIDIA),
            // there is no leaf pass: its column is empty and `route` times both.
            let fused = ds.iter().any(|&n| {
                r.ms("decode_route", n, st).is_some() && r.ms("decode_leaf", n, st).is_none()
            });
            // A fused step (decode_fused) runs none of the passes timed apart: they are the
            // split step's, recorded by stage for the parts.
            let step_fused = r.records.iter().any(|x| {
                x.storage == st
                    && x.op == "decode_pisa"
                    && x.kernel.as_deref().is_some_and(|k| {
                        k.split(", ")
                            .any(|n| n == pisa_wgpu::DecodeStep::Fused.name())
                    })
            });
            let passes = if step_fused {
                "route / leaf / merge: the split step's dispatches timed as separate passes, \
                 for its parts;\n the step itself runs fused (decode_fused: one dispatch, one \
                 workgroup per KV head)"
            } else if fused {
                "route / merge: the step's parts timed as separate passes (route and leaf \
                 slots\n run as one dispatch, timed as route: no leaf pass; merge as its own \
                 dispatch,\n which the step itself may run in that dispatch's last \
                 workgroups: decode_merge_in_route)"
            } else {
                "route / leaf / merge: the step's three dispatches timed as separate passes"
            };
            let _ = writeln!(
                s,
                "(PISA / dense ms: one isolated step per submission; burst: ms per step of {b} \
                 back-to-back steps\n in one submission, first begin to last end / {b}, as the \
                 PyTorch peer times decode;\n {passes})"
            );
        }
        if let Some(line) = super::kernels::note(r, st) {
            let _ = writeln!(s, "{line}");
        }
    }
    s
}

/// The records of one decode measurement ([`super::decode::decode`]) at cache length `n`: `decode_route`, `decode_leaf`,
/// `decode_merge` (GPU timestamps only), `decode_pisa`, `decode_dense`, `decode_pisa_burst`,
/// `decode_dense_burst` (ms per step); the dense ones with GB/s against reading K and V of
/// `hkv` heads of dimension `d` once.
pub fn decode_records(
    t: &DecodeTimes,
    n: usize,
    (hkv, d): (usize, usize),
    st: Storage,
    path: &str,
) -> Vec<Record> {
    let bytes = 2.0 * (hkv * n * d) as f64 * st.bytes() as f64;
    let stn = crate::text::storage(st);
    let gbps = |ms: f64| Some(bytes / ms.max(1e-9) * 1e-6);
    let staged = ["decode_route", "decode_leaf", "decode_merge"]
        .into_iter()
        .zip(t.stages.unwrap_or_default())
        .filter(|_| t.stages.is_some())
        // (a stage with no pass of its own, e.g. `leaf` run inside the route's dispatch: none)
        .filter(|&(_, ms)| ms > 0.0)
        .map(|(op, ms)| (op, ms, None));
    staged
        .chain([
            ("decode_pisa", t.pisa, None),
            ("decode_dense", t.dense, gbps(t.dense)),
            ("decode_pisa_burst", t.pisa_burst, None),
            ("decode_dense_burst", t.dense_burst, gbps(t.dense_burst)),
        ])
        .map(|(op, ms, gbps)| Record {
            op: op.into(),
            n,
            storage: stn.into(),
            ms,
            reps: t.reps,
            gpu_timed: t.gpu,
            tflops: None,
            gbps,
            path: path.into(),
            kernel: match op {
                "decode_dense" | "decode_dense_burst" => t.dense_kernel.clone(),
                "decode_pisa" | "decode_pisa_burst" => t.pisa_step.clone(),
                _ => None,
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts lines under the prefill table, from a report `pisa bench` wrote on the H200
    /// (docs/runs): both groups, every length, the parts' own times.
    #[test]
    fn table_lists_the_parts_of_the_leaf_major_stages() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/runs/h200-2026-12-02q2-bench.json");
        let r = Report::load(&path).unwrap();
        let t = table(&r);
        let leaf = t.lines().find(|l| l.starts_with("(leaf = ")).expect(&t);
        let attn = t.lines().find(|l| l.starts_with("(attn = ")).expect(&t);
        for n in ["65536", "131072", "262144"] {
            assert!(leaf.contains(n) && attn.contains(n), "{t}");
        }
        assert!(attn.contains("65536: 2.058 / 17.646 / 2.732"), "{attn}");
        assert!(leaf.contains("262144: 6.511 / 61.000 / 4.122"), "{leaf}");
    }

    /// Where the route and the leaf slots ran as one dispatch (no `decode_leaf` record, the
    /// default on NVIDIA), the footnote says that `route` times both: the empty leaf column
    /// was left unexplained under "the step's three dispatches".
    #[test]
    fn the_decode_footnote_names_the_dispatches_that_ran() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/runs/h100-2026-12-07y5-bench.json");
        let r = Report::load(&path).unwrap();
        assert!(r.ms("decode_route", 1 << 20, "f16").is_some());
        assert!(r.ms("decode_leaf", 1 << 20, "f16").is_none());
        let t = table(&r);
        assert!(
            t.contains("route and leaf slots") && !t.contains("three dispatches"),
            "{t}"
        );
        let mut three = r.clone();
        let mut leaf = (three.records.iter())
            .find(|x| x.op == "decode_route")
            .unwrap()
            .clone();
        leaf.op = "decode_leaf".into();
        three.records.push(leaf);
        let t = table(&three);
        assert!(
            t.contains("three dispatches") && !t.contains("route and leaf slots"),
            "{t}"
        );
        // A fused step's parts are the split step's passes, whatever they were.
        assert!(!t.contains("runs fused"), "{t}");
        let mut fused = three.clone();
        for x in fused.records.iter_mut().filter(|x| x.op == "decode_pisa") {
            x.kernel = Some(pisa_wgpu::DecodeStep::Fused.name().into());
        }
        let t = table(&fused);
        assert!(
            t.contains("runs fused") && !t.contains("three dispatches timed"),
            "{t}"
        );
    }
}
