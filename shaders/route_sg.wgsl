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
