// Key-block-major index of a selection for the backward pass's dK/dV (PISA.md section 4): for
// every (b, kv head), the entries (block, query) of its selection rows, stably sorted by block,
// so the queries that selected a block are contiguous and in query order.
//
// A least-significant-digit radix sort on 4-bit digits of the block index: `init_pairs` writes
// one (key, query) per selection entry (key = nb0 for padding, out-of-range, future (causal) and
// repeated slots, so they sort last); then per digit: `digit_hist` counts each tile's digits,
// `digit_scan` turns the (digit, tile) counts of each (b, kv head) into exclusive offsets, and
// `digit_scatter` moves every entry to offset + its rank among the same digit in its tile.
// Ranks come from a workgroup scan of 16 packed 16-bit counters: stable, integer, no atomics
// on positions, so the index is bitwise deterministic.
//
// sel: i32 [B*Hkv, Nq, K]; src, dst: vec2<u32> [B*Hkv, entries] (entries = Nq*K);
// hist: u32 [B*Hkv, 16, tiles].

const WG: u32 = 128u;
const ITEMS: u32 = 8u;
const TILE: u32 = WG * ITEMS;

struct Params {
    q_len: u32, top_k: u32, entries: u32, num_bh: u32,
    nb0: u32, block_size: u32, q_offset: u32, causal: u32,
    tiles: u32, shift: u32, wg_count: u32, pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> sel: array<i32>;
@group(0) @binding(2) var<storage, read> src: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> dst: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read_write> hist: array<u32>;

var<workgroup> counts: array<atomic<u32>, 16>;
var<workgroup> part: array<u32, WG>;
var<workgroup> lo4: array<vec4<u32>, WG>;
var<workgroup> hi4: array<vec4<u32>, WG>;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}

// One invocation per selection entry g = (bh * Nq + i) * K + slot.
@compute @workgroup_size(WG)
fn init_pairs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let g = linear_id(wid, nwg) * WG + lid;
    if (g >= p.num_bh * p.entries) { return; }
    let e = g % p.entries;
    let i = e / p.top_k;
    let slot = e % p.top_k;
    let j = sel[g];
    var key = p.nb0;
    if (j >= 0 && u32(j) < p.nb0) {
        if (p.causal == 0u || u32(j) * p.block_size <= p.q_offset + i) {
            key = u32(j);
        }
        for (var m = 1u; m <= slot; m++) {
            if (sel[g - m] == j) { key = p.nb0; }
        }
    }
    dst[g] = vec2<u32>(key, i);
}

fn digit(x: u32) -> u32 {
    return (x >> p.shift) & 15u;
}

// One workgroup per (bh, tile of TILE entries): digit counts into hist[bh][digit][tile].
@compute @workgroup_size(WG)
fn digit_hist(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let tile = id % p.tiles;
    if (lid < 16u) { atomicStore(&counts[lid], 0u); }
    workgroupBarrier();
    for (var m = 0u; m < ITEMS; m++) {
        let e = tile * TILE + m * WG + lid;
        if (e < p.entries) { atomicAdd(&counts[digit(src[bh * p.entries + e].x)], 1u); }
    }
    workgroupBarrier();
    if (lid < 16u) { hist[(bh * 16u + lid) * p.tiles + tile] = atomicLoad(&counts[lid]); }
}

// One workgroup per bh: exclusive prefix sum, in place, of its 16 * tiles counts (digit-major).
@compute @workgroup_size(WG)
fn digit_scan(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let bh = linear_id(wid, nwg);
    if (bh >= p.num_bh) { return; }
    let n = 16u * p.tiles;
    let per = (n + WG - 1u) / WG;
    let base = bh * n;
    let lo = min(lid * per, n);
    let hi = min(lo + per, n);
    var s = 0u;
    for (var x = lo; x < hi; x++) { s += hist[base + x]; }
    part[lid] = s;
    workgroupBarrier();
    for (var off = 1u; off < WG; off <<= 1u) {
        var add = 0u;
        if (lid >= off) { add = part[lid - off]; }
        workgroupBarrier();
        part[lid] += add;
        workgroupBarrier();
    }
    var run = part[lid] - s;
    for (var x = lo; x < hi; x++) {
        let c = hist[base + x];
        hist[base + x] = run;
        run += c;
    }
}

// Adds one to the packed 16-bit counter of digit d.
fn bump(a: ptr<function, vec4<u32>>, b: ptr<function, vec4<u32>>, d: u32) {
    let inc = 1u << ((d & 1u) * 16u);
    let w = d >> 1u;
    if (w < 4u) { (*a)[w] += inc; } else { (*b)[w - 4u] += inc; }
}

fn count_of(a: vec4<u32>, b: vec4<u32>, d: u32) -> u32 {
    let w = d >> 1u;
    var x = b[(w - 4u) & 3u];
    if (w < 4u) { x = a[w]; }
    return (x >> ((d & 1u) * 16u)) & 0xFFFFu;
}

// One workgroup per (bh, tile): thread lid owns entries lid*ITEMS .. +ITEMS of the tile (in
// order), so rank = (same-digit entries of earlier threads) + (earlier own entries).
@compute @workgroup_size(WG)
fn digit_scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let tile = id % p.tiles;
    let first = tile * TILE + lid * ITEMS;
    let seg = bh * p.entries;
    var a = vec4<u32>();
    var b = vec4<u32>();
    for (var m = 0u; m < ITEMS; m++) {
        if (first + m < p.entries) { bump(&a, &b, digit(src[seg + first + m].x)); }
    }
    lo4[lid] = a;
    hi4[lid] = b;
    workgroupBarrier();
    for (var off = 1u; off < WG; off <<= 1u) {
        var x = vec4<u32>();
        var y = vec4<u32>();
        if (lid >= off) {
            x = lo4[lid - off];
            y = hi4[lid - off];
        }
        workgroupBarrier();
        lo4[lid] += x;
        hi4[lid] += y;
        workgroupBarrier();
    }
    var ra = lo4[lid] - a;
    var rb = hi4[lid] - b;
    for (var m = 0u; m < ITEMS; m++) {
        if (first + m < p.entries) {
            let pr = src[seg + first + m];
            let d = digit(pr.x);
            let at = hist[(bh * 16u + d) * p.tiles + tile] + count_of(ra, rb, d);
            bump(&ra, &rb, d);
            dst[seg + at] = pr;
        }
    }
}
