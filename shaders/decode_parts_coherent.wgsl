// The decode step's block states, f32 [B*Hkv, NS, GQ, D + 2] (decode.wgsl), as route_leaf_merge
// binds them (appended last to its modules): `@coherent` (SPIR-V Coherent; wgpu's native
// feature MEMORY_DECORATION_COHERENT, which pisa asks for), so that the states one workgroup
// writes are visible to the loads of the workgroup that merges them once the barriers and the
// count have ordered them (decode_route_leaf_merge.wgsl). Never built in a browser.
@coherent @group(0) @binding(11) var<storage, read_write> parts: array<f32>;
