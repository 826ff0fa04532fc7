// Shared by the two stage-2 kernels of PISA prefill selection (appended to each by its host
// module): leaf_select.wgsl (portable) and leaf_select_coop.wgsl (tensor cores). Everything
// here is the part of stage 2 that is not matrix work (PISA.md 3.3, 3.4 and 5):
//   - `gather_union`: the tile's non-forced candidates (of queries that must choose) and their
//     union, deduplicated and compacted in entry order: ul[0 .. n_union) are the leaves to score,
//     ui[e] the union slot of candidate entry e;
//   - `write_selection`: the rank-based pick from the scores the kernel wrote to us[u * QT + qi]
//     (ranking keys, see `rank_key`) and the ascending row, forced leaves included, -1 padded.
// The rank of a candidate is the number of candidates strictly better (higher score, then lower
// index); keeping rank < K - |forced| keeps exactly that many whatever the scores. A query that
// sees K or fewer leaves gets them all.
//
// Needs from the kernel: QT (queries per tile), MC (candidate slots per query), WG
// (invocations). cand: i32 [B, Hkv, Nq, MC] (-1 padded); sel: i32 [B, Hkv, Nq, K].
// Every workgroup array here is a multiple of 16 bytes long (QMC4), so that cooperative-matrix
// buffers declared beside them stay 16-byte aligned however the driver packs them.

const NONE: u32 = 0xffffffffu;
const QMC4: u32 = (QT * MC + 3u) / 4u * 4u;
const QT4: u32 = (QT + 3u) / 4u * 4u;

@group(0) @binding(3) var<storage, read> cand: array<i32>;
@group(0) @binding(4) var<storage, read_write> sel: array<i32>;

var<workgroup> cl: array<u32, QMC4>;
var<workgroup> ui: array<u32, QMC4>;
var<workgroup> ul: array<u32, QMC4>;
var<workgroup> kf: array<u32, QMC4>;
var<workgroup> us: array<u32, QMC4 * QT>;
var<workgroup> nd: array<u32, QT4>;
var<workgroup> nu: array<u32, 4>;

// Loads the tile's candidates and builds the union; returns its length (workgroup-uniform).
// Uniform control flow only (barriers inside).
fn gather_union(lid: u32, bh: u32, i0: u32) -> u32 {
    let kk = p.top_k;
    // Non-forced candidates of queries that see more than K leaves.
    for (var e = lid; e < QT * MC; e += WG) {
        let i = i0 + e / MC;
        var v = NONE;
        if (i < p.q_len) {
            let bq = (p.q_pos0 + i) / p.block_size;
            if (visible(bq) > kk) {
                let c = cand[(bh * p.q_len + i) * MC + e % MC];
                if (c >= 0 && !is_forced(bq, u32(c))) { v = u32(c); }
            }
        }
        cl[e] = v;
    }
    workgroupBarrier();
    if (lid < QT) {
        let bq = (p.q_pos0 + i0 + lid) / p.block_size;
        var n = 0u;
        for (var o = 0u; o < MC; o++) { n += select(0u, 1u, cl[lid * MC + o] != NONE); }
        let slots = kk - n_forced(bq);
        nd[lid] = select(0u, 1u, n > slots && slots > 0u);
    }
    workgroupBarrier();
    // Union of the leaves to score: first occurrences, compacted in entry order.
    for (var e = lid; e < QT * MC; e += WG) {
        let x = cl[e];
        var f = 0u;
        if (x != NONE && nd[e / MC] != 0u) {
            f = 1u;
            for (var o = 0u; o < e; o++) {
                if (cl[o] == x && nd[o / MC] != 0u) { f = 0u; break; }
            }
        }
        kf[e] = f;
    }
    workgroupBarrier();
    for (var e = lid; e < QT * MC; e += WG) {
        if (kf[e] != 0u) {
            var u = 0u;
            for (var o = 0u; o < e; o++) { u += kf[o]; }
            ul[u] = cl[e];
            ui[e] = u;
        }
    }
    if (lid == 0u) {
        var n = 0u;
        for (var o = 0u; o < QT * MC; o++) { n += kf[o]; }
        nu[0] = n;
    }
    workgroupBarrier();
    for (var e = lid; e < QT * MC; e += WG) {
        let x = cl[e];
        if (x != NONE && nd[e / MC] != 0u && kf[e] == 0u) {
            for (var o = 0u; o < e; o++) {
                if (kf[o] != 0u && cl[o] == x) { ui[e] = ui[o]; break; }
            }
        }
    }
    return workgroupUniformLoad(&nu)[0];
}

// Keeps rank < slots of every query of the tile and writes its row. Uniform control flow only.
fn write_selection(lid: u32, bh: u32, i0: u32) {
    let kk = p.top_k;
    workgroupBarrier();
    for (var e = lid; e < QT * MC; e += WG) {
        let qi = e / MC;
        let x = cl[e];
        var keep = 0u;
        if (x != NONE) {
            let bq = (p.q_pos0 + i0 + qi) / p.block_size;
            let slots = kk - n_forced(bq);
            if (nd[qi] != 0u) {
                let s = us[ui[e] * QT + qi];
                var rank = 0u;
                for (var o = qi * MC; o < qi * MC + MC; o++) {
                    let xo = cl[o];
                    if (xo != NONE) {
                        let so = us[ui[o] * QT + qi];
                        if (so > s || (so == s && xo < x)) { rank++; }
                    }
                }
                keep = select(0u, 1u, rank < slots);
            } else {
                keep = select(0u, 1u, slots > 0u);
            }
        }
        kf[e] = keep;
    }
    workgroupBarrier();
    for (var e = lid; e < QT * MC; e += WG) {
        let qi = e / MC;
        let i = i0 + qi;
        if (kf[e] != 0u) {
            let x = cl[e];
            let bq = (p.q_pos0 + i) / p.block_size;
            var pos = forced_below(bq, x);
            for (var o = qi * MC; o < qi * MC + MC; o++) {
                if (kf[o] != 0u && cl[o] < x) { pos++; }
            }
            sel[(bh * p.q_len + i) * kk + pos] = i32(x);
        }
    }
    if (lid < QT && i0 + lid < p.q_len) {
        let i = i0 + lid;
        let out = (bh * p.q_len + i) * kk;
        let bq = (p.q_pos0 + i) / p.block_size;
        let vis = visible(bq);
        var total = 0u;
        if (vis <= kk) {
            for (var j = 0u; j < vis; j++) { sel[out + j] = i32(j); }
            total = vis;
        } else {
            var nk = 0u;
            for (var o = lid * MC; o < lid * MC + MC; o++) { nk += kf[o]; }
            let ls = local_start(bq);
            let se = sink_end(bq);
            var idx = 0u;
            for (var f = 0u; f <= bq; f++) {
                if (f == se && se < ls) { f = ls; }
                var pos = idx;
                for (var o = lid * MC; o < lid * MC + MC; o++) {
                    if (kf[o] != 0u && cl[o] < f) { pos++; }
                }
                sel[out + pos] = i32(f);
                idx++;
            }
            total = idx + nk;
        }
        for (var r = total; r < kk; r++) { sel[out + r] = -1; }
    }
}
