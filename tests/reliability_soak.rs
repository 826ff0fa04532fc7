//! Reliability of the GPU library (`docs/reliability.md`), a decode soak on a small
//! model-shaped cache: sequences reset at different lengths, replayed cycles must be bitwise equal
//! to the first ones, and checkpoints are compared with the CPU reference `DecodeState` (output
//! rel. L2 error <= 1e-4, LSE within 1e-4 * (1 + |lse|); a selection may differ from the
//! reference only where the reference's margin is under 1e-3, a tie, and is then checked as the
//! reference attention over the GPU's selection). `soak_short` runs here; `soak_100k_steps` is
//! `#[ignore]`d, run it in release:
//! `cargo test --release -p pisa-wgpu --test reliability_soak -- --ignored --nocapture`.
mod common;
#[path = "reliability_util.rs"]
mod reliability_util;

use common::*;
use pisa_core::reference::{self, DecodeState};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::Storage;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use reliability_util::bits;

/// Resident set size in bytes, from /proc/self/statm (0 where unavailable).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

struct SoakReport {
    steps: usize,
    checkpoints: usize,
    resets: usize,
    replays: usize,
    ties: usize,
    rss_after_warmup: u64,
    rss_max: u64,
    rss_end: u64,
}

/// Decodes `steps` steps of 2 sequences (Hq 8, Hkv 2, D 64, C 16, K 8, capacity `cap`):
/// sequence 0 resets when full, sequence 1 every `cap / 3 + 7` tokens, so lengths differ in
/// every dispatch. Sequence b's tokens in its cycle c come from a generator seeded by
/// `(b, c % 2)`: cycles 2, 3, ... replay cycles 0 and 1, and must give bitwise the same outputs
/// (a reset leaves nothing behind). Every `check_every` steps, each sequence is compared with
/// the CPU reference `DecodeState` fed the same tokens. RSS is sampled every 500 steps.
fn soak(steps: usize, cap: usize, check_every: usize) -> SoakReport {
    let ctx = ctx();
    let (hq, hkv, d) = (8, 2, 64);
    let cfg = SelectionConfig::new(16, 8).unwrap();
    let mut cache = KvCache::new(ctx, 2, cap, hq, hkv, d, cfg, Storage::F32).unwrap();
    let limits = [cap, cap / 3 + 7];
    let mut refs: Vec<DecodeState> = (0..2)
        .map(|_| DecodeState::new(hq, hkv, d, cfg).unwrap())
        .collect();
    let gen = |b: usize, c: usize| ChaCha8Rng::seed_from_u64(1000 + b as u64 * 10 + (c % 2) as u64);
    let mut cycle = [0usize; 2];
    let mut rngs = [gen(0, 0), gen(1, 0)];
    // Fingerprints of (out, lse) of the first two cycles, per (sequence, parity, position).
    let mut prints: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(), Vec::new()]; 2];
    let fp = |o: &[f32], l: &[f32]| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bits(o).hash(&mut h);
        bits(l).hash(&mut h);
        h.finish()
    };
    let mut rep = SoakReport {
        steps,
        checkpoints: 0,
        resets: 0,
        replays: 0,
        ties: 0,
        rss_after_warmup: 0,
        rss_max: 0,
        rss_end: 0,
    };
    let warmup = (2 * cap).min(steps / 2);
    let t0 = std::time::Instant::now();
    for step in 0..steps {
        for b in 0..2 {
            if cache.len(b).unwrap() == limits[b] {
                cache.reset(b).unwrap();
                assert_eq!(cache.len(b).unwrap(), 0);
                refs[b] = DecodeState::new(hq, hkv, d, cfg).unwrap();
                cycle[b] += 1;
                rngs[b] = gen(b, cycle[b]);
                rep.resets += 1;
            }
        }
        let (mut kr, mut vr, mut q) = (Vec::new(), Vec::new(), Vec::new());
        for r in rngs.iter_mut() {
            kr.extend(random(r, hkv * d, 1.0));
            vr.extend(random(r, hkv * d, 1.0));
            q.extend(random(r, hq * d, 1.5));
        }
        let check = step % check_every == check_every - 1 || step + 1 == steps;
        let o = cache
            .append_and_step(&kr, &vr, &[true, true], &q, check)
            .unwrap();
        for b in 0..2 {
            let n = hkv * d;
            refs[b]
                .append(&kr[b * n..(b + 1) * n], &vr[b * n..(b + 1) * n])
                .unwrap();
            assert_eq!(
                cache.len(b).unwrap(),
                refs[b].len(),
                "step {step} seq {b}: length"
            );
            let (ob, lb) = (
                &o.out[b * hq * d..(b + 1) * hq * d],
                &o.lse[b * hq..(b + 1) * hq],
            );
            let pos = cache.len(b).unwrap() - 1;
            let f = fp(ob, lb);
            let (par, c) = (cycle[b] % 2, cycle[b]);
            if c < 2 {
                prints[b][par].push(f);
            } else {
                assert_eq!(
                    prints[b][par][pos], f,
                    "step {step} seq {b}: cycle {c} position {pos} differs from cycle {par}"
                );
                rep.replays += 1;
            }
            if check {
                rep.checkpoints += 1;
                let qb = &q[b * hq * d..(b + 1) * hq * d];
                let want = refs[b].step_detailed(qb).unwrap();
                let k_ = cfg.top_k;
                let sel = &o.selection.as_ref().unwrap()[b * hkv * k_..(b + 1) * hkv * k_];
                let (want_o, want_l) = if sel == want.selection.as_slice() {
                    (want.out, want.lse)
                } else {
                    for h in 0..hkv {
                        let (g, w) = (
                            &sel[h * k_..(h + 1) * k_],
                            &want.selection[h * k_..(h + 1) * k_],
                        );
                        assert!(
                            g == w || want.margin[h] < 1e-3,
                            "step {step} seq {b} head {h}: selection {g:?} vs reference {w:?} (margin {})",
                            want.margin[h]
                        );
                    }
                    rep.ties += 1;
                    let shape = AttentionShape::new(1, hq, hkv, 1, refs[b].len(), d).unwrap();
                    reference::sparse_attention(
                        qb,
                        refs[b].keys(),
                        refs[b].values(),
                        &shape,
                        TensorLayout::Bnhd,
                        &cfg,
                        sel,
                    )
                    .unwrap()
                };
                let e = rel_err(ob, &want_o);
                assert!(e <= 1e-4, "step {step} seq {b}: output rel err {e}");
                for (x, y) in lb.iter().zip(&want_l) {
                    assert!(
                        (*x as f64 - y).abs() <= 1e-4 * (1.0 + y.abs()),
                        "step {step} seq {b}: lse {x} vs {y}"
                    );
                }
            }
        }
        if step % 500 == 499 || step + 1 == steps {
            let rss = rss_bytes();
            if step >= warmup && rep.rss_after_warmup == 0 {
                rep.rss_after_warmup = rss;
            }
            rep.rss_max = rep.rss_max.max(rss);
            rep.rss_end = rss;
        }
        if step % 10_000 == 9_999 {
            eprintln!(
                "soak: {} steps in {:.0?}, rss {} MiB",
                step + 1,
                t0.elapsed(),
                rss_bytes() >> 20
            );
        }
    }
    eprintln!(
        "soak: {} steps, {} checkpoints, {} resets, {} replayed steps bitwise equal, {} tie \
         selections, rss after warm-up {} MiB, max {} MiB, end {} MiB, {:.1?}",
        rep.steps,
        rep.checkpoints,
        rep.resets,
        rep.replays,
        rep.ties,
        rep.rss_after_warmup >> 20,
        rep.rss_max >> 20,
        rep.rss_end >> 20,
        t0.elapsed()
    );
    rep
}

#[test]
fn soak_short() {
    let r = soak(1_500, 256, 50);
    assert!(r.resets >= 5 && r.replays > 0);
}

/// The full soak: 100,000 steps (`PISA_SOAK_STEPS` overrides); memory must stay flat after
/// warm-up (growth under 32 MiB: a leak of one small buffer per step would show as far more).
#[test]
#[ignore = "long: 100,000 decode steps; run in release with --ignored"]
fn soak_100k_steps() {
    let steps = std::env::var("PISA_SOAK_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let r = soak(steps, 2048, 1000);
    assert!(r.resets >= steps / 2048);
    let growth = r.rss_max.saturating_sub(r.rss_after_warmup);
    assert!(
        growth < 32 << 20,
        "RSS grew by {} MiB after warm-up",
        growth >> 20
    );
}
