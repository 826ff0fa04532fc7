// Oracle block selection for quality measurement (PISA.md section 3, "Quality"): the
// full-attention softmax mass of every leaf, averaged over the GQA group, and the top K leaves by
// mass (ties: lower index), no forced leaves. O(Nq * Nk * D) per head: only for measurement.
//
// `mass`: one workgroup per (b, KV head, query). Pass 1 (invocations stride over the visible
// keys, each key row read once for all GQ heads): per-invocation online (max, sum) per head,
// combined in workgroup memory into the row LSE of every head. Pass 2 (invocations stride over
// the leaves): mass_j = (1/GQ) sum_h sum_{t in leaf j, visible} exp(s q_h.k_t - lse_h); 0 for
// leaves with no visible key.
// `topk`: one workgroup per row; K rounds, each picking the best visible leaf after the last
// pick in the order (more mass, then lower index), then written ascending, -1 padded. Per
// invocation K (ceil(vis / WG) + log2 WG + 1) loop iterations (it counted every leaf's rank over
// all leaves before: past llvmpipe's 65535 a row at 7500 leaves, whose loops then ended early,
// silently); the host checks both entry points against the device's cap (ops/oracle.rs).
//
// Q, K: store_t, (b, h, n, d) at b*sb + h*sh + n*sn + d. mass: f32 [B, Hkv, Nq, nb0];
// out: i32 [B, Hkv, Nq, K].
// (store_t, Params, p and the shared helpers: select_common.wgsl, prepended)

const GQ: u32 = 1u;
const KS: u32 = 16u;
const QBUF: u32 = 64u;
const WG: u32 = 64u;
const NEG: f32 = -3.0e38;

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> k: array<store_t>;
@group(0) @binding(3) var<storage, read_write> mass: array<f32>;
@group(0) @binding(4) var<storage, read_write> sel: array<i32>;

var<workgroup> qs: array<f32, QBUF>;
var<workgroup> rm: array<f32, WG * GQ>;
var<workgroup> rl: array<f32, WG * GQ>;
var<workgroup> lse: array<f32, GQ>;
var<workgroup> pick: array<u32, KS>;
// The tree of a top-k round: each invocation's best (mass, leaf).
var<workgroup> bm: array<f32, WG>;
var<workgroup> bi: array<u32, WG>;
const INVALID: u32 = 0xffffffffu;

@compute @workgroup_size(WG)
fn oracle_mass(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = linear_id(wid, nwg);
    if (row >= p.wg_count) { return; }
    let bh = row / p.q_len;
    let i = row % p.q_len;
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    let d_n = p.head_dim;
    for (var e = lid; e < GQ * d_n; e += WG) {
        let hq = hkv * GQ + e / d_n;
        qs[e] = p.scale * f32(q[b * p.q_sb + hq * p.q_sh + i * p.q_sn + e % d_n]);
    }
    var nvis = p.k_len;
    if (p.causal != 0u) { nvis = p.q_pos0 + i + 1u; }
    let kbase = b * p.k_sb + hkv * p.k_sh;
    workgroupBarrier();
    var m: array<f32, GQ>;
    var l: array<f32, GQ>;
    var acc: array<f32, GQ>;
    for (var h = 0u; h < GQ; h++) { m[h] = NEG; l[h] = 0.0; }
    for (var t = lid; t < nvis; t += WG) {
        for (var h = 0u; h < GQ; h++) { acc[h] = 0.0; }
        let kr = kbase + t * p.k_sn;
        for (var d = 0u; d < d_n; d++) {
            let x = f32(k[kr + d]);
            for (var h = 0u; h < GQ; h++) { acc[h] += qs[h * d_n + d] * x; }
        }
        for (var h = 0u; h < GQ; h++) {
            let mn = max(m[h], acc[h]);
            l[h] = l[h] * exp(m[h] - mn) + exp(acc[h] - mn);
            m[h] = mn;
        }
    }
    for (var h = 0u; h < GQ; h++) {
        rm[lid * GQ + h] = m[h];
        rl[lid * GQ + h] = l[h];
    }
    workgroupBarrier();
    for (var h = lid; h < GQ; h += WG) {
        var mx = NEG;
        for (var r = 0u; r < WG; r++) { mx = max(mx, rm[r * GQ + h]); }
        var s = 0.0;
        for (var r = 0u; r < WG; r++) { s += rl[r * GQ + h] * exp(rm[r * GQ + h] - mx); }
        lse[h] = mx + log(s);
    }
    workgroupBarrier();
    for (var j = lid; j < p.nb0; j += WG) {
        let t0 = j * p.block_size;
        let t1 = min(t0 + p.block_size, nvis);
        var total = 0.0;
        for (var t = t0; t < t1; t++) {
            for (var h = 0u; h < GQ; h++) { acc[h] = 0.0; }
            let kr = kbase + t * p.k_sn;
            for (var d = 0u; d < d_n; d++) {
                let x = f32(k[kr + d]);
                for (var h = 0u; h < GQ; h++) { acc[h] += qs[h * d_n + d] * x; }
            }
            for (var h = 0u; h < GQ; h++) { total += exp(acc[h] - lse[h]); }
        }
        mass[row * p.nb0 + j] = total / f32(GQ);
    }
}

// Whether leaf (ma, ia) comes before leaf (mb, ib) in the oracle's order: more mass, then the
// lower index (a strict total order, so each round's pick is the best leaf after the last).
fn before(ma: f32, ia: u32, mb: f32, ib: u32) -> bool {
    return ma > mb || (ma == mb && ia < ib);
}

@compute @workgroup_size(WG)
fn oracle_topk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = linear_id(wid, nwg);
    if (row >= p.wg_count) { return; }
    let i = row % p.q_len;
    let kk = p.top_k;
    var vis = p.nb0;
    if (p.causal != 0u) { vis = (p.q_pos0 + i) / p.block_size + 1u; }
    let base = row * p.nb0;
    let n = min(kk, vis);
    // Round r picks the best leaf after pick r - 1 (the first: the best of all): each
    // invocation the best of its strided leaves, then a tree over the workgroup.
    var pm = 3.0e38;
    var pi = 0u;
    var first = true;
    for (var r = 0u; r < n; r++) {
        var best_m = 0.0;
        var best_i = INVALID;
        for (var j = lid; j < vis; j += WG) {
            var m = mass[base + j];
            // A NaN mass (non-finite inputs) first, as the CPU reference's total order ranks a
            // positive NaN above every mass (at most 1); tested by its bits, since naga writes
            // `m != m` as an ordered compare, false for NaN.
            if ((bitcast<u32>(m) & 0x7fffffffu) > 0x7f800000u) { m = 2.0; }
            let after = first || before(pm, pi, m, j);
            if (after && (best_i == INVALID || before(m, j, best_m, best_i))) {
                best_m = m;
                best_i = j;
            }
        }
        bm[lid] = best_m;
        bi[lid] = best_i;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (lid < s) {
                let om = bm[lid + s];
                let oi = bi[lid + s];
                if (oi != INVALID && (bi[lid] == INVALID || before(om, oi, bm[lid], bi[lid]))) {
                    bm[lid] = om;
                    bi[lid] = oi;
                }
            }
            workgroupBarrier();
        }
        pm = bm[0];
        pi = bi[0];
        first = false;
        if (lid == 0u) { pick[r] = pi; }
        workgroupBarrier();
    }
    // The picks ascending by index (each at the count of smaller picks), -1 padded.
    for (var r = lid; r < kk; r += WG) {
        if (r < n && pick[r] != INVALID) {
            let x = pick[r];
            var pos = 0u;
            for (var o = 0u; o < n; o++) {
                if (pick[o] < x) { pos++; }
            }
            sel[row * kk + pos] = i32(x);
        } else {
            sel[row * kk + r] = -1;
        }
    }
}
