//! GPU PISA selection against the CPU reference `select_pisa` on the routing code paths of
//! stage 1: head dims not a multiple of 4, GQA groups of several head groups up to 32 heads, and
//! small candidate lists. Judged as in `select.rs` ([`select_util::run_case`]): a GPU row may
//! differ from the reference only where the reference's margin is a near-tie, in at most 5% of
//! the rows, and Qtile 1 and 4 must agree exactly where a case asks for both.
mod common;
#[path = "select_util.rs"]
mod select_util;

use common::*;
use pisa_core::Scoring::*;
use pisa_core::TensorLayout::*;
use pisa_wgpu::Storage::*;
use select_util::{base, run_case, Case};

/// Routing code paths: head dims not a multiple of 4 (scalar pyramid loads; an odd number of
/// vec4s gives one lane per candidate, scored without the partial-sum barrier), GQA groups of
/// several head groups (partial scores summed across invocations, up to the 32-head limit),
/// and small candidate lists (the widest query tile, with a partial last tile).
/// `PISA_ROUTE_LANES`, `PISA_ROUTE_TILE`, `PISA_ROUTE_MAX_WG` select other shapes.
#[test]
fn pisa_route_paths() {
    let seed = seed("pisa_route_paths");
    let mut r = rng(seed);
    let base = base();
    let cases = [
        (
            "gq5 d30 meanvar sink1",
            Case {
                b: 1,
                hq: 5,
                hkv: 1,
                nq: 500,
                nk: 500,
                d: 30,
                c: 8,
                k: 6,
                sink: 1,
                scoring: MeanVar,
                ..base
            },
            true,
        ),
        (
            "gq32 d64 lse non-causal",
            Case {
                b: 1,
                hq: 32,
                hkv: 1,
                nq: 300,
                nk: 300,
                c: 8,
                k: 4,
                causal: false,
                ..base
            },
            false,
        ),
        (
            "gq16 d34 mean local1 f16 bnhd",
            Case {
                b: 1,
                hq: 16,
                hkv: 1,
                nq: 400,
                nk: 400,
                d: 34,
                c: 8,
                k: 5,
                local: 1,
                scoring: Mean,
                storage: F16,
                layout: Bnhd,
                ..base
            },
            false,
        ),
        (
            "gq3 d18 lse g3 local1 (one task per candidate)",
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                nq: 450,
                nk: 450,
                d: 18,
                c: 8,
                k: 5,
                g: 3,
                local: 1,
                ..base
            },
            false,
        ),
        (
            "gq1 d6 lse K3 g4 wide tile",
            Case {
                b: 1,
                hq: 2,
                hkv: 2,
                nq: 777,
                nk: 777,
                d: 6,
                c: 4,
                k: 3,
                g: 4,
                ..base
            },
            true,
        ),
        // f16 storage: the kernel holds the queries as f16 pairs of heads (a pair past the
        // group's last head is half empty: GQ 1, 7).
        (
            "gq4 d128 lse f16",
            Case {
                b: 1,
                hq: 8,
                hkv: 2,
                nq: 333,
                nk: 333,
                d: 128,
                c: 8,
                k: 5,
                storage: F16,
                ..base
            },
            true,
        ),
        (
            "gq7 d36 meanvar sink1 f16",
            Case {
                b: 1,
                hq: 7,
                hkv: 1,
                nq: 410,
                nk: 410,
                d: 36,
                c: 8,
                k: 5,
                sink: 1,
                scoring: MeanVar,
                storage: F16,
                ..base
            },
            false,
        ),
        (
            "gq1 d20 lse g3 f16 bnhd",
            Case {
                b: 2,
                hq: 3,
                hkv: 3,
                nq: 290,
                nk: 290,
                d: 20,
                c: 4,
                k: 4,
                g: 3,
                storage: F16,
                layout: Bnhd,
                ..base
            },
            false,
        ),
    ];
    for (name, c, tile1) in cases {
        run_case(name, c, &mut r, tile1);
    }
}
