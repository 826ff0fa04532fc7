// Decode step: the top-K cut of the leaf slots (PISA.md 3.3-3.4), shared by the `merge` dispatch
// of the split step (decode_merge.wgsl) and the fused step (decode_fused.wgsl); appended to
// decode.wgsl. A candidate's score is its block LSE summed over the group, sum_h (m_h + log l_h)
// (PISA.md 2: exact leaf LSE); the forced leaves plus the best K - forced candidates (higher
// score first, then lower block; ranks compared through rank_key) are the selection. Also the
// outputs of an empty sequence (write_empty), which both write.

var<workgroup> mc: array<u32, NS>;     // the leaf slots (block index or INVALID)
var<workgroup> msc: array<u32, MAXC>;  // scores of the candidate slots (f32 bits), then keys
var<workgroup> mrank: array<u32, KMAX>;
var<workgroup> mtmp: array<u32, KMAX>;
var<workgroup> msel: array<u32, KMAX>; // slots of the selection, ascending block, INVALID last
// The rank counts: CPM invocations per candidate slot, their partial counts in mcnt.
const CPM: u32 = max(min(WG / MAXC, 8u), 1u);
const MCN: u32 = MAXC * CPM * min(CPM - 1u, 1u) + 1u; // (1 word when CPM = 1: unused)
var<workgroup> mcnt: array<u32, MCN>;         // partial rank counts [part][slot]

// The outputs of an empty sequence (called by the whole workgroup; strided, so any GQ * DD,
// GQ and K against WG): zero output at out[qrow..], LSE -inf, no blocks (K entries of -1 at
// sel_out[so..]).
fn write_empty(qrow: u32, so: u32, lid: u32) {
    for (var i = lid; i < GQ * DD; i += WG) { out[qrow + i] = store_t(0.0); }
    for (var i = lid; i < GQ; i += WG) { lse_out[qrow / DD + i] = bitcast<f32>(neg_inf_bits()); }
    for (var i = lid; i < KMAX; i += WG) { sel_out[so + i] = -1; }
}

// Called by the whole workgroup once mc, msc (of the valid candidate slots; an empty slot's
// score is never used) and mrank = INVALID are written and a barrier passed. Writes msel and
// the selection to sel_out[so..so + K] (ascending, -1 padded); ends with a barrier.
// Ranks in three phases (one invocation per slot looping over all MAXC slots cost 3.2 us more
// per merge on the H200 at 1M: docs/benchmarks.md, A.6, commit 974f137): rank keys in place of
// the scores in msc (0 for an empty slot, below every score's key) | partial counts, item
// (i, part) counting the slots j = part, part + CPM, ... ranked ahead of slot i (higher key,
// then lower block) | the sums, a kept slot of rank r (r + nf < K) written to mrank[r].
fn cut_top_k(so: u32, lid: u32) {
    var nf = 0u;
    for (var i = 0u; i < KMAX; i++) { nf += select(0u, 1u, mc[MAXC + i] != INVALID); }
    for (var i = lid; i < MAXC; i += WG) {
        msc[i] = select(0u, rank_key(bitcast<f32>(msc[i])), mc[i] != INVALID);
    }
    workgroupBarrier();
    for (var it = lid; it < MAXC * CPM; it += WG) {
        let i = it % MAXC;
        let part = it / MAXC;
        let v = mc[i];
        let sc = msc[i];
        var r = 0u;
        for (var j = part; j < MAXC; j += CPM) {
            let sj = msc[j];
            r += select(0u, 1u, sj > sc || (sj == sc && mc[j] < v));
        }
        if (CPM == 1u) {
            if (v != INVALID && r + nf < KMAX) { mrank[r] = i; }
        } else {
            mcnt[part * MAXC + i] = r;
        }
    }
    workgroupBarrier();
    if (CPM > 1u) {
        for (var i = lid; i < MAXC; i += WG) {
            if (mc[i] == INVALID) { continue; }
            var r = 0u;
            for (var part = 0u; part < CPM; part++) { r += mcnt[part * MAXC + i]; }
            if (r + nf < KMAX) { mrank[r] = i; }
        }
        workgroupBarrier();
    }
    // Slots of the selection: forced first, then by rank; with their blocks (in mcnt[0..K],
    // free now, when CPM > 1).
    for (var i = lid; i < KMAX; i += WG) {
        let sv = select(mrank[i - min(i, nf)], MAXC + i, i < nf);
        mtmp[i] = sv;
        if (CPM > 1u) { mcnt[i] = select(INVALID, mc[min(sv, NS - 1u)], sv != INVALID); }
    }
    workgroupBarrier();
    // Ascending block order, INVALID (-1) last: entry i goes to the count of entries before it
    // (a lower block; for an empty entry, every block and the empty entries j < i); counted
    // CPM ways into mcnt[K + part * K + i] when CPM > 1 (K (1 + CPM) <= MAXC CPM words: MAXC =
    // g (K + 1) >= 2K + 2 since g >= 2, which SelectionConfig::validate enforces).
    if (CPM > 1u) {
        for (var it = lid; it < KMAX * CPM; it += WG) {
            let i = it % KMAX;
            let part = it / KMAX;
            let v = mcnt[i];
            var pos = 0u;
            for (var j = part; j < KMAX; j += CPM) {
                let u = mcnt[j];
                pos += select(select(0u, 1u, u != INVALID || j < i), select(0u, 1u, u < v), v != INVALID);
            }
            mcnt[KMAX + part * KMAX + i] = pos;
        }
        workgroupBarrier();
        for (var i = lid; i < KMAX; i += WG) {
            var pos = 0u;
            for (var part = 0u; part < CPM; part++) { pos += mcnt[KMAX + part * KMAX + i]; }
            let v = mcnt[i];
            msel[pos] = mtmp[i];
            sel_out[so + pos] = select(i32(v), -1, v == INVALID);
        }
    } else {
        for (var i = lid; i < KMAX; i += WG) {
            let sv = mtmp[i];
            var v = INVALID;
            if (sv != INVALID) { v = mc[sv]; }
            var pos = 0u;
            for (var j = 0u; j < KMAX; j++) {
                let sj = mtmp[j];
                var u = INVALID;
                if (sj != INVALID) { u = mc[sj]; }
                pos += select(select(0u, 1u, u != INVALID || j < i), select(0u, 1u, u < v), v != INVALID);
            }
            msel[pos] = sv;
            sel_out[so + pos] = select(i32(v), -1, v == INVALID);
        }
    }
    workgroupBarrier();
}
