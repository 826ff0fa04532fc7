// The `Table` uniform of the routing kernels (route.wgsl, route_table.wgsl; prepended to both
// by pisa-wgpu/src/ops/route.rs, after select_common.wgsl): the chunk of queries i0 .. i0 + nq,
// the lowest table level lt (above the start level: no table), the entries per query tn, and
// the table kernel's grid (items, tiles). Host side: route.rs `TableParams`; the NVIDIA
// kernel's GLSL (shaders/nv/route_table.comp) restates the block.
struct Table {
    i0: u32, nq: u32, lt: u32, tn: u32,
    items: u32, tiles: u32, pad0: u32, pad1: u32,
}
