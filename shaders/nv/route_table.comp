#version 450
// The routing table of PISA prefill selection on NVIDIA cooperative matrices 2 (PISA.md 3.2 and
// 5): the same table as shaders/route_table.wgsl (host: pisa-wgpu/src/ops/route.rs, which runs
// this kernel where the device has VK_NV_cooperative_matrix2), the rank key of every node of
// the table levels (start level down to tb.lt) for every query of the chunk, which the routing
// kernel (route.wgsl) looks up instead of scoring those levels.
//
// One workgroup per (b, KV head, tile of RT / GQ queries): RT rows, query e's head h at row
// e * GQ + h. Per table level, the rows the level's scores need (`lse`: the nodes' children,
// one level down; `mean`: the nodes' own rows), up to the complete past of the tile's last
// query, CW rows at a time:
//   1. the rows (f32 means) split into f16 hi + f16 lo parts, lo scaled by 2^11 so that it
//      stays a normal f16 for means from about 6e-5 up to f16's largest (the residual is at
//      most half an f16 ulp, 2^-11 of the mean): hi + lo / 2^11 holds a mean to about 2^-22
//      of its size, near f32 (the queries are f16 values, held exactly);        barrier
//   2. S = Q hi^T + (Q lo^T) / 2^11 (two matrix products with f32 accumulators), to workgroup
//      memory;                                                                     barrier
//   3. one invocation per (query, node): route.wgsl's score (`lse`: per head the LSE over the
//      node's children of s q.mu_c + log n_c; `mean`: s q.mu_j + log n_j; summed over the GQ
//      heads), as its rank key, to the table.
// Defines: HD (head dim), RT (rows), CW (rows of means per product), DC (head-dim columns per
// multiply), WG (invocations).
#include "common.glsl"
// wgpu bindings 0 to 4 as Vulkan bindings 0 to 4.
#define B_PARAMS 0
#define NO_CHUNKS
#define NO_BUCKETS
#define PARAMS_LEVELS
#include "select_common.glsl"

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 1, std430) readonly buffer BufQ { uvec4 q4[]; };
layout(set = 0, binding = 2, std430) readonly buffer BufMeans { vec4 m4[]; };
layout(set = 0, binding = 3, std430) writeonly buffer BufTable { uint table[]; };
// The chunk and the table's shape (route.rs `TableParams`).
layout(set = 0, binding = 4, std140) uniform Table {
    uint i0; uint nq; uint lt; uint tn;
    uint items; uint tiles; uint pad0; uint pad1;
} tb;

const uint HD4 = HD / 4;
const uint HD8 = HD / 8;
// Rows of qsh, mhi, mlo are 16-byte words at a stride of QS8 = HD / 8 + 1 words (the word of
// padding puts consecutive rows in different banks for the matrix loads).
const uint QS8 = HD8 + 1;
const uint ML = (CW * HD4 + WG - 1) / WG; // vec4 loads of means per invocation and step
const float LO_SCALE = 2048.0;

shared uvec4 qsh[RT * QS8];
shared uvec4 mhi[CW * QS8];
shared uvec4 mlo[CW * QS8];
shared float ssh[RT * CW];

// Tokens of node j of a level with `tpn` tokens per full node (select_common.wgsl node_len).
uint node_len(const uint j, const uint tpn) {
    return min((j + 1u) * tpn, p.k_len) - j * tpn;
}

// Nodes of level l a query of the tile may list: the complete past of its last query (block
// bq_last), or every node when not causal.
uint level_nodes(const uint l, const uint bq_last) {
    const uvec4 lv = p.levels[l];
    return p.causal != 0u ? min(lv.y, bq_last / lv.z) : lv.y;
}

// Moves (l, j0) to the first step at or after it that has nodes: past a level's nodes, on to
// the next level down (toff past the level's table entries); l becomes 0 past the last table
// level (tb.lt >= 1).
void next_step(inout uint l, inout uint j0, inout uint toff, inout uint nn, const uint bq_last,
               const uint npc) {
    while (l >= tb.lt && l != 0u && j0 >= nn) {
        toff += p.levels[l].y;
        l -= 1u;
        j0 = 0u;
        nn = l >= tb.lt && l != 0u ? level_nodes(l, bq_last) : 0u;
    }
}

// The rows (f32 means) of step (l, j0), vec4 x of the step at v[(x - lid) / WG]; zeros past
// the level's rows, or everywhere when l is past the table levels.
void load_rows(out vec4 v[ML], const uint l, const uint j0, const uint gr, const uint npc,
               const uint row0, const uint lid) {
    const bool on = l >= tb.lt && l != 0u;
    const uvec4 lr = p.levels[on && p.scoring == 0u ? l - 1u : l];
    const uint r0 = j0 * gr;
    const uint nrows = on ? min(npc * gr, lr.y - r0) : 0u;
    [[unroll]] for (uint u = 0u; u < ML; u++) {
        const uint x = lid + u * WG;
        const uint r = x / HD4;
        v[u] = vec4(0.0);
        if (x < CW * HD4 && r < nrows) {
            v[u] = m4[(row0 + lr.x + r0 + r) * HD4 + x % HD4];
        }
    }
}

void main() {
    const uint wid = linear_workgroup();
    if (wid >= tb.items) { return; }
    const uint lid = gl_LocalInvocationIndex;
    const uint gq = p.q_heads / p.kv_heads;
    const uint qt = RT / gq;
    const uint bh = wid / tb.tiles, tile = wid % tb.tiles;
    const uint b = bh / p.kv_heads, hkv = bh % p.kv_heads;
    const uint q0 = tb.i0 + tile * qt;
    const uint qn = min(qt, tb.i0 + tb.nq - q0);
    const bool lse = p.scoring == 0u;
    const uint gr = lse ? p.merge : 1u;
    const uint npc = CW / gr; // nodes per step
    const uint row0 = bh * p.total_nodes;

    // Q rows (row r: query q0 + r / gq, head hkv * gq + r % gq), zeros past the tile.
    for (uint x = lid; x < RT * HD8; x += WG) {
        const uint r = x / HD8, e = r / gq;
        uvec4 w = uvec4(0u);
        if (e < qn) {
            const uint hq = hkv * gq + r % gq;
            w = q4[(b * p.q_sb + hq * p.q_sh + (q0 + e) * p.q_sn) / 8u + x % HD8];
        }
        qsh[r * QS8 + x % HD8] = w;
    }

    // Nodes a query of the tile can have as candidates: the complete past of its last query.
    // The steps of all table levels in one sequence, so that each step's rows are loaded
    // while the previous step multiplies (software pipelining across the levels too).
    const uint bq_last = (p.q_pos0 + q0 + qn - 1u) / p.block_size;
    uint l = p.start_level, j0 = 0u, toff = 0u;
    uint nn = level_nodes(l, bq_last);
    next_step(l, j0, toff, nn, bq_last, npc);
    vec4 v[ML];
    load_rows(v, l, j0, gr, npc, row0, lid);
    while (l >= tb.lt && l != 0u) {
        const uvec4 lv = p.levels[l];
        const uvec4 lr = p.levels[lse ? l - 1u : l];
        const uint r0 = j0 * gr;
        barrier();
        // 1. The rows as f16 hi and scaled lo parts.
        [[unroll]] for (uint u = 0u; u < ML; u++) {
            const uint x = lid + u * WG;
            if (x < CW * HD4) {
                const uint at = (x / HD4) * QS8 + (x % HD4) / 2u;
                const uint c = (x % 2u) * 2u;
                const f16vec4 hi = f16vec4(v[u]);
                const f16vec4 lo = f16vec4((v[u] - vec4(hi)) * LO_SCALE);
                mhi[at][c] = packFloat2x16(hi.xy);
                mhi[at][c + 1u] = packFloat2x16(hi.zw);
                mlo[at][c] = packFloat2x16(lo.xy);
                mlo[at][c + 1u] = packFloat2x16(lo.zw);
            }
        }
        barrier();
        // The next step's rows, in flight during this step's products.
        uint nl = l, nj0 = j0 + npc, ntoff = toff, nnn = nn;
        next_step(nl, nj0, ntoff, nnn, bq_last, npc);
        load_rows(v, nl, nj0, gr, npc, row0, lid);
        // 2. S = Q hi^T + (Q lo^T) / 2^11.
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> sh =
            coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator>(0.0);
        coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator> sl =
            coopmat<float, gl_ScopeWorkgroup, RT, CW, gl_MatrixUseAccumulator>(0.0);
        [[unroll]] for (uint d0 = 0u; d0 < HD; d0 += DC) {
            coopmat<float16_t, gl_ScopeWorkgroup, RT, DC, gl_MatrixUseA> qa;
            coopMatLoad(qa, qsh, d0 / 8u, QS8, gl_CooperativeMatrixLayoutRowMajor);
            coopmat<float16_t, gl_ScopeWorkgroup, DC, CW, gl_MatrixUseB> mb;
            coopMatLoad(mb, mhi, d0 / 8u, QS8, gl_CooperativeMatrixLayoutColumnMajor);
            sh = coopMatMulAdd(qa, mb, sh);
            coopMatLoad(mb, mlo, d0 / 8u, QS8, gl_CooperativeMatrixLayoutColumnMajor);
            sl = coopMatMulAdd(qa, mb, sl);
        }
        sh = sh + sl * (1.0 / LO_SCALE);
        coopMatStore(sh, ssh, 0u, CW, gl_CooperativeMatrixLayoutRowMajor);
        barrier();
        // 3. One invocation per (query, node of the step): its score, summed over the heads.
        for (uint x = lid; x < qn * npc; x += WG) {
            const uint e = x / npc, jn = x % npc, j = j0 + jn;
            if (j < nn && lse && gr == 2u) {
                // g = 2: the two children's log n_c once per node, not per head (the loop
                // below takes them for every child and head), and each head's LSE over them as
                // max + log(1 + exp(min - max)) (one exponential and one log instead of the
                // loop's four and one). The same value for finite scores. A +inf child score
                // would give +inf here where the loop gives NaN, but none reaches this step: a
                // mean past f16's range (non-finite keys) has a non-finite high part and a NaN
                // low part (step 1), so its scores are NaN on this path, ranked as -inf as the
                // loop ranks them; f16 rows of finite means cannot sum to an infinite score.
                const bool two = r0 + jn * 2u + 1u < lr.y;
                const float ln0 = log(float(node_len(j * 2u, lr.w)));
                const float ln1 = two ? log(float(node_len(j * 2u + 1u, lr.w))) : 0.0;
                float total = 0.0;
                for (uint h = 0u; h < gq; h++) {
                    const uint sr = (e * gq + h) * CW + jn * 2u;
                    const float y0 = p.scale * ssh[sr] + ln0;
                    if (two) {
                        const float y1 = p.scale * ssh[sr + 1u] + ln1;
                        const float m = max(y0, y1);
                        total += m + log(1.0 + exp(min(y0, y1) - m));
                    } else {
                        total += y0;
                    }
                }
                table[(bh * tb.nq + q0 - tb.i0 + e) * tb.tn + toff + j] = rank_key(total);
            } else if (j < nn) {
                float total = 0.0;
                for (uint h = 0u; h < gq; h++) {
                    const uint sr = (e * gq + h) * CW + jn * gr;
                    if (lse) {
                        float m = NEG;
                        float s = 0.0;
                        for (uint c = 0u; c < gr && r0 + jn * gr + c < lr.y; c++) {
                            const uint ch = j * gr + c;
                            const float y = p.scale * ssh[sr + c]
                                + log(float(node_len(ch, lr.w)));
                            const float mn = max(m, y);
                            s = s * exp(m - mn) + exp(y - mn);
                            m = mn;
                        }
                        total += m + log(s);
                    } else {
                        total += p.scale * ssh[sr] + log(float(node_len(j, lv.w)));
                    }
                }
                table[(bh * tb.nq + q0 - tb.i0 + e) * tb.tn + toff + j] = rank_key(total);
            }
        }
        l = nl;
        j0 = nj0;
        toff = ntoff;
        nn = nnn;
    }
}
