// Decode step, split step dispatch 0 (appended to decode.wgsl and decode_levels.wgsl, whose
// headers describe the design): `table`, the score table of the routing's top TL levels (`lse`
// scoring). `route` walks the levels one after the other on one workgroup per (sequence, KV
// head), and a level's row loads and dot products are most of its time (docs/benchmarks.md,
// A.6: about 2.2 us of a level's 3.5 at 1M tokens on an H200). The top levels hold few nodes
// (the start level at most g K, each level below g times more), so this dispatch computes
// q_h . mu of EVERY node of the levels s - 1 down to s - TL (the child rows of the walk's first
// TL levels) for every head h of the group, spread over TPW workgroups per (sequence, KV head),
// before `route` runs; `route` then reads its children's dots from the table for those levels.
//
// The dots are those `route` would compute, bit for bit: the same lanes (LR invocations per row,
// `dots_mean`) and the same order of the lane sums (as `child_x`), so the selection does not
// change (tests/decode_table.rs compares the two).
//
// Table: f32 [B*Hkv, TROWS, GQ], at the start of each (sequence, KV head)'s block states in
// `parts` (NS * GQ * PW floats each, at least TROWS * GQ: see ops/decode/plan.rs), which `leaf`
// overwrites only after `route` has read it. Row r: level s - 1's nodes first, then level
// s - 2's, and so on (the nodes of the current length: ceil(nb0 / g^l) at level l).

// q_h . mu of table row r, head hh, for (sequence, KV head) bh.
fn table_at(bh: u32, r: u32, hh: u32) -> f32 { return parts[bh * NS * GQ * PW + r * GQ + hh]; }

const TRW: u32 = WG / LR;                 // table rows per workgroup
const TPW: u32 = (TROWS + TRW - 1u) / TRW; // workgroups per (sequence, KV head)

@compute @workgroup_size(WG)
fn table(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    let bh = id / TPW;
    if (bh >= p.wg_count) { return; }
    let b = bh / p.kv_heads;
    let h = bh % p.kv_heads;
    load_q((b * p.q_heads + h * GQ) * DD, b, lid);
    let len = workgroupUniformLoad(&wlen);
    // This invocation's row and lane; no row where the query sees K leaves or fewer (no
    // routing), or past the table's levels.
    let r = (id % TPW) * TRW + lid / LR;
    var row = INVALID;
    if (len > 0u) {
        let bq = (len - 1u) / p.block_size;
        let nb0 = cdiv(len, p.block_size);
        var visible = nb0;
        if (p.causal != 0u) { visible = bq + 1u; }
        if (visible > KMAX) {
            let sp = start_level(nb0);
            var pc = sp.y;
            var off = 0u;
            for (var i = 0u; i < TL && i < sp.x; i++) {
                pc = pc / MG; // g^(level), the level s - 1 - i
                let n = cdiv_pw(nb0, pc);
                if (r < off + n) {
                    row = node_row(bh, sp.x - 1u - i, r - off);
                    break;
                }
                off += n;
            }
        }
    }
    var a: array<f32, GQ>;
    if (row != INVALID) { a = dots_mean(row, lid % LR); }
    for (var hh = 0u; hh < GQ; hh++) { xr[lid * GQ + hh] = a[hh]; } // [row, lane, head]
    workgroupBarrier();
    // One invocation per (row, head): the lanes summed in child_x's order.
    for (var it = lid; it < TRW * GQ; it += WG) {
        let rl = it / GQ;
        let hh = it % GQ;
        let r2 = (id % TPW) * TRW + rl;
        if (r2 < TROWS) {
            var acc = 0.0;
            for (var u = 0u; u < LR; u++) { acc += xr[(rl * LR + u) * GQ + hh]; }
            parts[bh * NS * GQ * PW + r2 * GQ + hh] = acc;
        }
    }
}
