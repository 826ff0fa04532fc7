// Block-sparse and dense flash attention on cooperative matrices (tensor cores), f16 storage,
// f32 accumulation (PISA.md sections 4 and 5). Host: pisa-wgpu/src/ops/attention/coop.rs; the
// portable twin is shaders/attention.wgsl (same bindings plus K and V again as f16 scalars at 7
// and 8, same Params, same row mapping; Params,
// the shared bindings and the selection union: attention_common.wgsl, appended).
//
// f16 only: the host prepends `enable f16;` (Storage::F16). Needs the SUBGROUP feature (the
// subgroup id picks each subgroup's tiles) and a fixed subgroup size SG (min = max), so the
// workgroup has exactly NSG subgroups.
//
// One workgroup owns RT = 16 * RB rows = (query head, query) pairs of one KV head (row r:
// query r / GH, head r % GH; rows past GH * QT are padding). Subgroup sg works on row block
// rb = sg / NSR (NSR = NSG / RB subgroups per row block) and keeps in registers the Q block of
// its rows (HD / 16 A matrices) and its share of the O block (OTS C matrices, f32). Per key tile
// of KT keys (loaded once into workgroup memory for all rows):
//   1. K and V tiles -> hsh (f16, padded rows; V transposed, one row per head-dim column) from
//      registers, then (PF = 1) the next tile's K and V are loaded into registers, in flight
//      while this tile computes;                                                  barrier
//   2. S = Q K^T on tensor cores, each subgroup STS 16x16 tiles -> fsh (f32);  barrier
//   3. SPLIT threads per row: scale to log2 units, mask, partial max -> red_sh; barrier
//   4. row max; lazy online softmax: the running max m moves only when the tile max exceeds it
//      by more than LAZY (log2 units), so P = exp2(s - m) <= 2^LAZY stays exact in f16 and O is
//      rescaled (through workgroup memory) only on those rare tiles; P (f16) -> hsh; the
//      workgroup-uniform "rescale" flag is read with workgroupUniformLoad (the barrier);
//      P is stored transposed (one row per key)
//   5. O += P V on tensor cores;                                              barrier
// Scores are in log2 units (s = scale * log2(e) * q.k, applied in f32 after the f16 MMA, so Q
// stays exact); LSE = ln2 * (m + log2 l). Sparse walks the ascending union of the tile's
// selected leaves (as the portable kernel), dense every visible KT-key tile.
//
// DIRECT = 1 (sparse with one row block: every key feeds one multiply of the workgroup, so
// staging buys no reuse): step 1 is skipped, and the K (step 2) and V (step 5) matrices are
// loaded straight from k16 / v16, 16-key tiles starting at min(t0 + 16 j, Nk - 16) (the host
// requires Nk >= 16), so no matrix load reads past the last key of its head; step 3 maps each
// column back to its token and masks those outside the tile's own range (P = 0 there).
// Otherwise cooperative loads/stores touch workgroup memory only (every offset and stride a
// multiple of 16 bytes), so no out-of-bounds matrix access can happen.
//
// Every f16 matrix staged in workgroup memory is laid out so that it loads column-major
// (`coopLoad`: K^T, V, P^T), never row-major (`coopLoadT`): on the H200 (driver 580) a
// row-major B load of V cost about as much as everything else in the dense kernel together
// (knock-out measurement in docs/benchmarks.md, A.4). Q (loaded once) keeps coopLoadT.
enable wgpu_cooperative_matrix;

const HD: u32 = 128u;    // head dim (multiple of 16, <= 128)
const RB: u32 = 1u;      // row blocks of 16 rows (1, 2 or 4)
const KT: u32 = 64u;     // keys per tile (multiple of 16)
const QT: u32 = 4u;      // queries per workgroup
const SELK: u32 = 16u;   // top_k (sparse; 1 for dense)
const SG: u32 = 32u;     // subgroup size (fixed)
const KVH: u32 = 17408u; // halves of the K + V (or Q staging) region = max(KT KS + HD VS, RT KS)
const PF: u32 = 1u;      // 1: load the next tile's K and V into registers during this tile
const DIRECT: u32 = 0u;  // 1: K and V go to the tensor cores straight from the storage buffers

const NSG: u32 = 4u;                 // subgroups per workgroup
const WG: u32 = NSG * SG;            // invocations
const RT: u32 = 16u * RB;            // rows per workgroup (<= WG)
const NSR: u32 = NSG / RB;           // subgroups per row block
const HD16: u32 = HD / 16u;
const KT16: u32 = KT / 16u;
const OTS: u32 = (HD16 + NSR - 1u) / NSR; // O tiles per subgroup (some may be dummies)
const STS: u32 = (KT16 + NSR - 1u) / NSR; // S tiles per subgroup (some may be dummies)
const KS: u32 = HD + 8u;             // K / V / Q row stride, halves (16-byte multiple)
const VS: u32 = KT + 8u;             // V^T row stride (one row per head-dim column), halves
const PS: u32 = RT + 8u;             // P^T row stride (one row per key), halves
const SS: u32 = KT + 4u;             // S row stride, floats
const V_OFF: u32 = KT * KS;          // V tile in hsh
const P_OFF: u32 = KVH;              // P in hsh
const ST_OFF: u32 = RT * SS;         // per-subgroup 16x16 f32 staging in fsh
const SPLIT: u32 = WG / RT;          // softmax threads per row
const KPT: u32 = KT / SPLIT;         // keys per softmax thread
const NPF: u32 = (KT * (HD / 4u) + WG - 1u) / WG; // K (and V) vec4 per thread per tile
const NEG: f32 = -3.0e38;            // "no score yet"
const LAZY: f32 = 8.0;               // rescale threshold, log2 units (P <= 256)

@group(0) @binding(1) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<f16>>;
@group(0) @binding(5) var<storage, read_write> o: array<vec4<f16>>;
// The K and V buffers again, as f16 scalars (the host binds them at 2 / 7 and 3 / 8).
@group(0) @binding(7) var<storage, read> k16: array<f16>;
@group(0) @binding(8) var<storage, read> v16: array<f16>;

// Every workgroup variable is a multiple of 16 bytes long and the two that cooperative
// matrices touch come first, so whatever order the driver packs them in, hsh and fsh start
// 16-byte aligned (cooperative loads and stores need 16-byte aligned rows).
var<workgroup> hsh: array<f16, KVH + KT * PS>;         // K | V^T tiles (Q staging), then P^T
var<workgroup> fsh: array<f32, RT * SS + NSG * 256u>;   // S, then per-subgroup staging
var<workgroup> red_sh: array<f32, WG>;
var<workgroup> alpha_sh: array<f32, RT>;
var<workgroup> flag_sh: array<atomic<u32>, 4>; // [0]: some row's running max moved this tile

// qa_get / qa_set: the Q rows' A matrices (coop_qa.wgsl, appended).
// This subgroup's O tiles (f32 accumulators), in eight private variables behind oacc_get /
// oacc_set instead of a private array, which the driver kept in local memory (as the A
// matrices: coop_qa.wgsl).
const_assert OTS <= 8u;
var<private> oacc_0: coop_mat16x16<f32, C>;
var<private> oacc_1: coop_mat16x16<f32, C>;
var<private> oacc_2: coop_mat16x16<f32, C>;
var<private> oacc_3: coop_mat16x16<f32, C>;
var<private> oacc_4: coop_mat16x16<f32, C>;
var<private> oacc_5: coop_mat16x16<f32, C>;
var<private> oacc_6: coop_mat16x16<f32, C>;
var<private> oacc_7: coop_mat16x16<f32, C>;
var<private> kpre: array<vec4<f16>, NPF>; // K / V of the tile to stage next
var<private> vpre: array<vec4<f16>, NPF>;
var<private> m_run: f32;  // running max of the softmax row (log2 units)
var<private> l_run: f32;  // running sum over this thread's share of keys
var<private> lid: u32;
var<private> sg: u32;
var<private> lane: u32;
var<private> b: u32;
var<private> kvh: u32;
var<private> hq0: u32;
var<private> heads: u32;
var<private> i0: u32;


// O tile i (< OTS) of this subgroup.
fn oacc_get(i: u32) -> coop_mat16x16<f32, C> {
    switch i {
        case 0u: { return oacc_0; }
        case 1u: { return oacc_1; }
        case 2u: { return oacc_2; }
        case 3u: { return oacc_3; }
        case 4u: { return oacc_4; }
        case 5u: { return oacc_5; }
        case 6u: { return oacc_6; }
        default: { return oacc_7; }
    }
}

fn oacc_set(i: u32, v: coop_mat16x16<f32, C>) {
    switch i {
        case 0u: { oacc_0 = v; }
        case 1u: { oacc_1 = v; }
        case 2u: { oacc_2 = v; }
        case 3u: { oacc_3 = v; }
        case 4u: { oacc_4 = v; }
        case 5u: { oacc_5 = v; }
        case 6u: { oacc_6 = v; }
        default: { oacc_7 = v; }
    }
}

fn row_valid(r: u32) -> bool {
    return r < RT && r % p.gh < heads && r / p.gh < QT && i0 + r / p.gh < p.q_len;
}

fn row_on(r: u32, mask: u32) -> bool {
    return row_valid(r) && (mask == 0xffffffffu || ((mask >> (r / p.gh)) & 1u) != 0u);
}

// Decodes the workgroup, loads the Q block of this subgroup into registers, resets the state.
fn setup(id: u32, qt: u32) {
    let hc = id % p.head_chunks;
    let bh = id / (p.head_chunks * p.n_qtiles);
    b = bh / p.kv_heads;
    kvh = bh % p.kv_heads;
    hq0 = kvh * p.group + hc * p.gh;
    heads = min(p.gh, p.group - hc * p.gh);
    i0 = qt * QT;
    for (var x = lid; x < RT * (HD / 4u); x += WG) {
        let r = x / (HD / 4u);
        let c = x % (HD / 4u);
        var val = vec4<f16>(0.0h);
        if (row_valid(r)) {
            val = q[b * p.q_sb + (hq0 + r % p.gh) * p.q_sh + (i0 + r / p.gh) * p.q_sn + c];
        }
        let at = r * KS + 4u * c;
        hsh[at] = val.x;
        hsh[at + 1u] = val.y;
        hsh[at + 2u] = val.z;
        hsh[at + 3u] = val.w;
    }
    workgroupBarrier();
    let rb = sg / NSR;
    for (var ds = 0u; ds < HD16; ds++) {
        let at = rb * 16u * KS + ds * 16u;
        qa_set(ds, coopLoadT<coop_mat16x16<f16, A>>(&hsh[at], KS));
    }
    for (var i = 0u; i < OTS; i++) { oacc_set(i, coop_mat16x16<f32, C>()); }
    m_run = NEG;
    l_run = 0.0;
    workgroupBarrier();
}

// First key of 16-key tile j of the tile starting at t0 (DIRECT), clamped into the sequence.
fn tstart(t0: u32, j: u32) -> u32 {
    return min(t0 + j * 16u, p.k_len - 16u);
}

// Multiplies every O tile of this subgroup by its rows' alpha_sh, through the staging tile.
// Uniform control flow only (barriers inside).
fn rescale_o() {
    let rb = sg / NSR;
    let st = ST_OFF + sg * 256u;
    for (var i = 0u; i < OTS; i++) {
        workgroupBarrier();
        coopStoreT(oacc_get(i), &fsh[st], 16u);
        workgroupBarrier();
        for (var e = lane; e < 256u; e += SG) {
            fsh[st + e] *= alpha_sh[rb * 16u + e / 16u];
        }
        workgroupBarrier();
        oacc_set(i, coopLoadT<coop_mat16x16<f32, C>>(&fsh[st], 16u));
    }
    workgroupBarrier();
}

// Loads K and V of keys t0 .. t0 + tcount (zero past the tile / the sequence) into registers:
// piece x of K is (key x / (HD/4), vec4 x % (HD/4)); piece x of V is (key x % KT, vec4 x / KT),
// keys fastest, so the transposed stores of stage_kv spread over the banks.
fn prefetch(t0: u32, tcount: u32) {
    for (var j = 0u; j < NPF; j++) {
        let x = lid + j * WG;
        let kk = x / (HD / 4u);
        let c = x % (HD / 4u);
        let kv_ = x % KT;
        let cv = x / KT;
        var kv = vec4<f16>(0.0h);
        var vv = vec4<f16>(0.0h);
        if (x < KT * (HD / 4u) && kk < tcount && t0 + kk < p.k_len) {
            kv = k[b * p.k_sb + kvh * p.k_sh + (t0 + kk) * p.k_sn + c];
        }
        if (x < KT * (HD / 4u) && kv_ < tcount && t0 + kv_ < p.k_len) {
            vv = v[b * p.v_sb + kvh * p.v_sh + (t0 + kv_) * p.v_sn + cv];
        }
        kpre[j] = kv;
        vpre[j] = vv;
    }
}

// Writes the prefetched K tile ([key][d], stride KS) and V tile transposed ([d][key], stride
// VS) into hsh.
fn stage_kv() {
    for (var j = 0u; j < NPF; j++) {
        let x = lid + j * WG;
        if (x < KT * (HD / 4u)) {
            let kv = kpre[j];
            let vv = vpre[j];
            let at = (x / (HD / 4u)) * KS + 4u * (x % (HD / 4u));
            hsh[at] = kv.x;
            hsh[at + 1u] = kv.y;
            hsh[at + 2u] = kv.z;
            hsh[at + 3u] = kv.w;
            let av = V_OFF + 4u * (x / KT) * VS + x % KT;
            hsh[av] = vv.x;
            hsh[av + VS] = vv.y;
            hsh[av + 2u * VS] = vv.z;
            hsh[av + 3u * VS] = vv.w;
        }
    }
}

// One tile of keys t0 .. t0 + tcount (tcount <= KT) for the rows whose query bit is in `mask`
// (all rows: 0xffffffff). `live`: O may be nonzero (false on the first tile). With PF = 1 the
// registers already hold this tile (the caller prefetched it) and the tile after it,
// n0 .. n0 + ncount (ncount 0: none), is prefetched here. Uniform control flow only.
fn process_tile(t0: u32, tcount: u32, mask: u32, live: bool, n0: u32, ncount: u32) {
    // 1. K and V tiles; reset the rescale flag (last read before the previous tile's end).
    if (lid == 0u) { atomicStore(&flag_sh[0], 0u); }
    if (DIRECT == 0u) {
        if (PF == 0u) { prefetch(t0, tcount); }
        stage_kv();
        workgroupBarrier();
        if (PF == 1u) { prefetch(n0, ncount); }
    }
    // 2. S = Q K^T (a dummy tile past KT16 goes to this subgroup's staging tile).
    let rb = sg / NSR;
    let part = sg % NSR;
    for (var j = 0u; j < STS; j++) {
        let kc = part + j * NSR;
        let kcc = min(kc, KT16 - 1u);
        var acc = coop_mat16x16<f32, C>();
        if (DIRECT == 1u) {
            let row0 = 4u * (b * p.k_sb + kvh * p.k_sh + tstart(t0, kcc) * p.k_sn);
            for (var ds = 0u; ds < HD16; ds++) {
                let at = row0 + ds * 16u;
                let kb = coopLoad<coop_mat16x16<f16, B>>(&k16[at], 4u * p.k_sn);
                acc = coopMultiplyAdd(qa_get(ds), kb, acc);
            }
        } else {
            for (var ds = 0u; ds < HD16; ds++) {
                let at = kcc * 16u * KS + ds * 16u;
                let kb = coopLoad<coop_mat16x16<f16, B>>(&hsh[at], KS);
                acc = coopMultiplyAdd(qa_get(ds), kb, acc);
            }
        }
        var dst = ST_OFF + sg * 256u;
        var stride = 16u;
        if (kc < KT16) {
            dst = rb * 16u * SS + kc * 16u;
            stride = SS;
        }
        let d = dst;
        let sd = stride;
        coopStoreT(acc, &fsh[d], sd);
    }
    workgroupBarrier();
    // 3. Scaled, masked scores and the partial max of this thread's keys.
    let srow = lid / SPLIT;
    let scol = lid % SPLIT;
    let on = row_on(srow, mask);
    let pos = p.k_len - p.q_len + i0 + srow / p.gh;
    var s: array<f32, KPT>;
    var tmax = NEG;
    for (var j = 0u; j < KPT; j++) {
        let kk = scol + j * SPLIT;
        var t = t0 + kk;
        var own = true;
        if (DIRECT == 1u) {
            // Column kk holds key tstart + kk % 16; keep it only inside this 16-key tile's range.
            let lo = t0 + (kk / 16u) * 16u;
            t = tstart(t0, kk / 16u) + kk % 16u;
            own = t >= lo && t < lo + 16u;
        }
        let ok = on && own && t - t0 < tcount && t < p.k_len && (p.causal == 0u || t <= pos);
        s[j] = NEG;
        if (ok) {
            s[j] = fsh[srow * SS + kk] * p.scale_log2;
            tmax = max(tmax, s[j]);
        }
    }
    red_sh[lid] = tmax;
    workgroupBarrier();
    // 4. Lazy online softmax; P (f16) -> hsh. A row whose running max moves raises the
    //    workgroup's rescale flag (not on the first tile: O is still zero).
    var rmax = NEG;
    for (var x = 0u; x < SPLIT; x++) { rmax = max(rmax, red_sh[srow * SPLIT + x]); }
    var m_new = m_run;
    if (rmax > m_run + LAZY) { m_new = rmax; }
    let alpha = exp2(m_run - m_new);
    l_run *= alpha;
    for (var j = 0u; j < KPT; j++) {
        let kk = scol + j * SPLIT;
        var pj = 0.0;
        if (s[j] > NEG) { pj = exp2(s[j] - m_new); }
        l_run += pj;
        hsh[P_OFF + kk * PS + srow] = f16(pj);
    }
    if (scol == 0u) {
        alpha_sh[srow] = alpha;
        if (live && m_new != m_run) { atomicOr(&flag_sh[0], 1u); }
    }
    m_run = m_new;
    let resc = workgroupUniformLoad(&flag_sh[0]);
    if (resc != 0u) { rescale_o(); }
    // 5. O += P V (a dummy O tile past HD16 reads the last V columns and is never stored).
    //    O tile outer, its accumulator in a local across the key steps, so each O tile is read
    //    and written once per key tile (key steps outer, reading and writing the O tile per
    //    multiply, was 1.2x to 1.5x slower for the dense kernel on the H200, when the tiles were
    //    still a private array); P is reloaded per O tile from workgroup memory.
    for (var i = 0u; i < OTS; i++) {
        let dc = min(part + i * NSR, HD16 - 1u);
        var acc = oacc_get(i);
        for (var ks = 0u; ks < KT16; ks++) {
            let ap = P_OFF + ks * 16u * PS + rb * 16u;
            let pa = coopLoad<coop_mat16x16<f16, A>>(&hsh[ap], PS);
            if (DIRECT == 1u) {
                let av = 4u * (b * p.v_sb + kvh * p.v_sh + tstart(t0, ks) * p.v_sn) + dc * 16u;
                let vb = coopLoadT<coop_mat16x16<f16, B>>(&v16[av], 4u * p.v_sn);
                acc = coopMultiplyAdd(pa, vb, acc);
            } else {
                let av = V_OFF + dc * 16u * VS + ks * 16u;
                let vb = coopLoad<coop_mat16x16<f16, B>>(&hsh[av], VS);
                acc = coopMultiplyAdd(pa, vb, acc);
            }
        }
        oacc_set(i, acc);
    }
    workgroupBarrier();
}

// Reduces the running sums, writes LSE and O = acc / l (zeros and -inf for an empty row).
fn finish() {
    red_sh[lid] = l_run;
    workgroupBarrier();
    let srow = lid / SPLIT;
    if (lid % SPLIT == 0u) {
        var l = 0.0;
        for (var x = 0u; x < SPLIT; x++) { l += red_sh[srow * SPLIT + x]; }
        alpha_sh[srow] = l;
        if (row_valid(srow)) {
            let i = i0 + srow / p.gh;
            let hq = hq0 + srow % p.gh;
            var out = bitcast<f32>(neg_inf_bits());
            if (l > 0.0) { out = (m_run + log2(l)) * 0.6931471805599453; }
            lse[(b * p.q_heads + hq) * p.q_len + i] = out;
        }
    }
    let rb = sg / NSR;
    let part = sg % NSR;
    let st = ST_OFF + sg * 256u;
    for (var i = 0u; i < OTS; i++) {
        workgroupBarrier();
        coopStoreT(oacc_get(i), &fsh[st], 16u);
        workgroupBarrier();
        let dc = part + i * NSR;
        for (var e = lane; e < 64u; e += SG) {
            let r = rb * 16u + e / 4u;
            let c4 = e % 4u;
            if (dc < HD16 && row_valid(r)) {
                let l = alpha_sh[r];
                var val = vec4<f32>(0.0);
                if (l > 0.0) {
                    let x = st + (e / 4u) * 16u + 4u * c4;
                    val = vec4<f32>(fsh[x], fsh[x + 1u], fsh[x + 2u], fsh[x + 3u]) / l;
                }
                let at = b * p.o_sb + (hq0 + r % p.gh) * p.o_sh + (i0 + r / p.gh) * p.o_sn
                    + dc * 4u + c4;
                o[at] = vec4<f16>(val);
            }
        }
    }
}

@compute @workgroup_size(WG)
fn sparse(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sgid: u32,
          @builtin(subgroup_invocation_id) sli: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    lid = li;
    sg = sgid;
    lane = sli;
    setup(id, (id / p.head_chunks) % p.n_qtiles);
    // The ascending union of the tile's selections (attention_common.wgsl).
    let nu = build_union(lid, (b * p.kv_heads + kvh) * p.q_len, i0);
    // Flat walk over (block, KT-key piece): tile j is piece j % tpb of union entry j / tpb.
    let tpb = (p.block_size + KT - 1u) / KT;
    let total = nu * tpb;
    if (DIRECT == 0u && PF == 1u && total > 0u) {
        prefetch(ublk[0] * p.block_size, min(p.block_size, KT));
    }
    for (var j = 0u; j < total; j++) {
        let u = j / tpb;
        let off = (j % tpb) * KT;
        let un = (j + 1u) / tpb;
        let offn = ((j + 1u) % tpb) * KT;
        var n0 = 0u;
        var ncount = 0u;
        if (j + 1u < total) {
            n0 = ublk[un] * p.block_size + offn;
            ncount = min(p.block_size - offn, KT);
        }
        process_tile(ublk[u] * p.block_size + off, min(p.block_size - off, KT), umask[u], j > 0u,
                     n0, ncount);
    }
    finish();
}

@compute @workgroup_size(WG)
fn dense(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sgid: u32,
         @builtin(subgroup_invocation_id) sli: u32) {
    let id = linear_id(wid, nwg);
    if (id >= p.wg_count) { return; }
    lid = li;
    sg = sgid;
    lane = sli;
    var qt = (id / p.head_chunks) % p.n_qtiles;
    if (p.causal != 0u) { qt = p.n_qtiles - 1u - qt; } // longest rows first
    setup(id, qt);
    var n_keys = p.k_len;
    if (p.causal != 0u) {
        let last = min(qt * QT + QT, p.q_len) - 1u;
        n_keys = p.k_len - p.q_len + last + 1u;
    }
    let tiles = (n_keys + KT - 1u) / KT;
    if (DIRECT == 0u && PF == 1u) { prefetch(0u, KT); }
    for (var j = 0u; j < tiles; j++) {
        var ncount = 0u;
        if (j + 1u < tiles) { ncount = KT; }
        process_tile(j * KT, KT, 0xffffffffu, j > 0u, (j + 1u) * KT, ncount);
    }
    finish();
}
