//! `pisa info`: adapters found, with the features and limits that matter.

use clap::Args;
use pisa_wgpu::DecodeStep;

/// Arguments of `pisa info`.
#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// The kernels each family runs on an adapter under the command's tuning, in the JSON
/// listing's words (the text listing says the same in sentences).
#[derive(serde::Serialize)]
struct Paths {
    /// `portable`, `coopmat` (KHR cooperative matrices) or `nv_cm2` (the NVIDIA kernels of
    /// `shaders/nv` for f16 attention and leaf scoring, coopmat for the rest of the hot path).
    kernel_path: &'static str,
    /// The prefill routing's score step: `subgroups` (where the selection allows it) or
    /// `workgroup_memory`.
    routing: &'static str,
    /// The decode route's level steps, as `routing`.
    decode_route: &'static str,
    /// The decode route_leaf's block attention, as `routing`.
    decode_leaf_attention: &'static str,
    /// The decode step's dispatches where its kernels fit: `fused` (one workgroup per KV
    /// head), `one_dispatch` (`route_leaf_merge`), `route_leaf_and_merge` or
    /// `three_dispatches` (route, leaf, merge).
    decode_step: &'static str,
}

impl Paths {
    fn of(r: &pisa_wgpu::AdapterReport, tuning: &pisa_wgpu::Tuning) -> Paths {
        let sg = |on: bool| if on { "subgroups" } else { "workgroup_memory" };
        let sg8 = r.subgroups && r.shuffle_lanes() >= 8;
        Paths {
            kernel_path: match (
                r.cooperative_matrix && tuning.tensor_cores,
                r.nv_cooperative_matrix2 && tuning.nv_cm2,
            ) {
                (false, _) => "portable",
                (true, false) => "coopmat",
                (true, true) => "nv_cm2",
            },
            routing: sg(r.subgroups && tuning.route_subgroups),
            decode_route: sg(sg8 && tuning.decode_route_subgroups),
            // (the library runs it only in the one-dispatch route and leaf, which a
            // decode_route_workgroups of 0 turns off, and with the route's subgroup steps:
            // ops/decode/record.rs, attend_subgroup_lanes and route_leaf_blocks)
            decode_leaf_attention: sg(sg8
                && tuning.decode_leaf_subgroups
                && tuning.decode_route_subgroups
                && tuning.decode_route_workgroups > 0),
            decode_step: match DecodeStep::planned(tuning, r) {
                DecodeStep::Fused => "fused",
                DecodeStep::OneDispatch => "one_dispatch",
                DecodeStep::RouteLeafAndMerge => "route_leaf_and_merge",
                DecodeStep::ThreeDispatches => "three_dispatches",
            },
        }
    }
}

/// One adapter of the JSON listing: its report's fields, then its [`Paths`].
#[derive(serde::Serialize)]
struct JsonEntry<'a> {
    #[serde(flatten)]
    report: &'a pisa_wgpu::AdapterReport,
    #[serde(flatten)]
    paths: Paths,
}

/// Lists every adapter.
pub fn run(a: InfoArgs) -> anyhow::Result<()> {
    let list = pisa_wgpu::list_adapters();
    // A knob set by name (--tune, PISA_*) that an adapter cannot use is said, as the commands
    // that open a device say it (on stderr: the listing, text or JSON, stays as it is).
    for (i, r) in list.iter().enumerate() {
        for line in crate::args::unavailable_asked_on(r, &format!("[{i}] {}", r.name)) {
            eprintln!("warning: {line}");
        }
    }
    if a.json {
        let entries = list
            .iter()
            .map(|r| {
                let tuning = crate::args::command_tuning_for(r)?;
                Ok(JsonEntry {
                    report: r,
                    paths: Paths::of(r, &tuning),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        crate::args::outln!("{}", serde_json::to_string_pretty(&entries)?)?;
    }
    // No adapter fails either way (the JSON listing, `[]`, is still printed first).
    if list.is_empty() {
        anyhow::bail!(
            "{}",
            pisa_wgpu::GpuError::NoAdapter(pisa_wgpu::INSTALL_HINT.into())
        );
    }
    if a.json {
        return Ok(());
    }
    for (i, r) in list.iter().enumerate() {
        let tuning = crate::args::command_tuning_for(r)?;
        // (the same choices as the JSON listing's, said with their reasons)
        let paths = Paths::of(r, &tuning);
        crate::args::outln!("[{i}] {} ({}, {})", r.name, r.backend, r.device_type)?;
        crate::args::outln!(
            "    vendor 0x{:04x} device 0x{:04x}, driver {} {}",
            r.vendor,
            r.device,
            r.driver,
            r.driver_info
        )?;
        crate::args::outln!(
            "    f16 {}, subgroups {} (size {}..{}{}), timestamps {}, cooperative matrix {}",
            yes(r.shader_f16),
            yes(r.subgroups),
            r.subgroup_size.0,
            r.subgroup_size.1,
            if r.subgroups && r.shuffle_lanes() < r.subgroup_size.0 {
                format!(
                    "; shuffles within {} lanes: llvmpipe's are wrong past them",
                    r.shuffle_lanes()
                )
            } else {
                String::new()
            },
            yes(r.timestamps),
            yes(r.cooperative_matrix)
        )?;
        crate::args::outln!(
            "    max storage binding {} MiB, max buffer {} MiB, workgroup memory {} KiB, {} workgroups/dim, {} invocations/workgroup",
            r.max_storage_binding >> 20,
            r.max_buffer >> 20,
            r.workgroup_memory / 1024,
            r.max_workgroups_per_dim,
            r.max_invocations
        )?;
        if r.cooperative_matrix {
            let path = if paths.kernel_path == "portable" {
                "portable (tuning tensor_cores=false)"
            } else {
                "coopmat where the device supports it: f16 attention and PISA leaf scoring on tensor cores, the rest portable (--tune tensor_cores=false or PISA_KERNEL_PATH=portable turns it off)"
            };
            crate::args::outln!("    kernel path: {path}")?;
            if r.nv_cooperative_matrix2 {
                let on = match paths.kernel_path == "nv_cm2" {
                    true => "f16 sparse and dense attention and leaf scoring run the NVIDIA kernels (shaders/nv; --tune nv_cm2=0 or PISA_NV_CM2=0 turns them off)",
                    false => "not used (tuning nv_cm2=false or tensor_cores=false)",
                };
                crate::args::outln!("    VK_NV_cooperative_matrix2: yes: {on}")?;
            }
        } else {
            crate::args::outln!("    kernel path: portable (f32 arithmetic, any subgroup size)")?;
        }
        // The routing's score step (pisa_wgpu::Tuning::route_subgroups; the library's rule
        // also needs `lse`, a GQA group of at most 16 and a fitting head dim).
        let sg = |p: &str| p == "subgroups";
        let route = match (r.subgroups, sg(paths.routing)) {
            (true, true) => "subgroup lanes for lse selections with GQA groups up to 16 (--tune route_subgroups=0 turns them off), workgroup memory otherwise",
            (true, false) => "workgroup memory (tuning route_subgroups=false)",
            (false, _) => "workgroup memory (no subgroups)",
        };
        crate::args::outln!("    routing: {route}")?;
        // The decode route's level steps (pisa_wgpu::Tuning::decode_route_subgroups; the
        // library's rule also needs `lse`, g_q up to 8 and a power-of-two merge factor).
        let sg8 = r.subgroups && r.shuffle_lanes() >= 8;
        let decode_route = match (sg8, sg(paths.decode_route)) {
            (true, true) => "subgroup level steps in the split step for lse selections with GQA groups up to 8 and a power-of-two merge factor (--tune decode_route_subgroups=0 turns them off), workgroup memory otherwise",
            (true, false) => "workgroup memory (tuning decode_route_subgroups=false)",
            (false, _) => "workgroup memory (no subgroups of 8 lanes or more)",
        };
        crate::args::outln!("    decode route: {decode_route}")?;
        // The block attention of route_leaf (pisa_wgpu::Tuning::decode_leaf_subgroups, off by
        // default; the library's rule also needs the route's subgroup steps and fitting shapes).
        let decode_leaf = if !sg8 {
            "workgroup memory (no subgroups of 8 lanes or more)"
        } else if sg(paths.decode_leaf_attention) {
            "subgroup shuffles in the one-dispatch route and leaf (where decode_route_workgroups allows it) when the route takes its subgroup steps and the block is one chunk, workgroup memory otherwise"
        } else if !tuning.decode_leaf_subgroups {
            "workgroup memory (tuning decode_leaf_subgroups=false, the default: 1.9 to 2.9 us slower a step on the H100, docs/benchmarks.md A.60)"
        } else if !tuning.decode_route_subgroups {
            "workgroup memory (decode_leaf_subgroups needs the route's subgroup steps: tuning decode_route_subgroups=false)"
        } else {
            "workgroup memory (decode_leaf_subgroups applies to the one-dispatch route and leaf, which tuning decode_route_workgroups=0 turns off: the leaf runs as its own dispatch)"
        };
        crate::args::outln!("    decode leaf attention: {decode_leaf}")?;
        // (The route and leaf run as one only where a cache's sequences x KV heads x copies
        // per head fit the budget: a cache past it runs the three dispatches, as `pisa bench`
        // and `pisa -vv decode` name.)
        let budget = format!(
            "where they fit and each cache's sequences x KV heads x copies per head are at most decode_route_workgroups={} (else three dispatches)",
            tuning.decode_route_workgroups
        );
        let decode_step = match DecodeStep::planned(&tuning, r) {
            DecodeStep::Fused => "one dispatch, one workgroup per KV head (tuning decode_fused=true), where it fits".to_string(),
            DecodeStep::OneDispatch => format!("one dispatch: route and leaf slots in several workgroups per KV head, the last to finish merging (decode_merge_in_route), {budget}"),
            DecodeStep::RouteLeafAndMerge => match r.one_dispatch_decode() {
                Ok(()) => format!("two dispatches: route and leaf slots in several workgroups per KV head, then the merge (--tune decode_merge_in_route=1 makes it one), {budget}"),
                Err(_) => format!("two dispatches: route and leaf slots in several workgroups per KV head, then the merge (the one dispatch, decode_merge_in_route, needs Vulkan and MEMORY_DECORATION_COHERENT), {budget}"),
            },
            DecodeStep::ThreeDispatches => "three dispatches: route, leaf slots, merge (decode_route_workgroups=0, the default except on the H100 and H200)".to_string(),
        };
        crate::args::outln!("    decode step: {decode_step}")?;
    }
    Ok(())
}
