// The routing table of PISA prefill selection, portable kernel (PISA.md 3.2 and 5): the score of
// every node of the table levels (the start level down to `tb.lt`) for every query of the chunk
// `tb.i0 .. tb.i0 + tb.nq`, as rank keys, so that the routing kernel (route.wgsl) looks those
// levels up instead of scoring them. Host: pisa-wgpu/src/ops/route.rs. The NVIDIA kernel
// (shaders/nv/route_table.comp) writes the same table with matrix products on tensor cores;
// this one, one invocation per entry with scalar dot products, is there so that the routing's
// table path runs on every device.
//
// Output: table [B * Hkv, tb.nq, tb.tn] u32, entry t of a query's row: node j of level l, with
// t = (nodes of the levels above l, down from the start level) + j. Scores as route.wgsl's
// `score`: `lse`: sum over the GQ heads of the LSE over the node's children c of
// s q.mu_c + log n_c; `mean`: sum over the heads of s q.mu_j + log n_j (`meanvar` has no
// table). Every node of a table level is scored, causal or not: the routing reads the
// complete-past ones only.
// (store_t, Params, p and the shared helpers: select_common.wgsl; `Table`: route_chunk.wgsl;
// both prepended)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> means: array<f32>;
@group(0) @binding(3) var<storage, read_write> table: array<u32>;
@group(0) @binding(4) var<uniform> tb: Table;

// s q_h . row for query head `qh` of query i and the pyramid row starting at element `base`.
fn scaled_dot(qb: u32, base: u32) -> f32 {
    var a = 0.0;
    for (var d = 0u; d < p.head_dim; d++) { a += in_q(qb + d) * means[base + d]; }
    return p.scale * a;
}

@compute @workgroup_size(WG)
fn route_table(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let e = linear_id(wid, nwg) * WG + lid;
    if (e >= tb.items) { return; }
    let t = e % tb.tn;
    let qi = (e / tb.tn) % tb.nq;
    let bh = e / (tb.tn * tb.nq);
    let i = tb.i0 + qi;
    if (i >= p.q_len) { return; }
    // Level l and node j of entry t.
    var l = p.start_level;
    var j = t;
    while (j >= p.levels[l].y && l > tb.lt) {
        j -= p.levels[l].y;
        l--;
    }
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    let gq = p.q_heads / p.kv_heads;
    let row0 = bh * p.total_nodes;
    var total = 0.0;
    for (var h = 0u; h < gq; h++) {
        let qb = b * p.q_sb + (hkv * gq + h) * p.q_sh + i * p.q_sn;
        if (p.scoring == 0u) {
            let lc = p.levels[l - 1u];
            var m = NEG_SCORE;
            var s = 0.0;
            for (var c = j * p.merge; c < min(j * p.merge + p.merge, lc.y); c++) {
                let v = scaled_dot(qb, (row0 + lc.x + c) * p.head_dim)
                    + log(f32(node_len(c, lc.w)));
                let mn = max(m, v);
                s = s * exp(m - mn) + exp(v - mn);
                m = mn;
            }
            total += m + log(s);
        } else {
            let lv = p.levels[l];
            total += scaled_dot(qb, (row0 + lv.x + j) * p.head_dim) + log(f32(node_len(j, lv.w)));
        }
    }
    table[e] = rank_key(total);
}

const NEG_SCORE: f32 = -3.0e38;
