// Fills a tensor with pseudo-random values uniform in [-scale, scale) from a counter-based hash
// (PCG-style) of (seed, index): benchmark inputs made on the GPU, never zeros. Written a pair
// of elements (2i, 2i + 1) at a time through out2_out (one whole word for bf16): the host
// allocates an even number of elements.
// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
alias store_t = f32;
alias cache_t = store_t;

struct Params { len: u32, seed: u32, scale: f32, per_thread: u32 } // len: pairs

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<cache_t>;

fn pcg(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let g = (wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y) * 256u + lid;
    for (var j = 0u; j < p.per_thread; j++) {
        let i = g * p.per_thread + j;
        if (i >= p.len) { return; }
        out2_out(2u * i, value(2u * i), value(2u * i + 1u));
    }
}

fn value(i: u32) -> f32 {
    let h = pcg(i ^ pcg(p.seed));
    let u = f32(h >> 8u) * (1.0 / 16777216.0);
    return (2.0 * u - 1.0) * p.scale;
}
