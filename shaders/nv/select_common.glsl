// The uniforms shared with the WGSL selection and attention kernels (shaders/select_common.wgsl
// `Params`, shaders/leaf_chunk.wgsl `Buckets`), same layout: the host writes one structure for
// both paths. `levels` (per level after the scalars) is declared only where a kernel defines
// PARAMS_LEVELS.
// Bindings: the including kernel defines B_PARAMS, B_BUCKETS, B_COFF, B_LIST and B_DESC as the
// Vulkan binding numbers of WGSL bindings 0, 10, 7, 8 and 11 (see common.glsl: wgpu numbers a
// layout's bindings densely in order), or NO_CHUNKS and only the first two when it reads no
// chunk buckets, or NO_CHUNKS and NO_BUCKETS and only B_PARAMS.
layout(set = 0, binding = B_PARAMS, std140) uniform Params {
    uint q_sb; uint q_sh; uint q_sn; uint k_sb;
    uint k_sh; uint k_sn; uint q_heads; uint kv_heads;
    uint q_len; uint k_len; uint head_dim; uint block_size;
    uint merge; uint top_k; uint causal; uint sink;
    uint local_blocks; uint nb0; uint total_nodes; uint start_level;
    uint scoring; uint tiles; uint wg_count; float scale;
    uint q_pos0; uint mc; uint routed; uint pad1;
    uint o_sb; uint o_sh; uint o_sn; uint pad2;
#ifdef PARAMS_LEVELS
    // Per level: node offset in the allocation, valid nodes, leaves per node, tokens per node.
    uvec4 levels[64];
#endif
} p;

#ifndef NO_BUCKETS
layout(set = 0, binding = B_BUCKETS, std140) uniform Buckets {
    uint items; uint buckets; uint i0; uint nq;
    uint bh0; uint first; uint heads; uint pad2;
} bl;
#endif

#ifndef NO_CHUNKS
// The chunk buckets of leaf_bucket.wgsl (see leaf_chunk.wgsl): coff[bl.buckets] is the chunk
// count, cdesc[c] = (bucket, first entry in `list`, entries, 0).
layout(set = 0, binding = B_COFF, std430) readonly buffer BufCoff { uint coff[]; };
layout(set = 0, binding = B_LIST, std430) readonly buffer BufList { uint list[]; };
layout(set = 0, binding = B_DESC, std430) readonly buffer BufDesc { uvec4 cdesc[]; };
#endif

const float NEG = -3.0e38;

uint linear_workgroup() {
    return gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x
        + gl_WorkGroupID.z * gl_NumWorkGroups.x * gl_NumWorkGroups.y;
}

// Ranking key of a score (select_common.wgsl rank_key): an order-preserving map of f32 onto
// u32; every NaN ranks as -inf, -0 as +0.
uint rank_key(float s) {
    uint b = floatBitsToUint(s);
    if ((b & 0x7fffffffu) > 0x7f800000u) { b = 0xff800000u; }
    if (b == 0x80000000u) { b = 0u; }
    return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}
