// Stage 1 of PISA prefill selection (PISA.md sections 2, 3 and 5): route every query through
// the intermediate pyramid levels (start level down to 1) and write its level-0 candidates.
//
// One workgroup of WG invocations per (b, KV head, tile of QT consecutive queries); the host
// sizes QT, L and WG so that the score tasks fill the workgroup (nothing is shared between the
// tile's queries: the output does not depend on the tile). Candidates, scores and keep flags
// live in workgroup memory; no query-by-block matrix is ever written. Per level, four barriers
// (three when L = 1 and GQ <= 4, or with the subgroup score step SG = 1 below, whose shape
// is fixed: QT = WG / (L GQ4P)):
//   1. score: one invocation per task (query, candidate, group of 4 query heads, lane) reads
//      every L-th vec4 of the pyramid rows the candidate needs (`lse`: its children; `mean`,
//      `meanvar`: its own row) straight from global memory (f32 means, L2-resident; vec4 loads
//      when D % 4 == 0; the L lanes of a row read L * 16 consecutive bytes together) and dots
//      them with its heads' queries (workgroup memory; scaled, or for f16 storage unscaled f16
//      pairs with the scale applied to the sums, see QH) into partial sums; after a
//      barrier (none when one task is the whole candidate), one invocation per candidate sums
//      the lanes and forms the score summed over the GQ heads;
//   2. keep: a level with more than K candidates keeps those of rank < K, where the rank is the
//      number of candidates strictly better (higher score, then lower node index; scores compared
//      through `rank_key`, so a NaN ranks as -inf): deterministic, exactly K kept, no sort. The
//      keys and keep flags are stored four to a vec4, so that the rank and expand loops read four
//      per load (route 115.0 -> 105.6 ms at 256K on the H200, 2026-11-30, commit 0a0e9ad:
//      docs/benchmarks.md, A.9);
//   3. expand: kept nodes (in ascending index order, so the list stays sorted) write their
//      children at g * (kept nodes before them); meanwhile one invocation per query counts the
//      kept children (min(n, K) * g, less the shortfall of the level's last node if kept) and
//      appends the complete-past children of the ancestor (at most g - 1 of them) after them.
// Levels from the start level down to `tb.lt` are looked up in the routing table (rank keys of
// every node of those levels per query, route_table.wgsl or shaders/nv/route_table.comp) rather
// than scored; the table covers the queries tb.i0 .. tb.i0 + tb.nq, the chunk this dispatch
// routes (tb.lt above the start level: no table, the chunk is every query).
// Output: cand [B, Hkv, Nq, MC] i32, ascending leaf indices, -1 padded. Queries that see K or
// fewer leaves (and every query when nb_0 <= K) get an all -1 row: stage 2 gives them all leaves.
//
// Q is store_t, element (b, h, n, d) at b*q_sb + h*q_sh + n*q_sn + d; means / sq are f32
// [B*Hkv, total_nodes, D] (the second moment E[k^2]; var = E[k^2] - mu^2, clamped at 0), bound
// twice: as f32 (bindings 2, 3; used when D % 4 != 0) and as vec4 (bindings 5, 6; used when
// V4 = 1, i.e. D % 4 == 0); the host binds a dummy to the pair that is not used.
// (store_t, Params, p and the shared helpers: select_common.wgsl, prepended)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const GQ: u32 = 1u;
const QT: u32 = 4u;
const MC: u32 = 34u;
// Merge factor g (rows per `lse` candidate).
const G: u32 = 2u;
// 1 when scoring is `meanvar` (reads the second moments).
const MV: u32 = 0u;
// vec4 slots per query head row: ceil(D / 4).
const D4: u32 = 32u;
// 1 when D % 4 == 0 (vec4 loads of the pyramid rows).
const V4: u32 = 1u;
const WG: u32 = 256u;
// Lanes per (candidate, head group): each reads every L-th vec4 of the rows.
const L: u32 = 4u;
const GQ4: u32 = (GQ + 3u) / 4u;
// 1: the tile's queries held unscaled as f16 pairs of heads (`qh`, two heads' vec4 in one
// 16-byte load), the scale applied to the dot products; the host sets it for f16 storage
// only, where the queries are f16 values and the pairs hold them exactly. On the H200 the
// route took 93.0 ms at 256K tokens this way against 103.7 with f32 queries
// (docs/benchmarks.md, 2026-12-02, commit 0837fd7).
const QH: u32 = 0u;
// 1: the score step with subgroup lanes (route_sg.wgsl, appended): one invocation per (query,
// head group of 4, lane), L lanes per head group, GQ4P (GQ4 rounded up to a power of two)
// groups per query, QT = WG / (L GQ4P); each holds its lane's dims of its group's heads in
// registers (scaled f32) and loops over the query's candidates; the L lanes' partial dot
// products are summed by subgroupShuffleXor butterflies (lanes_sum), each group forms its
// heads' part of the score, and the groups' parts are summed the same way (groups_sum), so
// that neither the queries nor the partial sums pass through workgroup memory. `lse` scoring,
// D % (4 L) == 0, L GQ4P at most the smallest subgroup (the host checks); a query's L GQ4P
// invocations are consecutive, so in one subgroup (subgroups are formed from consecutive
// invocations of a one-dimensional workgroup on the drivers pisa runs on). The knock-out of
// the queries' workgroup loads halved the score step on the H200 (docs/benchmarks.md, A.9).
const SG: u32 = 0u;
// SG = 1: vec4 slots of a query head row per lane; head groups per query, a power of two.
const QD: u32 = (D4 + L - 1u) / L;
// SG = 1 with g = 2 and 8 lanes per head group: the lanes' sums taken as a transposed butterfly
// (score_lanes, route_sg.wgsl), which leaves each lane one (child, head) sum, so each lane forms
// one head's LSE over the children, instead of every lane summing all 8 and forming all 4
// heads' LSEs (10 shuffles and 3 transcendentals per lane and candidate, 4 at a level's last
// node, instead of 24 and 22: 2 logs of n_c and, per head, 4 exponentials and a log).
// On the H200 (2026-12-02, f16, Hq 32, Hkv 8, D 128, K 16) the route (table included) took
// 54.4 / 9.27 ms at 256K / 64K tokens against 63.2 / 10.51 with every lane summing all 8; with
// the next candidate's rows also loaded during the current one's sums, 73.4 / 12.63; with the
// loop then ending at the query's own candidate count, 77.3 / 13.09; with 16 lanes per head
// group (score_lanes is written for 8 or 16), 59.2 / 9.92. log n_c taken once per level for
// full nodes (ln_full): 54.1 / 9.24 against 54.4 / 9.27 (docs/benchmarks.md A.16).
const TR: bool = SG == 1u && G == 2u && L == 8u;
const GQ4P: u32 = select(select(select(8u, 4u, GQ4 <= 4u), 2u, GQ4 <= 2u), 1u, GQ4 <= 1u);
// Score items (query, candidate, head group) of the tile.
const NIT: u32 = QT * MC * GQ4;
const NEG: f32 = -3.0e38;
// vec4 slots of `sc` and `kp` per query.
const MC4: u32 = (MC + 3u) / 4u;

// Slot ci of query qi in `sc` / `kp`: vec4 qi * MC4 + ci / 4, component ci % 4.
fn set_sc(qi: u32, ci: u32, v: u32) { sc[qi * MC4 + ci / 4u][ci % 4u] = v; }
fn set_kp(qi: u32, ci: u32, v: u32) { kp[qi * MC4 + ci / 4u][ci % 4u] = v; }
fn get_kp(qi: u32, ci: u32) -> u32 { return kp[qi * MC4 + ci / 4u][ci % 4u]; }

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> means: array<f32>;
@group(0) @binding(3) var<storage, read> sq: array<f32>;
@group(0) @binding(4) var<storage, read_write> cand: array<i32>;
@group(0) @binding(5) var<storage, read> means4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> sq4: array<vec4<f32>>;
// The routing table of the chunk, [B * Hkv, tb.nq, tb.tn] rank keys (route_table.wgsl).
@group(0) @binding(7) var<storage, read> table: array<u32>;
// (`Table`: route_chunk.wgsl, prepended)
@group(0) @binding(8) var<uniform> tb: Table;

// Scaled queries of the tile: [QT][GQ][D4] vec4 (dims 4*d4 .. 4*d4+3), zero-padded.
var<workgroup> qs: array<vec4<f32>, (1u - QH) * (1u - SG) * QT * GQ * D4 + 1u>;
// QH = 1: the queries as [QT][GQ4][2][D4] vec4<u32>, component k of pair pp of head group hg
// packing dim 4*d4+k of heads 4*hg+2*pp (low half) and 4*hg+2*pp+1 (high half), zero-padded.
var<workgroup> qh: array<vec4<u32>, QH * (1u - SG) * QT * GQ4 * 2u * D4 + 1u>;
// Candidate lists (two halves: current level, next level), per query MC slots.
var<workgroup> cl: array<u32, 2u * QT * MC>;
// Rank keys of the scored candidates.
// (vec4 per 4 slots, MC4 vec4 per query: the rank and expand steps read 4 slots per load)
var<workgroup> sc: array<vec4<u32>, QT * MC4>;
// Partial dot products per score task (candidate, head group, lane) and row slot.
// (SG = 1: not used.)
var<workgroup> pr: array<vec4<f32>, (1u - SG) * QT * MC * GQ4 * L * G + 1u>;
var<workgroup> pv: array<vec4<f32>, MV * QT * MC * GQ4 * L + 1u>;
var<workgroup> kp: array<vec4<u32>, QT * MC4>;
// Candidate counts per query, two halves like `cl` (current level, next level).
var<workgroup> nc: array<u32, 2u * QT>;
var<workgroup> rt: array<u32, QT>;

// Dims 4*d4 .. 4*d4+3 of the pyramid row starting at element `base` (zero past D).
fn ld_mean(base: u32, d4: u32) -> vec4<f32> {
    if (V4 != 0u) { return means4[base / 4u + d4]; }
    let d = d4 * 4u;
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if (d + i < p.head_dim) { v[i] = means[base + d + i]; }
    }
    return v;
}

fn ld_sq(base: u32, d4: u32) -> vec4<f32> {
    if (V4 != 0u) { return sq4[base / 4u + d4]; }
    let d = d4 * 4u;
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if (d + i < p.head_dim) { v[i] = sq[base + d + i]; }
    }
    return v;
}

// Whether head t (0..4) of head group hg exists (constant-folded when GQ % 4 == 0).
fn head_ok(hg: u32, t: u32) -> bool {
    return GQ % 4u == 0u || hg * 4u + t < GQ;
}

// The two heads' vec4s of a `qh` word (QH = 1): columns 0 (low halves) and 1 (high halves).
fn unpack_pair(w: vec4<u32>) -> mat2x4<f32> {
    let a0 = unpack2x16float(w.x);
    let a1 = unpack2x16float(w.y);
    let a2 = unpack2x16float(w.z);
    let a3 = unpack2x16float(w.w);
    return mat2x4<f32>(vec4<f32>(a0.x, a1.x, a2.x, a3.x), vec4<f32>(a0.y, a1.y, a2.y, a3.y));
}

// Task e = (candidate ce, head group hg, lane) of the score step: the partial dot products of
// lane `lane` (dims 4*d4 .. 4*d4+3 for d4 = lane, lane + L, ...) of the candidate's rows (`lse`:
// its G children, slot c; `mean`, `meanvar`: its own row, slot 0) with the 4 queries of
// head group hg (scaled, or scaled afterwards when QH = 1), into pr[(c * L + lane) * NIT + it]
// (it = ce * GQ4 + hg; component t: head 4*hg + t); `meanvar` also the partial sum_d q_d^2 var_d into pv[lane * NIT + it]. The L lanes
// of a row read L * 16 consecutive bytes together; items are the fastest index of pr, pv so
// that the per-candidate sums read consecutive vec4s (no bank conflicts).
fn score_task(it: u32, qi: u32, hg: u32, lane: u32, l: u32, j: u32, row0: u32) {
    let qb = (qi * GQ + hg * 4u) * D4;
    var acc: array<vec4<f32>, G>;
    for (var c = 0u; c < G; c++) { acc[c] = vec4<f32>(0.0); }
    var vacc = vec4<f32>(0.0);
    var nr = 1u;
    var base = (row0 + p.levels[l].x + j) * p.head_dim;
    if (p.scoring == 0u) {
        let lc = p.levels[l - 1u];
        nr = min(j * G + G, lc.y) - j * G;
        base = (row0 + lc.x + j * G) * p.head_dim;
    }
    for (var i = 0u; i < (D4 + L - 1u) / L; i++) {
        let d4 = i * L + lane;
        if (D4 % L == 0u || d4 < D4) {
            var q0: vec4<f32>;
            var q1 = vec4<f32>(0.0);
            var q2 = vec4<f32>(0.0);
            var q3 = vec4<f32>(0.0);
            if (QH != 0u) {
                let hb = (qi * GQ4 + hg) * 2u * D4 + d4;
                let p01 = unpack_pair(qh[hb]);
                q0 = p01[0];
                q1 = p01[1];
                if (head_ok(hg, 2u)) {
                    let p23 = unpack_pair(qh[hb + D4]);
                    q2 = p23[0];
                    q3 = p23[1];
                }
            } else {
                q0 = qs[qb + d4];
                if (head_ok(hg, 1u)) { q1 = qs[qb + D4 + d4]; }
                if (head_ok(hg, 2u)) { q2 = qs[qb + 2u * D4 + d4]; }
                if (head_ok(hg, 3u)) { q3 = qs[qb + 3u * D4 + d4]; }
            }
            for (var c = 0u; c < G; c++) {
                // The row is loaded whether or not the child exists (c < nr), so that no load
                // waits on a condition (0.9% faster at 256K on the H200, commit 702a543:
                // docs/benchmarks.md, A.8). Past a level's last node the row is another node's
                // or the allocation's poison; its dot products are never read (score uses
                // c < nr).
                let m = ld_mean(base + c * p.head_dim, d4);
                if (c < nr) {
                    acc[c] += vec4<f32>(dot(q0, m), dot(q1, m), dot(q2, m), dot(q3, m));
                    if (MV != 0u && p.scoring == 2u && c == 0u) {
                        let v = max(ld_sq(base, d4) - m * m, vec4<f32>(0.0));
                        vacc += vec4<f32>(dot(q0 * q0, v), dot(q1 * q1, v), dot(q2 * q2, v),
                                          dot(q3 * q3, v));
                    }
                }
            }
        }
    }
    // (QH: the dots of unscaled queries; the variance term is quadratic in the scale.)
    var f = 1.0;
    if (QH != 0u) { f = p.scale; }
    for (var c = 0u; c < G; c++) { pr[(c * L + lane) * NIT + it] = acc[c] * f; }
    if (MV != 0u) { pv[lane * NIT + it] = vacc * (f * f); }
}

// SG = 1 (`lse`): head group hg's part of the score of node j of level l >= 1 from its
// children's dot products with the group's heads (dots[c][t]: child c, head 4 hg + t; scaled),
// summed over those heads: per head the LSE over the children of n_c * exp(s q.mu_c), as
// `score` forms it.
fn score_lse(dots: array<vec4<f32>, G>, l: u32, j: u32, hg: u32) -> f32 {
    let lc = p.levels[l - 1u];
    let nr = min(j * G + G, lc.y) - j * G;
    var ln: array<f32, G>;
    for (var c = 0u; c < G; c++) { ln[c] = log(f32(node_len(j * G + c, lc.w))); }
    var total = 0.0;
    for (var t = 0u; t < 4u; t++) {
        if (hg * 4u + t < GQ) { total += children_lse(dots, ln, nr, t); }
    }
    return total;
}

// Head t's LSE over the first nr children of x_c = dots[c][t] + ln[c] (online, one pass).
fn children_lse(dots: array<vec4<f32>, G>, ln: array<f32, G>, nr: u32, t: u32) -> f32 {
    var m = NEG;
    var s = 0.0;
    for (var c = 0u; c < G; c++) {
        if (c < nr) {
            let v = dots[c][t] + ln[c];
            let mn = max(m, v);
            s = s * exp(m - mn) + exp(v - mn);
            m = mn;
        }
    }
    return m + log(s);
}

// Score of candidate ce (node j of level l >= 1) from the lanes' partial dot products, summed
// over the GQ heads: `lse`: per head LSE over the children of n_c * exp(s q.mu_c); `mean`:
// s q.mu_j + log n_j; `meanvar`: plus (s^2 / 2) sum_d q_d^2 var_d.
fn score(ce: u32, l: u32, j: u32) -> f32 {
    var total = 0.0;
    let lc = p.levels[l - 1u];
    let lse = p.scoring == 0u;
    var nr = 1u;
    if (lse) { nr = min(j * G + G, lc.y) - j * G; }
    var ln: array<f32, G>;
    for (var c = 0u; c < G; c++) {
        if (lse) {
            ln[c] = log(f32(node_len(j * G + c, lc.w)));
        } else {
            ln[c] = log(f32(node_len(j, p.levels[l].w)));
        }
    }
    for (var hg = 0u; hg < GQ4; hg++) {
        let it = ce * GQ4 + hg;
        // (zeroed by statements: a declaration's initializer may run once, not per iteration)
        var dots: array<vec4<f32>, G>;
        var vs: vec4<f32>;
        vs = vec4<f32>(0.0);
        for (var c = 0u; c < G; c++) { dots[c] = vec4<f32>(0.0); }
        for (var lane = 0u; lane < L; lane++) {
            for (var c = 0u; c < G; c++) { dots[c] += pr[(c * L + lane) * NIT + it]; }
            if (MV != 0u) { vs += pv[lane * NIT + it]; }
        }
        for (var t = 0u; t < 4u; t++) {
            if (head_ok(hg, t)) {
                if (lse) {
                    total += children_lse(dots, ln, nr, t);
                } else {
                    total += dots[0][t] + ln[0];
                    if (MV != 0u && p.scoring == 2u) { total += 0.5 * vs[t]; }
                }
            }
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
    let i0 = tb.i0 + (id % p.tiles) * QT;
    // End of the chunk's queries.
    let qend = min(p.q_len, tb.i0 + tb.nq);
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    let d_n = p.head_dim;
    let row0 = bh * p.total_nodes;
    let k = p.top_k;
    let g = p.merge;
    // Scaled queries of the tile, [QT][GQ][D4] vec4, zero-padded (QH: unscaled f16 pairs).
    for (var e = lid; e < (1u - SG) * QH * QT * GQ4 * 2u * D4 * 4u; e += WG) {
        let k = e % 4u;
        let d = (e / 4u) % D4 * 4u + k;
        let pr_ = e / (4u * D4); // (query, head group, pair)
        let qi = pr_ / (GQ4 * 2u);
        let ha = (pr_ % (GQ4 * 2u)) * 2u; // first head of the pair
        let i = i0 + qi;
        var v = vec2<f32>(0.0);
        if (i < qend && d < d_n) {
            let at = b * p.q_sb + (hkv * GQ + ha) * p.q_sh + i * p.q_sn + d;
            if (ha < GQ) { v.x = in_q(at); }
            if (ha + 1u < GQ) { v.y = in_q(at + p.q_sh); }
        }
        qh[e / 4u][k] = pack2x16float(v);
    }
    for (var e = lid; e < (1u - SG) * (1u - QH) * QT * GQ * D4 * 4u; e += WG) {
        let r = e / (D4 * 4u);
        let d = e % (D4 * 4u);
        let qi = r / GQ;
        let hh = r % GQ;
        let i = i0 + qi;
        var v = 0.0;
        if (i < qend && d < d_n) {
            v = p.scale * in_q(b * p.q_sb + (hkv * GQ + hh) * p.q_sh + i * p.q_sn + d);
        }
        qs[r * D4 + d / 4u][d % 4u] = v;
    }
    // SG = 1: this invocation's lane of its group's scaled query heads, qr[t * QD + x] =
    // dims 4 (x L + lane) .. + 3 of head 4 hg + t (zeros past the heads, the chunk or the
    // tile).
    var qr: array<vec4<f32>, 4u * QD>;
    if (SG == 1u) {
        let qi = lid / (L * GQ4P);
        let hg = (lid / L) % GQ4P;
        let i = i0 + qi;
        for (var t = 0u; t < 4u; t++) {
            for (var x = 0u; x < QD; x++) {
                var v = vec4<f32>(0.0);
                let d = (x * L + lid % L) * 4u;
                let hh = hg * 4u + t;
                if (qi < QT && i < qend && hh < GQ && d < d_n) {
                    let at = b * p.q_sb + (hkv * GQ + hh) * p.q_sh + i * p.q_sn + d;
                    v = p.scale * vec4<f32>(in_q(at), in_q(at + 1u), in_q(at + 2u), in_q(at + 3u));
                }
                qr[t * QD + x] = v;
            }
        }
    }
    // Start-level candidates: the complete-past nodes 0..n (the ancestor is implicit).
    let top = p.levels[p.start_level];
    if (lid < QT) {
        let i = i0 + lid;
        var n = 0u;
        var routed = 0u;
        if (i < qend && p.routed != 0u) {
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
    for (var e = lid; e < QT * MC; e += WG) {
        cl[e] = e % MC;
    }
    var cur = 0u;
    // Entry of the level's node 0 in a query's table row.
    var toff = 0u;
    for (var l = p.start_level; l >= 1u; l--) {
        let lc = p.levels[l - 1u];
        let nxt = QT * MC - cur;
        let hc = select(0u, QT, cur != 0u);
        workgroupBarrier();
        if (l >= tb.lt) {
            // 1. (table level) the rank keys looked up.
            for (var e = lid; e < QT * MC; e += WG) {
                let qi = e / MC;
                let n = nc[hc + qi];
                if (e % MC < n && n > k) {
                    let row = (bh * tb.nq + i0 + qi - tb.i0) * tb.tn + toff;
                    set_sc(qi, e % MC, table[row + cl[cur + e]]);
                }
            }
        } else if (SG == 1u) {
            // 1. score (SG): each (query, head group, lane) invocation over the query's
            // candidates, in step with its lanes (the same trip count for every invocation, so
            // every butterfly has all its lanes); lane ci % L of group 0 stores the score.
            let qi = lid / (L * GQ4P);
            let hg = (lid / L) % GQ4P;
            let lane = lid % L;
            var n = 0u;
            if (qi < QT) { n = nc[hc + qi]; }
            let ln_full = log(f32(lc.w));
            for (var ci = 0u; ci < MC; ci++) {
                var acc: array<vec4<f32>, G>;
                for (var c = 0u; c < G; c++) { acc[c] = vec4<f32>(0.0); }
                let on = ci < n && n > k;
                var j = 0u;
                if (on) {
                    j = cl[cur + qi * MC + ci];
                    let base = (row0 + lc.x + j * G) * p.head_dim;
                    for (var x = 0u; x < QD; x++) {
                        for (var c = 0u; c < G; c++) {
                            // (loaded whether or not the child exists, as in score_task)
                            let m = means4[(base + c * p.head_dim) / 4u + x * L + lane];
                            acc[c] += vec4<f32>(dot(qr[x], m), dot(qr[QD + x], m),
                                                dot(qr[2u * QD + x], m), dot(qr[3u * QD + x], m));
                        }
                    }
                }
                var part = 0.0;
                if (TR) {
                    // (every lane shuffles, `on` or not, so that each butterfly has its lanes)
                    part = score_lanes(acc, lane, l, j, hg, on, ln_full);
                } else {
                    for (var c = 0u; c < G; c++) { acc[c] = lanes_sum(acc[c]); }
                    if (on) { part = score_lse(acc, l, j, hg); }
                }
                let total = groups_sum(part);
                if (on && hg == 0u && lane == ci % L) { set_sc(qi, ci, rank_key(total)); }
            }
        } else {
            // 1. score: one invocation per (query, candidate, head group, lane), then one per
            // candidate sums the lanes and heads.
            for (var e = lid; e < QT * MC * GQ4 * L; e += WG) {
                let it = e / L;
                let ce = it / GQ4;
                let qi = ce / MC;
                let n = nc[hc + qi];
                if (ce % MC < n && n > k) {
                    let j = cl[cur + ce];
                    score_task(it, qi, it % GQ4, e % L, l, j, row0);
                    // One task per candidate: it reads back its own partials, no barrier needed.
                    if (L == 1u && GQ4 == 1u) { set_sc(qi, ce % MC, rank_key(score(ce, l, j))); }
                }
            }
            if (L != 1u || GQ4 != 1u) {
                workgroupBarrier();
                for (var e = lid; e < QT * MC; e += WG) {
                    let n = nc[hc + e / MC];
                    if (e % MC < n && n > k) {
                        set_sc(e / MC, e % MC, rank_key(score(e, l, cl[cur + e])));
                    }
                }
            }
        }
        workgroupBarrier();
        // 2. keep: rank < K under (higher score key, then lower index)
        for (var e = lid; e < QT * MC; e += WG) {
            let qi = e / MC;
            let ci = e % MC;
            let n = nc[hc + qi];
            var keep = 0u;
            if (ci < n) {
                keep = 1u;
                if (n > k) {
                    // The list is ascending by node index, so "lower index" is "earlier slot".
                    // Constant trip count and no branch, so the loads can be pipelined; four
                    // slots per load.
                    let s = vec4<u32>(sc[qi * MC4 + ci / 4u][ci % 4u]);
                    let lane = vec4<u32>(0u, 1u, 2u, 3u);
                    var rank = vec4<u32>(0u);
                    for (var o4 = 0u; o4 < MC4; o4++) {
                        let so = sc[qi * MC4 + o4];
                        let o = lane + o4 * 4u;
                        let better = (so > s) | ((so == s) & (o < vec4<u32>(ci)));
                        // A bool vector converted, not select(): naga writes select() of integer
                        // vectors as GLSL mix(), which desktop GLSL has only from 4.50.
                        rank += vec4<u32>(better & (o < vec4<u32>(n)));
                    }
                    keep = select(0u, 1u, rank.x + rank.y + rank.z + rank.w < k);
                }
            }
            set_kp(qi, ci, keep);
        }
        workgroupBarrier();
        // 3. expand kept nodes (only the last node of a level may have fewer than g children,
        // and it has the highest index, so g * (kept before) is each node's first slot).
        for (var e = lid; e < QT * MC; e += WG) {
            let qi = e / MC;
            let ci = e % MC;
            if (ci < nc[hc + qi] && get_kp(qi, ci) != 0u) {
                var b4 = vec4<u32>(0u);
                for (var o4 = 0u; o4 < MC4; o4++) {
                    let o = vec4<u32>(0u, 1u, 2u, 3u) + o4 * 4u;
                    b4 += kp[qi * MC4 + o4] & (vec4<u32>(0u) - vec4<u32>(o < vec4<u32>(ci)));
                }
                let before = b4.x + b4.y + b4.z + b4.w;
                let j = cl[cur + e];
                let c1 = min(j * g + g, lc.y);
                for (var c = j * g; c < c1; c++) {
                    cl[nxt + qi * MC + before * g + c - j * g] = c;
                }
            }
        }
        // Meanwhile one invocation per query counts the kept nodes' children (g each, but the
        // level's last node, which can only be the list's last entry) and appends the
        // ancestor's complete-past children after them.
        if (lid < QT) {
            let qi = lid;
            let n = nc[hc + qi];
            var total = min(n, k) * g;
            if (n > 0u) {
                let last = qi * MC + n - 1u;
                let j = cl[cur + last];
                if (get_kp(qi, n - 1u) != 0u && j + 1u == p.levels[l].y) {
                    total -= j * g + g - lc.y;
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
            nc[QT - hc + qi] = total;
        }
        cur = nxt;
        toff += p.levels[l].y;
    }
    workgroupBarrier();
    let hc = select(0u, QT, cur != 0u);
    for (var e = lid; e < QT * MC; e += WG) {
        let qi = e / MC;
        let ci = e % MC;
        let i = i0 + qi;
        if (i < qend && ci < p.mc) {
            var v = -1;
            if (ci < nc[hc + qi]) { v = i32(cl[cur + e]); }
            cand[(bh * p.q_len + i) * p.mc + ci] = v;
        }
    }
}
