//! A chunk of tokens appended to every sequence and attended (chunked prefill into the cache,
//! or speculative decoding's verification: `flash_attn_with_kvcache` with T query tokens), as
//! T recorded append + step pairs: the same kernels and results as recording them one by one.

use super::write::AppendIo;
use super::KvCache;
use crate::error::{GpuError, Result};
use crate::ops::gather::{check_gather_src, check_scatter_dst};
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;
use crate::runtime::view::{
    check_disjoint_among, check_disjoint_between, check_float_input, DType, TensorView,
};
use pisa_core::PisaError;

/// The caller's outputs of [`KvCache::record_chunk`], written token by token: f32 views of
/// any strides; an f16 or bf16 O as [`crate::PrefillOutputs::out`] says; in the caller's own
/// buffers, not the cache's ([`KvCache::outputs`], the source of the scatters: a
/// [`crate::GpuError::View`]).
#[derive(Debug, Clone, Copy)]
pub struct ChunkOutputs<'a> {
    /// O `[B, Hq, T, D]`: f32, f16 or bf16 (converted from the cache's output type; an f16 or
    /// bf16 O, written in whole 4-byte words, needs an even D, a D stride of 1, an even element
    /// offset and even strides, else [`crate::GpuError::View`]).
    pub out: &'a TensorView,
    /// LSE `[B, Hq, T, 1]` f32 (natural log).
    pub lse: &'a TensorView,
}

impl KvCache {
    /// Records a chunk of T tokens for every sequence: for `t` in `0..T`, token `t` of `k`,
    /// `v` (`[B, Hkv, T, D]`) is appended to each sequence (after its current length), then
    /// query token `t` of `q` (`[B, Hq, T, D]`) attends over the sequence's cache (PISA
    /// selection and attention of a decode step: its earlier tokens and the chunk's tokens up
    /// to `t`, causal), and its O and LSE go to token `t` of `outputs`. The views may have any
    /// strides and dtype (token slices that cannot be bound in place are gathered, as
    /// [`Self::record_append_view`] and [`Self::record_step_into`] do); the outputs are written
    /// by a scatter per token from the cache's own ([`Self::outputs`], which hold the last
    /// token's afterwards).
    ///
    /// Cost: T decode steps and appends (the kernels of decode, one token at a time), plus the
    /// host work of one small parameter buffer and bind group per gather and scatter; the
    /// sequences' lengths advance by T.
    ///
    /// The outputs must not share bytes with the inputs or each other (token `t`'s are written
    /// before token `t + 1`'s inputs are read).
    ///
    /// Errors: [`GpuError::View`] for views of the wrong shape or of different T, an input of
    /// i32, outputs that share bytes with inputs or each other, an LSE that is not f32, an O
    /// its scatter cannot write, or an output in the cache's own output buffers;
    /// [`PisaError::TooLarge`] when a sequence would pass the cache's capacity (a zero
    /// dimension, T = 0, is refused when its view is made);
    /// [`GpuError::Validation`] for a buffer of another device; [`GpuError::Misuse`] when a
    /// sequence's KV heads were loaded at different lengths ([`KvCache::prefill_view_heads`]).
    /// All checked before anything is recorded.
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context, cache: &mut pisa_wgpu::KvCache, q: &pisa_wgpu::TensorView,
    /// #      k: &pisa_wgpu::TensorView, v: &pisa_wgpu::TensorView, o: &pisa_wgpu::TensorView,
    /// #      lse: &pisa_wgpu::TensorView) -> pisa_wgpu::Result<()> {
    /// use pisa_wgpu::ChunkOutputs;
    /// // q [B, Hq, T, D], k, v [B, Hkv, T, D]: T new tokens of every sequence.
    /// let mut enc = ctx.device().create_command_encoder(&Default::default());
    /// cache.record_chunk(&mut enc, q, k, v, &ChunkOutputs { out: o, lse }, None)?;
    /// ctx.queue().submit([enc.finish()]);
    /// # Ok(()) }
    /// ```
    pub fn record_chunk(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        outputs: &ChunkOutputs<'_>,
        mut prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let s = self.shape;
        let (b, hq, hkv, d) = (s.batch, s.q_heads, s.kv_heads, s.head_dim);
        let t_n = q.shape()[2];
        if t_n == 0 {
            return Err(PisaError::Zero {
                what: "chunk tokens",
            }
            .into());
        }
        let ts = [k, v, outputs.out, outputs.lse].map(|x| x.shape()[2]);
        if ts.iter().any(|&t| t != t_n) {
            return Err(GpuError::View(format!(
                "chunk: q, k, v, O and LSE must hold the same T tokens (they hold {t_n}, {}, {}, {}, {})",
                ts[0], ts[1], ts[2], ts[3]
            )));
        }
        let want = [
            ("q", q, [b, hq, t_n, d]),
            ("k", k, [b, hkv, t_n, d]),
            ("v", v, [b, hkv, t_n, d]),
            ("chunk output", outputs.out, [b, hq, t_n, d]),
            ("chunk lse", outputs.lse, [b, hq, t_n, 1]),
        ];
        for (what, view, shape) in want {
            if view.shape() != shape {
                return Err(GpuError::View(format!(
                    "{what}: expected shape {shape:?}, got {:?}",
                    view.shape()
                )));
            }
        }
        if outputs.lse.dtype() != DType::F32 || outputs.out.dtype() == DType::I32 {
            return Err(GpuError::View(format!(
                "chunk outputs: O must be f32, f16 or bf16 and LSE f32 (got {:?}, {:?})",
                outputs.out.dtype(),
                outputs.lse.dtype()
            )));
        }
        self.check_heads_loaded()?;
        let cap = self.layout.key_len();
        if let Some(&len) = self.lens.iter().find(|&&len| len + t_n > cap) {
            return Err(PisaError::TooLarge {
                what: "sequence length after the chunk",
                value: (len + t_n) as u64,
                limit: cap as u64,
            }
            .into());
        }
        for (what, view) in [("q", q), ("k", k), ("v", v)] {
            check_float_input(what, view)?;
            check_gather_src(what, view, self.storage)?;
        }
        // Token t's outputs are written before token t + 1's inputs are read.
        let written = [("chunk output", outputs.out), ("chunk lse", outputs.lse)];
        check_disjoint_between(&written, &[("q", q), ("k", k), ("v", v)])?;
        check_disjoint_among(&written)?;
        let o_st = self.storage.output();
        for t in 0..t_n {
            check_scatter_dst("chunk output", o_st, &outputs.out.tokens(t, 1)?)?;
            check_scatter_dst("chunk lse", Storage::F32, &outputs.lse.tokens(t, 1)?)?;
        }
        let all = vec![true; b];
        // Token 0's dispatches are built before anything is recorded (under error scopes: a
        // view in a buffer of another device fails here, with nothing recorded and no length
        // advanced); every later token binds the same buffers.
        let kv_shape = [b, hkv, 1, d];
        let (kb, _) = self.input_binding("k", &k.tokens(0, 1)?, kv_shape, &self.k_in)?;
        let (vb, _) = self.input_binding("v", &v.tokens(0, 1)?, kv_shape, &self.v_in)?;
        self.append_built(AppendIo { k: kb, v: vb }, &all)?;
        self.step_stages(&q.tokens(0, 1)?, None)?;
        let (o, lse) = (self.out.buffer.clone(), self.lse.buffer.clone());
        self.scatter_built(&o, o_st, &outputs.out.tokens(0, 1)?)?;
        self.scatter_built(&lse, Storage::F32, &outputs.lse.tokens(0, 1)?)?;
        for t in 0..t_n {
            let (kt, vt, qt) = (k.tokens(t, 1)?, v.tokens(t, 1)?, q.tokens(t, 1)?);
            self.record_append_view(enc, &kt, &vt, &all, prof.as_deref_mut())?;
            self.record_step_into(enc, &qt, None, prof.as_deref_mut())?;
            let so = self.scatter_built(&o, o_st, &outputs.out.tokens(t, 1)?)?;
            let sl = self.scatter_built(&lse, Storage::F32, &outputs.lse.tokens(t, 1)?)?;
            for st in [so, sl] {
                self.ctx.record_pass(enc, "scatter", st.iter(), None);
            }
        }
        Ok(())
    }
}
