// A leaf slot's block attention with subgroup shuffles (SGA = 1; appended to
// decode_attend.wgsl, whose attend_block calls attend_block_sg, where the device has subgroups;
// elsewhere decode_attend_nosg.wgsl). The same state as attend_block (per head: max m, sum l,
// unnormalised O), with one barrier instead of six a chunk and the P.V parts' sum:
//   1. key t = al / LK, lane u = al % LK: its partial dots for the GQ heads, summed over the LK
//      lanes by shuffles; x = s q.k_t (NEG past the block). Per group of SGA_G consecutive lanes
//      (KPG keys), per head, the max mg and the sum lg of p_t = exp(x_t - mg) by shuffles; p_t
//      to xs, (mg, lg) of each group to xs after them;                              barrier
//   2. per head M = max over the groups' mg; invocation (j4 = al / PARTS, part = al % PARTS)
//      sums p_t exp(mg - M) v_t over the PVI consecutive keys of its part (value rows loaded
//      before step 1, so their round trip overlaps the keys'); the PARTS sums of a vec4, in
//      consecutive lanes, added by shuffles; part 0 writes the vec4 of every head, and j4 = 0
//      also M and l = sum over the groups of lg exp(mg - M).
// The host (ops/decode/plan.rs, Plan::attend_subgroup_lanes) runs this only where the block is
// one chunk (CH = C), CH * LK = AW, PARTS * D4 = AW with PARTS a power of two, PVI at most 16,
// and SGA_G (a power of two) at most the smallest subgroup, a multiple of LK and PARTS and a
// divisor of AW: a group's lanes, a key's lanes and a vec4's parts are then in one subgroup
// (subgroups are formed from consecutive invocations of a one-dimensional workgroup on the
// drivers pisa runs on, as decode_levels_sg.wgsl assumes). Every shuffle runs in every lane of
// the workgroup (the loads alone are conditional).

// (At least 1 each, so that the shader validates where SGA = 0 and the sizes do not fit.)
const KPG: u32 = max(SGA_G / LK, 1u);  // keys of a lane group
const NG: u32 = max(AW / SGA_G, 1u);   // lane groups of an instance
const PVI: u32 = max(CH / PARTS, 1u);  // keys of a P.V invocation (consecutive)
const XG: u32 = CH * GQ;      // the groups' (mg, lg) per head, after the p of the keys in xs
// The host's conditions (Plan::attend_subgroup_lanes), so that a mismatch fails the build.
const_assert SGA == 0u || (CH * LK == AW && PARTS * D4 == AW && CH % PARTS == 0u
                           && AW % SGA_G == 0u && WG % SGA_G == 0u && SGA_G % LK == 0u
                           && SGA_G % PARTS == 0u && XG + 2u * NG * GQ <= XS && PVR == PVI);

// exp(mg - M) of group g of head hh (xs at xb), 0 for a group without a key.
fn group_factor(xb: u32, g: u32, hh: u32, m: f32) -> f32 {
    let mg = xs[xb + XG + (g * GQ + hh) * 2u];
    return select(0.0, exp(mg - m), mg > NEG_T);
}

// attend_block's state of the block of n <= CH keys from token t0 into parts[po..] (n = 0:
// nothing written), by the AW invocations of instance ib (its invocation al; an instance ib >=
// NB takes part in the barrier and the shuffles only).
fn attend_block_sg(bh: u32, t0: u32, n: u32, po: u32, al: u32, ib: u32) {
    let act = ib < NB && n > 0u;
    let xb = min(ib, NB - 1u) * XS;
    let part = al % PARTS;
    let j4 = al / PARTS;
    let k0 = part * PVI;
    var vv: array<vec4<store_t>, PVR>;
    if (act) { vv = load_values(bh, t0, n, k0, 1u, j4); }
    // 1. Scores, the groups' maxima and sums.
    let t = al / LK;
    let u = al % LK;
    let on = act && t < n;
    var a: array<f32, GQ>;
    if (on) { a = dots_key_shard(bh, t0 + t, u); }
    for (var m = 1u; m < LK; m <<= 1u) {
        for (var hh = 0u; hh < GQ; hh++) { a[hh] += subgroupShuffleXor(a[hh], m); }
    }
    var mg: array<f32, GQ>;
    var lg: array<f32, GQ>;
    for (var hh = 0u; hh < GQ; hh++) {
        let x = select(NEG, p.scale * a[hh], on);
        var mx = x;
        for (var m = LK; m < SGA_G; m <<= 1u) { mx = max(mx, subgroupShuffleXor(mx, m)); }
        let e = select(0.0, exp(x - mx), x > NEG_T);
        var s = e;
        for (var m = LK; m < SGA_G; m <<= 1u) { s += subgroupShuffleXor(s, m); }
        mg[hh] = mx;
        lg[hh] = s;
        if (ib < NB && hh % LK == u) { xs[xb + t * GQ + hh] = e; }
    }
    if (ib < NB && al % SGA_G == 0u) {
        let g = al / SGA_G;
        for (var hh = 0u; hh < GQ; hh++) {
            xs[xb + XG + (g * GQ + hh) * 2u] = mg[hh];
            xs[xb + XG + (g * GQ + hh) * 2u + 1u] = lg[hh];
        }
    }
    workgroupBarrier();
    // 2. P.V over the part's keys, each key's p rescaled to the block's max.
    var mm: array<f32, GQ>;
    for (var hh = 0u; hh < GQ; hh++) {
        var v = NEG;
        if (ib < NB) {
            for (var g = 0u; g < NG; g++) { v = max(v, xs[xb + XG + (g * GQ + hh) * 2u]); }
        }
        mm[hh] = v;
    }
    var acc: array<vec4<f32>, GQ>;
    var f: array<f32, GQ>;
    for (var i = 0u; i < PVI; i++) {
        let k = k0 + i;
        if (act && (i == 0u || k % KPG == 0u)) {
            for (var hh = 0u; hh < GQ; hh++) { f[hh] = group_factor(xb, k / KPG, hh, mm[hh]); }
        }
        if (act && k < n) {
            let v = vec4<f32>(vv[i]);
            for (var hh = 0u; hh < GQ; hh++) { acc[hh] += (xs[xb + k * GQ + hh] * f[hh]) * v; }
        }
    }
    for (var m = 1u; m < PARTS; m <<= 1u) {
        for (var hh = 0u; hh < GQ; hh++) { acc[hh] += subgroupShuffleXor(acc[hh], m); }
    }
    if (!act || part != 0u) { return; }
    for (var hh = 0u; hh < GQ; hh++) {
        let w = po + hh * PW;
        let o = acc[hh];
        parts[w + 4u * j4] = o.x;
        parts[w + 4u * j4 + 1u] = o.y;
        parts[w + 4u * j4 + 2u] = o.z;
        parts[w + 4u * j4 + 3u] = o.w;
        if (j4 == 0u) {
            var l = 0.0;
            for (var g = 0u; g < NG; g++) {
                l += xs[xb + XG + (g * GQ + hh) * 2u + 1u] * group_factor(xb, g, hh, mm[hh]);
            }
            parts[w + DD] = mm[hh];
            parts[w + DD + 1u] = l;
        }
    }
}
