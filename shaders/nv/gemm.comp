#version 450
// C = A B^T on NVIDIA cooperative matrices 2 (the ceiling the attention kernels of this path are
// read against, as shaders/gemm_coop.wgsl is for the portable path): A [M, K] and B [N, K] f16
// row-major, C [M, N] f32 row-major, f32 accumulation. One workgroup per BM x BN tile of C
// (x: column tiles, y: row tiles); the tile's matrices are workgroup-scope, so the driver
// stages A and B and splits the product over the workgroup's subgroups. Loads past M, N or K
// read 0 (clamp-to-constant tensor layouts) and stores past M or N are dropped, so any sizes
// work. Defines: BM, BN, BK (tile), WG (invocations), UNR (K steps unrolled in whole tiles).
#include "common.glsl"

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer BufA { float16_t a[]; };
layout(set = 0, binding = 1, std430) readonly buffer BufB { float16_t b[]; };
layout(set = 0, binding = 2, std430) writeonly buffer BufC { float c[]; };
layout(set = 0, binding = 3, std140) uniform Dims { uint m; uint n; uint k; } dims;

void main() {
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint n0 = gl_WorkGroupID.x * BN;
    tensorLayoutNV<2, CLAMP> la = createTensorLayoutNV(2, CLAMP);
    tensorLayoutNV<2, CLAMP> lb = createTensorLayoutNV(2, CLAMP);
    tensorLayoutNV<2, CLAMP> lc = createTensorLayoutNV(2, CLAMP);
    la = setTensorLayoutDimensionNV(la, dims.m, dims.k);
    lb = setTensorLayoutDimensionNV(lb, dims.n, dims.k);
    lc = setTensorLayoutDimensionNV(lc, dims.m, dims.n);
    // B is read as its transpose: element (kk, nn) of the B operand is b[nn * K + kk].
    tensorViewNV<2, false, 1, 0> transpose = createTensorViewNV(2, false, 1, 0);

    coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> acc =
        coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(0.0);
    // A tile wholly inside C, with K a multiple of 8, runs its K steps UNR at a time through
    // layouts without clamping whose row stride the compiler sees as a multiple of 8 elements
    // (16 bytes); what is left of K, and every other tile, through the clamped layouts. On the
    // H100 (2026-12-06, docs/benchmarks.md A.62; 8192^3, 128 x 128 tiles, K step 32): 161.7
    // TFLOP/s clamped, 202.6 unclamped and aligned, 246.9 with 4 steps unrolled; clamped with 4
    // steps unrolled 136.9.
    const uint ka = dims.k & ~7u;
    tensorLayoutNV<2> lau = createTensorLayoutNV(2);
    tensorLayoutNV<2> lbu = createTensorLayoutNV(2);
    lau = setTensorLayoutDimensionNV(lau, dims.m, ka);
    lbu = setTensorLayoutDimensionNV(lbu, dims.n, ka);
    lau = setTensorLayoutStrideNV(lau, ka, 1);
    lbu = setTensorLayoutStrideNV(lbu, ka, 1);
    const bool inside = m0 + BM <= dims.m && n0 + BN <= dims.n && ka == dims.k;
    const uint kfull = inside ? dims.k - dims.k % (BK * UNR) : 0u;
    uint k0 = 0;
    [[dont_unroll]]
    for (; k0 < kfull; k0 += BK * UNR) {
        [[unroll]] for (uint j = 0; j < UNR; j++) {
            coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> ma;
            coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> mb;
            coopMatLoadTensorNV(ma, a, 0, sliceTensorLayoutNV(lau, m0, BM, k0 + j * BK, BK));
            coopMatLoadTensorNV(mb, b, 0, sliceTensorLayoutNV(lbu, n0, BN, k0 + j * BK, BK),
                                transpose);
            acc = coopMatMulAdd(ma, mb, acc);
        }
    }
    [[dont_unroll]]
    for (; k0 < dims.k; k0 += BK) {
        coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> ma;
        coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> mb;
        coopMatLoadTensorNV(ma, a, 0, sliceTensorLayoutNV(la, m0, BM, k0, BK));
        coopMatLoadTensorNV(mb, b, 0, sliceTensorLayoutNV(lb, n0, BN, k0, BK), transpose);
        acc = coopMatMulAdd(ma, mb, acc);
    }
    coopMatStoreTensorNV(acc, c, 0, sliceTensorLayoutNV(lc, m0, BM, n0, BN));
}
