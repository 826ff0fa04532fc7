// The lane and group sums of the routing kernel's subgroup score step (route.wgsl SG = 1),
// appended to it (host: pisa-wgpu/src/ops/route.rs, SG_SHADER), by butterflies of
// subgroupShuffleXor over a query's L GQ4P consecutive invocations (L and GQ4P powers of two,
// L GQ4P at most the subgroup size); every invocation gets the sum.

// The sum of v over the L lanes of a head group.
fn lanes_sum(v: vec4<f32>) -> vec4<f32> {
    var s = v;
    for (var m = 1u; m < L; m <<= 1u) { s += subgroupShuffleXor(s, m); }
    return s;
}

// The sum of x over the GQ4P head groups of a query (x the same in a group's L lanes).
fn groups_sum(x: f32) -> f32 {
    var s = x;
    for (var m = L; m < L * GQ4P; m <<= 1u) { s += subgroupShuffleXor(s, m); }
    return s;
}

// TR (route.wgsl): head group hg's part of the score of node j of level l >= 1, as score_lse
// forms it, from this lane's partial dot products acc[c][t] (child c of 2, head 4 hg + t;
// scaled) and those of the group's other L - 1 lanes (L = 8 or 16). The butterfly keeps half of
// the values at each step and sends the other half (for L = 8: xor 4 the children, 2 the head
// pairs, 1 the heads; L = 16 adds xor 1 over whole sums), so that lane u ends with the sum over
// the L lanes of child (u >> 2) & 1, head u & 3 (L = 8); the lanes
// of the two children of a head exchange theirs and form the head's LSE over the children
// (the same expression in both, in the same order: equal results), and the heads' LSEs are
// summed by two more steps. Every lane returns the group's part (`on` false: 0).
fn score_lanes(acc: array<vec4<f32>, G>, lane: u32, l: u32, j: u32, hg: u32, on: bool,
               ln_full: f32) -> f32 {
    // Lane bits: BC the child, BP the head pair, BH the head within the pair; the bits below BH
    // (L = 16: bit 0) tell apart lanes that hold parts of the same sums.
    const BC = L / 2u;
    const BP = L / 4u;
    const BH = L / 8u;
    let bc = (lane & BC) != 0u;
    let v4 = select(acc[0], acc[1], bc) + subgroupShuffleXor(select(acc[1], acc[0], bc), BC);
    let bp = (lane & BP) != 0u;
    let v2 = select(v4.xy, v4.zw, bp) + subgroupShuffleXor(select(v4.zw, v4.xy, bp), BP);
    let bh = (lane & BH) != 0u;
    var d = select(v2.x, v2.y, bh) + subgroupShuffleXor(select(v2.y, v2.x, bh), BH);
    for (var m = 1u; m < BH; m <<= 1u) { d += subgroupShuffleXor(d, m); }
    let c = select(0u, 1u, bc);
    let t = select(0u, 2u, bp) + select(0u, 1u, bh);
    let lc = p.levels[l - 1u];
    // Children of the node (1 or 2: the level's last node may have one).
    let nr = min(j * 2u + 2u, lc.y) - j * 2u;
    // log n_c: of a full node, ln_full (the caller's log of the level's node span, once per
    // level); only a level's last node may be shorter.
    let len = node_len(j * 2u + c, lc.w);
    var ln = ln_full;
    if (len != lc.w) { ln = log(f32(len)); }
    let x = d + ln;
    let xo = subgroupShuffleXor(x, BC);
    // x0, x1: child 0's and child 1's, in both lanes.
    let x0 = select(x, xo, bc);
    let x1 = select(xo, x, bc);
    // children_lse's result, written out for two children: NEG as the floor of the maximum
    // keeps an all -inf pair at -inf (children_lse starts its running maximum there).
    let m = max(max(x0, x1), NEG);
    var h = m + log(exp(x0 - m) + exp(x1 - m));
    if (nr < 2u) { h = x0; }
    if (!on || hg * 4u + t >= GQ) { h = 0.0; }
    h += subgroupShuffleXor(h, BH);
    h += subgroupShuffleXor(h, BP);
    return h;
}
