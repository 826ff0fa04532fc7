// Split-K dense attention (FlashDecoding), part 1 of 2: the partial online-softmax state of
// every row of a row block over one split of the keys. Host: pisa-wgpu/src/ops/attention/
// split_k.rs; part 2 (the merge over the splits): attention_split_merge.wgsl.
//
// One workgroup per (b, KV head) pair of the host's range, row block and split: id =
// (pair - pair0) * rblocks * n_splits + row block * n_splits + split. Row r of a pair is
// (query r / group, query head kv head * group + r % group); a row block holds rows
// rb * RB .. rb * RB + RB (rows past `rows` are padding). The split covers keys
// split * S .. min(split * S + S, Nk); key t is visible to query i iff t <= Nk - Nq + i when
// causal.
//
// Memory-bound layout: the workgroup is KG key groups of DC = D / 8 lanes; lane c of a key
// group owns 8 elements of every row (f16: elements 8c .. 8c + 7, one 16-byte load; f32:
// 4c .. 4c + 3 and D/2 + 4c .. D/2 + 4c + 3, two 16-byte loads), so a key group reads a K or V
// row with contiguous 16-byte loads. A batch is KB = KG * NB keys (key group kg takes keys
// t0 + j * KG + kg, j < NB); all loads of the next batch are issued into registers before the
// current batch is used. Per batch: lane partial dot products -> red (barrier), one lane per
// (key, row) sums them -> sc (barrier), then every lane updates its key group's online softmax
// (running max m and sum l per row, f32 accumulators of its 8 elements per row) with the
// batch's keys; a masked (row, key) pair is skipped, never weighted by 0 (0 * NaN). At the end
// the key groups' states are merged (max, rescale, tree sum through red) and key group 0 writes
// the state: opart[(id * RB + rr) * D + e] (unnormalised O, f32) and ml[id * RB + rr] =
// (m, l), m in log2 units of the scaled scores (Q is pre-multiplied by scale * log2(e)); a row
// with no visible key in the split gets (-1e30, 0) and zeros.
//
// Bindings: Q, K, V as 16-byte words (any storage; strides from the Params, in elements; every
// row starts at a multiple of 16 elements); opart f32, ml vec2<f32>.
alias store_t = f32;

const F16: u32 = 0u;    // 1: Q, K, V hold f16 (8 per 16-byte word); 0: f32 (4 per word)
const DC: u32 = 16u;    // lanes per key group = head dim / 8
const KG: u32 = 16u;    // key groups per workgroup
const NB: u32 = 4u;     // keys per key group per batch
const RB: u32 = 4u;     // rows per workgroup (row block)
const RED: u32 = 4352u; // floats of red: max(KG * NB * RB * (DC + 1), KG / 2 * RB * DC * 8)

const WG: u32 = KG * DC;
const KB: u32 = KG * NB;    // keys per batch
const PSTR: u32 = DC + 1u;  // padded stride of one (key, row)'s lane partials (bank spread)
const NEG: f32 = -1.0e30;   // "no score" (finite: no reliance on infinities)

struct SplitParams {
    q_sb: u32, q_sh: u32, q_sn: u32, k_sb: u32,
    k_sh: u32, k_sn: u32, v_sb: u32, v_sh: u32,
    v_sn: u32, kv_heads: u32, q_heads: u32, group: u32,
    q_len: u32, k_len: u32, rows: u32, rblocks: u32,
    rb: u32, split_keys: u32, n_splits: u32, causal: u32,
    pair0: u32, wg_count: u32, scale_log2: f32, head_dim: u32,
}

@group(0) @binding(0) var<uniform> p: SplitParams;
@group(0) @binding(1) var<storage, read> q: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> opart: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> ml: array<vec2<f32>>;

var<workgroup> red: array<f32, RED>;
var<workgroup> sc: array<f32, KB * RB>;
var<workgroup> mk: array<f32, KG * RB>;
var<workgroup> lk: array<f32, KG * RB>;

// The batch in flight: K and V words of NB keys (b: the second word of f32 storage).
var<private> ka: array<vec4<u32>, NB>;
var<private> kb: array<vec4<u32>, NB>;
var<private> va: array<vec4<u32>, NB>;
var<private> vb: array<vec4<u32>, NB>;

struct V8 { lo: vec4<f32>, hi: vec4<f32> }

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

// Issues the loads of the batch at t0 (keys past s_end read as zeros).
fn load_batch(t0: u32, s_end: u32, kbase: u32, vbase: u32, c: u32, kg: u32) {
    for (var j = 0u; j < NB; j++) {
        let t = t0 + j * KG + kg;
        var a = vec4<u32>(0u);
        var b = vec4<u32>(0u);
        var x = vec4<u32>(0u);
        var y = vec4<u32>(0u);
        if (t < s_end) {
            let kw = word(kbase + t * p.k_sn, c);
            let vw = word(vbase + t * p.v_sn, c);
            a = k[kw];
            x = v[vw];
            if (F16 == 0u) {
                b = k[kw + DC];
                y = v[vw + DC];
            }
        }
        ka[j] = a;
        kb[j] = b;
        va[j] = x;
        vb[j] = y;
    }
}

@compute @workgroup_size(WG)
fn partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let id = wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
    if (id >= p.wg_count) { return; }
    let c = lid % DC;
    let kg = lid / DC;
    let split = id % p.n_splits;
    let rbk = (id / p.n_splits) % p.rblocks;
    let pair = p.pair0 + id / (p.n_splits * p.rblocks);
    let b = pair / p.kv_heads;
    let kvh = pair % p.kv_heads;
    let s0 = split * p.split_keys;
    let s1 = s0 + min(p.split_keys, p.k_len - s0);
    // Rows: Q (scaled), key limit (keys t < lim are visible), state.
    var qlo: array<vec4<f32>, RB>;
    var qhi: array<vec4<f32>, RB>;
    var lim: array<u32, RB>;
    var m: array<f32, RB>;
    var l: array<f32, RB>;
    var alo: array<vec4<f32>, RB>;
    var ahi: array<vec4<f32>, RB>;
    var s_end = s0;
    for (var rr = 0u; rr < RB; rr++) {
        let r = rbk * RB + rr;
        var n = 0u;
        qlo[rr] = vec4<f32>(0.0);
        qhi[rr] = vec4<f32>(0.0);
        if (r < p.rows) {
            let i = r / p.group;
            let h = kvh * p.group + r % p.group;
            n = s1;
            if (p.causal != 0u) { n = min(s1, p.k_len - p.q_len + i + 1u); }
            let w = word(b * p.q_sb + h * p.q_sh + i * p.q_sn, c);
            var w2 = vec4<u32>(0u);
            if (F16 == 0u) { w2 = q[w + DC]; }
            let x = unpack8(q[w], w2);
            qlo[rr] = x.lo * p.scale_log2;
            qhi[rr] = x.hi * p.scale_log2;
        }
        lim[rr] = n;
        s_end = max(s_end, n);
        m[rr] = NEG;
        l[rr] = 0.0;
        alo[rr] = vec4<f32>(0.0);
        ahi[rr] = vec4<f32>(0.0);
    }
    let kbase = b * p.k_sb + kvh * p.k_sh;
    let vbase = b * p.v_sb + kvh * p.v_sh;
    load_batch(s0, s_end, kbase, vbase, c, kg);
    for (var t0 = s0; t0 < s_end; t0 += KB) {
        let cka = ka;
        let ckb = kb;
        let cva = va;
        let cvb = vb;
        if (t0 + KB < s_end) { load_batch(t0 + KB, s_end, kbase, vbase, c, kg); }
        // Lane partial dot products of the batch's keys with every row.
        for (var j = 0u; j < NB; j++) {
            let x = unpack8(cka[j], ckb[j]);
            for (var rr = 0u; rr < RB; rr++) {
                red[((kg * NB + j) * RB + rr) * PSTR + c] = dot(qlo[rr], x.lo) + dot(qhi[rr], x.hi);
            }
        }
        workgroupBarrier();
        // Scores: (key j, row rr) = slot j * RB + rr of the key group, summed over its lanes.
        for (var x = c; x < NB * RB; x += DC) {
            let at = (kg * NB * RB + x) * PSTR;
            var s = 0.0;
            for (var y = 0u; y < DC; y++) { s += red[at + y]; }
            sc[kg * NB * RB + x] = s;
        }
        workgroupBarrier();
        // Online softmax: the new row maxima, then P V over the visible (row, key) pairs.
        var alpha: array<f32, RB>;
        for (var rr = 0u; rr < RB; rr++) {
            var mx = m[rr];
            for (var j = 0u; j < NB; j++) {
                if (t0 + j * KG + kg < lim[rr]) { mx = max(mx, sc[(kg * NB + j) * RB + rr]); }
            }
            alpha[rr] = exp2(m[rr] - mx);
            m[rr] = mx;
            l[rr] *= alpha[rr];
            alo[rr] *= alpha[rr];
            ahi[rr] *= alpha[rr];
        }
        for (var j = 0u; j < NB; j++) {
            let t = t0 + j * KG + kg;
            let x = unpack8(cva[j], cvb[j]);
            for (var rr = 0u; rr < RB; rr++) {
                if (t < lim[rr]) {
                    let pj = exp2(sc[(kg * NB + j) * RB + rr] - m[rr]);
                    l[rr] += pj;
                    alo[rr] += pj * x.lo;
                    ahi[rr] += pj * x.hi;
                }
            }
        }
    }
    // Merge the key groups: common maxima, rescale, then sums (l through lk, O through red).
    if (c == 0u) {
        for (var rr = 0u; rr < RB; rr++) { mk[kg * RB + rr] = m[rr]; }
    }
    workgroupBarrier();
    for (var rr = 0u; rr < RB; rr++) {
        var mm = NEG;
        for (var g = 0u; g < KG; g++) { mm = max(mm, mk[g * RB + rr]); }
        let f = exp2(m[rr] - mm);
        m[rr] = mm;
        l[rr] *= f;
        alo[rr] *= f;
        ahi[rr] *= f;
    }
    if (c == 0u) {
        for (var rr = 0u; rr < RB; rr++) { lk[kg * RB + rr] = l[rr]; }
    }
    for (var n = KG; n > 1u; n -= n / 2u) {
        let h = n / 2u;
        workgroupBarrier();
        if (kg >= n - h && kg < n) {
            for (var rr = 0u; rr < RB; rr++) {
                let at = (((kg - (n - h)) * RB + rr) * DC + c) * 8u;
                red[at] = alo[rr].x;
                red[at + 1u] = alo[rr].y;
                red[at + 2u] = alo[rr].z;
                red[at + 3u] = alo[rr].w;
                red[at + 4u] = ahi[rr].x;
                red[at + 5u] = ahi[rr].y;
                red[at + 6u] = ahi[rr].z;
                red[at + 7u] = ahi[rr].w;
            }
        }
        workgroupBarrier();
        if (kg < h) {
            for (var rr = 0u; rr < RB; rr++) {
                let at = ((kg * RB + rr) * DC + c) * 8u;
                alo[rr] += vec4<f32>(red[at], red[at + 1u], red[at + 2u], red[at + 3u]);
                ahi[rr] += vec4<f32>(red[at + 4u], red[at + 5u], red[at + 6u], red[at + 7u]);
            }
        }
    }
    workgroupBarrier();
    if (kg == 0u) {
        for (var rr = 0u; rr < RB; rr++) {
            if (rbk * RB + rr < p.rows) {
                var ls = 0.0;
                for (var g = 0u; g < KG; g++) { ls += lk[g * RB + rr]; }
                let st = id * RB + rr;
                // f16 lane c owns vec4s 2c, 2c + 1 of the row; f32 lane c owns c and c + DC.
                var lo = st * 2u * DC + c;
                var hi = lo + DC;
                if (F16 == 1u) {
                    lo = st * 2u * DC + 2u * c;
                    hi = lo + 1u;
                }
                opart[lo] = alo[rr];
                opart[hi] = ahi[rr];
                if (c == 0u) { ml[st] = vec2<f32>(m[rr], ls); }
            }
        }
    }
}
