// The selection of a call in which no query sees more than K leaves (ceil(Nk / C) <= K): every
// query keeps every leaf it sees (PISA.md 3.3, "a query that sees K or fewer leaves gets them
// all"), whatever the scores, so nothing is scored. Row r of `sel` ([B, Hkv, Nq, K] i32, rows
// in that order) is the leaves 0 ..= last of its query, ascending, then -1: last is the query's
// own leaf (q_pos0 + i) / C when causal, nb0 - 1 otherwise.
//
// One invocation a row, WG rows a workgroup; the grid may be split over y and z (pisa_core::grid_for).

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
    let row = (wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y) * WG + lid;
    if (row >= p.rows) { return; }
    let i = row % p.q_len;
    var last = p.nb0 - 1u;
    if (p.causal != 0u) { last = min(last, (p.q_pos0 + i) / p.block_size); }
    let base = row * p.top_k;
    for (var j = 0u; j < p.top_k; j++) {
        sel[base + j] = select(-1, i32(j), j <= last);
    }
}
