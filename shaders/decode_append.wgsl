// KV cache writes of decode (PISA.md sections 1 and 5): `append` stores one new key/value per
// (sequence, KV head) and recomputes only the ancestor path of its leaf (the leaf from its raw
// keys, each ancestor from its children); `copy_rows` loads a prefill's keys and values.
//
// Layouts: kc, vc [rows, capacity, D] cache_t (the storage type), one shard of the cache (flat (sequence, KV head)
// row r = b * Hkv + h at r - p.kv_row0; the host dispatches once per shard); means, sq f32
// [B*Hkv, cap_nodes, D], node j of level l at cap_off[l] + j (the capacity's layout); rows_k, rows_v [B, Hkv, D] store_t;
// pos [B] u32: the position the new key takes (the old length), 0xffffffff for a sequence that
// does not append. The new key and value rows are written a pair of dimensions (d, d + 1), d
// even, per invocation (out2_*: one whole word for bf16, whose two elements share it; D is a
// multiple of 4); the pyramid path is updated one dimension d per invocation (stride WG), from
// the leaf up, taking the new key from the row itself and the leaf's older keys from the cache
// (written by earlier dispatches), so an invocation only ever reads pyramid values it wrote
// itself or an earlier dispatch wrote: no barrier is needed.
// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
alias store_t = f32;
alias cache_t = store_t;

override WG: u32 = 64u;
override WITH_SQ: bool = false;

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
@group(0) @binding(1) var<storage, read> pos: array<u32>;
@group(0) @binding(2) var<storage, read> rows_k: array<store_t>;
@group(0) @binding(3) var<storage, read> rows_v: array<store_t>;
@group(0) @binding(4) var<storage, read_write> kc: array<cache_t>;
@group(0) @binding(5) var<storage, read_write> vc: array<cache_t>;
@group(0) @binding(6) var<storage, read_write> means: array<f32>;
@group(0) @binding(7) var<storage, read_write> sq: array<f32>;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}
fn cdiv(a: u32, b: u32) -> u32 { return a / b + select(0u, 1u, a % b != 0u); }
fn cap_off(l: u32) -> u32 { return p.cap_off[l / 4u][l % 4u]; }

// The pyramid path of dimension d after token t_new (key value kn) of flat (sequence, KV head)
// id, row kr of the bound shard: its leaf's mean (and E[k^2]) over the leaf's raw keys, then
// each ancestor from its children.
fn update_path(id: u32, kr: u32, t_new: u32, d: u32, kn: f32) {
    let len = t_new + 1u;
    let d_n = p.head_dim;
    let c_n = p.block_size;
    let g = p.merge;
    let node_base = id * p.cap_nodes;
    let leaf = t_new / c_n;
    let t0 = leaf * c_n;
    let inv = 1.0 / f32(len - t0);
    // Leaf: mean (and E[k^2]) of its raw keys, the new one taken from the row itself.
    var s = 0.0;
    var s2 = 0.0;
    for (var t = t0; t < len; t++) {
        var x = kn;
        if (t != t_new) { x = in_kc((kr * p.capacity + t) * d_n + d); }
        s += x;
        s2 += x * x;
    }
    var o = (node_base + leaf) * d_n + d;
    means[o] = s * inv;
    if (WITH_SQ) { sq[o] = s2 * inv; }
    // Ancestors: count-weighted mean of the valid children.
    var j = leaf;
    var n_child = cdiv(len, c_n);
    var w = c_n;
    var l = 1u;
    while (n_child > 1u) {
        let jp = j / g;
        let c0 = jp * g;
        let c1 = min(c0 + g, n_child);
        var m = 0.0;
        var m2 = 0.0;
        for (var c = c0; c < c1; c++) {
            let n = f32(min(len - c * w, w));
            let src = (node_base + cap_off(l - 1u) + c) * d_n + d;
            m += n * means[src];
            if (WITH_SQ) { m2 += n * sq[src]; }
        }
        let n_tot = f32(min(len - c0 * w, w * (c1 - c0)));
        o = (node_base + cap_off(l) + jp) * d_n + d;
        means[o] = m / n_tot;
        if (WITH_SQ) { sq[o] = m2 / n_tot; }
        j = jp;
        n_child = cdiv(n_child, g);
        w = w * g;
        l++;
    }
}

// One workgroup per (sequence, KV head).
@compute @workgroup_size(WG)
fn append(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg) + p.kv_row0; // flat (sequence, KV head)
    if (id >= p.wg_count) { return; }
    let kr = id - p.kv_row0; // its row in the bound shard
    let t_new = pos[id / p.kv_heads];
    // (past the capacity only when the host's lengths ran ahead of the GPU's, as after an
    // encoder with a recorded reset was dropped: never write into the next row's keys)
    if (t_new == 0xffffffffu || t_new >= p.capacity) { return; }
    let d_n = p.head_dim;
    let krow = (kr * p.capacity + t_new) * d_n;
    let r = id * d_n;
    for (var d = 2u * lid; d < d_n; d += 2u * WG) {
        out2_kc(krow + d, in_rows_k(r + d), in_rows_k(r + d + 1u));
        out2_vc(krow + d, in_rows_v(r + d), in_rows_v(r + d + 1u));
    }
    for (var d = lid; d < d_n; d += WG) {
        update_path(id, kr, t_new, d, in_rows_k(r + d));
    }
}

// Prefill copy: elements e, e + 1 (e even; p.count elements in all) of heads hd0.. of a source
// [H, src_len, D] (strides src_sh, src_sn, even; head hd0 at source head src_h0) to sequence
// `seq` of the bound shard, tokens 0..src_len. WG invocations per workgroup, one pair each.
@group(0) @binding(8) var<storage, read> src_k: array<store_t>;
@group(0) @binding(9) var<storage, read> src_v: array<store_t>;

@compute @workgroup_size(WG)
fn copy_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let e = 2u * (linear_id(wid, nwg) * WG + lid);
    if (e >= p.count) { return; }
    let d_n = p.head_dim;
    let hl = e / (p.src_len * d_n);
    let r = e % (p.src_len * d_n);
    let t = r / d_n;
    let d = r % d_n;
    let src = (p.src_h0 + hl) * p.src_sh + t * p.src_sn + d;
    let dst = ((p.seq * p.kv_heads + p.hd0 + hl - p.kv_row0) * p.capacity + t) * d_n + d;
    out2_kc(dst, in_src_k(src), in_src_k(src + 1u));
    out2_vc(dst, in_src_v(src), in_src_v(src + 1u));
}
