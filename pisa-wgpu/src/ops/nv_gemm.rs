//! C = A B^T on NVIDIA cooperative matrices 2 (`shaders/nv/gemm.comp`): the ceiling the
//! NVIDIA attention kernels are read against, as `shaders/gemm_coop.wgsl` is for WGSL
//! (benchmark and tests only). A `[m, k]` and B `[n, k]` f16 row-major, C `[m, n]` f32.

use crate::error::{GpuError, Result};
use crate::nv_kernel;
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::Context;
use crate::runtime::nv::{NvBinding, NvKernel};
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;

const B: &[(u32, NvBinding)] = &[
    (0, NvBinding::Read),
    (1, NvBinding::Read),
    (2, NvBinding::Write),
    (3, NvBinding::Uniform),
];

/// The GEMM variants of `shaders/nv/kernels.txt`, with their tile (BM, BN).
pub const VARIANTS: [(NvKernel, u32, u32); 5] = [
    (nv_kernel!("gemm_128x128x32", B), 128, 128),
    (nv_kernel!("gemm_128x128x64", B), 128, 128),
    (nv_kernel!("gemm_128x256x32", B), 128, 256),
    (nv_kernel!("gemm_256x128x64", B), 256, 128),
    (nv_kernel!("gemm_64x64x64", B), 64, 64),
];

/// Records C = A B^T with variant `v` of [`VARIANTS`] into `enc` (one pass named "gemm").
/// Errors: [`GpuError::Unsupported`] without `VK_NV_cooperative_matrix2` or for a variant
/// index out of range, or when a tensor's length or storage does not match;
/// [`pisa_core::PisaError::BufferLen`] for a tensor whose elements do not fit its buffer.
#[allow(clippy::too_many_arguments)]
pub fn record_gemm(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    v: usize,
    a: &GpuTensor,
    b: &GpuTensor,
    c: &GpuTensor,
    (m, n, k): (usize, usize, usize),
    prof: Option<&mut Profiler>,
) -> Result<()> {
    let Some(&(kernel, bm, bn)) = VARIANTS.get(v) else {
        return Err(GpuError::Unsupported(format!("no NVIDIA GEMM variant {v}")));
    };
    for (what, t) in [("a", a), ("b", b), ("c", c)] {
        t.check_fits(what)?;
    }
    let ok = a.len == m * k
        && b.len == n * k
        && c.len == m * n
        && a.storage == Storage::F16
        && b.storage == Storage::F16
        && c.storage == Storage::F32;
    if !ok {
        return Err(GpuError::Unsupported(format!(
            "NVIDIA GEMM: A [{m}, {k}] f16, B [{n}, {k}] f16, C [{m}, {n}] f32 expected"
        )));
    }
    let (pipe, _) = ctx.nv_pipeline(&kernel)?;
    let dims = ctx.uniform("gemm dims", &[m as u32, n as u32, k as u32, 0])?;
    let bind = ctx.bind_group(
        &pipe,
        &[(0, &a.buffer), (1, &b.buffer), (2, &c.buffer), (3, &dims)],
    )?;
    // Column tiles on x, row tiles on y (the shader reads both ids).
    let grid = [
        n.div_ceil(bn as usize) as u32,
        m.div_ceil(bm as usize) as u32,
        1,
    ];
    ctx.record_pass(enc, "gemm", [&(pipe, bind, grid)], prof);
    Ok(())
}

const PB: &[(u32, NvBinding)] = &[
    (0, NvBinding::Read),
    (1, NvBinding::Read),
    (2, NvBinding::Write),
];

/// The probes of `shaders/nv/probe.comp` (single cooperative-matrix-2 operations, checked by
/// the tests): one workgroup over A `[64, 128]` and B `[64, 128]` f16; `out` f32 gets S = A B^T
/// (`probe_shared_load`, 64 x 64) or each row's max of S (`probe_callback`, 64).
pub const PROBES: [NvKernel; 2] = [
    nv_kernel!("probe_shared_load", PB),
    nv_kernel!("probe_callback", PB),
];

/// Records probe `k` of [`PROBES`] (one workgroup).
pub fn record_probe(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    k: &NvKernel,
    a: &GpuTensor,
    b: &GpuTensor,
    out: &GpuTensor,
) -> Result<()> {
    let (pipe, _) = ctx.nv_pipeline(k)?;
    let bind = ctx.bind_group(&pipe, &[(0, &a.buffer), (1, &b.buffer), (2, &out.buffer)])?;
    ctx.record_pass(enc, "probe", [&(pipe, bind, [1, 1, 1])], None);
    Ok(())
}
