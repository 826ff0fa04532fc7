// The decode route's level steps with subgroup shuffles (SGR = 1; appended to
// decode_levels.wgsl, whose route_levels calls them, where the device has subgroups; elsewhere
// decode_levels_nosg.wgsl). A level then costs two barriers instead of five: (1) the scores,
// where a candidate's g * LR invocations (g children, LR lanes per child row) are consecutive
// lanes of one subgroup, sum their partial dots by shuffles and take each head's LSE over the
// children by shuffles, so that no partial passes through workgroup memory; (2) the rank counts
// and the cut, where a candidate's CPS counting invocations are consecutive lanes and add
// their counts by shuffles, the first of them writing the kept node's children.
// The host (ops/decode/record.rs, route_subgroup_lanes) runs this only with `lse` scoring, LR
// and g powers of two with g * LR and CPS at most the smallest subgroup, and a workgroup a
// multiple of both: the lanes exchanged are then in one subgroup (subgroups are formed from
// consecutive invocations of a one-dimensional workgroup on the drivers pisa runs on, as the
// prefill routing kernel's route_sg.wgsl assumes). Every loop runs the same trip count in all
// invocations (shuffles need every lane of the subgroup).

// The smallest subgroup size of the device, up to 32 (substituted by the host).
const SGL: u32 = 8u;
// Counting invocations per candidate of the rank step: the largest power of two of at most
// WG / MAXC, SGL and 16 that divides WG (a candidate's counting lanes are then in one
// subgroup): 16 at K 16, g 2 on NVIDIA (2 or 3 comparisons each), 8 on lavapipe.
const CPW: u32 = min(min(WG / MAXC, SGL), min(16u, WG & (~WG + 1u)));
const CPS: u32 = select(select(select(select(1u, 2u, CPW >= 2u), 4u, CPW >= 4u), 8u, CPW >= 8u),
                        16u, CPW >= 16u);
// A candidate's lanes, and its counting lanes, lie in one aligned group the workgroup divides.
const_assert WG % (MG * LR) == 0u;
const_assert WG % CPS == 0u;
// Rank key and node of each candidate slot (one 8-byte load per comparison of the rank step).
var<workgroup> rkc: array<vec2<u32>, MAXC>;
// The query slices of an invocation's lane (vec4s u, u + LR, ... of every head: GQ * DLR)
// held in registers where they are at most 16 vec4s (g_q 4, D 128, 8 lanes), else read from
// `qs` in workgroup memory as dots_mean does. An invocation's lane u = lid % LR is the same at
// every level (the workgroup is a multiple of g * LR).
const QREG: bool = GQ * DLR <= 16u;
// g_q 4 with 4 lanes or more per row: the lanes' sums as a transposed butterfly, which leaves
// each lane one head's sum, so that each lane takes one head's LSE over the children (the
// prefill routing kernel's score_lanes does the same, docs/benchmarks.md A.16), then the heads
// summed by two more shuffles: 4 + 2 + 2 shuffles (with 8 lanes) and 2 transcendentals per lane
// instead of 4 log2(LR) + 8 (20 with 8 lanes) and 8.
const TR4: bool = GQ == 4u && LR >= 4u;
const QRN: u32 = select(1u, GQ * DLR, QREG);

// The lane's query slices (QREG), loaded once before the levels.
fn lane_queries(lid: u32) -> array<vec4<f32>, QRN> {
    var qr: array<vec4<f32>, QRN>;
    if (QREG) {
        let u = lid % LR;
        for (var hh = 0u; hh < GQ; hh++) {
            for (var i = 0u; i < DLR; i++) {
                qr[min(hh * DLR + i, QRN - 1u)] = qs[hh * D4 + min(u + i * LR, D4 - 1u)];
            }
        }
    }
    return qr;
}

// dots_mean with the query slices from registers (QREG): the row's vec4s loaded first (clamped
// to the row, the lanes past it masked after), then the dot products.
fn dots_mean_reg(row: u32, u: u32, qr: array<vec4<f32>, QRN>) -> array<f32, GQ> {
    var mv: array<vec4<f32>, DLR>;
    for (var i = 0u; i < DLR; i++) { mv[i] = means[row + min(u + i * LR, D4 - 1u)]; }
    var a: array<f32, GQ>;
    for (var i = 0u; i < DLR; i++) {
        if (D4 % LR == 0u || u + i * LR < D4) {
            for (var hh = 0u; hh < GQ; hh++) { a[hh] += dot(qr[min(hh * DLR + i, QRN - 1u)], mv[i]); }
        }
    }
    return a;
}

// One head's LSE over a candidate's g children, x = s q.mu_c + log n_c (NEG for a child not
// scored): `v` is this lane's child's whole dot product; the children's lanes are LR apart
// (max, then the sum of exp(x - max) over the scored children, as score_lse_split).
fn children_lse(v: f32, on: bool, ln: f32) -> f32 {
    var x = NEG;
    if (on) { x = p.scale * v + ln; }
    var mx = x;
    for (var m = LR; m < LR * MG; m <<= 1u) { mx = max(mx, subgroupShuffleXor(mx, m)); }
    var e = 0.0;
    if (x > NEG_T) { e = exp(x - mx); }
    for (var m = LR; m < LR * MG; m <<= 1u) { e += subgroupShuffleXor(e, m); }
    return mx + log(e);
}

// The `lse` score of every candidate slot as rank_key into rkc with its node (key 0 for an
// empty slot), as
// score_lse_split computes it, the sums in butterfly order. Item it = (slot * g + child) * LR +
// lane; `w` is the tokens of a full child, `nchild` the children of the level.
fn score_lse_sg(bh: u32, l: u32, len: u32, nchild: u32, w: u32, co: u32, lid: u32,
                qr: array<vec4<f32>, QRN>) {
    let g = MG;
    let n = MAXC * g * LR;
    for (var base = 0u; base < n; base += WG) {
        let it = base + lid;
        let ci = it / LR;
        var node = INVALID;
        if (it < n) { node = cand[co + ci / g]; }
        let child = node * g + ci % g;
        let on = node != INVALID && child < nchild;
        var a: array<f32, GQ>;
        if (on && QREG) {
            a = dots_mean_reg(node_row(bh, l - 1u, child), it % LR, qr);
        } else if (on) {
            a = dots_mean(node_row(bh, l - 1u, child), it % LR);
        }
        var ln = 0.0;
        if (on) { ln = log(f32(min(len - child * w, w))); }
        var tot = 0.0;
        if (TR4) {
            // Transposed butterfly: the lanes halve their heads at each of the first two steps
            // (sending the other half), then sum; lane u ends with head (u / (LR / 4)) % 4.
            let u = it % LR;
            let hi = (u & (LR / 2u)) != 0u;
            // (indices clamped to GQ: constants past the array fail validation where GQ < 4)
            let a0 = a[0];
            let a1 = a[min(1u, GQ - 1u)];
            let a2 = a[min(2u, GQ - 1u)];
            let a3 = a[min(3u, GQ - 1u)];
            let b0 = select(a0, a2, hi) + subgroupShuffleXor(select(a2, a0, hi), LR / 2u);
            let b1 = select(a1, a3, hi) + subgroupShuffleXor(select(a3, a1, hi), LR / 2u);
            let lo = (u & (LR / 4u)) != 0u;
            var v = select(b0, b1, lo) + subgroupShuffleXor(select(b1, b0, lo), LR / 4u);
            for (var m = 1u; m < LR / 4u; m <<= 1u) { v += subgroupShuffleXor(v, m); }
            tot = children_lse(v, on, ln);
            tot += subgroupShuffleXor(tot, LR / 4u);
            tot += subgroupShuffleXor(tot, LR / 2u);
        }
        for (var hh = 0u; hh < select(GQ, 0u, TR4); hh++) {
            var v = a[hh];
            for (var m = 1u; m < LR; m <<= 1u) { v += subgroupShuffleXor(v, m); }
            tot += children_lse(v, on, ln);
        }
        if (it < n && it % (LR * g) == 0u) {
            var key = 0u;
            if (node != INVALID) { key = rank_key(tot); }
            rkc[ci / g] = vec2<u32>(key, node);
        }
    }
}

// The cut of a level (route_levels' rank counts and cut, one step): item it = slot * CPS +
// part counts the candidates j = part, part + CPS, ... ranked ahead of the slot's (higher key,
// then lower node index); the CPS counts are added by shuffles, and a kept node (rank < K)
// writes its children to the next level's slots r * g ... (cleared before the caller's barrier).
fn rank_cut_sg(co: u32, cn: u32, l: u32, nchild: u32, bq: u32, lid: u32) {
    let g = MG;
    let n = MAXC * CPS;
    for (var base = 0u; base < n; base += WG) {
        let it = base + lid;
        let i = it / CPS;
        let part = it % CPS;
        var v = INVALID;
        var r = 0u;
        if (it < n) {
            let sc = rkc[i];
            v = sc.y;
            for (var j = part; j < MAXC; j += CPS) {
                let sj = rkc[j];
                r += select(0u, 1u, sj.x > sc.x || (sj.x == sc.x && sj.y < v));
            }
        }
        for (var m = 1u; m < CPS; m <<= 1u) { r += subgroupShuffleXor(r, m); }
        if (it < n && part == 0u && v != INVALID && r < KMAX) {
            for (var c = 0u; c < g; c++) {
                var ch = v * g + c;
                if (ch >= nchild || (l == 1u && is_forced(bq, ch))) { ch = INVALID; }
                cand[cn + r * g + c] = ch;
            }
        }
    }
}
