// The lane sums of the routing kernel's subgroup score step (route.wgsl SG = 1), appended to it
// (host: pisa-wgpu/src/ops/route.rs, SG_SHADER): the sum of v over
// the L consecutive invocations of a query (L a power of two, at most the subgroup size), in
// every one of them, by a butterfly of log2 L shuffles.
fn lanes_sum(v: vec4<f32>) -> vec4<f32> {
    var s = v;
    for (var m = 1u; m < L; m <<= 1u) { s += subgroupShuffleXor(s, m); }
    return s;
}
