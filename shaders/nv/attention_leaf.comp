#version 450
// Leaf-major block-sparse attention, part 2 of 3, on NVIDIA cooperative matrices 2 (PISA.md 4
// and 5): the same chunks, bindings and (m, l) states as shaders/attention_leaf_coop.wgsl
// (host: pisa-wgpu/src/ops/attention/by_leaf.rs, which runs this kernel where the device has
// VK_NV_cooperative_matrix2), so part 1 (leaf_bucket.wgsl) is shared; part 3 is
// attention_leaf_merge.wgsl (OPART_F16 = 0: O_part rows f32, unnormalised, as the WGSL kernel
// writes them) or attention_leaf_merge.comp (OPART_F16 = 1: O_part / l rows as f16). One workgroup per chunk: up to RT / GQ entries (local query i - i0, selection
// slot o) of one bucket (a leaf), RT rows (entry e, head h at row e * GQ + h).
//   1. the chunk's entries and each row's visible-token bound;       barrier
//   2. the Q rows gathered into workgroup memory (16-byte loads);   barrier
//   3. S = Q K^T over the leaf's CW = 64 key rows, read straight from K as a workgroup-scope
//      matrix (rows past the leaf or the sequence read as zeros: the tensor layout ends there);
//   4. mask (key in the leaf, t < min(p_i + 1, Nk) when causal; skipped, uniformly, where
//      every key of the tile is in the leaf and visible to every entry's rows: all leaves but
//      a query's own), row max m of the unscaled scores, P = exp(scale (s - m)) (one exp2
//      pass), row sum l, all on the accumulator; (m, l) to `mlpart` (as floats: see
//      store_col0) before step 5, so that neither full-size matrix stays live through it;
//   5. O_part = P V (V read as a workgroup-scope matrix) to the chunk's rows of `opart` (see
//      OPART_F16); 1 + each entry's first row to `spos`. A row whose keys are all masked has
//      l = 0 and O_part = 0. With OPART_F16 the f16 slices go to workgroup memory first (the
//      Q rows' array, free once S is formed; a barrier before and after), and the entries'
//      rows are then copied out with 16-byte stores, consecutive invocations writing
//      consecutive words; rows past the entries are not stored. On the H200 the chunk kernel
//      took 16.19 -> 15.07 ms at 64K and 64.21 -> 60.26 at 256K this way against the matrix
//      stores straight to `opart` (2026-12-03, docs/benchmarks.md A.18).
// PAIR = 1 (PREFETCH_V = 0): the chunks of the pair buckets (leaf_bucket.wgsl APAIR = 1; bucket
// bl.first + hb * ceil(nb0 / 2) + P), each over the 2C keys of leaves 2P and 2P + 1, the workgroups numbered from the
// first pair chunk, coff[bl.first]: as one tile of CW = 128 keys, or (HALVES = 1, CW = 64) as
// two tiles of CW keys (from leaf0 and leaf0 + CW, both masked at leaf0 + 2C) whose row maxima
// and sums are combined before P V = P1 V1 + P2 V2 (which is faster where, kernels.txt).
// Rows past the chunk's entries are computed (and, OPART_F16 = 0, stored) but never read (the
// merge follows spos). Defines: HD (head dim), RT (rows, a multiple of 16), CW (keys per leaf tile: 64),
// DC (head-dim columns per multiply: a divisor of HD), WG (invocations), OPART_F16 (1: the
// partial O rows stored as f16, for attention_leaf_merge.comp; 0: f32, for the WGSL merge),
// PREFETCH_V (1: the leaf's V slices loaded before the softmax, so their loads overlap it;
// default 0).
#ifndef PREFETCH_V
#define PREFETCH_V 0
#endif
#ifndef PAIR
#define PAIR 0
#endif
#ifndef HALVES
#define HALVES 0
#endif
// 1: a range of several (b, KV head)s (the `_mh` kernels; the head of a chunk decoded from its
// bucket); 0: one, bl.bh0, whose offsets the driver takes from the uniform. The one-head
// kernels stay for the ranges of one head: decoding the head in them made the chunk kernel 2.7%
// slower at 64K tokens on the H100 (15.5 against 15.9 ms, 2026-12-05, docs/benchmarks.md A.53).
#ifndef MULTI
#define MULTI 0
#endif
// Keys of a bucket: a leaf's, or a pair's.
#define SPAN ((PAIR + 1) * p.block_size)
#include "common.glsl"
// wgpu bindings 0, 1, 2, 3, 7, 8, 10, 11, 12, 13, 14 as Vulkan bindings 0 to 10 (common.glsl).
#define B_PARAMS 0
#define B_COFF 4
#define B_LIST 5
#define B_BUCKETS 6
#define B_DESC 7
#include "select_common.glsl"

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 2, std430) readonly buffer BufK { float16_t k[]; };
layout(set = 0, binding = 3, std430) readonly buffer BufV { float16_t v[]; };
#if OPART_F16
layout(set = 0, binding = 8, std430) buffer BufO { float16_t opart[]; };
// The same rows as 16-byte words, for the stores from workgroup memory (step 5).
layout(set = 0, binding = 8, std430) buffer BufO4 { uvec4 opart4[]; };
#else
layout(set = 0, binding = 8, std430) buffer BufO { float opart[]; };
#endif
layout(set = 0, binding = 9, std430) buffer BufML { float mlpart[]; }; // (m, l) pairs
layout(set = 0, binding = 10, std430) buffer BufSpos { uint spos[]; };

#if OPART_F16
#define QSH // the f16 O rows are staged in gather_q.glsl's qsh
#endif
#include "gather_q.glsl"

shared uint ent[RT];
shared uint rowlim[RT]; // row r sees tokens < rowlim[r] (0: a row past the entries)
shared uint cut;        // 1 where some entry's row sees only part of the leaf's tile

// Keys in the leaf and visible to the row kept; scores stay unscaled (the softmax scale is
// folded into the exponent, and m is scaled when stored).
float mask(const in uint r, const in uint c, const in float s, const in uint t0,
           const in uint end) {
    return (t0 + c < end && t0 + c < rowlim[r]) ? s : NEG;
}
float max2(const in uint r, const in uint c, const in float a, const in float b) {
    return max(a, b);
}
// exp(scale (s - m)) of a kept key as exp2((s - m) k), k = scale log2 e; exactly 0 for a
// masked one, so a row whose keys are all masked (a leaf after the query in a caller's
// selection) has l = 0 and O_part = 0, as the WGSL kernel writes, and the merge skips its state.
float exp_kept(const in uint r, const in uint c, const in float s, const in float m,
               const in float k) {
    return s > NEG ? exp2((s - m) * k) : 0.0;
}
float inv_or_zero(const in uint r, const in uint c, const in float l) {
    return l > 0.0 ? 1.0 / l : 0.0;
}
float smear_reduce(const in float a, const in float b) { return a; }
float max_reduce(const in float a, const in float b) { return max(a, b); }
float add_reduce(const in float a, const in float b) { return a + b; }
// Column 0 of a row-reduced matrix (every column holds the row's value) to word `at + 2 r` of
// mlpart. (A one-column tensor store does not do this: the H200's driver stores the other
// columns too, over the next rows; tests/nv_gemm.rs probes both.)
float store_col0(const in uint r, const in uint c, const in float x, const in uint at) {
    if (c == 0) { mlpart[at + 2 * r] = x; }
    return x;
}

void main() {
#if PAIR
    if (linear_workgroup() >= bl.items) { return; }
    const uint cid = coff[bl.first] + linear_workgroup();
    if (cid >= coff[bl.buckets]) { return; }
#else
    const uint cid = linear_workgroup();
    if (cid >= bl.items || cid >= coff[bl.buckets]) { return; }
#endif
    const uvec4 d = cdesc[cid];
    const uint first = d.y, n = d.z;
    const uint lid = gl_LocalInvocationIndex;
    const uint gq = p.q_heads / p.kv_heads;
#if MULTI
    // The bucket's head hb in the range (bl.bh0 + hb) and its leaf, or pair of leaves (see
    // shaders/leaf_chunk.wgsl attend_bucket): x = hb * nb0 + leaf; pairs x = bl.first + hb *
    // ceil(nb0 / 2) + P, keys from 2 P C.
#if PAIR
    const uint np = (p.nb0 + 1) / 2, y = d.x - bl.first;
    const uint hb = y / np, leaf0 = (y % np) * 2 * p.block_size;
#else
    const uint hb = d.x / p.nb0, leaf0 = (d.x % p.nb0) * p.block_size;
#endif
    const uint b = (bl.bh0 + hb) / p.kv_heads, hkv = (bl.bh0 + hb) % p.kv_heads;
#else
    // One head, bl.bh0: x = leaf, pairs x = nb0 + P.
#if PAIR
    const uint leaf0 = (d.x - p.nb0) * 2 * p.block_size;
#else
    const uint leaf0 = d.x * p.block_size;
#endif
    const uint b = bl.bh0 / p.kv_heads, hkv = bl.bh0 % p.kv_heads;
#endif
    const uint kend = min(p.k_len, leaf0 + SPAN);

    const uint kbase = b * p.k_sb + hkv * p.k_sh;
    tensorLayoutNV<2, CLAMP> lk = createTensorLayoutNV(2, CLAMP);
    lk = setTensorLayoutDimensionNV(lk, kend, HD);
    lk = setTensorLayoutStrideNV(lk, p.k_sn, 1);
    tensorViewNV<2, false, 1, 0> transpose = createTensorViewNV(2, false, 1, 0);

    // 1. Entries and visible bounds, and whether any entry's row sees part of the tile only.
    if (lid == 0) { cut = kend - leaf0 < (HALVES + 1) * CW ? 1u : 0u; }
    barrier();
    for (uint r = lid; r < RT; r += WG) {
        uint e = r / gq;
        uint x = e < n ? list[first + e] : 0u;
#if MULTI
        // spos index of the entry: its head's slots first (hb dead after this step).
        if (r < n) { ent[r] = hb * bl.nq * p.mc + list[first + r]; }
#else
        if (r < n) { ent[r] = list[first + r]; }
#endif
        uint lim = 0u;
        if (e < n) {
            uint i = bl.i0 + x / p.mc;
            lim = p.causal != 0u ? min(p.q_pos0 + i + 1u, p.k_len) : p.k_len;
            if (lim < kend) { atomicOr(cut, 1u); }
        }
        rowlim[r] = lim;
    }
    // 2. Q rows (row r: entry r / gq, head hkv * gq + r % gq), zeros past the entries.
    gather_q(lid, b, hkv, gq, first, n);
    barrier();

    // 3. S = Q K^T, DC head-dim columns at a time (the driver stages each operand in
    //    workgroup memory: whole 64 x 128 operands do not fit its 48 KiB beside qsh): the
    //    leaf's keys as the B operand (K read transposed), rows past kend zero.
    coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> s =
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator>(0.0);
#if HALVES
    // The pair's second tile of CW keys (from leaf0 + CW; the mask ends both at leaf0 + SPAN).
    coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> s2 =
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator>(0.0);
#endif
    [[unroll]] for (uint d0 = 0; d0 < HD; d0 += DC) {
        coopmat<float16_t, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseA> qa;
        LOAD_QA(qa, d0);
        coopmat<float16_t, gl_ScopeWorkgroup, DC, CW, gl_MatrixUseB> kt;
        coopMatLoadTensorNV(kt, k, kbase, sliceTensorLayoutNV(lk, leaf0, CW, d0, DC), transpose);
        s = coopMatMulAdd(qa, kt, s);
#if HALVES
        coopMatLoadTensorNV(kt, k, kbase, sliceTensorLayoutNV(lk, leaf0 + CW, CW, d0, DC),
                            transpose);
        s2 = coopMatMulAdd(qa, kt, s2);
#endif
    }

    // 4. Softmax pieces of the chunk's rows over this leaf (rows past the entries are left
    //    unmasked where `cut` is 0: their Q rows are zeros, and the merge never reads them).
#if PREFETCH_V
    coopmat<float16_t, gl_ScopeWorkgroup, CW, DC, gl_MatrixUseB> vbs[HD / DC];
    [[unroll]] for (uint j = 0; j < HD / DC; j++) {
        coopMatLoadTensorNV(vbs[j], v, kbase, sliceTensorLayoutNV(lk, leaf0, CW, j * DC, DC));
    }
#endif
    if (cut != 0u) { coopMatPerElementNV(s, s, mask, leaf0, leaf0 + SPAN); }
    coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> m, l;
    coopMatReduceNV(m, s, gl_CooperativeMatrixReduceRowNV, max_reduce);
#if HALVES
    if (cut != 0u) { coopMatPerElementNV(s2, s2, mask, leaf0 + CW, leaf0 + SPAN); }
    {
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> m2;
        coopMatReduceNV(m2, s2, gl_CooperativeMatrixReduceRowNV, max_reduce);
        coopMatPerElementNV(m, m, max2, m2);
    }
    coopMatPerElementNV(s2, s2, exp_kept, m, p.scale * 1.4426950408889634);
#endif
    coopMatPerElementNV(s, s, exp_kept, m, p.scale * 1.4426950408889634);
    coopMatReduceNV(l, s, gl_CooperativeMatrixReduceRowNV, add_reduce);
#if HALVES
    {
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> l2;
        coopMatReduceNV(l2, s2, gl_CooperativeMatrixReduceRowNV, add_reduce);
        l = l + l2;
    }
    coopmat<float16_t, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseA> pa2 =
        coopmat<float16_t, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseA>(s2);
#endif
    coopmat<float16_t, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseA> pa =
        coopmat<float16_t, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseA>(s);
#if OPART_F16
    // (1 / l taken on the RT x DC copy instead, half of the reciprocals: chunk kernel 16.34 ->
    // 17.35 ms at 64K and 65.10 -> 69.26 at 256K on the H200, 2026-12-02, docs/benchmarks.md
    // A.16; not kept.)
    coopmat<float, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseAccumulator> ld;
    {
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> linv;
        coopMatPerElementNV(linv, l, inv_or_zero);
        coopMatReduceNV(ld, linv, gl_CooperativeMatrixReduceRowNV, smear_reduce);
    }
#endif
    // m in the merge's units (natural log of the scaled scores).
    m = m * p.scale;
    coopMatPerElementNV(m, m, store_col0, 2 * cid * RT);
    coopMatPerElementNV(l, l, store_col0, 2 * cid * RT + 1);

    // 5. O_part = P V, DC columns at a time. With OPART_F16 the rows are stored divided by l
    //    (within the values' range, so f16 cannot overflow where f32 O_part would exceed it);
    //    the NVIDIA merge weights them by l.
    tensorLayoutNV<2> lo = createTensorLayoutNV(2);
    lo = setTensorLayoutDimensionNV(lo, RT, HD);
#if OPART_F16
    // qsh is overwritten by the O_part slices below: every invocation's Q loads are done.
    barrier();
#endif
    [[unroll]] for (uint d0 = 0; d0 < HD; d0 += DC) {
#if PREFETCH_V
#define vb vbs[d0 / DC]
#else
        coopmat<float16_t, gl_ScopeWorkgroup, CW, DC, gl_MatrixUseB> vb;
        coopMatLoadTensorNV(vb, v, kbase, sliceTensorLayoutNV(lk, leaf0, CW, d0, DC));
#endif
        coopmat<float, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseAccumulator> o =
            coopmat<float, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseAccumulator>(0.0);
        o = coopMatMulAdd(pa, vb, o);
#if HALVES
        {
            coopmat<float16_t, gl_ScopeWorkgroup, CW, DC, gl_MatrixUseB> vb2;
            coopMatLoadTensorNV(vb2, v, kbase, sliceTensorLayoutNV(lk, leaf0 + CW, CW, d0, DC));
            o = coopMatMulAdd(pa2, vb2, o);
        }
#endif
#undef vb
#if OPART_F16
        coopmat<float16_t, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseAccumulator> oh =
            coopmat<float16_t, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseAccumulator>(o * ld);
        coopMatStore(oh, qsh, d0 / 8, QS8, gl_CooperativeMatrixLayoutRowMajor);
#else
        coopMatStoreTensorNV(o, opart, cid * RT * HD, sliceTensorLayoutNV(lo, 0, RT, d0, DC));
#endif
    }
    barrier();
#if OPART_F16
    // The entries' rows from workgroup memory, 16 bytes per store (rows past them not stored).
    for (uint x = lid; x < n * gq * HD8; x += WG) {
        opart4[(cid * RT) * HD8 + x] = qsh[(x / HD8) * QS8 + x % HD8];
    }
#endif
    for (uint e = lid; e < n; e += WG) { spos[ent[e]] = cid * RT + e * gq + 1u; }
}
