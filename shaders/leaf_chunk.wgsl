// Shared by the leaf-major kernels (appended): the scorers of selection stage 2
// (leaf_score.wgsl, leaf_score_coop.wgsl) and the sparse attention (attention_leaf.wgsl,
// attention_leaf_coop.wgsl, and attention_leaf_merge.wgsl for the Buckets uniform): the buckets
// written by leaf_bucket.wgsl and the lookup of a workgroup's chunk (PISA.md 5).
//   coff[x]: first chunk of bucket x (stage 2: x = bh * nb0 + leaf; attention, the bl.heads
//   (b, KV head)s from bl.bh0 on: x = hb * nb0 + leaf, with pairs after every head's leaves,
//   x = heads * nb0 + hb * ceil(nb0 / 2) + pair); coff[buckets] is the chunk count (the bucket
//   offsets `off` are folded into the descriptors, so the chunk kernels do not bind them);
//   cdesc[c]: chunk c as (bucket, first entry in `list`, entries, 0), so that a chunk kernel
//   finds its chunk in one round trip to memory (the bucket-only lookup before commit b53002f
//   took two dependent ones);
//   list: each bucket's entries, contiguous, i * MC + o (stage 2: query i, candidate slot o;
//   attention: local query i - bl.i0 of its bucket's head, selection slot o);
//   scores[(bh * q_len + i) * MC + o]: rank_key of the candidate's exact-LSE score summed over
//   the group (written by the scorers, read by leaf_pick.wgsl).

struct Buckets {
    items: u32, buckets: u32, i0: u32, nq: u32,
    bh0: u32, first: u32, heads: u32, pad2: u32,
}

@group(0) @binding(7) var<storage, read> coff: array<u32>;
@group(0) @binding(8) var<storage, read> list: array<u32>;
@group(0) @binding(9) var<storage, read_write> scores: array<u32>;
@group(0) @binding(10) var<uniform> bl: Buckets;
@group(0) @binding(11) var<storage, read> cdesc: array<vec4<u32>>;

// Chunk `cid` as (1, bucket, first entry in `list`, entries <= QPC), or all zero past the last
// chunk. Needs cid within cdesc (bl.items descriptors from the dispatch's first chunk; those
// past the real chunk count are unwritten): both loads are issued before the branch on the
// count.
fn chunk_of(cid: u32) -> array<u32, 4> {
    let d = cdesc[cid];
    if (cid >= coff[bl.buckets]) { return array<u32, 4>(0u, 0u, 0u, 0u); }
    return array<u32, 4>(1u, d.x, d.y, d.z);
}

// Leaf-major attention: bucket x as (hb, its head in the range bl.bh0 .., and the leaf) or,
// pair = 1, (hb, the pair P: leaves 2P and 2P + 1), from x = hb * nb0 + leaf or x = bl.first +
// hb * ceil(nb0 / 2) + P (bl.first = heads * nb0, the first pair bucket).
fn attend_bucket(x: u32, pair: u32) -> vec2<u32> {
    if (pair == 1u) {
        let np = (p.nb0 + 1u) / 2u;
        let y = x - bl.first;
        return vec2<u32>(y / np, y % np);
    }
    return vec2<u32>(x / p.nb0, x % p.nb0);
}

var<workgroup> wch: array<u32, 4>;

// chunk_of(cid) as a workgroup-uniform value (invocation 0 looks it up; the load's barrier
// publishes it), so the kernel may return on it and keep its barriers in uniform control flow.
fn chunk_uniform(cid: u32, lid: u32) -> array<u32, 4> {
    if (lid == 0u) { wch = chunk_of(cid); }
    return workgroupUniformLoad(&wch);
}
