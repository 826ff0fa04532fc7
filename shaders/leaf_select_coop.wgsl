// Stage 2 of PISA prefill selection on cooperative matrices (tensor cores), f16 storage, f32
// accumulation (PISA.md sections 2, 3.3, 3.4 and 5). Host: pisa-wgpu/src/ops/leaf_select/coop.rs;
// the portable twin is leaf_select.wgsl (same bindings, same Params, same output). The union of
// the tile's candidates and the final pick are leaf_common.wgsl's (appended).
//
// f16 only (the host prepends `enable f16;`); needs SUBGROUP and a fixed subgroup size SG.
// One workgroup of NSG subgroups per (b, KV head, tile of QT consecutive queries); its RT = 16
// rows are the tile's (query, head) pairs, row r = query r / GQ, head r % GQ (QT * GQ <= 16;
// rows past that are zero padding). The raw Q rows (f16, unscaled, so exact) sit in registers as
// HD / 16 A matrices in every subgroup. Per union leaf (one at a time, all subgroups):
//   1. its CW = 16 * CT key rows (C tokens, zero past the leaf or the sequence) go from
//      registers to workgroup memory, and the next leaf's rows are loaded into registers, in
//      flight while this leaf computes;                                           barrier
//   2. S = Q K^T on tensor cores: subgroup sg computes the 16x16 tiles sg, sg + NSG, ... of
//      the leaf's CT column tiles and stores them (f32) to fsh;                   barrier
//   3. SPLIT invocations per row: scale (s = scale * q.k, f32), mask, and a partial (max, sum
//      of exp) over KPT keys each;                                                barrier
//   4. one invocation per query: merge the row partials into the LSE of each of its GQ heads
//      and write the sum over the heads as the leaf's ranking key us[u * QT + qi].
// Steps 3 and 4 read the previous step's data only after a barrier, and step 1 of the next
// leaf writes a region (the K tile) that nobody reads after step 2: three barriers per leaf.
//
// Cooperative loads and stores touch workgroup memory only (every offset and stride a multiple
// of 16 bytes), never the storage buffers, so no out-of-bounds matrix access can happen.
// Q, K: vec4<f16>, (b, h, n, d) at (b*sb + h*sh + n*sn + d) / 4 (D and the strides are
// multiples of 4).
enable wgpu_cooperative_matrix;

const GQ: u32 = 4u;      // query heads per KV head (<= 16)
const QT: u32 = 4u;      // queries per workgroup (QT * GQ <= 16)
const MC: u32 = 34u;     // candidate slots per query (g * (K + 1))
const HD: u32 = 128u;    // head dim (multiple of 16, <= 128)
const CT: u32 = 4u;      // 16-key column tiles per leaf: ceil(C / 16)
const SG: u32 = 32u;     // subgroup size (fixed)

const NSG: u32 = 4u;                 // subgroups per workgroup
const WG: u32 = NSG * SG;            // invocations
const RT: u32 = 16u;                 // rows
const HD16: u32 = HD / 16u;
const HD4: u32 = HD / 4u;
const CW: u32 = CT * 16u;            // key rows staged per leaf
const KS: u32 = HD + 8u;             // Q / K row stride, halves (16-byte multiple)
const SS: u32 = CW + 4u;             // S row stride, floats
const K_OFF: u32 = RT * KS;          // K tile in hsh (after the Q rows)
const STS: u32 = (CT + NSG - 1u) / NSG; // S tiles per subgroup (some may be dummies)
const ST_OFF: u32 = RT * SS;         // per-subgroup 16x16 f32 staging in fsh
const SPLIT: u32 = WG / RT;          // invocations per row in step 3
const KPT: u32 = (CW + SPLIT - 1u) / SPLIT; // keys per invocation in step 3
const NPF: u32 = (CW * HD4 + WG - 1u) / WG; // K vec4 per invocation per leaf
const NEG: f32 = -3.0e38;

@group(0) @binding(1) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<f16>>;

// Every workgroup variable is a multiple of 16 bytes long (see leaf_common.wgsl), so hsh and
// fsh start 16-byte aligned whatever order the driver packs them in.
var<workgroup> hsh: array<f16, K_OFF + CW * KS>;   // Q rows, then the K tile
var<workgroup> fsh: array<f32, RT * SS + NSG * 256u>; // S, then per-subgroup staging
var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_l: array<f32, WG>;

var<private> qa: array<coop_mat16x16<f16, A>, HD16>;
var<private> kpre: array<vec4<f16>, NPF>;

// Loads key rows 0 .. CW of `leaf` (zero past the leaf or the sequence) into registers.
fn prefetch(lid: u32, kbase: u32, leaf: u32) {
    for (var j = 0u; j < NPF; j++) {
        let x = lid + j * WG;
        let kk = x / HD4;
        let t = leaf * p.block_size + kk;
        var kv = vec4<f16>(0.0h);
        if (x < CW * HD4 && kk < p.block_size && t < p.k_len) {
            let at = kbase + t * (p.k_sn / 4u) + x % HD4;
            kv = k[at];
        }
        kpre[j] = kv;
    }
}

// Writes the prefetched key rows into the K tile.
fn stage_k(lid: u32) {
    for (var j = 0u; j < NPF; j++) {
        let x = lid + j * WG;
        if (x < CW * HD4) {
            let kv = kpre[j];
            let at = K_OFF + (x / HD4) * KS + 4u * (x % HD4);
            hsh[at] = kv.x;
            hsh[at + 1u] = kv.y;
            hsh[at + 2u] = kv.z;
            hsh[at + 3u] = kv.w;
        }
    }
}

// The Q rows (hsh[0 .. K_OFF)) as HD / 16 A matrices, in every subgroup. (The cooperative
// operations live in functions: naga checks their uniformity per function, and the entry
// point's early return for padding workgroups would otherwise make them non-uniform.)
fn load_q() {
    for (var ds = 0u; ds < HD16; ds++) {
        let at = ds * 16u;
        qa[ds] = coopLoadT<coop_mat16x16<f16, A>>(&hsh[at], KS);
    }
}

// S = Q K^T of the leaf in the K tile -> fsh (f32, row-major, stride SS).
fn score_tiles(sg: u32) {
    // One 16x16 tile per (subgroup, column tile); the loop is uniform (a dummy tile past CT
    // recomputes the last one into this subgroup's staging tile).
    for (var j = 0u; j < STS; j++) {
        let ct = sg + j * NSG;
        let ctc = min(ct, CT - 1u);
        var acc = coop_mat16x16<f32, C>();
        for (var ds = 0u; ds < HD16; ds++) {
            let at = K_OFF + ctc * 16u * KS + ds * 16u;
            let kb = coopLoad<coop_mat16x16<f16, B>>(&hsh[at], KS);
            acc = coopMultiplyAdd(qa[ds], kb, acc);
        }
        var dst = ST_OFF + sg * 256u;
        var stride = 16u;
        if (ct < CT) {
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
        let at = r * KS + 4u * c;
        hsh[at] = val.x;
        hsh[at + 1u] = val.y;
        hsh[at + 2u] = val.z;
        hsh[at + 3u] = val.w;
    }
    let n_union = gather_union(lid, bh, i0); // (its barriers also publish the Q rows)
    load_q();
    let kbase = (b * p.k_sb + hkv * p.k_sh) / 4u;
    if (n_union > 0u) { prefetch(lid, kbase, ul[0]); }
    let srow = lid / SPLIT;
    let scol = lid % SPLIT;
    for (var u = 0u; u < n_union; u++) {
        let leaf = ul[u];
        // 1. This leaf's keys to the K tile; the next leaf's into registers.
        stage_k(lid);
        workgroupBarrier();
        if (u + 1u < n_union) { prefetch(lid, kbase, ul[u + 1u]); }
        // 2. S = Q K^T on tensor cores.
        score_tiles(sg);
        workgroupBarrier();
        // 3. Partial (max, sum of exp) of this invocation's keys of row srow.
        var s: array<f32, KPT>;
        var m = NEG;
        for (var j = 0u; j < KPT; j++) {
            let kk = scol + j * SPLIT;
            let ok = kk < p.block_size && kk < CW && leaf * p.block_size + kk < p.k_len;
            s[j] = NEG;
            if (ok) {
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
        // 4. Row LSEs, summed over the query's heads: the leaf's ranking key for query lid.
        if (lid < QT) {
            var tot = 0.0;
            for (var h = 0u; h < GQ; h++) {
                let r0 = (lid * GQ + h) * SPLIT;
                var mr = NEG;
                for (var x = 0u; x < SPLIT; x++) { mr = max(mr, red_m[r0 + x]); }
                var lr = 0.0;
                for (var x = 0u; x < SPLIT; x++) {
                    lr += red_l[r0 + x] * exp(red_m[r0 + x] - mr);
                }
                tot += mr + log(lr);
            }
            us[u * QT + lid] = rank_key(tot);
        }
    }
    write_selection(lid, bh, i0);
}
