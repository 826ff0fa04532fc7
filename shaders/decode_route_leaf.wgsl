// Decode step, dispatches 1 and 2 of the split step as one (appended to decode.wgsl,
// decode_levels.wgsl and decode_attend.wgsl, whose headers describe the design):
// `route_leaf`, PF workgroups per (sequence, KV head). Each routes the token the same way
// (route_levels: the route's time is the chain of its levels, so copies on otherwise idle SMs
// cost none, docs/benchmarks.md A.26), then attends NB of the leaf slots at once, AW
// invocations each (copy r: slots r NB .. r NB + NB - 1), writing their states to `parts` as
// `leaf` does; the first copy writes the slots to `cands` for `merge`. The step is then two
// dependent dispatches instead of three, and the slots' blocks are attended without reading
// the slots, the length and the query again. (`route_leaf_merge`,
// decode_route_leaf_merge.wgsl, also merges in the last copy to finish: one dispatch.)

// What a copy routed: its slots (slot_at) and the sequence's length.
struct Routed { s: Slots, len: u32 }

// Copy id0 / (B Hkv) of (sequence, KV head) id0 % (B Hkv): routes the token and attends its NB
// slots (the whole workgroup; every invocation returns the same).
fn route_and_attend(id0: u32, lid: u32) -> Routed {
    let heads = p.batch * p.kv_heads;
    let id = id0 % heads;
    let r = id0 / heads;
    let b = id / p.kv_heads;
    let h = id % p.kv_heads;
    load_q((b * p.q_heads + h * GQ) * DD, b, lid);
    let len = workgroupUniformLoad(&wlen);
    var s: Slots;
    if (len > 0u) { s = route_slots(id, len, lid); }
    let ib = lid / AW;
    let slot = min(r * NB + ib, NS - 1u);
    var leaf = INVALID;
    if (len > 0u && ib < NB && r * NB + ib < NS) { leaf = slot_at(s, slot); }
    var t0 = 0u;
    var n = 0u;
    if (leaf != INVALID) {
        t0 = leaf * p.block_size;
        n = min(p.block_size, len - t0);
    }
    attend_block(id, t0, n, p.block_size, (id * NS + slot) * GQ * PW, lid % AW, ib);
    return Routed(s, len);
}

// Slot i of what a copy routed (INVALID for an empty sequence).
fn routed_slot(rt: Routed, i: u32) -> u32 {
    if (rt.len == 0u) { return INVALID; }
    return slot_at(rt.s, i);
}

@compute @workgroup_size(WG)
fn route_leaf(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let id0 = linear_id(wid, nwg);
    if (id0 >= p.wg_count) { return; }
    let heads = p.batch * p.kv_heads;
    let rt = route_and_attend(id0, lid);
    if (id0 < heads) {
        for (var i = lid; i < NS; i += WG) { cands[id0 * NS + i] = routed_slot(rt, i); }
    }
}
