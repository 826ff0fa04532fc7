#version 450
// Leaf-major block-sparse attention, part 3 of 3, for the NVIDIA chunk kernel
// (attention_leaf.comp with OPART_F16 = 1): the same merge as shaders/attention_leaf_merge.wgsl
// (one workgroup per query of the range and (b, KV head), numbered hb * nq + i_local: its
// selection slots' partial states, found through `spos`, merged per head into O and LSE),
// reading the partial rows as f16 O_part / l (so each is weighted by l exp(m - M) here, where
// the WGSL merge weights f32 O_part by exp(m - M)).
// Every global load of a phase is issued before any of its results is used, so a workgroup's
// time is a few memory round trips, not one per slot:
//   1. the slots' rows (spos), one invocation per slot;                      barrier
//   2. each (slot, head)'s (m, l), one invocation per pair;                   barrier
//   3. per head, M = max m and L = sum l exp(m - M) from workgroup memory;    barrier
//   4. each (slot, head)'s weight l exp(m - M) / L;                           barrier
//   5. each invocation sums 8 head-dim columns of one head over the slots, loading the rows of
//      SB slots at a time unconditionally (a slot without a state loads row h, weight 0), and
//      writes them with one 16-byte store (O's strides are multiples of 8 elements: the host
//      writes O contiguous, or a caller's O whose strides it checked to be such multiples).
// (A version with one invocation per head looping over the slots, each load behind a branch,
// took 5.5 ms at 64K tokens on the H200, about twice the time its bytes take.)
// Defines: HD (head dim, a multiple of 8), MCMAX, GQMAX (the most slots and heads per KV head
// it takes), MHMAX (the most slots x heads), WG.
#include "common.glsl"
// wgpu bindings 0, 5, 10, 12, 13, 14, 15 as Vulkan bindings 0 to 6 (common.glsl).
#define B_PARAMS 0
#define B_BUCKETS 2
#define NO_CHUNKS 1
#include "select_common.glsl"

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 1, std430) buffer BufO { uvec4 o4[]; };
layout(set = 0, binding = 3, std430) readonly buffer BufOp { uvec4 opart4[]; };
layout(set = 0, binding = 4, std430) readonly buffer BufML { vec2 mlpart[]; };
layout(set = 0, binding = 5, std430) buffer BufSpos { uint spos[]; };
layout(set = 0, binding = 6, std430) buffer BufLse { float lse[]; };

const uint HD8 = HD / 8;
const uint SB = 8; // slots whose rows one invocation loads together

shared uint rows[MCMAX];
// (slot s, head h) at s * gq + h (MC x GQ <= MHMAX, which the host checks):
shared float wm[MHMAX]; // m (NEG for no state)
shared float w[MHMAX];  // l, then l exp(m - M) / L (0 for no state)
shared float hm[GQMAX];         // head h: M
shared float hinv[GQMAX];       // head h: 1 / L (0 for no state)

void main() {
    const uint il = linear_workgroup();
    if (il >= bl.heads * bl.nq) { return; }
    const uint lid = gl_LocalInvocationIndex;
    const uint i = bl.i0 + il % bl.nq, bh = bl.bh0 + il / bl.nq;
    const uint b = bh / p.kv_heads, hkv = bh % p.kv_heads;
    const uint gq = p.q_heads / p.kv_heads;
    const uint mc = p.mc;
    // 1. spos: 1 + the first row of a slot's state, 0 for a slot without one; zeroed once
    //    read, ready for the host's next range.
    for (uint s = lid; s < mc; s += WG) {
        rows[s] = spos[il * mc + s];
        spos[il * mc + s] = 0u;
    }
    barrier();
    // 2. The states (a state with l = 0 saw no key: no state).
    for (uint x = lid; x < mc * gq; x += WG) {
        const uint s = x / gq, h = x % gq;
        const uint r = rows[s];
        vec2 ml = vec2(NEG, 0.0);
        if (r != 0u) { ml = mlpart[r - 1u + h]; }
        const bool on = ml.y > 0.0;
        wm[s * gq + h] = on ? ml.x : NEG;
        w[s * gq + h] = on ? ml.y : 0.0;
    }
    barrier();
    // 3. Per head: M, L and the LSE.
    for (uint h = lid; h < gq; h += WG) {
        float mx = NEG;
        for (uint s = 0; s < mc; s++) { mx = max(mx, wm[s * gq + h]); }
        float l = 0.0;
        for (uint s = 0; s < mc; s++) {
            const float ls = w[s * gq + h];
            if (ls > 0.0) { l += ls * exp(wm[s * gq + h] - mx); }
        }
        hm[h] = mx;
        hinv[h] = l > 0.0 ? 1.0 / l : 0.0;
        lse[(b * p.q_heads + hkv * gq + h) * p.q_len + i] =
            l > 0.0 ? mx + log(l) : uintBitsToFloat(0xff800000u);
    }
    barrier();
    // 4. The weights.
    for (uint x = lid; x < mc * gq; x += WG) {
        const uint s = x / gq, h = x % gq;
        const float ls = w[s * gq + h];
        w[s * gq + h] = ls > 0.0 ? ls * exp(wm[s * gq + h] - hm[h]) * hinv[h] : 0.0;
    }
    barrier();
    // 5. O, SB slots' rows loaded at a time.
    for (uint x = lid; x < gq * HD8; x += WG) {
        const uint h = x / HD8, c = x % HD8;
        vec4 a0 = vec4(0.0), a1 = vec4(0.0);
        for (uint s0 = 0; s0 < mc; s0 += SB) {
            uvec4 u[SB];
            float ws[SB];
            [[unroll]] for (uint j = 0; j < SB; j++) {
                const uint s = s0 + j;
                ws[j] = s < mc ? w[s * gq + h] : 0.0;
                const uint r = ws[j] != 0.0 ? rows[s] - 1u : 0u;
                u[j] = opart4[(r + h) * HD8 + c];
            }
            [[unroll]] for (uint j = 0; j < SB; j++) {
                if (ws[j] != 0.0) {
                    a0 += ws[j] * vec4(vec2(unpackFloat2x16(u[j].x)), vec2(unpackFloat2x16(u[j].y)));
                    a1 += ws[j] * vec4(vec2(unpackFloat2x16(u[j].z)), vec2(unpackFloat2x16(u[j].w)));
                }
            }
        }
        o4[(b * p.o_sb + (hkv * gq + h) * p.o_sh + i * p.o_sn) / 8u + c] =
            uvec4(packFloat2x16(f16vec2(a0.xy)), packFloat2x16(f16vec2(a0.zw)),
                  packFloat2x16(f16vec2(a1.xy)), packFloat2x16(f16vec2(a1.zw)));
    }
}
