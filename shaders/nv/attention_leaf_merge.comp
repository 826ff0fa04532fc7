#version 450
// Leaf-major block-sparse attention, part 3 of 3, for the NVIDIA chunk kernel
// (attention_leaf.comp with OPART_F16 = 1): the same merge as shaders/attention_leaf_merge.wgsl
// (one workgroup per query of the range: its selection slots' partial states, found through
// `spos`, merged per head into O and LSE), reading the partial rows as f16 O_part / l (so each
// is weighted by l exp(m - M) here, where the WGSL merge weights f32 O_part by exp(m - M)).
// Defines: MCMAX,
// GQMAX (the most slots and heads per KV head it takes), WG.
#include "common.glsl"
// wgpu bindings 0, 5, 10, 12, 13, 14, 15 as Vulkan bindings 0 to 6 (common.glsl).
#define B_PARAMS 0
#define B_BUCKETS 2
#define NO_CHUNKS 1
#include "select_common.glsl"

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 1, std430) buffer BufO { float16_t o[]; };
layout(set = 0, binding = 3, std430) readonly buffer BufOp { float16_t opart[]; };
layout(set = 0, binding = 4, std430) readonly buffer BufML { vec2 mlpart[]; };
layout(set = 0, binding = 5, std430) buffer BufSpos { uint spos[]; };
layout(set = 0, binding = 6, std430) buffer BufLse { float lse[]; };

shared uint rows[MCMAX];
shared float hm[GQMAX];
shared float hl[GQMAX];

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
            if (rows[s] != 0u) {
                vec2 ml = mlpart[rows[s] - 1u + h];
                if (ml.y > 0.0) { l += ml.y * exp(ml.x - mx); }
            }
        }
        hm[h] = mx;
        hl[h] = l;
        lse[(b * p.q_heads + hkv * gq + h) * p.q_len + i] =
            l > 0.0 ? mx + log(l) : uintBitsToFloat(0xff800000u);
    }
    barrier();
    for (uint x = lid; x < gq * p.head_dim; x += WG) {
        uint h = x / p.head_dim, d = x % p.head_dim;
        float acc = 0.0;
        for (uint s = 0; s < mc; s++) {
            if (rows[s] != 0u) {
                uint r = rows[s] - 1u + h;
                vec2 ml = mlpart[r];
                if (ml.y > 0.0) {
                    acc += float(opart[r * p.head_dim + d]) * (ml.y * exp(ml.x - hm[h]));
                }
            }
        }
        float val = hl[h] > 0.0 ? acc / hl[h] : 0.0;
        o[b * p.q_sb + (hkv * gq + h) * p.q_sh + i * p.q_sn + d] = float16_t(val);
    }
}
