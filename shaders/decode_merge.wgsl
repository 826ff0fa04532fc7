// Decode step, dispatch 3 of 3 (appended to decode.wgsl and decode_cut.wgsl, whose headers
// describe the design): `merge`, one workgroup per (sequence, KV head): the top-K cut of the
// slots by their block LSE (cut_top_k), then the selected blocks' states are merged per head
// (FlashDecoding): M = max m, L = sum l e^(m - M), O = sum O_b e^(m - M) / L, LSE = M + log L.

const MK: u32 = min(KMAX, 32u); // K of the weighted merge (K <= 32; larger K: loops)
var<workgroup> mml: array<vec2<f32>, GQ * MK>; // (m, l) per (head, selection entry), K <= 32
var<workgroup> mw: array<f32, GQ * MK>;        // merge weight per (head, selection entry)

@compute @workgroup_size(WG)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    if (lid == 0u) { wlen = lens[id / p.kv_heads]; }
    let len = workgroupUniformLoad(&wlen);
    for (var i = lid; i < NS; i += WG) { mc[i] = cands[id * NS + i]; }
    merge_slots(id, len, lid);
}

// The cut and the merge of (sequence, KV head) `id` whose length is `len`, by the whole
// workgroup, once each invocation has written its share of the slots into `mc` (i = lid, lid +
// WG, ...; the barrier before the cut orders them) and the slots' states are in `parts`: the
// `merge` dispatch, or the last workgroup of `route_leaf_merge` (decode_route_leaf_merge.wgsl).
fn merge_slots(id: u32, len: u32, lid: u32) {
    let b = id / p.kv_heads;
    let h = id % p.kv_heads;
    let qrow = (b * p.q_heads + h * GQ) * DD;
    let so = id * KMAX;
    if (len == 0u) {
        write_empty(qrow, so, lid); // zeros, LSE -inf, no blocks
        return;
    }
    let po = id * NS * GQ * PW;
    for (var i = lid; i < KMAX; i += WG) { mrank[i] = INVALID; }
    // Scores of every candidate slot, loaded together with the slots (an empty slot's stale
    // state is never ranked: the cut reads a score only beside a valid slot).
    for (var s = lid; s < MAXC; s += WG) {
        var tot = 0.0;
        for (var hh = 0u; hh < GQ; hh++) {
            let w = po + (s * GQ + hh) * PW;
            tot += state_lse(parts[w + DD], parts[w + DD + 1u]);
        }
        msc[s] = bitcast<u32>(tot);
    }
    workgroupBarrier();
    cut_top_k(so, lid);
    if (KMAX <= MK) {
        merge_weighted(po, qrow, lid);
        return;
    }
    // K > 32: per output element (head, dim), M = max m, L = sum l e^(m - M), O = sum O_b
    // e^(m - M) over the selected blocks, their states loaded in the loops (an empty selection
    // entry is skipped).
    for (var e = lid; e < GQ * DD; e += WG) {
        let hh = e / DD;
        let d = e % DD;
        var m = NEG;
        for (var i = 0u; i < KMAX; i++) {
            let sv = msel[i];
            if (sv != INVALID) { m = max(m, parts[po + (sv * GQ + hh) * PW + DD]); }
        }
        var o = 0.0;
        var l = 0.0;
        for (var i = 0u; i < KMAX; i++) {
            let sv = msel[i];
            if (sv != INVALID) {
                let w = po + (sv * GQ + hh) * PW;
                let a = exp(parts[w + DD] - m);
                o += a * parts[w + d];
                l += a * parts[w + DD + 1u];
            }
        }
        out[qrow + e] = store_t(select(0.0, o / l, l > 0.0));
        if (d == 0u) {
            let lse = select(bitcast<f32>(neg_inf_bits()), m + log(l), l > 0.0);
            lse_out[qrow / DD + hh] = lse;
        }
    }
}

// The merge for K <= 32 (after cut_top_k), in three phases: the (m, l) of each selected block
// per head, loaded once into mml | per (head, entry): M = max m, L = sum l e^(m - M) over the
// head's entries, the entry's weight e^(m - M) / L into mw (0 for an empty entry), LSE = M +
// log L | per output element (head, dim): its K values of O loaded together (an empty entry
// reads the first selected block, always present, with weight 0), O = sum weight x O_b.
// (Each output element loaded its own K copies of (m, l) before: 3K loads per invocation
// instead of K, 0.3 us slower per merge and 0.9 us per isolated step on the H200 at 1M:
// docs/benchmarks.md, A.6, commit 1e2830d. Keeping every slot's (m, l) in workgroup memory from
// the scores' load instead, read per entry through msel in the weights' loops, made the merge
// 1.1 us slower on the H100, and its NS g_q pairs took route_leaf_merge past 48 KiB at the
// bench's shape: A.82, commit fa0a896.)
fn merge_weighted(po: u32, qrow: u32, lid: u32) {
    for (var it = lid; it < GQ * KMAX; it += WG) {
        let sv = msel[it % KMAX];
        var st = vec2<f32>(NEG, 0.0);
        if (sv != INVALID) {
            let w = po + (sv * GQ + it / KMAX) * PW;
            st = vec2<f32>(parts[w + DD], parts[w + DD + 1u]);
        }
        mml[it] = st;
    }
    workgroupBarrier();
    for (var it = lid; it < GQ * KMAX; it += WG) {
        let hh = it / KMAX;
        let i = it % KMAX;
        var m = NEG;
        for (var j = 0u; j < KMAX; j++) { m = max(m, mml[hh * KMAX + j].x); }
        var l = 0.0;
        for (var j = 0u; j < KMAX; j++) {
            let st = mml[hh * KMAX + j];
            l += st.y * exp(st.x - m);
        }
        mw[it] = select(0.0, exp(mml[it].x - m) / l, msel[i] != INVALID && l > 0.0);
        if (i == 0u) {
            lse_out[qrow / DD + hh] = select(bitcast<f32>(neg_inf_bits()), m + log(l), l > 0.0);
        }
    }
    workgroupBarrier();
    for (var e = lid; e < GQ * DD; e += WG) {
        let hh = e / DD;
        let d = e % DD;
        var os: array<f32, MK>;
        for (var i = 0u; i < KMAX; i++) {
            os[i] = parts[po + (select(msel[0], msel[i], msel[i] != INVALID) * GQ + hh) * PW + d];
        }
        var o = 0.0;
        for (var i = 0u; i < KMAX; i++) {
            let w = mw[hh * KMAX + i];
            o += select(0.0, w * os[i], w > 0.0); // (0 x a non-finite O of an empty entry)
        }
        out[qrow + e] = store_t(o);
    }
}
