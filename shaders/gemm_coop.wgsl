// Benchmark only (not a library kernel): a plain f16 GEMM on cooperative matrices, to measure
// what WGSL tensor-core code can reach on a device, the ceiling against which the attention
// kernels' TFLOP/s are read (host and test: tests/coopmat_gemm.rs; results: docs/benchmarks.md,
// Ceilings).
//
// C [M][N] f32 = A [M][K] f16 * B [N][K]^T f16 (B stored as attention stores K: one row per
// output column), f32 accumulation; M, N multiples of BM, BN and K a multiple of BK (the host
// checks). One workgroup of 4 subgroups per BM x BN tile of C, the subgroups in a 2 x 2 grid,
// each owning WM x WN 16x16 accumulators (BM = 32 WM, BN = 32 WN). Per K step of BK:
//   1. the A and B tiles, held in registers since the last step, are stored to workgroup memory
//      (A transposed, [k][m], when AT = 1, so every load is column-major `coopLoad`; B as
//      [n][k], which loads column-major as B^T); then the next step's tiles are loaded into
//      registers (in flight while this step multiplies);                           barrier
//   2. per 16-deep slice: the subgroup's WM A matrices, then for each of its WN B matrices
//      WM multiply-adds;                                                            barrier
// The accumulators are sixteen private variables behind acc_get / acc_set (a private array of
// cooperative matrices lives in local memory on the H200's driver: coop_qa.wgsl).
// DIRECT = 1 skips workgroup memory: every matrix is loaded straight from the storage buffers.
// Two more entry points (timing only, their C is not a product), at the end of the file: `peak`
// (multiply-adds with no loads) and `probe` (the price of a load against a multiply-add).
enable wgpu_cooperative_matrix;

const WM: u32 = 4u;    // 16-row tiles per subgroup (<= 4)
const WN: u32 = 4u;    // 16-column tiles per subgroup (<= 4)
const BK: u32 = 32u;   // K step (multiple of 16)
const SG: u32 = 32u;   // subgroup size (fixed)
const AT: u32 = 1u;    // 1: A staged transposed (column-major loads)
const DIRECT: u32 = 0u;

const WG: u32 = 4u * SG;
const BM: u32 = 32u * WM;
const BN: u32 = 32u * WN;
const AS: u32 = select(BK + 8u, BM + 8u, AT == 1u); // A row stride in sh, halves
const BS: u32 = BK + 8u;                            // B row stride in sh, halves
const AROWS: u32 = select(BM, BK, AT == 1u);
const NA: u32 = (BM * BK / 8u + WG - 1u) / WG;      // 16-byte pieces of A per invocation
const NB: u32 = (BN * BK / 8u + WG - 1u) / WG;
const_assert WM * WN <= 16u;

struct Dims { m: u32, n: u32, k: u32, pad: u32 }

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> bm: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read> a16: array<f16>;
@group(0) @binding(5) var<storage, read> b16: array<f16>;

// The A tile, then the B tile from B_OFF (a multiple of 8 halves: rows stay 16-byte aligned).
const B_OFF: u32 = AROWS * AS;
var<workgroup> sh: array<f16, B_OFF + BN * BS>;

var<private> acc_0: coop_mat16x16<f32, C>;
var<private> acc_1: coop_mat16x16<f32, C>;
var<private> acc_2: coop_mat16x16<f32, C>;
var<private> acc_3: coop_mat16x16<f32, C>;
var<private> acc_4: coop_mat16x16<f32, C>;
var<private> acc_5: coop_mat16x16<f32, C>;
var<private> acc_6: coop_mat16x16<f32, C>;
var<private> acc_7: coop_mat16x16<f32, C>;
var<private> acc_8: coop_mat16x16<f32, C>;
var<private> acc_9: coop_mat16x16<f32, C>;
var<private> acc_10: coop_mat16x16<f32, C>;
var<private> acc_11: coop_mat16x16<f32, C>;
var<private> acc_12: coop_mat16x16<f32, C>;
var<private> acc_13: coop_mat16x16<f32, C>;
var<private> acc_14: coop_mat16x16<f32, C>;
var<private> acc_15: coop_mat16x16<f32, C>;
var<private> apre: array<vec4<u32>, NA>;
var<private> bpre: array<vec4<u32>, NB>;

fn acc_get(i: u32) -> coop_mat16x16<f32, C> {
    switch i {
        case 0u: { return acc_0; }
        case 1u: { return acc_1; }
        case 2u: { return acc_2; }
        case 3u: { return acc_3; }
        case 4u: { return acc_4; }
        case 5u: { return acc_5; }
        case 6u: { return acc_6; }
        case 7u: { return acc_7; }
        case 8u: { return acc_8; }
        case 9u: { return acc_9; }
        case 10u: { return acc_10; }
        case 11u: { return acc_11; }
        case 12u: { return acc_12; }
        case 13u: { return acc_13; }
        case 14u: { return acc_14; }
        default: { return acc_15; }
    }
}

fn acc_set(i: u32, v: coop_mat16x16<f32, C>) {
    switch i {
        case 0u: { acc_0 = v; }
        case 1u: { acc_1 = v; }
        case 2u: { acc_2 = v; }
        case 3u: { acc_3 = v; }
        case 4u: { acc_4 = v; }
        case 5u: { acc_5 = v; }
        case 6u: { acc_6 = v; }
        case 7u: { acc_7 = v; }
        case 8u: { acc_8 = v; }
        case 9u: { acc_9 = v; }
        case 10u: { acc_10 = v; }
        case 11u: { acc_11 = v; }
        case 12u: { acc_12 = v; }
        case 13u: { acc_13 = v; }
        case 14u: { acc_14 = v; }
        default: { acc_15 = v; }
    }
}

// The A and B tiles of K step k0 into registers: piece x of A is (row x / (BK/8), 8 halves
// at 8 (x % (BK/8))), likewise B.
fn load_tiles(lid: u32, m0: u32, n0: u32, k0: u32) {
    for (var j = 0u; j < NA; j++) {
        let x = lid + j * WG;
        let r = x / (BK / 8u);
        let at = ((m0 + r) * dims.k + k0) / 8u + x % (BK / 8u);
        apre[j] = a[at];
    }
    for (var j = 0u; j < NB; j++) {
        let x = lid + j * WG;
        let r = x / (BK / 8u);
        let at = ((n0 + r) * dims.k + k0) / 8u + x % (BK / 8u);
        bpre[j] = bm[at];
    }
}

// Eight halves (16 bytes) into sh at dst, dst + step, ... (explicit stores: a private array
// here, indexed in a loop, went to local memory).
fn put8(dst: u32, step: u32, w: vec4<u32>) {
    let h0 = vec2<f16>(unpack2x16float(w.x));
    let h1 = vec2<f16>(unpack2x16float(w.y));
    let h2 = vec2<f16>(unpack2x16float(w.z));
    let h3 = vec2<f16>(unpack2x16float(w.w));
    sh[dst] = h0.x;
    sh[dst + step] = h0.y;
    sh[dst + 2u * step] = h1.x;
    sh[dst + 3u * step] = h1.y;
    sh[dst + 4u * step] = h2.x;
    sh[dst + 5u * step] = h2.y;
    sh[dst + 6u * step] = h3.x;
    sh[dst + 7u * step] = h3.y;
}

fn store_tiles(lid: u32) {
    for (var j = 0u; j < NA; j++) {
        let x = lid + j * WG;
        let r = x / (BK / 8u);
        let kk = 8u * (x % (BK / 8u));
        if (AT == 1u) {
            put8(kk * AS + r, AS, apre[j]);
        } else {
            put8(r * AS + kk, 1u, apre[j]);
        }
    }
    for (var j = 0u; j < NB; j++) {
        let x = lid + j * WG;
        put8(B_OFF + (x / (BK / 8u)) * BS + 8u * (x % (BK / 8u)), 1u, bpre[j]);
    }
}

fn a_mat(i: u32, ks: u32, wm0: u32, m0: u32, k0: u32) -> coop_mat16x16<f16, A> {
    if (DIRECT == 1u) {
        let at = (m0 + wm0 + 16u * i) * dims.k + k0 + 16u * ks;
        let lda = dims.k;
        return coopLoadT<coop_mat16x16<f16, A>>(&a16[at], lda);
    }
    if (AT == 1u) {
        let at = 16u * ks * AS + wm0 + 16u * i;
        return coopLoad<coop_mat16x16<f16, A>>(&sh[at], AS);
    }
    let at = (wm0 + 16u * i) * AS + 16u * ks;
    return coopLoadT<coop_mat16x16<f16, A>>(&sh[at], AS);
}

fn b_mat(j: u32, ks: u32, wn0: u32, n0: u32, k0: u32) -> coop_mat16x16<f16, B> {
    if (DIRECT == 1u) {
        let at = (n0 + wn0 + 16u * j) * dims.k + k0 + 16u * ks;
        let ldb = dims.k;
        return coopLoad<coop_mat16x16<f16, B>>(&b16[at], ldb);
    }
    let at = B_OFF + (wn0 + 16u * j) * BS + 16u * ks;
    return coopLoad<coop_mat16x16<f16, B>>(&sh[at], BS);
}

@compute @workgroup_size(WG)
fn gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32) {
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let wm0 = (sg / 2u) * 16u * WM;
    let wn0 = (sg % 2u) * 16u * WN;
    for (var i = 0u; i < WM * WN; i++) { acc_set(i, coop_mat16x16<f32, C>()); }
    let steps = dims.k / BK;
    if (DIRECT == 0u) { load_tiles(lid, m0, n0, 0u); }
    for (var s = 0u; s < steps; s++) {
        let k0 = s * BK;
        if (DIRECT == 0u) {
            store_tiles(lid);
            workgroupBarrier();
            if (s + 1u < steps) { load_tiles(lid, m0, n0, k0 + BK); }
        }
        for (var ks = 0u; ks < BK / 16u; ks++) {
            let a0 = a_mat(0u, ks, wm0, m0, k0);
            let a1 = a_mat(min(1u, WM - 1u), ks, wm0, m0, k0);
            let a2 = a_mat(min(2u, WM - 1u), ks, wm0, m0, k0);
            let a3 = a_mat(min(3u, WM - 1u), ks, wm0, m0, k0);
            for (var j = 0u; j < WN; j++) {
                let bj = b_mat(j, ks, wn0, n0, k0);
                acc_set(j, coopMultiplyAdd(a0, bj, acc_get(j)));
                if (WM > 1u) { acc_set(WN + j, coopMultiplyAdd(a1, bj, acc_get(WN + j))); }
                if (WM > 2u) { acc_set(2u * WN + j, coopMultiplyAdd(a2, bj, acc_get(2u * WN + j))); }
                if (WM > 3u) { acc_set(3u * WN + j, coopMultiplyAdd(a3, bj, acc_get(3u * WN + j))); }
            }
        }
        if (DIRECT == 0u) { workgroupBarrier(); }
    }
    for (var i = 0u; i < WM; i++) {
        for (var j = 0u; j < WN; j++) {
            let at = (m0 + wm0 + 16u * i) * dims.n + n0 + wn0 + 16u * j;
            let ldc = dims.n; // (a stride written inline here panics naga 30's SPIR-V writer)
            coopStoreT(acc_get(i * WN + j), &c[at], ldc);
        }
    }
}

// Timing only (its C is not a product): the rate at which a subgroup issues multiply-adds from
// WGSL with no loads in the loop. Each subgroup loads its WM A and WN B matrices once (rows and
// columns of its tile, K slice 0) and multiplies them K / 16 times into its accumulators.
@compute @workgroup_size(WG)
fn peak(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    // (WM = WN = 4: the host runs it only so.)
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let wm0 = (sg / 2u) * 16u * WM;
    let wn0 = (sg % 2u) * 16u * WN;
    for (var i = 0u; i < WM * WN; i++) { acc_set(i, coop_mat16x16<f32, C>()); }
    // (Indices bound to lets: written inline in the pointer argument they panic naga 30.)
    let lda = dims.k;
    let ia0 = (m0 + wm0) * lda;
    let ia1 = ia0 + 16u * lda;
    let ia2 = ia0 + 32u * lda;
    let ia3 = ia0 + 48u * lda;
    let ib0 = (n0 + wn0) * lda;
    let ib1 = ib0 + 16u * lda;
    let ib2 = ib0 + 32u * lda;
    let ib3 = ib0 + 48u * lda;
    let a0 = coopLoadT<coop_mat16x16<f16, A>>(&a16[ia0], lda);
    let a1 = coopLoadT<coop_mat16x16<f16, A>>(&a16[ia1], lda);
    let a2 = coopLoadT<coop_mat16x16<f16, A>>(&a16[ia2], lda);
    let a3 = coopLoadT<coop_mat16x16<f16, A>>(&a16[ia3], lda);
    let b0 = coopLoad<coop_mat16x16<f16, B>>(&b16[ib0], lda);
    let b1 = coopLoad<coop_mat16x16<f16, B>>(&b16[ib1], lda);
    let b2 = coopLoad<coop_mat16x16<f16, B>>(&b16[ib2], lda);
    let b3 = coopLoad<coop_mat16x16<f16, B>>(&b16[ib3], lda);
    for (var s = 0u; s < dims.k / 16u; s++) {
        acc_0 = coopMultiplyAdd(a0, b0, acc_0);
        acc_1 = coopMultiplyAdd(a0, b1, acc_1);
        acc_2 = coopMultiplyAdd(a0, b2, acc_2);
        acc_3 = coopMultiplyAdd(a0, b3, acc_3);
        acc_4 = coopMultiplyAdd(a1, b0, acc_4);
        acc_5 = coopMultiplyAdd(a1, b1, acc_5);
        acc_6 = coopMultiplyAdd(a1, b2, acc_6);
        acc_7 = coopMultiplyAdd(a1, b3, acc_7);
        acc_8 = coopMultiplyAdd(a2, b0, acc_8);
        acc_9 = coopMultiplyAdd(a2, b1, acc_9);
        acc_10 = coopMultiplyAdd(a2, b2, acc_10);
        acc_11 = coopMultiplyAdd(a2, b3, acc_11);
        acc_12 = coopMultiplyAdd(a3, b0, acc_12);
        acc_13 = coopMultiplyAdd(a3, b1, acc_13);
        acc_14 = coopMultiplyAdd(a3, b2, acc_14);
        acc_15 = coopMultiplyAdd(a3, b3, acc_15);
    }
    for (var i = 0u; i < 16u; i++) {
        let at = (m0 + wm0 + 16u * (i / 4u)) * dims.n + n0 + wn0 + 16u * (i % 4u);
        let ldc = dims.n;
        coopStoreT(acc_get(i), &c[at], ldc);
    }
}

// Timing only (its C is not a product): the price of a cooperative load against a multiply.
// Each subgroup multiplies two A by two B matrices (4 multiply-adds) K / 16 times; with PL != 0
// two of the four operands are reloaded every step from an address that changes with the step
// (so the loads cannot be hoisted): 1 B from workgroup memory (`coopLoad`), 2 A from workgroup
// memory (`coopLoad`), 3 A from workgroup memory row-major (`coopLoadT`), 4 B from the storage
// buffer. (WM = WN = 2: the host runs it only so.)
const PL: u32 = 0u;

@compute @workgroup_size(WG)
fn probe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let wm0 = (sg / 2u) * 16u * WM;
    let wn0 = (sg % 2u) * 16u * WN;
    let lda = dims.k;
    let ia0 = (m0 + wm0) * lda;
    let ia1 = ia0 + 16u * lda;
    let ib0 = (n0 + wn0) * lda;
    let ib1 = ib0 + 16u * lda;
    var a0 = coopLoadT<coop_mat16x16<f16, A>>(&a16[ia0], lda);
    var a1 = coopLoadT<coop_mat16x16<f16, A>>(&a16[ia1], lda);
    var b0 = coopLoad<coop_mat16x16<f16, B>>(&b16[ib0], lda);
    var b1 = coopLoad<coop_mat16x16<f16, B>>(&b16[ib1], lda);
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    var c2 = coop_mat16x16<f32, C>();
    var c3 = coop_mat16x16<f32, C>();
    for (var s = 0u; s < dims.k / 16u; s++) {
        let off = (s % 2u) * 16u;
        if (PL == 1u) {
            let o0 = B_OFF + off;
            b0 = coopLoad<coop_mat16x16<f16, B>>(&sh[o0], BS);
            let o1 = o0 + 16u * BS;
            b1 = coopLoad<coop_mat16x16<f16, B>>(&sh[o1], BS);
        }
        if (PL == 2u) {
            a0 = coopLoad<coop_mat16x16<f16, A>>(&sh[off], AS);
            let o1 = off + 32u;
            a1 = coopLoad<coop_mat16x16<f16, A>>(&sh[o1], AS);
        }
        if (PL == 3u) {
            a0 = coopLoadT<coop_mat16x16<f16, A>>(&sh[off], AS);
            let o1 = off + 16u * AS;
            a1 = coopLoadT<coop_mat16x16<f16, A>>(&sh[o1], AS);
        }
        if (PL == 4u) {
            let g0 = ib0 + off;
            let g1 = ib1 + off;
            b0 = coopLoad<coop_mat16x16<f16, B>>(&b16[g0], lda);
            b1 = coopLoad<coop_mat16x16<f16, B>>(&b16[g1], lda);
        }
        c0 = coopMultiplyAdd(a0, b0, c0);
        c1 = coopMultiplyAdd(a0, b1, c1);
        c2 = coopMultiplyAdd(a1, b0, c2);
        c3 = coopMultiplyAdd(a1, b1, c3);
    }
    let ldc = dims.n;
    let at = (m0 + wm0) * ldc + n0 + wn0;
    coopStoreT(c0, &c[at], ldc);
    let at1 = at + 16u;
    coopStoreT(c1, &c[at1], ldc);
    let at2 = at + 16u * ldc;
    coopStoreT(c2, &c[at2], ldc);
    let at3 = at2 + 16u;
    coopStoreT(c3, &c[at3], ldc);
}
