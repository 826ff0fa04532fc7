#version 450
// Leaf-major block-sparse attention, part 3 of 3, for the NVIDIA chunk kernel
// (attention_leaf.comp with OPART_F16 = 1): the same merge as shaders/attention_leaf_merge.wgsl
// (one workgroup per query of the range: its selection slots' partial states, found through
// `spos`, merged per head into O and LSE), reading the partial rows as f16 O_part / l (so each
// is weighted by l exp(m - M) here, where the WGSL merge weights f32 O_part by exp(m - M)).
// Each (slot, head) weight l exp(m - M) / L is computed once into workgroup memory; then each
// invocation sums 8 head-dim columns of one head over the slots with 16-byte loads and writes
// them with one 16-byte store (O's strides are multiples of 8 elements: the host writes O
// contiguous, or a caller's O whose strides it checked to be such multiples). Defines: HD (head dim, a multiple of 8), MCMAX,
// GQMAX (the most slots and heads per KV head it takes), WG.
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

shared uint rows[MCMAX];
shared float w[MCMAX * GQMAX]; // slot s, head h: l exp(m - M) / L, 0 for no state

void main() {
    const uint il = linear_workgroup();
    if (il >= bl.nq) { return; }
    const uint lid = gl_LocalInvocationIndex;
    const uint i = bl.i0 + il;
    const uint b = bl.bh0 / p.kv_heads, hkv = bl.bh0 % p.kv_heads;
    const uint gq = p.q_heads / p.kv_heads;
    const uint mc = p.mc;
    // spos: 1 + the first row of a slot's state, 0 for a slot without one; zeroed once read,
    // ready for the host's next range.
    for (uint s = lid; s < mc; s += WG) {
        rows[s] = spos[il * mc + s];
        spos[il * mc + s] = 0u;
    }
    barrier();
    for (uint h = lid; h < gq; h += WG) {
        float mx = NEG;
        for (uint s = 0; s < mc; s++) {
            if (rows[s] != 0u) {
                vec2 ml = mlpart[rows[s] - 1u + h];
                if (ml.y > 0.0) { mx = max(mx, ml.x); }
            }
        }
        float l = 0.0;
        for (uint s = 0; s < mc; s++) {
            float e = 0.0;
            if (rows[s] != 0u) {
                vec2 ml = mlpart[rows[s] - 1u + h];
                if (ml.y > 0.0) { e = ml.y * exp(ml.x - mx); }
            }
            w[s * GQMAX + h] = e;
            l += e;
        }
        const float inv = l > 0.0 ? 1.0 / l : 0.0;
        for (uint s = 0; s < mc; s++) { w[s * GQMAX + h] *= inv; }
        lse[(b * p.q_heads + hkv * gq + h) * p.q_len + i] =
            l > 0.0 ? mx + log(l) : uintBitsToFloat(0xff800000u);
    }
    barrier();
    for (uint x = lid; x < gq * HD8; x += WG) {
        const uint h = x / HD8, c = x % HD8;
        vec4 a0 = vec4(0.0), a1 = vec4(0.0);
        for (uint s = 0; s < mc; s++) {
            const float ws = w[s * GQMAX + h];
            if (ws != 0.0) {
                const uvec4 u = opart4[(rows[s] - 1u + h) * HD8 + c];
                a0 += ws * vec4(vec2(unpackFloat2x16(u.x)), vec2(unpackFloat2x16(u.y)));
                a1 += ws * vec4(vec2(unpackFloat2x16(u.z)), vec2(unpackFloat2x16(u.w)));
            }
        }
        o4[(b * p.o_sb + (hkv * gq + h) * p.o_sh + i * p.o_sn) / 8u + c] =
            uvec4(packFloat2x16(f16vec2(a0.xy)), packFloat2x16(f16vec2(a0.zw)),
                  packFloat2x16(f16vec2(a1.xy)), packFloat2x16(f16vec2(a1.zw)));
    }
}
