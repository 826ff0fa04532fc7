// Decode step, dispatch 1 of 3 (appended to decode.wgsl and decode_levels.wgsl, whose headers
// describe the design): `route`, one workgroup per (sequence, KV head), walks the intermediate
// pyramid levels of the token at position len - 1 (PISA.md 3.1-3.2, route_levels) and writes
// its NS leaf slots to `cands`.

@compute @workgroup_size(WG)
fn route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let b = id / p.kv_heads;
    let h = id % p.kv_heads;
    load_q((b * p.q_heads + h * GQ) * DD, b, lid);
    let len = workgroupUniformLoad(&wlen);
    let so = id * NS;
    if (len == 0u) {
        for (var i = lid; i < NS; i += WG) { cands[so + i] = INVALID; }
        return;
    }
    let s = route_slots(id, len, lid);
    for (var i = lid; i < NS; i += WG) { cands[so + i] = slot_at(s, i); }
}
