// Split-K dense attention (FlashDecoding), part 1 of 2: the partial online-softmax state of
// every row of a row block over one split of the keys. Host: pisa-wgpu/src/ops/attention/
// split_k.rs; part 2 (the merge over the splits): attention_split_merge.wgsl.
//
// One workgroup per (b, KV head) pair of the host's range, split and row block: id =
// ((pair - pair0) * n_splits + split) * rblocks + row block (the row blocks of a split are
// neighbours, so they read the same keys at about the same time, from cache). Row r of a pair is
// (query r / group, query head kv head * group + r % group); a row block holds the 4 rows
// 4 rb .. 4 rb + 3 (rows past `rows` are padding). The split covers keys split * S ..
// min(split * S + S, Nk); key t is visible to query i iff t <= Nk - Nq + i when causal.
//
// Memory-bound layout: the workgroup is KG key groups of DC = D / 8 lanes; lane c of a key
// group owns 8 elements of every row (f16: elements 8c .. 8c + 7, one 16-byte load; f32:
// 4c .. 4c + 3 and D/2 + 4c .. D/2 + 4c + 3, two 16-byte loads), so a key group reads a K or V
// row with contiguous 16-byte loads. A batch is KB = KG * NB keys (key group kg takes keys
// t0 + j * KG + kg, j < NB); all loads of the next batch are issued into registers before the
// current batch is used. Per batch: lane partial dot products, 4 rows at once -> red
// (barrier); lane j < NB of a key group sums its key's partials -> sc (barrier); every lane
// updates its key group's online softmax (running max m and sum l per row, f32 accumulators
// of its 8 elements per row) with the batch's keys; a masked (row, key) pair is skipped, never
// weighted by 0 (0 * NaN). At the end the key groups' states are merged (max, rescale, tree
// sum through red) and key group 0 writes the state: opart[(id * 4 + j) * D + e] (unnormalised
// O, f32) and ml[id * 4 + j] = (m, l) for row j of the block, m in log2 units of the scaled
// scores (Q is pre-multiplied by scale * log2(e)); a row with no visible key in the split gets
// (-1e30, 0) and zeros.
//
// The 4 rows are the columns of 4x4 matrices and the components of vectors, and a batch's
// keys are struct fields: nothing is a dynamically indexed private array, so all of it stays
// in registers.
//
// Bindings: Q, K, V as 16-byte words (any storage; strides from the Params, in elements; every
// row starts at a multiple of 16 elements); opart vec4<f32>, ml vec2<f32>.
// The Params, the uniform `p` and NEG: attention_split_common.wgsl (appended by the host).
alias store_t = f32;

const F16: u32 = 0u;    // 1: Q, K, V hold f16 (8 per 16-byte word); 0: f32 (4 per word)
const DC: u32 = 16u;    // lanes per key group = head dim / 8
const KG: u32 = 8u;     // key groups per workgroup
const NB: u32 = 4u;     // keys per key group per batch: 4 (f16) or 2 (f32)
const RED: u32 = 544u;  // vec4s of red: max(KG * NB * (DC + 1), KG / 2 * DC * 8)

const WG: u32 = KG * DC;
const KB: u32 = KG * NB;    // keys per batch
const PSTR: u32 = DC + 1u;  // padded stride of one key's lane partials (bank spread)

@group(0) @binding(1) var<storage, read> q: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> opart: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> ml: array<vec2<f32>>;

var<workgroup> red: array<vec4<f32>, RED>;
var<workgroup> sc: array<vec4<f32>, KB>;   // scores of a key, 4 rows
var<workgroup> mk: array<vec4<f32>, KG>;   // per key group: running max of the 4 rows
var<workgroup> lk: array<vec4<f32>, KG>;   // per key group: running sum

// 8 elements of a row: lo and hi halves of a lane's share.
struct V8 { lo: vec4<f32>, hi: vec4<f32> }
// One key's words for a lane (w2: the second word of f32 storage).
struct KV { k: vec4<u32>, k2: vec4<u32>, v: vec4<u32>, v2: vec4<u32> }
struct Batch { a: KV, b: KV, c: KV, d: KV }
// A lane's per-row state: accumulators (column j = row j), max and sum.
struct State { lo: mat4x4<f32>, hi: mat4x4<f32>, m: vec4<f32>, l: vec4<f32> }

fn unpack8(a: vec4<u32>, b: vec4<u32>) -> V8 {
    if (F16 == 1u) {
        return V8(vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y)),
                  vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w)));
    }
    return V8(bitcast<vec4<f32>>(a), bitcast<vec4<f32>>(b));
}

// Lane c's first 16-byte word of the row starting at element e.
fn word(e: u32, c: u32) -> u32 {
    if (F16 == 1u) { return e / 8u + c; }
    return e / 4u + c;
}

// Key t's words for lane c (zeros past s_end).
fn load_key(t: u32, s_end: u32, kbase: u32, vbase: u32, c: u32) -> KV {
    var x = KV(vec4<u32>(0u), vec4<u32>(0u), vec4<u32>(0u), vec4<u32>(0u));
    if (t < s_end) {
        let kw = word(kbase + t * p.k_sn, c);
        let vw = word(vbase + t * p.v_sn, c);
        x.k = k[kw];
        x.v = v[vw];
        if (F16 == 0u) {
            x.k2 = k[kw + DC];
            x.v2 = v[vw + DC];
        }
    }
    return x;
}

// The batch at t0: key j of key group kg is t0 + j * KG + kg (keys 2, 3 only when NB = 4).
fn load_batch(t0: u32, s_end: u32, kbase: u32, vbase: u32, c: u32, kg: u32) -> Batch {
    let z = KV(vec4<u32>(0u), vec4<u32>(0u), vec4<u32>(0u), vec4<u32>(0u));
    var x = Batch(z, z, z, z);
    x.a = load_key(t0 + kg, s_end, kbase, vbase, c);
    x.b = load_key(t0 + KG + kg, s_end, kbase, vbase, c);
    if (NB == 4u) {
        x.c = load_key(t0 + 2u * KG + kg, s_end, kbase, vbase, c);
        x.d = load_key(t0 + 3u * KG + kg, s_end, kbase, vbase, c);
    }
    return x;
}

// Lane partial scores of one key for the 4 rows (component j: row j).
fn partial_scores(x: KV, qlo: mat4x4<f32>, qhi: mat4x4<f32>) -> vec4<f32> {
    let kk = unpack8(x.k, x.k2);
    return kk.lo * qlo + kk.hi * qhi;
}

// acc + p[j] * vv in column j where on[j] (a masked pair is skipped, not weighted by 0).
fn pv(acc: mat4x4<f32>, pr: vec4<f32>, vv: vec4<f32>, on: vec4<bool>) -> mat4x4<f32> {
    return mat4x4<f32>(select(acc[0], acc[0] + pr.x * vv, on.x),
                       select(acc[1], acc[1] + pr.y * vv, on.y),
                       select(acc[2], acc[2] + pr.z * vv, on.z),
                       select(acc[3], acc[3] + pr.w * vv, on.w));
}

fn scale_cols(acc: mat4x4<f32>, a: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(acc[0] * a.x, acc[1] * a.y, acc[2] * a.z, acc[3] * a.w);
}

fn masked(s: vec4<f32>, on: vec4<bool>) -> vec4<f32> {
    return select(vec4<f32>(NEG), s, on);
}

// Key x (score s, visible rows on) into the state, whose max already covers it.
fn attend(st: State, x: KV, s: vec4<f32>, on: vec4<bool>) -> State {
    let vv = unpack8(x.v, x.v2);
    let pr = select(vec4<f32>(0.0), exp2(s - st.m), on);
    return State(pv(st.lo, pr, vv.lo, on), pv(st.hi, pr, vv.hi, on), st.m, st.l + pr);
}

// Row r's key limit (keys t < n are visible; 0 for a padding row) and lane c's Q share.
struct Row { n: u32, x: V8 }

// The end of the keys row r sees within a split ending at s1 (0 past the rows): a function of
// the workgroup's row and split only, so that the key loop's bound is uniform as WGSL's
// analysis sees it (the loop has barriers; Tint, the browsers' compiler, rejects the module
// when the bound comes through `row`, whose loads depend on the invocation).
fn row_end(r: u32, s1: u32) -> u32 {
    if (r >= p.rows) { return 0u; }
    if (p.causal != 0u) { return min(s1, p.k_len - p.q_len + r / p.group + 1u); }
    return s1;
}

fn row(b: u32, kvh: u32, r: u32, s1: u32, c: u32) -> Row {
    var out = Row(0u, V8(vec4<f32>(0.0), vec4<f32>(0.0)));
    if (r < p.rows) {
        let i = r / p.group;
        let h = kvh * p.group + r % p.group;
        out.n = row_end(r, s1);
        let w = word(b * p.q_sb + h * p.q_sh + i * p.q_sn, c);
        var w2 = vec4<u32>(0u);
        if (F16 == 0u) { w2 = q[w + DC]; }
        out.x = unpack8(q[w], w2);
        out.x.lo *= p.scale_log2;
        out.x.hi *= p.scale_log2;
    }
    return out;
}

// The batch's keys into the state: new maxima over the visible pairs, rescale, then P V.
fn update(st0: State, x: Batch, t0: u32, kg: u32, lim: vec4<u32>) -> State {
    let base = kg * NB;
    let on0 = vec4<u32>(t0 + kg) < lim;
    let on1 = vec4<u32>(t0 + KG + kg) < lim;
    let on2 = vec4<u32>(t0 + 2u * KG + kg) < lim; // keys 2, 3: NB = 4 only (else s2 = s3 = NEG)
    let on3 = vec4<u32>(t0 + 3u * KG + kg) < lim;
    let s0 = sc[base];
    let s1 = sc[base + 1u];
    var s2 = vec4<f32>(NEG);
    var s3 = vec4<f32>(NEG);
    if (NB == 4u) {
        s2 = sc[base + 2u];
        s3 = sc[base + 3u];
    }
    let mx = max(max(st0.m, max(masked(s0, on0), masked(s1, on1))),
                 max(masked(s2, on2), masked(s3, on3)));
    let alpha = exp2(st0.m - mx);
    var st = State(scale_cols(st0.lo, alpha), scale_cols(st0.hi, alpha), mx, st0.l * alpha);
    st = attend(st, x.a, s0, on0);
    st = attend(st, x.b, s1, on1);
    if (NB == 4u) {
        st = attend(st, x.c, s2, on2);
        st = attend(st, x.d, s3, on3);
    }
    return st;
}

@compute @workgroup_size(WG)
fn partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let id = wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
    if (id >= p.wg_count) { return; }
    let c = lid % DC;
    let kg = lid / DC;
    let rbk = id % p.rblocks;
    let split = (id / p.rblocks) % p.n_splits;
    let pair = p.pair0 + id / (p.n_splits * p.rblocks);
    let b = pair / p.kv_heads;
    let kvh = pair % p.kv_heads;
    let s0 = split * p.split_keys;
    let s1 = s0 + min(p.split_keys, p.k_len - s0);
    let r0 = row(b, kvh, rbk * 4u, s1, c);
    let r1 = row(b, kvh, rbk * 4u + 1u, s1, c);
    let r2 = row(b, kvh, rbk * 4u + 2u, s1, c);
    let r3 = row(b, kvh, rbk * 4u + 3u, s1, c);
    let lim = vec4<u32>(row_end(rbk * 4u, s1), row_end(rbk * 4u + 1u, s1),
                        row_end(rbk * 4u + 2u, s1), row_end(rbk * 4u + 3u, s1));
    let qlo = mat4x4<f32>(r0.x.lo, r1.x.lo, r2.x.lo, r3.x.lo);
    let qhi = mat4x4<f32>(r0.x.hi, r1.x.hi, r2.x.hi, r3.x.hi);
    let s_end = max(s0, max(max(lim.x, lim.y), max(lim.z, lim.w)));
    let kbase = b * p.k_sb + kvh * p.k_sh;
    let vbase = b * p.v_sb + kvh * p.v_sh;
    var st = State(mat4x4<f32>(), mat4x4<f32>(), vec4<f32>(NEG), vec4<f32>(0.0));
    var next = load_batch(s0, s_end, kbase, vbase, c, kg);
    for (var t0 = s0; t0 < s_end; t0 += KB) {
        let x = next;
        if (t0 + KB < s_end) { next = load_batch(t0 + KB, s_end, kbase, vbase, c, kg); }
        // Lane partial scores of the batch's keys (4 rows each), summed per key by lane j.
        let at = kg * NB * PSTR + c;
        red[at] = partial_scores(x.a, qlo, qhi);
        red[at + PSTR] = partial_scores(x.b, qlo, qhi);
        if (NB == 4u) {
            red[at + 2u * PSTR] = partial_scores(x.c, qlo, qhi);
            red[at + 3u * PSTR] = partial_scores(x.d, qlo, qhi);
        }
        workgroupBarrier();
        if (c < NB) {
            let first = (kg * NB + c) * PSTR;
            var s = vec4<f32>(0.0);
            for (var y = 0u; y < DC; y++) { s += red[first + y]; }
            sc[kg * NB + c] = s;
        }
        workgroupBarrier();
        st = update(st, x, t0, kg, lim);
    }
    // Merge the key groups: common maxima, rescale, then sums (l through lk, O through red).
    if (c == 0u) { mk[kg] = st.m; }
    workgroupBarrier();
    var mm = vec4<f32>(NEG);
    for (var g = 0u; g < KG; g++) { mm = max(mm, mk[g]); }
    let f = exp2(st.m - mm);
    st = State(scale_cols(st.lo, f), scale_cols(st.hi, f), mm, st.l * f);
    if (c == 0u) { lk[kg] = st.l; }
    for (var n = KG; n > 1u; n -= n / 2u) {
        let h = n / 2u;
        workgroupBarrier();
        if (kg >= n - h && kg < n) {
            let at = ((kg - (n - h)) * DC + c) * 8u;
            red[at] = st.lo[0];
            red[at + 1u] = st.lo[1];
            red[at + 2u] = st.lo[2];
            red[at + 3u] = st.lo[3];
            red[at + 4u] = st.hi[0];
            red[at + 5u] = st.hi[1];
            red[at + 6u] = st.hi[2];
            red[at + 7u] = st.hi[3];
        }
        workgroupBarrier();
        if (kg < h) {
            let at = (kg * DC + c) * 8u;
            st.lo += mat4x4<f32>(red[at], red[at + 1u], red[at + 2u], red[at + 3u]);
            st.hi += mat4x4<f32>(red[at + 4u], red[at + 5u], red[at + 6u], red[at + 7u]);
        }
    }
    workgroupBarrier();
    if (kg == 0u) {
        var ls = vec4<f32>(0.0);
        for (var g = 0u; g < KG; g++) { ls += lk[g]; }
        let r = rbk * 4u;
        write_state(id * 4u, r, c, V8(st.lo[0], st.hi[0]), vec2<f32>(mm.x, ls.x));
        write_state(id * 4u + 1u, r + 1u, c, V8(st.lo[1], st.hi[1]), vec2<f32>(mm.y, ls.y));
        write_state(id * 4u + 2u, r + 2u, c, V8(st.lo[2], st.hi[2]), vec2<f32>(mm.z, ls.z));
        write_state(id * 4u + 3u, r + 3u, c, V8(st.lo[3], st.hi[3]), vec2<f32>(mm.w, ls.w));
    }
}

// State sj (row r of the pair; nothing for a padding row): lane c's share x of O and (m, l).
fn write_state(sj: u32, r: u32, c: u32, x: V8, m_l: vec2<f32>) {
    if (r >= p.rows) { return; }
    // f16 lane c owns vec4s 2c, 2c + 1 of the row; f32 lane c owns c and c + DC.
    var lo = sj * 2u * DC + c;
    var hi = lo + DC;
    if (F16 == 1u) {
        lo = sj * 2u * DC + 2u * c;
        hi = lo + 1u;
    }
    opart[lo] = x.lo;
    opart[hi] = x.hi;
    if (c == 0u) { ml[sj] = m_l; }
}
