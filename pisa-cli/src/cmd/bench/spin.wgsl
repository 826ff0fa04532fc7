// The warm-up kernel of `pisa bench` (warm.rs): one workgroup whose invocations each run a
// chain of `iters` dependent multiply-adds, so that the GPU is busy for a set time before a
// timed submission. The result is stored only if it takes a value it never reaches, so that
// the chain is not removed, and the buffer is never read.

struct Params { iters: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> sink: array<f32>;

@compute @workgroup_size(64)
fn spin(@builtin(local_invocation_index) lid: u32) {
    var x = f32(lid) * 1.0e-3;
    for (var i = 0u; i < p.iters; i++) {
        x = fma(x, 0.999999, 1.0e-6);
    }
    if (x == -1.0) {
        sink[lid] = x;
    }
}
