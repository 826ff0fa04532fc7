//! The bucketing of `leaf_bucket.wgsl` (steps 1-3 of the leaf-major stage 2) against a CPU
//! model of it, leaf buckets and pair buckets (PAIR = 1, the NVIDIA pair scorer's), on the
//! test adapter: the pair buckets are otherwise read only by the NVIDIA scorer, so this is
//! where devices without it check them. Random ascending candidate lists (sibling pairs,
//! lone leaves, forced leaves, -1 padding), causal and not, with sinks and local blocks, a
//! query offset, and an odd leaf count (the last pair has one leaf). Every bucket's entries
//! (order within a bucket is free: compared sorted), the offsets, the chunk offsets and every
//! chunk descriptor must equal the model's, and the slots the scorer writes from the lists
//! (checked apart from the model's rule) must be the scored slots, once each; the outputs are
//! poisoned before the run.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::ops::select::SelParams;
use crate::AdapterChoice;

const BOTH: u32 = 0x8000_0000;
const ODD: u32 = 0x4000_0000;

/// The selection parameters the bucket kernels read.
fn params(q_len: u32, q_pos0: u32, c: u32, k: u32, causal: bool, mc: u32) -> SelParams {
    let mut p: SelParams = bytemuck::Zeroable::zeroed();
    p.q_len = q_len;
    p.k_len = q_pos0 + q_len;
    p.block_size = c;
    p.top_k = k;
    p.causal = u32::from(causal);
    p.sink = 1;
    p.local = 1;
    p.nb0 = p.k_len.div_ceil(c);
    p.q_pos0 = q_pos0;
    p.mc = mc;
    p
}

/// `entry_leaf` of `leaf_bucket.wgsl`: the leaf of entry `e` when it is scored.
fn entry_leaf(p: &SelParams, cand: &[i32], e: usize) -> Option<u32> {
    let i = (e / p.mc as usize) as u32 % p.q_len;
    let bq = (p.q_pos0 + i) / p.block_size;
    let visible = if p.causal != 0 { bq + 1 } else { p.nb0 };
    let local_start = bq - p.local.min(bq);
    let sink_end = p.sink.min(local_start);
    let n_forced = sink_end + bq + 1 - local_start;
    if visible <= p.top_k || n_forced >= p.top_k {
        return None;
    }
    let c = u32::try_from(cand[e]).ok()?;
    let forced = c <= bq && (c < p.sink || c + p.local >= bq);
    (!forced).then_some(c)
}

/// The model's bucket lists: per bucket, its entries' list values, sorted.
fn model(p: &SelParams, cand: &[i32], bh: usize, pair: bool) -> Vec<Vec<u32>> {
    let mc = p.mc as usize;
    let units = if pair { p.nb0.div_ceil(2) } else { p.nb0 } as usize;
    let mut out = vec![Vec::new(); bh * units];
    let per_bh = p.q_len as usize * mc;
    for e in 0..cand.len() {
        let Some(j) = entry_leaf(p, cand, e) else {
            continue;
        };
        let (b, mut v) = (e / per_bh, (e % per_bh) as u32);
        let mut unit = j as usize;
        if pair {
            let prev = (e % mc > 0).then(|| entry_leaf(p, cand, e - 1)).flatten();
            if j % 2 == 1 && prev == Some(j - 1) {
                continue;
            }
            let next = (e % mc + 1 < mc)
                .then(|| entry_leaf(p, cand, e + 1))
                .flatten();
            if j % 2 == 1 {
                v |= ODD;
            } else if next == Some(j + 1) {
                v |= BOTH;
            }
            unit = j as usize / 2;
        }
        out[b * units + unit].push(v);
    }
    out.iter_mut().for_each(|l| l.sort_unstable());
    out
}

/// Ascending candidate lists of `mc` slots for `bh` x `q_len` queries: mostly both children of
/// random parents, some lone leaves, the query's own (forced) block now and then, -1 padded.
fn candidates(r: &mut ChaCha8Rng, p: &SelParams, bh: usize) -> Vec<i32> {
    let mc = p.mc as usize;
    let mut cand = Vec::with_capacity(bh * p.q_len as usize * mc);
    for _ in 0..bh {
        for i in 0..p.q_len {
            let bq = (p.q_pos0 + i) / p.block_size;
            let see = if p.causal != 0 { bq + 1 } else { p.nb0 };
            let mut row: Vec<i32> = Vec::new();
            for _ in 0..mc {
                let parent = r.random_range(0..see.div_ceil(2));
                for leaf in [2 * parent, 2 * parent + 1] {
                    if leaf < see && r.random_bool(0.85) {
                        row.push(leaf as i32);
                    }
                }
            }
            if r.random_bool(0.3) {
                row.push(bq.min(see - 1) as i32);
            }
            row.sort_unstable();
            row.dedup();
            row.truncate(r.random_range(0..=mc));
            row.resize(mc, -1);
            cand.extend(row);
        }
    }
    cand
}

#[test]
fn pair_and_leaf_buckets_equal_the_model() {
    let ctx = Context::new(&AdapterChoice::HighPerformance).expect("a GPU adapter");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let mut checked_pairs = 0;
    // (B * Hkv, Nq, query offset, C, K, causal, MC): nb0 = 22, 29 and 7 (the last two odd:
    // their last pair has one leaf).
    for (bh, q_len, q_pos0, c, k, causal, mc) in [
        (3, 300, 37, 16, 4, true, 10),
        (2, 201, 0, 7, 5, true, 12),
        (5, 97, 3, 16, 4, false, 9),
    ] {
        let p = params(q_len, q_pos0, c, k, causal, mc);
        let cand = candidates(&mut r, &p, bh);
        let t = ctx.upload_u32("candidates", &cand).unwrap();
        for pair in [false, true] {
            let units = if pair { p.nb0.div_ceil(2) } else { p.nb0 } as u64;
            let qpc = 4;
            let z = BucketSizes {
                entries: cand.len() as u64,
                buckets: bh as u64 * units,
                chunks: (cand.len() as u64).div_ceil(qpc) + bh as u64 * units,
                qpc: qpc as u32,
                pair,
            };
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            let lists = record_buckets(&ctx, &mut enc, &p, &t, z, &mut None).unwrap();
            // Poison what the scatter writes (queue writes run before the submitted
            // commands), so that an unwritten element shows.
            for g in [&lists.list, &lists.cdesc] {
                let poison = vec![0xa5u8; g.buffer.size() as usize];
                ctx.queue.write_buffer(&g.buffer, 0, &poison);
            }
            ctx.queue.submit([enc.finish()]);
            let read = |g: &GpuTensor| -> Vec<u32> {
                let v = ctx.read_i32(g).unwrap();
                v.into_iter().map(|x| x as u32).collect()
            };
            let (off, coff) = (read(&lists.off), read(&lists.coff));
            let (list, cdesc, cnt) = (read(&lists.list), read(&lists.cdesc), read(&lists.cnt));
            let want = model(&p, &cand, bh, pair);
            let what = format!("bh {bh} nq {q_len} C {c} causal {causal} pair {pair} seed {seed}");
            assert!(cnt.iter().all(|&n| n == 0), "{what}: counts not back to 0");
            let (mut o, mut co) = (0u32, 0u32);
            for (x, w) in want.iter().enumerate() {
                assert_eq!((off[x], coff[x]), (o, co), "{what}: offsets of bucket {x}");
                let n = w.len() as u32;
                let mut got = list[o as usize..(o + n) as usize].to_vec();
                got.sort_unstable();
                assert_eq!(&got, w, "{what}: entries of bucket {x}");
                for j in 0..n.div_ceil(qpc as u32) {
                    let d = &cdesc[4 * (co + j) as usize..][..3];
                    let first = o + j * qpc as u32;
                    let want_d = [x as u32, first, (n - j * qpc as u32).min(qpc as u32)];
                    assert_eq!(d, want_d, "{what}: chunk {j} of bucket {x}");
                }
                checked_pairs += w.iter().filter(|v| *v & BOTH != 0).count();
                o += n;
                co += n.div_ceil(qpc as u32);
            }
            let last = want.len();
            assert_eq!((off[last], coff[last]), (o, co), "{what}: totals");
            // Independent of the model's pairing rule: the scores the scorer writes from these
            // lists (each entry's slot; BOTH also the next one) cover every scored slot exactly
            // once, each with a leaf of its entry's bucket (2P at the first slot of BOTH or a
            // flag-less entry, 2P + 1 at ODD's or BOTH's second).
            let units = want.len() / bh;
            let per_bh = q_len as usize * mc as usize;
            let mut written = vec![0u32; cand.len()];
            for x in 0..want.len() {
                for &v in &list[off[x] as usize..off[x + 1] as usize] {
                    let e = (x / units) * per_bh + (v & !(BOTH | ODD)) as usize;
                    let mut slots = vec![(e, 0)];
                    if v & BOTH != 0 {
                        slots.push((e + 1, 1));
                    } else if v & ODD != 0 {
                        slots[0].1 = 1;
                    }
                    for (slot, half) in slots {
                        written[slot] += 1;
                        let leaf = cand[slot] as usize;
                        let ok = if pair {
                            leaf / 2 == x % units && leaf % 2 == half
                        } else {
                            leaf == x % units
                        };
                        assert!(ok, "{what}: bucket {x} writes slot {slot} (leaf {leaf})");
                    }
                }
            }
            for (e, &n) in written.iter().enumerate() {
                let scored = entry_leaf(&p, &cand, e).is_some();
                assert_eq!(n, u32::from(scored), "{what}: slot {e} written {n} times");
            }
        }
    }
    assert!(checked_pairs > 100, "only {checked_pairs} pair entries");
}
