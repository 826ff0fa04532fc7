// Decode step (PISA.md sections 3, 4, 5) for the new token of every sequence: THREE dispatches
// of one compute pass (two: decode_route_leaf.wgsl; one: decode_route_leaf_merge.wgsl), so
// that the GPU's many cores share a step that one workgroup per KV head (8 workgroups at
// Hkv = 8) left latency-bound:
//   1. `route` (decode_route.wgsl), one workgroup per (sequence, KV head): walks the pyramid's
//      intermediate levels (inherently serial: a level's candidates are the previous level's
//      kept children) and writes NS = g*(K+1) + K leaf slots: the scored leaf candidates
//      (slots 0..MAXC) and the forced leaves (slots MAXC.., all visible leaves when they are
//      K or fewer).
//   2. `leaf` (decode_attend.wgsl), one workgroup per (sequence, KV head, slot): exact scores
//      of the slot's block keys for the GQ heads, and the block's online-softmax state per head
//      (max m, sum l, unnormalised O = sum_t exp(x_t - m) v_t), written to `parts`. A block's
//      LSE m + log l is both its selection score (PISA.md 2) and what merges its attention.
//   3. `merge` (decode_merge.wgsl), one workgroup per (sequence, KV head): top-K cut of the
//      scored candidates by summed LSE (ties to the lower block), ascending selection, and the
//      FlashDecoding merge of the K selected blocks' states into O and LSE (PISA.md 4).
// Every candidate block is attended speculatively (at most g*(K+1) of them, ~2x the K needed),
// which costs little bandwidth and removes a dependent pass over the keys.
// This file holds the declarations and helpers shared by the modules (each module is this file
// followed by its parts, then the block states' declaration, decode_parts.wgsl or
// decode_parts_coherent.wgsl: ops/decode/shaders.rs). The append and the prefill copy live in
// decode_append.wgsl.
//
// Layouts: q, out [B, Hq, D]; kc, vc [B, Hkv, capacity, D] (store_t, read as vec4 rows through
// the generated in4_*/raw4_* accessors, which widen bf16 words: D is a multiple of 4; out is f32
// for bf16; the flat rows b * Hkv + h from p.kv_split on live in kc2, vc2 from row 0 when
// the cache is split over two bindings, see `leaf`); means, sq f32 [B*Hkv, cap_nodes, D] with
// node j of level l at cap_off[l] + j (the capacity's layout; the nodes of a shorter length are
// a prefix of each level); lens [B] u32; lse_out [B, Hq] f32; sel_out [B, Hkv, K] i32
// ascending, -1 padded; cands u32 [B*Hkv, NS]; parts f32 [B*Hkv, NS, GQ, D + 2] (O, then m, l).
// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
alias store_t = f32;

// Sizes substituted per pipeline (see ops/decode/plan.rs).
const WG: u32 = 64u;     // invocations per workgroup
const GQ: u32 = 2u;      // g_q: query heads per KV head
const KMAX: u32 = 4u;    // K (top_k)
const MAXC: u32 = 10u;   // g * (K + 1): candidate slots of one level
const MG: u32 = 2u;      // g, the merge factor (= p.merge)
const LR: u32 = 4u;      // route: invocations sharing one pyramid row's dot products
const SGR: u32 = 0u;     // route: 1 for the level steps with subgroup shuffles (decode_levels_sg.wgsl)
const XR: u32 = 80u;     // route scratch (partial per-child scores of a level)
const XS: u32 = 256u;    // leaf scratch (chunk scores and partial scores; merge of the P.V parts)
const CH: u32 = 64u;     // leaf: keys per chunk (C when memory allows)
const LK: u32 = 4u;      // leaf: invocations sharing one key row's dot products
const DD: u32 = 64u;     // D, the head dim (a multiple of 4)
const PARTS: u32 = 1u;   // key subsets of the P.V phase (invocations per output vec4)
const PVR: u32 = 1u;     // leaf: value rows prefetched per invocation (ceil(CH/PARTS), or 1)
const AW: u32 = WG;      // leaf: invocations attending one block (WG in `leaf`)
const NB: u32 = 1u;      // leaf: blocks attended at once by a workgroup (1 in `leaf`)
const D4: u32 = DD / 4u;
const NS: u32 = MAXC + KMAX; // leaf slots per (sequence, KV head)
const PW: u32 = DD + 2u;     // floats of one (slot, head) state in `parts`

const INVALID: u32 = 0xffffffffu;
// Finite stand-ins for -inf (WGSL may assume no infinities): "no score" and its test.
const NEG: f32 = -3.0e38;
const NEG_T: f32 = -1.0e38;

struct Params {
    batch: u32, kv_heads: u32, q_heads: u32, head_dim: u32,
    block_size: u32, merge: u32, top_k: u32, scoring: u32,
    causal: u32, sink: u32, local: u32, capacity: u32,
    cap_nodes: u32, wg_count: u32, scale: f32, seq: u32,
    src_sh: u32, src_sn: u32, count: u32, src_len: u32,
    kv_split: u32, kv_row0: u32, hd0: u32, src_h0: u32,
    cap_off: array<vec4<u32>, 16>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> lens: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<store_t>;
@group(0) @binding(3) var<storage, read> kc: array<vec4<store_t>>;
@group(0) @binding(4) var<storage, read> vc: array<vec4<store_t>>;
@group(0) @binding(5) var<storage, read> means: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> sq: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> out: array<store_t>;
@group(0) @binding(8) var<storage, read_write> lse_out: array<f32>;
@group(0) @binding(9) var<storage, read_write> sel_out: array<i32>;
@group(0) @binding(10) var<storage, read_write> cands: array<u32>;
// (binding 11, `parts`: decode_parts.wgsl, or decode_parts_coherent.wgsl, appended last)
// Shard 1 of a cache whose K/V exceed one storage binding (flat (sequence, KV head) rows
// kv_split.. of kc/vc live here, at row - kv_split); the `leaf` dispatch reads it (bound to shard
// 0 again when there is one shard). See decode_attend.wgsl.
@group(0) @binding(12) var<storage, read> kc2: array<vec4<store_t>>;
@group(0) @binding(13) var<storage, read> vc2: array<vec4<store_t>>;

var<workgroup> qs: array<vec4<f32>, GQ * D4>;
var<workgroup> wlen: u32;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}
fn cdiv(a: u32, b: u32) -> u32 { return a / b + select(0u, 1u, a % b != 0u); }
fn sat_mul(a: u32, b: u32) -> u32 {
    if (b != 0u && a > 0xffffffffu / b) { return 0xffffffffu; }
    return a * b;
}
fn cap_off(l: u32) -> u32 { return p.cap_off[l / 4u][l % 4u]; }
// Nodes of level l for nb0 leaves: ceil(nb0 / g^l).
fn level_nodes(nb0: u32, l: u32) -> u32 {
    var n = nb0;
    for (var i = 0u; i < l; i++) { n = cdiv(n, p.merge); }
    return n;
}
// Ancestor at level l of leaf bq.
fn anc(bq: u32, l: u32) -> u32 {
    var a = bq;
    for (var i = 0u; i < l; i++) { a = a / p.merge; }
    return a;
}
// Tokens of node j of level l over len keys.
fn node_len(l: u32, j: u32, len: u32) -> u32 {
    var w = p.block_size;
    for (var i = 0u; i < l; i++) { w = sat_mul(w, p.merge); }
    return min(len - sat_mul(j, w), w);
}
// First vec4 of a pyramid node's row and of a key's row.
fn node_row(bh: u32, l: u32, j: u32) -> u32 { return (bh * p.cap_nodes + cap_off(l) + j) * D4; }
fn key_row(bh: u32, t: u32) -> u32 { return (bh * p.capacity + t) * D4; }
// Loads the group's GQ query rows (starting at element qrow) into qs, and the sequence's
// length into wlen; the caller's workgroupUniformLoad(&wlen) orders both.
fn load_q(qrow: u32, b: u32, lid: u32) {
    if (lid == 0u) { wlen = lens[b]; }
    for (var i = lid; i < GQ * D4; i += WG) {
        let o = qrow + 4u * i;
        qs[i] = vec4<f32>(in_q(o), in_q(o + 1u), in_q(o + 2u), in_q(o + 3u));
    }
}
fn is_forced(bq: u32, j: u32) -> bool {
    return j <= bq && (j < p.sink || j + p.local >= bq);
}
// LSE of (m, l) online-softmax state; NEG when empty.
fn state_lse(m: f32, l: f32) -> f32 { return select(NEG, m + log(l), l > 0.0); }

// Ranking key of a score (PISA.md 3.4): an order-preserving map of f32 onto u32, compared as
// integers so that the top-K is a strict total order whatever the scores: every NaN ranks as
// -inf (it never wins, and never makes two candidates share a rank), -0 as +0. (WGSL float
// compares may assume no NaN, and NaN compares false both ways, which broke the rank count.)
fn rank_key(s: f32) -> u32 {
    var b = bitcast<u32>(s);
    if ((b & 0x7fffffffu) > 0x7f800000u) { b = 0xff800000u; }
    if (b == 0x80000000u) { b = 0u; }
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// Key rows (the `leaf` dispatch and the fused step): LK invocations share one row.
const DLK: u32 = (D4 + LK - 1u) / LK; // vec4s of a key row per invocation

// Partial q_h . k over the vec4s j = u, u + LK, ... of a key row, every head h of the group
// (a fixed trip count and no condition when LK divides D/4, so the loads are in flight
// together: see dots_mean in decode_levels.wgsl).
fn dots_key_part(row: u32, u: u32) -> array<f32, GQ> {
    var a: array<f32, GQ>;
    for (var i = 0u; i < DLK; i++) {
        let j = u + i * LK;
        if (D4 % LK == 0u || j < D4) {
            let k = in4_kc(row + j);
            for (var hh = 0u; hh < GQ; hh++) { a[hh] += dot(qs[hh * D4 + j], k); }
        }
    }
    return a;
}

// -inf as a runtime value: WGSL const-evaluates `bitcast<f32>(0xff800000u)` and Tint (Dawn,
// the browsers' WGSL compiler) refuses -inf as a constant ("value -inf cannot be represented as
// 'f32'"), where naga accepts it.
fn neg_inf_bits() -> u32 { return 0xff800000u; }
