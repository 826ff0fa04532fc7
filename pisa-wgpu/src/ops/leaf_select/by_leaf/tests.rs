//! The bucketing of `leaf_bucket.wgsl` (steps 1-3 of the leaf-major stage 2) against a CPU
//! model of it, leaf buckets and pair buckets (PAIR = 1, the NVIDIA pair scorer's), on the
//! test adapter: the pair buckets are otherwise read only by the NVIDIA scorer, so this is
//! where devices without it check them. Random ascending candidate lists (sibling pairs,
//! lone leaves, forced leaves, -1 padding), causal and not, with sinks and local blocks, a
//! query offset, and an odd leaf count (the last pair has one leaf). Every bucket's entries
//! (order within a bucket is free: compared sorted), the offsets, the chunk offsets and every
//! chunk descriptor must equal the model's, and the slots the scorer writes from the lists
//! (checked apart from the model's rule) must be the scored slots, once each; the outputs are
//! poisoned before the run. Both tests also count the entries that `count` sends to the global
//! counters rather than its workgroup bins (`STATS = 1`), which must be the model's (`bins`).
//! (Timing is the bins' only effect: without this count, a bucketing that stopped using them
//! would pass.)

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

/// Per entry, its bucket and list value (`entry_bucket`, `entry_value` of `leaf_bucket.wgsl`),
/// `None` for an entry that is not bucketed.
fn entry_buckets(p: &SelParams, cand: &[i32], pair: bool) -> Vec<Option<(usize, u32)>> {
    let mc = p.mc as usize;
    let units = if pair { p.nb0.div_ceil(2) } else { p.nb0 } as usize;
    let per_bh = p.q_len as usize * mc;
    (0..cand.len())
        .map(|e| {
            let j = entry_leaf(p, cand, e)?;
            let (b, mut v) = (e / per_bh, (e % per_bh) as u32);
            let mut unit = j as usize;
            if pair {
                let prev = (e % mc > 0).then(|| entry_leaf(p, cand, e - 1)).flatten();
                if j % 2 == 1 && prev == Some(j - 1) {
                    return None;
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
            Some((b * units + unit, v))
        })
        .collect()
}

/// The model's bucket lists: per bucket, its entries' list values, sorted.
fn model(p: &SelParams, cand: &[i32], bh: usize, pair: bool) -> Vec<Vec<u32>> {
    let units = if pair { p.nb0.div_ceil(2) } else { p.nb0 } as usize;
    let mut out = vec![Vec::new(); bh * units];
    for (x, v) in entry_buckets(p, cand, pair).into_iter().flatten() {
        out[x].push(v);
    }
    out.iter_mut().for_each(|l| l.sort_unstable());
    out
}

/// `window` of `leaf_bucket.wgsl`: the first bucket and the number of bins (at most `wb`) of the
/// tile whose last entry is `e_last`; `attend_i0`: the query range's start of an `ATTEND = 1`
/// bucketing (one (b, KV head), a bucket per leaf).
fn bins(
    p: &SelParams,
    e_last: usize,
    pair: bool,
    wb: u32,
    attend: Option<(u32, u32)>,
) -> (u32, u32) {
    let mc = p.mc as usize;
    let units = if pair { p.nb0.div_ceil(2) } else { p.nb0 };
    let (i, first) = match attend {
        // (the range's first query and queries: entry e is query e / mc % nq of head
        // e / (nq mc), whose buckets start at that head's units)
        Some((i0, nq)) => (
            i0 + (e_last / mc) as u32 % nq,
            (e_last / (nq as usize * mc)) as u32 * units,
        ),
        None => (
            (e_last / mc) as u32 % p.q_len,
            (e_last / (p.q_len as usize * mc)) as u32 * units,
        ),
    };
    let bq = (p.q_pos0 + i) / p.block_size;
    let mut leaf = if p.causal != 0 {
        (bq + 1).min(p.nb0 - 1)
    } else {
        p.nb0 - 1
    };
    if pair {
        leaf /= 2;
    }
    let last = first + leaf;
    let n = (last + 1 - first).min(wb);
    (last + 1 - n, n)
}

/// The entries that take the global counters directly in `count` (their bucket outside their
/// tile's bins, [`bins`]), and all the bucketed ones: `bucket[e]` is entry e's bucket.
fn global_entries(bucket: &[Option<usize>], window: impl Fn(usize) -> (u32, u32)) -> (u32, u32) {
    let tile = BUCKET_TILE as usize;
    let (mut global, mut all) = (0, 0);
    for e0 in (0..bucket.len()).step_by(tile) {
        let e1 = (e0 + tile).min(bucket.len());
        let (first, n) = window(e1 - 1);
        for x in bucket[e0..e1].iter().flatten() {
            all += 1;
            global += u32::from((*x as u32).wrapping_sub(first) >= n);
        }
    }
    (global, all)
}

/// Asserts that `count` sent exactly the model's entries to the global counters (`got`, the
/// STATS word), and, with the whole bins, that some entries took the bins (the tiles here
/// straddle (b, KV head) ranges, whose earlier entries are global): a bucketing that no longer
/// used its bins fails here, where its lists would still be right.
fn check_bins(got: u32, (global, all): (u32, u32), window: u32, what: &str) {
    assert_eq!(got, global, "{what}: entries on the global counters");
    if window == BUCKET_WINDOW {
        assert!(global < all, "{what}: {global} of {all} entries global");
    }
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

/// What a bucketing wrote, read back.
struct Lists<'a> {
    cnt: Vec<u32>,
    off: &'a [u32],
    coff: Vec<u32>,
    list: &'a [u32],
    cdesc: Vec<u32>,
}

/// Asserts that `got` holds the buckets `want` (each bucket's list values, sorted) in chunks of
/// `qpc` entries: counts back at zero, entry and chunk offsets, every bucket's entries (in any
/// order), every chunk's descriptor.
fn check_lists(want: &[Vec<u32>], got: &Lists, qpc: u32, what: &str) {
    assert!(
        got.cnt.iter().all(|&n| n == 0),
        "{what}: counts not back to 0"
    );
    let (mut o, mut co) = (0u32, 0u32);
    for (x, w) in want.iter().enumerate() {
        let offsets = (got.off[x], got.coff[x]);
        assert_eq!(offsets, (o, co), "{what}: offsets of bucket {x}");
        let n = w.len() as u32;
        let mut entries = got.list[o as usize..(o + n) as usize].to_vec();
        entries.sort_unstable();
        assert_eq!(&entries, w, "{what}: entries of bucket {x}");
        for j in 0..n.div_ceil(qpc) {
            let d = &got.cdesc[4 * (co + j) as usize..][..3];
            let want_d = [x as u32, o + j * qpc, (n - j * qpc).min(qpc)];
            assert_eq!(d, want_d, "{what}: chunk {j} of bucket {x}");
        }
        o += n;
        co += n.div_ceil(qpc);
    }
    let last = want.len();
    let totals = (got.off[last], got.coff[last]);
    assert_eq!(totals, (o, co), "{what}: totals");
}

/// The test adapter's context, a fresh seed (printed in failures) and its generator.
fn setup() -> (Context, u64, ChaCha8Rng) {
    let ctx = Context::new(&AdapterChoice::HighPerformance).expect("a GPU adapter");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    (ctx, seed, ChaCha8Rng::seed_from_u64(seed))
}

#[test]
fn pair_and_leaf_buckets_equal_the_model() {
    let (ctx, seed, mut r) = setup();
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
        // Windows of workgroup bins: every bucket of a tile's (b, KV head) (4096), a few
        // (some entries then take the global counts directly), one.
        for (pair, window) in [false, true]
            .into_iter()
            .flat_map(|x| [(x, 4096), (x, 5), (x, 1)])
        {
            let units = if pair { p.nb0.div_ceil(2) } else { p.nb0 } as u64;
            let qpc = 4;
            let z = BucketSizes {
                entries: cand.len() as u64,
                buckets: bh as u64 * units,
                chunks: (cand.len() as u64).div_ceil(qpc) + bh as u64 * units,
                qpc: qpc as u32,
                pair,
                window,
                stats: true,
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
            let (list, cdesc, mut cnt) = (read(&lists.list), read(&lists.cdesc), read(&lists.cnt));
            let want = model(&p, &cand, bh, pair);
            let what = format!(
                "bh {bh} nq {q_len} C {c} causal {causal} pair {pair} bins {window} seed {seed}"
            );
            let buckets: Vec<_> = (entry_buckets(&p, &cand, pair).iter())
                .map(|x| x.map(|(b, _)| b))
                .collect();
            let model_global = global_entries(&buckets, |e| bins(&p, e, pair, window, None));
            check_bins(cnt.pop().unwrap(), model_global, window, &what);
            let got = Lists {
                cnt,
                off: &off,
                coff,
                list: &list,
                cdesc,
            };
            check_lists(&want, &got, qpc as u32, &what);
            checked_pairs += want.iter().flatten().filter(|v| *v & BOTH != 0).count();
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

/// The bucketing of a block selection for leaf-major attention (`ATTEND = 1`,
/// `ops/attention/by_leaf.rs`) against a model of `attend_leaf`: a query range of one (b, KV
/// head), or all queries of `heads` of them (the last group shorter), at a time; a bucket per
/// leaf of each head (`hb * nb0 + leaf`), list values the head's local entries `i_local * K +
/// o`; a slot counts where its leaf is below nb0 and above every in-range slot before it (-1
/// padding, repeats and out-of-order slots are skipped). With sibling pairs (`APAIR`), a
/// counted even leaf whose next slot counts its sibling is one entry of pair bucket `heads *
/// nb0 + hb * ceil(nb0 / 2) + leaf / 2`, and that next slot none. Random selections with such slots and many sibling pairs,
/// windows of bins of every bucket (with pairs: as many as the device's workgroup memory
/// holds), a few, and one; outputs poisoned before each run.
#[test]
fn attention_buckets_equal_the_model() {
    let (ctx, seed, mut r) = setup();
    // (B * Hkv, Nq, query offset, C, K, causal, queries per range, heads per range): ranges of
    // one tile (BUCKET_TILE entries) and of several, the last one partial; ranges of every
    // query of 2 heads (of 3: the last range one head) and of 3 (tiles that span heads).
    for (bh, q_len, q_pos0, c, k, causal, per, hpr) in [
        (2, 700, 50, 16, 6, true, 300, 1),
        (3, 333, 0, 7, 5, false, 333, 1),
        (1, 1500, 20, 8, 4, true, 1500, 1),
        (2, 1100, 0, 16, 7, false, 1100, 1),
        (3, 333, 0, 7, 5, false, 333, 2),
        (3, 250, 30, 16, 6, true, 250, 3),
    ] {
        let p = params(q_len, q_pos0, c, k, causal, k);
        let nb0 = p.nb0;
        // Mostly ascending visible leaves, with repeats, out-of-order slots, -1 and leaves
        // past nb0.
        let sel: Vec<i32> = (0..bh * q_len as usize)
            .flat_map(|row| {
                let bq = (q_pos0 + row as u32 % q_len) / c;
                let see = if causal { bq + 1 } else { nb0 };
                let mut v: Vec<i32> = (0..k).map(|_| r.random_range(0..see) as i32).collect();
                v.sort_unstable();
                // Sibling pairs (a sibling past the visible leaves or a repeat's breaks the
                // order: such a slot is skipped).
                for j in 0..v.len() - 1 {
                    if v[j] % 2 == 0 && r.random_bool(0.5) {
                        v[j + 1] = v[j] + 1;
                    }
                }
                for x in v.iter_mut() {
                    match r.random_range(0..20) {
                        0 => *x = -1,
                        1 => *x = (nb0 + 3) as i32,
                        2 => *x = r.random_range(0..see) as i32,
                        _ => {}
                    }
                }
                v
            })
            .collect();
        let t = ctx.upload_u32("selection", &sel).unwrap();
        let qpc = 4u32;
        let limit = ctx.limits().max_compute_workgroup_storage_size;
        for (apair, window) in [false, true]
            .into_iter()
            .flat_map(|a| [(a, bucket_window_for(limit, a)), (a, 5), (a, 1)])
        {
            let whole = window == bucket_window_for(limit, apair);
            let np = if apair { nb0.div_ceil(2) } else { 0 };
            let mut pair_entries = 0;
            for b in (0..bh).step_by(hpr) {
                let heads = hpr.min(bh - b) as u32;
                let buckets_n = heads * (nb0 + np);
                for i0 in (0..q_len).step_by(per) {
                    let nq = (per as u32).min(q_len - i0);
                    let per_head = nq * k;
                    let entries = heads * per_head;
                    // The model: the list values of each bucket.
                    let mut want = vec![Vec::new(); buckets_n as usize];
                    // Entry e's bucket (None: not bucketed).
                    let mut buckets = vec![None; entries as usize];
                    // The leaf of entry e (head e / per_head of the range) where its slot counts.
                    let counted = |e: u32| -> Option<u32> {
                        let (hb, le) = (e / per_head, e % per_head);
                        let g = (((b as u32 + hb) * q_len + i0 + le / k) * k + le % k) as usize;
                        let o = (e % k) as usize;
                        let x = sel[g];
                        let shadowed = sel[g - o..g].iter().any(|&y| y >= x && (y as u32) < nb0);
                        (x >= 0 && (x as u32) < nb0 && !shadowed).then_some(x as u32)
                    };
                    for e in 0..entries {
                        let Some(x) = counted(e) else { continue };
                        let o = e % k;
                        let next = (o + 1 < k).then(|| counted(e + 1)).flatten();
                        let prev = (o > 0).then(|| counted(e - 1)).flatten();
                        let (hb, le) = (e / per_head, e % per_head);
                        let x = if apair && x % 2 == 0 && next == Some(x + 1) {
                            pair_entries += 1;
                            heads * nb0 + hb * np + x / 2
                        } else if !(apair && x % 2 == 1 && prev == Some(x - 1)) {
                            hb * nb0 + x
                        } else {
                            continue;
                        };
                        want[x as usize].push(le);
                        buckets[e as usize] = Some(x as usize);
                    }
                    want.iter_mut().for_each(|l| l.sort_unstable());
                    let chunks = entries.div_ceil(qpc) + buckets_n;
                    // (one word more: the entries on the global counters, STATS)
                    let cnt = ctx
                        .alloc("counts", buckets_n as usize + 1, Storage::F32, 0)
                        .unwrap();
                    let alloc = |n: u32| ctx.alloc("out", n as usize, Storage::F32, POISON_I32);
                    let (off, coff) =
                        (alloc(buckets_n + 1).unwrap(), alloc(buckets_n + 1).unwrap());
                    let (list, cdesc) = (alloc(entries).unwrap(), alloc(4 * chunks).unwrap());
                    let u_params = ctx.uniform("params", &p).unwrap();
                    let uni = |items: u32| {
                        let b = Buckets {
                            items,
                            buckets: buckets_n,
                            i0,
                            nq,
                            bh0: b as u32,
                            first: 0,
                            heads,
                            pad: 0,
                        };
                        ctx.uniform("buckets", &b).unwrap()
                    };
                    let (u_e, u_b) = (uni(entries), uni(buckets_n));
                    let mut consts = bucket_consts(k, qpc, true, apair, window).to_vec();
                    consts.push(("STATS", 1));
                    let pipe = |entry| {
                        let st = Storage::F32;
                        ctx.pipelines
                            .get(&ctx.device, &BUCKET_SHADER, entry, st, &consts, &[])
                    };
                    let (sb, cb, ob, cob) = (&t.buffer, &cnt.buffer, &off.buffer, &coff.buffer);
                    let mut enc = ctx.device.create_command_encoder(&Default::default());
                    let groups = (entries as u64).div_ceil(BUCKET_TILE);
                    let bind = [(0, &u_params), (3, sb), (5, cb), (10, &u_e)];
                    ctx.dispatch(&mut enc, &pipe("count").unwrap(), &bind, groups, None)
                        .unwrap();
                    let bind = [(5, cb), (6, ob), (7, cob), (10, &u_b)];
                    ctx.dispatch(&mut enc, &pipe("scan").unwrap(), &bind, 1, None)
                        .unwrap();
                    let bind = [
                        (0, &u_params),
                        (3, sb),
                        (5, cb),
                        (6, ob),
                        (7, cob),
                        (8, &list.buffer),
                        (10, &u_e),
                        (11, &cdesc.buffer),
                    ];
                    let scatter = pipe("scatter").unwrap();
                    ctx.dispatch(&mut enc, &scatter, &bind, groups, None)
                        .unwrap();
                    ctx.queue.submit([enc.finish()]);
                    let read = |g: &GpuTensor| -> Vec<u32> {
                        ctx.read_i32(g)
                            .unwrap()
                            .into_iter()
                            .map(|x| x as u32)
                            .collect()
                    };
                    let (off, list, mut counts) = (read(&off), read(&list), read(&cnt));
                    let what = format!(
                        "bh {b} heads {heads} i0 {i0} C {c} causal {causal} pairs {apair} bins {window} seed {seed}"
                    );
                    // A bucket is binned in the leaf window, or (pairs) in the pair window of
                    // WP = window / 2 pair buckets ending at the pair of the tile's last leaf.
                    let binned = |e_last: usize, x: u32| {
                        let (f1, n1) = bins(&p, e_last, false, window, Some((i0, nq)));
                        let hb = (e_last / per_head as usize) as u32;
                        let i = i0 + (e_last / k as usize) as u32 % nq;
                        let bq = (p.q_pos0 + i) / p.block_size;
                        let last = if causal {
                            (bq + 1).min(nb0 - 1)
                        } else {
                            nb0 - 1
                        };
                        let n2 = if apair {
                            (last / 2 + 1).min(window / 2)
                        } else {
                            0
                        };
                        let f2 = heads * nb0 + hb * np + last / 2 + 1 - n2;
                        x.wrapping_sub(f1) < n1 || x.wrapping_sub(f2) < n2
                    };
                    let (mut global, mut all) = (0, 0);
                    for e0 in (0..buckets.len()).step_by(BUCKET_TILE as usize) {
                        let e1 = (e0 + BUCKET_TILE as usize).min(buckets.len());
                        for &x in buckets[e0..e1].iter().flatten() {
                            all += 1;
                            global += u32::from(!binned(e1 - 1, x as u32));
                        }
                    }
                    let stats = counts.pop().unwrap();
                    assert_eq!(stats, global, "{what}: entries on the global counters");
                    if whole {
                        assert!(global < all, "{what}: {global} of {all} entries global");
                    }
                    let got = Lists {
                        cnt: counts,
                        off: &off,
                        coff: read(&coff),
                        list: &list,
                        cdesc: read(&cdesc),
                    };
                    check_lists(&want, &got, qpc, &what);
                }
            }
            if apair {
                assert!(pair_entries > 0, "no pair entries (seed {seed})");
            }
        }
    }
}
