// Leaf-major stage 2 of PISA prefill selection, part 1 of 3 (PISA.md 3.3 and 5; host:
// pisa-wgpu/src/ops/leaf_select/by_leaf.rs): bucket the stage-1 candidates by (b, KV head, leaf)
// so that a leaf's raw keys are read once per chunk of the queries that list it, not once per
// query tile (the tile kernels' union of 4 queries' candidates is mostly disjoint on inputs
// without locality: up to 4x the useful matrix work there).
//   count:   cnt[x] = entries of bucket x = bh * nb0 + leaf (PAIR = 1: bh * ceil(nb0 / 2) +
//            leaf / 2; atomics; cnt starts at zero);
//   scan:    off[x] (first entry of x in `list`) and coff[x] (first chunk of x: a bucket of n
//            entries has ceil(n / QPC) chunks), exclusive prefix sums, one workgroup;
//            off[buckets] = entries, coff[buckets] = chunks;
//   scatter: list[off[x] + slot] = i * MC + o for every entry (query i, candidate slot o; PAIR
//            = 1: with the flags BOTH or ODD, see PAIR below); the
//            slot comes from counting cnt back down to zero (order within a bucket is
//            unspecified, and does not matter: each entry's score goes to its own slot); the
//            entry that takes a slot that is a multiple of QPC also writes its chunk's
//            descriptor cdesc[coff[x] + slot / QPC] = (x, first entry, entries, 0), so a
//            chunk kernel finds its chunk in one load (leaf_chunk.wgsl).
// An entry is a non-forced candidate of a query that must choose (it sees more than K leaves
// and has slots left after its forced ones); the others are never read by the pick.
// (Params, p, visible, is_forced, n_forced, linear_id: select_common.wgsl, prepended.)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const MC: u32 = 34u;   // candidate slots per query, g * (K + 1)
const QPC: u32 = 16u;  // entries per scoring chunk
const NONE: u32 = 0xffffffffu;
// 1: bucket a block selection for leaf-major attention (ops/attention/by_leaf.rs): the entries
// are the valid slots of queries i0 .. i0 + nq of ONE (b, KV head) bh0, `cand` is the selection
// [B, Hkv, Nq, MC] (MC = top_k), a bucket is a leaf, and list entries are i_local * MC + o.
const ATTEND: u32 = 0u;
// 1 (with ATTEND = 0; the NVIDIA pair scorer, shaders/nv/leaf_score.comp PAIR = 1): a bucket
// is a pair of leaves (bh * ceil(nb0 / 2) + leaf / 2), and a query that lists both leaves of a
// pair in adjacent slots o, o + 1 (a kept node's children, g = 2) is one entry, o | BOTH; one
// that lists only leaf 2P + 1 is o | ODD, only 2P is o. The list values i * MC + o must stay
// below 2^30 (the host checks).
const PAIR: u32 = 0u;
const BOTH: u32 = 0x80000000u;
const ODD: u32 = 0x40000000u;

// items: entries (count, scatter) or buckets (scan); i0, nq, bh0: the query range and the
// (b, KV head) of an ATTEND = 1 bucketing.
struct Buckets {
    items: u32, buckets: u32, i0: u32, nq: u32,
    bh0: u32, pad0: u32, pad1: u32, pad2: u32,
}

@group(0) @binding(3) var<storage, read> cand: array<i32>;
@group(0) @binding(5) var<storage, read_write> cnt: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> off: array<u32>;
@group(0) @binding(7) var<storage, read_write> coff: array<u32>;
@group(0) @binding(8) var<storage, read_write> list: array<u32>;
@group(0) @binding(10) var<uniform> bl: Buckets;
@group(0) @binding(11) var<storage, read_write> cdesc: array<vec4<u32>>;

// ATTEND = 1: the leaf of local entry e = i_local * MC + o when that selection slot is valid
// as the attention kernels' union defines it (a leaf below nb0 above every in-range entry
// before it in its list: -1 padding, repeats and out-of-order entries are skipped), else NONE.
fn attend_leaf(e: u32) -> u32 {
    let o = e % MC;
    let g = (bl.bh0 * p.q_len + bl.i0 + e / MC) * MC + o;
    let c = cand[g];
    if (c < 0 || u32(c) >= p.nb0) { return NONE; }
    for (var j = g - o; j < g; j++) {
        let x = cand[j];
        if (x >= c && u32(x) < p.nb0) { return NONE; }
    }
    return u32(c);
}

// The leaf of entry e, NONE when it is not bucketed: ATTEND = 0, entry_leaf; ATTEND = 1,
// attend_leaf.
fn bucket_leaf(e: u32) -> u32 {
    if (ATTEND == 1u) { return attend_leaf(e); }
    return entry_leaf(e);
}

// The bucket of entry e of leaf j (j not NONE): ATTEND = 0, entry e = (bh * q_len + i) * MC + o
// and bucket bh * nb0 + leaf; ATTEND = 1, bucket = leaf. PAIR = 1: bucket
// bh * ceil(nb0 / 2) + leaf / 2, NONE for the second slot of a BOTH entry.
fn entry_bucket(e: u32, j: u32) -> u32 {
    if (ATTEND == 1u) { return j; }
    let bh = e / (p.q_len * MC);
    if (PAIR == 1u) {
        if ((j & 1u) == 1u && e % MC > 0u && entry_leaf(e - 1u) == j - 1u) { return NONE; }
        return bh * ((p.nb0 + 1u) / 2u) + j / 2u;
    }
    return bh * p.nb0 + j;
}

// The value in its bucket's list of entry e of leaf j: ATTEND = 0, i * MC + o (PAIR = 1: with
// BOTH or ODD); ATTEND = 1, e itself.
fn entry_value(e: u32, j: u32) -> u32 {
    if (ATTEND == 1u) { return e; }
    let v = e % (p.q_len * MC);
    if (PAIR == 1u) {
        if ((j & 1u) == 1u) { return v | ODD; }
        if (e % MC + 1u < MC && entry_leaf(e + 1u) == j + 1u) { return v | BOTH; }
    }
    return v;
}

// The leaf of entry e = (bh * q_len + i) * MC + o when it is to be scored, else NONE.
fn entry_leaf(e: u32) -> u32 {
    let i = (e / MC) % p.q_len;
    let bq = (p.q_pos0 + i) / p.block_size;
    if (visible(bq) <= p.top_k || n_forced(bq) >= p.top_k) { return NONE; }
    let c = cand[e];
    if (c < 0 || is_forced(bq, u32(c))) { return NONE; }
    return u32(c);
}

@compute @workgroup_size(256)
fn count(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let e = linear_id(wid, nwg) * 256u + lid;
    if (e >= bl.items) { return; }
    let j = bucket_leaf(e);
    if (j == NONE) { return; }
    let x = entry_bucket(e, j);
    if (x != NONE) { atomicAdd(&cnt[x], 1u); }
}

var<workgroup> part: array<u32, 256>;
var<workgroup> cpart: array<u32, 256>;

@compute @workgroup_size(256)
fn scan(@builtin(local_invocation_index) lid: u32) {
    let n = bl.buckets;
    let per = (n + 255u) / 256u;
    let a = min(lid * per, n);
    let z = min(a + per, n);
    var s = 0u;
    var cs = 0u;
    for (var x = a; x < z; x++) {
        let c = atomicLoad(&cnt[x]);
        s += c;
        cs += (c + QPC - 1u) / QPC;
    }
    part[lid] = s;
    cpart[lid] = cs;
    workgroupBarrier();
    // Inclusive scan of the 256 segment sums (Hillis-Steele).
    for (var d = 1u; d < 256u; d *= 2u) {
        var v = 0u;
        var cv = 0u;
        if (lid >= d) {
            v = part[lid - d];
            cv = cpart[lid - d];
        }
        workgroupBarrier();
        part[lid] += v;
        cpart[lid] += cv;
        workgroupBarrier();
    }
    var o = part[lid] - s;
    var co = cpart[lid] - cs;
    for (var x = a; x < z; x++) {
        let c = atomicLoad(&cnt[x]);
        off[x] = o;
        coff[x] = co;
        o += c;
        co += (c + QPC - 1u) / QPC;
    }
    if (lid == 255u) {
        off[n] = part[255];
        coff[n] = cpart[255];
    }
}

@compute @workgroup_size(256)
fn scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let e = linear_id(wid, nwg) * 256u + lid;
    if (e >= bl.items) { return; }
    let j = bucket_leaf(e);
    if (j == NONE) { return; }
    let x = entry_bucket(e, j);
    if (x != NONE) {
        let slot = atomicSub(&cnt[x], 1u) - 1u;
        let o = off[x];
        list[o + slot] = entry_value(e, j);
        if (slot % QPC == 0u) {
            let n = min(QPC, off[x + 1u] - o - slot);
            cdesc[coff[x] + slot / QPC] = vec4<u32>(x, o + slot, n, 0u);
        }
    }
}
