// Decode step, dispatch 3 of 3 (appended to decode.wgsl and decode_cut.wgsl, whose headers
// describe the design): `merge`, one workgroup per (sequence, KV head): the top-K cut of the
// slots by their block LSE (cut_top_k), then the selected blocks' states are merged per head
// (FlashDecoding): M = max m, L = sum l e^(m - M), O = sum O_b e^(m - M) / L, LSE = M + log L.
//
// Every load the merge needs is issued at its start, before its first barrier, so that the
// kernel waits for memory once: the length, the slots, the (m, l) of every slot per head (into
// `mst`, which both the cut's scores and the weights read; HOLD: up to 1024 of them, 8 KiB,
// else they are loaded where used) and, where each invocation owns one output element (PRE_O:
// GQ * D <= WG) and the slots are few enough for registers (NS <= 64), that element's O of
// every slot. The cut then picks the weights, and O = sum over the slots
// of weight x O_b with weight 0 for a slot outside the selection. (With the O of the selected
// blocks loaded after the cut, and their (m, l) reloaded there, the kernel waited for memory
// three times.)

const MK: u32 = min(KMAX, 32u); // K of the weighted merge (K <= 32; larger K: loops)
const PRE_O: bool = GQ * DD <= WG && NS <= 64u;
const NSO: u32 = select(1u, NS, PRE_O); // O values of every slot held per invocation (PRE_O)
const HOLD: bool = NS * GQ <= 1024u;
var<workgroup> mst: array<vec2<f32>, select(1u, NS * GQ, HOLD)>; // HOLD: (m, l) per (slot, head)
var<workgroup> mw: array<f32, GQ * MK>;        // merge weight per (head, selection entry)
var<workgroup> wsl: array<f32, GQ * NSO>;      // PRE_O: weight per (head, slot), 0 if unselected

@compute @workgroup_size(WG)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let b = id / p.kv_heads;
    let h = id % p.kv_heads;
    let qrow = (b * p.q_heads + h * GQ) * DD;
    let so = id * KMAX;
    let po = id * NS * GQ * PW;
    // The loads, all before the first barrier (an empty slot's stale state is read and never
    // used: the cut reads a score only beside a valid slot, and its weight is 0).
    if (lid == 0u) { wlen = lens[b]; }
    for (var i = lid; i < NS; i += WG) { mc[i] = cands[id * NS + i]; }
    if (HOLD) {
        for (var it = lid; it < NS * GQ; it += WG) { mst[it] = load_state(po, it); }
    }
    var os: array<f32, NSO>;
    if (PRE_O && lid < GQ * DD) {
        let hh = lid / DD;
        let d = lid % DD;
        for (var s = 0u; s < NSO; s++) { os[s] = parts[po + (s * GQ + hh) * PW + d]; }
    }
    for (var i = lid; i < KMAX; i += WG) { mrank[i] = INVALID; }
    if (PRE_O) {
        for (var i = lid; i < GQ * NSO; i += WG) { wsl[i] = 0.0; }
    }
    let len = workgroupUniformLoad(&wlen);
    if (len == 0u) {
        write_empty(qrow, so, lid); // zeros, LSE -inf, no blocks
        return;
    }
    // Scores of every candidate slot: its block LSE summed over the group.
    for (var s = lid; s < MAXC; s += WG) {
        var tot = 0.0;
        for (var hh = 0u; hh < GQ; hh++) {
            let st = slot_state(po, s * GQ + hh);
            tot += state_lse(st.x, st.y);
        }
        msc[s] = bitcast<u32>(tot);
    }
    workgroupBarrier();
    cut_top_k(so, lid);
    if (KMAX <= MK) {
        merge_weighted(po, qrow, lid, os);
        return;
    }
    // K > 32: per output element (head, dim), M = max m, L = sum l e^(m - M), O = sum O_b
    // e^(m - M) over the selected blocks, their O loaded in the loop (an empty selection
    // entry is skipped).
    for (var e = lid; e < GQ * DD; e += WG) {
        let hh = e / DD;
        let d = e % DD;
        var m = NEG;
        for (var i = 0u; i < KMAX; i++) {
            let sv = msel[i];
            if (sv != INVALID) { m = max(m, slot_state(po, sv * GQ + hh).x); }
        }
        var o = 0.0;
        var l = 0.0;
        for (var i = 0u; i < KMAX; i++) {
            let sv = msel[i];
            if (sv != INVALID) {
                let st = slot_state(po, sv * GQ + hh);
                let a = exp(st.x - m);
                o += a * parts[po + (sv * GQ + hh) * PW + d];
                l += a * st.y;
            }
        }
        out[qrow + e] = store_t(select(0.0, o / l, l > 0.0));
        if (d == 0u) {
            let lse = select(bitcast<f32>(neg_inf_bits()), m + log(l), l > 0.0);
            lse_out[qrow / DD + hh] = lse;
        }
    }
}

// The (m, l) of (slot, head) item it = slot * GQ + hh: from `parts`, or as held in `mst`.
fn load_state(po: u32, it: u32) -> vec2<f32> {
    return vec2<f32>(parts[po + it * PW + DD], parts[po + it * PW + DD + 1u]);
}
fn slot_state(po: u32, it: u32) -> vec2<f32> {
    if (HOLD) { return mst[it]; }
    return load_state(po, it);
}

// (m, l) of selection entry i for head hh ((-huge, 0) for an empty entry).
fn entry_state(po: u32, i: u32, hh: u32) -> vec2<f32> {
    let sv = msel[i];
    if (sv == INVALID) { return vec2<f32>(NEG, 0.0); }
    return slot_state(po, sv * GQ + hh);
}

// The merge for K <= 32 (after cut_top_k), in two phases: per (head, entry), from the states in
// mst: M = max m, L = sum l e^(m - M) over the head's entries, the entry's weight e^(m - M) / L
// (0 for an empty entry), LSE = M + log L | per output element (head, dim), O = sum weight x
// O_b: over every slot with the O held since the start (PRE_O), else over the K entries, their
// O loaded together (an empty entry reads the first selected block, always present, with
// weight 0).
fn merge_weighted(po: u32, qrow: u32, lid: u32, os: array<f32, NSO>) {
    for (var it = lid; it < GQ * KMAX; it += WG) {
        let hh = it / KMAX;
        let i = it % KMAX;
        var m = NEG;
        for (var j = 0u; j < KMAX; j++) { m = max(m, entry_state(po, j, hh).x); }
        var l = 0.0;
        for (var j = 0u; j < KMAX; j++) {
            let st = entry_state(po, j, hh);
            l += st.y * exp(st.x - m);
        }
        let sv = msel[i];
        let w = select(0.0, exp(entry_state(po, i, hh).x - m) / l, sv != INVALID && l > 0.0);
        if (PRE_O) {
            if (sv != INVALID) { wsl[hh * NSO + sv] = w; }
        } else {
            mw[it] = w;
        }
        if (i == 0u) {
            lse_out[qrow / DD + hh] = select(bitcast<f32>(neg_inf_bits()), m + log(l), l > 0.0);
        }
    }
    workgroupBarrier();
    if (PRE_O) {
        if (lid < GQ * DD) {
            let hh = lid / DD;
            var o = 0.0;
            for (var s = 0u; s < NSO; s++) {
                let w = wsl[hh * NSO + s];
                o += select(0.0, w * os[s], w > 0.0); // (0 x a non-finite O of another slot)
            }
            out[qrow + lid] = store_t(o);
        }
        return;
    }
    for (var e = lid; e < GQ * DD; e += WG) {
        let hh = e / DD;
        let d = e % DD;
        var ov: array<f32, MK>;
        for (var i = 0u; i < KMAX; i++) {
            ov[i] = parts[po + (select(msel[0], msel[i], msel[i] != INVALID) * GQ + hh) * PW + d];
        }
        var o = 0.0;
        for (var i = 0u; i < KMAX; i++) {
            let w = mw[hh * KMAX + i];
            o += select(0.0, w * ov[i], w > 0.0); // (0 x a non-finite O of an empty entry)
        }
        out[qrow + e] = store_t(o);
    }
}
