// Leaf-major stage 2 of PISA prefill selection, part 2 of 3, portable (PISA.md 2, 3.3 and 5;
// host: pisa-wgpu/src/ops/leaf_select/by_leaf.rs; the tensor-core twin is leaf_score_coop.wgsl).
// One workgroup per chunk: up to QPC entries of one bucket (b, KV head, leaf), i.e. QPC queries
// that list this leaf, R = QPC * GQ rows (entry e, head h at row e * GQ + h). Invocation t takes
// key t of each WG-key step of the leaf and computes s q_r.k_t for every row; a workgroup pass
// folds the step into a running (max, sum of exp) per row. An entry's score is the sum over its
// GQ heads of the row LSE, written as rank_key to its own slot in `scores`.
// Q, K: store_t, (b, h, n, d) at b*sb + h*sh + n*sn + d.
// (Params, p, rank_key, linear_id: select_common.wgsl, prepended; buckets and chunk_of:
// leaf_chunk.wgsl, appended)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const GQ: u32 = 4u;   // query heads per KV head
const QPC: u32 = 4u;  // entries per chunk
const MC: u32 = 34u;  // candidate slots per query
const WG: u32 = 64u;
const R: u32 = QPC * GQ;
const NEG: f32 = -3.0e38;

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> k: array<store_t>;

var<workgroup> ent: array<u32, QPC>;
var<workgroup> sm: array<f32, R * WG>;
var<workgroup> rm: array<f32, R>;
var<workgroup> rl: array<f32, R>;

@compute @workgroup_size(WG)
fn leaf_score(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let cid = linear_id(wid, nwg);
    if (cid >= bl.items) { return; }
    let c = chunk_uniform(cid, lid);
    if (c[0] == 0u) { return; }
    let bh = c[1] / p.nb0;
    let leaf = c[1] % p.nb0;
    let n = c[3];
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    for (var e = lid; e < QPC; e += WG) {
        var x = 0u;
        if (e < n) { x = list[c[2] + e]; }
        ent[e] = x;
    }
    for (var r = lid; r < R; r += WG) {
        rm[r] = NEG;
        rl[r] = 0.0;
    }
    workgroupBarrier();
    let kb = b * p.k_sb + hkv * p.k_sh;
    let leaf0 = leaf * p.block_size;
    let leaf1 = min(leaf0 + p.block_size, p.k_len);
    for (var t0 = leaf0; t0 < leaf1; t0 += WG) {
        let tok = t0 + lid;
        for (var r = 0u; r < R; r++) {
            let e = r / GQ;
            var s = NEG;
            if (tok < leaf1 && e < n) {
                let qb = b * p.q_sb + (hkv * GQ + r % GQ) * p.q_sh + (ent[e] / MC) * p.q_sn;
                let kr = kb + tok * p.k_sn;
                var a = 0.0;
                for (var d = 0u; d < p.head_dim; d++) { a += in_q(qb + d) * in_k(kr + d); }
                s = p.scale * a;
            }
            sm[r * WG + lid] = s;
        }
        workgroupBarrier();
        for (var r = lid; r < R; r += WG) {
            var m = rm[r];
            for (var j = 0u; j < WG; j++) { m = max(m, sm[r * WG + j]); }
            var l = rl[r] * exp(rm[r] - m);
            for (var j = 0u; j < WG; j++) {
                let s = sm[r * WG + j];
                if (s > NEG) { l += exp(s - m); }
            }
            rm[r] = m;
            rl[r] = l;
        }
        workgroupBarrier();
    }
    for (var e = lid; e < n; e += WG) {
        var tot = 0.0;
        for (var h = 0u; h < GQ; h++) { tot += rm[e * GQ + h] + log(rl[e * GQ + h]); }
        scores[bh * p.q_len * MC + ent[e]] = rank_key(tot);
    }
}
