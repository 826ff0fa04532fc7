// Stage 1 of PISA prefill selection (PISA.md sections 2, 3 and 5): route every query through
// the intermediate pyramid levels (start level down to 1) and write its level-0 candidates.
//
// One workgroup per (b, KV head, tile of QT consecutive queries). Candidates, scores and keep
// flags live in workgroup memory; no query-by-block matrix is ever written. Per level:
//   1. score: one invocation per (query, candidate) computes the candidate's score for all GQ
//      query heads at once (each pyramid row is read once and serves the whole group) and sums
//      them (`lse`: LSE over the children's means; `mean`, `meanvar`: the node's own row);
//   2. keep: a level with more than K candidates keeps those of rank < K, where the rank is the
//      number of candidates strictly better (higher score, then lower node index): deterministic,
//      no sort;
//   3. expand: kept nodes (in ascending index order, so the list stays sorted) write their
//      children at g * (kept nodes before them); one invocation per query appends the
//      complete-past children of the ancestor.
// Output: cand [B, Hkv, Nq, MC] i32, ascending leaf indices, -1 padded. Queries that see K or
// fewer leaves (and every query when nb_0 <= K) get an all -1 row: stage 2 gives them all leaves.
//
// Q is store_t, element (b, h, n, d) at b*q_sb + h*q_sh + n*q_sn + d; means / sq are f32
// [B*Hkv, total_nodes, D] (the second moment E[k^2]; var = E[k^2] - mu^2, clamped at 0).
alias store_t = f32;

const GQ: u32 = 1u;
const QT: u32 = 4u;
const MC: u32 = 34u;
const QBUF: u32 = 256u;
const WG: u32 = 64u;
const NEG: f32 = -3.0e38;

struct Params {
    q_sb: u32, q_sh: u32, q_sn: u32, k_sb: u32,
    k_sh: u32, k_sn: u32, q_heads: u32, kv_heads: u32,
    q_len: u32, k_len: u32, head_dim: u32, block_size: u32,
    merge: u32, top_k: u32, causal: u32, sink: u32,
    local: u32, nb0: u32, total_nodes: u32, start_level: u32,
    scoring: u32, tiles: u32, wg_count: u32, scale: f32,
    q_pos0: u32, mc: u32, routed: u32, pad1: u32,
    // per level: (node offset in the allocation, valid nodes, leaves per node, tokens per node)
    levels: array<vec4<u32>, 64>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> means: array<f32>;
@group(0) @binding(3) var<storage, read> sq: array<f32>;
@group(0) @binding(4) var<storage, read_write> cand: array<i32>;

var<workgroup> qs: array<f32, QBUF>;
var<workgroup> cl: array<u32, 2u * QT * MC>;
var<workgroup> sc: array<f32, QT * MC>;
var<workgroup> kp: array<u32, QT * MC>;
var<workgroup> nc: array<u32, QT>;
var<workgroup> ncn: array<u32, QT>;
var<workgroup> rt: array<u32, QT>;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}

// Tokens of node j of a level with `tpn` tokens per full node.
fn node_len(j: u32, tpn: u32) -> u32 {
    return min((j + 1u) * tpn, p.k_len) - j * tpn;
}

// Score of node j of level l >= 1 for query qi of the tile, summed over the GQ heads.
fn score(qi: u32, row0: u32, l: u32, j: u32) -> f32 {
    let d_n = p.head_dim;
    let qb = qi * GQ * d_n;
    var acc: array<f32, GQ>;
    var total = 0.0;
    if (p.scoring == 0u) {
        let lc = p.levels[l - 1u];
        var m: array<f32, GQ>;
        var s: array<f32, GQ>;
        for (var h = 0u; h < GQ; h++) { m[h] = NEG; s[h] = 0.0; }
        let c1 = min(j * p.merge + p.merge, lc.y);
        for (var c = j * p.merge; c < c1; c++) {
            let row = (row0 + lc.x + c) * d_n;
            for (var h = 0u; h < GQ; h++) { acc[h] = 0.0; }
            for (var d = 0u; d < d_n; d++) {
                let x = means[row + d];
                for (var h = 0u; h < GQ; h++) { acc[h] += qs[qb + h * d_n + d] * x; }
            }
            let ln_n = log(f32(node_len(c, lc.w)));
            for (var h = 0u; h < GQ; h++) {
                let v = acc[h] + ln_n;
                let mn = max(m[h], v);
                s[h] = s[h] * exp(m[h] - mn) + exp(v - mn);
                m[h] = mn;
            }
        }
        for (var h = 0u; h < GQ; h++) { total += m[h] + log(s[h]); }
    } else {
        let lv = p.levels[l];
        let row = (row0 + lv.x + j) * d_n;
        var v2: array<f32, GQ>;
        for (var h = 0u; h < GQ; h++) { acc[h] = 0.0; v2[h] = 0.0; }
        for (var d = 0u; d < d_n; d++) {
            let x = means[row + d];
            var var_d = 0.0;
            if (p.scoring == 2u) { var_d = max(sq[row + d] - x * x, 0.0); }
            for (var h = 0u; h < GQ; h++) {
                let qv = qs[qb + h * d_n + d];
                acc[h] += qv * x;
                v2[h] += qv * qv * var_d;
            }
        }
        let ln_n = log(f32(node_len(j, lv.w)));
        for (var h = 0u; h < GQ; h++) { total += acc[h] + ln_n + 0.5 * v2[h]; }
    }
    return total;
}

@compute @workgroup_size(WG)
fn route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let i0 = (id % p.tiles) * QT;
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    let d_n = p.head_dim;
    let row0 = bh * p.total_nodes;
    let k = p.top_k;
    let g = p.merge;
    // Scaled queries of the tile, [QT][GQ][D].
    for (var e = lid; e < QT * GQ * d_n; e += WG) {
        let qi = e / (GQ * d_n);
        let r = e % (GQ * d_n);
        let i = i0 + qi;
        var v = 0.0;
        if (i < p.q_len) {
            let hq = hkv * GQ + r / d_n;
            v = p.scale * f32(q[b * p.q_sb + hq * p.q_sh + i * p.q_sn + r % d_n]);
        }
        qs[e] = v;
    }
    // Start-level candidates: the complete-past nodes 0..n (the ancestor is implicit).
    let top = p.levels[p.start_level];
    if (lid < QT) {
        let i = i0 + lid;
        var n = 0u;
        var routed = 0u;
        if (i < p.q_len && p.routed != 0u) {
            let bq = (p.q_pos0 + i) / p.block_size;
            if (p.causal == 0u) {
                n = top.y;
                routed = 1u;
            } else if (bq + 1u > k) {
                n = bq / top.z;
                routed = 1u;
            }
        }
        nc[lid] = n;
        rt[lid] = routed;
    }
    workgroupBarrier();
    for (var e = lid; e < QT * MC; e += WG) {
        cl[e] = e % MC;
    }
    var cur = 0u;
    for (var l = p.start_level; l >= 1u; l--) {
        let lc = p.levels[l - 1u];
        let nxt = QT * MC - cur;
        workgroupBarrier();
        // 1. score
        for (var e = lid; e < QT * MC; e += WG) {
            let qi = e / MC;
            let n = nc[qi];
            if (e % MC < n && n > k) { sc[e] = score(qi, row0, l, cl[cur + e]); }
        }
        workgroupBarrier();
        // 2. keep: rank < K under (higher score, then lower index)
        for (var e = lid; e < QT * MC; e += WG) {
            let qi = e / MC;
            let ci = e % MC;
            let n = nc[qi];
            var keep = 0u;
            if (ci < n) {
                keep = 1u;
                if (n > k) {
                    let s = sc[e];
                    let j = cl[cur + e];
                    var rank = 0u;
                    for (var o = 0u; o < n; o++) {
                        let so = sc[qi * MC + o];
                        let jo = cl[cur + qi * MC + o];
                        if (so > s || (so == s && jo < j)) { rank++; }
                    }
                    keep = select(0u, 1u, rank < k);
                }
            }
            kp[e] = keep;
        }
        workgroupBarrier();
        // 3. expand kept nodes (only the last node of a level may have fewer than g children,
        // and it has the highest index, so g * (kept before) is each node's first slot).
        for (var e = lid; e < QT * MC; e += WG) {
            let qi = e / MC;
            let ci = e % MC;
            if (ci < nc[qi] && kp[e] != 0u) {
                var before = 0u;
                for (var o = 0u; o < ci; o++) { before += kp[qi * MC + o]; }
                let j = cl[cur + e];
                let c1 = min(j * g + g, lc.y);
                for (var c = j * g; c < c1; c++) {
                    cl[nxt + qi * MC + before * g + c - j * g] = c;
                }
            }
        }
        if (lid < QT) {
            let qi = lid;
            var total = 0u;
            for (var o = 0u; o < nc[qi]; o++) {
                if (kp[qi * MC + o] != 0u) {
                    let j = cl[cur + qi * MC + o];
                    total += min(j * g + g, lc.y) - j * g;
                }
            }
            if (p.causal != 0u && rt[qi] != 0u) {
                let bq = (p.q_pos0 + i0 + qi) / p.block_size;
                let below = bq / lc.z;
                for (var c = (bq / p.levels[l].z) * g; c < below; c++) {
                    cl[nxt + qi * MC + total] = c;
                    total++;
                }
            }
            ncn[qi] = total;
        }
        workgroupBarrier();
        if (lid < QT) { nc[lid] = ncn[lid]; }
        cur = nxt;
    }
    workgroupBarrier();
    for (var e = lid; e < QT * MC; e += WG) {
        let qi = e / MC;
        let ci = e % MC;
        let i = i0 + qi;
        if (i < p.q_len && ci < p.mc) {
            var v = -1;
            if (ci < nc[qi]) { v = i32(cl[cur + e]); }
            cand[(bh * p.q_len + i) * p.mc + ci] = v;
        }
    }
}
