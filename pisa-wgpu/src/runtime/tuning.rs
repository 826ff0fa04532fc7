//! The kernels' tuning knobs, in one typed structure: [`Tuning`].
//!
//! A context holds one ([`Context::tuning`], [`Context::set_tuning`]); every operation reads
//! its knobs from there when it plans. The defaults are per device ([`Tuning::for_adapter`]):
//! the values measured fastest on the GPUs measured so far (`docs/benchmarks.md`): the same
//! for every adapter but the H100 and H200, whose decode route runs as 104 workgroups
//! ([`Tuning::decode_route_workgroups`]), and a browser's fallback adapter (SwiftShader),
//! which runs leaf-major ([`Tuning::leaf_order`]). The library itself never reads the
//! environment for them, with one convenience for programs: [`Context::new`] applies the
//! `PISA_*` variables through [`Tuning::with_env`] (the table of [`KNOBS`]);
//! [`Context::from_device`] (an application's device) takes the defaults only.
//!
//! Every knob changes speed only: the results of every setting are the ones the reference
//! tests check (selections up to near-ties of f32 rounding, outputs within f32 rounding). Two
//! fields are diagnostics rather than knobs, kept here so that they travel the same ways
//! (`--tune`, the variables): [`Tuning::dump_wgsl`], and [`Tuning::shader_override`], whose
//! kernels are whatever its files make them (for timing a kernel's variant).
//!
//! [`Context::tuning`]: super::context::Context::tuning
//! [`Context::set_tuning`]: super::context::Context::set_tuning
//! [`Context::new`]: super::context::Context::new
//! [`Context::from_device`]: super::context::Context::from_device

use super::adapter::AdapterReport;
use super::checks::ShaderChecks;
use super::coop::{LeafOrder, COOP_SUBGROUPS};
use crate::error::{GpuError, Result};

/// The tuning knobs of pisa's kernels (see the module docs). Start from a context's
/// ([`crate::Context::tuning`]) or from [`Tuning::for_adapter`] (or `Default`), change fields
/// or [`Tuning::set`] them by name, and hand it to [`crate::Context::set_tuning`] or
/// [`crate::Context::with_tuning`], which check it ([`Tuning::check`]). More knobs may come:
/// the structure is `non_exhaustive` (build it from one of those, not from a literal).
///
/// ```
/// use pisa_wgpu::{LeafOrder, Tuning};
/// let mut t = Tuning::default();
/// t.set("route_lanes", "8")?;
/// t.leaf_order = LeafOrder::Leaves;
/// assert_eq!(t.route_lanes, 8);
/// assert!(t.set("route_lanes", "3").is_err()); // not a power of two up to 16
/// # Ok::<(), pisa_wgpu::GpuError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Tuning {
    /// Tensor-core kernels (WGSL cooperative matrices, and the NVIDIA ones below) where the
    /// device runs them; `false` keeps the portable kernels everywhere. Default `true`.
    /// Variable `PISA_KERNEL_PATH` (`portable` or `coopmat`).
    pub tensor_cores: bool,
    /// The `VK_NV_cooperative_matrix2` kernels (`shaders/nv/`) where the device has the
    /// extension; with [`crate::Context::new`], `false` also opens the device without it.
    /// Default `true`. Variable `PISA_NV_CM2` (`0` or `1`).
    pub nv_cm2: bool,
    /// The NVIDIA leaf scorer of selection stage 2 (`shaders/nv/leaf_score.comp`) where the
    /// NVIDIA kernels run. Default `true`: faster than the WGSL tensor-core scorer on the
    /// H200 (2026-12-01). Variable `PISA_NV_SCORER` (`0` or `1`).
    pub nv_scorer: bool,
    /// Whether the NVIDIA leaf scorer scores pairs of leaves (`shaders/leaf_bucket.wgsl` PAIR
    /// buckets, `leaf_score.comp` PAIR = 1): a query that lists both leaves of a pair (a kept
    /// node's two children) is one entry whose rows are gathered once for both. Default
    /// `true`: on the H200 (2026-12-02, f16, Hq 32, Hkv 8, D 128, C 64, K 16) the scorer took
    /// 14.8 / 60.7 ms at 64K / 256K tokens against 20.0 / 82.6 per leaf (docs/benchmarks.md).
    /// Variable `PISA_LEAF_PAIRS` (`0` or `1`).
    pub leaf_score_pairs: bool,
    /// Whether leaf-major sparse attention attends sibling pairs as one entry
    /// (`shaders/leaf_bucket.wgsl` APAIR buckets, `attention_leaf.wgsl` and
    /// `shaders/nv/attention_leaf.comp` with PAIR = 1): a query that selected both leaves of a
    /// pair gathers its rows, writes its partial state and merges it once for the pair's 2C
    /// keys. Where the leaf-major kernel has no pair variant (the WGSL tensor-core one) it is
    /// not used. Default `true`. Variable `PISA_ATTENTION_PAIRS` (`0` or `1`).
    pub attention_pairs: bool,
    /// The order of selection stage 2 and sparse attention ([`LeafOrder`]). Default `Auto`
    /// (`Leaves` on a browser's fallback adapter: [`Tuning::for_adapter`]).
    /// Variable `PISA_LEAF_ORDER` (`auto`, `tiles` or `leaves`).
    pub leaf_order: LeafOrder,
    /// The shaders' runtime checks; `None` chooses per device ([`ShaderChecks::for_device`]).
    /// Fixed when the context is made: [`crate::Context::set_tuning`] refuses a change.
    /// Variable `PISA_SHADER_CHECKS` (`all`, `bounds`, `none`, `driver_bounded`, or `auto` for
    /// the per-device choice).
    pub shader_checks: Option<ShaderChecks>,
    /// Decode caches made from now on run the step as one dispatch of one workgroup per
    /// (sequence, KV head) (`decode_fused.wgsl`) rather than the split step's three (two or
    /// one: [`Self::decode_route_workgroups`], [`Self::decode_merge_in_route`]). Default
    /// `false` (the split step was faster on the H200). Variable
    /// `PISA_DECODE` (`fused` or `split`).
    pub decode_fused: bool,
    /// Lanes per key row of the fused decode step's attention (a power of two up to 64);
    /// `None`: 4. A value above a cache's D / 4 is not used by that cache (it takes the
    /// default), and fewer lanes run where workgroup memory needs it. Variable
    /// `PISA_DECODE_LK`.
    pub decode_key_lanes: Option<u32>,
    /// The split decode step's `route` with its level steps on subgroup shuffles
    /// (`shaders/decode_levels_sg.wgsl`: two barriers a level instead of five) where the device
    /// has subgroups and the selection allows it (`lse`, at most 8 query heads per KV head, a
    /// merge factor that is a power of two, g times the row lanes within the smallest subgroup
    /// of at least 8). Read by decode caches made from now on
    /// ([`crate::ops::decode::KvCache::new`] copies it). Default `true`. Variable
    /// `PISA_DECODE_ROUTE_SG` (`0` or `1`).
    pub decode_route_subgroups: bool,
    /// The leaf slots' block attention of the split decode step's `route_leaf` dispatch with
    /// subgroup shuffles (`shaders/decode_attend_sg.wgsl`: one barrier a block instead of
    /// seven) where its route runs on subgroup shuffles too ([`Self::decode_route_subgroups`])
    /// and the plan's shapes allow it (the block one chunk, its key rows' lanes and the P.V
    /// parts within the smallest subgroup). Read by decode caches made from now on. Default
    /// `false`: on the H100 it made the step 1.9 to 2.9 us slower at 64K and 1M
    /// (docs/benchmarks.md A.60), though the block attention of the leaf slots it shortens adds
    /// about 11 us to the route's 25 at a 1M cache, of which leaving out every key and value
    /// load saves only 2 (A.59). Tested both ways against the reference on lavapipe (subgroups
    /// of 8, 32 and 64; shuffles within lane groups of 8 and 16 there, as lavapipe's shuffle
    /// lanes are capped at 16) and on the H100 (groups of 32). Variable `PISA_DECODE_LEAF_SG`
    /// (`0` or `1`).
    pub decode_leaf_subgroups: bool,
    /// The leaf slots' block attention of the split decode step's `route_leaf` dispatch loads
    /// each P.V invocation's value rows with the keys (`PVR` rows held in registers, so that
    /// their memory round trip overlaps the keys'), as the `leaf` dispatch does; `false` loads
    /// them in the P.V loop (`PVR` 1; not the subgroup attention of
    /// [`Self::decode_leaf_subgroups`], which always loads them ahead), for the registers of
    /// a workgroup as wide as the route's (544 invocations at K 16: at most 120 registers
    /// each). Read by decode caches made from now on. Default `true`: on the H100 `false` made
    /// the step at 1M 3.8 us slower (47.5 against 43.7), and the kernel holds 96 registers
    /// and spills nothing either way (docs/benchmarks.md A.86). Variable
    /// `PISA_DECODE_LEAF_PREFETCH` (`0` or `1`).
    pub decode_leaf_prefetch: bool,
    /// The most workgroups the split decode step may give its `route` and `leaf` dispatches as
    /// one (`route_leaf`, `shaders/decode_route_leaf.wgsl`; 0 to 65536): each (sequence, KV
    /// head) is routed by as many workgroups as its leaf slots need (NS / NB, NB slots
    /// attended at once by each), each routing the same way and then attending its slots, so
    /// the step is two dependent dispatches instead of three (one with
    /// [`Self::decode_merge_in_route`]). Where B * Hkv times that is
    /// above this (or the kernel does not fit the device), the three dispatches run. Read by
    /// decode caches made from now on. Default 104 on adapters named H100 or H200 (132 SMs: 13
    /// workgroups per KV head at B * Hkv = 8; 13 copies of the route took no longer than one
    /// there, 50 nearly three times as long, docs/benchmarks.md A.26), 0 (never) elsewhere
    /// until measured. Variable `PISA_DECODE_ROUTE_WG`.
    pub decode_route_workgroups: u32,
    /// Where `route_leaf` runs ([`Self::decode_route_workgroups`]), its last workgroup of each
    /// (sequence, KV head) to finish also does the `merge` dispatch's cut and merge
    /// (`route_leaf_merge`, `shaders/decode_route_leaf_merge.wgsl`), so the step is one
    /// dispatch, on Vulkan devices with `Features::MEMORY_DECORATION_COHERENT` and 13 storage
    /// buffers per shader stage (the two dispatches run elsewhere: the last workgroup's view
    /// of the others' states rests on SPIR-V's barrier semantics). Read by decode caches made
    /// from now on. Default `true`: on the H100 the step took 44.2 / 37.1 / 32.5 /
    /// 20.0 us at 1M / 64K / 8K / 1K tokens against 46.4 / 39.1 / 34.4 / 20.8 with the two
    /// dispatches (one round of docs/benchmarks.md A.81; the other within 0.3 us). Variable
    /// `PISA_DECODE_MERGE_IN_ROUTE` (`0` or `1`).
    pub decode_merge_in_route: bool,
    /// Leaves scored per iteration by the query-tile tensor-core scorer (1 to 4). Default 2.
    /// Variable `PISA_LEAF_LPI`.
    pub leaf_tiles_per_iteration: u32,
    /// Subgroups (16-row tiles) of a leaf-major WGSL tensor-core scoring workgroup (2 or 4;
    /// the NVIDIA scorer's chunks have 128 rows whatever this says). Default 4. Variable
    /// `PISA_LEAF_NSG`.
    pub leaf_subgroups: u32,
    /// Whether the leaf-major tensor-core scorer stages the leaf's keys in workgroup memory
    /// (where its plan allows). Default `true`. Variable `PISA_LEAF_KSTAGE` (`0` or `1`).
    pub leaf_stage_keys: bool,
    /// Lanes per (candidate, head group) of the routing kernel: 1, 2, 4, 8 or 16 (those used
    /// divide ceil(D / 4)). Default 4. Variable `PISA_ROUTE_LANES`.
    pub route_lanes: u32,
    /// Most invocations of a routing workgroup, 32 to 1024 (never above the device's limit).
    /// Default 256. Variable `PISA_ROUTE_MAX_WG`.
    pub route_max_workgroup: u32,
    /// Queries per routing workgroup, 1 to 16 (lowered to fit workgroup memory); `None`: the
    /// tile that fills the workgroup. Variable `PISA_ROUTE_TILE`.
    pub route_tile: Option<u32>,
    /// The routing kernel's subgroup score step (`shaders/route_sg.wgsl`: each query's lanes
    /// hold their dims of its heads in registers, the lanes and head groups summed by subgroup
    /// shuffles) where the device has subgroups and the selection allows it (`lse`, at most 16
    /// query heads per KV head, a query's head groups times at least 2 lanes within the
    /// smallest subgroup, D a multiple of 4 lanes); then `route_lanes`, `route_max_workgroup`
    /// and `route_tile` do not apply. Default `true`: on the H200 (2026-12-02, f16, Hq 32, Hkv
    /// 8, D 128, C 64, K 16) the route took 10.8 / 63.5 ms at 64K / 256K tokens against 14.6 /
    /// 88.7 through workgroup memory; 4 or 16 lanes per query instead of 8, 12.2 / 71.7 and
    /// 11.8 / 74.0; with GQA group 8 (Hq 64) 20.6 against 32.6 ms at 64K (docs/benchmarks.md).
    /// Variable `PISA_ROUTE_SUBGROUPS` (`0` or `1`).
    pub route_subgroups: bool,
    /// Most nodes per query of the routing table (`ops/route.rs`): the scores of every node
    /// of the top pyramid levels, from the start level down while their nodes add up to at
    /// most this, computed for a tile of queries as matrix products, so that routing looks
    /// those levels up instead of scoring them. 0 turns it off. Used where a table kernel runs:
    /// the NVIDIA one (`shaders/nv/route_table.comp`), or the portable one when
    /// [`Tuning::route_table_portable`] asks. Default 96: the two top levels for merge factor
    /// 2 (the start level has at most 32 nodes); for larger factors the start level only. On the H200 (2026-12-02, f16, Hq 32, Hkv 8, D 128, C 64, K 16),
    /// with the routing kernel's subgroup score step, the route took 10.35 / 62.07 ms at 64K /
    /// 256K tokens with 96 nodes, 10.73 / 63.54 with 224 and 10.65 / 62.83 without the table;
    /// before that step (routing through workgroup memory) 224 nodes were the fastest, 14.6 /
    /// 88.7 ms against 15.7 / 93.6 without (docs/benchmarks.md). Variable
    /// `PISA_ROUTE_TABLE_NODES`.
    pub route_table_nodes: u32,
    /// The portable table kernel (`shaders/route_table.wgsl`, scalar) where the NVIDIA one
    /// does not run. Default `false`: it is there so that the routing's table path runs on
    /// every device (tests), not for speed. Variable `PISA_ROUTE_TABLE_PORTABLE` (`0` or `1`).
    pub route_table_portable: bool,
    /// Queries per routing-table chunk (the table and the routing run per chunk, so that the
    /// table buffer stays small), rounded down to whole routing tiles (at least one), and no
    /// more than fit in 256 MiB; `None`: as many as fit. Variable `PISA_ROUTE_TABLE_QUERIES`.
    pub route_table_queries: Option<u32>,
    /// A diagnostic, not a speed knob: the folder into which the context writes the
    /// preprocessed WGSL of every pipeline it builds, one file per pipeline
    /// (`<shader>.<entry>.<F16|F32|Bf16>.<hash of constants and overrides>.wgsl`, its first
    /// lines `// entry: <entry>` and `// overrides: <name>=<value>,...`), for offline tools
    /// (`tests/shader_stats.rs` reads the driver's register and memory statistics of each). A
    /// write that fails is reported on stderr and otherwise ignored: the dump never changes
    /// what runs. Fixed when the context is made, as `shader_checks`. Default `None`; `off`
    /// by name (a folder named so: `./off`); by name or variable the folder's name is trimmed
    /// and must be UTF-8 (a [`GpuError::Tuning`] otherwise). Variable `PISA_DUMP_WGSL`.
    pub dump_wgsl: Option<std::path::PathBuf>,
    /// A diagnostic for kernel development, not a speed knob: a folder of kernels that replace
    /// the library's, so that a variant of a kernel can be timed with a release build. A WGSL
    /// pipeline whose file, named as [`Self::dump_wgsl`] names it, is there is built from that
    /// file instead of its preprocessed source (the constants already in the text): dump,
    /// edit a copy, run with this folder. An NVIDIA kernel (`shaders/nv`) whose
    /// `<kernel>.spv` is there (the name of `shaders/nv/kernels.txt`) is built from that
    /// SPIR-V instead of the embedded one, which must declare the same bindings. The files are
    /// trusted as the library's own kernels are (the same runtime checks: a variant that
    /// breaks its kernel's invariants may read or write out of bounds, and its results are
    /// its own), and each use is logged as a warning. Fixed when the context is made. Default
    /// `None`; `off` by name; the folder must exist. A file that cannot be read, SPIR-V that
    /// is not a module or whose bindings differ, is an [`GpuError::Unsupported`] of that
    /// kernel (an NVIDIA kernel then runs its WGSL fallback, as for one the driver refuses);
    /// WGSL that is not valid a [`GpuError::Validation`]. Variable `PISA_SHADER_OVERRIDE`.
    pub shader_override: Option<std::path::PathBuf>,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            tensor_cores: true,
            nv_cm2: true,
            nv_scorer: true,
            leaf_score_pairs: true,
            attention_pairs: true,
            leaf_order: LeafOrder::Auto,
            shader_checks: None,
            decode_fused: false,
            decode_key_lanes: None,
            decode_route_subgroups: true,
            decode_leaf_subgroups: false,
            decode_leaf_prefetch: true,
            decode_route_workgroups: 0,
            decode_merge_in_route: true,
            leaf_tiles_per_iteration: 2,
            leaf_subgroups: COOP_SUBGROUPS,
            leaf_stage_keys: true,
            route_lanes: 4,
            route_max_workgroup: 256,
            route_tile: None,
            route_subgroups: true,
            route_table_nodes: 96,
            route_table_portable: false,
            route_table_queries: None,
            dump_wgsl: None,
            shader_override: None,
        }
    }
}

/// The knobs by name: `(name, environment variable)`, in the order of [`Tuning`]'s fields.
/// [`Tuning::set`] takes the names, [`Tuning::with_env`] the variables.
pub const KNOBS: [(&str, &str); 26] = [
    ("tensor_cores", "PISA_KERNEL_PATH"),
    ("nv_cm2", "PISA_NV_CM2"),
    ("nv_scorer", "PISA_NV_SCORER"),
    ("leaf_score_pairs", "PISA_LEAF_PAIRS"),
    ("attention_pairs", "PISA_ATTENTION_PAIRS"),
    ("leaf_order", "PISA_LEAF_ORDER"),
    ("shader_checks", "PISA_SHADER_CHECKS"),
    ("decode_fused", "PISA_DECODE"),
    ("decode_key_lanes", "PISA_DECODE_LK"),
    ("decode_route_subgroups", "PISA_DECODE_ROUTE_SG"),
    ("decode_leaf_subgroups", "PISA_DECODE_LEAF_SG"),
    ("decode_leaf_prefetch", "PISA_DECODE_LEAF_PREFETCH"),
    ("decode_route_workgroups", "PISA_DECODE_ROUTE_WG"),
    ("decode_merge_in_route", "PISA_DECODE_MERGE_IN_ROUTE"),
    ("leaf_tiles_per_iteration", "PISA_LEAF_LPI"),
    ("leaf_subgroups", "PISA_LEAF_NSG"),
    ("leaf_stage_keys", "PISA_LEAF_KSTAGE"),
    ("route_lanes", "PISA_ROUTE_LANES"),
    ("route_max_workgroup", "PISA_ROUTE_MAX_WG"),
    ("route_tile", "PISA_ROUTE_TILE"),
    ("route_subgroups", "PISA_ROUTE_SUBGROUPS"),
    ("route_table_nodes", "PISA_ROUTE_TABLE_NODES"),
    ("route_table_portable", "PISA_ROUTE_TABLE_PORTABLE"),
    ("route_table_queries", "PISA_ROUTE_TABLE_QUERIES"),
    ("dump_wgsl", "PISA_DUMP_WGSL"),
    ("shader_override", "PISA_SHADER_OVERRIDE"),
];

impl Tuning {
    /// The defaults for an adapter: measured on the NVIDIA H200, and right (not tuned)
    /// elsewhere. They are [`Tuning::default`] on every adapter but the H100 and H200, where the
    /// decode route runs as 104 workgroups ([`Tuning::decode_route_workgroups`]), and a
    /// browser's fallback adapter (WebGPU on a CPU: Chrome's SwiftShader on a machine without
    /// a GPU), where selection stage 2 and sparse attention run leaf-major
    /// ([`Tuning::leaf_order`] [`LeafOrder::Leaves`]): SwiftShader does not finish compiling
    /// the query-tile kernel of stage 2 in minutes, and the browser's GPU watchdog then ends
    /// its GPU process, which loses the device (`examples/web/test.mjs`).
    pub fn for_adapter(report: &AdapterReport) -> Self {
        let mut t = Self::default();
        // 132 SMs: the decode route's copies run on SMs the route leaves idle.
        if report.name.contains("H100") || report.name.contains("H200") {
            t.decode_route_workgroups = 104;
        }
        // (the report holds the Debug names of wgpu's enums)
        let web = report.backend == format!("{:?}", wgpu::Backend::BrowserWebGpu);
        if web && report.device_type == format!("{:?}", wgpu::DeviceType::Cpu) {
            t.leaf_order = LeafOrder::Leaves;
        }
        t
    }

    /// `self` with the `PISA_*` environment variables of [`KNOBS`] applied (unset or empty
    /// ones leave their knob as it is). Errors: [`GpuError::Tuning`] naming the variable whose
    /// value is not one its knob takes, or is not UTF-8 (a value is never silently ignored).
    pub fn with_env(self) -> Result<Self> {
        self.with_env_except(&[])
    }

    /// [`Tuning::with_env`] but for the knobs named in `skip` (by knob or variable name), whose
    /// variables are not read at all: a program that sets those knobs itself afterwards (as
    /// `pisa --tune` does) is not stopped by a bad value it overrides. Errors: as
    /// [`Tuning::with_env`], for the variables read.
    pub fn with_env_except(mut self, skip: &[&str]) -> Result<Self> {
        for (name, var) in KNOBS {
            if skip.iter().any(|s| *s == name || *s == var) {
                continue;
            }
            let Some(raw) = std::env::var_os(var) else {
                continue;
            };
            let Some(v) = raw.to_str() else {
                return Err(GpuError::Tuning(format!("{var}: not UTF-8 ({raw:?})")));
            };
            if v.trim().is_empty() {
                continue;
            }
            self.set_text(name, v)
                .map_err(|e| GpuError::Tuning(format!("{var}={v}: {e}")))?;
        }
        Ok(self)
    }

    /// Sets the knob `name` (a name of [`KNOBS`], or its variable) from text: `true`/`false`,
    /// `on`/`off` or `1`/`0` for switches (and `coopmat`/`portable` for `tensor_cores`,
    /// `fused`/`split` for `decode_fused`); a number for sizes, or `auto` for the default of an
    /// optional one (`decode_key_lanes`, `route_tile`); `auto`, `tiles` or `leaves` for
    /// `leaf_order`; `auto`, `all`, `bounds`, `none` (no checks) or `driver_bounded` for
    /// `shader_checks`; a folder, or `off`, for `dump_wgsl` (made if missing, and written once
    /// to check it can be) and `shader_override` (which must exist).
    ///
    /// Errors: [`GpuError::Tuning`] for an unknown name, a value out of the knob's range, a
    /// `dump_wgsl` folder that cannot be made or written, or a `shader_override` folder that is
    /// not there.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        self.set_text(name, value).map_err(GpuError::Tuning)
    }

    /// [`Tuning::set`] with the error as text.
    fn set_text(&mut self, name: &str, value: &str) -> std::result::Result<(), String> {
        let v = value.trim();
        let bad = |what: &str| format!("{name}: `{v}` is not {what}");
        let switch = |yes: &str, no: &str| match v {
            "1" | "true" | "on" => Ok(true),
            "0" | "false" | "off" => Ok(false),
            _ if !yes.is_empty() && v == yes => Ok(true),
            _ if !no.is_empty() && v == no => Ok(false),
            _ if yes.is_empty() => Err(bad("a switch (1/0, true/false, on/off)")),
            _ => Err(bad(&format!(
                "{yes}, {no} or a switch (1/0, true/false, on/off)"
            ))),
        };
        let num = |lo: u32, hi: u32| {
            v.parse::<u32>()
                .ok()
                .filter(|n| (lo..=hi).contains(n))
                .ok_or_else(|| bad(&format!("a whole number from {lo} to {hi}")))
        };
        // A number from one of `set` (named in full by the error: a range would claim the
        // values between its members).
        let one_of = |set: &[u32], what: &str| {
            v.parse::<u32>()
                .ok()
                .filter(|n| set.contains(n))
                .ok_or_else(|| bad(what))
        };
        let auto = v == "auto";
        let name = KNOBS
            .iter()
            .find(|(n, e)| *n == name || *e == name)
            .map(|(n, _)| *n)
            .ok_or_else(|| {
                format!(
                    "unknown knob `{name}` (known: {})",
                    KNOBS.map(|k| k.0).join(", ")
                )
            })?;
        match name {
            "tensor_cores" => self.tensor_cores = switch("coopmat", "portable")?,
            "nv_cm2" => self.nv_cm2 = switch("", "")?,
            "nv_scorer" => self.nv_scorer = switch("", "")?,
            "leaf_score_pairs" => self.leaf_score_pairs = switch("", "")?,
            "attention_pairs" => self.attention_pairs = switch("", "")?,
            "leaf_order" => {
                self.leaf_order = match v {
                    "auto" => LeafOrder::Auto,
                    "tiles" => LeafOrder::Tiles,
                    "leaves" => LeafOrder::Leaves,
                    _ => return Err(bad("auto, tiles or leaves")),
                }
            }
            "shader_checks" => {
                self.shader_checks = match v {
                    "all" => Some(ShaderChecks::All),
                    "bounds" => Some(ShaderChecks::Bounds),
                    "none" => Some(ShaderChecks::None),
                    "driver_bounded" => Some(ShaderChecks::DriverBounded),
                    "auto" => None,
                    _ => return Err(bad("all, bounds, none, driver_bounded or auto")),
                }
            }
            "decode_fused" => self.decode_fused = switch("fused", "split")?,
            "decode_route_subgroups" => self.decode_route_subgroups = switch("", "")?,
            "decode_leaf_subgroups" => self.decode_leaf_subgroups = switch("", "")?,
            "decode_leaf_prefetch" => self.decode_leaf_prefetch = switch("", "")?,
            "decode_route_workgroups" => self.decode_route_workgroups = num(0, 65536)?,
            "decode_merge_in_route" => self.decode_merge_in_route = switch("", "")?,
            "decode_key_lanes" if auto => self.decode_key_lanes = None,
            "decode_key_lanes" => {
                let n = one_of(&[1, 2, 4, 8, 16, 32, 64], "1, 2, 4, 8, 16, 32, 64 or auto")?;
                self.decode_key_lanes = Some(n)
            }
            "leaf_tiles_per_iteration" => self.leaf_tiles_per_iteration = num(1, 4)?,
            "leaf_subgroups" => self.leaf_subgroups = one_of(&[2, 4], "2 or 4")?,
            "leaf_stage_keys" => self.leaf_stage_keys = switch("", "")?,
            "route_lanes" => self.route_lanes = one_of(&[1, 2, 4, 8, 16], "1, 2, 4, 8 or 16")?,
            "route_max_workgroup" => self.route_max_workgroup = num(32, 1024)?,
            "route_tile" if auto => self.route_tile = None,
            "route_tile" => {
                let n = num(1, 16).map_err(|_| bad("a whole number from 1 to 16 or auto"))?;
                self.route_tile = Some(n)
            }
            "route_subgroups" => self.route_subgroups = switch("", "")?,
            "route_table_nodes" => self.route_table_nodes = num(0, 4096)?,
            "route_table_portable" => self.route_table_portable = switch("", "")?,
            "route_table_queries" if auto => self.route_table_queries = None,
            "route_table_queries" => {
                let n = num(1, 1 << 24)
                    .map_err(|_| bad("a whole number from 1 to 16777216 or auto"))?;
                self.route_table_queries = Some(n)
            }
            "dump_wgsl" if v == "off" => self.dump_wgsl = None,
            "dump_wgsl" if v.is_empty() => return Err(bad("a folder or off")),
            // A path that exists and is not a folder could never take the files (each write
            // would fail on stderr while the run went on).
            "dump_wgsl"
                if std::path::Path::new(v).exists() && !std::path::Path::new(v).is_dir() =>
            {
                return Err(bad("a folder or off (this path is a file)"))
            }
            // Made and written once here, so that a folder the dump cannot write is refused
            // with the knob instead of reported at every pipeline while the run goes on.
            "dump_wgsl" => {
                let dir = std::path::Path::new(v);
                if let Err(e) = writable_folder(dir) {
                    return Err(bad(&format!("a folder pisa can write ({e})")));
                }
                self.dump_wgsl = Some(dir.to_path_buf())
            }
            "shader_override" if v == "off" => self.shader_override = None,
            "shader_override" if !std::path::Path::new(v).is_dir() => {
                return Err(bad("an existing folder or off"))
            }
            "shader_override" => self.shader_override = Some(std::path::PathBuf::from(v)),
            _ => unreachable!("every name of KNOBS has a case"),
        }
        Ok(())
    }

    /// Checks every knob's range, that a `dump_wgsl` folder can be made and written, and that
    /// a `shader_override` folder exists and is not the dump's (whose writes would replace
    /// the edited files); fields set directly skip [`Tuning::set`]'s checks.
    /// Errors: [`GpuError::Tuning`] naming the first knob out of range.
    pub fn check(&self) -> Result<()> {
        let mut t = self.clone();
        let nums = [
            ("decode_key_lanes", self.decode_key_lanes),
            (
                "decode_route_workgroups",
                Some(self.decode_route_workgroups),
            ),
            (
                "leaf_tiles_per_iteration",
                Some(self.leaf_tiles_per_iteration),
            ),
            ("leaf_subgroups", Some(self.leaf_subgroups)),
            ("route_lanes", Some(self.route_lanes)),
            ("route_max_workgroup", Some(self.route_max_workgroup)),
            ("route_tile", self.route_tile),
            ("route_table_nodes", Some(self.route_table_nodes)),
            ("route_table_queries", self.route_table_queries),
        ];
        for (name, v) in nums {
            if let Some(v) = v {
                t.set(name, &v.to_string())?;
            }
        }
        // The dump folder as `set` checks it (a path that is a file, or a folder pisa cannot
        // make or write, would fail every pipeline's dump while the run went on).
        if let Some(dir) = &self.dump_wgsl {
            let bad = |what: String| {
                GpuError::Tuning(format!("dump_wgsl: `{}` is not {what}", dir.display()))
            };
            // (an empty or blank path, which `set` refuses, dumped into the working directory or
            // made a folder named by the blanks)
            if dir.to_str().is_some_and(|s| s.trim().is_empty()) {
                return Err(bad("a folder or off".into()));
            }
            if dir.exists() && !dir.is_dir() {
                return Err(bad("a folder or off (this path is a file)".into()));
            }
            writable_folder(dir).map_err(|e| bad(format!("a folder pisa can write ({e})")))?;
        }
        if let Some(dir) = &self.shader_override {
            let bad = |what: &str| {
                GpuError::Tuning(format!("shader_override: `{}` {what}", dir.display()))
            };
            if !dir.is_dir() {
                return Err(bad("is not an existing folder or off"));
            }
            if self.dump_wgsl.as_ref().is_some_and(|d| same_folder(d, dir)) {
                return Err(bad(
                    "is the dump_wgsl folder, whose dump would overwrite the files: use another",
                ));
            }
        }
        Ok(())
    }

    /// The speed knobs that differ from `base`, as `name=value` (what `pisa bench` records;
    /// the diagnostic `dump_wgsl` is not one, `shader_override` is: it changes what runs).
    pub fn changes_from(&self, base: &Tuning) -> Vec<String> {
        let (a, b) = (self.pairs(), base.pairs());
        a.into_iter()
            .zip(b)
            .filter(|(x, y)| x != y && x.0 != "dump_wgsl")
            .map(|((n, v), _)| format!("{n}={v}"))
            .collect()
    }

    /// Every knob as `(name, value)` in the text [`Tuning::set`] takes.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let opt = |v: Option<u32>| v.map_or("auto".to_string(), |n| n.to_string());
        let values = [
            self.tensor_cores.to_string(),
            self.nv_cm2.to_string(),
            self.nv_scorer.to_string(),
            self.leaf_score_pairs.to_string(),
            self.attention_pairs.to_string(),
            format!("{:?}", self.leaf_order).to_ascii_lowercase(),
            self.shader_checks
                .map_or("auto".to_string(), |c| c.to_string()),
            self.decode_fused.to_string(),
            opt(self.decode_key_lanes),
            self.decode_route_subgroups.to_string(),
            self.decode_leaf_subgroups.to_string(),
            self.decode_leaf_prefetch.to_string(),
            self.decode_route_workgroups.to_string(),
            self.decode_merge_in_route.to_string(),
            self.leaf_tiles_per_iteration.to_string(),
            self.leaf_subgroups.to_string(),
            self.leaf_stage_keys.to_string(),
            self.route_lanes.to_string(),
            self.route_max_workgroup.to_string(),
            opt(self.route_tile),
            self.route_subgroups.to_string(),
            self.route_table_nodes.to_string(),
            self.route_table_portable.to_string(),
            opt(self.route_table_queries),
            self.dump_wgsl
                .as_ref()
                .map_or("off".to_string(), |d| d.display().to_string()),
            self.shader_override
                .as_ref()
                .map_or("off".to_string(), |d| d.display().to_string()),
        ];
        KNOBS.iter().map(|k| k.0).zip(values).collect()
    }
}

/// Whether `a` and `b` name one folder (by their canonical paths where both resolve).
fn same_folder(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// Makes `dir` if missing and writes (then removes) a file in it: what the WGSL dump needs.
fn writable_folder(dir: &std::path::Path) -> std::io::Result<()> {
    // A probe file per call, not per process: contexts made at once on two threads probed
    // one file, and one's removal failed the other's ("No such file or directory").
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".pisa-dump-probe-{}-{n}", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A browser's fallback adapter (SwiftShader) runs leaf-major by default; a native CPU
    /// adapter (lavapipe) and a browser's GPU keep the default order; the H100 and H200 their
    /// decode route workgroups.
    #[test]
    fn per_adapter_defaults() {
        let report = |name: &str, backend: wgpu::Backend, ty: wgpu::DeviceType| AdapterReport {
            name: name.into(),
            vendor: 0,
            device: 0,
            backend: format!("{backend:?}"),
            device_type: format!("{ty:?}"),
            driver: String::new(),
            driver_info: String::new(),
            shader_f16: false,
            subgroups: false,
            subgroup_size: (0, 0),
            timestamps: false,
            cooperative_matrix: false,
            nv_cooperative_matrix2: false,
            memory_coherent: false,
            max_storage_binding: 1 << 27,
            max_buffer: 1 << 28,
            workgroup_memory: 16384,
            max_workgroups_per_dim: 65535,
            max_invocations: 256,
        };
        use wgpu::{Backend, DeviceType};
        let swiftshader = Tuning::for_adapter(&report("", Backend::BrowserWebGpu, DeviceType::Cpu));
        assert_eq!(swiftshader.leaf_order, LeafOrder::Leaves);
        assert_eq!(
            swiftshader,
            Tuning {
                leaf_order: LeafOrder::Leaves,
                ..Tuning::default()
            }
        );
        for (name, b, ty) in [
            (
                "llvmpipe (LLVM 15.0.6, 256 bits)",
                Backend::Vulkan,
                DeviceType::Cpu,
            ),
            ("", Backend::BrowserWebGpu, DeviceType::Other),
            (
                "NVIDIA GeForce RTX 4090",
                Backend::Vulkan,
                DeviceType::DiscreteGpu,
            ),
        ] {
            assert_eq!(
                Tuning::for_adapter(&report(name, b, ty)),
                Tuning::default(),
                "{name}"
            );
        }
        let h200 = Tuning::for_adapter(&report(
            "NVIDIA H200",
            Backend::Vulkan,
            DeviceType::DiscreteGpu,
        ));
        assert_eq!(h200.decode_route_workgroups, 104);
        assert_eq!(h200.leaf_order, LeafOrder::Auto);
        // The one-dispatch decode step's rule: Vulkan with the coherent feature, nothing else.
        let coherent = |b: Backend, c: bool| AdapterReport {
            memory_coherent: c,
            ..report("", b, DeviceType::DiscreteGpu)
        };
        assert_eq!(
            coherent(Backend::Vulkan, true).one_dispatch_decode(),
            Ok(())
        );
        for (b, c) in [
            (Backend::Vulkan, false),
            (Backend::Metal, true),
            (Backend::Dx12, true),
        ] {
            assert!(coherent(b, c).one_dispatch_decode().is_err(), "{b:?} {c}");
        }
    }

    /// Contexts made at once on several threads with one dump folder all find it writable
    /// (their probes once shared a file name, and one's removal failed another's check).
    #[test]
    fn dump_folder_probed_from_many_threads() {
        let dir = std::env::temp_dir().join(format!("pisa-probe-test-{}", std::process::id()));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let dir = dir.clone();
                std::thread::spawn(move || (0..200).all(|_| writable_folder(&dir).is_ok()))
            })
            .collect();
        let ok = threads.into_iter().all(|t| t.join().unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(ok, "a probe failed");
    }

    #[test]
    fn every_knob_round_trips_through_its_text() {
        let mut t = Tuning::default();
        for (name, v) in [
            ("tensor_cores", "portable"),
            ("nv_cm2", "0"),
            ("nv_scorer", "0"),
            ("leaf_score_pairs", "0"),
            ("attention_pairs", "0"),
            ("leaf_order", "leaves"),
            ("shader_checks", "bounds"),
            ("decode_fused", "fused"),
            ("decode_key_lanes", "8"),
            ("decode_route_subgroups", "0"),
            ("decode_leaf_subgroups", "1"),
            ("decode_leaf_prefetch", "0"),
            ("decode_route_workgroups", "40"),
            ("decode_merge_in_route", "0"),
            ("leaf_tiles_per_iteration", "3"),
            ("leaf_subgroups", "2"),
            ("leaf_stage_keys", "0"),
            ("route_lanes", "16"),
            ("route_max_workgroup", "512"),
            ("route_tile", "4"),
            ("route_subgroups", "0"),
            ("route_table_nodes", "512"),
            ("route_table_portable", "1"),
            ("route_table_queries", "1000"),
            ("dump_wgsl", "/tmp/wgsl"),
            ("shader_override", env!("CARGO_MANIFEST_DIR")),
        ] {
            t.set(name, v).unwrap();
        }
        let mut u = Tuning::default();
        for (name, v) in t.pairs() {
            u.set(name, &v).unwrap();
        }
        assert_eq!(t, u);
        // ... and back to every default, `auto` included.
        for (name, v) in Tuning::default().pairs() {
            u.set(name, &v).unwrap();
        }
        assert_eq!(u, Tuning::default());
        assert_eq!(t.changes_from(&Tuning::default()).len(), KNOBS.len() - 1);
        assert!(Tuning::default()
            .changes_from(&Tuning::default())
            .is_empty());
        t.check().unwrap();
    }

    /// `check` refuses an empty or blank dump folder set directly, as `set` does (it dumped
    /// into the working directory, or made a folder named by the blanks).
    #[test]
    fn check_refuses_a_blank_dump_folder() {
        for p in ["", " "] {
            let t = Tuning {
                dump_wgsl: Some(std::path::PathBuf::from(p)),
                ..Tuning::default()
            };
            assert!(matches!(t.check(), Err(GpuError::Tuning(_))), "{p:?}");
        }
    }

    /// A refusal of a knob taking a few values names them all (`route_lanes=0` said "from 1 to
    /// 16", as if 3 were taken), and `auto` where the knob takes it.
    #[test]
    fn refusals_name_every_value_taken() {
        let mut t = Tuning::default();
        for (name, v, want) in [
            ("route_lanes", "0", "1, 2, 4, 8 or 16"),
            ("route_lanes", "32", "1, 2, 4, 8 or 16"),
            ("decode_key_lanes", "0", "1, 2, 4, 8, 16, 32, 64 or auto"),
            ("decode_key_lanes", "Auto", "1, 2, 4, 8, 16, 32, 64 or auto"),
            ("leaf_subgroups", "1", "2 or 4"),
            ("route_tile", "17", "from 1 to 16 or auto"),
            ("route_table_queries", "0", "or auto"),
        ] {
            let e = t.set(name, v).unwrap_err().to_string();
            assert!(e.contains(want), "{name}={v}: {e}");
        }
    }

    /// `check` refuses a `shader_override` set directly (skipping `set`) that is not an
    /// existing folder, or that is the dump's folder (the dump would overwrite the edits).
    #[test]
    fn check_refuses_an_override_folder_it_cannot_use() {
        let here = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = std::env::temp_dir().join(format!("pisa-check-override-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let with = |o: std::path::PathBuf, d: Option<std::path::PathBuf>| Tuning {
            shader_override: Some(o),
            dump_wgsl: d,
            ..Tuning::default()
        };
        assert!(with(dir.clone(), None).check().is_ok());
        assert!(with(dir.join("."), Some(here.clone())).check().is_ok());
        for t in [
            with(dir.join("missing"), None),
            with(here.join("Cargo.toml"), None),
            with(dir.join("."), Some(dir.clone())),
        ] {
            assert!(matches!(t.check(), Err(GpuError::Tuning(_))), "{t:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_names_and_values_are_typed_errors() {
        let mut t = Tuning::default();
        for (name, v) in [
            ("route_lane", "4"),
            ("route_lanes", "3"),
            ("route_lanes", "32"),
            ("route_lanes", "x"),
            ("leaf_subgroups", "3"),
            ("route_max_workgroup", "16"),
            ("leaf_order", "random"),
            ("nv_cm2", "maybe"),
            ("decode_key_lanes", "6"),
            ("decode_key_lanes", "128"),
            ("leaf_tiles_per_iteration", "0"),
            ("leaf_tiles_per_iteration", "5"),
            ("route_tile", "17"),
            ("route_tile", "0"),
            ("nv_scorer", ""),
            ("leaf_order", "none"),
            ("shader_checks", "off"),
            ("dump_wgsl", " "),
            // A folder that cannot be made.
            ("dump_wgsl", "/proc/pisa-wgsl"),
            // A file, which could never take the dump.
            (
                "dump_wgsl",
                concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
            ),
        ] {
            assert!(
                matches!(t.set(name, v), Err(GpuError::Tuning(_))),
                "{name}={v} was taken"
            );
        }
        // A refusal names the values taken (a lane count of 6 was "not a power of two"
        // without its range).
        let e = t.set("decode_key_lanes", "6").unwrap_err().to_string();
        assert!(e.contains("64") && e.contains("auto"), "{e}");
        assert_eq!(t, Tuning::default(), "a refused value changed the tuning");
        // The variable names work too.
        t.set("PISA_ROUTE_TILE", "8").unwrap();
        assert_eq!(t.route_tile, Some(8));
        t.route_lanes = 5;
        assert!(matches!(t.check(), Err(GpuError::Tuning(_))));
        // Regression: a dump folder set on the field (as `Context::with_tuning` takes it)
        // skipped the folder check that `set` makes.
        for dir in [
            "/proc/pisa-wgsl",
            concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        ] {
            let t = Tuning {
                dump_wgsl: Some(dir.into()),
                ..Tuning::default()
            };
            assert!(
                matches!(t.check(), Err(GpuError::Tuning(_))),
                "{dir} was taken"
            );
        }
    }
}
