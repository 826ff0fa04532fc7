// Stage 2 of PISA prefill selection on cooperative matrices (tensor cores), f16 storage, f32
// accumulation (PISA.md sections 2, 3.3, 3.4 and 5). Host: pisa-wgpu/src/ops/leaf_select/coop.rs;
// the portable twin is leaf_select.wgsl (same bindings, same Params, same output). The union of
// the tile's candidates and the final pick are leaf_common.wgsl's (appended).
//
// f16 only (the host prepends `enable f16;`); needs SUBGROUP and a fixed subgroup size SG.
// One workgroup of NSG subgroups per (b, KV head, tile of QT consecutive queries); its RT = 16
// rows are the tile's (query, head) pairs, row r = query r / GQ, head r % GQ (QT * GQ <= 16;
// rows past that are zero padding). The raw Q rows (f16, unscaled, so exact) sit in registers as
// HD / 16 A matrices in every subgroup. The union leaves are taken LPI at a time:
//   1. S = Q K^T on tensor cores: the LPI leaves have LPI * CT 16-key column tiles; subgroup sg
//      computes tiles sg, sg + NSG, ... loading K straight from the storage buffer (each key
//      is used by exactly one multiply of the workgroup, so staging it through workgroup
//      memory would buy no reuse), and stores them (f32) to fsh;                  barrier
//   2. SPLIT invocations per row: scale (s = scale * q.k, f32), mask, and a partial (max, sum
//      of exp) per leaf over its keys;                                            barrier
//   3. one invocation per (leaf, query): merge the row partials into the LSE of each of the
//      query's GQ heads and write their sum as the leaf's ranking key us[u * QT + qi].
// Step 1 of the next leaves writes fsh, last read in step 2, and step 2 writes red_*, last read
// in step 3 of the leaves before, each across a barrier: two barriers per LPI leaves.
//
// Bounds: a 16-key tile starting at token t0 is loaded from min(t0, Nk - 16) (the host requires
// Nk >= 16), so a matrix load never reads past token Nk - 1 of its head, hence never past the
// buffer; step 2 maps each column back to its token and drops those outside the tile's own
// range (a clamped tile holds its own keys in its last columns), so no key is counted twice,
// missed, or counted out of its leaf.
// Q: vec4<f16>, (b, h, n, d) at (b*sb + h*sh + n*sn + d) / 4; K: f16 at b*sb + h*sh + n*sn + d
// (D and the strides are multiples of 16, so every matrix row is 32-byte aligned).
enable wgpu_cooperative_matrix;

const GQ: u32 = 4u;      // query heads per KV head (<= 16)
const QT: u32 = 4u;      // queries per workgroup (QT * GQ <= 16)
const MC: u32 = 34u;     // candidate slots per query (g * (K + 1))
const HD: u32 = 128u;    // head dim (multiple of 16, <= 128)
const CT: u32 = 4u;      // 16-key column tiles per leaf: ceil(C / 16)
const LPI: u32 = 2u;     // leaves per iteration
const SG: u32 = 32u;     // subgroup size (fixed)

const NSG: u32 = 4u;                 // subgroups per workgroup
const WG: u32 = NSG * SG;            // invocations
const RT: u32 = 16u;                 // rows
const HD16: u32 = HD / 16u;
const HD4: u32 = HD / 4u;
const CW: u32 = CT * 16u;            // S columns per leaf
const NT: u32 = LPI * CT;            // column tiles per iteration
const STS: u32 = (NT + NSG - 1u) / NSG; // S tiles per subgroup (some may be dummies)
const QS: u32 = HD + 8u;             // Q row stride, halves (16-byte multiple)
const SS: u32 = LPI * CW + 4u;       // S row stride, floats
const ST_OFF: u32 = RT * SS;         // per-subgroup 16x16 f32 staging in fsh (dummy tiles)
const SPLIT: u32 = WG / RT;          // invocations per row in step 2
const KPT: u32 = (CW + SPLIT - 1u) / SPLIT; // keys per invocation per leaf in step 2
const NEG: f32 = -3.0e38;

@group(0) @binding(1) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> k: array<f16>;

// Every workgroup variable is a multiple of 16 bytes long (see leaf_common.wgsl), so qsh and
// fsh start 16-byte aligned whatever order the driver packs them in.
var<workgroup> qsh: array<f16, RT * QS>;                 // Q rows
var<workgroup> fsh: array<f32, RT * SS + NSG * 256u>;    // S, then per-subgroup staging
var<workgroup> red_m: array<f32, LPI * WG>;
var<workgroup> red_l: array<f32, LPI * WG>;

// qa_get / qa_set: the Q rows' A matrices (coop_qa.wgsl, appended).

// The Q rows as HD / 16 A matrices, in every subgroup. (The cooperative operations live in
// functions: naga checks their uniformity per function, and the entry point's early return for
// padding workgroups would otherwise make them non-uniform.)
fn load_q() {
    for (var ds = 0u; ds < HD16; ds++) {
        let at = ds * 16u;
        qa_set(ds, coopLoadT<coop_mat16x16<f16, A>>(&qsh[at], QS));
    }
}

// First token of the keys loaded for column tile ct (< NT) of the iteration whose leaves are
// `leaves` (component lj: the leaf of slot lj).
fn tile_start(leaves: vec4<u32>, ct: u32) -> u32 {
    let t0 = leaves[ct / CT] * p.block_size + (ct % CT) * 16u;
    return min(t0, p.k_len - 16u);
}

// S = Q K^T of the iteration's leaves -> fsh (f32, row-major, stride SS). The loop is uniform
// (a dummy tile past NT recomputes the last one into this subgroup's staging tile).
fn score_tiles(sg: u32, leaves: vec4<u32>, kbase: u32) {
    for (var j = 0u; j < STS; j++) {
        let ct = sg + j * NSG;
        let ctc = min(ct, NT - 1u);
        let row0 = kbase + tile_start(leaves, ctc) * p.k_sn;
        var acc = coop_mat16x16<f32, C>();
        for (var ds = 0u; ds < HD16; ds++) {
            let at = row0 + ds * 16u;
            let kb = coopLoad<coop_mat16x16<f16, B>>(&k[at], p.k_sn);
            acc = coopMultiplyAdd(qa_get(ds), kb, acc);
        }
        var dst = ST_OFF + sg * 256u;
        var stride = 16u;
        if (ct < NT) {
            dst = ct * 16u;
            stride = SS;
        }
        let d = dst;
        let sd = stride;
        coopStoreT(acc, &fsh[d], sd);
    }
}

@compute @workgroup_size(WG)
fn leaf_select(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32, @builtin(subgroup_id) sg: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let i0 = (id % p.tiles) * QT;
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    // Raw Q rows (f16), zero padding past the tile, the group or the sequence.
    for (var x = lid; x < RT * HD4; x += WG) {
        let r = x / HD4;
        let c = x % HD4;
        let i = i0 + r / GQ;
        var val = vec4<f16>(0.0h);
        if (r < QT * GQ && i < p.q_len) {
            let hq = hkv * GQ + r % GQ;
            let at = (b * p.q_sb + hq * p.q_sh + i * p.q_sn) / 4u + c;
            val = q[at];
        }
        let at = r * QS + 4u * c;
        qsh[at] = val.x;
        qsh[at + 1u] = val.y;
        qsh[at + 2u] = val.z;
        qsh[at + 3u] = val.w;
    }
    let n_union = gather_union(lid, bh, i0); // (its barriers also publish the Q rows)
    load_q();
    let kbase = b * p.k_sb + hkv * p.k_sh;
    let srow = lid / SPLIT;
    let scol = lid % SPLIT;
    for (var u = 0u; u < n_union; u += LPI) {
        // The iteration's leaves (a slot past the union repeats the last leaf; never written).
        var leaves = vec4<u32>(0u);
        for (var lj = 0u; lj < LPI; lj++) { leaves[lj] = ul[min(u + lj, n_union - 1u)]; }
        // 1. S = Q K^T on tensor cores.
        score_tiles(sg, leaves, kbase);
        workgroupBarrier();
        // 2. Per leaf, the partial (max, sum of exp) of this invocation's keys of row srow.
        for (var lj = 0u; lj < LPI; lj++) {
            let leaf0 = leaves[lj] * p.block_size;
            let leaf1 = min(leaf0 + p.block_size, p.k_len);
            var s: array<f32, KPT>;
            var m = NEG;
            for (var j = 0u; j < KPT; j++) {
                let kk = scol + j * SPLIT;
                // Column kk holds key tile_start + kk % 16; keep it only inside the range of its
                // 16-key tile (lo ..= lo + 15) and of the leaf.
                let ct = lj * CT + kk / 16u;
                let lo = leaf0 + (kk / 16u) * 16u;
                let tok = tile_start(leaves, min(ct, NT - 1u)) + kk % 16u;
                let ok = kk < CW && tok >= lo && tok < lo + 16u && tok < leaf1;
                s[j] = NEG;
                if (ok) {
                    s[j] = p.scale * fsh[srow * SS + lj * CW + kk];
                    m = max(m, s[j]);
                }
            }
            var l = 0.0;
            for (var j = 0u; j < KPT; j++) {
                if (s[j] > NEG) { l += exp(s[j] - m); }
            }
            red_m[lj * WG + lid] = m;
            red_l[lj * WG + lid] = l;
        }
        workgroupBarrier();
        // 3. Row LSEs summed over the query's heads: leaf slot lid / QT's key for query lid % QT.
        if (lid < LPI * QT && u + lid / QT < n_union) {
            let qi = lid % QT;
            let lj = lid / QT;
            var tot = 0.0;
            for (var h = 0u; h < GQ; h++) {
                let r0 = lj * WG + (qi * GQ + h) * SPLIT;
                var mr = NEG;
                for (var x = 0u; x < SPLIT; x++) { mr = max(mr, red_m[r0 + x]); }
                var lr = 0.0;
                for (var x = 0u; x < SPLIT; x++) {
                    lr += red_l[r0 + x] * exp(red_m[r0 + x] - mr);
                }
                tot += mr + log(lr);
            }
            us[(u + lj) * QT + qi] = rank_key(tot);
        }
    }
    write_selection(lid, bh, i0);
}
