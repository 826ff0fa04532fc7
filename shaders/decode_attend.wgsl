// Decode step, second half (appended to decode.wgsl, whose declarations it uses): the
// attention over the selected leaves and the `step` entry point (PISA.md sections 4 and 5).

// Attention (PISA.md 4) of the group's GQ heads over the selected leaves sel_s (ascending,
// INVALID last), keys t <= len - 1, in chunks of CH token slots: scores (one invocation per
// key), per-head chunk max, exponentials in place, then P.V with each invocation owning one
// output vec4 of every head for one of PARTS key subsets (the row sum l rides along with the
// vec4 0 owners); the parts are merged at the end.
fn attend(bh: u32, qrow: u32, len: u32, lid: u32) {
    let c_n = p.block_size;
    let total = KMAX * c_n;
    let part = lid / D4;
    let j4 = lid % D4;
    let r_n = min(WG / GQ, 32u);
    var acc: array<vec4<f32>, GQ>;
    var lacc: array<f32, GQ>;
    if (lid < GQ) { hm[lid] = NEG; }
    for (var c0 = 0u; c0 < total; c0 += CH) {
        for (var it = lid; it < CH; it += WG) {
            var x: array<f32, GQ>;
            for (var hh = 0u; hh < GQ; hh++) { x[hh] = NEG; }
            let si = c0 + it;
            if (si < total && sel_s[si / c_n] != INVALID) {
                let t = sel_s[si / c_n] * c_n + si % c_n;
                if (t < len) {
                    let a = dots_key(key_row(bh, t));
                    for (var hh = 0u; hh < GQ; hh++) { x[hh] = p.scale * a[hh]; }
                }
            }
            for (var hh = 0u; hh < GQ; hh++) { xs[it * GQ + hh] = x[hh]; }
        }
        workgroupBarrier();
        if (lid < r_n * GQ) {
            var m = NEG;
            for (var it = lid % r_n; it < CH; it += r_n) { m = max(m, xs[it * GQ + lid / r_n]); }
            red[lid] = m;
        }
        workgroupBarrier();
        if (lid < GQ) {
            var m = NEG;
            for (var r = 0u; r < r_n; r++) { m = max(m, red[lid * r_n + r]); }
            let m_new = max(hm[lid], m);
            halpha[lid] = exp(hm[lid] - m_new);
            hm[lid] = m_new;
        }
        workgroupBarrier();
        for (var e = lid; e < CH * GQ; e += WG) {
            let x = xs[e];
            xs[e] = select(0.0, exp(x - hm[e % GQ]), x > NEG_T);
        }
        workgroupBarrier();
        if (part < PARTS) {
            for (var hh = 0u; hh < GQ; hh++) {
                lacc[hh] *= halpha[hh];
                acc[hh] *= halpha[hh];
            }
            for (var it = part; it < CH; it += PARTS) {
                let si = c0 + it;
                if (si >= total || sel_s[si / c_n] == INVALID) { continue; }
                let t = sel_s[si / c_n] * c_n + si % c_n;
                if (t >= len) { continue; }
                let v = vec4<f32>(vc[key_row(bh, t) + j4]);
                for (var hh = 0u; hh < GQ; hh++) {
                    let pr = xs[it * GQ + hh];
                    acc[hh] += pr * v;
                    lacc[hh] += pr;
                }
            }
        }
        workgroupBarrier();
    }
    // Merge the parts: xs = [PARTS][GQ][D] partial outputs, then [PARTS][GQ] row sums.
    if (part < PARTS) {
        for (var hh = 0u; hh < GQ; hh++) {
            let o = (part * GQ + hh) * DD + 4u * j4;
            xs[o] = acc[hh].x;
            xs[o + 1u] = acc[hh].y;
            xs[o + 2u] = acc[hh].z;
            xs[o + 3u] = acc[hh].w;
            if (j4 == 0u) { xs[PARTS * GQ * DD + part * GQ + hh] = lacc[hh]; }
        }
    }
    workgroupBarrier();
    for (var e = lid; e < GQ * DD; e += WG) {
        let hh = e / DD;
        let d = e % DD;
        var o = 0.0;
        var l = 0.0;
        for (var pp = 0u; pp < PARTS; pp++) {
            o += xs[(pp * GQ + hh) * DD + d];
            l += xs[PARTS * GQ * DD + pp * GQ + hh];
        }
        out[qrow + e] = store_t(select(0.0, o / l, l > 0.0));
        if (d == 0u) {
            let lse = select(bitcast<f32>(0xff800000u), hm[hh] + log(l), l > 0.0);
            lse_out[qrow / DD + hh] = lse;
        }
    }
}

@compute @workgroup_size(WG)
fn step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let b = id / p.kv_heads;
    let h = id % p.kv_heads;
    let qrow = (b * p.q_heads + h * GQ) * DD;
    if (lid == 0u) { wlen = lens[b]; }
    for (var i = lid; i < GQ * D4; i += WG) {
        let o = qrow + 4u * i;
        qs[i] = vec4<f32>(f32(q[o]), f32(q[o + 1u]), f32(q[o + 2u]), f32(q[o + 3u]));
    }
    let len = workgroupUniformLoad(&wlen);
    let so = id * KMAX;
    if (len == 0u) {
        // An empty sequence: zero output, LSE -inf, no blocks.
        for (var i = lid; i < GQ * DD; i += WG) { out[qrow + i] = store_t(0.0); }
        if (lid < GQ) { lse_out[qrow / DD + lid] = bitcast<f32>(0xff800000u); }
        if (lid < KMAX) { sel_out[so + lid] = -1; }
        return;
    }
    let bq = (len - 1u) / p.block_size;
    let nb0 = cdiv(len, p.block_size);
    var visible = nb0;
    if (p.causal != 0u) { visible = bq + 1u; }
    if (visible <= KMAX) {
        for (var i = lid; i < KMAX; i += WG) { sel_tmp[i] = select(INVALID, i, i < visible); }
    } else {
        select_pisa(id, len, bq, nb0, lid);
    }
    workgroupBarrier();
    // Ascending order, INVALID (-1) last.
    for (var i = lid; i < KMAX; i += WG) {
        let v = sel_tmp[i];
        var pos = 0u;
        for (var j = 0u; j < KMAX; j++) {
            let u = sel_tmp[j];
            if (v != INVALID) {
                pos += select(0u, 1u, u < v);
            } else {
                pos += select(0u, 1u, u != INVALID || j < i);
            }
        }
        sel_s[pos] = v;
        sel_out[so + pos] = select(i32(v), -1, v == INVALID);
    }
    workgroupBarrier();
    attend(id, qrow, len, lid);
}
