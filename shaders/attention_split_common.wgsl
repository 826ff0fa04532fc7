// Shared by the two split-K dense attention shaders (attention_split.wgsl,
// attention_split_merge.wgsl; the host appends it to each): the parameters (field order as
// `SplitParams` in pisa-wgpu/src/ops/attention/split_k.rs) and the "no score" value.

const NEG: f32 = -3.0e38; // "no score" (finite: no reliance on infinities)

struct SplitParams {
    q_sb: u32, q_sh: u32, q_sn: u32, k_sb: u32,
    k_sh: u32, k_sn: u32, v_sb: u32, v_sh: u32,
    v_sn: u32, kv_heads: u32, q_heads: u32, group: u32,
    q_len: u32, k_len: u32, rows: u32, rblocks: u32,
    rb: u32, split_keys: u32, n_splits: u32, causal: u32,
    pair0: u32, wg_count: u32, scale_log2: f32, head_dim: u32,
}

@group(0) @binding(0) var<uniform> p: SplitParams;

// -inf as a runtime value: WGSL const-evaluates `bitcast<f32>(0xff800000u)` and Tint (Dawn,
// the browsers' WGSL compiler) refuses -inf as a constant ("value -inf cannot be represented as
// 'f32'"), where naga accepts it.
fn neg_inf_bits() -> u32 { return 0xff800000u; }
