// Decode step, dispatch 2 of 3 (appended to decode.wgsl, whose header describes the design):
// `leaf`, one workgroup per (sequence, KV head, leaf slot), computes the slot's block attention
// state for the group's GQ heads over keys t < len of the block (PISA.md 2 and 4): max m, sum l
// and unnormalised O = sum_t exp(s q.k_t - m) v_t, f32. In chunks of CH keys (the whole block
// when workgroup memory allows), six barriers a chunk: partial scores (LK consecutive
// invocations per key row, so a warp's loads are coalesced, each row serving all GQ heads) |
// per-(key, head) sums | per-head partial maxima | chunk max | exponentials in place | P.V,
// each invocation owning one output vec4 of every head for one of PARTS key subsets, its value
// rows loaded at the chunk's start so that their memory round trip overlaps the keys' (the row
// sum l rides along with the vec4 0 owners). The parts are summed at the end into `parts`.

// 1: attend_block runs attend_block_sg (decode_attend_sg.wgsl: subgroup shuffles, one barrier),
// with lane groups of SGA_G (both substituted by the host where the device allows it).
const SGA: u32 = 0u;
const SGA_G: u32 = 8u;
const PV_IT: u32 = (CH + PARTS - 1u) / PARTS; // keys of a chunk per P.V invocation
const PREFETCH: bool = PVR == PV_IT;           // value rows loaded with the keys (see below;
                                               // PVR 1 in route_leaf: decode_leaf_prefetch off)
const XP: u32 = CH * GQ;                       // start of the partial scores in xs

// (NB instances of AW invocations each: one in `leaf`, several in `route_leaf`.)
var<workgroup> xs: array<f32, XS * NB>;
var<workgroup> red: array<f32, AW * NB>;
var<workgroup> hm: array<f32, GQ * NB>;
var<workgroup> halpha: array<f32, GQ * NB>;
var<workgroup> wleaf: vec2<u32>; // (length, the slot's block)

// Vec4 j of the key / value row of token t of flat (sequence, KV head) bh: shard 0 (kc, vc) for
// bh < p.kv_split, else shard 1 (kc2, vc2) at row bh - kv_split (a cache past one storage
// binding). bh is the same over the workgroup: the branch does not diverge.
fn value_vec(bh: u32, t: u32, j: u32) -> vec4<store_t> {
    if (bh < p.kv_split) { return raw4_vc(key_row(bh, t) + j); }
    return raw4_vc2(key_row(bh - p.kv_split, t) + j);
}

// Vec4 j4 of the value rows first, first + stride, ... (PVR of them, clamped to the chunk's cn
// keys) of the chunk at token t of bh, from its shard (chosen once, outside the loop, so the
// loads are unconditional and can be in flight together). attend_block takes a P.V part's
// rows (part, stride PARTS), attend_block_sg its consecutive rows (stride 1).
fn load_values(bh: u32, t: u32, cn: u32, first: u32, stride: u32,
               j4: u32) -> array<vec4<store_t>, PVR> {
    var vv: array<vec4<store_t>, PVR>;
    if (bh < p.kv_split) {
        for (var i = 0u; i < PVR; i++) {
            vv[i] = raw4_vc(key_row(bh, t + min(first + i * stride, cn - 1u)) + j4);
        }
    } else {
        for (var i = 0u; i < PVR; i++) {
            vv[i] = raw4_vc2(key_row(bh - p.kv_split, t + min(first + i * stride, cn - 1u)) + j4);
        }
    }
    return vv;
}

// dots_key_part (decode.wgsl) over the key row of token t of bh, wherever its shard (chosen
// once, outside the loop, so the loads stay unconditional and can be in flight together).
fn dots_key_shard(bh: u32, t: u32, u: u32) -> array<f32, GQ> {
    if (bh < p.kv_split) { return dots_key_part(key_row(bh, t), u); }
    var a: array<f32, GQ>;
    let row = key_row(bh - p.kv_split, t);
    for (var i = 0u; i < DLK; i++) {
        let j = u + i * LK;
        if (D4 % LK == 0u || j < D4) {
            let k = in4_kc2(row + j);
            for (var hh = 0u; hh < GQ; hh++) { a[hh] += dot(qs[hh * D4 + j], k); }
        }
    }
    return a;
}

// The state of the block of n keys from token t0 (n = 0: a slot with no block, nothing
// written) into parts[po..], by the AW invocations of instance ib (its invocation al), in
// chunks up to nmax keys (the same for every invocation of the workgroup: the barriers are
// the workgroup's). Invocations of an instance ib >= NB take part in the barriers only.
fn attend_block(bh: u32, t0: u32, n: u32, nmax: u32, po: u32, al: u32, ib: u32) {
    if (SGA != 0u) {
        attend_block_sg(bh, t0, n, po, al, ib);
        return;
    }
    let act = ib < NB;
    let xb = min(ib, NB - 1u) * XS;   // this instance's scratch in xs
    let hb = min(ib, NB - 1u) * GQ;   // and in hm, halpha
    let part = al / D4;
    let j4 = al % D4;
    let r_n = min(AW / GQ, 8u);
    var acc: array<vec4<f32>, GQ>;
    var lacc: array<f32, GQ>;
    if (act && al < GQ) { hm[hb + al] = NEG; }
    for (var c0 = 0u; c0 < nmax; c0 += CH) {
        let cn = select(0u, min(CH, n - c0), n > c0);
        let cl = max(cn, 1u) - 1u; // the last key loads are clamped to
        // The chunk's value rows of this P.V invocation, loaded now (when they fit in
        // registers: PVR = PV_IT <= 16) so that their memory round trip overlaps the keys'.
        var vv: array<vec4<store_t>, PVR>;
        if (act && PREFETCH && part < PARTS) { vv = load_values(bh, t0 + c0, cl + 1u, part, PARTS, j4); }
        if (act) {
            for (var it = al; it < CH * LK; it += AW) {
                var a: array<f32, GQ>;
                if (it / LK < cn) { a = dots_key_shard(bh, t0 + c0 + it / LK, it % LK); }
                for (var hh = 0u; hh < GQ; hh++) { xs[xb + XP + it * GQ + hh] = a[hh]; }
            }
        }
        workgroupBarrier();
        if (act) {
            for (var e = al; e < CH * GQ; e += AW) {
                var a = 0.0;
                for (var u = 0u; u < LK; u++) { a += xs[xb + XP + ((e / GQ) * LK + u) * GQ + e % GQ]; }
                xs[xb + e] = select(NEG, p.scale * a, e / GQ < cn);
            }
        }
        workgroupBarrier();
        if (act && al < r_n * GQ) {
            var m = NEG;
            for (var it = al % r_n; it < CH; it += r_n) { m = max(m, xs[xb + it * GQ + al / r_n]); }
            red[min(ib, NB - 1u) * AW + al] = m;
        }
        workgroupBarrier();
        if (act && al < GQ) {
            var m = NEG;
            for (var r = 0u; r < r_n; r++) { m = max(m, red[ib * AW + al * r_n + r]); }
            let m_new = max(hm[hb + al], m);
            halpha[hb + al] = exp(hm[hb + al] - m_new);
            hm[hb + al] = m_new;
        }
        workgroupBarrier();
        if (act) {
            for (var e = al; e < CH * GQ; e += AW) {
                let x = xs[xb + e];
                xs[xb + e] = select(0.0, exp(x - hm[hb + e % GQ]), x > NEG_T);
            }
        }
        workgroupBarrier();
        if (act && part < PARTS) {
            for (var hh = 0u; hh < GQ; hh++) {
                lacc[hh] *= halpha[hb + hh];
                acc[hh] *= halpha[hb + hh];
            }
            for (var i = 0u; i < PV_IT; i++) {
                let it = part + i * PARTS;
                // Loads clamped to the chunk (no condition on them); masked keys skipped.
                let ti = min(it, cl);
                var v: vec4<f32>;
                if (PREFETCH) {
                    v = vec4<f32>(vv[i]);
                } else {
                    v = vec4<f32>(value_vec(bh, t0 + c0 + ti, j4));
                }
                if (it < cn) {
                    for (var hh = 0u; hh < GQ; hh++) {
                        let pr = xs[xb + ti * GQ + hh];
                        acc[hh] += pr * v;
                        lacc[hh] += pr;
                    }
                }
            }
        }
        workgroupBarrier();
    }
    // Sum the parts: xs = [PARTS][GQ][D] partial outputs, then [PARTS][GQ] row sums.
    if (act && part < PARTS) {
        for (var hh = 0u; hh < GQ; hh++) {
            let o = xb + (part * GQ + hh) * DD + 4u * j4;
            xs[o] = acc[hh].x;
            xs[o + 1u] = acc[hh].y;
            xs[o + 2u] = acc[hh].z;
            xs[o + 3u] = acc[hh].w;
            if (j4 == 0u) { xs[xb + PARTS * GQ * DD + part * GQ + hh] = lacc[hh]; }
        }
    }
    workgroupBarrier();
    if (!act || n == 0u) { return; }
    for (var e = al; e < GQ * DD; e += AW) {
        let hh = e / DD;
        let d = e % DD;
        var o = 0.0;
        var l = 0.0;
        for (var pp = 0u; pp < PARTS; pp++) {
            o += xs[xb + (pp * GQ + hh) * DD + d];
            l += xs[xb + PARTS * GQ * DD + pp * GQ + hh];
        }
        let w = po + hh * PW;
        parts[w + d] = o;
        if (d == 0u) {
            parts[w + DD] = hm[hb + hh];
            parts[w + DD + 1u] = l;
        }
    }
}

@compute @workgroup_size(WG)
fn leaf(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let bh = id / NS;
    let b = bh / p.kv_heads;
    let h = bh % p.kv_heads;
    // The length and the slot's block in one uniform load (one barrier; load_q's copy of the
    // length into wlen is not read here).
    if (lid == 0u) { wleaf = vec2<u32>(lens[b], cands[id]); }
    load_q((b * p.q_heads + h * GQ) * DD, b, lid);
    let ll = workgroupUniformLoad(&wleaf);
    let len = ll.x;
    let leaf = ll.y;
    if (leaf == INVALID || len == 0u) { return; }
    let t0 = leaf * p.block_size;
    let n = min(p.block_size, len - t0);
    attend_block(bh, t0, n, n, id * GQ * PW, lid, 0u);
}
