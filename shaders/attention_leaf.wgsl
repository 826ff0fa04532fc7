// Leaf-major block-sparse attention, part 2 of 3, portable (PISA.md 4 and 5; host:
// pisa-wgpu/src/ops/attention/by_leaf.rs; the tensor-core twin is attention_leaf_coop.wgsl,
// same bindings and outputs, whose header describes the design).
// One workgroup per chunk: up to QPC entries of one bucket (a leaf of (b, KV head) bh0 + hb;
// local query i - i0, selection slot o), R = QPC * GQ rows (entry e, head h at row e * GQ + h), the
// leaf's C <= WG keys one per invocation: scores s q.k for every row (masked to the leaf, to
// t <= p_i when causal) | per row max m, P = exp(s - m) in place, sum l | O_part = P V, one
// invocation per (row, dim). Outputs as the twin: opart [chunk, R, D] f32, mlpart [chunk, R]
// (m, l), spos [heads, nq, MC] (1 + the first row of each entry; 0 for none).
// PAIR = 1 (WG = 128): the chunks of the pair buckets (leaf_bucket.wgsl APAIR = 1;
// leaf_chunk.wgsl attend_bucket), each over the 2C keys of leaves 2P and 2P + 1, its workgroups
// numbered from the first pair chunk, coff[bl.first].
// Q, K, V: store_t, (b, h, n, d) at b*sb + h*sh + n*sn + d (V with K's strides).
// (Params, p, linear_id: select_common.wgsl, prepended; buckets and chunk_of:
// leaf_chunk.wgsl, appended)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const GQ: u32 = 4u;   // query heads per KV head
const QPC: u32 = 4u;  // entries per chunk
const MC: u32 = 16u;  // selection slots per query (top_k)
const WG: u32 = 64u;  // invocations = most keys of a leaf (PAIR = 1: of a pair)
const PAIR: u32 = 0u;
// 1: a range of several (b, KV head)s, a chunk's head decoded from its bucket (leaf_chunk.wgsl
// attend_bucket); 0: one, bl.bh0 (bucket x = leaf, pairs x = nb0 + P).
const MULTI: u32 = 0u;
const R: u32 = QPC * GQ;
const NEG: f32 = -3.0e38;

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> k: array<store_t>;
@group(0) @binding(3) var<storage, read> v: array<store_t>;
@group(0) @binding(12) var<storage, read_write> opart: array<f32>;
@group(0) @binding(13) var<storage, read_write> mlpart: array<vec2<f32>>;
@group(0) @binding(14) var<storage, read_write> spos: array<u32>;

var<workgroup> ent: array<u32, QPC>;
var<workgroup> sm: array<f32, R * WG>;
var<workgroup> rm: array<f32, R>;
var<workgroup> rl: array<f32, R>;

// Keys of the leaf (tokens leaf0 .. leaf1) row r may attend: all of them, none for a padding
// row, and when causal those up to its query's position.
fn row_keys(r: u32, n: u32, leaf0: u32, leaf1: u32) -> u32 {
    let e = r / GQ;
    if (e >= n) { return 0u; }
    var end = leaf1;
    if (p.causal != 0u) { end = min(end, p.q_pos0 + bl.i0 + ent[e] / MC + 1u); }
    return select(0u, end - leaf0, end > leaf0);
}

@compute @workgroup_size(WG)
fn attend_leaf(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let w = linear_id(wid, nwg);
    if (w >= bl.items) { return; }
    var cid = w;
    if (PAIR == 1u) { cid += coff[bl.first]; }
    let c = chunk_uniform(cid, lid);
    if (c[0] == 0u) { return; }
    var hl = vec2<u32>(0u, c[1] - PAIR * p.nb0);
    if (MULTI == 1u) { hl = attend_bucket(c[1], PAIR); }
    let n = c[3];
    let bh = bl.bh0 + hl.x;
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    for (var e = lid; e < QPC; e += WG) {
        var x = 0u;
        if (e < n) { x = list[c[2] + e]; }
        ent[e] = x;
    }
    workgroupBarrier();
    let kb = b * p.k_sb + hkv * p.k_sh;
    let leaf0 = hl.y * (1u + PAIR) * p.block_size;
    let leaf1 = min(leaf0 + (1u + PAIR) * p.block_size, p.k_len);
    let tok = leaf0 + lid;
    for (var r = 0u; r < R; r++) {
        let e = r / GQ;
        var s = NEG;
        if (tok < leaf1 && e < n) {
            let i = bl.i0 + ent[e] / MC;
            if (p.causal == 0u || tok <= p.q_pos0 + i) {
                let qb = b * p.q_sb + (hkv * GQ + r % GQ) * p.q_sh + i * p.q_sn;
                let kr = kb + tok * p.k_sn;
                var a = 0.0;
                for (var d = 0u; d < p.head_dim; d++) { a += in_q(qb + d) * in_k(kr + d); }
                s = p.scale * a;
            }
        }
        sm[r * WG + lid] = s;
    }
    workgroupBarrier();
    for (var r = lid; r < R; r += WG) {
        var m = NEG;
        for (var j = 0u; j < WG; j++) { m = max(m, sm[r * WG + j]); }
        var l = 0.0;
        for (var j = 0u; j < WG; j++) {
            let s = sm[r * WG + j];
            var pk = 0.0;
            if (s > NEG) { pk = exp(s - m); }
            sm[r * WG + j] = pk;
            l += pk;
        }
        rm[r] = m;
        rl[r] = l;
    }
    workgroupBarrier();
    for (var x = lid; x < R * p.head_dim; x += WG) {
        let r = x / p.head_dim;
        let d = x % p.head_dim;
        // Only the keys this row may see (a masked key's value never enters the sum, so a
        // non-finite future value cannot reach an earlier row through 0 * NaN).
        let nk = row_keys(r, n, leaf0, leaf1);
        var acc = 0.0;
        for (var j = 0u; j < nk; j++) {
            acc += sm[r * WG + j] * in_v(kb + (leaf0 + j) * p.k_sn + d);
        }
        opart[(cid * R + r) * p.head_dim + d] = acc;
    }
    for (var r = lid; r < R; r += WG) { mlpart[cid * R + r] = vec2<f32>(rm[r], rl[r]); }
    let sp = hl.x * bl.nq * MC;
    for (var e = lid; e < n; e += WG) { spos[sp + ent[e]] = cid * R + e * GQ + 1u; }
}
