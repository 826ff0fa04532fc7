// Decode step (PISA.md sections 3, 4, 5): ONE workgroup per (sequence, KV head) routes the new
// token's GQA group through every pyramid level, scores the leaf candidates by exact LSE, keeps
// the top K and attends over them (online softmax, f32 accumulators), in one dispatch.
// This file holds the declarations and the selection; decode_attend.wgsl (appended to it to
// make one module) the attention and the entry point. The pyramid update of an append and the
// prefill copy live in decode_append.wgsl.
//
// Layouts: q, out [B, Hq, D]; kc, vc [B, Hkv, capacity, D] (store_t, read as vec4 rows: D is a
// multiple of 4); means, sq f32 [B*Hkv, cap_nodes, D] with node j of level l at cap_off[l] + j
// (the capacity's layout; the nodes of a shorter length are a prefix of each level); lens [B]
// u32; lse_out [B, Hq] f32; sel_out [B, Hkv, K] i32 ascending, -1 padded.
// Every dot product is one invocation's loop over the D/4 vec4s of a row (the head dim is a
// compile-time constant, so the loads are unrolled and in flight together) against the group's
// queries in workgroup memory (broadcast reads): a loaded row serves all GQ heads.
alias store_t = f32;

// Sizes substituted per pipeline (see ops/decode/plan.rs).
const WG: u32 = 64u;     // invocations per workgroup
const GQ: u32 = 2u;      // g_q: query heads per KV head
const KMAX: u32 = 4u;    // K (top_k)
const MAXC: u32 = 10u;   // g * (K + 1): candidate slots of one level
const XS: u32 = 256u;    // f32 scratch (scores, partial LSEs, attention chunk, merge)
const DD: u32 = 64u;     // D, the head dim (a multiple of 4)
const PARTS: u32 = 1u;   // key subsets of the P.V phase (invocations per output vec4)
const D4: u32 = DD / 4u;

const INVALID: u32 = 0xffffffffu;
// Finite stand-ins for -inf (WGSL may assume no infinities): "no score" and its test.
const NEG: f32 = -3.0e38;
const NEG_T: f32 = -1.0e38;
const CH: u32 = XS / GQ; // attention tokens per chunk

struct Params {
    batch: u32, kv_heads: u32, q_heads: u32, head_dim: u32,
    block_size: u32, merge: u32, top_k: u32, scoring: u32,
    causal: u32, sink: u32, local: u32, capacity: u32,
    cap_nodes: u32, wg_count: u32, scale: f32, seq: u32,
    src_sh: u32, src_sn: u32, count: u32, src_len: u32,
    cap_off: array<vec4<u32>, 16>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> lens: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<store_t>;
@group(0) @binding(3) var<storage, read> kc: array<vec4<store_t>>;
@group(0) @binding(4) var<storage, read> vc: array<vec4<store_t>>;
@group(0) @binding(5) var<storage, read> means: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> sq: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> out: array<store_t>;
@group(0) @binding(8) var<storage, read_write> lse_out: array<f32>;
@group(0) @binding(9) var<storage, read_write> sel_out: array<i32>;

var<workgroup> qs: array<vec4<f32>, GQ * D4>;
var<workgroup> cand: array<u32, MAXC>;
var<workgroup> byrank: array<u32, MAXC>;
var<workgroup> score: array<f32, MAXC>;
var<workgroup> sel_tmp: array<u32, KMAX>;
var<workgroup> sel_s: array<u32, KMAX>;
var<workgroup> xs: array<f32, XS>;
var<workgroup> red: array<f32, WG>;
var<workgroup> hm: array<f32, GQ>;
var<workgroup> halpha: array<f32, GQ>;
var<workgroup> wlen: u32;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}
fn cdiv(a: u32, b: u32) -> u32 { return a / b + select(0u, 1u, a % b != 0u); }
fn sat_mul(a: u32, b: u32) -> u32 {
    if (b != 0u && a > 0xffffffffu / b) { return 0xffffffffu; }
    return a * b;
}
fn cap_off(l: u32) -> u32 { return p.cap_off[l / 4u][l % 4u]; }
// Nodes of level l for nb0 leaves: ceil(nb0 / g^l).
fn level_nodes(nb0: u32, l: u32) -> u32 {
    var n = nb0;
    for (var i = 0u; i < l; i++) { n = cdiv(n, p.merge); }
    return n;
}
// Ancestor at level l of leaf bq.
fn anc(bq: u32, l: u32) -> u32 {
    var a = bq;
    for (var i = 0u; i < l; i++) { a = a / p.merge; }
    return a;
}
// Tokens of node j of level l over len keys.
fn node_len(l: u32, j: u32, len: u32) -> u32 {
    var w = p.block_size;
    for (var i = 0u; i < l; i++) { w = sat_mul(w, p.merge); }
    return min(len - sat_mul(j, w), w);
}
// First vec4 of a pyramid node's row and of a key's row.
fn node_row(bh: u32, l: u32, j: u32) -> u32 { return (bh * p.cap_nodes + cap_off(l) + j) * D4; }
fn key_row(bh: u32, t: u32) -> u32 { return (bh * p.capacity + t) * D4; }
// q_h . mu for every head h of the group (a node's mean row).
fn dots_mean(row: u32) -> array<f32, GQ> {
    var a: array<f32, GQ>;
    for (var j = 0u; j < D4; j++) {
        let m = means[row + j];
        for (var hh = 0u; hh < GQ; hh++) { a[hh] += dot(qs[hh * D4 + j], m); }
    }
    return a;
}
// q_h . k_t for every head h of the group.
fn dots_key(row: u32) -> array<f32, GQ> {
    var a: array<f32, GQ>;
    for (var j = 0u; j < D4; j++) {
        let k = vec4<f32>(kc[row + j]);
        for (var hh = 0u; hh < GQ; hh++) { a[hh] += dot(qs[hh * D4 + j], k); }
    }
    return a;
}
fn is_forced(bq: u32, j: u32) -> bool {
    return j <= bq && (j < p.sink || j + p.local >= bq);
}
// LSE of (m, l) online-softmax state; NEG when empty.
fn state_lse(m: f32, l: f32) -> f32 { return select(NEG, m + log(l), l > 0.0); }

// score[slot] for the candidates of level l >= 1 (PISA.md 2), summed over the group.
fn score_level(bh: u32, l: u32, len: u32, nb0: u32, lid: u32) {
    let g = p.merge;
    if (p.scoring == 0u) {
        // lse: one item per (candidate, child); x = s * q.mu_c + log n_c per head.
        let nchild = level_nodes(nb0, l - 1u);
        for (var it = lid; it < MAXC * g; it += WG) {
            let node = cand[it / g];
            var x: array<f32, GQ>;
            for (var hh = 0u; hh < GQ; hh++) { x[hh] = NEG; }
            let child = node * g + it % g;
            if (node != INVALID && child < nchild) {
                let a = dots_mean(node_row(bh, l - 1u, child));
                let ln = log(f32(node_len(l - 1u, child, len)));
                for (var hh = 0u; hh < GQ; hh++) { x[hh] = p.scale * a[hh] + ln; }
            }
            for (var hh = 0u; hh < GQ; hh++) { xs[it * GQ + hh] = x[hh]; }
        }
        workgroupBarrier();
        for (var s = lid; s < MAXC; s += WG) {
            if (cand[s] == INVALID) { continue; }
            var tot = 0.0;
            for (var hh = 0u; hh < GQ; hh++) {
                var m = NEG;
                for (var c = 0u; c < g; c++) { m = max(m, xs[(s * g + c) * GQ + hh]); }
                var sum = 0.0;
                for (var c = 0u; c < g; c++) {
                    let x = xs[(s * g + c) * GQ + hh];
                    if (x > NEG_T) { sum += exp(x - m); }
                }
                tot += m + log(sum);
            }
            score[s] = tot;
        }
    } else {
        // mean / meanvar: s * q.mu + log n (+ s^2/2 * sum_d q_d^2 var_d), var = E[k^2] - mu^2.
        let mv = p.scoring == 2u;
        for (var s = lid; s < MAXC; s += WG) {
            let node = cand[s];
            if (node == INVALID) { continue; }
            let row = node_row(bh, l, node);
            var a1: array<f32, GQ>;
            var a2: array<f32, GQ>;
            for (var j = 0u; j < D4; j++) {
                let mu = means[row + j];
                var var_d = vec4<f32>(0.0);
                if (mv) { var_d = max(sq[row + j] - mu * mu, vec4<f32>(0.0)); }
                for (var hh = 0u; hh < GQ; hh++) {
                    let qv = qs[hh * D4 + j];
                    a1[hh] += dot(qv, mu);
                    a2[hh] += dot(qv * qv, var_d);
                }
            }
            let ln = log(f32(node_len(l, node, len)));
            var tot = 0.0;
            for (var hh = 0u; hh < GQ; hh++) {
                tot += p.scale * a1[hh] + ln + 0.5 * p.scale * p.scale * a2[hh];
            }
            score[s] = tot;
        }
    }
}

// score[slot] = exact leaf LSE (PISA.md 2) summed over the group; S items per leaf split its keys.
fn score_leaves(bh: u32, len: u32, lid: u32) {
    let sub_n = max(1u, WG / MAXC);
    for (var it = lid; it < MAXC * sub_n; it += WG) {
        let leaf = cand[it / sub_n];
        var m: array<f32, GQ>;
        var l: array<f32, GQ>;
        for (var hh = 0u; hh < GQ; hh++) { m[hh] = NEG; }
        if (leaf != INVALID) {
            let t0 = leaf * p.block_size;
            let t1 = min(t0 + p.block_size, len);
            for (var t = t0 + it % sub_n; t < t1; t += sub_n) {
                let acc = dots_key(key_row(bh, t));
                for (var hh = 0u; hh < GQ; hh++) {
                    let x = p.scale * acc[hh];
                    if (x > m[hh]) {
                        l[hh] = l[hh] * exp(m[hh] - x) + 1.0;
                        m[hh] = x;
                    } else {
                        l[hh] += exp(x - m[hh]);
                    }
                }
            }
        }
        for (var hh = 0u; hh < GQ; hh++) { xs[it * GQ + hh] = state_lse(m[hh], l[hh]); }
    }
    workgroupBarrier();
    for (var s = lid; s < MAXC; s += WG) {
        if (cand[s] == INVALID) { continue; }
        var tot = 0.0;
        for (var hh = 0u; hh < GQ; hh++) {
            var m = NEG;
            for (var u = 0u; u < sub_n; u++) { m = max(m, xs[(s * sub_n + u) * GQ + hh]); }
            var sum = 0.0;
            for (var u = 0u; u < sub_n; u++) {
                let x = xs[(s * sub_n + u) * GQ + hh];
                if (x > NEG_T) { sum += exp(x - m); }
            }
            tot += m + log(sum);
        }
        score[s] = tot;
    }
}

// Ranking key of a score (PISA.md 3.4): an order-preserving map of f32 onto u32, compared as
// integers so that the top-K is a strict total order whatever the scores: every NaN ranks as
// -inf (it never wins, and never makes two candidates share a rank), -0 as +0. (WGSL float
// compares may assume no NaN, and NaN compares false both ways, which broke the rank count.)
fn rank_key(s: f32) -> u32 {
    var b = bitcast<u32>(s);
    if ((b & 0x7fffffffu) > 0x7f800000u) { b = 0xff800000u; }
    if (b == 0x80000000u) { b = 0u; }
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// byrank[r] = candidate of rank r < keep (higher score first, then lower index: PISA.md 3.4).
// Scores are compared through `rank_key`, so ranks are distinct (no two writes to one slot)
// even when a score is NaN.
fn cut(keep: u32, lid: u32) {
    for (var i = lid; i < MAXC; i += WG) {
        let v = cand[i];
        if (v == INVALID) { continue; }
        let sc = rank_key(score[i]);
        var r = 0u;
        for (var j = 0u; j < MAXC; j++) {
            let u = cand[j];
            let sj = rank_key(score[j]);
            if (u != INVALID && (sj > sc || (sj == sc && u < v))) { r++; }
        }
        if (r < keep) { byrank[r] = v; }
    }
    workgroupBarrier();
}

// PISA selection (PISA.md 3) of the query at position len - 1 into sel_tmp (unsorted).
fn select_pisa(bh: u32, len: u32, bq: u32, nb0: u32, lid: u32) {
    let g = p.merge;
    let causal = p.causal != 0u;
    var s = 0u;
    var n = nb0;
    loop {
        n = cdiv(n, g);
        if (n <= KMAX) { break; }
        s++;
    }
    var first = level_nodes(nb0, s);
    if (causal) { first = anc(bq, s); }
    for (var i = lid; i < MAXC; i += WG) {
        cand[i] = select(INVALID, i, i < first && !(s == 0u && is_forced(bq, i)));
    }
    workgroupBarrier();
    for (var l = s; l >= 1u; l--) {
        score_level(bh, l, len, nb0, lid);
        for (var i = lid; i < KMAX; i += WG) { byrank[i] = INVALID; }
        workgroupBarrier();
        cut(KMAX, lid);
        // Children of the kept nodes (rank order) and of the ancestor below the own path.
        let nchild = level_nodes(nb0, l - 1u);
        let a_hi = anc(bq, l) * g;
        let a_lo = anc(bq, l - 1u);
        for (var i = lid; i < MAXC; i += WG) {
            var c = INVALID;
            if (i < KMAX * g) {
                let nd = byrank[i / g];
                if (nd != INVALID && nd * g + i % g < nchild) { c = nd * g + i % g; }
            } else if (causal && a_hi + (i - KMAX * g) < a_lo) {
                c = a_hi + (i - KMAX * g);
            }
            if (l == 1u && c != INVALID && is_forced(bq, c)) { c = INVALID; }
            cand[i] = c;
        }
        workgroupBarrier();
    }
    // Leaves: forced ones (sinks, locals, own) plus the best K - forced scored candidates.
    let local_start = bq - min(p.local, bq);
    let sink_end = min(p.sink, local_start);
    let nf = sink_end + bq - local_start + 1u;
    score_leaves(bh, len, lid);
    for (var i = lid; i < KMAX; i += WG) { byrank[i] = INVALID; }
    workgroupBarrier();
    cut(KMAX - nf, lid);
    for (var i = lid; i < KMAX; i += WG) {
        var v = byrank[i - min(i, nf)];
        if (i < nf) { v = select(local_start + i - sink_end, i, i < sink_end); }
        sel_tmp[i] = v;
    }
}

