// Key pyramid (PISA.md section 1): leaf block means from K, then each coarser level as the
// count-weighted mean of its children. Also the per-dimension second moment E[k^2] of every
// node when WITH_SQ (the `meanvar` scoring's variance is E[k^2] - mu^2).
//
// Layout: K is store_t with element (b, h, t, d) at b*k_sb + h*k_sh + t*k_sn + d.
// means / sq are f32 [B*Hkv, total_nodes, D]; node j of level l at flat index off_l + j,
// where the offsets are those of the layout of `cap_len` keys (a KV cache's capacity), of
// which the first `k_len` are valid.
// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
alias store_t = f32;

override WG: u32 = 64u;
override WITH_SQ: bool = false;

struct Params {
    k_sb: u32, k_sh: u32, k_sn: u32, kv_heads: u32,
    head_dim: u32, k_len: u32, block_size: u32, merge: u32,
    num_bh: u32, nodes: u32, node_off: u32, child_off: u32,
    child_nodes: u32, child_tokens: u32, total_nodes: u32, wg_count: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k: array<store_t>;
@group(0) @binding(2) var<storage, read_write> means: array<f32>;
@group(0) @binding(3) var<storage, read_write> sq: array<f32>;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}

// One workgroup per (bh, leaf); threads stride over d. `nodes` = leaves.
@compute @workgroup_size(WG)
fn pool_leaves(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.nodes;
    let leaf = id % p.nodes;
    let b = bh / p.kv_heads;
    let h = bh % p.kv_heads;
    let t0 = leaf * p.block_size;
    let t1 = min(t0 + p.block_size, p.k_len);
    let inv = 1.0 / f32(t1 - t0);
    let base = b * p.k_sb + h * p.k_sh;
    let out = (bh * p.total_nodes + p.node_off + leaf) * p.head_dim;
    for (var d = lid; d < p.head_dim; d += WG) {
        var s = 0.0;
        var s2 = 0.0;
        for (var t = t0; t < t1; t++) {
            let x = in_k(base + t * p.k_sn + d);
            s += x;
            s2 += x * x;
        }
        means[out + d] = s * inv;
        if (WITH_SQ) { sq[out + d] = s2 * inv; }
    }
}

// One workgroup per (bh, node) of a level >= 1: count-weighted mean of the children.
// `child_tokens` = tokens per full child (C * g^(l-1)).
@compute @workgroup_size(WG)
fn pool_level(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / p.nodes;
    let j = id % p.nodes;
    let c0 = j * p.merge;
    let c1 = min(c0 + p.merge, p.child_nodes);
    let n_total = f32(min(c1 * p.child_tokens, p.k_len) - c0 * p.child_tokens);
    let row = bh * p.total_nodes;
    let out = (row + p.node_off + j) * p.head_dim;
    for (var d = lid; d < p.head_dim; d += WG) {
        var s = 0.0;
        var s2 = 0.0;
        for (var c = c0; c < c1; c++) {
            let n = f32(min((c + 1u) * p.child_tokens, p.k_len) - c * p.child_tokens);
            let src = (row + p.child_off + c) * p.head_dim + d;
            s += n * means[src];
            if (WITH_SQ) { s2 += n * sq[src]; }
        }
        means[out + d] = s / n_total;
        if (WITH_SQ) { sq[out + d] = s2 / n_total; }
    }
}
