// Leaf-major stage 2 of PISA prefill selection, part 3 of 3 (PISA.md 3.3 and 3.4; host:
// pisa-wgpu/src/ops/leaf_select/by_leaf.rs): the final pick from the scores the leaf-major
// scorer wrote. One workgroup per (b, KV head, query); the union and the rank-based pick are
// leaf_common.wgsl's (appended), exactly as the tile kernels use them, with the ranking keys
// read from `scores` instead of computed in the workgroup.
// (Params, p, linear_id: select_common.wgsl, prepended; cand, sel: leaf_common.wgsl)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const QT: u32 = 1u;   // queries per workgroup
const MC: u32 = 34u;  // candidate slots per query
const WG: u32 = 64u;

@group(0) @binding(9) var<storage, read> scores: array<u32>;

@compute @workgroup_size(WG)
fn leaf_pick(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let i0 = (id % p.tiles) * QT;
    _ = gather_union(lid, bh, i0);
    for (var e = lid; e < QT * MC; e += WG) {
        let qi = e / MC;
        if (cl[e] != NONE && nd[qi] != 0u) {
            us[ui[e] * QT + qi] = scores[(bh * p.q_len + i0 + qi) * MC + e % MC];
        }
    }
    write_selection(lid, bh, i0);
}
