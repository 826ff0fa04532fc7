// Decode step: the routing through the intermediate pyramid levels (PISA.md 3.1-3.3), shared by
// the `route` dispatch of the split step (decode_route.wgsl) and the fused step
// (decode_fused.wgsl); appended to decode.wgsl, whose header describes the design.
// Partial dot products live in `xr` with the candidate slot fastest, so the per-candidate
// sums (one invocation per slot) read consecutive words: no bank conflicts.
// A level costs five barriers (`lse`; four for `mean`, `meanvar`): per-child partial scores |
// per-(child, head) sums of the lanes (`lse`) | per-candidate scores (and the next level's slots
// cleared) | rank counts, the MAXC x MAXC comparisons split CP ways | the cut, where each kept
// node writes its children straight into the next level's slots (double-buffered `cand`).
// Measured on the H200 (docs/benchmarks.md): one invocation per candidate looping over all MAXC
// for the rank was 2.5 us a level, 40% of the route (A.4, before commit 408e6f6); the
// per-candidate score summing all MG * GQ * LR partials itself cost 2.5 us more per step at 1M
// than the extra barrier of the two-step sum, and divisions by the runtime merge factor instead
// of the constant MG 4.5 us (A.5, commit c787655).
// With SGR = 1 (decode_levels_sg.wgsl, devices with subgroups) a level costs two barriers: the
// lanes' sums, the children's LSEs and the rank counts go through subgroup shuffles instead
// (route at 1M 34.2 -> 25.4 us, step 56.6 -> 47.0 us on the H200 with the steps that followed,
// docs/benchmarks.md A.25).
// `xr` (XR floats) is also the fused step's scratch after the routing.

var<workgroup> cand: array<u32, 2u * MAXC>;
var<workgroup> rk: array<u32, MAXC>;
var<workgroup> xr: array<f32, XR>;

const DLR: u32 = (D4 + LR - 1u) / LR; // vec4s of a row per invocation

// Division, rounded-up division and saturating product by pw, a power of g (a level's width in
// leaves): shifts when the merge factor MG is a power of two. (A runtime u32 division is a
// long instruction chain, and every level has several on its phases' critical paths.)
const MG_POW2: bool = (MG & (MG - 1u)) == 0u;
fn div_pw(a: u32, pw: u32) -> u32 {
    if (MG_POW2) { return a >> countTrailingZeros(pw); }
    return a / pw;
}
fn cdiv_pw(a: u32, pw: u32) -> u32 {
    let q = div_pw(a, pw);
    return q + select(0u, 1u, a - q * pw != 0u);
}
fn mul_pw(a: u32, pw: u32) -> u32 {
    if (MG_POW2) {
        let sh = countTrailingZeros(pw);
        if (a > (0xffffffffu >> sh)) { return 0xffffffffu; }
        return a << sh;
    }
    return sat_mul(a, pw);
}
// The cut's rank counts: CP invocations per candidate, their partial counts in xr (free then).
const CP: u32 = max(min(min(WG / MAXC, XR / MAXC), 8u), 1u);

// Partial q_h . mu over the vec4s j = u, u + LR, ... of a node's mean row, every head h of
// the group: LR consecutive invocations share one row, so a warp's loads are coalesced; a
// fixed trip count and no condition when LR divides D/4, so the loads can be in flight
// together. Measured on the H200 (docs/benchmarks.md, A.6): the loads per invocation
// still cost about 0.6 us each per route level (LR = 4, 8 loads: route 60 us at 1M; LR = 8,
// 4 loads: 38 us; LR = 2: 92 us), whatever the condition; the cause is not known.
fn dots_mean(row: u32, u: u32) -> array<f32, GQ> {
    var a: array<f32, GQ>;
    for (var i = 0u; i < DLR; i++) {
        let j = u + i * LR;
        if (D4 % LR == 0u || j < D4) {
            let m = means[row + j];
            for (var hh = 0u; hh < GQ; hh++) { a[hh] += dot(qs[hh * D4 + j], m); }
        }
    }
    return a;
}

// x = s * q.mu_c + log n_c of child c of the candidate in slot s, head hh, from the LR
// partial dots in xr (ln = log n_c).
fn child_x(s: u32, c: u32, hh: u32, ln: f32) -> f32 {
    var a = 0.0;
    for (var u = 0u; u < LR; u++) { a += xr[((c * LR + u) * GQ + hh) * MAXC + s]; }
    return p.scale * a + ln;
}

// The `lse` score of every candidate slot from the partial dots in xr, in two steps: one
// invocation per (child, head, slot) sums the LR lanes into x = s * q.mu_c + log n_c (NEG for a
// child past the level's end), written over lane 0's partial (read by that invocation only);
// then one invocation per slot takes, per head, the max over the children and the sum of
// exp(x - max) over the scored ones (max-then-sum: a +inf child makes NaN, ranked as -inf), and
// sums m + log(sum) over the heads. Ends with rk written.
fn score_lse_split(len: u32, nchild: u32, w: u32, co: u32, lid: u32) {
    for (var it = lid; it < MG * GQ * MAXC; it += WG) {
        let s = it % MAXC;
        let hh = (it / MAXC) % GQ;
        let c = it / (MAXC * GQ);
        let node = cand[co + s];
        let child = node * MG + c;
        var x = NEG;
        if (node != INVALID && child < nchild) {
            x = child_x(s, c, hh, log(f32(min(len - child * w, w))));
        }
        xr[(c * LR * GQ + hh) * MAXC + s] = x;
    }
    workgroupBarrier();
    for (var s = lid; s < MAXC; s += WG) {
        var key = 0u;
        if (cand[co + s] != INVALID) {
            var tot = 0.0;
            for (var hh = 0u; hh < GQ; hh++) {
                var m = NEG;
                for (var c = 0u; c < MG; c++) { m = max(m, xr[(c * LR * GQ + hh) * MAXC + s]); }
                var sum = 0.0;
                for (var c = 0u; c < MG; c++) {
                    let x = xr[(c * LR * GQ + hh) * MAXC + s];
                    if (x > NEG_T) { sum += exp(x - m); }
                }
                tot += m + log(sum);
            }
            key = rank_key(tot);
        }
        rk[s] = key;
    }
}

// rk[slot] = rank_key of the score of the candidates cand[co..co + MAXC] of level l >= 1
// (PISA.md 2), summed over the group; 0 (below every score's key) for an empty slot. `pw` is
// g^(l-1), the leaves under a child. Ends with rk written (the caller's barrier orders it).
fn score_level(bh: u32, l: u32, len: u32, nb0: u32, pw: u32, co: u32, lid: u32,
               qr: array<vec4<f32>, QRN>) {
    let g = MG; // (the pipeline constant: divisions by it are shifts for g = 2)
    let nchild = cdiv_pw(nb0, pw);
    let w = mul_pw(p.block_size, pw);
    if (p.scoring == 0u && SGR != 0u) {
        score_lse_sg(bh, l, len, nchild, w, co, lid, qr);
    } else if (p.scoring == 0u) {
        // lse: LR items per (candidate, child), partial dots of the child's mean.
        for (var it = lid; it < MAXC * g * LR; it += WG) {
            let ci = it / LR;
            let node = cand[co + ci / g];
            let child = node * g + ci % g;
            var a: array<f32, GQ>;
            if (node != INVALID && child < nchild) { a = dots_mean(node_row(bh, l - 1u, child), it % LR); }
            let xo = (it % (g * LR)) * GQ * MAXC + it / (g * LR); // [child, lane, head, slot]
            for (var hh = 0u; hh < GQ; hh++) { xr[xo + hh * MAXC] = a[hh]; }
        }
        workgroupBarrier();
        score_lse_split(len, nchild, w, co, lid);
    } else {
        // mean / meanvar: s * q.mu + log n (+ s^2/2 * sum_d q_d^2 var_d), var = E[k^2] - mu^2;
        // LR items per candidate, partial sums of both terms.
        let mv = p.scoring == 2u;
        for (var it = lid; it < MAXC * LR; it += WG) {
            let node = cand[co + it / LR];
            var a1: array<f32, GQ>;
            var a2: array<f32, GQ>;
            if (node != INVALID) {
                let row = node_row(bh, l, node);
                for (var j = it % LR; j < D4; j += LR) {
                    let mu = means[row + j];
                    var var_d = vec4<f32>(0.0);
                    if (mv) { var_d = max(sq[row + j] - mu * mu, vec4<f32>(0.0)); }
                    for (var hh = 0u; hh < GQ; hh++) {
                        let qv = qs[hh * D4 + j];
                        a1[hh] += dot(qv, mu);
                        a2[hh] += dot(qv * qv, var_d);
                    }
                }
            }
            for (var hh = 0u; hh < GQ; hh++) {
                let xo = (((it % LR) * GQ + hh) * 2u) * MAXC + it / LR; // [lane, head, term, slot]
                xr[xo] = a1[hh];
                xr[xo + MAXC] = a2[hh];
            }
        }
        workgroupBarrier();
        let wn = sat_mul(w, g);
        for (var s = lid; s < MAXC; s += WG) {
            let node = cand[co + s];
            var key = 0u;
            if (node != INVALID) {
                let ln = log(f32(min(len - node * wn, wn)));
                var tot = 0.0;
                for (var hh = 0u; hh < GQ; hh++) {
                    var a1 = 0.0;
                    var a2 = 0.0;
                    for (var u = 0u; u < LR; u++) {
                        a1 += xr[((u * GQ + hh) * 2u) * MAXC + s];
                        a2 += xr[((u * GQ + hh) * 2u + 1u) * MAXC + s];
                    }
                    tot += p.scale * a1 + ln + 0.5 * p.scale * p.scale * a2;
                }
                key = rank_key(tot);
            }
            rk[s] = key;
        }
    }
}

// PISA routing (PISA.md 3.1-3.2) of the query at position len - 1 down to the leaf
// candidates; returns the offset (0 or MAXC) of the slots in `cand` holding them, forced
// leaves excluded.
fn route_levels(bh: u32, len: u32, bq: u32, nb0: u32, lid: u32) -> u32 {
    let g = MG;
    let causal = p.causal != 0u;
    var s = 0u;
    var n = nb0;
    var pw = 1u; // g^s
    loop {
        n = cdiv(n, g);
        if (n <= KMAX) { break; }
        s++;
        pw *= g;
    }
    var first = cdiv_pw(nb0, pw);
    if (causal) { first = div_pw(bq, pw); }
    for (var i = lid; i < MAXC; i += WG) {
        cand[i] = select(INVALID, i, i < first && !(s == 0u && is_forced(bq, i)));
    }
    workgroupBarrier();
    // SGR = 1: the lane's query slices in registers (qs was loaded before the caller's barrier).
    let qr = lane_queries(lid);
    var co = 0u;
    for (var l = s; l >= 1u; l--) {
        let cn = MAXC - co; // the next level's slots
        let pc = pw / g;    // g^(l-1)
        score_level(bh, l, len, nb0, pc, co, lid, qr);
        // Clear the next slots; the ancestor's children below the own path go after the
        // K * g children of the kept nodes.
        let nchild = cdiv_pw(nb0, pc);
        let a_hi = div_pw(bq, pw) * g;
        let a_lo = div_pw(bq, pc);
        for (var i = lid; i < MAXC; i += WG) {
            var c = INVALID;
            if (i >= KMAX * g && causal && a_hi + (i - KMAX * g) < a_lo) {
                c = a_hi + (i - KMAX * g);
            }
            if (l == 1u && c != INVALID && is_forced(bq, c)) { c = INVALID; }
            cand[cn + i] = c;
        }
        workgroupBarrier();
        if (SGR != 0u) {
            // The rank counts and the cut in one step (decode_levels_sg.wgsl).
            rank_cut_sg(co, cn, l, nchild, bq, lid);
            workgroupBarrier();
            co = cn;
            pw = pc;
            continue;
        }
        // Rank counts: item (i, part) counts the candidates j = part, part + CP, ... ranked
        // ahead of candidate i (higher score, then lower index; distinct keys unless the same
        // score, and an empty slot's key 0 is below every score's) into xr[part * MAXC + i]
        // (f32: exact for counts this small).
        for (var it = lid; it < MAXC * CP; it += WG) {
            let i = it % MAXC;
            let part = it / MAXC;
            let v = cand[co + i];
            let sc = rk[i];
            var r = 0u;
            for (var j = part; j < MAXC; j += CP) {
                let sj = rk[j];
                r += select(0u, 1u, sj > sc || (sj == sc && cand[co + j] < v));
            }
            xr[part * MAXC + i] = f32(r);
        }
        workgroupBarrier();
        // Cut: a kept node of rank r writes its children to slots r*g...
        for (var i = lid; i < MAXC; i += WG) {
            let v = cand[co + i];
            if (v == INVALID) { continue; }
            var rf = 0.0;
            for (var part = 0u; part < CP; part++) { rf += xr[part * MAXC + i]; }
            let r = u32(rf);
            if (r < KMAX) {
                for (var c = 0u; c < g; c++) {
                    var ch = v * g + c;
                    if (ch >= nchild || (l == 1u && is_forced(bq, ch))) { ch = INVALID; }
                    cand[cn + r * g + c] = ch;
                }
            }
        }
        workgroupBarrier();
        co = cn;
        pw = pc;
    }
    return co;
}

// Where the leaf slots of the query at position len - 1 (len > 0) are: `all` > 0 when the query
// sees K or fewer leaves (slots MAXC.. are then every visible leaf, unscored); else the routed
// candidates in cand[co..co + MAXC] and the nf forced leaves (sinks, then locals and the own
// block). Called by the whole workgroup in uniform control flow (route_levels has barriers).
struct Slots { all: u32, co: u32, nf: u32, local_start: u32, sink_end: u32 }

fn route_slots(bh: u32, len: u32, lid: u32) -> Slots {
    var s: Slots;
    let bq = (len - 1u) / p.block_size;
    let nb0 = cdiv(len, p.block_size);
    var visible = nb0;
    if (p.causal != 0u) { visible = bq + 1u; }
    if (visible <= KMAX) {
        s.all = visible;
        return s;
    }
    s.co = route_levels(bh, len, bq, nb0, lid);
    s.local_start = bq - min(p.local, bq);
    s.sink_end = min(p.sink, s.local_start);
    s.nf = s.sink_end + bq - s.local_start + 1u;
    return s;
}

// Slot i (< NS) of `s`: a leaf block index or INVALID. Candidates in slots 0..MAXC, the forced
// leaves (or every visible leaf) packed first in slots MAXC...
fn slot_at(s: Slots, i: u32) -> u32 {
    if (s.all != 0u) { return select(INVALID, i - MAXC, i >= MAXC && i - MAXC < s.all); }
    if (i < MAXC) { return cand[s.co + i]; }
    let f = i - MAXC;
    if (f >= s.nf) { return INVALID; }
    return select(s.local_start + f - s.sink_end, f, f < s.sink_end);
}
