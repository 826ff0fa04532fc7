//! `pisa`: PISA block-sparse attention from the command line (prefill, decode, selection
//! quality, adapter info, benchmarks). See the README for examples.

mod cmd;

#[allow(unused_imports)]
pub(crate) use pisa_cli::{args, input, io, limits, text};

use clap::{Parser, Subcommand};

/// PISA: pyramid Top-K block-sparse attention on any Vulkan GPU (also OpenGL; Metal and DX12 through wgpu, not yet run there).
#[derive(Parser)]
#[command(name = "pisa", version, about, long_about = None)]
struct Cli {
    /// Log more on stderr: -v the device and kernel path, -vv every pipeline built, -vvv also
    /// wgpu's info logs and every dispatch (`pisa info` prints its report alike at every level).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Set a tuning knob of the kernels, KNOB=VALUE (repeatable; after the `PISA_*` variables).
    /// Knobs: tensor_cores, nv_cm2, nv_scorer, leaf_score_pairs, attention_pairs, leaf_order,
    /// shader_checks,
    /// decode_fused, decode_key_lanes, decode_route_subgroups, decode_leaf_subgroups,
    /// decode_leaf_prefetch,
    /// decode_route_workgroups, decode_merge_in_route,
    /// leaf_tiles_per_iteration,
    /// leaf_subgroups, leaf_stage_keys, route_lanes, route_max_workgroup, route_tile,
    /// route_subgroups, route_table_nodes, route_table_portable, route_table_queries
    /// (`pisa_wgpu::Tuning`): speed only, results are the same, selections up to near-ties of
    /// rounding. Values: 1/0 (true/false, on/off) for switches, a whole number for sizes and
    /// budgets (an out-of-range one is refused with its range; decode_route_workgroups is the
    /// most workgroups the decode step's route and leaf may take as one dispatch, 0 never: a
    /// cache that needs more runs three dispatches), auto/tiles/leaves for leaf_order,
    /// auto/all/bounds/none/driver_bounded for shader_checks. And dump_wgsl=DIR: write every
    /// pipeline's WGSL into DIR; shader_override=DIR: build a pipeline from the file of DIR named
    /// as the dump names it, an NVIDIA kernel from DIR/<kernel>.spv, where there is one
    /// (diagnostics, for timing a kernel's variant).
    #[arg(long, value_name = "KNOB=VALUE", global = true)]
    tune: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Adapters found, with the features and limits that matter to PISA.
    Info(cmd::info::InfoArgs),
    /// Prefill: block selection + sparse attention over Q, K, V read from files.
    Forward(cmd::forward::ForwardArgs),
    /// Prefill the first P tokens, then decode the rest one token at a time through the KV cache.
    Decode(cmd::decode::DecodeArgs),
    /// Selection quality: Recall@K and mass recall of lse, mean, meanvar and BSA vs the oracle
    /// (reads Q and K only: V may be absent).
    Recall(cmd::recall::RecallArgs),
    /// Forward, decode and recall on the embedded default input (no arguments needed).
    Demo(cmd::demo::DemoArgs),
    /// GPU-timed benchmark of PISA against BSA and dense attention.
    Bench(cmd::bench::BenchArgs),
}

fn main() {
    // Mesa's Vulkan drivers (lavapipe on headless machines) print "error: XDG_RUNTIME_DIR is
    // invalid or not set" once per WSI probe when it is unset, burying pisa's own one-line
    // errors; any existing directory quiets them. Set before any thread starts.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    // A closed pipe (`pisa info | head -1`) ends the process quietly, as it does other Unix
    // tools, instead of making `println!` panic: Rust's runtime ignores SIGPIPE unless told.
    #[cfg(unix)]
    // SAFETY: restores the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    if let Err(e) = args::set_tuning(&cli.tune) {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
    // -v and -vv raise pisa's own logs (the device opened, its kernel path and shader checks;
    // each pipeline built and its compile time); wgpu's stay at warn below -vvv.
    let level = match cli.verbose {
        0 => "warn",
        1 => "warn,pisa=info,pisa_wgpu=info,pisa_cli=info",
        2 => "warn,pisa=debug,pisa_wgpu=debug,pisa_cli=debug",
        // (naga's front end logs every type it resolves at debug: thousands of lines)
        _ => "info,naga=warn,pisa=trace,pisa_wgpu=trace,pisa_cli=trace",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level)).init();
    let res = match cli.command {
        Command::Info(a) => cmd::info::run(a),
        Command::Forward(a) => cmd::forward::run(a),
        Command::Decode(a) => cmd::decode::run(a),
        Command::Recall(a) => cmd::recall::run(a),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        let usage = e.downcast_ref::<args::UsageError>().is_some();
        std::process::exit(if usage { 2 } else { 1 });
    }
}
