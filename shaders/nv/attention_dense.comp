#version 450
// Dense attention (the baseline of PISA.md 4, and the short-sequence path) on NVIDIA cooperative
// matrices 2: FlashAttention-2's forward pass with workgroup-scope matrices (host:
// pisa-wgpu/src/ops/attention/nv_dense.rs). One workgroup per BR consecutive queries (a tile)
// of one query head (b, hq; its KV head hq / (Hq / Hkv)), the tiles split .. of every head
// before the tiles 0 .. split - 1 (`split` below); per key block of BC keys up to the tile's last
// visible key:
//   S = Q K^T (DC head-dim columns per multiply; Q's matrices loaded once), masked (t < Nk,
//   and t <= p_i when causal; only blocks that reach past a row's bound call the mask),
//   m' = max(m, rowmax S), P = exp(s (S - m')), l = exp(s (m - m')) l + rowsum P,
//   O = exp(s (m - m')) O + P V (f32 accumulators, P as f16). The softmax scale s is folded into
//   Q itself when it is loaded (below): S and m are then in log2 units, each exponential is
//   exp2(x - y), and an unmasked block makes no scaling pass.
// Then O / l (f16) to O (at Q's strides, or at O's own with OSTRIDES) and s m + log l to LSE [B, Hq, Nq]. Every stored row sees at
// least key 0 (Nk >= Nq >= 1, and query i sees keys up to Nk - Nq + i). Rows past Nq are computed
// on zero queries and never stored (the tensor layouts end at Nq). Defines: HD, BR, BC, DC, WG, MW
// (below), OSTRIDES (1: O at its own strides, o_s*; 0 or absent: at Q's). Two builds rather than
// one: with O's own tensor layout the key loop ran 0.9% slower at 64K on the H200 and the H100
// (docs/benchmarks.md A.54), wherever in the shader the layout was made.
#include "common.glsl"
#ifndef OSTRIDES
#define OSTRIDES 0
#endif

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std140) uniform Params {
    uint q_sb; uint q_sh; uint q_sn; uint k_sb;
    uint k_sh; uint k_sn; uint v_sb; uint v_sh;
    uint v_sn; uint q_heads; uint kv_heads; uint q_len;
    uint k_len; uint q_pos0; uint causal; float scale;
    uint tiles; uint split; uint o_sb; uint o_sh;
    uint o_sn; uint pad1; uint pad2; uint pad3;
} p;
layout(set = 0, binding = 1, std430) readonly buffer BufQ { float16_t q[]; };
layout(set = 0, binding = 2, std430) readonly buffer BufK { float16_t k[]; };
layout(set = 0, binding = 3, std430) readonly buffer BufV { float16_t v[]; };
layout(set = 0, binding = 4, std430) buffer BufO { float16_t o[]; };
layout(set = 0, binding = 5, std430) buffer BufLse { float lse[]; };

const float NEG = -3.0e38;
const uint NDC = HD / DC;
// Columns of the row-state matrices m and l (each column a copy of the row's value): BC (the
// default), or fewer, so that exp(s (m - m')) is taken MW times per row instead of BC, at the
// cost of broadcasting m' back to BR x BC for P.
#ifndef MW
#define MW BC
#endif
// Q's matrices are scaled by k = s log2 e once, when loaded (in f32, then rounded to f16 as
// they were), so that S, m and P's exponent are in log2 units and each element's exponential
// is exp2(x - y), one multiply fewer per score than exp2((x - y) k); LSE = m ln 2 + log l. The
// rounding of k q to f16 is of the order of Q's own f16 storage (relative 2^-11 per element).
// Measured on the H200 (docs/benchmarks.md A.17, commit e36c73e): 173.6 -> 170.3 ms at 64K,
// causal, D 128.

// Mask to t < Nk and (causal) t <= p_i: row r of the tile is query i0 + r.
float mask(const in uint r, const in uint c, const in float s, const in uint j0,
           const in uint i0) {
    uint t = j0 + c;
    bool ok = t < p.k_len && (p.causal == 0u || t <= p.q_pos0 + i0 + r);
    return ok ? s : NEG;
}
// exp(s (x - y)) of unscaled scores, as exp2(x - y) of the scores of Q scaled by s log2 e: 0
// for a masked x (NEG), as every row's running max is a visible score's. (`k`, the callers'
// s log2 e, is not used: the scale is in Q.)
float exp_scaled(const in uint r, const in uint c, const in float x, const in float y,
                 const in float k) {
    return exp2(x - y);
}
float max_elem(const in uint r, const in uint c, const in float x, const in float y) {
    return max(x, y);
}
float log_elem(const in uint r, const in uint c, const in float x) { return log(x); }
float max_reduce(const in float a, const in float b) { return max(a, b); }
float add_reduce(const in float a, const in float b) { return a + b; }
float smear_reduce(const in float a, const in float b) { return a; }
float store_lse(const in uint r, const in uint c, const in float x, const in uint at,
                const in uint rows) {
    if (c == 0 && r < rows) { lse[at + r] = x; }
    return x;
}

// P = exp2(S - m') per element, m' broadcast from MW columns to BC where MW < BC.
#if MW == BC
#define EXP_P(pr, s, mnew) coopMatPerElementNV(pr, s, exp_scaled, mnew, k2)
#else
#define EXP_P(pr, s, mnew)                                                                  \
    {                                                                                       \
        coopmat<float, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseAccumulator> mb;              \
        coopMatReduceNV(mb, mnew, gl_CooperativeMatrixReduceRowNV, smear_reduce);           \
        coopMatPerElementNV(pr, s, exp_scaled, mb, k2);                                     \
    }
#endif
// One block of BC keys from j0 (inside a key loop, with m, l, acc, qa, bound0, i0, k2 in
// scope), its keys and values read through the tensor layouts LK, LV at element offsets KB, VB
// (a macro: the matrices stay in the caller's scope, and main's two key loops share it).
#define KEY_BLOCK(LK, KB, LV, VB)                                                               \
    coopmat<float, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseAccumulator> s =                      \
        coopmat<float, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseAccumulator>(0.0);                \
    [[unroll]] for (uint c = 0; c < NDC; c++) {                                                 \
        coopmat<float16_t, gl_ScopeWorkgroup, DC, BC, gl_MatrixUseB> kt;                        \
        coopMatLoadTensorNV(kt, k, KB, sliceTensorLayoutNV(LK, j0, BC, c * DC, DC),             \
                            transpose);                                                         \
        s = coopMatMulAdd(qa[c], kt, s);                                                        \
    }                                                                                           \
    if (j0 + BC > bound0) {                                                                     \
        coopMatPerElementNV(s, s, mask, j0, i0);                                                \
    }                                                                                           \
    coopmat<float, gl_ScopeWorkgroup, BR, MW, gl_MatrixUseAccumulator> rowmax, mnew, em,        \
        rowsum;                                                                                 \
    coopmat<float, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseAccumulator> pr;                      \
    coopMatReduceNV(rowmax, s, gl_CooperativeMatrixReduceRowNV, max_reduce);                    \
    coopMatPerElementNV(mnew, rowmax, max_elem, m);                                             \
    EXP_P(pr, s, mnew);                                                                         \
    coopMatPerElementNV(em, m, exp_scaled, mnew, k2);                                           \
    coopMatReduceNV(rowsum, pr, gl_CooperativeMatrixReduceRowNV, add_reduce);                   \
    l = em * l + rowsum;                                                                        \
    m = mnew;                                                                                   \
    coopmat<float16_t, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseA> pa =                           \
        coopmat<float16_t, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseA>(pr);                       \
    coopmat<float, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator> emd;                     \
    coopMatReduceNV(emd, em, gl_CooperativeMatrixReduceRowNV, smear_reduce);                    \
    [[unroll]] for (uint c = 0; c < NDC; c++) {                                                 \
        coopmat<float16_t, gl_ScopeWorkgroup, BC, DC, gl_MatrixUseB> vb;                        \
        coopMatLoadTensorNV(vb, v, VB, sliceTensorLayoutNV(LV, j0, BC, c * DC, DC));            \
        acc[c] = acc[c] * emd;                                                                  \
        acc[c] = coopMatMulAdd(pa, vb, acc[c]);                                                 \
    }

void main() {
    const uint wid = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x
        + gl_WorkGroupID.z * gl_NumWorkGroups.x * gl_NumWorkGroups.y;
    if (wid >= p.tiles) { return; }
    const uint ntiles = (p.q_len + BR - 1) / BR;
    // Causal tiles grow with their index. Workgroups first take the heavier tiles split ..
    // ntiles - 1 of every head, then the lighter tiles 0 .. split - 1, so that the last
    // workgroups to start are light ones; within each part, a head's tiles are consecutive
    // workgroups (neighbours read the same keys and values at the same time, from L2).
    const uint split = min(p.split, ntiles - 1u);
    const uint heavy = (p.tiles / ntiles) * (ntiles - split);
    const uint tile = wid < heavy ? split + wid % (ntiles - split) : (wid - heavy) % split;
    const uint bh = wid < heavy ? wid / (ntiles - split) : (wid - heavy) / split; // b * Hq + hq
    const uint b = bh / p.q_heads, hq = bh % p.q_heads;
    const uint hkv = hq / (p.q_heads / p.kv_heads);
    const uint i0 = tile * BR;

    tensorLayoutNV<2, CLAMP> lq = createTensorLayoutNV(2, CLAMP);
    lq = setTensorLayoutDimensionNV(lq, p.q_len, HD);
    lq = setTensorLayoutStrideNV(lq, p.q_sn, 1);
    tensorLayoutNV<2, CLAMP> lk = createTensorLayoutNV(2, CLAMP);
    lk = setTensorLayoutDimensionNV(lk, p.k_len, HD);
    lk = setTensorLayoutStrideNV(lk, p.k_sn, 1);
    tensorLayoutNV<2, CLAMP> lv = createTensorLayoutNV(2, CLAMP);
    lv = setTensorLayoutDimensionNV(lv, p.k_len, HD);
    lv = setTensorLayoutStrideNV(lv, p.v_sn, 1);
    tensorViewNV<2, false, 1, 0> transpose = createTensorViewNV(2, false, 1, 0);
    const uint qbase = b * p.q_sb + hq * p.q_sh;
    const uint kbase = b * p.k_sb + hkv * p.k_sh;
    const uint vbase = b * p.v_sb + hkv * p.v_sh;

    coopmat<float16_t, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseA> qa[NDC];
    coopmat<float, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator> acc[NDC];
    [[unroll]] for (uint c = 0; c < NDC; c++) {
        coopmat<float16_t, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator> qh;
        coopMatLoadTensorNV(qh, q, qbase, sliceTensorLayoutNV(lq, i0, BR, c * DC, DC));
        coopmat<float, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator> qf =
            coopmat<float, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator>(qh);
        qf = qf * (p.scale * 1.4426950408889634);
        qa[c] = coopmat<float16_t, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseA>(qf);
        acc[c] = coopmat<float, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator>(0.0);
    }
    // (m, l) per row, MW copies of each (MW = BC: every column; see MW above).
    coopmat<float, gl_ScopeWorkgroup, BR, MW, gl_MatrixUseAccumulator> m =
        coopmat<float, gl_ScopeWorkgroup, BR, MW, gl_MatrixUseAccumulator>(NEG);
    coopmat<float, gl_ScopeWorkgroup, BR, MW, gl_MatrixUseAccumulator> l =
        coopmat<float, gl_ScopeWorkgroup, BR, MW, gl_MatrixUseAccumulator>(0.0);

    // Keys up to the tile's last visible one; a block that ends past `bound0` (the first row's
    // bound, or Nk) needs the mask.
    const uint last_row = min(i0 + BR, p.q_len);
    const uint kend = p.causal != 0u ? min(p.k_len, p.q_pos0 + last_row) : p.k_len;
    const uint bound0 = p.causal != 0u ? min(p.k_len, p.q_pos0 + i0 + 1u) : p.k_len;
    const float k2 = p.scale * 1.4426950408889634;
    // Blocks wholly inside the keys go through tensor layouts without clamping whose strides and
    // offsets the compiler sees as multiples of 8 elements (16 bytes), as the host's choice of
    // this kernel ensures they are (nv_dense.rs kernel_of); the rest (a last partial block)
    // through the clamped layouts. On the H100 (2026-12-06, docs/benchmarks.md A.62), causal
    // 64K, D 128, BC 64: 168.4 ms with clamped loads only, 140.4 with this; and as single
    // loops, 153.7 with the aligned unclamped loads alone (wrong past the keys), 884 with
    // unclamped loads whose alignment the compiler does not know, 171.1 with clamped aligned
    // ones, 236.0 choosing between the two loads per block: hence two loops sharing KEY_BLOCK.
    const bool aligned = ((kbase | vbase | p.k_sn | p.v_sn) & 7u) == 0u; // (nv_dense.rs: always)
    tensorLayoutNV<2> lka = createTensorLayoutNV(2);
    lka = setTensorLayoutDimensionNV(lka, p.k_len, HD);
    lka = setTensorLayoutStrideNV(lka, p.k_sn & ~7u, 1);
    tensorLayoutNV<2> lva = createTensorLayoutNV(2);
    lva = setTensorLayoutDimensionNV(lva, p.k_len, HD);
    lva = setTensorLayoutStrideNV(lva, p.v_sn & ~7u, 1);
    const uint kfull = aligned ? min(kend, p.k_len - p.k_len % BC) : 0u;
    uint j0 = 0;
    [[dont_unroll]]
    for (; j0 < kfull; j0 += BC) {
        KEY_BLOCK(lka, kbase & ~7u, lva, vbase & ~7u)
    }
    [[dont_unroll]]
    for (; j0 < kend; j0 += BC) {
        KEY_BLOCK(lk, kbase, lv, vbase)
    }

    // O = acc / l at O's strides (rows past Nq fall outside the layout and are not stored);
    // LSE = m + log l.
#if OSTRIDES
    tensorLayoutNV<2, CLAMP> lo = createTensorLayoutNV(2, CLAMP);
    lo = setTensorLayoutDimensionNV(lo, p.q_len, HD);
    lo = setTensorLayoutStrideNV(lo, p.o_sn, 1);
    const uint obase = b * p.o_sb + hq * p.o_sh;
#else
    const uint obase = qbase;
#define lo lq
#endif
    coopmat<float, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator> ld;
    coopMatReduceNV(ld, l, gl_CooperativeMatrixReduceRowNV, smear_reduce);
    [[unroll]] for (uint c = 0; c < NDC; c++) {
        coopmat<float16_t, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator> oh =
            coopmat<float16_t, gl_ScopeWorkgroup, BR, DC, gl_MatrixUseAccumulator>(acc[c] / ld);
        coopMatStoreTensorNV(oh, o, obase, sliceTensorLayoutNV(lo, i0, BR, c * DC, DC));
    }
    coopmat<float, gl_ScopeWorkgroup, BR, MW, gl_MatrixUseAccumulator> lg;
    coopMatPerElementNV(lg, l, log_elem);
    lg = m * 0.6931471805599453 + lg; // m in log2 units
    coopMatPerElementNV(lg, lg, store_lse, bh * p.q_len + i0, last_row - i0);
}
