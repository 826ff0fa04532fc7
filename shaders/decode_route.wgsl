// Decode step, dispatch 1 of 3 (appended to decode.wgsl, whose header describes the design):
// `route`, one workgroup per (sequence, KV head), walks the intermediate pyramid levels of the
// token at position len - 1 (PISA.md 3.1-3.2) and writes its leaf slots to `cands`.
// A level costs three barriers: per-child partial scores | per-candidate scores (and the next
// level's slots cleared) | rank-based cut, where each kept node writes its children straight
// into the next level's slots (double-buffered `cand`).

var<workgroup> cand: array<u32, 2u * MAXC>;
var<workgroup> score: array<f32, MAXC>;
var<workgroup> xr: array<f32, XR>;

// q_h . mu for every head h of the group (a node's mean row).
fn dots_mean(row: u32) -> array<f32, GQ> {
    var a: array<f32, GQ>;
    for (var j = 0u; j < D4; j++) {
        let m = means[row + j];
        for (var hh = 0u; hh < GQ; hh++) { a[hh] += dot(qs[hh * D4 + j], m); }
    }
    return a;
}

// score[slot] for the candidates cand[co..co + MAXC] of level l >= 1 (PISA.md 2), summed over
// the group. Ends with the scores written and a barrier.
fn score_level(bh: u32, l: u32, len: u32, nb0: u32, co: u32, lid: u32) {
    let g = p.merge;
    if (p.scoring == 0u) {
        // lse: one item per (candidate, child); x = s * q.mu_c + log n_c per head.
        let nchild = level_nodes(nb0, l - 1u);
        for (var it = lid; it < MAXC * g; it += WG) {
            let node = cand[co + it / g];
            var x: array<f32, GQ>;
            for (var hh = 0u; hh < GQ; hh++) { x[hh] = NEG; }
            let child = node * g + it % g;
            if (node != INVALID && child < nchild) {
                let a = dots_mean(node_row(bh, l - 1u, child));
                let ln = log(f32(node_len(l - 1u, child, len)));
                for (var hh = 0u; hh < GQ; hh++) { x[hh] = p.scale * a[hh] + ln; }
            }
            for (var hh = 0u; hh < GQ; hh++) { xr[it * GQ + hh] = x[hh]; }
        }
        workgroupBarrier();
        for (var s = lid; s < MAXC; s += WG) {
            if (cand[co + s] == INVALID) { continue; }
            var tot = 0.0;
            for (var hh = 0u; hh < GQ; hh++) {
                var m = NEG;
                for (var c = 0u; c < g; c++) { m = max(m, xr[(s * g + c) * GQ + hh]); }
                var sum = 0.0;
                for (var c = 0u; c < g; c++) {
                    let x = xr[(s * g + c) * GQ + hh];
                    if (x > NEG_T) { sum += exp(x - m); }
                }
                tot += m + log(sum);
            }
            score[s] = tot;
        }
    } else {
        // mean / meanvar: s * q.mu + log n (+ s^2/2 * sum_d q_d^2 var_d), var = E[k^2] - mu^2.
        let mv = p.scoring == 2u;
        for (var s = lid; s < MAXC; s += WG) {
            let node = cand[co + s];
            if (node == INVALID) { continue; }
            let row = node_row(bh, l, node);
            var a1: array<f32, GQ>;
            var a2: array<f32, GQ>;
            for (var j = 0u; j < D4; j++) {
                let mu = means[row + j];
                var var_d = vec4<f32>(0.0);
                if (mv) { var_d = max(sq[row + j] - mu * mu, vec4<f32>(0.0)); }
                for (var hh = 0u; hh < GQ; hh++) {
                    let qv = qs[hh * D4 + j];
                    a1[hh] += dot(qv, mu);
                    a2[hh] += dot(qv * qv, var_d);
                }
            }
            let ln = log(f32(node_len(l, node, len)));
            var tot = 0.0;
            for (var hh = 0u; hh < GQ; hh++) {
                tot += p.scale * a1[hh] + ln + 0.5 * p.scale * p.scale * a2[hh];
            }
            score[s] = tot;
        }
    }
}

// PISA routing (PISA.md 3.1-3.2) of the query at position len - 1 down to the leaf
// candidates; returns the offset (0 or MAXC) of the slots in `cand` holding them, forced
// leaves excluded.
fn route_levels(bh: u32, len: u32, bq: u32, nb0: u32, lid: u32) -> u32 {
    let g = p.merge;
    let causal = p.causal != 0u;
    var s = 0u;
    var n = nb0;
    loop {
        n = cdiv(n, g);
        if (n <= KMAX) { break; }
        s++;
    }
    var first = level_nodes(nb0, s);
    if (causal) { first = anc(bq, s); }
    for (var i = lid; i < MAXC; i += WG) {
        cand[i] = select(INVALID, i, i < first && !(s == 0u && is_forced(bq, i)));
    }
    workgroupBarrier();
    var co = 0u;
    for (var l = s; l >= 1u; l--) {
        let cn = MAXC - co; // the next level's slots
        score_level(bh, l, len, nb0, co, lid);
        // Clear the next slots; the ancestor's children below the own path go after the
        // K * g children of the kept nodes.
        let nchild = level_nodes(nb0, l - 1u);
        let a_hi = anc(bq, l) * g;
        let a_lo = anc(bq, l - 1u);
        for (var i = lid; i < MAXC; i += WG) {
            var c = INVALID;
            if (i >= KMAX * g && causal && a_hi + (i - KMAX * g) < a_lo) {
                c = a_hi + (i - KMAX * g);
            }
            if (l == 1u && c != INVALID && is_forced(bq, c)) { c = INVALID; }
            cand[cn + i] = c;
        }
        workgroupBarrier();
        // Cut (higher score first, then lower index; scores compared through rank_key, so
        // ranks are distinct): a kept node of rank r writes its children to slots r*g...
        for (var i = lid; i < MAXC; i += WG) {
            let v = cand[co + i];
            if (v == INVALID) { continue; }
            let sc = rank_key(score[i]);
            var r = 0u;
            for (var j = 0u; j < MAXC; j++) {
                let u = cand[co + j];
                let sj = rank_key(score[j]);
                if (u != INVALID && (sj > sc || (sj == sc && u < v))) { r++; }
            }
            if (r < KMAX) {
                for (var c = 0u; c < g; c++) {
                    var ch = v * g + c;
                    if (ch >= nchild || (l == 1u && is_forced(bq, ch))) { ch = INVALID; }
                    cand[cn + r * g + c] = ch;
                }
            }
        }
        workgroupBarrier();
        co = cn;
    }
    return co;
}

@compute @workgroup_size(WG)
fn route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    let b = id / p.kv_heads;
    let h = id % p.kv_heads;
    load_q((b * p.q_heads + h * GQ) * DD, b, lid);
    let len = workgroupUniformLoad(&wlen);
    let so = id * NS;
    if (len == 0u) {
        for (var i = lid; i < NS; i += WG) { cands[so + i] = INVALID; }
        return;
    }
    let bq = (len - 1u) / p.block_size;
    let nb0 = cdiv(len, p.block_size);
    var visible = nb0;
    if (p.causal != 0u) { visible = bq + 1u; }
    if (visible <= KMAX) {
        // Every visible leaf, unscored.
        for (var i = lid; i < NS; i += WG) {
            cands[so + i] = select(INVALID, i - MAXC, i >= MAXC && i - MAXC < visible);
        }
        return;
    }
    let co = route_levels(id, len, bq, nb0, lid);
    // Forced leaves (sinks, locals, own block) in the last K slots, packed first.
    let local_start = bq - min(p.local, bq);
    let sink_end = min(p.sink, local_start);
    let nf = sink_end + bq - local_start + 1u;
    for (var i = lid; i < NS; i += WG) {
        var v = INVALID;
        if (i < MAXC) {
            v = cand[co + i];
        } else if (i - MAXC < nf) {
            let f = i - MAXC;
            v = select(local_start + f - sink_end, f, f < sink_end);
        }
        cands[so + i] = v;
    }
}
