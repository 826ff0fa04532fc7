// Block-sparse attention over selected leaves and the dense FlashAttention baseline
// (PISA.md section 4). Host: pisa-wgpu/src/ops/attention.rs. Params, the bindings shared with
// the tensor-core twin (attention_coop.wgsl) and the selection union: attention_common.wgsl,
// appended.
//
// One workgroup owns RP rows = (query head, query) pairs of one KV head: the GH query heads of
// a head chunk times QT consecutive queries (row r: query r / GH, head r % GH; rows past
// GH * QT are padding). Every key tile (KT keys) is loaded once into workgroup memory and
// serves every row, with the online softmax (running max, running sum, f32 accumulators):
//   1. K tile -> kv_sh;                                                              barrier
//   2. S phase: thread (row srow, split scol) scores groups of 4 keys (scol + j*SPLIT,
//      j = 0..3, per group of KG = 4*SPLIT keys) into p_sh; its max -> red_sh;       barrier
//   3. row max; P = exp2(s - m) in place in p_sh; rescale factor -> alpha_sh;
//      V tile -> kv_sh;                                                              barrier
//   4. PV phase: thread (row group rg, column c) updates RM rows x one vec4 of O;    barrier
// Accumulators are vectors and matrices, never dynamically indexed arrays, so they stay in
// registers. Scores are in log2 units (Q is pre-multiplied by scale * log2(e));
// LSE = ln2 * (m + log2 l).
// Sparse: the tile's queries' selections are merged (ascending union, a bit mask of the queries
// that chose each block) and each selected block is walked in KT-key tiles; rows whose query
// did not choose a block are masked (and skip their work). Dense: every visible KT-key tile.
//
// Layouts: Q, K, V, O are vec4<store_t> arrays; element (b, h, n, 4c..4c+3) at
// b*sb + h*sh + n*sn + c (strides in vec4 units; O its own, o_s*). sel: i32 [B, Hkv, Nq, K];
// lse: f32 [B, Hq, Nq].
// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
alias store_t = f32;

const HD4: u32 = 32u;  // head dim / 4
const RM: u32 = 4u;    // rows per thread in the PV phase: 4 or 8 (divides HD4)
const RP: u32 = 16u;   // rows per workgroup (GH * QT rounded up to a multiple of RM)
const KT: u32 = 32u;   // keys per tile (a multiple of KG, or below KG: some S threads idle)
const QT: u32 = 4u;    // queries per workgroup (<= 32)
const SELK: u32 = 16u; // top_k (sparse; 1 for dense)

const ROW4: u32 = HD4 + 1u;        // padded workgroup row stride, vec4 (bank spread)
const WG: u32 = HD4 * (RP / RM);   // invocations
const SPLIT: u32 = HD4 / RM;       // S-phase threads per row (= WG / RP)
const KG: u32 = 4u * SPLIT;        // keys per S-phase group
const NG: u32 = (KT + KG - 1u) / KG; // groups per tile
const RP4: u32 = RP / 4u;
const NEG: f32 = -3.0e38;          // "no score" (finite: no reliance on infinities)

@group(0) @binding(1) var<storage, read> q: array<vec4<store_t>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<store_t>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<store_t>>;
@group(0) @binding(5) var<storage, read_write> o: array<vec4<store_t>>;

var<workgroup> q_sh: array<vec4<f32>, RP * ROW4>;
var<workgroup> kv_sh: array<vec4<f32>, KT * ROW4>;
var<workgroup> p_sh: array<vec4<f32>, KT * RP4>; // P[key][row], rows packed by 4
var<workgroup> red_sh: array<f32, WG>;
var<workgroup> alpha_sh: array<vec4<f32>, RP4>;

// Per-invocation state.
var<private> acc0: mat4x4<f32>; // PV rows rg*RM + j (column j), vec4 column c of O
var<private> acc1: mat4x4<f32>; // rows rg*RM + 4 + j when RM == 8
var<private> m_run: f32;        // running max of the S-phase row (log2 units)
var<private> l_run: f32;        // running sum over this thread's share of keys
var<private> lid: u32;
var<private> b: u32;
var<private> kvh: u32;
var<private> hq0: u32;    // first query head of the chunk
var<private> heads: u32;  // valid heads in the chunk
var<private> i0: u32;     // first query of the tile

fn row_valid(r: u32) -> bool {
    return r % p.gh < heads && r / p.gh < QT && i0 + r / p.gh < p.q_len;
}

// Decodes the workgroup, loads the Q tile (scaled) and resets the running state.
fn setup(id: u32, qt: u32) {
    let hc = id % p.head_chunks;
    let bh = id / (p.head_chunks * p.n_qtiles);
    b = bh / p.kv_heads;
    kvh = bh % p.kv_heads;
    hq0 = kvh * p.group + hc * p.gh;
    heads = min(p.gh, p.group - hc * p.gh);
    i0 = qt * QT;
    for (var x = lid; x < RP * HD4; x += WG) {
        let r = x / HD4;
        let c = x % HD4;
        var val = vec4<f32>(0.0);
        if (row_valid(r)) {
            let at = b * p.q_sb + (hq0 + r % p.gh) * p.q_sh + (i0 + r / p.gh) * p.q_sn + c;
            val = in4_q(at) * p.scale_log2;
        }
        q_sh[r * ROW4 + c] = val;
    }
    acc0 = mat4x4<f32>();
    acc1 = mat4x4<f32>();
    m_run = NEG;
    l_run = 0.0;
}

fn load_tile(from_v: bool, t0: u32, tcount: u32) {
    for (var x = lid; x < KT * HD4; x += WG) {
        let kk = x / HD4;
        let c = x % HD4;
        var val = vec4<f32>(0.0);
        let t = t0 + kk;
        if (kk < tcount && t < p.k_len) {
            if (from_v) {
                val = in4_v(b * p.v_sb + kvh * p.v_sh + t * p.v_sn + c);
            } else {
                val = in4_k(b * p.k_sb + kvh * p.k_sh + t * p.k_sn + c);
            }
        }
        kv_sh[kk * ROW4 + c] = val;
    }
}

fn key_ok(row_on: bool, kk: u32, t0: u32, tcount: u32, pos: u32) -> bool {
    let t = t0 + kk;
    return row_on && kk < KT && kk < tcount && t < p.k_len && (p.causal == 0u || t <= pos);
}

fn set_p(kk: u32, r: u32, x: f32) {
    p_sh[kk * RP4 + r / 4u][r % 4u] = x;
}

fn get_p(kk: u32, r: u32) -> f32 {
    return p_sh[kk * RP4 + r / 4u][r % 4u];
}

// acc + outer(vv, pv): column j (row j of O) gains pv[j] * vv.
fn pv_update(acc: mat4x4<f32>, pv: vec4<f32>, vv: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(acc[0] + pv.x * vv, acc[1] + pv.y * vv, acc[2] + pv.z * vv,
                       acc[3] + pv.w * vv);
}

// pv_update for the columns j with on[j] only: a masked (row, key) pair is skipped with select,
// never weighted by p = 0, since 0 * NaN = NaN would carry a non-finite value into a row that
// must not see it (a future key of the row, or a block the row did not select).
fn pv_update_masked(acc: mat4x4<f32>, pv: vec4<f32>, vv: vec4<f32>, on: vec4<bool>)
    -> mat4x4<f32> {
    return mat4x4<f32>(select(acc[0], acc[0] + pv.x * vv, on.x),
                       select(acc[1], acc[1] + pv.y * vv, on.y),
                       select(acc[2], acc[2] + pv.z * vv, on.z),
                       select(acc[3], acc[3] + pv.w * vv, on.w));
}

// Keys of the tile (kk < keys) that row r attends: 0 for a padding row or one whose query did
// not choose the block; else the tile's loaded keys up to the row's position (causal). Every
// bound of key_ok is an upper bound on kk, so the attended keys are a prefix of the tile.
fn row_keys(r: u32, t0: u32, tcount: u32, mask: u32) -> u32 {
    if (!row_valid(r) || ((mask >> (r / p.gh)) & 1u) == 0u || t0 >= p.k_len) { return 0u; }
    var n = min(min(tcount, KT), p.k_len - t0);
    if (p.causal != 0u) {
        let pos = p.k_len - p.q_len + i0 + r / p.gh;
        n = select(0u, min(n, pos + 1u - t0), pos >= t0);
    }
    return n;
}

fn scale_cols(acc: mat4x4<f32>, a: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(acc[0] * a.x, acc[1] * a.y, acc[2] * a.z, acc[3] * a.w);
}

// One tile of keys t0 .. t0 + tcount (tcount <= KT) for the rows whose query bit is in `mask`.
// Must be called in uniform control flow.
fn process_tile(t0: u32, tcount: u32, mask: u32) {
    load_tile(false, t0, tcount);
    workgroupBarrier();
    // S phase: raw scores of 4 keys at a time into p_sh, and their max.
    let srow = lid / SPLIT;
    let scol = lid % SPLIT;
    let sq = srow / p.gh;
    let row_on = row_valid(srow) && ((mask >> sq) & 1u) != 0u;
    let pos = p.k_len - p.q_len + i0 + sq;
    var tmax = NEG;
    for (var g = 0u; g < NG; g++) {
        let k0 = g * KG + scol;
        let k1 = k0 + SPLIT;
        let k2 = k0 + 2u * SPLIT;
        let k3 = k0 + 3u * SPLIT;
        var s4 = vec4<f32>(0.0);
        if (row_on) {
            let qa = srow * ROW4;
            let ka0 = min(k0, KT - 1u) * ROW4;
            let ka1 = min(k1, KT - 1u) * ROW4;
            let ka2 = min(k2, KT - 1u) * ROW4;
            let ka3 = min(k3, KT - 1u) * ROW4;
            for (var c = 0u; c < HD4; c++) {
                let qv = q_sh[qa + c];
                s4 += vec4<f32>(dot(qv, kv_sh[ka0 + c]), dot(qv, kv_sh[ka1 + c]),
                                dot(qv, kv_sh[ka2 + c]), dot(qv, kv_sh[ka3 + c]));
            }
        }
        let ok = vec4<bool>(key_ok(row_on, k0, t0, tcount, pos),
                            key_ok(row_on, k1, t0, tcount, pos),
                            key_ok(row_on, k2, t0, tcount, pos),
                            key_ok(row_on, k3, t0, tcount, pos));
        s4 = select(vec4<f32>(NEG), s4, ok);
        tmax = max(tmax, max(max(s4.x, s4.y), max(s4.z, s4.w)));
        if (k0 < KT) { set_p(k0, srow, s4.x); }
        if (k1 < KT) { set_p(k1, srow, s4.y); }
        if (k2 < KT) { set_p(k2, srow, s4.z); }
        if (k3 < KT) { set_p(k3, srow, s4.w); }
    }
    red_sh[lid] = tmax;
    workgroupBarrier();
    var rmax = m_run;
    for (var x = 0u; x < SPLIT; x++) { rmax = max(rmax, red_sh[srow * SPLIT + x]); }
    let alpha = exp2(m_run - rmax);
    var lsum = 0.0;
    for (var g = 0u; g < NG; g++) {
        for (var j = 0u; j < 4u; j++) {
            let kk = g * KG + scol + j * SPLIT;
            if (kk < KT) {
                let sj = get_p(kk, srow);
                let pj = select(0.0, exp2(sj - rmax), sj > NEG);
                lsum += pj;
                set_p(kk, srow, pj);
            }
        }
    }
    l_run = l_run * alpha + lsum;
    m_run = rmax;
    if (scol == 0u) { alpha_sh[srow / 4u][srow % 4u] = alpha; }
    load_tile(true, t0, tcount);
    workgroupBarrier();
    // PV phase (skipped when none of this thread's rows chose the block). When every row of the
    // thread attends every loaded key (the keys past them are zero in kv_sh), all keys are
    // accumulated; otherwise (the diagonal tile, the tile's last keys, or a row that did not
    // choose the block) each row takes only the keys it attends: a masked key is skipped, not
    // weighted by 0.
    let c = lid % HD4;
    let r0 = (lid / HD4) * RM;
    var any_on = false;
    for (var j = 0u; j < RM; j++) { any_on = any_on || ((mask >> ((r0 + j) / p.gh)) & 1u) != 0u; }
    if (any_on) {
        let g0 = r0 / 4u;
        var a0 = scale_cols(acc0, alpha_sh[g0]);
        var a1 = acc1;
        if (RM == 8u) { a1 = scale_cols(acc1, alpha_sh[g0 + 1u]); }
        let full = select(0u, min(min(tcount, KT), p.k_len - min(t0, p.k_len)), t0 < p.k_len);
        let n0 = vec4<u32>(row_keys(r0, t0, tcount, mask), row_keys(r0 + 1u, t0, tcount, mask),
                           row_keys(r0 + 2u, t0, tcount, mask), row_keys(r0 + 3u, t0, tcount, mask));
        var n1 = vec4<u32>(0u);
        if (RM == 8u) {
            n1 = vec4<u32>(row_keys(r0 + 4u, t0, tcount, mask), row_keys(r0 + 5u, t0, tcount, mask),
                           row_keys(r0 + 6u, t0, tcount, mask), row_keys(r0 + 7u, t0, tcount, mask));
        }
        if (all(n0 >= vec4<u32>(full)) && (RM != 8u || all(n1 >= vec4<u32>(full)))) {
            for (var kk = 0u; kk < KT; kk++) {
                let vv = kv_sh[kk * ROW4 + c];
                a0 = pv_update(a0, p_sh[kk * RP4 + g0], vv);
                if (RM == 8u) { a1 = pv_update(a1, p_sh[kk * RP4 + g0 + 1u], vv); }
            }
        } else {
            let kmax = max(max(max(n0.x, n0.y), max(n0.z, n0.w)), max(max(n1.x, n1.y), max(n1.z, n1.w)));
            for (var kk = 0u; kk < kmax; kk++) {
                let vv = kv_sh[kk * ROW4 + c];
                let kv = vec4<u32>(kk);
                a0 = pv_update_masked(a0, p_sh[kk * RP4 + g0], vv, kv < n0);
                if (RM == 8u) { a1 = pv_update_masked(a1, p_sh[kk * RP4 + g0 + 1u], vv, kv < n1); }
            }
        }
        acc0 = a0;
        acc1 = a1;
    }
    workgroupBarrier();
}

fn write_row(r: u32, c: u32, x: vec4<f32>) {
    if (row_valid(r)) {
        let l = alpha_sh[r / 4u][r % 4u];
        var val = vec4<f32>(0.0);
        if (l > 0.0) { val = x / l; }
        let at = b * p.o_sb + (hq0 + r % p.gh) * p.o_sh + (i0 + r / p.gh) * p.o_sn + c;
        o[at] = vec4<store_t>(val);
    }
}

// Reduces the running sums, writes O = acc / l and LSE (zeros and -inf for an empty row).
fn finish() {
    red_sh[lid] = l_run;
    workgroupBarrier();
    let srow = lid / SPLIT;
    if (lid % SPLIT == 0u) {
        var l = 0.0;
        for (var x = 0u; x < SPLIT; x++) { l += red_sh[srow * SPLIT + x]; }
        alpha_sh[srow / 4u][srow % 4u] = l;
        if (row_valid(srow)) {
            let i = i0 + srow / p.gh;
            let hq = hq0 + srow % p.gh;
            var out = bitcast<f32>(neg_inf_bits());
            if (l > 0.0) { out = (m_run + log2(l)) * 0.6931471805599453; }
            lse[(b * p.q_heads + hq) * p.q_len + i] = out;
        }
    }
    workgroupBarrier();
    let c = lid % HD4;
    let r0 = (lid / HD4) * RM;
    write_row(r0, c, acc0[0]);
    write_row(r0 + 1u, c, acc0[1]);
    write_row(r0 + 2u, c, acc0[2]);
    write_row(r0 + 3u, c, acc0[3]);
    if (RM == 8u) {
        write_row(r0 + 4u, c, acc1[0]);
        write_row(r0 + 5u, c, acc1[1]);
        write_row(r0 + 6u, c, acc1[2]);
        write_row(r0 + 7u, c, acc1[3]);
    }
}

@compute @workgroup_size(WG)
fn sparse(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) li: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    lid = li;
    let qt = (id / p.head_chunks) % p.n_qtiles;
    setup(id, qt);
    // The ascending union of the tile's selections (attention_common.wgsl).
    let nu = build_union(lid, (b * p.kv_heads + kvh) * p.q_len, i0);
    // Only the keys some row of the tile may see are walked: a block's keys below Nk and, when
    // causal, up to the tile's last query position. Tiles past them would be empty or masked
    // for every row; walking hundreds of them (a long block) gave wrong outputs on lavapipe
    // (lavapipe's loop limit: docs/benchmarks.md, A.8; tests/lavapipe_loops.rs), besides costing
    // time.
    // The loops' bounds are uniform as WGSL's analysis sees it (process_tile has barriers): the
    // tile's first query from the workgroup id, not from the private i0, and the union's
    // entries through workgroupUniformLoad. (Tint, the browsers' WGSL compiler, rejected the
    // module otherwise; naga does not check this.)
    var end = p.k_len;
    if (p.causal != 0u) { end = p.k_len - p.q_len + min(qt * QT + QT, p.q_len); }
    for (var u = 0u; u < nu; u++) {
        let blk0 = workgroupUniformLoad(&ublk[u]) * p.block_size;
        let m = workgroupUniformLoad(&umask[u]);
        let span = min(p.block_size, end - min(blk0, end));
        for (var off = 0u; off < span; off += KT) {
            process_tile(blk0 + off, min(p.block_size - off, KT), m);
        }
    }
    finish();
}

@compute @workgroup_size(WG)
fn dense(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    lid = li;
    var qt = (id / p.head_chunks) % p.n_qtiles;
    if (p.causal != 0u) { qt = p.n_qtiles - 1u - qt; } // longest rows first
    setup(id, qt);
    var n_keys = p.k_len;
    if (p.causal != 0u) {
        let last = min(qt * QT + QT, p.q_len) - 1u;
        n_keys = p.k_len - p.q_len + last + 1u;
    }
    let tiles = (n_keys + KT - 1u) / KT;
    for (var j = 0u; j < tiles; j++) {
        process_tile(j * KT, KT, 0xffffffffu);
    }
    finish();
}
