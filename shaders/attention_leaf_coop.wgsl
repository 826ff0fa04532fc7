// Leaf-major block-sparse attention, part 2 of 3, on cooperative matrices (tensor cores), f16
// storage, f32 accumulation (PISA.md 4 and 5; host: pisa-wgpu/src/ops/attention/by_leaf.rs;
// the portable twin is attention_leaf.wgsl, same bindings and outputs). Part 1 buckets the
// selection of the range's (b, KV head)s by leaf (leaf_bucket.wgsl with ATTEND = 1); part 3
// merges (attention_leaf_merge.wgsl).
//
// One dispatch covers the queries i0 .. i0 + nq of the (b, KV head)s bh0 .. bh0 + heads (the
// Buckets uniform); a bucket is a leaf of one of them (leaf_chunk.wgsl attend_bucket). One
// workgroup of NSG subgroups per chunk: up to QPC entries (local query i - i0, selection slot
// o; list value (i - i0) * MC + o) of one bucket, RT = 16 * NSG rows (entry e, head h at row
// e * GQ + h). Per chunk, for the
// leaf's CW = 16 * CT keys (tiles clamped into the sequence: tile_start, leaf_rows_coop.wgsl):
//   0. the chunk's entries into `ent`;                             barrier
//   1. Q rows gathered into qsh;                                   barrier
//   2. Q rows to registers (HD / 16 A matrices per subgroup);       barrier
//   3. the leaf's keys staged into qsh;                            barrier
//   4. S = Q K^T -> fsh (f32);                                     barrier
//   5. SPLIT invocations per row: scale, mask (own tile's range, the leaf, t <= p_i when
//      causal), partial max;                                       barrier
//   6. row max m; P = exp(s - m) (f16, <= 1) -> psh transposed (one row per key), partial
//      sums; and the leaf's values staged transposed into qsh (one row per head-dim column;
//      the keys are dead);                                         barrier
//   7. O_part = P V on tensor cores, stored (f32) to this chunk's rows of `opart`
//      ([chunk, RT, HD]); one invocation per row writes (m, l) to `mlpart` ([chunk, RT]), one
//      per entry 1 + the index of its first row to `spos` ([heads, nq, MC]; 0, as the
//      merge leaves it after reading, for a slot without a state).
// Non-finite values: staged value rows outside the leaf are zeros, but a chunk's rows share the
// leaf's value tile, so (as in attention_coop.wgsl) a non-finite value of a key that one row
// masks causally still reaches that row through P = 0 times NaN (docs/reliability.md).
// A row whose keys are all masked has m = NEG, l = 0 and O_part = 0 (the merge skips it).
// Q, K, V: 16-byte pieces, (b, h, n, d) at (b*sb + h*sh + n*sn + d) / 8 (V with K's strides).
// P and V are staged so that they load column-major (`coopLoad`), as K does: a row-major
// (`coopLoadT`) B load of V was about 45% of the dense tile kernel on the H200 (docs/
// benchmarks.md, A.4: 2026-11-29 knock-outs).
enable wgpu_cooperative_matrix;

const GQ: u32 = 4u;    // query heads per KV head (<= RT)
const QPC: u32 = 16u;  // entries per chunk (QPC * GQ <= RT)
const MC: u32 = 16u;   // selection slots per query (top_k)
// 1: a range of several (b, KV head)s, a chunk's head decoded from its bucket (leaf_chunk.wgsl
// attend_bucket); 0: one, bl.bh0 (bucket x = leaf).
const MULTI: u32 = 0u;
const HD: u32 = 128u;  // head dim (multiple of 16, <= 128)
const CT: u32 = 4u;    // 16-key tiles per leaf: ceil(C / 16) (<= NSG)
const SG: u32 = 32u;   // subgroup size (fixed, >= 16)
const NSG: u32 = 4u;   // subgroups = 16-row tiles

const WG: u32 = NSG * SG;
const RT: u32 = NSG * 16u;
const HD16: u32 = HD / 16u;
const HD8: u32 = HD / 8u;
const CW: u32 = CT * 16u;
const QS: u32 = HD + 8u;         // Q / K / V row stride in qsh, halves
const SS: u32 = CW + 4u;         // S row stride, floats
const PS: u32 = RT + 8u;         // P^T row stride (one row per key), halves
const VS: u32 = CW + 8u;         // V^T row stride (one row per head-dim column), halves
const QSH: u32 = max(RT * QS, HD * VS); // qsh: Q rows, K rows, then V^T
const SPLIT: u32 = WG / RT;
const KPT: u32 = CW / SPLIT;
const QL: u32 = (RT * HD8 + WG - 1u) / WG;
const KL: u32 = (CW * HD8 + WG - 1u) / WG;
const NEG: f32 = -3.0e38;
const NONE: u32 = 0xffffffffu;

@group(0) @binding(1) var<storage, read> q: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<u32>>;
@group(0) @binding(12) var<storage, read_write> opart: array<f32>;
@group(0) @binding(13) var<storage, read_write> mlpart: array<vec2<f32>>;
@group(0) @binding(14) var<storage, read_write> spos: array<u32>;

var<workgroup> qsh: array<f16, QSH>;
var<workgroup> psh: array<f16, CW * PS>;
var<workgroup> fsh: array<f32, RT * SS>;
var<workgroup> red: array<f32, WG>;
var<workgroup> ent: array<u32, RT>;

// qa_get / qa_set: the Q rows' A matrices (coop_qa.wgsl, appended).

// The token of column kk of S when it is a key of the leaf inside its own tile's range, else
// NONE.
fn col_token(leaf: u32, kk: u32) -> u32 {
    let leaf0 = leaf * p.block_size;
    let lo = leaf0 + (kk / 16u) * 16u;
    let tok = tile_start(leaf, min(kk / 16u, CT - 1u)) + kk % 16u;
    let ok = kk < CW && tok >= lo && tok < lo + 16u && tok < min(leaf0 + p.block_size, p.k_len);
    return select(NONE, tok, ok);
}

// Whether staged row r holds a key of the leaf in its tile's own range.
fn row_in_leaf(leaf: u32, r: u32) -> bool {
    return col_token(leaf, r) != NONE;
}

// 16-byte piece `at` of K (see leaf_rows_coop.wgsl).
fn key_piece(at: u32) -> vec4<u32> {
    return k[at];
}

// The leaf's CW value rows, transposed into qsh ([d][key], stride VS; the keys are dead by
// then). Rows that are not keys of the leaf in their tile's own range (`row_in_leaf`: a tile
// clamped into the sequence or running past a leaf that is not a multiple of 16 keys) are
// zeros, so another leaf's values (finite or not) never enter the multiply. Keys vary fastest
// across invocations, so the transposed 2-byte stores spread over the banks; all loads are
// issued before the first store. One function, not a load returning the pieces and a store
// taking them (as leaf_rows_coop.wgsl's Q and key helpers): that split made this kernel 1.3x
// slower on the H200 (docs/benchmarks.md, A.7, 2026-11-29).
fn stage_values_t(lid: u32, leaf: u32, kbase: u32) {
    var buf: array<vec4<u32>, KL>;
    for (var j = 0u; j < KL; j++) {
        let x = lid + j * WG;
        let r = x % CW;
        var val = vec4<u32>(0u);
        if (x < CW * HD8 && row_in_leaf(leaf, r)) {
            let tok = tile_start(leaf, r / 16u) + r % 16u;
            val = v[(kbase + tok * p.k_sn) / 8u + x / CW];
        }
        buf[j] = val;
    }
    for (var j = 0u; j < KL; j++) {
        let x = lid + j * WG;
        if (x < CW * HD8) {
            let at = 8u * (x / CW) * VS + x % CW;
            let w = buf[j];
            let h0 = vec2<f16>(unpack2x16float(w.x));
            let h1 = vec2<f16>(unpack2x16float(w.y));
            let h2 = vec2<f16>(unpack2x16float(w.z));
            let h3 = vec2<f16>(unpack2x16float(w.w));
            qsh[at] = h0.x;
            qsh[at + VS] = h0.y;
            qsh[at + 2u * VS] = h1.x;
            qsh[at + 3u * VS] = h1.y;
            qsh[at + 4u * VS] = h2.x;
            qsh[at + 5u * VS] = h2.y;
            qsh[at + 6u * VS] = h3.x;
            qsh[at + 7u * VS] = h3.y;
        }
    }
}

fn score_tiles(sg: u32) {
    for (var ct = 0u; ct < CT; ct++) {
        var acc = coop_mat16x16<f32, C>();
        for (var ds = 0u; ds < HD16; ds++) {
            let at = ct * 16u * QS + ds * 16u;
            let kb = coopLoad<coop_mat16x16<f16, B>>(&qsh[at], QS);
            acc = coopMultiplyAdd(qa_get(ds), kb, acc);
        }
        let d = sg * 16u * SS + ct * 16u;
        coopStoreT(acc, &fsh[d], SS);
    }
}

// O_part of subgroup sg's rows = P V, to rows (cid * RT + 16 sg ..) of opart.
fn pv(sg: u32, cid: u32) {
    for (var dt = 0u; dt < HD16; dt++) {
        var acc = coop_mat16x16<f32, C>();
        for (var kt = 0u; kt < CT; kt++) {
            let ap = kt * 16u * PS + sg * 16u;
            let pa = coopLoad<coop_mat16x16<f16, A>>(&psh[ap], PS);
            let av = dt * 16u * VS + kt * 16u;
            let vb = coopLoad<coop_mat16x16<f16, B>>(&qsh[av], VS);
            acc = coopMultiplyAdd(pa, vb, acc);
        }
        let d = (cid * RT + sg * 16u) * HD + dt * 16u;
        coopStoreT(acc, &opart[d], HD);
    }
}

@compute @workgroup_size(WG)
fn attend_leaf(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32, @builtin(subgroup_id) sg: u32) {
    let cid = linear_id(wid, nwg);
    if (cid >= bl.items) { return; }
    let c = chunk_uniform(cid, lid);
    if (c[0] == 0u) { return; }
    var hl = vec2<u32>(0u, c[1]);
    if (MULTI == 1u) { hl = attend_bucket(c[1], 0u); }
    let bh = bl.bh0 + hl.x;
    let leaf = hl.y;
    let n = c[3];
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    load_entries(c[2], n, lid);
    workgroupBarrier();
    store_q(lid, load_q(lid, b, hkv, n));
    workgroupBarrier();
    load_rows(sg);
    workgroupBarrier();
    let kbase = b * p.k_sb + hkv * p.k_sh;
    store_keys(lid, load_keys(lid, leaf, kbase));
    workgroupBarrier();
    score_tiles(sg);
    workgroupBarrier();
    // 5. Partial max of this invocation's keys of row srow.
    let srow = lid / SPLIT;
    let scol = lid % SPLIT;
    let e = srow / GQ;
    var pos = 0xffffffffu; // p_i: keys after it are masked when causal
    if (p.causal != 0u && e < n) { pos = p.q_pos0 + bl.i0 + ent[e] / MC; }
    var m = NEG;
    for (var j = 0u; j < KPT; j++) {
        let kk = scol + j * SPLIT;
        let tok = col_token(leaf, kk);
        if (tok != NONE && tok <= pos) { m = max(m, p.scale * fsh[srow * SS + kk]); }
    }
    red[lid] = m;
    workgroupBarrier();
    var mr = NEG;
    for (var x = 0u; x < SPLIT; x++) { mr = max(mr, red[srow * SPLIT + x]); }
    var l = 0.0;
    for (var j = 0u; j < KPT; j++) {
        let kk = scol + j * SPLIT;
        let tok = col_token(leaf, kk);
        var pk = 0.0;
        let s = p.scale * fsh[srow * SS + kk];
        if (tok != NONE && tok <= pos && s > NEG) { pk = exp(s - mr); }
        l += pk;
        psh[kk * PS + srow] = f16(pk);
    }
    stage_values_t(lid, leaf, kbase);
    workgroupBarrier();
    red[lid] = l;
    pv(sg, cid);
    workgroupBarrier();
    if (scol == 0u) {
        var lr = 0.0;
        for (var x = 0u; x < SPLIT; x++) { lr += red[srow * SPLIT + x]; }
        mlpart[cid * RT + srow] = vec2<f32>(mr, lr);
    }
    if (lid < n) { spos[hl.x * bl.nq * MC + ent[lid]] = cid * RT + lid * GQ + 1u; }
}
