//! The arguments of `pisa bench` ([`BenchArgs`]) and the parsing of their lists: sizes with
//! k/M suffixes ([`parse_sizes`]) and storage precisions.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};
use clap::Args;
use pisa_wgpu::Storage;

use crate::args::{usage_bail, LayoutArg, LeafOrderArg, ScoringArg};

/// Arguments of `pisa bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Prefill lengths N (comma separated; k/K and m/M suffixes: 4k = 4096).
    #[arg(long, default_value = "4k,16k,64k,128k,256k")]
    pub sizes: String,
    /// KV-cache lengths of the decode benchmark (empty: none) [default: 64k,256k,1m; none with
    /// --input].
    #[arg(long)]
    pub decode_sizes: Option<String>,
    /// Decode steps per back-to-back burst (10, as the PyTorch peer; a long burst keeps the GPU
    /// busy long enough to reach its sustained clocks, as an inference loop does). At most 2048
    /// timed passes a query set: K/V parts x steps.
    #[arg(long, default_value_t = super::decode::BURST)]
    pub decode_burst: usize,
    /// Query heads (a multiple of --hkv; the GQA group is hq / hkv).
    #[arg(long, default_value_t = 32)]
    pub hq: usize,
    /// Key/value heads (at least 1).
    #[arg(long, default_value_t = 8)]
    pub hkv: usize,
    /// Head dim D: a multiple of 16 from 16 to 256 (the prefill's and dense attention's
    /// kernels; the decode benchmark runs dense attention as its baseline, so it takes the
    /// same, though the library's decode step alone takes multiples of 4 up to 1024).
    #[arg(long, default_value_t = 128)]
    pub d: usize,
    /// Leaf block size C (1 to 1048576).
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// top_k K (1 to 16777216).
    #[arg(long, default_value_t = 16)]
    pub top_k: usize,
    /// Intermediate scoring.
    #[arg(long, value_enum, default_value_t = ScoringArg::Lse)]
    pub scoring: ScoringArg,
    /// Consecutive queries per stage-2 tile (PISA.md section 5) in the query-tile order (the
    /// kernels clamp it; the leaf-major order has none). The result does not depend on it.
    #[arg(long, default_value_t = 4)]
    pub q_tile: usize,
    /// Layout of the prefill's Q, K, V and O: [B, H, N, D] (`bhnd`), or [B, N, H, D] (`bnhd`,
    /// the layout of a model's projections and of FlashAttention's inputs), read in place; with
    /// --input, the layout of its tensors too.
    #[arg(long, value_enum, default_value_t = LayoutArg::Bhnd)]
    pub layout: LayoutArg,
    /// Time the prefill on these Q, K, V (a `.safetensors` file: `q`, `k`, `v`, or with --layer
    /// `layer{N}.q/k/v`; batch 1; no decode sizes) instead of random ones, at the file's length and shape: a
    /// model's inputs share far more between neighbouring queries than random ones
    /// (docs/benchmarks.md A.37). The softmax scale is 1/sqrt(D), as for random inputs.
    #[arg(long, short = 'i', conflicts_with_all = ["sizes", "hq", "hkv", "d"])]
    pub input: Option<PathBuf>,
    /// With --input: read `layer{N}.q`, `layer{N}.k`, `layer{N}.v`.
    #[arg(long, requires = "input")]
    pub layer: Option<usize>,
    /// With --input: use only its first N tokens (default: all of them).
    #[arg(long, requires = "input")]
    pub tokens: Option<usize>,
    /// Order of selection stage 2 and sparse attention (query tiles or leaf-major).
    #[arg(long, value_enum, default_value_t = LeafOrderArg::Auto)]
    pub leaf_order: LeafOrderArg,
    /// Storage precisions to run (comma separated: f16, f32, bf16; bf16 runs the portable
    /// kernels and leaves out the BSA baseline and the backward pass, which do not read it).
    #[arg(long, default_value = "f16,f32")]
    pub storages: String,
    /// Queries per prefill (k/K, m/M suffixes): each prefill size N runs the last
    /// min(QUERIES, N) queries over its N keys, as a prompt chunk prefilled over the keys of the
    /// earlier chunks (every prefill row: PISA, the BSA baseline, dense attention, the backward
    /// pass). Default: N, the whole prompt.
    #[arg(long, conflicts_with = "input")]
    pub queries: Option<String>,
    /// Time dense prefill attention only up to this N (the portable kernel is O(N^2); 0: never;
    /// the dense decode baseline of --decode-sizes is timed at every size).
    #[arg(long, default_value = "64k")]
    pub dense_max: String,
    /// Time the backward pass only up to this N (0: never).
    #[arg(long, default_value = "64k")]
    pub backward_max: String,
    /// Timed repetitions per size (fewer when a size would exceed --budget-s, but at least
    /// 3 or --reps, whichever is fewer).
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// Timed repetitions per decode cache size (fewer when one would exceed --budget-s, but at
    /// least 3 or --decode-reps, whichever is fewer): more than --reps by default, as a step is
    /// short and its median noisy.
    #[arg(long, default_value_t = 20)]
    pub decode_reps: usize,
    /// Seconds one size may take.
    #[arg(long, default_value_t = 8.0, allow_hyphen_values = true)]
    pub budget_s: f64,
    /// Milliseconds of GPU time a spin kernel keeps the GPU busy at the start of each timed
    /// submission, untimed, so that the timed work runs at the clocks of a busy GPU whatever
    /// ran before it (0: none). Rounded up to whole dispatches of the spin (about 0.9 ms each on
    /// an H100), at most 1000 of them; the report's shape line gives the length as calibrated.
    /// Default: 5 on a GPU, 0 on a CPU adapter; none without GPU timestamps (the wall clock
    /// would count it).
    #[arg(long, value_parser = warmup_ms, allow_hyphen_values = true)]
    pub warmup_ms: Option<f64>,
    /// Write the results as JSON here (and an SVG plot beside it).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Instead of measuring: print these result files side by side (and, with --plot, their plot).
    #[arg(long, num_args = 1.., conflicts_with_all = [
        "sizes", "decode_sizes", "decode_burst", "hq", "hkv", "d", "block_size", "top_k",
        "scoring", "q_tile", "layout", "input", "layer", "tokens", "leaf_order", "storages", "queries", "dense_max", "backward_max", "reps",
        "decode_reps", "budget_s", "warmup_ms", "json", "adapter",
    ])]
    pub compare: Vec<PathBuf>,
    /// With --compare: also write the SVG plot of the compared results here (*.svg).
    #[arg(long, requires = "compare")]
    pub plot: Option<PathBuf>,
    /// Adapter name fragment or index.
    #[arg(long, value_parser = crate::args::adapter_arg)]
    pub adapter: Option<String>,
}

/// `--warmup-ms`: a finite number of milliseconds from 0 to 1000.
fn warmup_ms(s: &str) -> std::result::Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .map_err(|_| format!("{s:?}: a number of milliseconds from 0 to 1000"))
}

/// The entries of a comma-separated option value `s` of option `what`, trimmed: none for an
/// empty value; an empty entry (`1,,2`, `,`) is a usage error (it was dropped without a word).
fn list_entries<'a>(s: &'a str, what: &str) -> Result<Vec<&'a str>> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    let v: Vec<&str> = s.split(',').map(str::trim).collect();
    if v.iter().any(|x| x.is_empty()) {
        usage_bail!("{what} {s:?} has an empty entry: give values separated by single commas");
    }
    Ok(v)
}

/// Parses "4k,16K,1m,1000" into token counts (none for an empty value).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>> {
    list_entries(s, "the list")?
        .into_iter()
        .map(|x| {
            let (num, mul) = match x.chars().last() {
                Some('k' | 'K') => (&x[..x.len() - 1], 1024),
                Some('m' | 'M') => (&x[..x.len() - 1], 1024 * 1024),
                _ => (x, 1),
            };
            // A value that does not parse is a usage error (exit 2), as clap's own.
            let Ok(n) = num.parse::<usize>() else {
                usage_bail!("bad size {x:?} (examples: 4096, 4k, 1m)");
            };
            if n == 0 {
                bail!("size {x:?} must be at least 1");
            }
            // Token positions and counts are 32-bit in the shaders.
            let most = u32::MAX as usize;
            match n.checked_mul(mul) {
                Some(v) if v <= most => Ok(v),
                _ => bail!(
                    "size {x:?} is too large: at most {most} tokens (32-bit positions on the GPU)"
                ),
            }
        })
        .collect::<Result<Vec<usize>>>()
        .and_then(|v| no_repeats(v, |n| format!("size {n}")))
}

/// Parses the one size of a limit option (`what`: `--dense-max`, `--backward-max`): a size as
/// in `--sizes` (4096, 64k, 1m), or 0 for never. A list or an empty value is an error naming
/// the option (a list was read as its first size, an empty value as 0).
pub(super) fn max_size(s: &str, what: &str) -> Result<usize> {
    let s = s.trim();
    if s == "0" {
        return Ok(0);
    }
    if s.is_empty() {
        usage_bail!("{what} is empty: give one size (e.g. 64k), or 0 for never");
    }
    if s.contains(',') {
        usage_bail!("{what} {s}: takes one size (e.g. 64k), or 0 for never, not a list");
    }
    match parse_sizes(s).context(what.to_string())?[..] {
        [n] => Ok(n),
        _ => bail!("{what} {s}: takes one size (e.g. 64k), or 0 for never"),
    }
}

/// `v` when no value appears twice; else an error naming the repeated one (a repeated size or
/// storage was measured twice, and the tables and `--compare` showed one of the two).
fn no_repeats<T: PartialEq>(v: Vec<T>, name: impl Fn(&T) -> String) -> Result<Vec<T>> {
    if let Some(i) = (1..v.len()).find(|&i| v[..i].contains(&v[i])) {
        usage_bail!("{} is listed twice", name(&v[i]));
    }
    Ok(v)
}

/// Parses "f16,f32" into storage precisions (at least one).
pub(super) fn storages(s: &str) -> Result<Vec<Storage>> {
    if s.trim().is_empty() {
        usage_bail!("--storages is empty: give f16, f32 and/or bf16");
    }
    list_entries(s, "--storages")?
        .into_iter()
        .map(|x| match x {
            "f32" => Ok(Storage::F32),
            "f16" => Ok(Storage::F16),
            "bf16" => Ok(Storage::Bf16),
            _ => usage_bail!("unknown storage {x:?}: use f16, f32 and/or bf16"),
        })
        .collect::<Result<Vec<Storage>>>()
        .and_then(|v| {
            no_repeats(v, |s| {
                format!("--storages: storage {}", format!("{s:?}").to_lowercase())
            })
        })
}

/// Checks a `--json` path before anything is measured: a `.json` name in an existing directory,
/// and, where the file (or the `.svg` plot beside it) exists already, an earlier `pisa bench`
/// result (or plot) that may be replaced, never another file.
pub(super) fn check_json_path(path: &Path) -> Result<()> {
    if path.extension().and_then(|e| e.to_str()) != Some("json") {
        crate::args::usage_bail!(
            "--json {}: the results file must end in .json (its plot is written beside it as .svg)",
            path.display()
        );
    }
    let svg = path.with_extension("svg");
    crate::io::check_output_paths(&[path.to_path_buf(), svg.clone()], &[])?;
    if path.exists() && super::report::Report::load(path).is_err() {
        bail!(
            "--json {}: the file exists and is not a pisa bench JSON file; refusing to overwrite it",
            path.display()
        );
    }
    check_plot_path(&svg, &format!("--json {}", path.display()))
}

/// Refuses to replace an existing file at `svg` that is not an SVG plot (`what` names the
/// option in the error).
pub(super) fn check_plot_path(svg: &Path, what: &str) -> Result<()> {
    if svg.exists() {
        let head = crate::io::read_file(svg).unwrap_or_default();
        if !String::from_utf8_lossy(&head[..head.len().min(4096)]).contains("<svg") {
            bail!(
                "{what}: {} exists and is not an SVG plot; refusing to overwrite it",
                svg.display()
            );
        }
    }
    Ok(())
}

/// Timed repetitions of one size: `reps` (`--reps`), fewer when repetitions of `one_s` seconds
/// each would exceed `budget_s` (`--budget-s`), but at least 3 for a meaningful median (or
/// `reps` when that is fewer), and at least 1.
pub(super) fn budget_reps(reps: usize, budget_s: f64, one_s: f64) -> usize {
    reps.min(((budget_s / one_s.max(1e-6)) as usize).max(3))
        .max(1)
}

/// Refuses `--reps 0`, a `--budget-s` that is NaN, infinite or negative, and a `--warmup-ms`
/// past 0 to 1000 (a NaN would have made every warm-up one dispatch, an infinity the most): out
/// of range, exit code 1, as every option's range (a value that does not parse is clap's usage
/// error).
pub(super) fn check_reps(reps: usize, budget_s: f64, warmup_ms: Option<f64>) -> Result<()> {
    if reps == 0 {
        bail!("--reps must be at least 1");
    }
    if !(budget_s.is_finite() && budget_s >= 0.0) {
        bail!("--budget-s {budget_s}: must be a finite number of seconds, 0 or more");
    }
    if let Some(ms) = warmup_ms.filter(|ms| !(ms.is_finite() && (0.0..=1000.0).contains(ms))) {
        bail!("--warmup-ms {ms}: must be a number of milliseconds from 0 to 1000");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--warmup-ms`: a finite number from 0 to 1000; a negative, non-finite or larger value is
    /// refused by check_reps (a NaN would have made every warm-up one dispatch, an infinity the
    /// most), what is not a number by clap.
    #[test]
    fn warmup_ms_takes_a_finite_number_up_to_a_second() {
        for (s, ms) in [("0", 0.0), ("5", 5.0), (" 0.5 ", 0.5), ("1000", 1000.0)] {
            assert_eq!(warmup_ms(s).unwrap(), ms, "{s}");
            assert!(check_reps(1, 1.0, Some(ms)).is_ok(), "{s}");
        }
        for s in ["", "5ms", "abc"] {
            assert!(warmup_ms(s).is_err(), "{s}");
        }
        for s in ["-1", "nan", "inf", "1000.5"] {
            assert!(
                check_reps(1, 1.0, Some(warmup_ms(s).unwrap())).is_err(),
                "{s}"
            );
        }
        assert!(check_reps(1, 1.0, None).is_ok());
    }

    /// `--dense-max` / `--backward-max`: one size or 0; a list or an empty value is refused by
    /// name (it was read as the list's first size, or as 0).
    #[test]
    fn max_size_takes_one_size_or_zero() {
        for (s, n) in [
            ("0", 0),
            (" 0 ", 0),
            ("1k", 1024),
            ("64k", 65536),
            ("4096", 4096),
        ] {
            assert_eq!(max_size(s, "--dense-max").unwrap(), n, "{s}");
        }
        for s in ["", " ", "1k,64k", "64k,", ",", "x"] {
            let e = format!("{:#}", max_size(s, "--backward-max").unwrap_err());
            assert!(e.contains("--backward-max"), "{s}: {e}");
        }
    }

    /// Every option of a measurement conflicts with `--compare`, which measures nothing (a
    /// `--queries` beside it was ignored without a word): the test walks clap's own list of
    /// the command's arguments, so an option added later is covered.
    #[test]
    fn every_measuring_option_conflicts_with_compare() {
        use clap::CommandFactory as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        let mut cmd = Cli::command();
        cmd.build();
        let compare = cmd
            .get_arguments()
            .find(|a| a.get_id() == "compare")
            .expect("--compare");
        let conflicts: Vec<String> = cmd
            .get_arg_conflicts_with(compare)
            .iter()
            .map(|a| a.get_id().to_string())
            .collect();
        let mut checked = 0;
        for a in cmd.get_arguments() {
            let id = a.get_id().as_str();
            if ["compare", "plot", "help"].contains(&id) {
                continue;
            }
            assert!(
                conflicts.iter().any(|c| c == id),
                "--{id} does not conflict with --compare"
            );
            checked += 1;
        }
        assert!(checked >= 20, "only {checked} options checked");
    }
}
