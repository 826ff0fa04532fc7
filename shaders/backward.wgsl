// Backward pass of block-sparse attention (PISA.md section 4), FlashAttention-2 style: P is
// recomputed from Q, K and the forward's LSE; D_i = rowsum(dO_i * O_i);
// dS = P * (dO.V^T - D); dQ = s * dS K; dK = s * dS^T Q; dV = P^T dO.
//
// Layouts: Q, O, dO (store_t) and dQ (f32) share Q's strides (q_sb, q_sh, q_sn); K, V
// (store_t) and dK, dV (f32) share K's (k_sb, k_sh, k_sn); element d is contiguous.
// stats: vec2<f32> [B, Hq, Nq] = (lse, D). sel: i32 [B, Hkv, Nq, K]. pairs: the key-block-major
// index of shaders/backward_index.wgsl, (block, query) per entry, sorted per (b, kv head).
//
// Constants substituted per variant: HD (head dim), G (GQA group), KTILE (keys in workgroup
// memory: per dQ tile, or per dK/dV workgroup), QROWS (query rows in workgroup memory: G for
// dQ, rows per round for dK/dV). K and V tiles are padded to
// HD + 1 floats per key so threads reading the same d of consecutive keys hit distinct banks.
// Sums run in a fixed order: results are bitwise deterministic.
alias store_t = f32;

const WG: u32 = 128u;
const HD: u32 = 64u;
const G: u32 = 1u;
const KTILE: u32 = 8u;
const QROWS: u32 = 8u;
const HP: u32 = HD + 1u;
const EQ: u32 = (G * HD + WG - 1u) / WG;
const EK: u32 = (KTILE * HD + WG - 1u) / WG;
const DROWS: u32 = 16u;
const DLANES: u32 = WG / DROWS;

struct Params {
    q_sb: u32, q_sh: u32, q_sn: u32, k_sb: u32,
    k_sh: u32, k_sn: u32, q_heads: u32, kv_heads: u32,
    q_len: u32, k_len: u32, top_k: u32, block_size: u32,
    nb0: u32, q_offset: u32, causal: u32, scale: f32,
    entries: u32, ksub: u32, wg_count: u32, rows: u32,
    splits: u32, split_rows: u32, kv_elems: u32, pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<store_t>;
@group(0) @binding(2) var<storage, read> k: array<store_t>;
@group(0) @binding(3) var<storage, read> v: array<store_t>;
@group(0) @binding(4) var<storage, read> o: array<store_t>;
@group(0) @binding(5) var<storage, read> d_o: array<store_t>;
@group(0) @binding(6) var<storage, read> lse: array<f32>;
@group(0) @binding(7) var<storage, read_write> stats: array<vec2<f32>>;
@group(0) @binding(8) var<storage, read> pairs: array<vec2<u32>>;
@group(0) @binding(9) var<storage, read> sel: array<i32>;
@group(0) @binding(10) var<storage, read_write> dq: array<f32>;
@group(0) @binding(11) var<storage, read_write> dk: array<f32>;
@group(0) @binding(12) var<storage, read_write> dv: array<f32>;
@group(0) @binding(13) var<storage, read> dk_parts: array<f32>;
@group(0) @binding(14) var<storage, read> dv_parts: array<f32>;

var<workgroup> ks: array<f32, KTILE * HP>;
var<workgroup> vs: array<f32, KTILE * HP>;
var<workgroup> qs: array<f32, QROWS * HD>;
var<workgroup> dos: array<f32, QROWS * HD>;
var<workgroup> ps: array<f32, QROWS * KTILE>;
var<workgroup> dss: array<f32, QROWS * KTILE>;
var<workgroup> rstat: array<vec2<f32>, QROWS>;
var<workgroup> rpos: array<u32, QROWS>;
var<workgroup> red: array<f32, WG>;
var<workgroup> wg_blk: i32;
var<workgroup> wg_lo: u32;
var<workgroup> wg_hi: u32;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}

fn q_at(b: u32, hq: u32, i: u32) -> u32 {
    return b * p.q_sb + hq * p.q_sh + i * p.q_sn;
}

fn k_at(b: u32, h: u32, t: u32) -> u32 {
    return b * p.k_sb + h * p.k_sh + t * p.k_sn;
}

// D_i = sum_d dO_id * O_id for DROWS rows per workgroup, DLANES lanes per row; also copies the
// row's LSE so the gradient kernels read both from one binding. Row r = (b * Hq + hq) * Nq + i.
@compute @workgroup_size(WG)
fn row_dot(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let r = id * DROWS + lid / DLANES;
    let lane = lid % DLANES;
    var s = 0.0;
    if (r < p.rows) {
        let i = r % p.q_len;
        let hq = (r / p.q_len) % p.q_heads;
        let base = q_at(r / (p.q_len * p.q_heads), hq, i);
        for (var d = lane; d < HD; d += DLANES) {
            s += f32(d_o[base + d]) * f32(o[base + d]);
        }
    }
    red[lid] = s;
    workgroupBarrier();
    if (lane == 0u && r < p.rows) {
        var t = 0.0;
        for (var x = 0u; x < DLANES; x++) { t += red[lid + x]; }
        stats[r] = vec2<f32>(lse[r], t);
    }
}

// Block of slot m of selection row `row` (flat start) for a query at position `pos`, or -1 when
// the slot is padding, out of range, wholly in the future (causal), or repeats an earlier slot.
fn valid_block(row: u32, m: u32, pos: u32) -> i32 {
    let j = sel[row + m];
    if (j < 0 || u32(j) >= p.nb0) { return -1; }
    if (p.causal != 0u && u32(j) * p.block_size > pos) { return -1; }
    for (var x = 0u; x < m; x++) {
        if (sel[row + x] == j) { return -1; }
    }
    return j;
}

// dQ: one workgroup per (b, kv head, query) and its G query heads, walking its selected blocks
// KTILE keys at a time. A gather: no other workgroup writes these rows.
@compute @workgroup_size(WG)
fn grad_q(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let i = id % p.q_len;
    let bh = id / p.q_len;
    let b = bh / p.kv_heads;
    let h = bh % p.kv_heads;
    let pos = p.q_offset + i;
    var kend = p.k_len;
    if (p.causal != 0u) { kend = min(kend, pos + 1u); }
    for (var e = lid; e < G * HD; e += WG) {
        let at = q_at(b, h * G + e / HD, i) + e % HD;
        qs[e] = f32(q[at]);
        dos[e] = f32(d_o[at]);
    }
    for (var x = lid; x < G; x += WG) {
        rstat[x] = stats[(b * p.q_heads + h * G + x) * p.q_len + i];
    }
    var acc: array<f32, EQ>;
    for (var m = 0u; m < EQ; m++) { acc[m] = 0.0; }
    let row = id * p.top_k;
    for (var m = 0u; m < p.top_k; m++) {
        if (lid == 0u) { wg_blk = valid_block(row, m, pos); }
        let j = workgroupUniformLoad(&wg_blk);
        workgroupBarrier(); // wg_blk is rewritten next iteration
        if (j < 0) { continue; }
        let t1 = min(u32(j) * p.block_size + p.block_size, kend);
        for (var ta = u32(j) * p.block_size; ta < t1; ta += KTILE) {
            let n = min(KTILE, t1 - ta);
            for (var e = lid; e < n * HD; e += WG) {
                let at = k_at(b, h, ta + e / HD) + e % HD;
                ks[(e / HD) * HP + e % HD] = f32(k[at]);
                vs[(e / HD) * HP + e % HD] = f32(v[at]);
            }
            workgroupBarrier();
            for (var x = lid; x < G * KTILE; x += WG) {
                let g = x / KTILE;
                let t = x % KTILE;
                var ds = 0.0;
                if (t < n) {
                    var sc = 0.0;
                    var dp = 0.0;
                    for (var d = 0u; d < HD; d++) {
                        sc += qs[g * HD + d] * ks[t * HP + d];
                        dp += dos[g * HD + d] * vs[t * HP + d];
                    }
                    let pr = exp(p.scale * sc - rstat[g].x);
                    ds = p.scale * pr * (dp - rstat[g].y);
                }
                dss[x] = ds;
            }
            workgroupBarrier();
            for (var m2 = 0u; m2 < EQ; m2++) {
                let e = lid + m2 * WG;
                if (e < G * HD) {
                    let g = e / HD;
                    let d = e % HD;
                    var a = acc[m2];
                    for (var t = 0u; t < n; t++) { a += dss[g * KTILE + t] * ks[t * HP + d]; }
                    acc[m2] = a;
                }
            }
            workgroupBarrier();
        }
    }
    for (var m = 0u; m < EQ; m++) {
        let e = lid + m * WG;
        if (e < G * HD) { dq[q_at(b, h * G + e / HD, i) + e % HD] = acc[m]; }
    }
}

// First index in [lo, hi) of the sorted pairs whose block is >= x.
fn lower_bound(lo0: u32, hi0: u32, x: u32) -> u32 {
    var lo = lo0;
    var hi = hi0;
    while (lo < hi) {
        let mid = lo + (hi - lo) / 2u;
        if (pairs[mid].x < x) { lo = mid + 1u; } else { hi = mid; }
    }
    return lo;
}

// dK, dV: one workgroup per (b, kv head, leaf block, split, key sub-tile of KTILE keys). It
// reads the queries that selected the block from the key-block-major index (in query order) and
// walks rows split * split_rows .. + split_rows of their (query, head) rows, QROWS at a time;
// the KTILE x HD accumulators live in registers. With one split (p.splits = 1) the workgroup
// writes dK and dV themselves; with several (devices that cap an invocation's loop iterations,
// where one workgroup could not walk a block every query selected) split s writes its partial
// sums at s * kv_elems of dk, dv (then buffers of splits x the elements) and `sum_splits`
// adds them. No other workgroup writes these elements: no atomics, and the sum order is fixed.
@compute @workgroup_size(WG)
fn grad_kv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let sub = id % p.ksub;
    let split = (id / p.ksub) % p.splits;
    let j = (id / (p.ksub * p.splits)) % p.nb0;
    let bh = id / (p.ksub * p.splits * p.nb0);
    let b = bh / p.kv_heads;
    let h = bh % p.kv_heads;
    let t0 = j * p.block_size + sub * KTILE;
    let t1 = min(min(t0 + KTILE, j * p.block_size + p.block_size), p.k_len);
    if (t0 >= t1) { return; }
    let n = t1 - t0;
    for (var e = lid; e < n * HD; e += WG) {
        let at = k_at(b, h, t0 + e / HD) + e % HD;
        ks[(e / HD) * HP + e % HD] = f32(k[at]);
        vs[(e / HD) * HP + e % HD] = f32(v[at]);
    }
    if (lid == 0u) {
        let seg = bh * p.entries;
        let lo = lower_bound(seg, seg + p.entries, j);
        wg_lo = lo;
        wg_hi = lower_bound(lo, seg + p.entries, j + 1u);
    }
    let lo = workgroupUniformLoad(&wg_lo);
    let all_rows = (workgroupUniformLoad(&wg_hi) - lo) * G;
    let r_begin = min(split * p.split_rows, all_rows);
    let rows = min(all_rows - r_begin, p.split_rows);
    var acc_k: array<f32, EK>;
    var acc_v: array<f32, EK>;
    for (var m = 0u; m < EK; m++) {
        acc_k[m] = 0.0;
        acc_v[m] = 0.0;
    }
    for (var r0 = 0u; r0 < rows; r0 += QROWS) {
        let nr = min(QROWS, rows - r0);
        for (var e = lid; e < nr * HD; e += WG) {
            let rr = r_begin + r0 + e / HD;
            let i = pairs[lo + rr / G].y;
            let at = q_at(b, h * G + rr % G, i) + e % HD;
            qs[e] = f32(q[at]);
            dos[e] = f32(d_o[at]);
        }
        if (lid < nr) {
            let rr = r_begin + r0 + lid;
            let i = pairs[lo + rr / G].y;
            rstat[lid] = stats[(b * p.q_heads + h * G + rr % G) * p.q_len + i];
            rpos[lid] = p.q_offset + i;
        }
        workgroupBarrier();
        for (var x = lid; x < QROWS * KTILE; x += WG) {
            let r = x / KTILE;
            let t = x % KTILE;
            var pr = 0.0;
            var ds = 0.0;
            if (r < nr && t < n) {
                let mt = rstat[r];
                if (p.causal == 0u || t0 + t <= rpos[r]) {
                    var sc = 0.0;
                    var dp = 0.0;
                    for (var d = 0u; d < HD; d++) {
                        sc += qs[r * HD + d] * ks[t * HP + d];
                        dp += dos[r * HD + d] * vs[t * HP + d];
                    }
                    pr = exp(p.scale * sc - mt.x);
                    ds = p.scale * pr * (dp - mt.y);
                }
            }
            ps[x] = pr;
            dss[x] = ds;
        }
        workgroupBarrier();
        for (var m = 0u; m < EK; m++) {
            let e = lid + m * WG;
            let t = e / HD;
            let d = e % HD;
            if (t < n) {
                var ak = acc_k[m];
                var av = acc_v[m];
                // A row in the key's past (causal) is skipped with select, not weighted by
                // P = dS = 0: 0 * NaN = NaN would carry a non-finite Q or dO of that row into
                // the gradient of a key it never saw.
                for (var r = 0u; r < nr; r++) {
                    let on = p.causal == 0u || t0 + t <= rpos[r];
                    av = select(av, av + ps[r * KTILE + t] * dos[r * HD + d], on);
                    ak = select(ak, ak + dss[r * KTILE + t] * qs[r * HD + d], on);
                }
                acc_k[m] = ak;
                acc_v[m] = av;
            }
        }
        workgroupBarrier();
    }
    for (var m = 0u; m < EK; m++) {
        let e = lid + m * WG;
        let t = e / HD;
        if (t < n) {
            let at = split * p.kv_elems + k_at(b, h, t0 + t) + e % HD;
            dk[at] = acc_k[m];
            dv[at] = acc_v[m];
        }
    }
}

// dK, dV as the sums of grad_kv's splits in split order (used only with several splits): one
// invocation per element e of dK and dV (both [kv_elems], any layout: the element index is the
// same in the parts), WG elements per workgroup.
@compute @workgroup_size(WG)
fn sum_splits(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let e = id * WG + lid;
    if (e >= p.kv_elems) { return; }
    var sk = 0.0;
    var sv = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        sk += dk_parts[s * p.kv_elems + e];
        sv += dv_parts[s * p.kv_elems + e];
    }
    dk[e] = sk;
    dv[e] = sv;
}
