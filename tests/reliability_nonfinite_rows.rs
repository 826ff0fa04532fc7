//! Reliability of the GPU library (`docs/reliability.md`): one NaN or infinite value in
//! one key or value row of a prefill ([`nonfinite_rows`]). What an affected row gets is
//! adapter-specific and printed; every adapter must give no error and no panic, rows in blocks
//! before the bad token's block bitwise unchanged, and valid selection indices. Three more tests
//! hold further invariants, each once a bug found by the reliability review: forced blocks stay in
//! every selection, masked future values reach no earlier row, unselected blocks reach no row.
//! (In the printed classes, `d` is a row equal within 1e-5 absolute to attention without the bad
//! token, in f64.)
mod common;
#[path = "reliability_util.rs"]
mod reliability_util;

use common::*;
use pisa_core::{AttentionShape, SelectionConfig};
use pisa_wgpu::ops::prefill::prefill_host;
use reliability_util::{bits, inputs, opts};

/// Attention of query row `row` (one head, `[N, D]` tensors) over the keys of `blocks` (size
/// `c`) up to position `row`, leaving out token `skip`, in f64.
#[allow(clippy::too_many_arguments)]
fn attend_without(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    c: usize,
    row: usize,
    blocks: &[i32],
    skip: usize,
) -> Vec<f64> {
    let s = 1.0 / (d as f64).sqrt();
    let mut scores = Vec::new();
    for &b in blocks.iter().filter(|&&b| b >= 0) {
        for t in (b as usize * c..(b as usize + 1) * c).filter(|&t| t <= row && t != skip) {
            let dot: f64 = (0..d)
                .map(|i| q[row * d + i] as f64 * k[t * d + i] as f64)
                .sum();
            scores.push((t, s * dot));
        }
    }
    let m = scores.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = scores.iter().map(|x| (x.1 - m).exp()).sum();
    let mut out = vec![0.0; d];
    for &(t, x) in &scores {
        let p = (x - m).exp() / z;
        for i in 0..d {
            out[i] += p * v[t * d + i] as f64;
        }
    }
    out
}

/// What [`nonfinite_rows`] saw that breaks an invariant, per case: rows whose selection lost
/// the forced own block, rows before the bad token that changed, and rows whose selection
/// skips the bad block that are not finite.
#[derive(Debug, Default)]
struct NonFinite {
    lost_own: Vec<(&'static str, Vec<usize>)>,
    leaked: Vec<(&'static str, Vec<usize>)>,
    unselected: Vec<(&'static str, Vec<usize>)>,
}

/// One non-finite value in one key or value row. WGSL leaves NaN and infinity arithmetic to the
/// implementation, so what an affected row gets is adapter-specific: this prints it
/// (docs/reliability.md records lavapipe's) and asserts what every adapter must give: no error
/// and no panic; rows in blocks before the bad token's block bitwise unchanged; every
/// selection index valid (in range or -1, ascending), so a NaN score never turns into an
/// out-of-range read. It returns the rows that break three further invariants (see the tests
/// below).
fn nonfinite_rows() -> NonFinite {
    let ctx = ctx();
    let mut found = NonFinite::default();
    // One query head, one KV head: row r is query r at position r.
    let (n, d, c, kk) = (64usize, 16usize, 8usize, 3usize);
    let shape = AttentionShape::new(1, 1, 1, n, n, d).unwrap();
    let cfg = SelectionConfig::new(c, kk).unwrap();
    let (q, k, v) = inputs(&shape, 9);
    let clean = prefill_host(ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    let clean_sel = clean.selection.as_ref().unwrap();
    let t_bad = 20; // block 2, tokens 16..24
    let b_bad = t_bad / c;
    for (what, x, on_key) in [
        ("NaN key", f32::NAN, true),
        ("+inf key", f32::INFINITY, true),
        ("-inf key", f32::NEG_INFINITY, true),
        ("NaN value", f32::NAN, false),
        ("+inf value", f32::INFINITY, false),
    ] {
        let (mut k2, mut v2) = (k.clone(), v.clone());
        if on_key {
            k2[t_bad * d + 3] = x;
        } else {
            v2[t_bad * d + 3] = x;
        }
        let got = prefill_host(ctx, &q, &k2, &v2, &shape, &opts(cfg)).unwrap();
        let sel = got.selection.as_ref().unwrap();
        // Per row of the bad block and after: `=` unchanged (before the bad token), `x` does
        // not attend the bad block (`X`: and is not finite); attending rows: `N` non-finite, `Z` zeros with LSE -inf
        // (looks like an empty row), `d` finite and equal to attention without the bad token,
        // `f` other finite.
        let (mut classes, mut lost_own, mut leaked) = (String::new(), Vec::new(), Vec::new());
        let mut unselected = Vec::new();
        for r in 0..n {
            let row_sel = &sel[r * kk..(r + 1) * kk];
            let mut prev = -1;
            for &j in row_sel {
                assert!(
                    j == -1 || (j > prev && j <= (r / c) as i32),
                    "{what}: row {r} {row_sel:?}"
                );
                if j >= 0 {
                    prev = j;
                }
            }
            if !row_sel.contains(&((r / c) as i32)) {
                lost_own.push(r);
            }
            let o = &got.out[r * d..(r + 1) * d];
            let unchanged = bits(o) == bits(&clean.out[r * d..(r + 1) * d]);
            if r < b_bad * c {
                assert!(
                    unchanged,
                    "{what}: row {r} (a block before the bad one) changed"
                );
                assert_eq!(row_sel, &clean_sel[r * kk..(r + 1) * kk]);
                continue;
            }
            if r < t_bad {
                // Same block, earlier position: the bad token is masked for this row.
                assert_eq!(row_sel, &clean_sel[r * kk..(r + 1) * kk]);
                if !unchanged {
                    leaked.push(r);
                }
                classes.push(if unchanged { '=' } else { 'N' });
                continue;
            }
            let finite = o.iter().all(|x| x.is_finite()) && got.lse[r].is_finite();
            if !row_sel.contains(&(b_bad as i32)) {
                if !finite {
                    unselected.push(r);
                }
                if !on_key && finite {
                    // A value does not enter the scores: same selection, same output.
                    assert_eq!(row_sel, &clean_sel[r * kk..(r + 1) * kk], "{what}: row {r}");
                    assert!(unchanged, "{what}: row {r} skips the bad block but changed");
                }
                classes.push(if finite { 'x' } else { 'X' });
            } else if got.lse[r] == f32::NEG_INFINITY && o.iter().all(|&x| x == 0.0) {
                classes.push('Z');
            } else if !finite {
                classes.push('N');
            } else {
                let want = attend_without(&q, &k, &v, d, c, r, row_sel, t_bad);
                let close = o
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| (*a as f64 - b).abs() < 1e-5);
                classes.push(if close { 'd' } else { 'f' });
            }
        }
        eprintln!(
            "{what} at token {t_bad} ({}): rows {}..{n}: {classes}",
            ctx.report().name,
            b_bad * c
        );
        eprintln!("  rows that lost their forced own block: {lost_own:?}");
        eprintln!("  rows before the bad token that changed: {leaked:?}");
        eprintln!("  rows not selecting the bad block that are not finite: {unselected:?}");
        found.lost_own.push((what, lost_own));
        found.leaked.push((what, leaked));
        found.unselected.push((what, unselected));
    }
    found
}

/// Asserts that no case of [`nonfinite_rows`] found a row breaking one of its invariants.
fn assert_no_rows(found: &[(&'static str, Vec<usize>)]) {
    assert!(found.iter().all(|(_, r)| r.is_empty()), "{found:?}");
}

#[test]
fn nonfinite_key_or_value_is_contained_to_rows_that_attend_to_it() {
    nonfinite_rows();
}

/// Forced blocks (the own block here) are part of every selection whatever the scores. (Found by
/// the reliability review: a NaN key made PISA prefill selections drop the own block from row 24
/// on, because NaN compares false both ways and the rank-based top-K kept too many candidates.)
#[test]
fn forced_blocks_survive_nonfinite_scores() {
    assert_no_rows(&nonfinite_rows().lost_own);
}

/// A masked (future) key of the own block must not touch the output of an earlier query. (Found
/// by the reliability review: a NaN or +inf value at token 20 made rows 16 to 19 NaN, because
/// masked keys were weighted by p = 0 in P.V, and 0 * NaN = NaN.)
#[test]
fn masked_future_values_do_not_reach_earlier_rows() {
    assert_no_rows(&nonfinite_rows().leaked);
}

/// A block a row did not select must not touch its output (e.g. through a neighbour of the same
/// query tile that did select it). (Found by the reliability review: the query-tiled kernel
/// weighted such a block by 0 for the rows that skipped it.)
#[test]
fn unselected_blocks_do_not_reach_a_row() {
    assert_no_rows(&nonfinite_rows().unselected);
}
