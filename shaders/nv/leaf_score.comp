#version 450
// Leaf-major stage 2 of PISA prefill selection, part 2 of 3 (the scorer), on NVIDIA cooperative
// matrices 2 (PISA.md 2, 3.3 and 5): the same chunks, bindings and output as
// shaders/leaf_score_coop.wgsl (host: pisa-wgpu/src/ops/leaf_select/by_leaf.rs, which runs this
// kernel where the device has VK_NV_cooperative_matrix2), so the bucketing (leaf_bucket.wgsl)
// and the pick (leaf_pick.wgsl) are shared. One workgroup per chunk: up to RT / GQ entries of
// one bucket (b, KV head, leaf), i.e. queries that list the leaf as a candidate, RT rows
// (entry e, head h at row e * GQ + h).
//   1. the chunk's Q rows gathered into workgroup memory (16-byte loads);          barrier
//   2. S = Q K^T over the leaf's CW = 64 key rows, read straight from K as a workgroup-scope
//      matrix (rows past the leaf or the sequence read as zeros: the tensor layout ends there);
//   3. mask (keys of the leaf: candidates are complete past, no causal cut), row max m of the
//      unscaled scores, row sum l of exp(scale (s - m)) (one exp2 pass), LSE = scale m + log l,
//      column 0 to workgroup memory;                                             barrier
//   4. one invocation per entry: the LSEs of its GQ rows summed, as rank_key to its slot.
// Defines: HD (head dim), RT (rows), CW (keys per leaf tile: 64), DC (head-dim columns per
// multiply), WG (invocations).
#include "common.glsl"
// wgpu bindings 0, 1, 2, 7, 8, 9, 10, 11, 12 as Vulkan bindings 0 to 8 (common.glsl; 12, K
// again for the WGSL kernel's staging copy, is not read here).
#define B_PARAMS 0
#define B_COFF 3
#define B_LIST 4
#define B_BUCKETS 6
#define B_DESC 7
#include "select_common.glsl"

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 1, std430) readonly buffer BufQ { uvec4 q4[]; };
layout(set = 0, binding = 2, std430) readonly buffer BufK { float16_t k[]; };
layout(set = 0, binding = 5, std430) buffer BufScores { uint scores[]; };

#include "gather_q.glsl"

shared float rowlse[RT];

// Keys past the leaf's end masked; scores stay unscaled (the scale is folded into the exponent).
float mask(const in uint r, const in uint c, const in float s, const in uint leaf_len) {
    return c < leaf_len ? s : NEG;
}
// exp(scale (x - y)) as exp2((x - y) k), k = scale log2 e: one pass, 0 for a masked x.
float exp_scaled(const in uint r, const in uint c, const in float x, const in float y,
                 const in float k) {
    return exp2((x - y) * k);
}
float log_elem(const in uint r, const in uint c, const in float x) { return log(x); }
float max_reduce(const in float a, const in float b) { return max(a, b); }
float add_reduce(const in float a, const in float b) { return a + b; }
float store_col0(const in uint r, const in uint c, const in float x) {
    if (c == 0) { rowlse[r] = x; }
    return x;
}

void main() {
    const uint cid = linear_workgroup();
    if (cid >= bl.items || cid >= coff[bl.buckets]) { return; }
    const uvec4 d = cdesc[cid];
    const uint bh = d.x / p.nb0, leaf = d.x % p.nb0, first = d.y, n = d.z;
    const uint lid = gl_LocalInvocationIndex;
    const uint gq = p.q_heads / p.kv_heads;
    const uint b = bh / p.kv_heads, hkv = bh % p.kv_heads;
    const uint leaf0 = leaf * p.block_size;
    const uint kend = min(p.k_len, leaf0 + p.block_size);

    // 1. Q rows (row r: entry r / gq, head hkv * gq + r % gq), zeros past the entries.
    gather_q(lid, b, hkv, gq, first, n);
    barrier();

    // 2. S = Q K^T, DC head-dim columns at a time (the driver stages each operand in
    //    workgroup memory).
    tensorLayoutNV<2, CLAMP> lk = createTensorLayoutNV(2, CLAMP);
    lk = setTensorLayoutDimensionNV(lk, kend, HD);
    lk = setTensorLayoutStrideNV(lk, p.k_sn, 1);
    tensorViewNV<2, false, 1, 0> transpose = createTensorViewNV(2, false, 1, 0);
    coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> s =
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator>(0.0);
    [[unroll]] for (uint d0 = 0; d0 < HD; d0 += DC) {
        coopmat<float16_t, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseA> qa;
        coopMatLoad(qa, qsh, d0 / 8, QS8, gl_CooperativeMatrixLayoutRowMajor);
        coopmat<float16_t, gl_ScopeWorkgroup, DC, CW, gl_MatrixUseB> kt;
        coopMatLoadTensorNV(kt, k, b * p.k_sb + hkv * p.k_sh,
                            sliceTensorLayoutNV(lk, leaf0, CW, d0, DC), transpose);
        s = coopMatMulAdd(qa, kt, s);
    }

    // 3. Each row's LSE over the leaf's keys.
    coopMatPerElementNV(s, s, mask, kend - leaf0);
    coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> m, e, l;
    coopMatReduceNV(m, s, gl_CooperativeMatrixReduceRowNV, max_reduce);
    coopMatPerElementNV(e, s, exp_scaled, m, p.scale * 1.4426950408889634);
    coopMatReduceNV(l, e, gl_CooperativeMatrixReduceRowNV, add_reduce);
    coopMatPerElementNV(l, l, log_elem);
    l = m * p.scale + l;
    coopMatPerElementNV(l, l, store_col0);
    barrier();

    // 4. An entry's score: its rows' LSEs summed over the group.
    for (uint x = lid; x < n; x += WG) {
        float tot = 0.0;
        for (uint h = 0; h < gq; h++) { tot += rowlse[x * gq + h]; }
        scores[bh * p.q_len * p.mc + list[first + x]] = rank_key(tot);
    }
}
