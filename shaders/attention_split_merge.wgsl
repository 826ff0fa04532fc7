// Split-K dense attention (FlashDecoding), part 2 of 2: merges the per-split partial states of
// attention_split.wgsl (same Params, in attention_split_common.wgsl, appended; host:
// pisa-wgpu/src/ops/attention/split_k.rs) into O and LSE: M = max m, L = sum l 2^(m - M), O = sum
// O_part 2^(m - M) / L, LSE = ln 2 * (M + log2 L) (m in log2 units). A split with l = 0 saw no key
// of the row and is skipped; a row with no key at all gets O = 0 and LSE = -inf, as the tile kernel
// (attention.wgsl) writes.
//
// One workgroup per row of the host's range: id = (pair - pair0) * rows + r, row r = (query
// r / group, query head kv head * group + r % group). The state of split s of row r is
// (((pair - pair0) * n_splits + s) * rblocks + r / rb) * rb + r % rb (O part: D / 4 vec4s
// from state * D / 4). The splits go in chunks of WG: each invocation computes one split's weight
// 2^(m - M) into w_sh, then invocation (split lane sl, vec4 column dq) sums the chunk's splits
// sl, sl + SL, ... (SL = WG / (D / 4) lanes) of column dq, four loads in flight at a time into
// four accumulators; the sums are added in a fixed order at the end. O: store_t in Q's layout
// (element strides q_s*), LSE: f32 [B, Hq, Nq].
alias store_t = f32;

const WG: u32 = 256u;

@group(0) @binding(4) var<storage, read> opart: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> ml: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> o: array<store_t>;
@group(0) @binding(7) var<storage, read_write> lse: array<f32>;

var<workgroup> red: array<f32, WG>;
var<workgroup> w_sh: array<f32, WG>;
var<workgroup> acc_sh: array<vec4<f32>, WG>;

// The tree reduction of red (max when `is_max`, else sum); every invocation gets the result.
fn reduce(lid: u32, x: f32, is_max: bool) -> f32 {
    workgroupBarrier();
    red[lid] = x;
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        workgroupBarrier();
        if (lid < s) {
            if (is_max) {
                red[lid] = max(red[lid], red[lid + s]);
            } else {
                red[lid] += red[lid + s];
            }
        }
    }
    return workgroupUniformLoad(&red[0]);
}

// Split j of the chunk (state at + j * rblocks * rb) weighted, or zero past the chunk's n
// splits or for a split without keys (weight 0).
fn term(at: u32, j: u32, n: u32, hd4: u32, dq: u32) -> vec4<f32> {
    if (j >= n) { return vec4<f32>(0.0); }
    let wj = w_sh[j];
    if (wj > 0.0) { return opart[(at + j * p.rblocks * p.rb) * hd4 + dq] * wj; }
    return vec4<f32>(0.0);
}

@compute @workgroup_size(WG)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
    if (id >= p.wg_count) { return; }
    let r = id % p.rows;
    let pair = p.pair0 + id / p.rows;
    let b = pair / p.kv_heads;
    let h = (pair % p.kv_heads) * p.group + r % p.group;
    let i = r / p.group;
    // State of split s: st0 + s * sstride.
    let st0 = ((id / p.rows) * p.n_splits * p.rblocks + r / p.rb) * p.rb + r % p.rb;
    let sstride = p.rblocks * p.rb;
    var mx = NEG;
    for (var s = lid; s < p.n_splits; s += WG) {
        let e = ml[st0 + s * sstride];
        if (e.y > 0.0) { mx = max(mx, e.x); }
    }
    let mm = reduce(lid, mx, true);
    var ls = 0.0;
    for (var s = lid; s < p.n_splits; s += WG) {
        let e = ml[st0 + s * sstride];
        if (e.y > 0.0) { ls += e.y * exp2(e.x - mm); }
    }
    let ll = reduce(lid, ls, false);
    if (lid == 0u) {
        var out = bitcast<f32>(neg_inf_bits());
        if (ll > 0.0) { out = (mm + log2(ll)) * 0.6931471805599453; }
        lse[(b * p.q_heads + h) * p.q_len + i] = out;
    }
    let hd4 = p.head_dim / 4u;
    let sl_n = WG / hd4;
    let sl = lid / hd4;
    let dq = lid % hd4;
    var acc = mat4x4<f32>();
    for (var c0 = 0u; c0 < p.n_splits; c0 += WG) {
        workgroupBarrier();
        var w = 0.0;
        if (c0 + lid < p.n_splits) {
            let e = ml[st0 + (c0 + lid) * sstride];
            if (e.y > 0.0) { w = exp2(e.x - mm); }
        }
        w_sh[lid] = w;
        workgroupBarrier();
        if (sl < sl_n) {
            // Four independent loads in flight per step.
            let n = min(WG, p.n_splits - c0);
            let at = st0 + c0 * sstride;
            for (var j = sl; j < n; j += 4u * sl_n) {
                acc[0] += term(at, j, n, hd4, dq);
                acc[1] += term(at, j + sl_n, n, hd4, dq);
                acc[2] += term(at, j + 2u * sl_n, n, hd4, dq);
                acc[3] += term(at, j + 3u * sl_n, n, hd4, dq);
            }
        }
    }
    acc_sh[lid] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    workgroupBarrier();
    if (lid < hd4) {
        var sum = vec4<f32>(0.0);
        for (var j = 0u; j < sl_n; j++) { sum += acc_sh[j * hd4 + lid]; }
        var val = vec4<f32>(0.0);
        if (ll > 0.0) { val = sum / ll; }
        let at = b * p.q_sb + h * p.q_sh + i * p.q_sn + 4u * lid;
        o[at] = store_t(val.x);
        o[at + 1u] = store_t(val.y);
        o[at + 2u] = store_t(val.z);
        o[at + 3u] = store_t(val.w);
    }
}
