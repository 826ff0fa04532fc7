// Stage 1 of PISA prefill selection (PISA.md sections 2, 3 and 5): route every query through
// the intermediate pyramid levels (start level down to 1) and write its level-0 candidates.
//
// One workgroup per (b, KV head, tile of QT consecutive queries). Candidates, scores and keep
// flags live in workgroup memory; no query-by-block matrix is ever written. Per level:
//   1. score: the pyramid rows the scored candidates need (`lse`: each candidate's children;
//      `mean`, `meanvar`: its own row) are listed, then staged WG rows x DC dims at a time into
//      workgroup memory with coalesced reads; one invocation per row computes its dot products
//      with all GQ query heads at once (vec4 accumulators unrolled by hand, 16 heads per pass), and one invocation
//      per candidate combines them into the score summed over the heads;
//   2. keep: a level with more than K candidates keeps those of rank < K, where the rank is the
//      number of candidates strictly better (higher score, then lower node index; scores compared
//      through `rank_key`, so a NaN ranks as -inf): deterministic, exactly K kept, no sort;
//   3. expand: kept nodes (in ascending index order, so the list stays sorted) write their
//      children at g * (kept nodes before them); one invocation per query appends the
//      complete-past children of the ancestor.
// Output: cand [B, Hkv, Nq, MC] i32, ascending leaf indices, -1 padded. Queries that see K or
// fewer leaves (and every query when nb_0 <= K) get an all -1 row: stage 2 gives them all leaves.
//
// Q is store_t, element (b, h, n, d) at b*q_sb + h*q_sh + n*q_sn + d; means / sq are f32
// [B*Hkv, total_nodes, D] (the second moment E[k^2]; var = E[k^2] - mu^2, clamped at 0).
// (store_t, Params, p and the shared helpers: select_common.wgsl, prepended)

const GQ: u32 = 1u;
const QT: u32 = 4u;
const MC: u32 = 34u;
// Merge factor g (rows per `lse` candidate).
const G: u32 = 2u;
// 1 when scoring is `meanvar` (sizes the variance buffers).
const MV: u32 = 0u;
// vec4 slots of the query buffer: QT * GQ4 * (D rounded up to DC).
const QBUF: u32 = 64u;
const WG: u32 = 64u;
const DC: u32 = 32u;
const GQ4: u32 = (GQ + 3u) / 4u;
const NEG: f32 = -3.0e38;

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> means: array<f32>;
@group(0) @binding(3) var<storage, read> sq: array<f32>;
@group(0) @binding(4) var<storage, read_write> cand: array<i32>;

var<workgroup> qs: array<vec4<f32>, QBUF>;
var<workgroup> ms: array<f32, WG * (DC + 1u)>;
var<workgroup> vs: array<f32, MV * WG * (DC + 1u) + 1u>;
var<workgroup> rd: array<vec4<f32>, QT * MC * G * GQ4>;
var<workgroup> rv: array<vec4<f32>, MV * QT * MC * GQ4 + 1u>;
var<workgroup> ra: array<u32, QT * MC * G>;
var<workgroup> nr: atomic<u32>;
var<workgroup> cl: array<u32, 2u * QT * MC>;
var<workgroup> sc: array<u32, QT * MC>;
var<workgroup> kp: array<u32, QT * MC>;
var<workgroup> nc: array<u32, QT>;
var<workgroup> ncn: array<u32, QT>;
var<workgroup> rt: array<u32, QT>;

// Stages element e (listed row r0 + e / DC, dim d0 + e % DC) of the rows to score, branch-free:
// slot e*G + c is child c of entry e's node (`lse`), or the node itself (`mean`, `meanvar`).
fn stage_r(e: u32, r0: u32, n_rows: u32, d0: u32, cur: u32, l: u32, row0: u32) {
    let ri = r0 + e / DC;
    let d = d0 + e % DC;
    let ok = ri < n_rows && d < p.head_dim;
    let slot = ra[select(0u, ri, ok)];
    let c = cl[cur + slot / G];
    let node = select(p.levels[l].x + c, p.levels[l - 1u].x + c * p.merge + slot % G, p.scoring == 0u);
    let o = select(0u, (row0 + node) * p.head_dim + d, ok);
    let v = select(0.0, means[o], ok);
    let at = (e / DC) * (DC + 1u) + e % DC;
    ms[at] = v;
    if (MV != 0u) { vs[at] = select(0.0, max(sq[o] - v * v, 0.0), ok && p.scoring == 2u); }
}

fn stage_r4(e: u32, r0: u32, n_rows: u32, d0: u32, cur: u32, l: u32, row0: u32) {
    stage_r(e + 0u, r0, n_rows, d0, cur, l, row0);
    stage_r(e + 64u, r0, n_rows, d0, cur, l, row0);
    stage_r(e + 128u, r0, n_rows, d0, cur, l, row0);
    stage_r(e + 192u, r0, n_rows, d0, cur, l, row0);
}

// Score of entry e (node j of level l >= 1) from the row dots, summed over the GQ heads.
fn score(e: u32, l: u32, j: u32) -> f32 {
    var total = 0.0;
    if (p.scoring == 0u) {
        let lc = p.levels[l - 1u];
        let c1 = min(j * p.merge + p.merge, lc.y);
        for (var h = 0u; h < GQ; h++) {
            var m = NEG;
            var s = 0.0;
            for (var c = j * p.merge; c < c1; c++) {
                let v = rd[(e * G + c - j * p.merge) * GQ4 + h / 4u][h % 4u] + log(f32(node_len(c, lc.w)));
                let mn = max(m, v);
                s = s * exp(m - mn) + exp(v - mn);
                m = mn;
            }
            total += m + log(s);
        }
    } else {
        let ln_n = log(f32(node_len(j, p.levels[l].w)));
        for (var h = 0u; h < GQ; h++) {
            total += rd[e * G * GQ4 + h / 4u][h % 4u] + ln_n;
            if (p.scoring == 2u) { total += 0.5 * rv[e * GQ4 + h / 4u][h % 4u]; }
        }
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
    // Scaled queries of the tile, [Dp][QT][GQ4] vec4 (component h % 4), zero-padded.
    let d_p = (d_n + DC - 1u) / DC * DC;
    for (var e = lid; e < QT * GQ4 * 4u * d_p; e += WG) {
        let r = e / d_p;
        let d = e % d_p;
        let qi = r / (GQ4 * 4u);
        let hh = r % (GQ4 * 4u);
        let i = i0 + qi;
        var v = 0.0;
        if (hh < GQ && i < p.q_len && d < d_n) {
            v = p.scale * f32(q[b * p.q_sb + (hkv * GQ + hh) * p.q_sh + i * p.q_sn + d]);
        }
        qs[(d * QT + qi) * GQ4 + hh / 4u][hh % 4u] = v;
    }
    if (lid == 0u) { atomicStore(&nr, 0u); }
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
        // 1. score: list the rows, stage them, dot them with the group's heads, combine.
        for (var e = lid; e < QT * MC; e += WG) {
            let n = nc[e / MC];
            if (e % MC < n && n > k) {
                var rows = 1u;
                if (p.scoring == 0u) {
                    let j = cl[cur + e];
                    rows = min(j * g + g, lc.y) - j * g;
                }
                let at = atomicAdd(&nr, rows);
                for (var c = 0u; c < rows; c++) { ra[at + c] = e * G + c; }
            }
        }
        let n_rows = workgroupUniformLoad(&nr);
        for (var r0 = 0u; r0 < n_rows; r0 += WG) {
          // Heads in chunks of 16 (four vec4 accumulators); one chunk unless GQ > 16.
          for (var hc = 0u; hc < GQ4; hc += 4u) {
            var a0 = vec4<f32>(0.0);
            var a1 = vec4<f32>(0.0);
            var a2 = vec4<f32>(0.0);
            var a3 = vec4<f32>(0.0);
            var b0 = vec4<f32>(0.0);
            var b1 = vec4<f32>(0.0);
            var b2 = vec4<f32>(0.0);
            var b3 = vec4<f32>(0.0);
            let my = r0 + lid;
            var qi = 0u;
            if (my < n_rows) { qi = (ra[my] / G) / MC; }
            for (var d0 = 0u; d0 < d_p; d0 += DC) {
                // Straight-line coalesced staging: all loads in flight together.
                stage_r4(lid + 0u, r0, n_rows, d0, cur, l, row0); stage_r4(lid + 256u, r0, n_rows, d0, cur, l, row0);
                stage_r4(lid + 512u, r0, n_rows, d0, cur, l, row0); stage_r4(lid + 768u, r0, n_rows, d0, cur, l, row0);
                stage_r4(lid + 1024u, r0, n_rows, d0, cur, l, row0); stage_r4(lid + 1280u, r0, n_rows, d0, cur, l, row0);
                stage_r4(lid + 1536u, r0, n_rows, d0, cur, l, row0); stage_r4(lid + 1792u, r0, n_rows, d0, cur, l, row0);
                workgroupBarrier();
                let mr = lid * (DC + 1u);
                for (var dd = 0u; dd < DC; dd++) {
                    let x = ms[mr + dd];
                    let o = ((d0 + dd) * QT + qi) * GQ4 + hc;
                    let q0 = qs[o];
                    a0 += q0 * x;
                    if (GQ4 > 1u && hc + 1u < GQ4) { a1 += qs[o + 1u] * x; }
                    if (GQ4 > 2u && hc + 2u < GQ4) { a2 += qs[o + 2u] * x; }
                    if (GQ4 > 3u && hc + 3u < GQ4) { a3 += qs[o + 3u] * x; }
                    if (MV != 0u) {
                        let y = vs[mr + dd];
                        b0 += q0 * q0 * y;
                        if (GQ4 > 1u && hc + 1u < GQ4) { b1 += qs[o + 1u] * qs[o + 1u] * y; }
                        if (GQ4 > 2u && hc + 2u < GQ4) { b2 += qs[o + 2u] * qs[o + 2u] * y; }
                        if (GQ4 > 3u && hc + 3u < GQ4) { b3 += qs[o + 3u] * qs[o + 3u] * y; }
                    }
                }
                workgroupBarrier();
            }
            if (my < n_rows) {
                let slot = ra[my];
                let w = slot * GQ4 + hc;
                rd[w] = a0;
                if (GQ4 > 1u && hc + 1u < GQ4) { rd[w + 1u] = a1; }
                if (GQ4 > 2u && hc + 2u < GQ4) { rd[w + 2u] = a2; }
                if (GQ4 > 3u && hc + 3u < GQ4) { rd[w + 3u] = a3; }
                if (MV != 0u) {
                    let v = (slot / G) * GQ4 + hc;
                    rv[v] = b0;
                    if (GQ4 > 1u && hc + 1u < GQ4) { rv[v + 1u] = b1; }
                    if (GQ4 > 2u && hc + 2u < GQ4) { rv[v + 2u] = b2; }
                    if (GQ4 > 3u && hc + 3u < GQ4) { rv[v + 3u] = b3; }
                }
            }
          }
        }
        workgroupBarrier();
        if (lid == 0u) { atomicStore(&nr, 0u); }
        for (var e = lid; e < QT * MC; e += WG) {
            let n = nc[e / MC];
            if (e % MC < n && n > k) { sc[e] = rank_key(score(e, l, cl[cur + e])); }
        }
        workgroupBarrier();
        // 2. keep: rank < K under (higher score key, then lower index)
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
