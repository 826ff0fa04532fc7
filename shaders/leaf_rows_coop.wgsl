// Shared by the two leaf-major tensor-core kernels (leaf_score_coop.wgsl: selection stage 2;
// attention_leaf_coop.wgsl: sparse attention; appended by their hosts): the loads of a chunk's
// rows into workgroup memory and the A matrices of a subgroup's 16 rows. Loads and stores are
// separate functions: every invocation issues all of its 16-byte loads into registers (a fixed
// trip count) before its first store, so their memory round trips overlap instead of queueing
// behind the stores (on the H200 this halved the stage-2 scorer). A loaded piece holds a
// register until it is stored, so where a kernel issues its loads is a trade: on the H200 the
// scorer gained 3% from issuing the key loads before the Q gather, while leaf-major attention
// was 1.3x slower with its value loads split into a load and a store function the same way, so
// it keeps them in one (stage_values_t; docs/benchmarks.md, A.7, 2026-11-29).
// Needs from the kernel: GQ, MC, HD16, HD8, RT, QS, QL, KL, CW, WG; `qsh` (f16 rows of stride
// QS), `ent` (RT entries: the chunk's, local query * MC + slot), `qa_set` (coop_qa.wgsl), the
// binding `q` (Q as 16-byte pieces) and `key_piece(at)` (16-byte piece `at` of K);
// p (select_common.wgsl) and bl (leaf_chunk.wgsl).

// First token of the keys loaded for 16-key tile ct of `leaf`: clamped into the sequence (the
// host requires Nk >= 16), so a tile never reads past the head's last key.
fn tile_start(leaf: u32, ct: u32) -> u32 {
    return min(leaf * p.block_size + ct * 16u, p.k_len - 16u);
}

// The Q rows of subgroup sg's 16-row tile (from qsh) as HD / 16 A matrices.
fn load_rows(sg: u32) {
    let r0 = sg * 16u;
    for (var ds = 0u; ds < HD16; ds++) {
        let at = r0 * QS + ds * 16u;
        qa_set(ds, coopLoadT<coop_mat16x16<f16, A>>(&qsh[at], QS));
    }
}

// Eight halves (16 bytes) into qsh at `at`.
fn put8(at: u32, v: vec4<u32>) {
    let h0 = vec2<f16>(unpack2x16float(v.x));
    let h1 = vec2<f16>(unpack2x16float(v.y));
    let h2 = vec2<f16>(unpack2x16float(v.z));
    let h3 = vec2<f16>(unpack2x16float(v.w));
    qsh[at] = h0.x;
    qsh[at + 1u] = h0.y;
    qsh[at + 2u] = h1.x;
    qsh[at + 3u] = h1.y;
    qsh[at + 4u] = h2.x;
    qsh[at + 5u] = h2.y;
    qsh[at + 6u] = h3.x;
    qsh[at + 7u] = h3.y;
}

// The chunk's entries list[first .. first + n] into ent (0 past n, up to RT).
fn load_entries(first: u32, n: u32, lid: u32) {
    if (lid < RT) {
        var x = 0u;
        if (lid < n) { x = list[first + lid]; }
        ent[lid] = x;
    }
}

// This invocation's 16-byte pieces of the chunk's RT Q rows (entry e, head h at row e * GQ + h;
// query bl.i0 + ent[e] / MC of (b, KV head hkv)), zero past its n entries (`ent` must be
// loaded: a barrier after load_entries).
fn load_q(lid: u32, b: u32, hkv: u32, n: u32) -> array<vec4<u32>, QL> {
    var buf: array<vec4<u32>, QL>;
    for (var j = 0u; j < QL; j++) {
        let x = lid + j * WG;
        let r = x / HD8;
        let e = r / GQ;
        var val = vec4<u32>(0u);
        if (x < RT * HD8 && e < n) {
            let hq = hkv * GQ + r % GQ;
            let i = bl.i0 + ent[e] / MC;
            val = q[(b * p.q_sb + hq * p.q_sh + i * p.q_sn) / 8u + x % HD8];
        }
        buf[j] = val;
    }
    return buf;
}

// The pieces of load_q into qsh (rows of stride QS).
fn store_q(lid: u32, buf: array<vec4<u32>, QL>) {
    for (var j = 0u; j < QL; j++) {
        let x = lid + j * WG;
        if (x < RT * HD8) { put8((x / HD8) * QS + 8u * (x % HD8), buf[j]); }
    }
}

// This invocation's 16-byte pieces of the leaf's CW key rows (its 16-key tiles, each from
// tile_start). `kbase`: the (b, KV head) offset in K, elements. Keys outside the leaf's own tile
// ranges are loaded too; the kernels mask their scores.
fn load_keys(lid: u32, leaf: u32, kbase: u32) -> array<vec4<u32>, KL> {
    var buf: array<vec4<u32>, KL>;
    for (var j = 0u; j < KL; j++) {
        let x = lid + j * WG;
        let r = x / HD8;
        var val = vec4<u32>(0u);
        if (x < CW * HD8) {
            let tok = tile_start(leaf, r / 16u) + r % 16u;
            val = key_piece((kbase + tok * p.k_sn) / 8u + x % HD8);
        }
        buf[j] = val;
    }
    return buf;
}

// The pieces of load_keys into qsh rows 0 .. CW (the Q rows must be in registers by then).
fn store_keys(lid: u32, buf: array<vec4<u32>, KL>) {
    for (var j = 0u; j < KL; j++) {
        let x = lid + j * WG;
        if (x < CW * HD8) { put8((x / HD8) * QS + 8u * (x % HD8), buf[j]); }
    }
}
