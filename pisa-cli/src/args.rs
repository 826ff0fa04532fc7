//! Argument groups shared by several commands.

use clap::{Args, ValueEnum};
use pisa_core::{Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::{AdapterChoice, Context, Storage};

/// Intermediate-level scoring (PISA.md section 2).
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum ScoringArg {
    /// PISA: LSE over the children's means.
    Lse,
    /// PISA-1: mean key + log count.
    Mean,
    /// PISA-2: PISA-1 + variance term.
    Meanvar,
}

impl From<ScoringArg> for Scoring {
    fn from(s: ScoringArg) -> Self {
        match s {
            ScoringArg::Lse => Scoring::Lse,
            ScoringArg::Mean => Scoring::Mean,
            ScoringArg::Meanvar => Scoring::MeanVar,
        }
    }
}

/// Order of selection stage 2 and sparse attention (`pisa_wgpu::LeafOrder`).
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LeafOrderArg {
    /// Leaf-major where the kernels run on tensor cores or a stage's query-tile kernel does
    /// not fit the device (workgroup memory, loop cap), query tiles elsewhere (or
    /// `PISA_LEAF_ORDER` / `--tune leaf_order=...` when set).
    Auto,
    /// Query tiles: a workgroup per tile of consecutive queries, over the union of their leaves.
    Tiles,
    /// Leaf-major: each leaf against chunks of the queries that listed it.
    Leaves,
}

impl LeafOrderArg {
    /// Applies the order to `ctx` (Auto keeps what the context was opened with). A flag that
    /// overrides another order asked for by the tuning (`--tune leaf_order=...` or
    /// `PISA_LEAF_ORDER`) says so on stderr.
    pub fn apply(self, ctx: &Context) {
        let order = match self {
            LeafOrderArg::Auto => return,
            LeafOrderArg::Tiles => pisa_wgpu::LeafOrder::Tiles,
            LeafOrderArg::Leaves => pisa_wgpu::LeafOrder::Leaves,
        };
        let tuned = ctx.tuning().leaf_order;
        if tuned != pisa_wgpu::LeafOrder::Auto && tuned != order {
            let name = |o: pisa_wgpu::LeafOrder| format!("{o:?}").to_ascii_lowercase();
            eprintln!(
                "warning: --leaf-order {} overrides the tuning's leaf_order={} (--tune or \
                 PISA_LEAF_ORDER)",
                name(order),
                name(tuned)
            );
        }
        ctx.set_leaf_order(order);
    }
}

/// Tensor layout of the input files.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LayoutArg {
    /// [B, H, N, D] (or [H, N, D]).
    Bhnd,
    /// [B, N, H, D] (or [N, H, D]).
    Bnhd,
}

impl From<LayoutArg> for TensorLayout {
    fn from(l: LayoutArg) -> Self {
        match l {
            LayoutArg::Bhnd => TensorLayout::Bhnd,
            LayoutArg::Bnhd => TensorLayout::Bnhd,
        }
    }
}

/// GPU storage precision of Q/K/V.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum StorageArg {
    /// 4-byte floats.
    F32,
    /// 2-byte floats (needs SHADER_F16).
    F16,
    /// bfloat16, widened in the kernels (on the portable kernels; O in f32).
    Bf16,
}

impl From<StorageArg> for Storage {
    fn from(s: StorageArg) -> Self {
        match s {
            StorageArg::F32 => Storage::F32,
            StorageArg::F16 => Storage::F16,
            StorageArg::Bf16 => Storage::Bf16,
        }
    }
}

/// Selection options (PISA.md "Notation" and section 3) that every selecting command takes;
/// the scoring ([`ScoringArgs`]) and causality ([`CausalArgs`]) are taken by the commands they
/// apply to.
#[derive(Args, Clone, Debug)]
pub struct SelectArgs {
    /// Leaf block size C in tokens (1 to 1048576).
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// K: leaf blocks per query, forced blocks included (1 to 16777216).
    #[arg(long, default_value_t = 16)]
    pub top_k: usize,
    /// Merge factor g of the pyramid (2 to 64).
    #[arg(long, default_value_t = 2)]
    pub merge: usize,
    /// Forced first blocks (attention sinks): blocks 0..N at or before the query's own block
    /// (also non-causal: PISA.md's "as in the causal case").
    #[arg(long, default_value_t = 0)]
    pub sink_blocks: usize,
    /// Forced blocks just before each query's own block.
    #[arg(long, default_value_t = 0)]
    pub local_blocks: usize,
    /// Softmax scale; default: the file's metadata, else 1/sqrt(D).
    // (Read as f64 so that a value past f32's range is named as given, not as its f32
    // rounding: 1e-50 is not "0".)
    #[arg(long, allow_hyphen_values = true)]
    pub scale: Option<f64>,
    /// Consecutive queries per stage-2 tile (PISA.md section 5), in the query-tile order: the
    /// kernels clamp it (at most 32 rows of query heads per tile, fewer where workgroup memory
    /// does not hold them; `-vv` shows the tile built), and the leaf-major order has no query
    /// tiles. The result does not depend on it.
    #[arg(long, default_value_t = 4)]
    pub q_tile: usize,
}

/// `--scoring`, for the commands that select with one scoring (`forward`, `decode`; `recall`
/// measures every scoring side by side).
#[derive(Args, Clone, Debug)]
pub struct ScoringArgs {
    /// Intermediate-level scoring.
    #[arg(long, value_enum, default_value_t = ScoringArg::Lse)]
    pub scoring: ScoringArg,
}

/// `--non-causal`, for the commands that can attend to every key (`forward`, `recall`; each
/// token `decode` appends attends to the tokens before it).
#[derive(Args, Clone, Debug)]
pub struct CausalArgs {
    /// Attend to every key (encoders); default is causal.
    #[arg(long)]
    pub non_causal: bool,
}

impl SelectArgs {
    /// The validated configuration with `scoring` and `causal` (scale from the file when not
    /// given: `file_scale` as [`crate::input::Loaded::file_scale`], whose error counts only
    /// then).
    pub fn config(
        &self,
        scoring: Scoring,
        causal: bool,
        file_scale: &std::result::Result<Option<f32>, String>,
    ) -> anyhow::Result<SelectionConfig> {
        let file_scale = match (self.scale, file_scale) {
            (Some(_), _) => None,
            (None, Ok(s)) => *s,
            (None, Err(e)) => anyhow::bail!("{e}"),
        };
        if let Some(s) = self.scale {
            if !(s.is_finite() && s > 0.0) {
                anyhow::bail!("--scale {s}: the softmax scale must be finite and positive");
            }
            let f = s as f32;
            if !(f.is_finite() && f > 0.0) {
                anyhow::bail!(
                    "--scale {s:e}: {} f32's range, the precision the kernels use",
                    if f > 0.0 { "overflows" } else { "underflows" }
                );
            }
        }
        let c = SelectionConfig {
            block_size: self.block_size,
            top_k: self.top_k,
            merge_factor: self.merge,
            scoring,
            sink_blocks: self.sink_blocks,
            local_blocks: self.local_blocks,
            causal,
            scale: self.scale.map(|s| s as f32).or(file_scale),
        };
        c.validate().map_err(selection_error)?;
        if self.q_tile == 0 {
            anyhow::bail!("--q-tile must be at least 1");
        }
        Ok(c)
    }
}

/// The option that sets `SelectionConfig`'s field `field`.
fn selection_flag(field: &str) -> &str {
    match field {
        "block_size" => "--block-size",
        "top_k" => "--top-k",
        "merge_factor" => "--merge",
        "sink_blocks" => "--sink-blocks",
        "local_blocks" => "--local-blocks",
        other => other,
    }
}

/// A refusal of [`SelectionConfig::validate`] in the words of the command line: the core's
/// messages name the configuration's fields (top_k, merge_factor), this names the option that
/// set the value (`--merge 65 is above the limit of 64`).
pub fn selection_error(e: pisa_core::PisaError) -> anyhow::Error {
    use pisa_core::PisaError as E;
    match e {
        E::Zero { what } => anyhow::anyhow!("{} must be at least 1, got 0", selection_flag(what)),
        E::MergeFactor { merge_factor } => {
            anyhow::anyhow!("--merge {merge_factor}: the merge factor must be at least 2")
        }
        E::TooLarge { what, value, limit } if value > limit => {
            anyhow::anyhow!("{} {value} is above the limit of {limit}", selection_flag(what))
        }
        E::TopKBelowForced { top_k, forced } => anyhow::anyhow!(
            "--top-k {top_k} is smaller than the {forced} forced blocks (the query's own block + --sink-blocks + --local-blocks)"
        ),
        other => anyhow::Error::new(other).context("the selection options"),
    }
}

/// A warning for `--save-selection` when `cfg.top_k` exceeds the leaf blocks of `n_keys` keys:
/// every query then keeps every block it sees, and the saved selection still holds top_k
/// entries a row, the rest -1 padding (a short prompt under the default top_k is no news
/// without a saved selection: nothing is said then).
pub fn top_k_warning(cfg: &SelectionConfig, n_keys: usize, save_selection: bool) -> Option<String> {
    let blocks = n_keys.div_ceil(cfg.block_size.max(1));
    (save_selection && cfg.top_k > blocks).then(|| {
        format!(
            "--top-k {} is above the {} leaf blocks of {} tokens (block size {}): every query keeps every block it sees, and the saved selection pads each row to {} entries with -1",
            cfg.top_k,
            blocks,
            n_keys,
            cfg.block_size,
            cfg.top_k
        )
    })
}

/// A failure of a call with `cfg` over `n_keys` keys, with a note when `top_k` exceeds the
/// leaf blocks there are (the selection buffers grow with top_k, so a huge top_k reads as a
/// sequence too long; `--top-k` equal to the block count already selects every block). The
/// note does not call top_k the cause: the merge factor also sizes the routing's memory.
/// Only a size limit gets the note (a buffer, workgroup memory or an index too large): other
/// errors, a head dim or a GQA group the kernels do not take, are not the top_k's doing.
pub fn top_k_note(e: anyhow::Error, cfg: &SelectionConfig, n_keys: usize) -> anyhow::Error {
    let blocks = n_keys.div_ceil(cfg.block_size.max(1));
    let size_limit = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<pisa_wgpu::GpuError>(),
            Some(
                pisa_wgpu::GpuError::Limit { .. }
                    | pisa_wgpu::GpuError::Input(pisa_core::PisaError::TooLarge { .. })
            )
        )
    });
    if cfg.top_k <= blocks || !size_limit {
        return e;
    }
    // (Not "the cause": the memory also grows with the merge factor, and a smaller top_k need
    // not be enough.)
    anyhow::anyhow!(
        "{e:#}; note: --top-k {} is above the {} of {} (C={}), and --top-k {blocks} already \
         selects every block; the kernels' buffers and workgroup memory grow with top_k and \
         with the merge factor (--merge {})",
        cfg.top_k,
        crate::text::plural(blocks, "leaf block"),
        crate::text::plural(n_keys, "token"),
        cfg.block_size,
        cfg.merge_factor
    )
}

/// An error of the command line itself (options that do not go together, a missing input):
/// `pisa` exits with code 2 for it, as for clap's own usage errors, and 1 for every other.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// `anyhow::bail!` for a [`UsageError`]: returns it, its message formatted as `format!`'s.
#[macro_export]
macro_rules! usage_bail {
    ($($fmt:tt)*) => {
        return Err($crate::args::UsageError(format!($($fmt)*)).into())
    };
}
pub use crate::usage_bail;

/// `println!` that returns a write error (`?`) instead of panicking: a full disk or a closed
/// file behind a redirected stdout is an error, exit 1, not a panic (a closed pipe ends the
/// process quietly, see `main`).
#[macro_export]
macro_rules! outln {
    ($($fmt:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($fmt)*)
            .map_err(|e| anyhow::anyhow!("cannot write to stdout: {e}"))
    }};
}
pub use crate::outln;

/// `print!` as [`outln!`] is `println!`.
#[macro_export]
macro_rules! out {
    ($($fmt:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($fmt)*)
            .and_then(|_| std::io::stdout().lock().flush())
            .map_err(|e| anyhow::anyhow!("cannot write to stdout: {e}"))
    }};
}
pub use crate::out;

/// The value of an `--adapter` option: a name fragment or an index, not empty (an empty
/// fragment matched every adapter, so the option chose the first one silently).
pub fn adapter_arg(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("empty: give a name fragment or an index from `pisa info`".into());
    }
    Ok(s.to_string())
}

/// Which GPU and precision.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Adapter: a name fragment or an index from `pisa info` (default: highest performance).
    #[arg(long, value_parser = adapter_arg)]
    pub adapter: Option<String>,
    /// GPU storage precision of Q, K, V and O (arithmetic is f32; O is f32 for bf16).
    #[arg(long, value_enum, default_value_t = StorageArg::F32)]
    pub storage: StorageArg,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

impl DeviceArgs {
    /// Opens the chosen adapter.
    pub fn context(&self) -> anyhow::Result<Context> {
        let choice = match &self.adapter {
            None => AdapterChoice::HighPerformance,
            Some(s) => match s.parse::<usize>() {
                Ok(i) => AdapterChoice::Index(i),
                Err(_) => AdapterChoice::Name(s.clone()),
            },
        };
        let ctx = Context::with_tuning(&choice, command_tuning()?)?;
        // The adapter's own defaults under the command's knobs (the tuning above starts from
        // the library's general defaults: the adapter is known only once it is open).
        let t = command_tuning_for(ctx.report())?;
        if t != ctx.tuning() {
            ctx.set_tuning(t)?;
        }
        for line in unavailable_asked(&ctx) {
            eprintln!("warning: {line}");
        }
        Ok(ctx)
    }
}

/// The knobs this command set (by `--tune` or a `PISA_*` variable) that ask for a hardware path
/// the opened context does not run: one line each, naming the knob, the adapter and what runs
/// instead. (The library falls back without an error, as it must for an app's defaults; a
/// person who asked by name is told.) What runs is the context's own choice
/// ([`Context::kernel_path`], [`Context::nv_cm2`], its features), which also weighs the
/// adapter's shapes, subgroup sizes and limits, not only its feature list.
fn unavailable_asked(ctx: &Context) -> Vec<String> {
    let subgroups = ctx.features().contains(pisa_wgpu::wgpu::Features::SUBGROUP);
    let hw = Hardware {
        tensor_cores: (ctx.kernel_path() == pisa_wgpu::KernelPath::CoopMat)
            .then_some(())
            .ok_or("cannot run pisa's tensor-core kernels"),
        nv_cm2: ctx.nv_cm2(),
        subgroups,
        subgroups8: subgroups && ctx.shuffle_lanes() >= 8,
        one_dispatch_decode: ctx.one_dispatch_decode(),
    };
    unavailable(&ctx.tuning(), &hw, &ctx.report().name)
}

/// [`unavailable_asked`] for `pisa info`, which opens no device: the knobs this command set
/// that ask for a hardware path adapter `r` (named `name`) does not have, as far as its report
/// tells before a device is opened, one line each.
pub fn unavailable_asked_on(r: &pisa_wgpu::AdapterReport, name: &str) -> Vec<String> {
    let Ok(t) = command_tuning_for(r) else {
        return Vec::new();
    };
    let hw = Hardware {
        tensor_cores: r
            .cooperative_matrix
            .then_some(())
            .ok_or("has no cooperative matrices"),
        nv_cm2: r.nv_cooperative_matrix2,
        subgroups: r.subgroups,
        subgroups8: r.subgroups && r.shuffle_lanes() >= 8,
        one_dispatch_decode: r.one_dispatch_decode(),
    };
    unavailable(&t, &hw, name)
}

/// The hardware paths an opened context runs, or an adapter has (for `pisa info`).
struct Hardware {
    /// `Err(why)` where pisa's tensor-core kernels do not run, in words after the name.
    tensor_cores: Result<(), &'static str>,
    /// Whether the NVIDIA `VK_NV_cooperative_matrix2` kernels run.
    nv_cm2: bool,
    /// Subgroup operations, and subgroups of 8 lanes or more.
    subgroups: bool,
    subgroups8: bool,
    /// `Err(why)` where the decode step cannot run as one dispatch
    /// (`pisa_wgpu::Tuning::decode_merge_in_route`), in words after the name.
    one_dispatch_decode: Result<(), &'static str>,
}

/// One line per knob this command set by name (`--tune` or its `PISA_*` variable) that asks
/// for a path `hw` lacks: the knob, what it asks for, why `name` cannot, and what runs there.
fn unavailable(t: &pisa_wgpu::Tuning, hw: &Hardware, name: &str) -> Vec<String> {
    let checks = [
        (
            "tensor_cores",
            t.tensor_cores,
            hw.tensor_cores.err(),
            "tensor cores",
            "the portable kernels run there",
        ),
        (
            "nv_cm2",
            t.nv_cm2 && t.tensor_cores,
            (!hw.nv_cm2).then_some("has no usable VK_NV_cooperative_matrix2"),
            "the NVIDIA kernels",
            "they do not run there",
        ),
        (
            "route_subgroups",
            t.route_subgroups,
            (!hw.subgroups).then_some("has no subgroups"),
            "the routing's subgroup step",
            "the workgroup-memory step runs there",
        ),
        (
            "decode_route_subgroups",
            t.decode_route_subgroups,
            (!hw.subgroups8).then_some("has no subgroups of 8 lanes or more"),
            "the decode route's subgroup level steps",
            "the workgroup-memory steps run there",
        ),
        (
            "decode_leaf_subgroups",
            t.decode_leaf_subgroups,
            (!hw.subgroups8).then_some("has no subgroups of 8 lanes or more"),
            "the decode leaf attention on subgroup shuffles",
            "the workgroup-memory attention runs there",
        ),
        (
            "decode_merge_in_route",
            t.decode_merge_in_route && t.decode_route_workgroups > 0 && !t.decode_fused,
            hw.one_dispatch_decode.err(),
            "the decode step as one dispatch",
            "its route and leaf, then the merge, run as two",
        ),
    ];
    let mut lines: Vec<String> = checks
        .into_iter()
        .filter_map(|(knob, on, lacks, asks, runs)| {
            let lacks = lacks.filter(|_| on && asked(knob))?;
            Some(format!(
                "{knob} asks for {asks}, but {name} {lacks}: {runs}"
            ))
        })
        .collect();
    lines.extend(unused(t, hw, name));
    lines
}

/// One line per knob this command set by name that shapes a kernel the other choices leave out
/// on `hw` (the library reads such a knob only where its kernel runs, as the `Tuning` field docs
/// say: it was set and recorded without effect, and without a word): the knob, the kernel it
/// shapes and why that does not run. Selection-dependent rules (the subgroup routing's `lse`
/// and GQA groups up to 16) are named, not evaluated: the shapes are not known here.
fn unused(t: &pisa_wgpu::Tuning, hw: &Hardware, name: &str) -> Vec<String> {
    let tc = hw.tensor_cores.is_ok() && t.tensor_cores;
    let nv = tc && hw.nv_cm2 && t.nv_cm2;
    let nv_scorer = nv && t.nv_scorer;
    let sg_route = hw.subgroups && t.route_subgroups;
    let route = "shapes the workgroup-memory routing, but the subgroup routing runs on {name} for \
                 lse selections with GQA groups up to 16 (route_subgroups=0 runs the other)";
    let table = "sizes the routing table, which runs on the NVIDIA path or with \
                 route_table_portable=1: neither on {name}";
    let tiles = t.leaf_order == pisa_wgpu::LeafOrder::Tiles;
    let checks: [(&str, bool, &str); 15] = [
        (
            "nv_scorer",
            !nv,
            "chooses the NVIDIA leaf scorer, which runs on the NVIDIA path only (not on {name})",
        ),
        (
            "leaf_score_pairs",
            !nv_scorer,
            "asks the NVIDIA leaf scorer for pairs of leaves, but that scorer does not run on \
             {name}",
        ),
        (
            "leaf_subgroups",
            !tc || nv_scorer,
            "sizes the WGSL tensor-core leaf scorer, which does not run on {name} (it needs \
             tensor cores, and the NVIDIA scorer replaces it where that runs)",
        ),
        (
            "leaf_stage_keys",
            !tc || nv_scorer || tiles,
            "stages the keys of the WGSL tensor-core leaf-major scorer, which does not run on \
             {name} (it needs tensor cores and the leaf-major order, and the NVIDIA scorer \
             replaces it where that runs)",
        ),
        (
            "attention_pairs",
            tiles,
            "pairs the entries of leaf-major sparse attention, but leaf_order=tiles runs the \
             query-tile kernels on {name}",
        ),
        (
            "leaf_tiles_per_iteration",
            !tc,
            "sizes the tensor-core query-tile leaf stage, which needs tensor cores {name} does not \
             run",
        ),
        ("route_lanes", sg_route, route),
        ("route_tile", sg_route, route),
        ("route_max_workgroup", sg_route, route),
        ("route_table_nodes", !nv && !t.route_table_portable, table),
        ("route_table_queries", !nv && !t.route_table_portable, table),
        (
            "decode_key_lanes",
            !t.decode_fused,
            "shapes the fused decode step, but the split step runs (decode_fused=1 runs the other)",
        ),
        (
            "decode_leaf_prefetch",
            !t.decode_leaf_prefetch
                && (t.decode_route_workgroups == 0
                    || t.decode_fused
                    || (hw.subgroups8 && t.decode_leaf_subgroups && t.decode_route_subgroups)),
            "applies to the workgroup-memory attention of the one-dispatch route and leaf, which \
             decode_route_workgroups=0 or decode_fused=1 leaves out, and the subgroup attention \
             (decode_leaf_subgroups=1, which loads its rows ahead) replaces",
        ),
        (
            "decode_leaf_subgroups",
            hw.subgroups8
                && t.decode_leaf_subgroups
                && (!t.decode_route_subgroups || t.decode_route_workgroups == 0),
            "applies to the one-dispatch route and leaf with the route's subgroup steps, which \
             decode_route_workgroups=0 or decode_route_subgroups=false leaves out: the leaf \
             attention runs in workgroup memory",
        ),
        (
            "decode_merge_in_route",
            t.decode_merge_in_route && (t.decode_route_workgroups == 0 || t.decode_fused),
            "applies to the one-dispatch route and leaf, which decode_route_workgroups=0 or \
             decode_fused=1 leaves out",
        ),
    ];
    // (a knob asked at its default value changes nothing, used or not: no line)
    let default = pisa_wgpu::Tuning::default().pairs();
    let pairs = t.pairs();
    let at_default = |knob: &str| {
        pairs
            .iter()
            .zip(&default)
            .any(|(a, b)| a.0 == knob && a == b)
    };
    checks
        .into_iter()
        .filter(|&(knob, unused, _)| unused && asked(knob) && !at_default(knob))
        .map(|(knob, _, why)| format!("{knob} {}", why.replace("{name}", name)))
        .collect()
}

/// Whether the command set `knob` explicitly ([`EXPLICIT`]).
fn asked(knob: &str) -> bool {
    EXPLICIT.get().is_some_and(|k| k.iter().any(|x| x == knob))
}

/// The knob names the command set explicitly ([`set_tuning`]): `--tune` pairs (by knob or
/// variable name) and `PISA_*` variables set to a non-blank value (a blank one is not read).
static EXPLICIT: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// The tuning of this command: the defaults, the `PISA_*` variables, then the `--tune
/// KNOB=VALUE` pairs ([`set_tuning`]); every context the command opens takes it
/// ([`DeviceArgs::context`]).
static TUNE: std::sync::OnceLock<pisa_wgpu::Tuning> = std::sync::OnceLock::new();

/// Builds the command's tuning from the `PISA_*` variables and the `--tune` pairs (names and
/// values checked by `pisa_wgpu::Tuning`) and keeps it for [`DeviceArgs::context`]. Errors
/// name the bad variable or pair.
pub fn set_tuning(pairs: &[String]) -> anyhow::Result<()> {
    let t = tuning_from(pisa_wgpu::Tuning::default(), pairs)?;
    let set = |var: &str| std::env::var(var).is_ok_and(|v| !v.trim().is_empty());
    let mut explicit: Vec<String> = pisa_wgpu::TUNING_KNOBS
        .iter()
        .filter(|(_, var)| set(var))
        .map(|(name, _)| name.to_string())
        .collect();
    for p in pairs {
        // (checked by tuning_from above; `Tuning::set` takes a knob's variable name too)
        let k = pair_key(p);
        if let Some((name, _)) = pisa_wgpu::TUNING_KNOBS
            .iter()
            .find(|(n, v)| *n == k || *v == k)
        {
            explicit.push(name.to_string());
        }
    }
    let _ = TUNE.set(t);
    let _ = PAIRS.set(pairs.to_vec());
    let _ = EXPLICIT.set(explicit);
    for var in unknown_pisa_variables(std::env::vars_os().map(|(k, _)| k)) {
        eprintln!(
            "warning: {var} is not a variable pisa reads (tuning knobs' variables: {}; or --tune \
             KNOB=VALUE)",
            pisa_wgpu::TUNING_KNOBS
                .iter()
                .map(|k| k.1)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// The `PISA_*` variables pisa reads besides the tuning knobs' (`pisa_wgpu::TUNING_KNOBS`): the
/// GPU tests' and the development tools'.
const OTHER_PISA_VARIABLES: [&str; 12] = [
    "PISA_REQUIRE_NV_CM2",
    "PISA_SEED",
    "PISA_SOAK_STEPS",
    "PISA_GEMM_SIZES",
    "PISA_BENCH_N",
    "PISA_BENCH_LENS",
    "PISA_CORPUS_PRINT",
    "PISA_WGSL_DIR",
    "PISA_WGSL_CHECK_DIR",
    "PISA_WGSL_CHECK_MIN",
    "PISA_NV_SPV_DIR",
    "PISA_WEB_QUERY",
];

/// The names among `vars` that start with `PISA_` and that pisa does not read: a misspelt
/// knob variable (`PISA_ROUTE_LANE`, `PISA_DECODE_FUSED` for `PISA_DECODE`) was ignored
/// without a word, where a bad value of a known one is refused.
fn unknown_pisa_variables(vars: impl Iterator<Item = std::ffi::OsString>) -> Vec<String> {
    let mut unknown: Vec<String> = vars
        .filter_map(|k| k.into_string().ok())
        .filter(|k| k.starts_with("PISA_"))
        .filter(|k| !pisa_wgpu::TUNING_KNOBS.iter().any(|(_, var)| var == k))
        .filter(|k| !OTHER_PISA_VARIABLES.contains(&k.as_str()))
        .collect();
    unknown.sort();
    unknown
}

/// The knob (or variable) name of a `--tune KNOB=VALUE` pair, trimmed; empty without `=`.
fn pair_key(p: &str) -> &str {
    p.split_once('=').map_or("", |(k, _)| k.trim())
}

/// The `--tune` pairs of this command ([`set_tuning`]).
static PAIRS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// The `--tune` pairs of this command as given (none before [`set_tuning`]).
pub fn tune_pairs() -> &'static [String] {
    PAIRS.get().map_or(&[], Vec::as_slice)
}

/// `base` with the `PISA_*` variables, then the `--tune` pairs, applied. A variable whose knob a
/// pair sets is not read (the pair overrides it, even where the variable's value is bad); every
/// other is, as `Tuning::with_env` reads them.
fn tuning_from(base: pisa_wgpu::Tuning, pairs: &[String]) -> anyhow::Result<pisa_wgpu::Tuning> {
    let paired: Vec<&str> = pairs.iter().map(|p| pair_key(p)).collect();
    let mut t = base.with_env_except(&paired)?;
    for p in pairs {
        let Some((k, v)) = p.split_once('=') else {
            anyhow::bail!("--tune {p}: expected KNOB=VALUE (knobs: {})", knob_names());
        };
        t.set(k.trim(), v)
            .map_err(|e| anyhow::anyhow!("--tune {p}: {e}"))?;
    }
    Ok(t)
}

/// The tuning of this command ([`set_tuning`]) over the library's defaults; without it (the
/// CLI's unit tests), the defaults with the `PISA_*` variables.
pub fn command_tuning() -> anyhow::Result<pisa_wgpu::Tuning> {
    match TUNE.get() {
        Some(t) => Ok(t.clone()),
        None => Ok(pisa_wgpu::Tuning::default().with_env()?),
    }
}

/// The tuning of this command on adapter `r`: its defaults ([`pisa_wgpu::Tuning::for_adapter`],
/// what an application's context gets there), then the variables and the `--tune` pairs.
pub fn command_tuning_for(r: &pisa_wgpu::AdapterReport) -> anyhow::Result<pisa_wgpu::Tuning> {
    let pairs = PAIRS.get().map_or(&[][..], Vec::as_slice);
    tuning_from(pisa_wgpu::Tuning::for_adapter(r), pairs)
}

/// The names of the tuning knobs, comma separated.
pub fn knob_names() -> String {
    pisa_wgpu::TUNING_KNOBS.map(|k| k.0).join(", ")
}

/// A progress bar on a terminal, hidden when stderr is piped.
pub fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb.set_message(what.to_string());
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The --top-k note goes on size limits only, and only when top_k exceeds the blocks.
    #[test]
    fn top_k_note_only_on_size_limits() {
        let cfg = SelectionConfig::new(64, 16).unwrap();
        let limit = || {
            anyhow::Error::new(pisa_wgpu::GpuError::Limit {
                what: "workgroup memory".into(),
                needed: 2,
                limit: 1,
                unit: "bytes",
                hint: "smaller",
            })
            .context("prefill failed")
        };
        let head_dim = || {
            anyhow::Error::new(pisa_wgpu::GpuError::Input(pisa_core::PisaError::HeadDim {
                head_dim: 40,
                supported: "multiples of 16",
            }))
        };
        // 128 tokens: 2 blocks of 64, below top_k 16.
        let note = format!("{:#}", top_k_note(limit(), &cfg, 128));
        assert!(note.contains("--top-k 2 already"), "{note}");
        // Not blamed alone: the merge factor sizes the memory too.
        assert!(
            note.contains("--merge 2") && !note.contains("cause"),
            "{note}"
        );
        assert!(!format!("{:#}", top_k_note(head_dim(), &cfg, 128)).contains("--top-k"));
        // 4096 tokens: 64 blocks, top_k within them.
        assert!(!format!("{:#}", top_k_note(limit(), &cfg, 4096)).contains("--top-k"));
    }
}
