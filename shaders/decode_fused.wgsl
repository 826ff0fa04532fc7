// Decode step, fused: ONE dispatch, one workgroup of WG invocations (up to 1024) per (sequence,
// KV head) (appended to decode.wgsl, decode_levels.wgsl and decode_cut.wgsl, whose headers
// describe the shared parts). Where the split step pays a dependent dispatch per stage (about
// 1.7 us each inside one pass on an H200: docs/benchmarks.md, A.4), this does the whole
// step in one (measured 1.5-2x slower there: 8 workgroups read all the keys):
//   1. routing (route_slots: the intermediate levels, five barriers a level) into the NS leaf
//      slots, kept in workgroup memory (mc), compacted into a list (lst);
//   2. the exact state (max m, sum l) per GQ head of every slot's block (PISA.md 2: a block's
//      LSE m + log l is its leaf score), in passes of FNB blocks x FCH keys (FCH = C when
//      memory allows, so a block is in one pass): LK consecutive invocations per key row (a
//      warp's loads coalesced, fixed trip counts, every row serving all GQ heads) | the row
//      scores | per (block, head, sub) max then sum of exponentials over the keys k = sub mod
//      FRN, merged into bst; two barriers a pass. A block's state does not depend on where it
//      falls in the passes, so equal blocks get equal scores (ties go to the lower index);
//   3. the top-K cut (cut_top_k, as the split step's merge);
//   4. the attention over the K selected blocks only (their keys read again, from cache): the
//      per-head max M and sum L of the whole selection are known from step 2's states, so each
//      pass is partial scores | p = exp(s q.k - M) | P.V, each invocation owning one output
//      vec4 of every head for one of FPARTS key subsets, its value rows loaded at the pass's
//      start (their round trip overlaps the keys'); two barriers a pass. The FPARTS partial
//      outputs are summed through `xr` in rounds of FPB (two barriers a round); O = sum / L,
//      LSE = M + log L.
// f32 arithmetic, no subgroup operations. Scratch: `xr` holds the route's partial scores, then
// a pass's partial scores [RP * LK, GQ] and row values [RP, GQ] (from XP), then the P.V rounds.

const FNB: u32 = 4u;   // blocks per pass
const FCH: u32 = 64u;  // keys of each block per pass (C when memory allows)
const FRN: u32 = 4u;   // sub-accumulators per (block, head) (keys k = sub mod FRN)
const FPB: u32 = 8u;   // P.V parts summed per reduction round
const FPV: u32 = 1u;   // value rows prefetched per P.V invocation (FPV_IT, or 1: no prefetch)
const RP: u32 = FNB * FCH;          // key rows per pass
const XP: u32 = RP * LK * GQ;       // start of the row values in xr
const FPARTS: u32 = WG / D4;        // P.V key subsets (invocations per output vec4)
const FPV_IT: u32 = (RP + FPARTS - 1u) / FPARTS; // rows of a pass per P.V invocation
const FPREF: bool = FPV == FPV_IT;
const FOE: u32 = (GQ * DD + WG - 1u) / WG;      // output elements per invocation

var<workgroup> lst: array<u32, NS>;                 // slots to process (then the selection's)
var<workgroup> bst: array<vec2<f32>, NS * GQ * FRN>; // (m, l) per (slot, head, sub)
var<workgroup> hml: array<vec2<f32>, GQ>;           // (M, L) of the selection per head
var<workgroup> wnl: u32;

// The token of row r of the pass over list blocks bi0.. and keys c0.. of each, or INVALID
// (past the list, the block or the sequence).
fn pass_token(bi0: u32, c0: u32, r: u32, nl: u32, len: u32) -> u32 {
    let bi = bi0 + r / FCH;
    let k = c0 + r % FCH;
    if (r >= RP || bi >= nl || k >= p.block_size) { return INVALID; }
    let t = mc[lst[bi]] * p.block_size + k;
    return select(INVALID, t, t < len);
}

// Partial scores of the pass's rows, LK invocations per row, into xr[0..XP].
fn pass_partials(bh: u32, bi0: u32, c0: u32, nl: u32, len: u32, lid: u32) {
    for (var it = lid; it < RP * LK; it += WG) {
        let t = pass_token(bi0, c0, it / LK, nl, len);
        var a: array<f32, GQ>;
        if (t != INVALID) { a = dots_key_part(key_row(bh, t), it % LK); }
        for (var hh = 0u; hh < GQ; hh++) { xr[it * GQ + hh] = a[hh]; }
    }
}

// s * q_h . k of row r (its LK partials summed in a fixed order).
fn row_x(r: u32, hh: u32) -> f32 {
    var a = 0.0;
    for (var u = 0u; u < LK; u++) { a += xr[(r * LK + u) * GQ + hh]; }
    return p.scale * a;
}

@compute @workgroup_size(WG)
fn fused(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let b = id / p.kv_heads;
    let h = id % p.kv_heads;
    let qrow = (b * p.q_heads + h * GQ) * DD;
    load_q(qrow, b, lid);
    let len = workgroupUniformLoad(&wlen);
    let so = id * KMAX;
    if (len == 0u) {
        write_empty(qrow, so, lid); // zeros, LSE -inf, no blocks
        return;
    }
    // 1. Routing, the slots into mc, then the valid ones listed in lst.
    let sl = route_slots(id, len, lid);
    for (var i = lid; i < NS; i += WG) { mc[i] = slot_at(sl, i); }
    for (var i = lid; i < KMAX; i += WG) { mrank[i] = INVALID; }
    workgroupBarrier();
    for (var i = lid; i < NS; i += WG) {
        if (mc[i] != INVALID) {
            var pos = 0u;
            for (var j = 0u; j < i; j++) { pos += select(0u, 1u, mc[j] != INVALID); }
            lst[pos] = i;
        }
    }
    if (lid == 0u) {
        var n = 0u;
        for (var j = 0u; j < NS; j++) { n += select(0u, 1u, mc[j] != INVALID); }
        wnl = n;
    }
    let nl = workgroupUniformLoad(&wnl);
    // 2. The state of every listed block per head.
    for (var bi0 = 0u; bi0 < nl; bi0 += FNB) {
        for (var c0 = 0u; c0 < p.block_size; c0 += FCH) {
            pass_partials(id, bi0, c0, nl, len, lid);
            workgroupBarrier();
            for (var e = lid; e < RP * GQ; e += WG) {
                let t = pass_token(bi0, c0, e / GQ, nl, len);
                xr[XP + e] = select(NEG, row_x(e / GQ, e % GQ), t != INVALID);
            }
            workgroupBarrier();
            for (var e = lid; e < FNB * GQ * FRN; e += WG) {
                let bl = e / (GQ * FRN);
                let hh = (e / FRN) % GQ;
                let sub = e % FRN;
                if (bi0 + bl >= nl) { continue; }
                // Max, then the sum of the exponentials of the scored keys (an online update
                // would treat a +inf score differently; this matches the split step).
                var m = NEG;
                for (var k = sub; k < FCH; k += FRN) { m = max(m, xr[XP + (bl * FCH + k) * GQ + hh]); }
                var l = 0.0;
                for (var k = sub; k < FCH; k += FRN) {
                    let x = xr[XP + (bl * FCH + k) * GQ + hh];
                    if (x > NEG_T) { l += exp(x - m); }
                }
                let w = (lst[bi0 + bl] * GQ + hh) * FRN + sub;
                if (c0 == 0u) {
                    bst[w] = vec2<f32>(m, l);
                } else {
                    let o = bst[w];
                    let mm = max(o.x, m);
                    bst[w] = vec2<f32>(mm, o.y * exp(o.x - mm) + l * exp(m - mm));
                }
            }
        }
    }
    workgroupBarrier();
    // Per slot and head, the FRN sub-states merged (into sub 0); a candidate's score is the
    // sum over the heads of its block LSE.
    for (var s = lid; s < NS; s += WG) {
        if (mc[s] == INVALID) { continue; }
        var tot = 0.0;
        for (var hh = 0u; hh < GQ; hh++) {
            let w = (s * GQ + hh) * FRN;
            var m = NEG;
            for (var u = 0u; u < FRN; u++) { m = max(m, bst[w + u].x); }
            var l = 0.0;
            for (var u = 0u; u < FRN; u++) { l += bst[w + u].y * exp(bst[w + u].x - m); }
            bst[w] = vec2<f32>(m, l);
            tot += state_lse(m, l);
        }
        if (s < MAXC) { msc[s] = bitcast<u32>(tot); }
    }
    workgroupBarrier();
    // 3. The cut: msel, sel_out.
    cut_top_k(so, lid);
    // 4. Attention over the selection: its slots listed, (M, L) per head from the states.
    for (var i = lid; i < KMAX; i += WG) { lst[i] = msel[i]; }
    if (lid < GQ) {
        var m = NEG;
        for (var i = 0u; i < KMAX; i++) {
            if (msel[i] != INVALID) { m = max(m, bst[(msel[i] * GQ + lid) * FRN].x); }
        }
        var l = 0.0;
        for (var i = 0u; i < KMAX; i++) {
            if (msel[i] != INVALID) {
                let st = bst[(msel[i] * GQ + lid) * FRN];
                l += st.y * exp(st.x - m);
            }
        }
        hml[lid] = vec2<f32>(m, l);
    }
    if (lid == 0u) {
        var n = 0u;
        for (var i = 0u; i < KMAX; i++) { n += select(0u, 1u, msel[i] != INVALID); }
        wnl = n;
    }
    let ns = workgroupUniformLoad(&wnl);
    // A valid token for the clamped loads of masked rows (the first selected block's first).
    let t_any = mc[lst[0]] * p.block_size;
    let part = lid / D4;
    let j4 = lid % D4;
    var acc: array<vec4<f32>, GQ>;
    for (var bi0 = 0u; bi0 < ns; bi0 += FNB) {
        for (var c0 = 0u; c0 < p.block_size; c0 += FCH) {
            // This invocation's value rows of the pass, loaded before the keys.
            var vv: array<vec4<store_t>, FPV>;
            if (FPREF && part < FPARTS) {
                for (var i = 0u; i < FPV; i++) {
                    let t = pass_token(bi0, c0, part + i * FPARTS, ns, len);
                    vv[i] = raw4_vc(key_row(id, select(t_any, t, t != INVALID)) + j4);
                }
            }
            pass_partials(id, bi0, c0, ns, len, lid);
            workgroupBarrier();
            for (var e = lid; e < RP * GQ; e += WG) {
                let t = pass_token(bi0, c0, e / GQ, ns, len);
                let x = row_x(e / GQ, e % GQ);
                xr[XP + e] = select(0.0, exp(x - hml[e % GQ].x), t != INVALID && x > NEG_T);
            }
            workgroupBarrier();
            if (part < FPARTS) {
                for (var i = 0u; i < FPV_IT; i++) {
                    let r = part + i * FPARTS;
                    let t = pass_token(bi0, c0, r, ns, len);
                    var v: vec4<f32>;
                    if (FPREF) {
                        v = vec4<f32>(vv[i]);
                    } else {
                        v = in4_vc(key_row(id, select(t_any, t, t != INVALID)) + j4);
                    }
                    if (t != INVALID) {
                        for (var hh = 0u; hh < GQ; hh++) { acc[hh] += xr[XP + r * GQ + hh] * v; }
                    }
                }
            }
        }
    }
    // The FPARTS partial outputs summed in rounds of FPB parts through xr.
    var o: array<f32, FOE>;
    for (var r0 = 0u; r0 < FPARTS; r0 += FPB) {
        workgroupBarrier();
        if (part >= r0 && part < min(r0 + FPB, FPARTS)) {
            for (var hh = 0u; hh < GQ; hh++) {
                let w = ((part - r0) * GQ + hh) * DD + 4u * j4;
                xr[w] = acc[hh].x;
                xr[w + 1u] = acc[hh].y;
                xr[w + 2u] = acc[hh].z;
                xr[w + 3u] = acc[hh].w;
            }
        }
        workgroupBarrier();
        let np = min(FPB, FPARTS - r0);
        for (var i = 0u; i < FOE; i++) {
            let e = lid + i * WG;
            if (e < GQ * DD) {
                for (var pp = 0u; pp < np; pp++) { o[i] += xr[pp * GQ * DD + e]; }
            }
        }
    }
    for (var i = 0u; i < FOE; i++) {
        let e = lid + i * WG;
        if (e < GQ * DD) {
            let hh = e / DD;
            let ml = hml[hh];
            out[qrow + e] = store_t(select(0.0, o[i] / ml.y, ml.y > 0.0));
            if (e % DD == 0u) {
                lse_out[qrow / DD + hh] = select(bitcast<f32>(neg_inf_bits()), ml.x + log(ml.y), ml.y > 0.0);
            }
        }
    }
}
