// BSA selection baseline (PISA.md section 3, "BSA baseline"): every complete-past, non-forced
// leaf j is scored by s * q.mu_j summed over the GQA group (= (s * sum_h q_h) . mu_j), and the
// best K - |forced| join the forced leaves. O(N / C) per query.
//
// One workgroup per (b, KV head, tile of QB consecutive queries). The leaves are scanned in
// chunks of WG: the chunk's mean rows are staged DC dims at a time into workgroup memory with
// coalesced reads, then each invocation scores one leaf against every query of the tile (query
// sums held [D][QB4] as vec4, accumulators unrolled by hand). Each query keeps a running top
// list in workgroup memory, sorted best first (position = rank). A scored leaf that beats the list's worst entry (or any leaf while the list
// is not full) joins the query's survivors (atomic append); after each chunk the list and the
// survivors are merged by rank (rank = number strictly better: higher score, then lower index),
// which is deterministic whatever the append order. The row is written ascending: forced + kept,
// -1 padded; a query that sees K or fewer leaves gets them all.
//
// Q: store_t, (b, h, n, d) at b*q_sb + h*q_sh + n*q_sn + d; means: f32 [B*Hkv, total_nodes, D]
// (level 0 at levels[0].x); out: i32 [B, Hkv, Nq, K].
// (store_t, Params, p and the shared helpers: select_common.wgsl, prepended)

const GQ: u32 = 1u;
const QB: u32 = 8u;
const KS: u32 = 16u;
// vec4 slots of the query-sum buffer: QB4 * (D rounded up to DC).
const QBUF: u32 = 64u;
const WG: u32 = 64u;
const DC: u32 = 32u;
const QB4: u32 = (QB + 3u) / 4u;
const LIST: u32 = QB * KS;

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> means: array<f32>;
@group(0) @binding(3) var<storage, read_write> sel: array<i32>;

var<workgroup> qs: array<vec4<f32>, QBUF>;
var<workgroup> ms: array<f32, WG * (DC + 1u)>;
var<workgroup> sc: array<vec4<f32>, WG * QB4>;
var<workgroup> ts: array<f32, 2u * LIST>;
var<workgroup> ti: array<u32, 2u * LIST>;
var<workgroup> tn: array<u32, QB>;
var<workgroup> ss: array<f32, QB * WG>;
var<workgroup> si: array<u32, QB * WG>;
var<workgroup> sn: array<atomic<u32>, QB>;
// Per query of the tile: own block, slots to fill (0: no choice), complete-past leaves.
var<workgroup> qbq: array<u32, QB>;
var<workgroup> qsl: array<u32, QB>;
var<workgroup> qpa: array<u32, QB>;

// Slots left after the forced leaves, 0 for a query that does not choose.
fn slots_of(i: u32) -> u32 {
    if (i >= p.q_len) { return 0u; }
    let bq = (p.q_pos0 + i) / p.block_size;
    if (visible(bq) <= p.top_k) { return 0u; }
    return p.top_k - n_forced(bq);
}
fn better(s: f32, j: u32, so: f32, jo: u32) -> bool {
    return s > so || (s == so && j < jo);
}

// Stages element e (leaf c0 + e / DC, dim d0 + e % DC) of the leaf means, branch-free.
fn stage_m(e: u32, c0: u32, d0: u32, pmax: u32, row0: u32) {
    let jj = c0 + e / DC;
    let d = d0 + e % DC;
    let ok = jj < pmax && d < p.head_dim;
    ms[(e / DC) * (DC + 1u) + e % DC] = select(0.0, means[select(0u, row0 + jj * p.head_dim + d, ok)], ok);
}

fn stage_m4(e: u32, c0: u32, d0: u32, pmax: u32, row0: u32) {
    stage_m(e + 0u, c0, d0, pmax, row0);
    stage_m(e + 64u, c0, d0, pmax, row0);
    stage_m(e + 128u, c0, d0, pmax, row0);
    stage_m(e + 192u, c0, d0, pmax, row0);
}

@compute @workgroup_size(WG)
fn bsa(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let i0 = (id % p.tiles) * QB;
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    let d_n = p.head_dim;
    let kk = p.top_k;
    // s * (sum of the group's query heads), [Dp][QB4] vec4, zero-padded.
    let d_p = (d_n + DC - 1u) / DC * DC;
    for (var e = lid; e < QB4 * 4u * d_p; e += WG) {
        let qi = e / d_p;
        let d = e % d_p;
        let i = i0 + qi;
        var v = 0.0;
        if (qi < QB && i < p.q_len && d < d_n) {
            let base = b * p.q_sb + i * p.q_sn + d;
            for (var h = 0u; h < GQ; h++) { v += f32(q[base + (hkv * GQ + h) * p.q_sh]); }
        }
        qs[d * QB4 + qi / 4u][qi % 4u] = p.scale * v;
    }
    if (lid < QB) {
        tn[lid] = 0u;
        atomicStore(&sn[lid], 0u);
        let bq = (p.q_pos0 + i0 + lid) / p.block_size;
        qbq[lid] = bq;
        qsl[lid] = slots_of(i0 + lid);
        qpa[lid] = select(p.nb0, bq, p.causal != 0u);
    }
    let i_last = min(i0 + QB, p.q_len) - 1u;
    var pmax = p.nb0;
    if (p.causal != 0u) { pmax = (p.q_pos0 + i_last) / p.block_size; }
    let row0 = (bh * p.total_nodes + p.levels[0].x) * d_n;
    var par = 0u;
    workgroupBarrier();
    for (var c0 = 0u; c0 < pmax; c0 += WG) {
        let j = c0 + lid;
        var a0 = vec4<f32>(0.0);
        var a1 = vec4<f32>(0.0);
        var a2 = vec4<f32>(0.0);
        var a3 = vec4<f32>(0.0);
        var a4 = vec4<f32>(0.0);
        var a5 = vec4<f32>(0.0);
        var a6 = vec4<f32>(0.0);
        var a7 = vec4<f32>(0.0);
        for (var d0 = 0u; d0 < d_p; d0 += DC) {
            // Straight-line coalesced staging: all loads in flight together.
            stage_m4(lid + 0u, c0, d0, pmax, row0); stage_m4(lid + 256u, c0, d0, pmax, row0);
            stage_m4(lid + 512u, c0, d0, pmax, row0); stage_m4(lid + 768u, c0, d0, pmax, row0);
            stage_m4(lid + 1024u, c0, d0, pmax, row0); stage_m4(lid + 1280u, c0, d0, pmax, row0);
            stage_m4(lid + 1536u, c0, d0, pmax, row0); stage_m4(lid + 1792u, c0, d0, pmax, row0);
            workgroupBarrier();
            let mr = lid * (DC + 1u);
            for (var dd = 0u; dd < DC; dd++) {
                let x = ms[mr + dd];
                let o = (d0 + dd) * QB4;
                a0 += qs[o] * x;
                if (QB4 > 1u) { a1 += qs[o + 1u] * x; }
                if (QB4 > 2u) { a2 += qs[o + 2u] * x; }
                if (QB4 > 3u) { a3 += qs[o + 3u] * x; }
                if (QB4 > 4u) { a4 += qs[o + 4u] * x; }
                if (QB4 > 5u) { a5 += qs[o + 5u] * x; }
                if (QB4 > 6u) { a6 += qs[o + 6u] * x; }
                if (QB4 > 7u) { a7 += qs[o + 7u] * x; }
            }
            workgroupBarrier();
        }
        let so = lid * QB4;
        sc[so] = a0;
        if (QB4 > 1u) { sc[so + 1u] = a1; }
        if (QB4 > 2u) { sc[so + 2u] = a2; }
        if (QB4 > 3u) { sc[so + 3u] = a3; }
        if (QB4 > 4u) { sc[so + 4u] = a4; }
        if (QB4 > 5u) { sc[so + 5u] = a5; }
        if (QB4 > 6u) { sc[so + 6u] = a6; }
        if (QB4 > 7u) { sc[so + 7u] = a7; }
        if (j < pmax) {
            for (var qi = 0u; qi < QB; qi++) {
                let slots = qsl[qi];
                if (slots > 0u && j < qpa[qi] && !is_forced(qbq[qi], j)) {
                    let score = sc[so + qi / 4u][qi % 4u];
                    let w = par * LIST + qi * KS + slots - 1u;
                    if (tn[qi] < slots || better(score, j, ts[w], ti[w])) {
                        let at = atomicAdd(&sn[qi], 1u);
                        ss[qi * WG + at] = score;
                        si[qi * WG + at] = j;
                    }
                }
            }
        }
        workgroupBarrier();
        let np = 1u - par;
        for (var e = lid; e < QB * (KS + WG); e += WG) {
            let qi = e / (KS + WG);
            let r = e % (KS + WG);
            let n = tn[qi];
            let m = atomicLoad(&sn[qi]);
            if (r < n + m) {
                var s: f32;
                var x: u32;
                if (r < n) { s = ts[par * LIST + qi * KS + r]; x = ti[par * LIST + qi * KS + r]; }
                else { s = ss[qi * WG + r - n]; x = si[qi * WG + r - n]; }
                var rank = r;
                if (m > 0u) {
                    rank = 0u;
                    for (var o = 0u; o < n; o++) {
                        if (better(ts[par * LIST + qi * KS + o], ti[par * LIST + qi * KS + o], s, x)) { rank++; }
                    }
                    for (var o = 0u; o < m; o++) {
                        if (better(ss[qi * WG + o], si[qi * WG + o], s, x)) { rank++; }
                    }
                }
                if (rank < qsl[qi]) {
                    ts[np * LIST + qi * KS + rank] = s;
                    ti[np * LIST + qi * KS + rank] = x;
                }
            }
        }
        workgroupBarrier();
        if (lid < QB) {
            tn[lid] = min(qsl[lid], tn[lid] + atomicLoad(&sn[lid]));
            atomicStore(&sn[lid], 0u);
        }
        par = np;
        workgroupBarrier();
    }
    // Kept leaves at their ascending positions among forced + kept.
    for (var e = lid; e < LIST; e += WG) {
        let qi = e / KS;
        let r = e % KS;
        let i = i0 + qi;
        if (i < p.q_len && r < tn[qi]) {
            let x = ti[par * LIST + e];
            let bq = (p.q_pos0 + i) / p.block_size;
            var pos = forced_below(bq, x);
            for (var o = 0u; o < tn[qi]; o++) {
                if (ti[par * LIST + qi * KS + o] < x) { pos++; }
            }
            sel[(bh * p.q_len + i) * kk + pos] = i32(x);
        }
    }
    if (lid < QB && i0 + lid < p.q_len) {
        let i = i0 + lid;
        let out = (bh * p.q_len + i) * kk;
        let bq = (p.q_pos0 + i) / p.block_size;
        let vis = visible(bq);
        var total = 0u;
        if (vis <= kk) {
            for (var j = 0u; j < vis; j++) { sel[out + j] = i32(j); }
            total = vis;
        } else {
            let nk = tn[lid];
            let ls = local_start(bq);
            let se = sink_end(bq);
            var idx = 0u;
            for (var f = 0u; f <= bq; f++) {
                if (f == se && se < ls) { f = ls; }
                var pos = idx;
                for (var o = 0u; o < nk; o++) {
                    if (ti[par * LIST + lid * KS + o] < f) { pos++; }
                }
                sel[out + pos] = i32(f);
                idx++;
            }
            total = idx + nk;
        }
        for (var r = total; r < kk; r++) { sel[out + r] = -1; }
    }
}
