// Decode step as ONE dispatch on the split step's kernels (appended to decode.wgsl,
// decode_levels.wgsl, decode_attend.wgsl, decode_route_leaf.wgsl, decode_cut.wgsl and
// decode_merge.wgsl, whose headers describe the design): `route_leaf_merge`, the workgroups of
// `route_leaf`, each routing the token and attending its NB slots; then the last copy of a
// (sequence, KV head) to finish does `merge`'s cut and merge over every copy's block states.
// The dependent `merge` dispatch and its own load of the slots are gone.
//
// "Last": each copy, once its states are written, adds 1 to the (sequence, KV head)'s counter
// in `done`; the copy that sees copies - 1 merges and sets the counter back to 0 for the next step
// (the counters start at 0: the buffer is zeroed when the cache is made). The states are
// written before the count and read after it across workgroups: storageBarrier is a control
// barrier with device-scope acquire-release semantics on storage memory (naga emits
// OpControlBarrier Workgroup Device AcquireRelease|UniformMemory), so each copy's writes are
// released before its invocation 0 counts, and the last copy's reads are acquired after its
// invocation 0 has seen every other count (the fences order the atomic, as in the
// "last block" reduction of CUDA's threadfence sample); `parts` is bound `@coherent`
// (decode_parts_coherent.wgsl) so that those loads see other workgroups' stores.

// Per (sequence, KV head): copies that have finished this step (0 between steps).
@group(0) @binding(14) var<storage, read_write> done: array<atomic<u32>>;
var<workgroup> wdone: u32;

@compute @workgroup_size(WG)
fn route_leaf_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let id0 = linear_id(wid, nwg);
    if (id0 >= p.wg_count) { return; }
    let heads = p.batch * p.kv_heads;
    let id = id0 % heads;
    let copies = p.wg_count / heads;
    let rt = route_and_attend(id0, lid);
    storageBarrier();
    if (lid == 0u) { wdone = atomicAdd(&done[id], 1u); }
    if (workgroupUniformLoad(&wdone) + 1u < copies) { return; }
    storageBarrier();
    if (lid == 0u) { atomicStore(&done[id], 0u); }
    for (var i = lid; i < NS; i += WG) { mc[i] = routed_slot(rt, i); }
    // (the length as a uniform load, not through rt: merge_slots' barriers follow a branch on it)
    merge_slots(id, workgroupUniformLoad(&wlen), lid);
}
