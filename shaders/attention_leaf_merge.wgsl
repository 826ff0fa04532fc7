// Leaf-major block-sparse attention, part 3 of 3 (PISA.md 4; host:
// pisa-wgpu/src/ops/attention/by_leaf.rs): merges the per-(query, leaf) partial states written
// by attention_leaf(_coop).wgsl (FlashDecoding: M = max m, L = sum l e^(m - M),
// O = sum O_part e^(m - M) / L, LSE = M + log L; a partial with l = 0 has no visible key and is
// skipped; no state at all gives O = 0 and LSE = -inf, as the tile kernels write). One
// workgroup per query i0 + i_local of (b, KV head) bh0 + hb (hb < bl.heads), all GQ heads,
// numbered hb * nq + i_local. O: store_t at its own strides (o_s*); LSE: f32 [B, Hq, Nq].
// (Params, p, linear_id: select_common.wgsl, prepended; the Buckets uniform: leaf_chunk.wgsl,
// appended.)

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const GQ: u32 = 4u;   // query heads per KV head
const MC: u32 = 16u;  // selection slots per query (top_k)
const WG: u32 = 64u;

@group(0) @binding(5) var<storage, read_write> o: array<store_t>;
@group(0) @binding(15) var<storage, read_write> lse: array<f32>;
@group(0) @binding(12) var<storage, read> opart: array<f32>;
@group(0) @binding(13) var<storage, read> mlpart: array<vec2<f32>>;
@group(0) @binding(14) var<storage, read_write> spos: array<u32>;

var<workgroup> rows: array<u32, MC>;
// (slot s, head h) at s * GQ + h: m (NEG for no state); l, then the weight e^(m - M) / L (0 for
// no state).
var<workgroup> wm: array<f32, MC * GQ>;
var<workgroup> w: array<f32, MC * GQ>;
var<workgroup> hm: array<f32, GQ>;
var<workgroup> hinv: array<f32, GQ>;

const NEG: f32 = -3.0e38;

// Every global load of a phase is issued before any of its results is used (no load behind a
// branch or behind another load), so a workgroup's time is a few memory round trips, not one
// per slot: 1. the slots' rows | 2. each (slot, head)'s (m, l) | 3. per head M, L and the LSE,
// from workgroup memory | 4. the weights | 5. O, each element summing its slots' rows, a slot
// without a state reading row h with weight 0 (selected away from the garbage it may hold).
// (The NVIDIA merge, shaders/nv/attention_leaf_merge.comp, has the same phases.)
@compute @workgroup_size(WG)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let il = linear_id(wid, nwg);
    if (il >= bl.heads * bl.nq) { return; }
    let i = bl.i0 + il % bl.nq;
    let bh = bl.bh0 + il / bl.nq;
    let b = bh / p.kv_heads;
    let hkv = bh % p.kv_heads;
    // 1. spos holds 1 + the first row of a slot's state, 0 for a slot without one; zeroed once
    //    read, ready for the host's next range.
    for (var s = lid; s < MC; s += WG) {
        rows[s] = spos[il * MC + s];
        spos[il * MC + s] = 0u;
    }
    workgroupBarrier();
    // 2. The states (a state with l = 0 saw no key: no state).
    for (var x = lid; x < MC * GQ; x += WG) {
        let r = rows[x / GQ];
        var ml = vec2<f32>(NEG, 0.0);
        if (r != 0u) { ml = mlpart[r - 1u + x % GQ]; }
        let on = ml.y > 0.0;
        wm[x] = select(NEG, ml.x, on);
        w[x] = select(0.0, ml.y, on);
    }
    workgroupBarrier();
    // 3. Per head: M, L and the LSE.
    for (var h = lid; h < GQ; h += WG) {
        var mx = NEG;
        for (var s = 0u; s < MC; s++) { mx = max(mx, wm[s * GQ + h]); }
        var l = 0.0;
        for (var s = 0u; s < MC; s++) {
            let ls = w[s * GQ + h];
            if (ls > 0.0) { l += ls * exp(wm[s * GQ + h] - mx); }
        }
        hm[h] = mx;
        hinv[h] = select(0.0, 1.0 / l, l > 0.0);
        var out = bitcast<f32>(neg_inf_bits());
        if (l > 0.0) { out = mx + log(l); }
        lse[(b * p.q_heads + hkv * GQ + h) * p.q_len + i] = out;
    }
    workgroupBarrier();
    // 4. The weights of the (unnormalised) partial rows.
    for (var x = lid; x < MC * GQ; x += WG) {
        let h = x % GQ;
        w[x] = select(0.0, exp(wm[x] - hm[h]) * hinv[h], w[x] > 0.0);
    }
    workgroupBarrier();
    // 5. O.
    for (var x = lid; x < GQ * p.head_dim; x += WG) {
        let h = x / p.head_dim;
        let d = x % p.head_dim;
        var acc = 0.0;
        for (var s = 0u; s < MC; s++) {
            let ws = w[s * GQ + h];
            let r = select(0u, rows[s] - 1u, ws != 0.0);
            let v = opart[(r + h) * p.head_dim + d];
            acc += select(0.0, v * ws, ws != 0.0);
        }
        o[b * p.o_sb + (hkv * GQ + h) * p.o_sh + i * p.o_sn + d] = store_t(acc);
    }
}

// -inf as a runtime value: WGSL const-evaluates `bitcast<f32>(0xff800000u)` and Tint (Dawn,
// the browsers' WGSL compiler) refuses -inf as a constant ("value -inf cannot be represented as
// 'f32'"), where naga accepts it.
fn neg_inf_bits() -> u32 { return 0xff800000u; }
