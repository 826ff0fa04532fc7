// The part the sparse and dense attention kernels share, appended to each by its host module
// (ops/attention.rs for attention.wgsl, the portable kernels; ops/attention/coop.rs for
// attention_coop.wgsl, the tensor-core ones): the parameter block (host side:
// ops/attention.rs `Params`, filled by ops/attention/launch.rs), the bindings whose type does
// not depend on the storage precision, the workgroup index, and the ascending union of a query
// tile's block selections. Needs from the kernel: QT (queries per tile), SELK (top_k), WG
// (invocations).
//
// Union: per list (one query's K entries), an entry is valid when it is a leaf (0 <= e < nb0)
// above every valid entry before it in the list (a -1, a leaf past the last, a repeat or an
// out-of-order entry is skipped; well-formed lists are ascending and all valid). The union is
// the ascending set of valid entries; umask[u] has bit qi set when query qi's list holds
// ublk[u]. Built in parallel, one invocation per entry, in three passes: valid, first valid
// occurrence of its value, then (first occurrences) rank among the distinct values (the union
// slot) and mask. O(QT * K) steps per invocation instead of one invocation's serial merge.

struct Params {
    q_sb: u32, q_sh: u32, q_sn: u32, k_sb: u32,
    k_sh: u32, k_sn: u32, v_sb: u32, v_sh: u32,
    v_sn: u32, kv_heads: u32, q_heads: u32, group: u32,
    gh: u32, head_chunks: u32, q_len: u32, k_len: u32,
    block_size: u32, n_qtiles: u32, top_k: u32, nb0: u32,
    causal: u32, wg_count: u32, scale_log2: f32, o_sb: u32,
    o_sh: u32, o_sn: u32, pad0: u32, pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> sel: array<i32>;
@group(0) @binding(6) var<storage, read_write> lse: array<f32>;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y;
}

const MAXU: u32 = QT * SELK;
const MAXU4: u32 = (MAXU + 3u) / 4u * 4u;

var<workgroup> sel_sh: array<i32, MAXU4>;
var<workgroup> uvalid: array<u32, MAXU4>;
var<workgroup> ufirst: array<u32, MAXU4>;
var<workgroup> ublk: array<u32, MAXU4>;
var<workgroup> umask: array<u32, MAXU4>;
var<workgroup> ucount: array<u32, 4>;  // [0]: union length

// Loads the selections of queries i0 .. i0 + QT of (b, KV head) row block `row0` (= (b * Hkv +
// kv head) * Nq) and builds the union; returns its length (workgroup-uniform). Uniform control
// flow only (barriers inside).
fn build_union(lid: u32, row0: u32, i0: u32) -> u32 {
    for (var x = lid; x < MAXU; x += WG) {
        let i = i0 + x / SELK;
        var e = -1;
        if (i < p.q_len) { e = sel[(row0 + i) * p.top_k + x % SELK]; }
        sel_sh[x] = e;
    }
    workgroupBarrier();
    for (var x = lid; x < MAXU; x += WG) {
        let e = sel_sh[x];
        var ok = e >= 0 && u32(e) < p.nb0;
        for (var j = x - x % SELK; j < x; j++) {
            let f = sel_sh[j];
            if (f >= e && f >= 0 && u32(f) < p.nb0) { ok = false; }
        }
        uvalid[x] = select(0u, 1u, ok);
    }
    workgroupBarrier();
    for (var x = lid; x < MAXU; x += WG) {
        let e = sel_sh[x];
        var first = uvalid[x] != 0u;
        for (var j = 0u; j < x; j++) {
            if (uvalid[j] != 0u && sel_sh[j] == e) { first = false; }
        }
        ufirst[x] = select(0u, 1u, first);
    }
    workgroupBarrier();
    for (var x = lid; x < MAXU; x += WG) {
        if (ufirst[x] != 0u) {
            let e = sel_sh[x];
            var rank = 0u;
            var mask = 0u;
            for (var j = 0u; j < MAXU; j++) {
                let f = sel_sh[j];
                if (ufirst[j] != 0u && f < e) { rank++; }
                if (uvalid[j] != 0u && f == e) { mask |= 1u << (j / SELK); }
            }
            ublk[rank] = u32(e);
            umask[rank] = mask;
        }
    }
    if (lid == 0u) {
        var n = 0u;
        for (var x = 0u; x < MAXU; x++) { n += ufirst[x]; }
        ucount[0] = n;
    }
    return workgroupUniformLoad(&ucount)[0];
}

// -inf as a runtime value: WGSL const-evaluates `bitcast<f32>(0xff800000u)` and Tint (Dawn,
// the browsers' WGSL compiler) refuses -inf as a constant ("value -inf cannot be represented as
// 'f32'"), where naga accepts it.
fn neg_inf_bits() -> u32 { return 0xff800000u; }
