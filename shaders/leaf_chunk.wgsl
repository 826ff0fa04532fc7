// Shared by the two leaf-major scorers (leaf_score.wgsl, leaf_score_coop.wgsl; appended): the
// buckets written by leaf_bucket.wgsl and the lookup of a workgroup's chunk (PISA.md 5).
//   off[x], coff[x]: first entry and first chunk of bucket x = bh * nb0 + leaf;
//   list[off[x] .. off[x + 1]): the bucket's entries, i * MC + o (query i, candidate slot o);
//   scores[(bh * q_len + i) * MC + o]: rank_key of the candidate's exact-LSE score summed over
//   the group (written by the scorers, read by leaf_pick.wgsl).
// Needs QPC (entries per chunk) and MC from the scorer.

struct Buckets { items: u32, buckets: u32, pad0: u32, pad1: u32 }

@group(0) @binding(6) var<storage, read> off: array<u32>;
@group(0) @binding(7) var<storage, read> coff: array<u32>;
@group(0) @binding(8) var<storage, read> list: array<u32>;
@group(0) @binding(9) var<storage, read_write> scores: array<u32>;
@group(0) @binding(10) var<uniform> bl: Buckets;

// Chunk `cid` as (1, bucket, first entry in `list`, entries <= QPC), or all zero past the last
// chunk. Its bucket is the last x with coff[x] <= cid (a bucket without entries has no chunks,
// so it never is).
fn chunk_of(cid: u32) -> array<u32, 4> {
    if (cid >= coff[bl.buckets]) { return array<u32, 4>(0u, 0u, 0u, 0u); }
    var lo = 0u;
    var hi = bl.buckets;
    while (hi - lo > 1u) {
        let mid = (lo + hi) / 2u;
        if (coff[mid] <= cid) { lo = mid; } else { hi = mid; }
    }
    let first = off[lo] + (cid - coff[lo]) * QPC;
    return array<u32, 4>(1u, lo, first, min(QPC, off[lo + 1u] - first));
}
