// Leaf-major stage 2 of PISA prefill selection, part 3 of 3 (PISA.md 3.3 and 3.4; host:
// pisa-wgpu/src/ops/leaf_select/by_leaf.rs): the final pick from the scores the leaf-major
// scorer wrote. One workgroup of WG invocations per (b, KV head, QW consecutive queries), one
// invocation per candidate entry (query, slot), two barriers in all:
//   1. each entry's leaf (a non-forced candidate of a query that sees more than K leaves and has
//      slots left after its forced ones: the entries leaf_bucket.wgsl buckets and the scorer
//      scores; else NONE) and its ranking key from `scores` into workgroup memory;  barrier
//   2. keep = rank < K - |forced|, the rank being the number of the query's candidates strictly
//      better (higher key, then lower leaf): exactly that many kept whatever the scores, all of
//      them when the query has no more candidates than slots;                  barrier
//   3. the ascending row: a kept leaf goes after the forced leaves and kept leaves below it; the
//      entry of slot o also writes the o-th forced leaf (sinks first, then the locals and the
//      own block; and the (o + MC)-th, ...) after the kept leaves below it, and the -1 padding
//      of row position o (and o + MC, ...). A query that sees K or fewer leaves gets them all.
// The same rule as leaf_common.wgsl's `write_selection` (the tile kernels'), without its union:
// a query's candidates are distinct leaves, each scored in its own slot of `scores`. Measured
// on the H200 at 256K tokens, Hkv 8, MC 34 (docs/benchmarks.md, 2026-12-02, commit 83e52fe):
// 4.08 ms, where one workgroup of 64 per query with leaf_common's union and pick took 11.2;
// with the slots four to a vec4 (below), 4.12 -> 2.66 ms (and 1.04 -> 0.68 at 64K; 2026-12-03,
// A.18).
// cand: i32 [B, Hkv, Nq, MC] (-1 padded); scores: u32 ranking keys (`rank_key`) at the same
// index, written by the scorer for the entries step 1 keeps (the only ones read);
// sel: i32 [B, Hkv, Nq, K].
// (Params, p, linear_id, visible, is_forced, n_forced, forced_below, local_start, sink_end:
// select_common.wgsl, prepended.)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const MC: u32 = 34u;  // candidate slots per query
const QW: u32 = 7u;   // queries per workgroup: max(1, WG / (4 MC4)), the padded slots
const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
// Workgroup memory holds a query's slots four to a vec4 (MC4 vec4 per query, the slots past MC
// padded with NONE and not kept), so that the rank and count loops read four slots per load.
const MC4: u32 = (MC + 3u) / 4u;
const NE: u32 = QW * MC4 * 4u;

@group(0) @binding(3) var<storage, read> cand: array<i32>;
@group(0) @binding(4) var<storage, read_write> sel: array<i32>;
@group(0) @binding(9) var<storage, read> scores: array<u32>;

var<workgroup> cl: array<vec4<u32>, QW * MC4>; // entry's leaf, or NONE
var<workgroup> sc: array<vec4<u32>, QW * MC4>; // entry's ranking key
var<workgroup> kf: array<vec4<u32>, QW * MC4>; // 1: kept

// Kept leaves of local query qi below leaf x.
fn kept_below(qi: u32, x: u32) -> u32 {
    var n = vec4<u32>(0u);
    for (var o4 = qi * MC4; o4 < qi * MC4 + MC4; o4++) {
        n += kf[o4] & vec4<u32>(cl[o4] < vec4<u32>(x));
    }
    return n.x + n.y + n.z + n.w;
}

@compute @workgroup_size(WG)
fn leaf_pick(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let i0 = (id % p.tiles) * QW;
    let kk = p.top_k;
    // Entry e: query e / (4 MC4), slot e % (4 MC4); slots past MC are padding.
    for (var e = lid; e < NE; e += WG) {
        let i = i0 + e / (MC4 * 4u);
        let o = e % (MC4 * 4u);
        var x = NONE;
        var s = 0u;
        if (i < p.q_len && o < MC) {
            let bq = (p.q_pos0 + i) / p.block_size;
            let at = (bh * p.q_len + i) * MC + o;
            let c = cand[at];
            if (visible(bq) > kk && n_forced(bq) < kk && c >= 0 && !is_forced(bq, u32(c))) {
                x = u32(c);
                s = scores[at];
            }
        }
        cl[e / 4u][e % 4u] = x;
        sc[e / 4u][e % 4u] = s;
    }
    workgroupBarrier();
    for (var e = lid; e < NE; e += WG) {
        let qi = e / (MC4 * 4u);
        let x = cl[e / 4u][e % 4u];
        var keep = 0u;
        if (x != NONE) {
            let bq = (p.q_pos0 + i0 + qi) / p.block_size;
            let s4 = vec4<u32>(sc[e / 4u][e % 4u]);
            let x4 = vec4<u32>(x);
            var rank = vec4<u32>(0u);
            for (var o4 = qi * MC4; o4 < qi * MC4 + MC4; o4++) {
                let xo = cl[o4];
                let so = sc[o4];
                // A bool vector converted, not select() (see route.wgsl's rank step).
                let better = (xo != vec4<u32>(NONE)) & ((so > s4) | ((so == s4) & (xo < x4)));
                rank += vec4<u32>(better);
            }
            keep = select(0u, 1u, rank.x + rank.y + rank.z + rank.w < kk - n_forced(bq));
        }
        kf[e / 4u][e % 4u] = keep;
    }
    workgroupBarrier();
    for (var e = lid; e < NE; e += WG) {
        let qi = e / (MC4 * 4u);
        let o = e % (MC4 * 4u);
        let i = i0 + qi;
        if (i >= p.q_len || o >= MC) { continue; }
        let out = (bh * p.q_len + i) * kk;
        let bq = (p.q_pos0 + i) / p.block_size;
        let vis = visible(bq);
        if (vis <= kk) {
            for (var r = o; r < kk; r += MC) { sel[out + r] = select(-1, i32(r), r < vis); }
            continue;
        }
        let x = cl[e / 4u][e % 4u];
        if (kf[e / 4u][e % 4u] != 0u) {
            sel[out + forced_below(bq, x) + kept_below(qi, x)] = i32(x);
        }
        // Forced leaf r (sinks 0..se, then ls..=bq) and the padding after the kept ones.
        let nf = n_forced(bq);
        let se = sink_end(bq);
        let ls = local_start(bq);
        var k4 = vec4<u32>(0u);
        for (var o4 = qi * MC4; o4 < qi * MC4 + MC4; o4++) { k4 += kf[o4]; }
        let nk = k4.x + k4.y + k4.z + k4.w;
        for (var r = o; r < kk; r += MC) {
            if (r < nf) {
                let f = select(ls + r - se, r, r < se);
                sel[out + r + kept_below(qi, f)] = i32(f);
            } else if (r >= nf + nk) {
                sel[out + r] = -1;
            }
        }
    }
}
