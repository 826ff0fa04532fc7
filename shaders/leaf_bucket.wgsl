// Leaf-major stage 2 of PISA prefill selection, part 1 of 3 (PISA.md 3.3 and 5; host:
// pisa-wgpu/src/ops/leaf_select/by_leaf.rs): bucket the stage-1 candidates by (b, KV head, leaf)
// so that a leaf's raw keys are read once per chunk of the queries that list it, not once per
// query tile (the tile kernels' union of 4 queries' candidates is mostly disjoint on inputs
// without locality: up to 4x the useful matrix work there).
//   count:   cnt[x] = entries of bucket x = bh * nb0 + leaf (PAIR = 1: bh * ceil(nb0 / 2) +
//            leaf / 2; ATTEND = 1: see there; atomics; cnt starts at zero);
//   scan:    off[x] (first entry of x in `list`) and coff[x] (first chunk of x: a bucket of n
//            entries has ceil(n / QPC) chunks), exclusive prefix sums, one workgroup;
//            off[buckets] = entries, coff[buckets] = chunks;
//   scatter: list[off[x] + slot] = i * MC + o for every entry (query i, candidate slot o; PAIR
//            = 1: with the flags BOTH or ODD, see PAIR below); the
//            slots come from counting cnt back down to zero (order within a bucket is
//            unspecified, and does not matter: each entry's score goes to its own slot); the
//            entry that takes a slot that is a multiple of QPC also writes its chunk's
//            descriptor cdesc[coff[x] + slot / QPC] = (x, first entry, entries, 0), so a
//            chunk kernel finds its chunk in one load (leaf_chunk.wgsl).
// An entry is a non-forced candidate of a query that must choose (it sees more than K leaves
// and has slots left after its forced ones); the others are never read by the pick.
// (Params, p, visible, is_forced, n_forced, linear_id: select_common.wgsl, prepended.)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const MC: u32 = 34u;   // candidate slots per query, g * (K + 1)
const QPC: u32 = 16u;  // entries per scoring chunk
const NONE: u32 = 0xffffffffu;
// 1: bucket a block selection for leaf-major attention (ops/attention/by_leaf.rs): the entries
// are the valid slots of queries i0 .. i0 + nq of the bl.heads (b, KV head)s bh0 + hb (hb <
// bl.heads), entry e = (hb * nq + i_local) * MC + o; `cand` is the selection [B, Hkv, Nq, MC]
// (MC = top_k); the bucket of a leaf is hb * nb0 + leaf, and list entries are i_local * MC + o
// (the chunk kernels find hb from the bucket). One range of many heads takes one bucketing, one
// chunk dispatch and one merge where a head each took its own (ops/attention/by_leaf.rs).
const ATTEND: u32 = 0u;
// 1 (with ATTEND = 0; the NVIDIA pair scorer, shaders/nv/leaf_score.comp PAIR = 1): a bucket
// is a pair of leaves (bh * ceil(nb0 / 2) + leaf / 2), and a query that lists both leaves of a
// pair in adjacent slots o, o + 1 (a kept node's children, g = 2) is one entry, o | BOTH; one
// that lists only leaf 2P + 1 is o | ODD, only 2P is o. The list values i * MC + o must stay
// below 2^30 (the host checks).
const PAIR: u32 = 0u;
// 1 (with ATTEND = 1; ops/attention/by_leaf.rs with sibling pairs): a query whose selection
// lists both leaves 2P and 2P + 1 (valid entries, so in adjacent slots o, o + 1: a valid list
// ascends) is ONE entry, slot o, in pair bucket heads * nb0 + hb * ceil(nb0 / 2) + P (hb: its
// head in the range), whose chunk kernel attends both leaves at once; slot o + 1 is not bucketed
// (its spos stays 0, so the merge finds no state there: the pair's state holds both leaves).
// Every other entry stays in its leaf's bucket hb * nb0 + leaf. Buckets: heads * (nb0 +
// ceil(nb0 / 2)), every head's leaves first, so that the leaf chunks come before the pair
// chunks (two dispatches, one per kind).
const APAIR: u32 = 0u;
const BOTH: u32 = 0x80000000u;
const ODD: u32 = 0x40000000u;

// items: entries (count, scatter) or buckets (scan); i0, nq, bh0, heads: the query range and
// the (b, KV head)s bh0 .. bh0 + heads of an ATTEND = 1 bucketing (first: see leaf_chunk.wgsl).
struct Buckets {
    items: u32, buckets: u32, i0: u32, nq: u32,
    bh0: u32, first: u32, heads: u32, pad2: u32,
}

@group(0) @binding(3) var<storage, read> cand: array<i32>;
@group(0) @binding(5) var<storage, read_write> cnt: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> off: array<u32>;
@group(0) @binding(7) var<storage, read_write> coff: array<u32>;
@group(0) @binding(8) var<storage, read_write> list: array<u32>;
@group(0) @binding(10) var<uniform> bl: Buckets;
@group(0) @binding(11) var<storage, read_write> cdesc: array<vec4<u32>>;

// ATTEND = 1: the head hb of entry e = (hb * nq + i_local) * MC + o in the range, and its entry
// within that head's, i_local * MC + o (its list value).
fn attend_head(e: u32) -> u32 { return e / (bl.nq * MC); }
fn attend_local(e: u32) -> u32 { return e % (bl.nq * MC); }

// ATTEND = 1: entry e's slot in `cand`, ((bh0 + hb) * q_len + i0 + i_local) * MC + o.
fn attend_slot(e: u32) -> u32 {
    let le = attend_local(e);
    return ((bl.bh0 + attend_head(e)) * p.q_len + bl.i0 + le / MC) * MC + le % MC;
}

// ATTEND = 1: the leaf of entry e = (hb * nq + i_local) * MC + o when that selection slot is
// valid as the attention kernels' union defines it (a leaf below nb0 above every in-range entry
// before it in its list: -1 padding, repeats and out-of-order entries are skipped), else NONE.
fn attend_leaf(e: u32) -> u32 {
    let o = e % MC;
    let g = attend_slot(e);
    let c = cand[g];
    if (c < 0 || u32(c) >= p.nb0) { return NONE; }
    for (var j = g - o; j < g; j++) {
        let x = cand[j];
        if (x >= c && u32(x) < p.nb0) { return NONE; }
    }
    return u32(c);
}

// APAIR = 1: entry e's leaf j (attend_leaf's) and bucket, in one pass over the slots before
// it. An even leaf whose next slot lists j + 1 (valid: above every entry before it, as j is)
// is a pair, bucket heads * nb0 + hb * ceil(nb0 / 2) + j / 2 (the pair buckets of every head
// after the leaf buckets of every head); an odd leaf whose previous slot lists j - 1, valid (no
// slot before that one lists j - 1: the others are below j, as j is valid), is that pair's
// second slot, NONE; else bucket hb * nb0 + j. (NONE, NONE) for an entry attend_leaf skips.
fn attend_pair_entry(e: u32) -> vec2<u32> {
    let o = e % MC;
    let g = attend_slot(e);
    let hb = attend_head(e);
    let c = cand[g];
    if (c < 0 || u32(c) >= p.nb0) { return vec2<u32>(NONE); }
    var earlier = false; // j - 1 in a slot before o - 1
    for (var k = g - o; k < g; k++) {
        let x = cand[k];
        if (x >= c && u32(x) < p.nb0) { return vec2<u32>(NONE); }
        earlier = earlier || (x == c - 1 && k + 1u < g);
    }
    let j = u32(c);
    if ((j & 1u) == 0u) {
        if (o + 1u < MC && j + 1u < p.nb0 && cand[g + 1u] == c + 1) {
            return vec2<u32>(j, bl.heads * p.nb0 + hb * ((p.nb0 + 1u) / 2u) + j / 2u);
        }
        return vec2<u32>(j, hb * p.nb0 + j);
    }
    if (o > 0u && cand[g - 1u] == c - 1 && !earlier) { return vec2<u32>(j, NONE); }
    return vec2<u32>(j, hb * p.nb0 + j);
}

// The leaf of entry e, NONE when it is not bucketed: ATTEND = 0, entry_leaf; ATTEND = 1,
// attend_leaf.
fn bucket_leaf(e: u32) -> u32 {
    if (ATTEND == 1u) { return attend_leaf(e); }
    return entry_leaf(e);
}

// The bucket of entry e of leaf j (j not NONE): ATTEND = 0, entry e = (bh * q_len + i) * MC + o
// and bucket bh * nb0 + leaf; ATTEND = 1, hb * nb0 + leaf. PAIR = 1: bucket
// bh * ceil(nb0 / 2) + leaf / 2, NONE for the second slot of a BOTH entry.
fn entry_bucket(e: u32, j: u32) -> u32 {
    if (ATTEND == 1u) { return attend_head(e) * p.nb0 + j; }
    let bh = e / (p.q_len * MC);
    if (PAIR == 1u) {
        if ((j & 1u) == 1u && e % MC > 0u && entry_leaf(e - 1u) == j - 1u) { return NONE; }
        return bh * ((p.nb0 + 1u) / 2u) + j / 2u;
    }
    return bh * p.nb0 + j;
}

// The value in its bucket's list of entry e of leaf j: ATTEND = 0, i * MC + o (PAIR = 1: with
// BOTH or ODD); ATTEND = 1, i_local * MC + o (e within its head's entries).
fn entry_value(e: u32, j: u32) -> u32 {
    if (ATTEND == 1u) { return attend_local(e); }
    let v = e % (p.q_len * MC);
    if (PAIR == 1u) {
        if ((j & 1u) == 1u) { return v | ODD; }
        if (e % MC + 1u < MC && entry_leaf(e + 1u) == j + 1u) { return v | BOTH; }
    }
    return v;
}

// The leaf of entry e = (bh * q_len + i) * MC + o when it is to be scored, else NONE.
fn entry_leaf(e: u32) -> u32 {
    let i = (e / MC) % p.q_len;
    let bq = (p.q_pos0 + i) / p.block_size;
    if (visible(bq) <= p.top_k || n_forced(bq) >= p.top_k) { return NONE; }
    let c = cand[e];
    if (c < 0 || is_forced(bq, u32(c))) { return NONE; }
    return u32(c);
}

// Count and scatter take EPI entries per invocation, 256 * EPI consecutive entries per
// workgroup (a tile), and first add them up per bucket in workgroup memory: a tile's queries
// share many of their candidate leaves (always so at the sequence's start, and where
// selections cluster), and one global atomic per bucket and tile, instead of one per entry,
// spares the bucket counters the contention of the queries in flight (on the H200 the per-entry
// atomics took twice the time per entry at 64K as at 256K, where the queries in flight spread
// over four times as many buckets). The bins `win` hold the WB buckets of the tile's last
// (b, KV head) that end one past its last query's own leaf (causally, no query lists a later
// one; without causal masking, the WB buckets that end at the last leaf); an entry of a bucket
// outside them (older leaves past WB, another (b, KV head)) takes the global atomic directly.
// Which entries the bins take changes nothing but time: count leaves the totals, and scatter
// hands out each bucket's slots 0 .. n - 1 once each. On the H200 (2026-12-03,
// docs/benchmarks.md A.19) the selection's bucketing went from 3.43 to 0.60 ms at 64K and 6.63
// to 2.52 at 256K, the attention's from 2.06 to 0.57 and 5.09 to 2.39; with 16 entries per
// invocation the selection's took 2.49 ms at 256K and the attention's 2.83, prefill as long or
// longer.
const EPI: u32 = 8u;
const WB: u32 = 4096u;
// APAIR = 1: the bins of pair buckets, after the WB of leaf buckets (0 otherwise).
const WP: u32 = 0u;
// 1 (tests only): `count` also counts the entries that take the global counters directly, in
// cnt[bl.buckets] (one word past the buckets), so that a test sees the bins are used.
const STATS: u32 = 0u;
var<workgroup> win: array<atomic<u32>, WB + WP>;

// The first bucket of the bins of the tile whose last entry is e_last, and their number (at
// most WB, fewer where the (b, KV head) has fewer buckets up to the window's end; APAIR = 1:
// pair_window's WP pair buckets come after them).
fn window(e_last: u32) -> vec2<u32> {
    // The tile's last query (ATTEND = 1: of the range i0 ..), and its (b, KV head)'s first
    // bucket (ATTEND = 1: a bucket per leaf of each head of the range).
    var i = (e_last / MC) % p.q_len;
    var first = 0u;
    var units = p.nb0;
    if (PAIR == 1u) { units = (p.nb0 + 1u) / 2u; }
    if (ATTEND == 1u) {
        i = bl.i0 + attend_local(e_last) / MC;
        first = attend_head(e_last) * units;
    } else {
        first = e_last / (p.q_len * MC) * units;
    }
    let leaf = last_leaf(i);
    var last = first + leaf;
    if (PAIR == 1u) { last = first + leaf / 2u; }
    let n = min(last + 1u - first, WB);
    return vec2<u32>(last + 1u - n, n);
}

// The last leaf query i may list: causally, the leaf after its own (the window ends one past
// it); without causal masking, the last leaf.
fn last_leaf(i: u32) -> u32 {
    let bq = (p.q_pos0 + i) / p.block_size;
    return select(p.nb0 - 1u, min(bq + 1u, p.nb0 - 1u), p.causal != 0u);
}

// APAIR = 1: the pair buckets of the tile whose last entry is e_last, as window() (at most
// WP, ending at the pair of the last leaf its last query may list).
fn pair_window(e_last: u32) -> vec2<u32> {
    if (APAIR == 0u) { return vec2<u32>(0u, 0u); }
    let pl = last_leaf(bl.i0 + attend_local(e_last) / MC) / 2u;
    let n = min(pl + 1u, WP);
    let first = bl.heads * p.nb0 + attend_head(e_last) * ((p.nb0 + 1u) / 2u);
    return vec2<u32>(first + pl + 1u - n, n);
}

// A workgroup's tile: its first entry e0 and its bins, bins 0 .. n1 for buckets f1 .. f1 + n1
// and bins n1 .. n1 + n2 for buckets f2 .. f2 + n2 (APAIR = 1: the pair buckets; else n2 = 0).
struct Tile { e0: u32, f1: u32, n1: u32, f2: u32, n2: u32 }

fn tile(wid: vec3<u32>, nwg: vec3<u32>) -> Tile {
    let e0 = linear_id(wid, nwg) * 256u * EPI;
    let e_last = min(e0 + 256u * EPI, bl.items) - 1u;
    let w = window(e_last);
    let w2 = pair_window(e_last);
    return Tile(e0, w.x, w.y, w2.x, w2.y);
}

// The bin of bucket x in tile t, NONE where x has none (it takes the global counter).
fn bin_of(t: Tile, x: u32) -> u32 {
    if (x - t.f1 < t.n1) { return x - t.f1; }
    if (x - t.f2 < t.n2) { return t.n1 + x - t.f2; }
    return NONE;
}

// The bucket of bin k (k < n1 + n2) of tile t.
fn bin_bucket(t: Tile, k: u32) -> u32 {
    if (k < t.n1) { return t.f1 + k; }
    return t.f2 + k - t.n1;
}

// Entry e's leaf and bucket; bucket NONE for an entry past the items or not bucketed.
fn tile_entry(e: u32) -> vec2<u32> {
    if (e >= bl.items) { return vec2<u32>(NONE); }
    if (APAIR == 1u) {
        let jx = attend_pair_entry(e);
        if (jx.y == NONE) { return vec2<u32>(NONE); }
        return jx;
    }
    let j = bucket_leaf(e);
    if (j == NONE) { return vec2<u32>(NONE); }
    return vec2<u32>(j, entry_bucket(e, j));
}

@compute @workgroup_size(256)
fn count(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let t = tile(wid, nwg);
    let bins = t.n1 + t.n2;
    for (var k = lid; k < bins; k += 256u) { atomicStore(&win[k], 0u); }
    workgroupBarrier();
    for (var k = 0u; k < EPI; k++) {
        let x = tile_entry(t.e0 + k * 256u + lid).y;
        if (x == NONE) { continue; }
        let b = bin_of(t, x);
        if (b != NONE) {
            atomicAdd(&win[b], 1u);
        } else {
            atomicAdd(&cnt[x], 1u);
            if (STATS == 1u) { atomicAdd(&cnt[bl.buckets], 1u); }
        }
    }
    workgroupBarrier();
    for (var k = lid; k < bins; k += 256u) {
        let c = atomicLoad(&win[k]);
        if (c > 0u) { atomicAdd(&cnt[bin_bucket(t, k)], c); }
    }
}

var<workgroup> part: array<u32, 256>;
var<workgroup> cpart: array<u32, 256>;

@compute @workgroup_size(256)
fn scan(@builtin(local_invocation_index) lid: u32) {
    let n = bl.buckets;
    let per = (n + 255u) / 256u;
    let a = min(lid * per, n);
    let z = min(a + per, n);
    var s = 0u;
    var cs = 0u;
    for (var x = a; x < z; x++) {
        let c = atomicLoad(&cnt[x]);
        s += c;
        cs += (c + QPC - 1u) / QPC;
    }
    part[lid] = s;
    cpart[lid] = cs;
    workgroupBarrier();
    // Inclusive scan of the 256 segment sums (Hillis-Steele).
    for (var d = 1u; d < 256u; d *= 2u) {
        var v = 0u;
        var cv = 0u;
        if (lid >= d) {
            v = part[lid - d];
            cv = cpart[lid - d];
        }
        workgroupBarrier();
        part[lid] += v;
        cpart[lid] += cv;
        workgroupBarrier();
    }
    var o = part[lid] - s;
    var co = cpart[lid] - cs;
    for (var x = a; x < z; x++) {
        let c = atomicLoad(&cnt[x]);
        off[x] = o;
        coff[x] = co;
        o += c;
        co += (c + QPC - 1u) / QPC;
    }
    if (lid == 255u) {
        off[n] = part[255];
        coff[n] = cpart[255];
    }
}

// Entry value v in bucket x at slot `slot` of the bucket's list; the entry that takes a slot
// that is a multiple of QPC also writes its chunk's descriptor.
fn place(x: u32, slot: u32, v: u32) {
    let o = off[x];
    list[o + slot] = v;
    if (slot % QPC == 0u) {
        let n = min(QPC, off[x + 1u] - o - slot);
        cdesc[coff[x] + slot / QPC] = vec4<u32>(x, o + slot, n, 0u);
    }
}

@compute @workgroup_size(256)
fn scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let t = tile(wid, nwg);
    let bins = t.n1 + t.n2;
    for (var k = lid; k < bins; k += 256u) { atomicStore(&win[k], 0u); }
    workgroupBarrier();
    // The binned entries: bin (NONE: none), rank among the tile's entries of that bin, list
    // value.
    var bx: array<u32, EPI>;
    var br: array<u32, EPI>;
    var bv: array<u32, EPI>;
    for (var k = 0u; k < EPI; k++) {
        bx[k] = NONE;
        let e = t.e0 + k * 256u + lid;
        let jx = tile_entry(e);
        let x = jx.y;
        if (x == NONE) { continue; }
        let v = entry_value(e, jx.x);
        let b = bin_of(t, x);
        if (b != NONE) {
            bx[k] = b;
            br[k] = atomicAdd(&win[b], 1u);
            bv[k] = v;
        } else {
            // The slot comes from counting cnt back down to zero.
            place(x, atomicSub(&cnt[x], 1u) - 1u, v);
        }
    }
    workgroupBarrier();
    // Each bin takes its entries' slots in one step: the n slots below the bucket's count.
    for (var k = lid; k < bins; k += 256u) {
        let c = atomicLoad(&win[k]);
        if (c > 0u) { atomicStore(&win[k], atomicSub(&cnt[bin_bucket(t, k)], c) - c); }
    }
    workgroupBarrier();
    for (var k = 0u; k < EPI; k++) {
        let b = bx[k];
        if (b != NONE) { place(bin_bucket(t, b), atomicLoad(&win[b]) + br[k], bv[k]); }
    }
}
