// The decode step's block states, f32 [B*Hkv, NS, GQ, D + 2] (decode.wgsl), appended last to
// every decode module but route_leaf_merge's (decode_parts_coherent.wgsl).
@group(0) @binding(11) var<storage, read_write> parts: array<f32>;
