// Shared by the leaf-major kernels (appended): the scorers of selection stage 2
// (leaf_score.wgsl, leaf_score_coop.wgsl) and the sparse attention (attention_leaf.wgsl,
// attention_leaf_coop.wgsl, and attention_leaf_merge.wgsl for the Buckets uniform): the buckets
// written by leaf_bucket.wgsl and the lookup of a workgroup's chunk (PISA.md 5).
//   off[x], coff[x]: first entry and first chunk of bucket x (stage 2: x = bh * nb0 + leaf;
//   attention, one (b, KV head) bl.bh0 at a time: x = leaf);
//   cdesc[c]: the bucket of chunk c;
//   list[off[x] .. off[x + 1]): the bucket's entries, i * MC + o (stage 2: query i, candidate
//   slot o; attention: local query i - bl.i0, selection slot o);
//   scores[(bh * q_len + i) * MC + o]: rank_key of the candidate's exact-LSE score summed over
//   the group (written by the scorers, read by leaf_pick.wgsl).
// Needs QPC (entries per chunk) and MC from the scorer.

struct Buckets {
    items: u32, buckets: u32, i0: u32, nq: u32,
    bh0: u32, pad0: u32, pad1: u32, pad2: u32,
}

@group(0) @binding(6) var<storage, read> off: array<u32>;
@group(0) @binding(7) var<storage, read> coff: array<u32>;
@group(0) @binding(8) var<storage, read> list: array<u32>;
@group(0) @binding(9) var<storage, read_write> scores: array<u32>;
@group(0) @binding(10) var<uniform> bl: Buckets;
@group(0) @binding(11) var<storage, read> cdesc: array<u32>;

// Chunk `cid` as (1, bucket, first entry in `list`, entries <= QPC), or all zero past the last
// chunk; cdesc[cid] is its bucket (written by the scatter).
fn chunk_of(cid: u32) -> array<u32, 4> {
    if (cid >= coff[bl.buckets]) { return array<u32, 4>(0u, 0u, 0u, 0u); }
    let x = cdesc[cid];
    let first = off[x] + (cid - coff[x]) * QPC;
    return array<u32, 4>(1u, x, first, min(QPC, off[x + 1u] - first));
}

var<workgroup> wch: array<u32, 4>;

// chunk_of(cid) as a workgroup-uniform value (invocation 0 looks it up; the load's barrier
// publishes it), so the kernel may return on it and keep its barriers in uniform control flow.
fn chunk_uniform(cid: u32, lid: u32) -> array<u32, 4> {
    if (lid == 0u) { wch = chunk_of(cid); }
    return workgroupUniformLoad(&wch);
}
