// Shared prelude of the selection shaders (route, leaf_select, bsa, oracle): prepended to each
// by its host module (`concat!`), so the parameter block and the helpers exist once.
//
// Params: strides of Q (`q_*`) and K (`k_*`) in elements, shape, selection configuration,
// grid size, and per level (node offset in the allocation, valid nodes, leaves per node, tokens
// per node). Host side: pisa-wgpu/src/ops/select/plan.rs (`SelParams`).
alias store_t = f32;

struct Params {
    q_sb: u32, q_sh: u32, q_sn: u32, k_sb: u32,
    k_sh: u32, k_sn: u32, q_heads: u32, kv_heads: u32,
    q_len: u32, k_len: u32, head_dim: u32, block_size: u32,
    merge: u32, top_k: u32, causal: u32, sink: u32,
    local: u32, nb0: u32, total_nodes: u32, start_level: u32,
    scoring: u32, tiles: u32, wg_count: u32, scale: f32,
    q_pos0: u32, mc: u32, routed: u32, pad1: u32,
    o_sb: u32, o_sh: u32, o_sn: u32, pad2: u32,
    levels: array<vec4<u32>, 64>,
}

@group(0) @binding(0) var<uniform> p: Params;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}

// Ranking key of a score (PISA.md 3.4): an order-preserving map of f32 onto u32, compared as
// integers so that the top-K is a strict total order whatever the scores: every NaN ranks as
// -inf (it never wins, and never makes two candidates share a rank), -0 as +0. (WGSL float
// compares may assume no NaN, and NaN compares false both ways, which broke the rank count.)
fn rank_key(s: f32) -> u32 {
    var b = bitcast<u32>(s);
    if ((b & 0x7fffffffu) > 0x7f800000u) { b = 0xff800000u; }
    if (b == 0x80000000u) { b = 0u; }
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// Tokens of node j of a level with `tpn` tokens per full node.
fn node_len(j: u32, tpn: u32) -> u32 {
    return min((j + 1u) * tpn, p.k_len) - j * tpn;
}

// Forced leaves of own block bq (PISA.md 3.3): 0..sink_end, then local_start..=bq.
fn local_start(bq: u32) -> u32 { return bq - min(p.local, bq); }
fn sink_end(bq: u32) -> u32 { return min(p.sink, local_start(bq)); }
fn n_forced(bq: u32) -> u32 { return sink_end(bq) + bq + 1u - local_start(bq); }
fn is_forced(bq: u32, j: u32) -> bool {
    return j <= bq && (j < p.sink || j + p.local >= bq);
}
// Forced leaves below leaf x.
fn forced_below(bq: u32, x: u32) -> u32 {
    let ls = local_start(bq);
    var n = min(x, sink_end(bq));
    if (x > ls) { n += min(x, bq + 1u) - ls; }
    return n;
}
// Leaves a query of own block bq sees.
fn visible(bq: u32) -> u32 {
    if (p.causal != 0u) { return bq + 1u; }
    return p.nb0;
}
