#version 450
// Probes of the cooperative-matrix-2 operations the NVIDIA kernels rely on, each checked
// against the CPU by tests/nv_gemm.rs on a device with VK_NV_cooperative_matrix2. One
// workgroup; A [64, 128] f16 and B [64, 128] f16 row-major; S = A B^T (64 x 64, f32).
//   PROBE 1: A gathered into workgroup memory by the invocations, then loaded from there as a
//            workgroup-scope matrix; out[64 * 64] = S (tensor store).
//   PROBE 2: out[r] = max_c S[r, c], written from a per-element callback at column 0.
// (A one-column tensor store of the row-reduced matrix does not give out[r]: the driver also
// stores the columns past the layout's one, over the next rows.)
#include "common.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(set = 0, binding = 0, std430) readonly buffer BufA { float16_t a[]; };
layout(set = 0, binding = 1, std430) readonly buffer BufB { float16_t b[]; };
layout(set = 0, binding = 2, std430) buffer BufC { float outv[]; };

shared float16_t ash[64 * 128];

float max_reduce(const in float x, const in float y) { return max(x, y); }
float store_col0(const in uint r, const in uint c, const in float x) {
    if (c == 0) { outv[r] = x; }
    return x;
}

void main() {
    tensorLayoutNV<2> la = createTensorLayoutNV(2);
    la = setTensorLayoutDimensionNV(la, 64, 128);
    tensorViewNV<2, false, 1, 0> transpose = createTensorViewNV(2, false, 1, 0);
    coopmat<float16_t, gl_ScopeWorkgroup, 64, 128, gl_MatrixUseA> ma;
#if PROBE == 1
    for (uint x = gl_LocalInvocationIndex; x < 64 * 128; x += 128) { ash[x] = a[x]; }
    barrier();
    coopMatLoad(ma, ash, 0, 128, gl_CooperativeMatrixLayoutRowMajor);
#else
    coopMatLoadTensorNV(ma, a, 0, sliceTensorLayoutNV(la, 0, 64, 0, 128));
#endif
    coopmat<float16_t, gl_ScopeWorkgroup, 128, 64, gl_MatrixUseB> mb;
    coopMatLoadTensorNV(mb, b, 0, sliceTensorLayoutNV(la, 0, 64, 0, 128), transpose);
    coopmat<float, gl_ScopeWorkgroup, 64, 64, gl_MatrixUseAccumulator> s =
        coopmat<float, gl_ScopeWorkgroup, 64, 64, gl_MatrixUseAccumulator>(0.0);
    s = coopMatMulAdd(ma, mb, s);
#if PROBE == 1
    tensorLayoutNV<2> lc = createTensorLayoutNV(2);
    lc = setTensorLayoutDimensionNV(lc, 64, 64);
    coopMatStoreTensorNV(s, outv, 0, sliceTensorLayoutNV(lc, 0, 64, 0, 64));
#else
    coopmat<float, gl_ScopeWorkgroup, 64, 64, gl_MatrixUseAccumulator> m;
    coopMatReduceNV(m, s, gl_CooperativeMatrixReduceRowNV, max_reduce);
    coopMatPerElementNV(m, m, store_col0);
#endif
}
