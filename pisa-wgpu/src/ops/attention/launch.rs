//! One launch of an attention kernel, shared by the portable (`shaders/attention.wgsl`) and
//! cooperative-matrix (`shaders/attention_coop.wgsl`) paths: they have the same bindings,
//! `Params` and row mapping, and differ only in the pipeline and its workgroup cut.

use bytemuck::{Pod, Zeroable};
use pisa_core::AttentionShape;

use super::{element_strides, u32_of, AttentionKind, QkvLayouts};
use crate::error::Result;
use crate::runtime::buffers::{Bind, GpuTensor, POISON_F32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;
use crate::runtime::view::KernelLayout;

/// The kernels' `Params` uniform (`shaders/attention_common.wgsl`).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct Params {
    q_s: [u32; 3],
    k_s: [u32; 3],
    v_s: [u32; 3],
    kv_heads: u32,
    q_heads: u32,
    group: u32,
    gh: u32,
    head_chunks: u32,
    q_len: u32,
    k_len: u32,
    block_size: u32,
    n_qtiles: u32,
    top_k: u32,
    nb0: u32,
    causal: u32,
    wg_count: u32,
    scale_log2: f32,
    /// O's strides in vec4 units (O contiguous in `layouts.o`, or a caller's at its strides).
    o_s: [u32; 3],
    pad: [u32; 2],
}

/// [`element_strides`] in vec4 units (the tile kernels read Q, K, V as vec4 rows).
fn strides(l: impl Into<KernelLayout>, heads: usize, tokens: usize, d: usize) -> [u32; 3] {
    element_strides(l, heads, tokens, d).map(|x| x / 4)
}

/// One launch of a sparse or dense attention kernel (portable or cooperative-matrix: same
/// bindings, parameters and row mapping): its poisoned outputs, parameters, entry point and
/// profiler label.
pub(crate) struct Launch {
    /// O, in `layouts.o` and Q's storage's output type (`Storage::output`: f32 for bf16).
    pub o: GpuTensor,
    /// LSE `[B, Hq, Nq]` f32.
    pub lse: GpuTensor,
    params: Params,
    entry: &'static str,
    label: &'static str,
}

impl Launch {
    /// Allocates the outputs (O only when `out` is `None`: else O is `out`, at its strides)
    /// and builds the parameters for a kernel cut into workgroups of `gh` query heads x `qt`
    /// queries; `dense_kt`, the key tile, is the dense kernel's block size.
    pub(crate) fn new(
        ctx: &Context,
        q: &GpuTensor,
        s: &AttentionShape,
        layouts: QkvLayouts,
        kind: &AttentionKind<'_>,
        (gh, qt, dense_kt): (u32, u32, u32),
        out: Option<&super::OutTarget>,
    ) -> Result<Self> {
        let g = s.gqa_group();
        let (c, top_k, causal, scale) = match kind {
            AttentionKind::Sparse { cfg, .. } => (
                cfg.block_size,
                cfg.top_k,
                cfg.causal,
                cfg.softmax_scale(s.head_dim),
            ),
            AttentionKind::Dense { causal, scale } => (dense_kt as usize, 1, *causal, *scale),
        };
        let (o, o_layout) = match out {
            Some(t) => (t.o.alias(), t.layout),
            None => (
                ctx.alloc("attention O", s.q_elems(), q.storage.output(), POISON_F32)?,
                layouts.o.into(),
            ),
        };
        let lse = ctx.alloc("attention LSE", s.lse_elems(), Storage::F32, POISON_F32)?;
        let head_chunks = g.div_ceil(gh as usize);
        let n_qtiles = s.q_len.div_ceil(qt as usize);
        let wg_count = u32_of(
            "attention workgroups",
            s.batch * s.kv_heads * head_chunks * n_qtiles,
        )?;
        let params = Params {
            q_s: strides(layouts.q, s.q_heads, s.q_len, s.head_dim),
            k_s: strides(layouts.k, s.kv_heads, s.k_len, s.head_dim),
            v_s: strides(layouts.v, s.kv_heads, s.k_len, s.head_dim),
            kv_heads: s.kv_heads as u32,
            q_heads: s.q_heads as u32,
            group: g as u32,
            gh,
            head_chunks: head_chunks as u32,
            q_len: s.q_len as u32,
            k_len: s.k_len as u32,
            block_size: u32_of("block size", c)?,
            n_qtiles: n_qtiles as u32,
            top_k: top_k as u32,
            nb0: s.k_len.div_ceil(c) as u32,
            causal: causal as u32,
            wg_count,
            scale_log2: scale * std::f32::consts::LOG2_E,
            o_s: strides(o_layout, s.q_heads, s.q_len, s.head_dim),
            pad: [0; 2],
        };
        let (entry, label) = match kind {
            AttentionKind::Sparse { .. } => ("sparse", "attention"),
            AttentionKind::Dense { .. } => ("dense", "dense"),
        };
        Ok(Self {
            o,
            lse,
            params,
            entry,
            label,
        })
    }

    /// The same launch timed as `label` in the profiler instead of its kind's stage, when given
    /// (dense attention as a prefill's "attention" stage).
    pub(crate) fn labelled(mut self, label: Option<&'static str>) -> Self {
        if let Some(l) = label {
            self.label = l;
        }
        self
    }

    /// The entry point of the kind ("sparse" or "dense").
    pub(crate) fn entry(&self) -> &'static str {
        self.entry
    }

    /// Dispatches `pipe` with the shared bindings (0 params, 1-3 Q K V, 4 the selection when
    /// sparse, 5-6 O and LSE) plus `extra`, and returns `(O, LSE)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dispatch(
        self,
        ctx: &Context,
        enc: &mut wgpu::CommandEncoder,
        pipe: &wgpu::ComputePipeline,
        [q, k, v]: [&GpuTensor; 3],
        kind: &AttentionKind<'_>,
        extra: &[(u32, Bind<'_>)],
        prof: Option<&mut Profiler>,
    ) -> Result<(GpuTensor, GpuTensor)> {
        let u = ctx.uniform("attention params", &self.params)?;
        let mut b: Vec<(u32, Bind<'_>)> = vec![
            (0, (&u).into()),
            (1, q.into()),
            (2, k.into()),
            (3, v.into()),
            (5, (&self.o).into()),
            (6, (&self.lse).into()),
        ];
        if let AttentionKind::Sparse { selection, .. } = kind {
            b.push((4, (*selection).into()));
        }
        b.extend_from_slice(extra);
        let timer = prof.map(|pr| (pr, self.label));
        ctx.dispatch(enc, pipe, &b, self.params.wg_count as u64, timer)?;
        Ok((self.o, self.lse))
    }
}
