// Leaf-major stage 2 of PISA prefill selection, part 2 of 3, on cooperative matrices (tensor
// cores), f16 storage, f32 accumulation (PISA.md 2, 3.3 and 5; host:
// pisa-wgpu/src/ops/leaf_select/by_leaf.rs; the portable twin is leaf_score.wgsl, same bindings
// plus K again as 16-byte pieces at 12, same output).
//
// One workgroup of NSG subgroups per chunk: up to QPC entries of one bucket (b, KV head, leaf),
// i.e. QPC queries that list this leaf, as RT = 16 * NSG rows (entry e, head h at row
// e * GQ + h; QPC * GQ <= RT, the rest zero padding). Unlike the tile kernel
// (leaf_select_coop.wgsl), every row of a multiply belongs to a query that listed the leaf, and
// the leaf's keys are loaded once per chunk and shared by its NSG subgroups (staged in
// workgroup memory with KSTAGE = 1, the default; through the cache with KSTAGE = 0).
//   1. gather the chunk's Q rows (f16, unscaled, so exact) into qsh, every 16-byte load of an
//      invocation issued before its first store, and (KSTAGE = 1) the leaf's keys into
//      registers, issued first;                                                        barrier
//   2. subgroup sg: its 16 rows as HD / 16 A matrices, times the CT 16-key column tiles of
//      the leaf, stored (f32) to fsh. KSTAGE = 1 (the host's default where CT <= NSG): the
//      Q rows go to registers (barrier), the leaf's keys are staged into qsh (barrier) and
//      every subgroup multiplies from there; KSTAGE = 0: the key matrices are loaded
//      straight from the storage buffer;                                               barrier
//   3. SPLIT invocations per row: scale, mask, partial (max, sum of exp);             barrier
//   4. one invocation per entry: the LSE of each of its GQ rows, summed, as rank_key to the
//      entry's slot in `scores`.
// Bounds: as in leaf_select_coop.wgsl, a 16-key tile starting at token t0 is loaded from
// min(t0, Nk - 16) (the host requires Nk >= 16) and step 3 keeps a column only when its token
// lies in its own tile's range and in the leaf.
// Q: 16-byte pieces, (b, h, n, d) at (b*sb + h*sh + n*sn + d) / 8; K: f16 at
// b*sb + h*sh + n*sn + d (and 16-byte pieces, for the staging copy); D is a multiple of 16
// and the strides of 8 halves (the host checks both).
enable wgpu_cooperative_matrix;

const GQ: u32 = 4u;    // query heads per KV head (<= 16)
const QPC: u32 = 16u;  // entries per chunk (QPC * GQ <= RT)
const MC: u32 = 34u;   // candidate slots per query
const HD: u32 = 128u;  // head dim (multiple of 16, <= 128)
const CT: u32 = 4u;    // 16-key column tiles per leaf: ceil(C / 16)
const SG: u32 = 32u;   // subgroup size (fixed)

const NSG: u32 = 4u;             // subgroups per workgroup = 16-row tiles (host: 2 or 4)
const KSTAGE: u32 = 0u;          // 1: stage the leaf's keys in workgroup memory (needs CT <= NSG)
const WG: u32 = NSG * SG;        // invocations
const RT: u32 = NSG * 16u;       // rows
const HD16: u32 = HD / 16u;
const HD8: u32 = HD / 8u;        // 16-byte pieces of a row
const QL: u32 = (RT * HD8 + WG - 1u) / WG; // 16-byte Q loads per invocation
const KL: u32 = (CW * HD8 + WG - 1u) / WG; // 16-byte K loads per invocation (KSTAGE = 1)
const CW: u32 = CT * 16u;        // S columns
const QS: u32 = HD + 8u;         // Q row stride, halves (16-byte multiple)
const SS: u32 = CW + 4u;         // S row stride, floats
const SPLIT: u32 = WG / RT;      // invocations per row in step 3 (the host needs SG >= 16)
const KPT: u32 = (CW + SPLIT - 1u) / SPLIT; // keys per invocation in step 3
const NEG: f32 = -3.0e38;

// Q read 16 bytes (8 halves) at a time.
@group(0) @binding(1) var<storage, read> q: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> k: array<f16>;
// The same K buffer, read 16 bytes at a time by the staging copy (KSTAGE = 1).
@group(0) @binding(12) var<storage, read> k16: array<vec4<u32>>;

// Every workgroup variable is a multiple of 16 bytes long, so qsh and fsh start 16-byte aligned
// whatever order the driver packs them in.
var<workgroup> qsh: array<f16, RT * QS>;
var<workgroup> fsh: array<f32, RT * SS>;
var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_l: array<f32, WG>;
var<workgroup> ent: array<u32, RT>;

// qa_get / qa_set: the Q rows' A matrices (coop_qa.wgsl, appended).

// 16-byte piece `at` of K (see leaf_rows_coop.wgsl).
fn key_piece(at: u32) -> vec4<u32> {
    return k16[at];
}

// KSTAGE = 1: S = Q K^T for subgroup sg's rows, K from the staged rows.
fn score_rows_staged(sg: u32) {
    let r0 = sg * 16u;
    for (var ct = 0u; ct < CT; ct++) {
        var acc = coop_mat16x16<f32, C>();
        for (var ds = 0u; ds < HD16; ds++) {
            let at = ct * 16u * QS + ds * 16u;
            let kb = coopLoad<coop_mat16x16<f16, B>>(&qsh[at], QS);
            acc = coopMultiplyAdd(qa_get(ds), kb, acc);
        }
        let d = r0 * SS + ct * 16u;
        coopStoreT(acc, &fsh[d], SS);
    }
}

// Step 2 for subgroup sg (its own 16 rows; uniform, so in a function of its own: naga checks
// the uniformity of cooperative operations per function).
fn score_rows(sg: u32, leaf: u32, kbase: u32) {
    let r0 = sg * 16u;
    load_rows(sg);
    for (var ct = 0u; ct < CT; ct++) {
        let row0 = kbase + tile_start(leaf, ct) * p.k_sn;
        var acc = coop_mat16x16<f32, C>();
        for (var ds = 0u; ds < HD16; ds++) {
            let at = row0 + ds * 16u;
            let kb = coopLoad<coop_mat16x16<f16, B>>(&k[at], p.k_sn);
            acc = coopMultiplyAdd(qa_get(ds), kb, acc);
        }
        let d = r0 * SS + ct * 16u;
        coopStoreT(acc, &fsh[d], SS);
    }
}

@compute @workgroup_size(WG)
fn leaf_score(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32, @builtin(subgroup_id) sg: u32) {
    let cid = linear_id(wid, nwg);
    if (cid >= bl.items) { return; }
    let c = chunk_uniform(cid, lid);
    if (c[0] == 0u) { return; }
    let bh = c[1] / p.nb0;
    let leaf = c[1] % p.nb0;
    let n = c[3];
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    // 1. The chunk's Q rows (zero past its entries) and, KSTAGE = 1, the leaf's keys into
    //    registers, the key loads first: they need only the leaf, so their round trip overlaps
    //    the entries' and the Q rows' (3% faster on the H200 than loading the keys in step 2).
    let kbase = b * p.k_sb + hkv * p.k_sh;
    var kbuf: array<vec4<u32>, KL>;
    if (KSTAGE == 1u) { kbuf = load_keys(lid, leaf, kbase); }
    load_entries(c[2], n, lid);
    workgroupBarrier();
    store_q(lid, load_q(lid, b, hkv, n));
    workgroupBarrier();
    // 2. S = Q K^T on tensor cores.
    if (KSTAGE == 1u) {
        load_rows(sg);
        workgroupBarrier();
        store_keys(lid, kbuf);
        workgroupBarrier();
        score_rows_staged(sg);
    } else {
        score_rows(sg, leaf, kbase);
    }
    workgroupBarrier();
    // 3. Partial (max, sum of exp) of this invocation's keys of row srow.
    let srow = lid / SPLIT;
    let scol = lid % SPLIT;
    let leaf0 = leaf * p.block_size;
    let leaf1 = min(leaf0 + p.block_size, p.k_len);
    var s: array<f32, KPT>;
    var m = NEG;
    for (var j = 0u; j < KPT; j++) {
        let kk = scol + j * SPLIT;
        let lo = leaf0 + (kk / 16u) * 16u;
        let tok = tile_start(leaf, min(kk / 16u, CT - 1u)) + kk % 16u;
        s[j] = NEG;
        if (kk < CW && tok >= lo && tok < lo + 16u && tok < leaf1) {
            s[j] = p.scale * fsh[srow * SS + kk];
            m = max(m, s[j]);
        }
    }
    var l = 0.0;
    for (var j = 0u; j < KPT; j++) {
        if (s[j] > NEG) { l += exp(s[j] - m); }
    }
    red_m[lid] = m;
    red_l[lid] = l;
    workgroupBarrier();
    // 4. An entry's score: the row LSEs of its GQ heads, summed.
    if (lid < n) {
        var tot = 0.0;
        for (var h = 0u; h < GQ; h++) {
            let r0 = (lid * GQ + h) * SPLIT;
            var mr = NEG;
            for (var x = 0u; x < SPLIT; x++) { mr = max(mr, red_m[r0 + x]); }
            var lr = 0.0;
            for (var x = 0u; x < SPLIT; x++) { lr += red_l[r0 + x] * exp(red_m[r0 + x] - mr); }
            tot += mr + log(lr);
        }
        scores[bh * p.q_len * MC + ent[lid]] = rank_key(tot);
    }
}
