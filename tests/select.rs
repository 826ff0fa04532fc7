//! GPU PISA selection (stage 1 routing + stage 2 leaf scoring) against the CPU reference
//! `select_pisa`, over scorings, causal / non-causal, forced blocks, merge factors, GQA groups,
//! head dims, layouts, storages and query tiles; plus input validation. A GPU row may differ from
//! the reference only where the reference's margin is a near-tie (`select_util::check`), in at
//! most 5% of the rows; where a case runs both Qtile 1 and 4, each is judged so against the
//! reference (they sum a score's terms in different orders, so a near-tie may fall either way
//! in each: `select_util::run_case`). The routing code paths are in `select_route.rs`.
mod common;
#[path = "select_util.rs"]
mod select_util;

use common::*;
use pisa_core::PisaError;
use pisa_wgpu::ops::select::{select_host, Method};
use pisa_wgpu::{GpuError, Storage};
use select_util::{base, group_cases, length_cases, run_case, run_short_lengths, Case};

#[test]
fn pisa_scorings_groups_and_head_dims() {
    let seed = seed("pisa_scorings_groups_and_head_dims");
    let mut r = rng(seed);
    // Qtile 1 against 4 as well for the C 8 case (select_by_leaf.rs checks it for every case).
    let tile1 = [false, false, false, true, false, false];
    for ((name, c), tile1) in group_cases().into_iter().zip(tile1) {
        run_case(name, c, &mut r, tile1);
    }
}

#[test]
fn pisa_lengths_layouts_and_tiles() {
    let seed = seed("pisa_lengths_layouts_and_tiles");
    let mut r = rng(seed);
    let long = Case {
        b: 1,
        hq: 1,
        hkv: 1,
        nq: 4099,
        nk: 4099,
        d: 32,
        k: 8,
        ..base()
    };
    let shared = length_cases().map(|(name, c)| (name, c, true));
    for (name, c, tile1) in shared
        .into_iter()
        .chain([("n 4099 d32 lse K8", long, false)])
    {
        run_case(name, c, &mut r, tile1);
    }
    run_short_lengths(&mut r, &[1, 15, 17]);
}

/// A large top_k over blocks of one key (514 candidates a query): the portable tile kernel's
/// invocations would pass llvmpipe's loop limit (65535 iterations in all, then every loop ends
/// silently: rows from ~380 on came out wrong, `pisa forward --block-size 1 --top-k 256`), so
/// on a loop-limited adapter the default order runs leaf-major there and an explicit query-tile
/// order is a `Limit` error; on others the tiles run. Either way the selection equals the
/// reference up to near-ties.
#[test]
fn a_top_k_past_the_loop_limit_is_right_or_refused() {
    let seed = seed("a_top_k_past_the_loop_limit_is_right_or_refused");
    let mut r = rng(seed);
    let c = Case::new(1, 1, 1, 600, 16, 1, 256);
    let _guard = settings_lock();
    let ctx = ctx();
    run_case("C 1 K 256 n 600 d 16 (default order)", c, &mut r, false);
    ctx.set_leaf_order(pisa_wgpu::LeafOrder::Tiles);
    let (q, k) = c.inputs(&mut r);
    let got = select_host(
        ctx,
        &q,
        &k,
        &c.shape(),
        c.layout,
        &c.cfg(),
        c.storage,
        Method::Pisa,
        1,
    );
    ctx.set_leaf_order(pisa_wgpu::LeafOrder::Auto);
    match (ctx.loop_limit(), got) {
        (Some(_), Err(GpuError::Limit { unit, .. })) => assert_eq!(unit, "loop iterations"),
        (None, Ok(sel)) => {
            let want = pisa_core::reference::select_pisa(&q, &k, &c.shape(), c.layout, &c.cfg());
            let ties = select_util::check("tiles", &sel, &want.unwrap(), c.tol(&q, &k));
            select_util::report("tiles", ties, 600);
        }
        (limit, other) => panic!("query tiles with loop limit {limit:?}: {other:?} (seed {seed})"),
    }
}

#[test]
fn invalid_inputs_are_typed_errors() {
    let ctx = ctx();
    let c = Case::new(1, 2, 1, 100, 64, 16, 4);
    let (shape, cfg) = (c.shape(), c.cfg());
    let q = vec![0.5f32; shape.q_elems()];
    let k = vec![0.25f32; shape.kv_elems()];
    let run = |q: &[f32], k: &[f32], cfg: &pisa_core::SelectionConfig| {
        select_host(
            ctx,
            q,
            k,
            &shape,
            c.layout,
            cfg,
            Storage::F32,
            Method::Pisa,
            4,
        )
    };
    match run(&q[1..], &k, &cfg) {
        Err(GpuError::Input(PisaError::BufferLen { what: "q", .. })) => {}
        other => panic!("short q: {other:?}"),
    }
    match run(&q, &k[..10], &cfg) {
        Err(GpuError::Input(PisaError::BufferLen { what: "k", .. })) => {}
        other => panic!("short k: {other:?}"),
    }
    let mut bad = cfg;
    bad.sink_blocks = 4;
    match run(&q, &k, &bad) {
        Err(GpuError::Input(PisaError::TopKBelowForced { .. })) => {}
        other => panic!("forced above K: {other:?}"),
    }
    let big = Case::new(1, 1, 1, 4, 600, 16, 4);
    let (s, cf) = (big.shape(), big.cfg());
    let (q, k) = (vec![0.1; s.q_elems()], vec![0.1; s.kv_elems()]);
    match select_host(
        ctx,
        &q,
        &k,
        &s,
        big.layout,
        &cf,
        Storage::F32,
        Method::Bsa,
        4,
    ) {
        Err(GpuError::Input(PisaError::HeadDim { head_dim: 600, .. })) => {}
        other => panic!("head dim 600: {other:?}"),
    }
}
