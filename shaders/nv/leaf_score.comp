#version 450
// Leaf-major stage 2 of PISA prefill selection, part 2 of 3 (the scorer), on NVIDIA cooperative
// matrices 2 (PISA.md 2, 3.3 and 5): the same chunks, bindings and output as
// shaders/leaf_score_coop.wgsl (host: pisa-wgpu/src/ops/leaf_select/by_leaf.rs, which runs this
// kernel where the device has VK_NV_cooperative_matrix2), so the bucketing (leaf_bucket.wgsl)
// and the pick (leaf_pick.wgsl) are shared. One workgroup per chunk: up to RT / GQ entries of
// one bucket (b, KV head, leaf), i.e. queries that list the leaf as a candidate, RT rows
// (entry e, head h at row e * GQ + h).
//   1. the chunk's rows' offsets in Q to workgroup memory (gather_q.glsl, QDEC = 1); barrier
//   2. S = Q K^T over the leaf's CW = 64 key rows, the Q rows read through gather_q.glsl's
//      decode function and the keys straight from K, each as a workgroup-scope matrix (key
//      rows past the sequence, or past the leaf (PAIR: past the pair), read as zeros: the
//      tensor layout ends there; within it, keys past a leaf of C < 64 are masked in 3);
//   3. mask (keys of the leaf: candidates are complete past, no causal cut), row max m of the
//      unscaled scores, row sum l of exp(scale (s - m)) (one exp2 pass), LSE = scale m + log l,
//      column 0 to workgroup memory;                                             barrier
//   4. one invocation per entry: the LSEs of its GQ rows summed, as rank_key to its slot.
// PAIR = 1 (leaf_bucket.wgsl's PAIR buckets): a bucket is a pair of leaves 2P, 2P + 1, and an
// entry is a query that lists one of them or both (two adjacent slots: a kept node's two
// children with g = 2). Steps 2 and 3 run for both leaves with the same Q matrices, and step 4
// writes the scores of the leaves the entry lists. Each query's rows are then read once per
// pair instead of once per leaf: the gather was a third of the scorer's time at 256K tokens
// (docs/benchmarks.md, A.11).
// Defines: HD (head dim), RT (rows), CW (keys per leaf tile: 64), DC (head-dim columns per
// multiply), WG (invocations), PAIR (0 or 1).
#ifndef PAIR
#define PAIR 0
#endif
// Entry flags of a PAIR bucket list (leaf_bucket.wgsl): the entry's slot o holds leaf 2P + 1
// alone (ODD), or o and o + 1 hold 2P and 2P + 1 (BOTH); neither: o holds 2P alone.
#define ENTRY_BOTH 0x80000000u
#define ENTRY_ODD 0x40000000u
#define ENTRY_INDEX(v) ((v) & 0x3fffffffu)
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

layout(set = 0, binding = 2, std430) readonly buffer BufK { float16_t k[]; };
layout(set = 0, binding = 5, std430) buffer BufScores { uint scores[]; };

// The Q rows through the driver's tensor loads (gather_q.glsl).
#ifndef QDEC
#define QDEC 1
#endif
#include "gather_q.glsl"

// Per row, the LSE over the leaf (PAIR: over leaf 2P at r, over 2P + 1 at RT + r).
shared float rowlse[RT * (PAIR + 1)];

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
float store_col0(const in uint r, const in uint c, const in float x, const in uint base) {
    if (c == 0) { rowlse[base + r] = x; }
    return x;
}

#define ACC coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator>

// Step 3 for one leaf: each row's LSE over the leaf's first `len` keys of `s` to rowlse[base +
// row] (a macro: the matrices stay in the caller's scope).
#define ROW_LSE(s, len, base)                                                          \
    {                                                                                  \
        coopMatPerElementNV(s, s, mask, len);                                          \
        ACC m, e, l;                                                                   \
        coopMatReduceNV(m, s, gl_CooperativeMatrixReduceRowNV, max_reduce);            \
        coopMatPerElementNV(e, s, exp_scaled, m, p.scale * 1.4426950408889634);        \
        coopMatReduceNV(l, e, gl_CooperativeMatrixReduceRowNV, add_reduce);            \
        coopMatPerElementNV(l, l, log_elem);                                           \
        l = m * p.scale + l;                                                           \
        coopMatPerElementNV(l, l, store_col0, base);                                   \
    }

void main() {
    const uint cid = linear_workgroup();
    if (cid >= bl.items || cid >= coff[bl.buckets]) { return; }
    const uvec4 d = cdesc[cid];
    // Buckets per (b, KV head): leaves, or pairs of leaves.
    const uint units = PAIR == 1 ? (p.nb0 + 1) / 2 : p.nb0;
    const uint bh = d.x / units, leaf = (d.x % units) * (PAIR + 1), first = d.y, n = d.z;
    const uint lid = gl_LocalInvocationIndex;
    const uint gq = p.q_heads / p.kv_heads;
    const uint b = bh / p.kv_heads, hkv = bh % p.kv_heads;
    const uint leaf0 = leaf * p.block_size;
    const uint kend = min(p.k_len, leaf0 + (PAIR + 1) * p.block_size);

    // 1. Q rows (row r: entry r / gq, head hkv * gq + r % gq), zeros past the entries.
    gather_q(lid, b, hkv, gq, first, n);
    barrier();

    // 2. S = Q K^T, DC head-dim columns at a time (the driver stages each operand in
    //    workgroup memory); PAIR: S1 against the second leaf's keys with the same Q matrices.
    tensorLayoutNV<2, CLAMP> lk = createTensorLayoutNV(2, CLAMP);
    lk = setTensorLayoutDimensionNV(lk, kend, HD);
    lk = setTensorLayoutStrideNV(lk, p.k_sn, 1);
    tensorViewNV<2, false, 1, 0> transpose = createTensorViewNV(2, false, 1, 0);
    const uint kbase = b * p.k_sb + hkv * p.k_sh;
    ACC s = ACC(0.0);
#if PAIR
    ACC s1 = ACC(0.0);
#endif
    [[unroll]] for (uint d0 = 0; d0 < HD; d0 += DC) {
        coopmat<float16_t, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseA> qa;
        LOAD_QA(qa, d0);
        coopmat<float16_t, gl_ScopeWorkgroup, DC, CW, gl_MatrixUseB> kt;
        coopMatLoadTensorNV(kt, k, kbase, sliceTensorLayoutNV(lk, leaf0, CW, d0, DC), transpose);
        s = coopMatMulAdd(qa, kt, s);
#if PAIR
        coopmat<float16_t, gl_ScopeWorkgroup, DC, CW, gl_MatrixUseB> kt1;
        coopMatLoadTensorNV(kt1, k, kbase,
                            sliceTensorLayoutNV(lk, leaf0 + p.block_size, CW, d0, DC), transpose);
        s1 = coopMatMulAdd(qa, kt1, s1);
#endif
    }

    // 3. Each row's LSE over the leaf's keys (PAIR: over each leaf's; a second leaf past the
    //    sequence has no keys, and no entry lists it).
    const uint len0 = min(kend - leaf0, p.block_size);
    ROW_LSE(s, len0, 0u)
#if PAIR
    const uint len1 = kend > leaf0 + p.block_size ? kend - leaf0 - p.block_size : 0;
    ROW_LSE(s1, len1, uint(RT))
#endif
    barrier();

    // 4. An entry's score: its rows' LSEs summed over the group, to the slot of each leaf it
    //    lists.
    for (uint x = lid; x < n; x += WG) {
        float tot = 0.0;
        const uint v = list[first + x];
        const uint slot = bh * p.q_len * p.mc + ENTRY_INDEX(v);
#if PAIR
        const bool lo = (v & ENTRY_ODD) == 0, hi = (v & (ENTRY_ODD | ENTRY_BOTH)) != 0;
#else
        const bool lo = true, hi = false;
#endif
        if (lo) {
            for (uint h = 0; h < gq; h++) { tot += rowlse[x * gq + h]; }
            scores[slot] = rank_key(tot);
        }
        if (hi) {
            float tot1 = 0.0;
            for (uint h = 0; h < gq; h++) { tot1 += rowlse[RT * PAIR + x * gq + h]; }
            scores[lo ? slot + 1 : slot] = rank_key(tot1);
        }
    }
}
