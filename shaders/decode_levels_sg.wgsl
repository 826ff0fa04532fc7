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

// Counting invocations per candidate of the rank step: the largest power of two of at most CP.
const CPS: u32 = select(select(select(1u, 2u, CP >= 2u), 4u, CP >= 4u), 8u, CP >= 8u);
// The query slices of an invocation's lane (vec4s u, u + LR, ... of every head: GQ * DLR)
// held in registers where they are at most 16 vec4s (g_q 4, D 128, 8 lanes), else read from
// `qs` in workgroup memory as dots_mean does. An invocation's lane u = lid % LR is the same at
// every level (the workgroup is a multiple of g * LR).
const QREG: bool = GQ * DLR <= 16u;
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

// The `lse` score of every candidate slot as rank_key into rk (0 for an empty slot), as
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
        for (var hh = 0u; hh < GQ; hh++) {
            var v = a[hh];
            for (var m = 1u; m < LR; m <<= 1u) { v += subgroupShuffleXor(v, m); }
            var x = NEG;
            if (on) { x = p.scale * v + ln; }
            var mx = x;
            for (var m = LR; m < LR * g; m <<= 1u) { mx = max(mx, subgroupShuffleXor(mx, m)); }
            var e = 0.0;
            if (x > NEG_T) { e = exp(x - mx); }
            for (var m = LR; m < LR * g; m <<= 1u) { e += subgroupShuffleXor(e, m); }
            tot += mx + log(e);
        }
        if (it < n && it % (LR * g) == 0u) {
            var key = 0u;
            if (node != INVALID) { key = rank_key(tot); }
            rk[ci / g] = key;
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
            v = cand[co + i];
            let sc = rk[i];
            for (var j = part; j < MAXC; j += CPS) {
                let sj = rk[j];
                r += select(0u, 1u, sj > sc || (sj == sc && cand[co + j] < v));
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
