// Stage 2 of PISA prefill selection (PISA.md sections 2, 3.3, 3.4 and 5): score the stage-1
// leaf candidates with exact LSE over their raw keys and write the final selection.
//
// One workgroup per (b, KV head, tile of QT consecutive queries). The tile's non-forced
// candidates (of queries that must choose) are deduplicated into a union; each union leaf is
// loaded once, chunk by chunk of WG tokens and DC dims, with coalesced reads into workgroup
// memory; then one token per invocation, each key value serves every (query, head) pair of the
// tile (QT*GQ dot products per key read; the queries are held [D][QG4] as vec4 so that one
// broadcast load feeds four accumulators; accumulators are unrolled by hand). A workgroup reduction
// folds the chunk into a running (max, sum) per (query, head); a leaf's score for a query is the
// sum over the GQ heads of log sum_t exp(s q.k_t). The union and the final rank-based pick are
// leaf_common.wgsl's (appended). The tensor-core twin of this kernel is leaf_select_coop.wgsl.
//
// Q, K: store_t, (b, h, n, d) at b*sb + h*sh + n*sn + d. cand: i32 [B, Hkv, Nq, MC] (-1 padded);
// out: i32 [B, Hkv, Nq, K].
// (store_t, Params, p and the shared helpers: select_common.wgsl, prepended; cand, sel and the
// union: leaf_common.wgsl, appended)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const GQ: u32 = 1u;
const QT: u32 = 4u;
const MC: u32 = 34u;
// vec4 slots of the query buffer: QG4 * (D rounded up to DC).
const QBUF: u32 = 64u;
const WG: u32 = 64u;
const DC: u32 = 32u;
const QG: u32 = QT * GQ;
const QG4: u32 = (QG + 3u) / 4u;
const NEG: f32 = -3.0e38;

@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> k: array<store_t>;

var<workgroup> qs: array<vec4<f32>, QBUF>;
var<workgroup> ks: array<f32, WG * (DC + 1u)>;
var<workgroup> sc: array<vec4<f32>, WG * QG4>;
var<workgroup> rm: array<f32, QG>;
var<workgroup> rl: array<f32, QG>;
var<workgroup> pm: array<f32, WG>;
var<workgroup> ps: array<f32, WG>;
// Base of this workgroup's (b, KV head) in K.
var<private> kbase_g: u32;

// Stages element e (token e / DC, dim e % DC of the chunk) of leaf `leaf`'s tokens t0.. and
// dims d0..: branch-free (clamped index, zero outside the leaf, K or D).
fn stage_k(e: u32, leaf: u32, t0: u32, d0: u32) {
    let tt = t0 + e / DC;
    let tok = leaf * p.block_size + tt;
    let d = d0 + e % DC;
    let ok = tt < p.block_size && tok < p.k_len && d < p.head_dim;
    let i = select(0u, kbase_g + tok * p.k_sn + d, ok);
    ks[(e / DC) * (DC + 1u) + e % DC] = select(0.0, in_k(i), ok);
}

fn stage_k4(e: u32, leaf: u32, t0: u32, d0: u32) {
    stage_k(e + 0u, leaf, t0, d0);
    stage_k(e + 64u, leaf, t0, d0);
    stage_k(e + 128u, leaf, t0, d0);
    stage_k(e + 192u, leaf, t0, d0);
}

@compute @workgroup_size(WG)
fn leaf_select(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.tiles;
    let i0 = (id % p.tiles) * QT;
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    let d_n = p.head_dim;
    // Scaled queries, [Dp][QG4] vec4 (component j % 4 of slot j / 4), zero-padded.
    let d_p = (d_n + DC - 1u) / DC * DC;
    for (var e = lid; e < QG4 * 4u * d_p; e += WG) {
        let j = e / d_p;
        let d = e % d_p;
        let qi = j / GQ;
        let i = i0 + qi;
        var v = 0.0;
        if (j < QG && i < p.q_len && d < d_n) {
            let hq = hkv * GQ + j % GQ;
            v = p.scale * in_q(b * p.q_sb + hq * p.q_sh + i * p.q_sn + d);
        }
        qs[d * QG4 + j / 4u][j % 4u] = v;
    }
    let n_union = gather_union(lid, bh, i0);
    kbase_g = b * p.k_sb + hkv * p.k_sh;
    for (var u = 0u; u < n_union; u++) {
        let leaf = ul[u];
        for (var t0 = 0u; t0 < p.block_size; t0 += WG) {
            let t = t0 + lid;
            let valid = t < p.block_size && leaf * p.block_size + t < p.k_len;
            var a0 = vec4<f32>(0.0);
            var a1 = vec4<f32>(0.0);
            var a2 = vec4<f32>(0.0);
            var a3 = vec4<f32>(0.0);
            var a4 = vec4<f32>(0.0);
            var a5 = vec4<f32>(0.0);
            var a6 = vec4<f32>(0.0);
            var a7 = vec4<f32>(0.0);
            for (var d0 = 0u; d0 < d_p; d0 += DC) {
                // Stage WG tokens x DC dims, coalesced (consecutive invocations, consecutive d),
                // straight-line so that all loads are in flight together.
                stage_k4(lid + 0u, leaf, t0, d0); stage_k4(lid + 256u, leaf, t0, d0);
                stage_k4(lid + 512u, leaf, t0, d0); stage_k4(lid + 768u, leaf, t0, d0);
                stage_k4(lid + 1024u, leaf, t0, d0); stage_k4(lid + 1280u, leaf, t0, d0);
                stage_k4(lid + 1536u, leaf, t0, d0); stage_k4(lid + 1792u, leaf, t0, d0);
                workgroupBarrier();
                let kr = lid * (DC + 1u);
                for (var dd = 0u; dd < DC; dd++) {
                    let x = ks[kr + dd];
                    let o = (d0 + dd) * QG4;
                    a0 += qs[o] * x;
                    if (QG4 > 1u) { a1 += qs[o + 1u] * x; }
                    if (QG4 > 2u) { a2 += qs[o + 2u] * x; }
                    if (QG4 > 3u) { a3 += qs[o + 3u] * x; }
                    if (QG4 > 4u) { a4 += qs[o + 4u] * x; }
                    if (QG4 > 5u) { a5 += qs[o + 5u] * x; }
                    if (QG4 > 6u) { a6 += qs[o + 6u] * x; }
                    if (QG4 > 7u) { a7 += qs[o + 7u] * x; }
                }
                workgroupBarrier();
            }
            let neg = vec4<f32>(NEG);
            let so = lid * QG4;
            sc[so] = select(neg, a0, valid);
            if (QG4 > 1u) { sc[so + 1u] = select(neg, a1, valid); }
            if (QG4 > 2u) { sc[so + 2u] = select(neg, a2, valid); }
            if (QG4 > 3u) { sc[so + 3u] = select(neg, a3, valid); }
            if (QG4 > 4u) { sc[so + 4u] = select(neg, a4, valid); }
            if (QG4 > 5u) { sc[so + 5u] = select(neg, a5, valid); }
            if (QG4 > 6u) { sc[so + 6u] = select(neg, a6, valid); }
            if (QG4 > 7u) { sc[so + 7u] = select(neg, a7, valid); }
            workgroupBarrier();
            // Fold the chunk into the running (max, sum) of every (query, head) column: `parts`
            // invocations per column each reduce a strided share, then one merges them.
            let cnt = min(WG, p.block_size - t0);
            let parts = max(1u, WG / QG);
            if (lid < parts * QG) {
                let j = lid / parts;
                var m = NEG;
                var s = 0.0;
                for (var r = lid % parts; r < cnt; r += parts) {
                    let x = sc[r * QG4 + j / 4u][j % 4u];
                    let mn = max(m, x);
                    s = s * exp(m - mn) + exp(x - mn);
                    m = mn;
                }
                pm[lid] = m;
                ps[lid] = s;
            }
            workgroupBarrier();
            for (var j = lid; j < QG; j += WG) {
                var mo = NEG;
                var lo = 0.0;
                if (t0 > 0u) { mo = rm[j]; lo = rl[j]; }
                var mn = mo;
                for (var r = 0u; r < parts; r++) { mn = max(mn, pm[j * parts + r]); }
                var s = lo * exp(mo - mn);
                for (var r = 0u; r < parts; r++) { s += ps[j * parts + r] * exp(pm[j * parts + r] - mn); }
                rm[j] = mn;
                rl[j] = s;
            }
            workgroupBarrier();
        }
        if (lid < QT) {
            var tot = 0.0;
            for (var h = 0u; h < GQ; h++) { tot += rm[lid * GQ + h] + log(rl[lid * GQ + h]); }
            us[u * QT + lid] = rank_key(tot);
        }
    }
    write_selection(lid, bh, i0);
}
