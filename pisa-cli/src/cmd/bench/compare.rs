//! Reports side by side: `pisa bench --compare` (one table, a column per report named by
//! adapter and kernel path) and the log-log SVG plot of time against N (also written beside
//! every `--json` report).

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::params::params;
use super::report::{cell, Report};

/// `name` cut to at most `most` characters, never inside a parenthesis it opens.
fn shorten(name: &str, most: usize) -> String {
    if name.chars().count() <= most {
        return name.to_string();
    }
    let cut: String = name.chars().take(most).collect();
    let cut = match (cut.rfind('('), cut.rfind(')')) {
        (Some(o), c) if c.is_none_or(|c| c < o) => cut[..o].to_string(),
        _ => cut,
    };
    cut.trim_end().to_string()
}

/// A report's column / series label (at most 32 characters): the adapter, the backend (`vk`,
/// `gl`, `webgpu`, `metal`, `dx12`) and the kernel path that ran (`portable`, `coopmat`), so
/// runs of one GPU through two backends or on both paths stay apart.
pub fn label(r: &Report) -> String {
    // The adapter's name in `budget` characters: whole where it fits, else without its vendor
    // word before it is cut.
    let fit = |budget: usize| match r.adapter.chars().count() <= budget {
        true => r.adapter.clone(),
        false => shorten(&without_vendor(&r.adapter), budget),
    };
    let backend = match r.backend.as_str() {
        "Vulkan" => "vk",
        "Gl" => "gl",
        "BrowserWebGpu" => "webgpu",
        "Metal" => "metal",
        "Dx12" => "dx12",
        _ => "",
    };
    let path = match &r.params {
        Some(p) => Some(p.kernel_path.as_str()),
        None => r
            .shape
            .split("kernel path ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next()),
    };
    match path {
        Some(p) => {
            let p = shorten(p, 12);
            let p = if backend.is_empty() {
                p
            } else {
                format!("{backend} {p}")
            };
            format!("{} ({p})", fit(32 - p.len() - 3))
        }
        None if !backend.is_empty() => format!("{} ({backend})", fit(24 - backend.len() - 3)),
        None => fit(32),
    }
}

/// `name` without a leading vendor word (`NVIDIA`, `AMD`, `Intel(R)`, `Apple`), also after
/// a `name_apart` prefix (`07v1: NVIDIA H100 80GB HBM3` gives `07v1: H100 80GB HBM3`): the
/// label's 32 characters cut the model off after it (`NVIDIA H` for an H100 and an H200 alike).
fn without_vendor(name: &str) -> String {
    let (prefix, rest) = match name.split_once(": ") {
        Some((p, r)) => (format!("{p}: "), r),
        None => (String::new(), name),
    };
    for vendor in ["NVIDIA ", "AMD ", "Intel(R) ", "Apple "] {
        if let Some(model) = rest.strip_prefix(vendor) {
            if !model.trim().is_empty() {
                return format!("{prefix}{model}");
            }
        }
    }
    name.to_string()
}

/// Where two reports would get the same [`label`] (runs of one adapter and path), prefixes each
/// such report's adapter name with the part of its file's stem that differs from the others'
/// (`h100-2026-12-05f3-bench` and `h100-2026-12-06r4-bench` give `05f3` and `06r4`: the label's
/// 32 characters would cut a whole stem before it differs), so columns and plot lines stay
/// apart; where labels still clash (files of one name in two folders), by the report's place
/// in the list (`#1`, `#2`, ...).
pub fn name_apart(reports: &mut [Report], files: &[&std::path::Path]) {
    let clashing = |reports: &[Report]| -> Vec<bool> {
        let labels: Vec<String> = reports.iter().map(label).collect();
        (0..labels.len())
            .map(|i| (0..labels.len()).any(|j| j != i && labels[j] == labels[i]))
            .collect()
    };
    let rename = clashing(reports);
    let stems: Vec<String> = files
        .iter()
        .zip(&rename)
        .filter(|(_, &r)| r)
        .map(|(f, _)| {
            f.file_stem()
                .map_or(String::new(), |s| s.to_string_lossy().into())
        })
        .collect();
    let mut parts = distinct_parts(&stems).into_iter();
    for (r, rename) in reports.iter_mut().zip(&rename) {
        if *rename {
            let part = parts.next().unwrap_or_default();
            r.adapter = format!("{part}: {}", r.adapter);
        }
    }
    let still = clashing(reports);
    for (i, (r, still)) in reports.iter_mut().zip(still).enumerate() {
        if still {
            r.adapter = format!("#{} {}", i + 1, r.adapter);
        }
    }
}

/// Each of `stems` without the prefix and suffix all of them share, cut at a separator (`-`,
/// `_`, `.`, space) so that a date or a name is not split; a stem left empty stays whole.
fn distinct_parts(stems: &[String]) -> Vec<String> {
    let chars: Vec<Vec<char>> = stems.iter().map(|s| s.chars().collect()).collect();
    let shortest = chars.iter().map(Vec::len).min().unwrap_or(0);
    let common = |at: &dyn Fn(&Vec<char>, usize) -> char| {
        (0..shortest)
            .take_while(|&i| chars.iter().all(|c| at(c, i) == at(&chars[0], i)))
            .count()
    };
    let sep = |c: char| matches!(c, '-' | '_' | '.' | ' ');
    let front = |c: &Vec<char>, i: usize| c[i];
    let back = |c: &Vec<char>, i: usize| c[c.len() - 1 - i];
    let (mut pre, mut suf) = (common(&front), common(&back));
    if chars.len() < 2 {
        (pre, suf) = (0, 0);
    }
    // Back to just after the last separator of the shared prefix (before the first of the
    // shared suffix).
    if let Some(c) = chars.first() {
        pre = (0..pre).rev().find(|&i| sep(c[i])).map_or(0, |i| i + 1);
        suf = (0..suf)
            .rev()
            .find(|&i| sep(c[c.len() - 1 - i]))
            .map_or(0, |i| i + 1);
    }
    chars
        .iter()
        .zip(stems)
        .map(|(c, stem)| {
            let end = c.len().saturating_sub(suf);
            if pre >= end {
                return stem.clone();
            }
            let part: String = c[pre..end].iter().collect();
            let part = part.trim_matches(sep).to_string();
            if part.is_empty() {
                stem.clone()
            } else {
                part
            }
        })
        .collect()
}

/// Writes to `s` a note naming each report's `describe` where they are not all the same: "note:
/// the runs differ in {what} (label: description; ...)".
fn note_where_they_differ(
    s: &mut String,
    reports: &[Report],
    what: &str,
    describe: impl Fn(&Report) -> String,
) {
    let each: Vec<String> = reports.iter().map(describe).collect();
    if each.iter().all(|d| *d == each[0]) {
        return;
    }
    let named: Vec<String> = reports
        .iter()
        .zip(&each)
        .map(|(r, d)| format!("{}: {d}", label(r)))
        .collect();
    let _ = writeln!(s, "note: the runs differ in {what} ({})", named.join("; "));
}

/// One table of every (op, N, storage) across several reports, a column per report
/// ([`label`]); a line first when the reports differ in Hq, Hkv, D, C or top_k, and a line
/// that says so where no report has a timed result.
pub fn compare(reports: &[Report]) -> String {
    let mut keys: Vec<(String, usize, String)> = Vec::new();
    for r in reports {
        for x in &r.records {
            let k = (x.op.clone(), x.n, x.storage.clone());
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    let mut s = String::new();
    let ps: Vec<Option<[usize; 5]>> = reports.iter().map(params).collect();
    if ps.iter().any(|p| *p != ps[0]) {
        let each: Vec<String> = reports
            .iter()
            .zip(&ps)
            .map(|(r, p)| match p {
                Some([hq, hkv, d, c, k]) => {
                    format!("{}: Hq {hq}, Hkv {hkv}, D {d}, C {c}, top_k {k}", label(r))
                }
                None => format!("{}: unknown", label(r)),
            })
            .collect();
        let _ = writeln!(
            s,
            "note: the runs differ in Hq/Hkv/D/C/top_k ({})",
            each.join("; ")
        );
    }
    // The prefill's layout and inputs (files of before they were recorded: BHND, random), and
    // its queries where `--queries` set them.
    let how = |r: &Report| match &r.params {
        Some(p) => {
            let q = p
                .queries
                .map_or(String::new(), |q| format!(", the last {q} queries"));
            format!("layout {}, inputs {}{q}", p.layout_name(), p.input_name())
        }
        None => "layout bhnd, inputs random".to_string(),
    };
    note_where_they_differ(
        &mut s,
        reports,
        "the prefill's layout, inputs or queries",
        how,
    );
    // How each run measured: scoring, leaf order, kernel path, shader checks and tuning, the
    // GPU warm-up (none in files of before it existed) and the decode burst; the times of runs
    // that differ here are not the same measurement (the warm-up alone changed some 1.2 to 4.6
    // times, docs/benchmarks.md A.77).
    let measured = |r: &Report| {
        let burst = format!("decode burst {}", r.decode_burst);
        match &r.params {
            Some(p) => {
                let tuning = match p.tuning.is_empty() {
                    true => String::new(),
                    false => format!(", tuning {}", p.tuning.join(" ")),
                };
                let warm = p
                    .warmup_ms
                    .map_or("no warm-up".to_string(), |ms| format!("warm-up {ms:.1} ms"));
                format!(
                    "{}, leaf order {}, kernel path {}, checks {}{tuning}, {warm}, {burst}",
                    p.scoring,
                    p.leaf_order,
                    p.kernel_path,
                    if p.shader_checks.is_empty() {
                        "unrecorded"
                    } else {
                        &p.shader_checks
                    }
                )
            }
            None => format!("unrecorded, {burst}"),
        }
    };
    let what = "scoring, kernels, tuning, warm-up or decode burst";
    note_where_they_differ(&mut s, reports, what, measured);
    let labels: Vec<String> = reports.iter().map(label).collect();
    let w = labels
        .iter()
        .map(|l| l.chars().count())
        .max()
        .unwrap_or(0)
        .max(9);
    let ow = keys.iter().map(|k| k.0.len()).max().unwrap_or(0).max(14);
    s.push_str("times in ms (each run's median; st: storage)\n");
    let _ = write!(s, "{:<ow$} {:>8} {:>5}", "op", "N", "st");
    for l in &labels {
        let _ = write!(s, " {l:>w$}");
    }
    s.push('\n');
    if keys.is_empty() {
        s.push_str("(no timed results in these reports: they measured no size)\n");
    }
    for (op, n, st) in keys {
        let _ = write!(s, "{op:<ow$} {n:>8} {st:>5}");
        for r in reports {
            let _ = write!(s, " {:>w$}", cell(r.ms(&op, n, &st)));
        }
        s.push('\n');
    }
    s
}

/// A log-log SVG of ms against N: one line per (adapter, op, storage) for the prefill ops.
pub fn svg(reports: &[Report]) -> String {
    let ops = [
        "pisa_select",
        "bsa_select",
        "pisa_prefill",
        "dense",
        "decode_pisa",
        "decode_dense",
    ];
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in reports {
        let st: BTreeSet<&str> = r.records.iter().map(|x| x.storage.as_str()).collect();
        for s in st {
            for op in ops {
                let mut pts: Vec<(f64, f64)> = r
                    .records
                    .iter()
                    // (log axes: only positive, finite values; Report::load refuses others)
                    .filter(|x| x.op == op && x.storage == s && x.n > 0)
                    .filter(|x| x.ms > 0.0 && x.ms.is_finite())
                    .map(|x| (x.n as f64, x.ms))
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                if !pts.is_empty() {
                    series.push((format!("{} {op} {s}", label(r)), pts));
                }
            }
        }
    }
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
    let (w, h, m) = (900.0, 560.0, 70.0);
    if all.is_empty() {
        return format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='14'>\n<rect width='100%' height='100%' fill='white'/>\n<text x='{m}' y='40'>pisa bench: no timed results to plot</text>\n</svg>\n");
    }
    // The legend, right of the plot, one 16-pixel line per series: the canvas grows to hold
    // it (35 series ran past a fixed 560 x 900 canvas), about 7 pixels a character.
    let chars = series
        .iter()
        .map(|x| x.0.chars().count())
        .max()
        .unwrap_or(0);
    let w = (w - 265.0 + 7.0 * chars as f64 + 10.0).max(w);
    let h = (m + 16.0 * series.len() as f64 + 10.0).max(h);
    let plot_w = 900.0 - 2.0 * m - 220.0;
    let lx = |v: f64| v.log10();
    let (x0, x1) = all.iter().fold((f64::MAX, f64::MIN), |a, p| {
        (a.0.min(lx(p.0)), a.1.max(lx(p.0)))
    });
    let (y0, y1) = all.iter().fold((f64::MAX, f64::MIN), |a, p| {
        (a.0.min(lx(p.1)), a.1.max(lx(p.1)))
    });
    let (x0, x1) = (x0.floor(), x1.ceil().max(x0.floor() + 1.0));
    let (y0, y1) = (y0.floor(), y1.ceil().max(y0.floor() + 1.0));
    let px = |v: f64| m + (lx(v) - x0) / (x1 - x0) * plot_w;
    let py = |v: f64| h - m - (lx(v) - y0) / (y1 - y0) * (h - 2.0 * m);
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
        "#bcbd22", "#17becf",
    ];
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n");
    let _ = writeln!(s, "<text x='{}' y='20' font-size='14'>pisa bench: GPU time (ms) against tokens N, log-log</text>", m);
    for e in (x0 as i32)..=(x1 as i32) {
        let x = px(10f64.powi(e));
        let _ = writeln!(s, "<line x1='{x}' y1='{}' x2='{x}' y2='{}' stroke='#ddd'/><text x='{x}' y='{}' text-anchor='middle'>1e{e}</text>", m, h - m, h - m + 16.0);
    }
    for e in (y0 as i32)..=(y1 as i32) {
        let y = py(10f64.powi(e));
        let _ = writeln!(s, "<line x1='{m}' y1='{y}' x2='{}' y2='{y}' stroke='#ddd'/><text x='{}' y='{}' text-anchor='end'>1e{e} ms</text>", m + plot_w, m - 4.0, y + 4.0);
    }
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|p| format!("{:.1},{:.1}", px(p.0), py(p.1)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill='none' stroke='{c}' stroke-width='2' points='{}'/>",
            path.join(" ")
        );
        for p in pts {
            let _ = writeln!(
                s,
                "<circle cx='{:.1}' cy='{:.1}' r='3' fill='{c}'/>",
                px(p.0),
                py(p.1)
            );
        }
        let ly = m + 16.0 * i as f64;
        let _ = writeln!(
            s,
            "<rect x='{}' y='{}' width='10' height='10' fill='{c}'/><text x='{}' y='{}'>{}</text>",
            m + plot_w + 10.0,
            ly - 9.0,
            m + plot_w + 25.0,
            ly,
            xml(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::{compare, label, name_apart, Report};
    use crate::cmd::bench::params;
    use crate::cmd::bench::report::Record;

    /// The parameters of `pisa bench`'s default shapes in `layout`, on the portable path.
    fn params_of(layout: &str) -> params::Params {
        params::Params {
            hq: 32,
            hkv: 8,
            d: 128,
            block_size: 64,
            top_k: 16,
            merge_factor: 2,
            scoring: "lse".into(),
            q_tile: 4,
            layout: layout.into(),
            leaf_order: "auto".into(),
            input: "random".into(),
            kernel_path: "portable".into(),
            shader_checks: String::new(),
            tuning: Vec::new(),
            queries: None,
            warmup_ms: None,
        }
    }

    fn report(adapter: &str, shape: &str) -> Report {
        Report {
            adapter: adapter.into(),
            vendor: 0,
            backend: "Vulkan".into(),
            driver: String::new(),
            command: String::new(),
            shape: shape.into(),
            params: None,
            records: Vec::new(),
            decode_burst: 10,
        }
    }

    #[test]
    fn labels_name_the_kernel_path() {
        let shape =
            |p: &str| format!("Hq=32 Hkv=8 D=128 C=64 K=16 g=2 Lse Qtile=4, kernel path {p} (x)");
        assert_eq!(
            label(&report("NVIDIA H200", &shape("coopmat"))),
            "NVIDIA H200 (vk coopmat)"
        );
        assert_eq!(
            label(&report("NVIDIA H200", &shape("portable"))),
            "NVIDIA H200 (vk portable)"
        );
        assert_eq!(label(&report("llvmpipe", "Hq=8")), "llvmpipe (vk)");
        let mut gl = report("llvmpipe", &shape("portable"));
        gl.backend = "Gl".into();
        assert_eq!(label(&gl), "llvmpipe (gl portable)");
        let long = label(&report(
            "AMD Radeon RX 7900 XTX (RADV NAVI31)",
            &shape("portable"),
        ));
        assert!(
            long.len() <= 32 && long.ends_with("(vk portable)"),
            "{long}"
        );
    }

    #[test]
    fn runs_of_one_adapter_are_named_by_their_files() {
        let shape = "Hq=32 Hkv=8 D=128 C=64 K=16 g=2 Lse Qtile=4, kernel path coopmat (x)";
        let mut rs = vec![
            report("NVIDIA H200", shape),
            report("NVIDIA H200", shape),
            report("llvmpipe", shape),
        ];
        let files = [
            std::path::Path::new("runs/before.json"),
            std::path::Path::new("after.json"),
            std::path::Path::new("cpu.json"),
        ];
        name_apart(&mut rs, &files);
        let labels: Vec<String> = rs.iter().map(label).collect();
        assert!(labels[0].starts_with("before: NVIDIA"), "{labels:?}");
        assert!(labels[1].starts_with("after: NVIDIA"), "{labels:?}");
        assert_ne!(labels[0], labels[1]);
        assert_eq!(labels[2], "llvmpipe (vk coopmat)");
    }

    /// Regression: stems that differ only past the label's 32 characters (dated runs of one
    /// GPU) gave columns of one name; each keeps the part of its stem that differs, and files
    /// of one name in two folders are told apart by their place in the list.
    #[test]
    fn dated_runs_of_one_adapter_get_labels_that_differ() {
        let shape = "Hq=32 Hkv=8 D=128 C=64 K=16 g=2 Lse Qtile=4, kernel path coopmat+nv-cm2 (x)";
        let mut rs = vec![
            report("NVIDIA H100 80GB HBM3", shape),
            report("NVIDIA H100 80GB HBM3", shape),
            report("NVIDIA H100 80GB HBM3", shape),
        ];
        let files = [
            std::path::Path::new("docs/runs/h100-2026-12-05f3-bench.json"),
            std::path::Path::new("docs/runs/h100-2026-12-06r4-bench.json"),
            std::path::Path::new("docs/runs/h100-2026-12-06r5-bench.json"),
        ];
        name_apart(&mut rs, &files);
        let labels: Vec<String> = rs.iter().map(label).collect();
        // (the vendor word dropped where the name is cut: "05f3: NVIDIA H" named no GPU model)
        assert!(labels[0].starts_with("05f3: H100"), "{labels:?}");
        assert!(labels[1].starts_with("06r4: H100"), "{labels:?}");
        assert!(labels[2].starts_with("06r5: H100"), "{labels:?}");
        assert!(labels.iter().all(|l| l.chars().count() <= 32), "{labels:?}");
        let mut same = vec![report("llvmpipe", shape), report("llvmpipe", shape)];
        let files = [
            std::path::Path::new("a/run.json"),
            std::path::Path::new("b/run.json"),
        ];
        name_apart(&mut same, &files);
        let labels: Vec<String> = same.iter().map(label).collect();
        assert_ne!(labels[0], labels[1], "{labels:?}");
        assert!(labels[0].starts_with("#1 "), "{labels:?}");
    }

    /// Runs that measured differently (the GPU warm-up, the decode burst, the kernel path or
    /// tuning) get a note naming each run's; they printed side by side without one.
    #[test]
    fn runs_measured_differently_get_a_note() {
        let p = params::Params {
            kernel_path: "coopmat+nv-cm2".into(),
            shader_checks: "driver_bounded".into(),
            ..params_of("bhnd")
        };
        let mut a = report("NVIDIA H100 80GB HBM3", "");
        a.params = Some(p.clone());
        let mut b = a.clone();
        assert!(!compare(&[a.clone(), b.clone()]).contains("note:"));
        b.params.as_mut().unwrap().warmup_ms = Some(5.6);
        let t = compare(&[a.clone(), b.clone()]);
        assert!(
            t.contains(
                "note: the runs differ in scoring, kernels, tuning, warm-up or decode burst"
            ) && t.contains("no warm-up")
                && t.contains("warm-up 5.6 ms"),
            "{t}"
        );
        let mut c = a.clone();
        c.decode_burst = 1;
        assert!(compare(&[a.clone(), c]).contains("decode burst 1)"));
        let mut d = a.clone();
        d.params.as_mut().unwrap().tuning = vec!["nv_cm2=false".into()];
        assert!(compare(&[a.clone(), d]).contains("tuning nv_cm2=false"));
        // A label that must be cut keeps the GPU model: an H100 and an H200 stay apart.
        let mut h200 = a.clone();
        h200.adapter = "07v1: NVIDIA H200 141GB HBM3e".into();
        let mut h100 = a.clone();
        h100.adapter = "07v1: NVIDIA H100 80GB HBM3".into();
        let (l0, l1) = (label(&h100), label(&h200));
        assert!(
            l0.starts_with("07v1: H100") && l1.starts_with("07v1: H200"),
            "{l0} / {l1}"
        );
    }

    /// The plot's canvas holds its legend: 35 series ran past a fixed 560-pixel height.
    #[test]
    fn the_plot_grows_with_its_legend() {
        let rec = |op: &str, n: usize| Record {
            op: op.into(),
            n,
            storage: "f16".into(),
            ms: 1.0 + n as f64 / 1000.0,
            reps: 3,
            gpu_timed: true,
            tflops: None,
            gbps: None,
            path: String::new(),
            kernel: None,
        };
        let runs: Vec<Report> = (0..8)
            .map(|i| {
                let mut r = report(&format!("a long adapter name number {i}"), "");
                for op in [
                    "pisa_select",
                    "bsa_select",
                    "pisa_prefill",
                    "dense",
                    "decode_pisa",
                ] {
                    r.records.push(rec(op, 1024));
                    r.records.push(rec(op, 4096));
                }
                r
            })
            .collect();
        let svg = super::svg(&runs);
        let attr = |name: &str| -> f64 {
            let at = svg.find(&format!("{name}='")).unwrap() + name.len() + 2;
            svg[at..].split('\'').next().unwrap().parse().unwrap()
        };
        let (w, h) = (attr("width"), attr("height"));
        assert!(h > 560.0 && w >= 900.0, "{w} x {h}");
        let last_y = svg
            .split("<text x='")
            .filter_map(|t| {
                t.split("y='")
                    .nth(1)?
                    .split('\'')
                    .next()?
                    .parse::<f64>()
                    .ok()
            })
            .fold(0.0, f64::max);
        assert!(last_y < h, "legend at {last_y} of {h}");
    }

    #[test]
    fn compare_labels_widths_and_shape_note() {
        let old =
            "Hq=32 Hkv=8 D=128 C=64 K=16 g=2 Lse Qtile=4 order Auto, kernel path portable (x)";
        let llvm = report("llvmpipe (LLVM 15.0.7, 256 bits)", old);
        assert_eq!(label(&llvm), "llvmpipe (vk portable)");
        let rec = |op: &str| Record {
            op: op.into(),
            n: 4096,
            storage: "f16".into(),
            ms: 1.5,
            reps: 3,
            gpu_timed: true,
            tflops: None,
            gbps: None,
            path: "portable".into(),
            kernel: None,
        };
        let mut a = llvm.clone();
        a.records = vec![rec("pisa_prefill"), rec("decode_dense_burst")];
        let mut b = report("NVIDIA H200", &old.replace("K=16", "K=8"));
        b.records = a.records.clone();
        let t = compare(&[a.clone(), b]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("note: the runs differ in Hq/Hkv/D/C/top_k")
                && lines[0].contains("top_k 8"),
            "{t}"
        );
        assert!(lines[1].starts_with("times in ms"), "{t}");
        assert!(lines[2..].iter().all(|l| l.len() == lines[2].len()), "{t}");
        assert!(!compare(&[a.clone(), a.clone()]).contains("note:"));
        // A run in BNHD beside one in BHND (recorded, or unrecorded in an older file).
        let mut c = a.clone();
        let mut p = params_of("bnhd");
        c.params = Some(p.clone());
        let t = compare(&[a.clone(), c.clone()]);
        assert!(
            t.contains("note: the runs differ in the prefill's layout, inputs or queries")
                && t.contains("layout bnhd, inputs random")
                && t.contains("layout bhnd, inputs random"),
            "{t}"
        );
        p.layout = "bhnd".into();
        c.params = Some(p.clone());
        assert!(!compare(&[a.clone(), c.clone()]).contains("layout, inputs or queries"));
        // A prefill over a prefix (`--queries`) beside whole prompts.
        p.queries = Some(8192);
        c.params = Some(p);
        let t = compare(&[a, c]);
        assert!(t.contains("inputs random, the last 8192 queries"), "{t}");
    }
}
