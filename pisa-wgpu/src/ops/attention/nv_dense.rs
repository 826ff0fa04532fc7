//! Dense attention on NVIDIA cooperative matrices 2 (`shaders/nv/attention_dense.comp`:
//! FlashAttention-2's forward pass with workgroup-scope matrices; PISA.md 4). Runs in place of
//! the WGSL tensor-core tile kernel ([`super::coop`]) for dense calls where the device has
//! `VK_NV_cooperative_matrix2` ([`Context::nv_cm2`]), f16 storage, a head dim with a built
//! kernel (64, 128) that the driver built, and Q, K, V strides of whole 16-byte pieces (where
//! their dimension has more than one element). Same outputs: O `[B, Hq, Nq, D]` in Q's layout
//! (f16; O's layout must be Q's), or, with the builds writing O at its own strides (the prefill
//! of a prompt that selects every leaf), contiguous in `layouts.o` or at the strides of a
//! caller's O (`OutTarget`); LSE `[B, Hq, Nq]` f32; profiler stage "dense", or the
//! caller's.

use pisa_core::AttentionShape;

use super::{element_strides, OutTarget, QkvLayouts};
use crate::error::Result;
use crate::nv_kernel;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_F32};
use crate::runtime::context::Context;
use crate::runtime::nv::{NvBinding, NvKernel};
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;

const BINDINGS: &[(u32, NvBinding)] = &[
    (0, NvBinding::Uniform),
    (1, NvBinding::Read),
    (2, NvBinding::Read),
    (3, NvBinding::Read),
    (4, NvBinding::Write),
    (5, NvBinding::Write),
];

/// The embedded dense kernels (`shaders/nv/kernels.txt`) with their query rows per workgroup:
/// those writing O at Q's strides, then (`_o`) those writing O at its own.
pub const NV_DENSE: [(NvKernel, u32); 4] = [
    (nv_kernel!("attention_dense_d128", BINDINGS), 128),
    (nv_kernel!("attention_dense_d64", BINDINGS), 128),
    (nv_kernel!("attention_dense_d128_o", BINDINGS), 128),
    (nv_kernel!("attention_dense_d64_o", BINDINGS), 128),
];

/// Whether `kernel` writes O at O's own strides (an `_o` build) rather than at Q's.
fn own_o_strides(kernel: &NvKernel) -> bool {
    kernel.name.ends_with("_o")
}

/// The uniform of `attention_dense.comp` (std140 scalars, in order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    pub(crate) q_s: [u32; 3],
    pub(crate) k_s: [u32; 3],
    pub(crate) v_s: [u32; 3],
    pub(crate) q_heads: u32,
    pub(crate) kv_heads: u32,
    pub(crate) q_len: u32,
    pub(crate) k_len: u32,
    pub(crate) q_pos0: u32,
    pub(crate) causal: u32,
    pub(crate) scale: f32,
    pub(crate) tiles: u32,
    /// The tiles of each head taken last ([`light_tiles`]; 0: every head's tiles in order).
    pub(crate) split: u32,
    /// O's element strides (batch, head, token).
    pub(crate) o_s: [u32; 3],
    pub(crate) pad: [u32; 3],
}

/// The causal tiles of a head that the dense kernel's workgroups take last (`split` of
/// `shaders/nv/attention_dense.comp`): the lightest quarter of `ceil(q_len / rows)`. The
/// heavier tiles of every head go first, so that the last workgroups to start are short ones
/// and the GPU does not idle behind a few long tiles at the end. On the H200 (2026-12-04,
/// causal, D 128, Hq 32, docs/benchmarks.md A.31) the kernel took 11.16 against 11.30 ms at
/// 16K and 169.8 against 170.6 ms at 64K with a quarter; with half, or with only the heaviest
/// tile of each head first, no faster than the plain order. Measured at D 128 only; the D 64
/// kernel (also 128-row tiles) takes the same quarter, and where tiles weigh nearly the same (a
/// query offset much larger than the tiles) the order changes little.
fn light_tiles(q_len: usize, rows: u32) -> u32 {
    (q_len.div_ceil(rows as usize) / 4) as u32
}

/// The dense kernel for this call (see the module docs), or `None` for the WGSL kernels: the
/// build writing O at Q's strides (the caller has O in Q's layout).
pub fn kernel_for(
    ctx: &Context,
    s: &AttentionShape,
    storage: Storage,
    layouts: QkvLayouts,
) -> Option<(NvKernel, u32)> {
    kernel_of(ctx, s, storage, layouts, false)
}

/// [`kernel_for`], or with `own_o` its build writing O at O's own strides (a prefill's
/// attention where every query selects every leaf it sees, and dense calls with O in another
/// layout than Q's).
pub(crate) fn kernel_of(
    ctx: &Context,
    s: &AttentionShape,
    storage: Storage,
    layouts: QkvLayouts,
    own_o: bool,
) -> Option<(NvKernel, u32)> {
    if !ctx.nv_cm2() || storage != Storage::F16 {
        return None;
    }
    // The kernel reads Q, K and V as 16-byte-aligned rows (its full key blocks through tensor
    // layouts it tells the compiler are aligned: 168.4 -> 140.4 ms at 64K on the H100,
    // docs/benchmarks.md A.62), so every stride must be a multiple of 8 elements. Strides of
    // dimensions of extent 1 are never multiplied by a non-zero index, so they need no
    // alignment (as for a view a PrefillPlan reads in place).
    let extents = [s.batch, s.q_heads, s.q_len, s.batch, s.kv_heads, s.k_len];
    let strides = [
        element_strides(layouts.q, s.q_heads, s.q_len, s.head_dim),
        element_strides(layouts.k, s.kv_heads, s.k_len, s.head_dim),
        element_strides(layouts.v, s.kv_heads, s.k_len, s.head_dim),
    ];
    let aligned = strides.iter().enumerate().all(|(t, st)| {
        st.iter()
            .enumerate()
            .all(|(i, x)| extents[(t.min(1)) * 3 + i] == 1 || x % 8 == 0)
    });
    let name = match (s.head_dim, own_o) {
        (128, false) => "attention_dense_d128",
        (64, false) => "attention_dense_d64",
        (128, true) => "attention_dense_d128_o",
        (64, true) => "attention_dense_d64_o",
        _ => return None,
    };
    aligned
        .then(|| NV_DENSE.into_iter().find(|k| k.0.name == name))
        .flatten()
        .filter(|k| ctx.nv_kernel_ok(&k.0))
}

/// Records dense attention with `kernel` (from [`kernel_for`] or [`kernel_of`]);
/// inputs validated by the caller. Returns (O, LSE): O written into `out` when given (at its
/// strides; `_o` builds only), else a new tensor contiguous in `layouts.o` (which must be Q's
/// layout for the builds writing O at Q's strides); LSE new. Both poisoned before the kernel
/// writes them (the caller's O is not). Timed as `label` in `prof`. Errors:
/// [`crate::GpuError::Unsupported`] for an O a build cannot write.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    (q, k, v): (&GpuTensor, &GpuTensor, &GpuTensor),
    s: &AttentionShape,
    layouts: QkvLayouts,
    (causal, scale): (bool, f32),
    (kernel, rows): (NvKernel, u32),
    (out, label): (Option<&OutTarget>, &'static str),
    prof: Option<&mut Profiler>,
) -> Result<(GpuTensor, GpuTensor)> {
    if !own_o_strides(&kernel) {
        if out.is_some() {
            return Err(crate::GpuError::Unsupported(
                "the NVIDIA dense kernel writing O at Q's strides into a caller's O".into(),
            ));
        }
        super::check_o_is_q(layouts)?;
    }
    let (o, o_s) = match out {
        Some(t) => (
            t.o.alias(),
            element_strides(t.layout, s.q_heads, s.q_len, s.head_dim),
        ),
        None => (
            ctx.alloc("attention O", s.q_elems(), q.storage.output(), POISON_F32)?,
            element_strides(layouts.o, s.q_heads, s.q_len, s.head_dim),
        ),
    };
    let lse = ctx.alloc("attention LSE", s.lse_elems(), Storage::F32, POISON_F32)?;
    let tiles = (s.batch * s.q_heads) as u64 * s.q_len.div_ceil(rows as usize) as u64;
    let params = Params {
        q_s: element_strides(layouts.q, s.q_heads, s.q_len, s.head_dim),
        k_s: element_strides(layouts.k, s.kv_heads, s.k_len, s.head_dim),
        v_s: element_strides(layouts.v, s.kv_heads, s.k_len, s.head_dim),
        q_heads: s.q_heads as u32,
        kv_heads: s.kv_heads as u32,
        q_len: s.q_len as u32,
        k_len: s.k_len as u32,
        q_pos0: (s.k_len - s.q_len) as u32,
        causal: causal as u32,
        scale,
        // The same error as the WGSL kernels' (`Launch`) for a grid past u32.
        tiles: super::u32_of("attention workgroups", tiles as usize)?,
        split: if causal {
            light_tiles(s.q_len, rows)
        } else {
            0
        },
        o_s,
        pad: [0; 3],
    };
    let u = ctx.uniform("dense params", &params)?;
    let (pipe, _) = ctx.nv_pipeline(&kernel)?;
    let binds: [(u32, Bind<'_>); 6] = [
        (0, (&u).into()),
        (1, q.into()),
        (2, k.into()),
        (3, v.into()),
        (4, (&o).into()),
        (5, (&lse).into()),
    ];
    let stage = ctx.stage(&pipe, &binds, tiles)?;
    ctx.record_pass(enc, label, [&stage], prof);
    Ok((o, lse))
}
