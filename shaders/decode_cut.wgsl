// Decode step: the top-K cut of the leaf slots (PISA.md 3.3-3.4), shared by the `merge` dispatch
// of the split step (decode_merge.wgsl) and the fused step (decode_fused.wgsl); appended to
// decode.wgsl. A candidate's score is its block LSE summed over the group, sum_h (m_h + log l_h)
// (PISA.md 2: exact leaf LSE); the forced leaves plus the best K - forced candidates (higher
// score first, then lower block; ranks compared through rank_key) are the selection. Also the
// outputs of an empty sequence (write_empty), which both write.

var<workgroup> mc: array<u32, NS>;     // the leaf slots (block index or INVALID)
var<workgroup> msc: array<f32, MAXC>;  // scores of the candidate slots
var<workgroup> mrank: array<u32, KMAX>;
var<workgroup> mtmp: array<u32, KMAX>;
var<workgroup> msel: array<u32, KMAX>; // slots of the selection, ascending block, INVALID last

// The outputs of an empty sequence (called by the whole workgroup; strided, so any GQ * DD,
// GQ and K against WG): zero output at out[qrow..], LSE -inf, no blocks (K entries of -1 at
// sel_out[so..]).
fn write_empty(qrow: u32, so: u32, lid: u32) {
    for (var i = lid; i < GQ * DD; i += WG) { out[qrow + i] = store_t(0.0); }
    for (var i = lid; i < GQ; i += WG) { lse_out[qrow / DD + i] = bitcast<f32>(0xff800000u); }
    for (var i = lid; i < KMAX; i += WG) { sel_out[so + i] = -1; }
}

// Called by the whole workgroup once mc, msc (of the valid candidate slots; an empty slot's
// score is never read) and mrank = INVALID are written and a barrier passed. Writes msel and
// the selection to sel_out[so..so + K] (ascending, -1 padded); ends with a barrier.
fn cut_top_k(so: u32, lid: u32) {
    var nf = 0u;
    for (var i = 0u; i < KMAX; i++) { nf += select(0u, 1u, mc[MAXC + i] != INVALID); }
    for (var i = lid; i < MAXC; i += WG) {
        let v = mc[i];
        if (v == INVALID) { continue; }
        let sc = rank_key(msc[i]);
        var r = 0u;
        for (var j = 0u; j < MAXC; j++) {
            let u = mc[j];
            let sj = rank_key(msc[j]);
            if (u != INVALID && (sj > sc || (sj == sc && u < v))) { r++; }
        }
        if (r + nf < KMAX) { mrank[r] = i; }
    }
    workgroupBarrier();
    // Slots of the selection: forced first, then by rank.
    for (var i = lid; i < KMAX; i += WG) {
        mtmp[i] = select(mrank[i - min(i, nf)], MAXC + i, i < nf);
    }
    workgroupBarrier();
    // Ascending block order, INVALID (-1) last.
    for (var i = lid; i < KMAX; i += WG) {
        let sv = mtmp[i];
        var v = INVALID;
        if (sv != INVALID) { v = mc[sv]; }
        var pos = 0u;
        for (var j = 0u; j < KMAX; j++) {
            let sj = mtmp[j];
            var u = INVALID;
            if (sj != INVALID) { u = mc[sj]; }
            if (v != INVALID) {
                pos += select(0u, 1u, u < v);
            } else {
                pos += select(0u, 1u, u != INVALID || j < i);
            }
        }
        msel[pos] = sv;
        sel_out[so + pos] = select(i32(v), -1, v == INVALID);
    }
    workgroupBarrier();
}
