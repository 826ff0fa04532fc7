// The selection of a call in which no query sees more than K leaves (ceil(Nk / C) <= K): every
// query keeps every leaf it sees (PISA.md 3.3, "a query that sees K or fewer leaves gets them
// all"), whatever the scores, so nothing is scored. Row r of `sel` ([B, Hkv, Nq, K] i32, rows
// in that order) is the leaves 0 ..= last of its query, ascending, then -1: last is the query's
// own leaf (q_pos0 + i) / C when causal, nb0 - 1 otherwise.
//
// One invocation an entry (row, j), WG entries a workgroup, so that no invocation loops (a row
// of K entries in one invocation ran past llvmpipe's cap on loop iterations, 65535, for
// K > 65535 and left the rest of the row unwritten); the grid may be split over y and z
// (pisa_core::grid_for). rows * K fits u32 (the host checks).

const WG: u32 = 64u;

struct Params {
    rows: u32, q_len: u32, q_pos0: u32, block_size: u32,
    top_k: u32, nb0: u32, causal: u32, pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> sel: array<i32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y) * WG + lid;
    if (e >= p.rows * p.top_k) { return; }
    let row = e / p.top_k;
    let j = e % p.top_k;
    let i = row % p.q_len;
    var last = p.nb0 - 1u;
    if (p.causal != 0u) { last = min(last, (p.q_pos0 + i) / p.block_size); }
    sel[e] = select(-1, i32(j), j <= last);
}
