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
// Route look-ahead (route_levels, LA = 1; substituted by the host where the route has g of 2 or
// more, ops/decode/record.rs): a level also scores each candidate's children as the next
// level's candidates, whose own children's rows it loads with the level's rows.
const LA: u32 = 0u;
// Rank key and node of each candidate slot of the three slot buffers of `cand` (one 8-byte
// load per comparison of the rank step).
var<workgroup> rkc: array<vec2<u32>, 3u * MAXC>;
// LA: sp[slot * g + c] is the rank key of child c of the slot's candidate as a candidate of
// the next level (0 for no child). Slot MAXC - 1 is never a candidate (the K * g kept children
// and at most g - 1 of the ancestor's come before it; at the start level at most g K nodes), so
// its lanes score the children of the level's ancestor, which are the next level's candidates
// below the own path.
var<workgroup> sp: array<u32, MAXC * MG>;
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

// The lane's vec4s u, u + LR, ... of a pyramid row (clamped to the row; the lanes past it are
// masked by dots_of), loaded before any product so that a level's loads are in flight together.
fn load_row(row: u32, u: u32) -> array<vec4<f32>, DLR> {
    var mv: array<vec4<f32>, DLR>;
    for (var i = 0u; i < DLR; i++) { mv[i] = means[row + min(u + i * LR, D4 - 1u)]; }
    return mv;
}

// dots_mean over a row's loaded vec4s (load_row), the query slices from registers (QREG) or
// from `qs`, in dots_mean's order.
fn dots_of(mv: array<vec4<f32>, DLR>, u: u32, qr: array<vec4<f32>, QRN>) -> array<f32, GQ> {
    var a: array<f32, GQ>;
    for (var i = 0u; i < DLR; i++) {
        if (D4 % LR == 0u || u + i * LR < D4) {
            for (var hh = 0u; hh < GQ; hh++) {
                var qv: vec4<f32>;
                if (QREG) {
                    qv = qr[min(hh * DLR + i, QRN - 1u)];
                } else {
                    qv = qs[hh * D4 + min(u + i * LR, D4 - 1u)];
                }
                a[hh] += dot(qv, mv[i]);
            }
        }
    }
    return a;
}

// The LR lanes' partial dots of a row summed by shuffles: with TR4, as a transposed butterfly
// that leaves element 0 holding the sum of head (u / (LR / 4)) % 4 (the lanes halve their
// heads at each of the first two steps, sending the other half, then sum), else element hh
// holding head hh's. Called by every lane of the subgroup.
fn lane_sums(a: array<f32, GQ>, u: u32) -> array<f32, GQ> {
    var r = a;
    if (TR4) {
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
        r[0] = v;
        return r;
    }
    for (var hh = 0u; hh < GQ; hh++) {
        var v = a[hh];
        for (var m = 1u; m < LR; m <<= 1u) { v += subgroupShuffleXor(v, m); }
        r[hh] = v;
    }
    return r;
}

// The four heads' values of a TR4 lane group summed by shuffles (each lane then holds the sum).
fn heads_tr4(t: f32) -> f32 {
    var tot = t;
    tot += subgroupShuffleXor(tot, LR / 4u);
    tot += subgroupShuffleXor(tot, LR / 2u);
    return tot;
}

// children_lse within one lane: one head's LSE over g children x (NEG for a child not
// scored), the exponentials summed in the order of children_lse's butterfly.
fn lse_in_lane(x: array<f32, MG>) -> f32 {
    var mx = x[0];
    for (var c = 1u; c < MG; c++) { mx = max(mx, x[c]); }
    var e: array<f32, MG>;
    for (var c = 0u; c < MG; c++) { e[c] = select(0.0, exp(x[c] - mx), x[c] > NEG_T); }
    for (var m = 1u; m < MG; m <<= 1u) {
        for (var c = 0u; c + m < MG; c += 2u * m) { e[c] += e[c + m]; }
    }
    return mx + log(e[0]);
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

// The `lse` score of every candidate slot cand[co..] of level l as rank_key into rkc[co..] with
// its node (key 0 for an empty slot), as score_lse_split computes it, the sums in butterfly
// order; `pc` is g^(l-1). Item it = (slot * g + child) * LR + lane. With `la` (LA, l >= 2) each
// child's lanes also load its g children's rows (level l - 2) with its own and leave its rank
// key as a candidate of level l - 1 in sp, computed as this function would at that level.
fn score_lse_sg(bh: u32, l: u32, len: u32, nb0: u32, pc: u32, co: u32, bq: u32, lid: u32,
                qr: array<vec4<f32>, QRN>, la: bool) {
    let g = MG;
    let nchild = cdiv_pw(nb0, pc);
    let w = mul_pw(p.block_size, pc);
    // LA: the children's children, nodes of level l - 2 (pc >= g there).
    let pg = max(pc / g, 1u);
    let ngc = cdiv_pw(nb0, pg);
    let wgc = mul_pw(p.block_size, pg);
    var anc = INVALID;
    if (la && p.causal != 0u) { anc = div_pw(bq, pc * g); }
    let n = MAXC * g * LR;
    for (var base = 0u; base < n; base += WG) {
        let it = base + lid;
        let ci = it / LR;
        let u = it % LR;
        var node = INVALID;
        if (it < n) { node = cand[co + ci / g]; }
        // (LA: slot MAXC - 1's lanes take the ancestor, whose own score is never used.)
        let an = la && it < n && ci / g == MAXC - 1u;
        if (an) { node = anc; }
        let child = node * g + ci % g;
        let on = node != INVALID && child < nchild;
        var a: array<f32, GQ>;
        var a2: array<array<f32, GQ>, MG>;
        var on2: array<bool, MG>;
        if (la) {
            // Every row's loads first (rows clamped to node 0 where there is none).
            let mv = load_row(node_row(bh, l - 1u, select(0u, child, on)), u);
            var mg: array<array<vec4<f32>, DLR>, MG>;
            for (var c = 0u; c < MG; c++) {
                let gc = child * g + c;
                on2[c] = on && gc < ngc;
                mg[c] = load_row(node_row(bh, l - 2u, select(0u, gc, on2[c])), u);
            }
            a = dots_of(mv, u, qr);
            for (var c = 0u; c < MG; c++) { a2[c] = dots_of(mg[c], u, qr); }
        } else if (on) {
            a = dots_of(load_row(node_row(bh, l - 1u, child), u), u, qr);
        }
        var ln = 0.0;
        if (on) { ln = log(f32(min(len - child * w, w))); }
        let sums = lane_sums(a, u);
        var tot = 0.0;
        if (TR4) { tot = heads_tr4(children_lse(sums[0], on, ln)); }
        for (var hh = 0u; hh < select(GQ, 0u, TR4); hh++) { tot += children_lse(sums[hh], on, ln); }
        if (it < n && it % (LR * g) == 0u) {
            var key = 0u;
            let cn0 = cand[co + ci / g];
            if (cn0 != INVALID) { key = rank_key(tot); }
            rkc[co + ci / g] = vec2<u32>(key, cn0);
        }
        if (la) {
            // The child's own score from its children's sums, each head's LSE within the lane.
            var s2 = array<array<f32, GQ>, MG>();
            var ln2: array<f32, MG>;
            for (var c = 0u; c < MG; c++) {
                s2[c] = lane_sums(a2[c], u);
                if (on2[c]) { ln2[c] = log(f32(min(len - (child * g + c) * wgc, wgc))); }
            }
            var tot2 = 0.0;
            for (var hh = 0u; hh < select(GQ, 1u, TR4); hh++) {
                var x: array<f32, MG>;
                for (var c = 0u; c < MG; c++) {
                    x[c] = select(NEG, p.scale * s2[c][hh] + ln2[c], on2[c]);
                }
                tot2 += lse_in_lane(x);
            }
            if (TR4) { tot2 = heads_tr4(tot2); }
            if (it < n && u == 0u) { sp[ci] = select(0u, rank_key(tot2), on); }
        }
    }
}

// LA: the key slot i of a level's slot buffers starts with (0: below every score's; `c` its
// node or INVALID), before its cut writes the kept children's.
fn set_key(i: u32, c: u32) { rkc[i] = vec2<u32>(0u, c); }

// The cut of a level (route_levels' rank counts and cut, one step) over the keys rkc[co..]:
// item it = slot * CPS + part counts the candidates j = part, part + CPS, ... ranked ahead of the slot's (higher key,
// then lower node index); the CPS counts are added by shuffles, and a kept node (rank < K)
// writes its children to the next level's slots r * g ... (cleared before the caller's barrier),
// with `la` also their look-ahead keys (sp) into rkc[cn..].
fn rank_cut_sg(co: u32, cn: u32, l: u32, nchild: u32, bq: u32, lid: u32, la: bool) {
    let g = MG;
    let n = MAXC * CPS;
    for (var base = 0u; base < n; base += WG) {
        let it = base + lid;
        let i = it / CPS;
        let part = it % CPS;
        var v = INVALID;
        var r = 0u;
        if (it < n) {
            let sc = rkc[co + i];
            v = sc.y;
            for (var j = part; j < MAXC; j += CPS) {
                let sj = rkc[co + j];
                r += select(0u, 1u, sj.x > sc.x || (sj.x == sc.x && sj.y < v));
            }
        }
        for (var m = 1u; m < CPS; m <<= 1u) { r += subgroupShuffleXor(r, m); }
        if (it < n && part == 0u && v != INVALID && r < KMAX) {
            for (var c = 0u; c < g; c++) {
                var ch = v * g + c;
                if (ch >= nchild || (l == 1u && is_forced(bq, ch))) { ch = INVALID; }
                cand[cn + r * g + c] = ch;
                if (la) { rkc[cn + r * g + c] = vec2<u32>(select(0u, sp[i * g + c], ch != INVALID), ch); }
            }
        }
        // LA: the ancestor's children below the own path (slots K g.., set before the
        // barrier) take their keys from the ancestor's lanes (slot MAXC - 1 of sp).
        if (la && it < n && part == 0u && i >= KMAX * g) {
            let c = cand[cn + i];
            if (c != INVALID) { rkc[cn + i] = vec2<u32>(sp[(MAXC - 1u) * g + i - KMAX * g], c); }
        }
    }
}
