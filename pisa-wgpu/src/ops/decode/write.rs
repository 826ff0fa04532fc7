//! The writes of the KV cache: prefill (copy and pyramid build) and the append with its
//! ancestor-path update (PISA.md section 1), `shaders/decode_append.wgsl`.

use std::sync::Arc;

use pisa_core::{PisaError, TensorLayout};

use super::record::{range, whole, Binds, Stage};
use super::{input, KvCache, Params, APPEND_SHADER, APPEND_WG, LENS_SHADER};
use crate::error::Result;
use crate::ops::prefill::PrefillPlan;
use crate::ops::pyramid;
use crate::runtime::buffers::{check_len, GpuTensor};
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;
use crate::runtime::view::{InPlace, TensorView};

impl KvCache {
    /// Loads the keys and values of sequence `seq`, replacing its contents: `k`, `v` are
    /// `[1, Hkv, P, D]` in `layout` (`P = k.len() / (Hkv * D)`, 1 <= P <= capacity). Builds
    /// the sequence's pyramid on the GPU and sets its length to P.
    /// Errors: [`PisaError::BufferLen`] for lengths that are not a positive multiple of
    /// `Hkv * D` or differ; [`PisaError::TooLarge`] for a bad `seq` or P past the capacity.
    pub fn prefill(
        &mut self,
        seq: usize,
        k: &[f32],
        v: &[f32],
        layout: TensorLayout,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let kt = self.ctx.upload("prefill keys", k, self.storage)?;
        let vt = self.ctx.upload("prefill values", v, self.storage)?;
        self.prefill_device(seq, &kt, &vt, layout)
    }

    /// [`Self::prefill`] from views of the caller's buffers: `k`, `v` `[1, Hkv, P, D]`, any
    /// strides and dtype (f32, f16, bf16; e.g. one sequence of a varlen prefill's packed K/V,
    /// [`TensorView::tokens`]), gathered on the GPU into the cache (no host transfer). Blocks
    /// until the copy and the pyramid build are done (wasm32: refused). Errors: as
    /// [`Self::prefill`], [`crate::GpuError::View`] for views of the wrong shape or of
    /// dtype i32, [`crate::GpuError::Validation`] for a view in a buffer of another device.
    pub fn prefill_view(&mut self, seq: usize, k: &TensorView, v: &TensorView) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.record_and_submit(|c, enc| c.record_prefill_view(enc, seq, k, v))
    }

    /// [`Self::prefill`] from tensors already on the GPU (in the cache's storage precision).
    #[doc(hidden)]
    pub fn prefill_device(
        &mut self,
        seq: usize,
        k: &GpuTensor,
        v: &GpuTensor,
        layout: TensorLayout,
    ) -> Result<()> {
        self.prefill_device_heads(seq, 0, self.shape.kv_heads, k, v, layout)
    }

    /// [`Self::prefill_device`] of the KV heads `h0 .. h0 + heads` only: `k`, `v` are
    /// `[1, heads, P, D]` in `layout`, loaded into those heads of sequence `seq` with their
    /// pyramid rows. For caches whose all-heads prefill tensors would exceed one storage
    /// binding (a 1M-token cache of 8 heads of 128 f16 is 2 GiB): load them a few heads at a
    /// time. The sequence's length becomes P; every head of it must be loaded with the same P
    /// before a step (a head left out keeps what it held: until then steps, appends and chunks
    /// are refused, [`crate::GpuError::Misuse`]).
    /// Errors: as [`Self::prefill_device`]; [`PisaError::Zero`] for no heads,
    /// [`PisaError::TooLarge`] for a head range past Hkv; nothing changes on error.
    #[doc(hidden)]
    pub fn prefill_device_heads(
        &mut self,
        seq: usize,
        h0: usize,
        heads: usize,
        k: &GpuTensor,
        v: &GpuTensor,
        layout: TensorLayout,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.record_and_submit(|c, enc| c.record_prefill_heads(enc, seq, h0, heads, k, v, layout))
    }

    /// Records [`Self::prefill_device_heads`] into `enc` (nothing waits): the copy of the rows,
    /// the pyramid build and the new length, in the order of the encoder. The host length
    /// changes at once. Errors as [`Self::prefill_device_heads`]; nothing changes on error.
    #[allow(clippy::too_many_arguments)]
    #[doc(hidden)]
    pub fn record_prefill_heads(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        seq: usize,
        h0: usize,
        heads: usize,
        k: &GpuTensor,
        v: &GpuTensor,
        layout: TensorLayout,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.check_seq(seq)?;
        let (hkv, d) = (self.shape.kv_heads, self.shape.head_dim);
        let old_len = self.lens[seq];
        self.check_head_range(h0, heads)?;
        let p_len = k.len / (heads * d);
        // A positive multiple of heads * D: else name the nearest length that would be.
        check_len("prefill keys", k.len, p_len.max(1) * heads * d)?;
        self.check_tensor("prefill keys", k, p_len * heads * d)?;
        self.check_tensor("prefill values", v, p_len * heads * d)?;
        self.check_prefill_len(p_len)?;
        let ctx = self.ctx.clone();
        let geo = Self::geometry(1, heads, p_len, d, layout);
        let tmp = pyramid::alloc(&ctx, self.layout, &geo, self.pyr.sq.is_some())?;
        let (_, sh, sn) = layout.strides(heads, p_len, d);
        let pipe = self.append_pipeline("copy_rows")?;
        // One copy per K/V shard the head range touches (flat rows seq * Hkv + h).
        let mut copies = Vec::new();
        let (first, end) = (seq * hkv + h0, seq * hkv + h0 + heads);
        for (i, shard) in self.kv.iter().enumerate() {
            let (r0, r1) = (i * self.kv_rows, (i + 1) * self.kv_rows);
            let (a, b) = (first.max(r0), end.min(r1));
            if a >= b {
                continue;
            }
            let count = ((b - a) * p_len * d) as u32;
            let pr = Params {
                seq: seq as u32,
                src_sh: sh as u32,
                src_sn: sn as u32,
                count,
                src_len: p_len as u32,
                kv_row0: r0 as u32,
                hd0: (a - seq * hkv) as u32,
                src_h0: (a - first) as u32,
                ..self.base()
            };
            copies.push((ctx.uniform("decode copy params", &pr)?, shard, count));
        }
        let head_bytes = (self.layout.total_nodes() * d * 4) as u64;
        let (off, bytes) = ((first as u64) * head_bytes, heads as u64 * head_bytes);
        let len_buf = ctx.upload_u32("prefill length", &[p_len as u32])?;
        ctx.scope_now("decode prefill", || {
            for (u, shard, count) in &copies {
                let b = [
                    (0, u),
                    (4, &shard.0.buffer),
                    (5, &shard.1.buffer),
                    (8, &k.buffer),
                    (9, &v.buffer),
                ];
                // One invocation per pair of elements (D is even: a multiple of 4).
                let pairs = count / 2;
                ctx.dispatch(enc, &pipe, &b, pairs.div_ceil(APPEND_WG) as u64, None)?;
            }
            pyramid::record_build(&ctx, enc, k, &geo, p_len, &tmp, None)?;
            enc.copy_buffer_to_buffer(&tmp.means.buffer, 0, &self.pyr.means.buffer, off, bytes);
            if let (Some(s), Some(d)) = (&tmp.sq, &self.pyr.sq) {
                enc.copy_buffer_to_buffer(&s.buffer, 0, &d.buffer, off, bytes);
            }
            enc.copy_buffer_to_buffer(&len_buf.buffer, 0, &self.lens_gpu, seq as u64 * 4, 4);
            Ok(())
        })?;
        self.lens[seq] = p_len;
        let mut at = (self.head_lens[seq].take()).unwrap_or_else(|| vec![old_len; hkv]);
        at[h0..h0 + heads].fill(p_len);
        self.head_lens[seq] = at.iter().any(|&l| l != p_len).then_some(at);
        Ok(())
    }

    /// The checks of [`Self::record_prefill_from_plan`] before it records anything, for a plan
    /// of `ps` and `po` made with `plan_ctx`: the plan matches the cache (its context, Hkv, D,
    /// storage, block size, merge factor, scoring; [`crate::GpuError::Unsupported`] naming what
    /// differs), `seq` is one of the
    /// cache's, `batch` one of the plan's and its length fits the cache
    /// ([`PisaError::TooLarge`]).
    pub(crate) fn check_plan(
        &self,
        plan_ctx: &crate::Context,
        ps: &pisa_core::AttentionShape,
        po: &crate::ops::prefill::PrefillOptions,
        seq: usize,
        batch: usize,
    ) -> Result<()> {
        if !plan_ctx.same(&self.ctx) {
            return Err(crate::GpuError::Unsupported(
                "the plan and the cache were made with different contexts (the take-over \
                 records copies in one context's device and pools, even where two contexts \
                 share one wgpu device): make both with one Context or its clones"
                    .into(),
            ));
        }
        let (hkv, d) = (self.shape.kv_heads, self.shape.head_dim);
        let c = &self.cfg;
        let diffs: Vec<String> = [
            ("KV heads", ps.kv_heads.to_string(), hkv.to_string()),
            ("head dim", ps.head_dim.to_string(), d.to_string()),
            (
                "storage",
                format!("{:?}", po.storage),
                format!("{:?}", self.storage),
            ),
            (
                "block size",
                po.cfg.block_size.to_string(),
                c.block_size.to_string(),
            ),
            (
                "merge factor",
                po.cfg.merge_factor.to_string(),
                c.merge_factor.to_string(),
            ),
            (
                "second moments (meanvar scoring)",
                (po.cfg.scoring == pisa_core::Scoring::MeanVar).to_string(),
                self.pyr.sq.is_some().to_string(),
            ),
        ]
        .into_iter()
        .filter(|(_, a, b)| a != b)
        .map(|(what, a, b)| format!("{what} {a} (plan) vs {b} (cache)"))
        .collect();
        if !diffs.is_empty() {
            return Err(crate::GpuError::Unsupported(format!(
                "a plan that does not match the cache: {}",
                diffs.join(", ")
            )));
        }
        self.check_seq(seq)?;
        if batch >= ps.batch {
            return Err(input(PisaError::TooLarge {
                what: "batch entry of the plan",
                value: batch as u64,
                limit: ps.batch as u64 - 1,
            }));
        }
        self.check_prefill_len(ps.k_len)
    }

    fn check_head_range(&self, h0: usize, heads: usize) -> Result<()> {
        let hkv = self.shape.kv_heads;
        if heads == 0 {
            return Err(input(PisaError::Zero {
                what: "KV heads of the prefill",
            }));
        }
        if h0 >= hkv || heads > hkv - h0 {
            return Err(input(PisaError::TooLarge {
                what: "end of the prefill's KV heads",
                value: (h0 as u64).saturating_add(heads as u64),
                limit: hkv as u64,
            }));
        }
        Ok(())
    }

    /// Runs `record` into a new encoder and submits it (a blocking prefill: the scope waits
    /// for the queue and turns device errors into [`crate::GpuError`]s).
    fn record_and_submit(
        &mut self,
        record: impl FnOnce(&mut Self, &mut wgpu::CommandEncoder) -> Result<()>,
    ) -> Result<()> {
        let ctx = self.ctx.clone();
        ctx.scoped("decode prefill", || {
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            record(self, &mut enc)?;
            ctx.queue.submit([enc.finish()]);
            Ok(())
        })
    }

    pub(crate) fn check_prefill_len(&self, p_len: usize) -> Result<()> {
        if p_len > self.layout.key_len() {
            return Err(input(PisaError::TooLarge {
                what: "prefill length",
                value: p_len as u64,
                limit: self.layout.key_len() as u64,
            }));
        }
        Ok(())
    }

    /// Records the loading of sequence `seq` from views of the caller's buffers into `enc`
    /// (nothing waits; the non-blocking [`Self::prefill_view`]): `k`, `v` `[1, Hkv, P, D]`, any
    /// strides and dtype, gathered on the GPU. Errors as [`Self::prefill_view`]; a view the
    /// cache cannot use (its shape, dtype, or a buffer of another device) is refused before
    /// anything is recorded.
    pub fn record_prefill_view(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        seq: usize,
        k: &TensorView,
        v: &TensorView,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.record_view_heads(enc, seq, 0, self.shape.kv_heads, k, v)
    }

    /// [`Self::prefill_view`] of the KV heads `h0 .. h0 + H` only, `k`, `v` `[1, H, P, D]`
    /// views (any strides and dtype), for a cache whose keys of all heads exceed one storage
    /// binding (a 1M-token cache of 8 heads of 128 f16 is 2 GiB, one MiB past the limit of
    /// many GPUs): load it a few heads at a time. The sequence's length becomes P; a head left
    /// out keeps what it held, so until every head of the sequence holds P tokens, steps,
    /// appends and chunks of the cache are refused ([`crate::GpuError::Misuse`]; a reset or a
    /// whole prefill of the sequence also ends it). Blocks until
    /// the copy and the pyramid build are done (wasm32: refused; record with
    /// [`Self::record_prefill_view_heads`] there). Errors: as [`Self::prefill_view`];
    /// [`PisaError::TooLarge`] for a head range past Hkv; nothing changes on error.
    pub fn prefill_view_heads(
        &mut self,
        seq: usize,
        h0: usize,
        k: &TensorView,
        v: &TensorView,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.record_and_submit(|c, enc| c.record_prefill_view_heads(enc, seq, h0, k, v))
    }

    /// Records [`Self::prefill_view_heads`] into `enc` (nothing waits). Errors as
    /// [`Self::prefill_view_heads`]; a view the cache cannot use (its shape, dtype, or a buffer
    /// of another device) is refused before anything is recorded.
    pub fn record_prefill_view_heads(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        seq: usize,
        h0: usize,
        k: &TensorView,
        v: &TensorView,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.record_view_heads(enc, seq, h0, k.shape()[1], k, v)
    }

    /// The gather of views `k`, `v` `[1, heads, P, D]` (checked to be of that shape) into the
    /// KV heads `h0 .. h0 + heads` of sequence `seq`: [`Self::record_prefill_view`] (all heads)
    /// and [`Self::record_prefill_view_heads`].
    fn record_view_heads(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        seq: usize,
        h0: usize,
        heads: usize,
        k: &TensorView,
        v: &TensorView,
    ) -> Result<()> {
        let d = self.shape.head_dim;
        let p_len = k.shape()[2];
        // Both views are checked before either gather is recorded.
        for (what, t) in [("prefill keys", k), ("prefill values", v)] {
            crate::runtime::view::check_float_input(what, t)?;
            crate::ops::gather::check_gather_src(what, t, self.storage)?;
            if t.shape() != [1, heads, p_len, d] {
                return Err(crate::GpuError::View(format!(
                    "{what}: expected [1, {heads}, {p_len}, {d}], got {:?}",
                    t.shape()
                )));
            }
        }
        self.check_seq(seq)?;
        self.check_prefill_len(p_len)?;
        self.check_head_range(h0, heads)?;
        let ctx = self.ctx.clone();
        let n = heads * p_len * d;
        let kt = ctx.scratch("prefill keys", n, self.storage)?;
        let vt = ctx.scratch("prefill values", n, self.storage)?;
        // Both gathers built (under an error scope: a view in another device's buffer is a
        // Validation error) before either is recorded.
        let gathers = ctx.scope_now("decode prefill gather", || {
            let g = |view, dst: &GpuTensor| {
                crate::ops::gather::gather_stages(&ctx, view, &dst.buffer, self.storage)
            };
            Ok([g(k, &kt)?, g(v, &vt)?])
        })?;
        for g in &gathers {
            ctx.record_pass(enc, "gather", g.iter(), None);
        }
        self.record_prefill_heads(enc, seq, h0, heads, &kt, &vt, TensorLayout::Bhnd)
    }

    /// Records the loading of sequence `seq` from what a [`PrefillPlan`] run left: the keys and
    /// values of its batch entry `batch` and its key pyramid (taken over by buffer copies: no
    /// pyramid build). The keys and values come from where the run read them: the plan's
    /// staging when it gathered them (buffer copies), or the caller's K and V views when it
    /// read them in place ([`PrefillPlan::reads_in_place`]; one gather of entry `batch` into the
    /// staging, or, for a plan without staging ([`PrefillPlan::new_in_place`]), into `[1, Hkv,
    /// N, D]` K and V tensors made for this call and freed once it has run; then the copies).
    /// In that second case the views must still hold the run's keys and values when this
    /// executes: record it in the run's encoder, or at least before anything overwrites them
    /// (the next layer's QKV projection in a reused buffer, say). pisa cannot tell: a cache
    /// loaded from views the app rewrote in between holds the new keys beside the run's
    /// pyramid, and its steps select from those stale means without an error; where that
    /// cannot be promised, [`Self::record_prefill_view`] gathers the keys and builds their
    /// pyramid.
    /// The cache and the plan must share their context and agree on Hkv, D, storage, block
    /// size, merge factor, and whether the scoring is `meanvar` (second moments): what the
    /// keys, values and pyramid are made of. `top_k`, the forced blocks, causality, the other
    /// scorings and the query heads may differ: they belong to the steps.
    /// What is loaded is what the plan's last recorded run leaves once it has
    /// executed, whichever thread recorded it, so record this after that run and before the
    /// plan's next one from any thread (which reuses the same buffers: two runs then two
    /// take-overs load the second run's sequence twice; the crate docs, "Threads", say how
    /// threads sharing a plan keep the pairs apart);
    /// a varlen prefill hands over with [`crate::VarlenPrefillPlan::run_into_cache`]. Errors:
    /// [`crate::GpuError::Unsupported`] when they differ, or for a plan that has not run yet
    /// (no pyramid to take over); [`PisaError::TooLarge`] for a `seq`,
    /// `batch` or N past the cache's; [`crate::GpuError::View`] when the last run read K and V
    /// in place and wrote one of its outputs over their bytes (the keys are gone); nothing
    /// changes on error.
    pub fn record_prefill_from_plan(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        seq: usize,
        plan: &PrefillPlan,
        batch: usize,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let (ps, po) = (plan.shape(), plan.options());
        self.check_plan(plan.context(), ps, po, seq, batch)?;
        let (hkv, d) = (self.shape.kv_heads, self.shape.head_dim);
        let c = &self.cfg;
        let n = ps.k_len;
        let ctx = self.ctx.clone();
        let e = self.storage.bytes();
        let src_lay = pisa_core::PyramidLayout::new(n, c.block_size, c.merge_factor)?;
        let len_buf = ctx.upload_u32("prefill length", &[n as u32])?;
        // Last, so that nothing is recorded on error: `parts` records the gathers.
        let (k, v, pyr, entry) = plan.parts(enc, batch)?;
        let Some((means, sq)) = pyr else {
            return Err(crate::GpuError::Unsupported(
                "the plan has no pyramid to take over: record its run first".into(),
            ));
        };
        let cap = self.layout.key_len() as u64;
        for h in 0..hkv {
            let row = seq * hkv + h;
            let (shard, r0) = (row / self.kv_rows, (row / self.kv_rows) * self.kv_rows);
            let (dk, dv) = (&self.kv[shard].0.buffer, &self.kv[shard].1.buffer);
            let src = ((entry * hkv + h) * n * d) as u64 * e;
            let dst = (row - r0) as u64 * cap * d as u64 * e;
            let bytes = (n * d) as u64 * e;
            enc.copy_buffer_to_buffer(&k.buffer, src, dk, dst, bytes);
            enc.copy_buffer_to_buffer(&v.buffer, src, dv, dst, bytes);
            // The pyramid, level by level: the first nodes of each of the cache's levels are
            // the plan's (a shorter length's nodes are a prefix of each level).
            for l in 0..src_lay.num_levels() {
                let nodes = src_lay.nodes(l) as u64;
                let s_off = (((batch * hkv + h) * src_lay.total_nodes() + src_lay.offset(l)) * d)
                    as u64
                    * 4;
                let d_off =
                    ((row * self.layout.total_nodes() + self.layout.offset(l)) * d) as u64 * 4;
                let bytes = nodes * d as u64 * 4;
                enc.copy_buffer_to_buffer(&means, s_off, &self.pyr.means.buffer, d_off, bytes);
                if let (Some(s), Some(t)) = (&sq, &self.pyr.sq) {
                    enc.copy_buffer_to_buffer(s, s_off, &t.buffer, d_off, bytes);
                }
            }
        }
        enc.copy_buffer_to_buffer(&len_buf.buffer, 0, &self.lens_gpu, seq as u64 * 4, 4);
        self.lens[seq] = n;
        self.head_lens[seq] = None;
        Ok(())
    }

    /// Records emptying sequence `seq` into `enc` (the encoder-ordered [`Self::reset`]: steps
    /// recorded before it still see the old length). Errors: as [`Self::reset`].
    pub fn record_reset(&mut self, enc: &mut wgpu::CommandEncoder, seq: usize) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.check_seq(seq)?;
        enc.clear_buffer(&self.lens_gpu, seq as u64 * 4, Some(4));
        self.lens[seq] = 0;
        self.head_lens[seq] = None;
        Ok(())
    }

    fn append_pipeline(&self, entry: &'static str) -> Result<Arc<wgpu::ComputePipeline>> {
        let ov = [
            ("WG", APPEND_WG as f64),
            ("WITH_SQ", if self.pyr.sq.is_some() { 1.0 } else { 0.0 }),
        ];
        self.ctx.pipelines.get(
            &self.ctx.device,
            &APPEND_SHADER,
            entry,
            self.storage,
            &[],
            &ov,
        )
    }

    /// Every sequence's KV heads hold the same length: else (some heads loaded by
    /// [`Self::prefill_view_heads`] or [`Self::prefill_device_heads`] at a length the others
    /// were not) [`crate::GpuError::Misuse`], which a step, an append or a chunk returns
    /// rather than read heads of another length (or never written) as if they were the
    /// sequence's.
    pub(super) fn check_heads_loaded(&self) -> Result<()> {
        let partial = self.head_lens.iter().enumerate();
        let Some((seq, at)) = partial
            .filter_map(|(b, h)| h.as_ref().map(|h| (b, h)))
            .next()
        else {
            return Ok(());
        };
        let len = self.lens[seq];
        let missing: Vec<usize> = (0..at.len()).filter(|&h| at[h] != len).collect();
        Err(crate::GpuError::Misuse(format!(
            "sequence {seq} was loaded a few KV heads at a time and its KV heads {missing:?} do not hold its length of {len} tokens (they hold {:?}): load every head with the same length (KvCache::prefill_view_heads) or reset the sequence before a step, an append or a chunk",
            missing.iter().map(|&h| at[h]).collect::<Vec<_>>()
        )))
    }

    pub(super) fn check_append(&self, rows: usize, active: &[bool]) -> Result<()> {
        self.check_heads_loaded()?;
        let s = &self.shape;
        check_len("active", active.len(), s.batch)?;
        check_len("appended rows", rows, s.batch * s.kv_heads * s.head_dim)?;
        for (b, _) in active.iter().enumerate().filter(|a| *a.1) {
            if self.lens[b] >= self.layout.key_len() {
                return Err(input(PisaError::TooLarge {
                    what: "sequence length after append",
                    value: self.lens[b] as u64 + 1,
                    limit: self.layout.key_len() as u64,
                }));
            }
        }
        Ok(())
    }

    /// Records the append of one key and value per active sequence (`k_rows`, `v_rows`:
    /// `[B, Hkv, D]` in the cache's storage precision; rows of inactive sequences are ignored)
    /// at position `len(seq)`, and the update of the ancestor path of its leaf (PISA.md 1),
    /// labelled "append" in `prof`. Lengths advance at once on the host, and on the GPU when the
    /// recorded commands run: submit `enc` before reading results. Errors: as [`Self::append`];
    /// nothing changes on error.
    #[doc(hidden)]
    pub fn record_append(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        k_rows: &GpuTensor,
        v_rows: &GpuTensor,
        active: &[bool],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let n = self.shape.batch * self.shape.kv_heads * self.shape.head_dim;
        self.check_tensor("appended keys", k_rows, n)?;
        self.check_tensor("appended values", v_rows, n)?;
        let io = AppendIo {
            k: InPlace::whole(&k_rows.buffer),
            v: InPlace::whole(&v_rows.buffer),
        };
        self.record_append_io(enc, io, active, prof)
    }

    /// Records the append of one key and value per sequence whose `active` entry is true, from
    /// the caller's buffers, at position `len(seq)`, and the update of the ancestor path of its
    /// leaf in the pyramid (PISA.md 1), labelled "append" in `prof`. Lengths advance at once
    /// on the host, and on the GPU when the recorded commands run. `k`, `v`
    /// `[B, Hkv, 1, D]`, bound in place when contiguous, of the cache's storage dtype and at
    /// offsets that are multiples of the device's `min_storage_buffer_offset_alignment`; any
    /// other view (the rows of a packed QKV projection, another dtype) is gathered first by one small
    /// dispatch (its parameter buffer and bind group built for the first gather of that view and
    /// kept). The first append of a given set of buffers builds its bind groups (one set for
    /// appends of every sequence, one for appends of some, whatever the mask); every later one
    /// only records (no GPU allocation, no host write to the GPU, only the few small heap
    /// allocations of the call's liveness probe, [`crate::Context::check_alive`]: positions and
    /// lengths are computed on the
    /// GPU, and a mask of some sequences is set by a few buffer commands recorded before the
    /// append, one per run of sequences that do or do not append). Errors:
    /// [`pisa_core::PisaError::BufferLen`] for an `active` of the wrong length,
    /// [`pisa_core::PisaError::TooLarge`] when an active sequence is full,
    /// [`crate::GpuError::View`] for a view of the wrong shape, [`crate::GpuError::Validation`]
    /// for a view in a buffer of another device, [`crate::GpuError::Misuse`] when a sequence's
    /// KV heads were loaded at different lengths ([`Self::prefill_view_heads`]); nothing is
    /// recorded and nothing changes on error.
    pub fn record_append_view(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        k: &TensorView,
        v: &TensorView,
        active: &[bool],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let s = self.shape;
        let shape = [s.batch, s.kv_heads, 1, s.head_dim];
        // Checked before any gather is recorded: nothing is recorded on error.
        self.check_append(s.batch * s.kv_heads * s.head_dim, active)?;
        for (what, view) in [("appended keys", k), ("appended values", v)] {
            self.check_input_view(what, view, shape)?;
        }
        // The gathers (where a view is not bound in place) and the append are built before
        // anything is recorded.
        let (kb, kg) = self.input_binding("appended keys", k, shape, &self.k_in)?;
        let (vb, vg) = self.input_binding("appended values", v, shape, &self.v_in)?;
        let stages = self.append_built(AppendIo { k: kb, v: vb }, active)?;
        self.record_gather_of(enc, kg.as_ref());
        self.record_gather_of(enc, vg.as_ref());
        self.record_append_built(enc, &stages, active, prof);
        Ok(())
    }

    pub(super) fn record_append_io(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        io: AppendIo,
        active: &[bool],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let stages = self.append_built(io, active)?;
        self.record_append_built(enc, &stages, active, prof);
        Ok(())
    }

    /// The append's dispatches for `io` and `active` (checked: [`Self::check_append`]), built
    /// on first use under an error scope and kept; nothing recorded.
    pub(super) fn append_built(&self, io: AppendIo, active: &[bool]) -> Result<Arc<[Stage]>> {
        let n = self.shape.batch * self.shape.kv_heads * self.shape.head_dim;
        self.check_append(n, active)?;
        let key = (io, active.iter().all(|&a| a));
        self.append_cache.get_or_build(&key, || {
            self.ctx
                .scope_now("decode append", || self.append_stages(&key.0, key.1))
        })
    }

    /// Records an append built by [`Self::append_built`] for `active` (the mask first, where
    /// some sequences do not append) and advances the host lengths.
    fn record_append_built(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        stages: &Arc<[Stage]>,
        active: &[bool],
        prof: Option<&mut Profiler>,
    ) {
        if !active.iter().all(|&a| a) {
            self.record_mask(enc, active);
        }
        self.ctx.record_pass(enc, "append", stages.iter(), prof);
        for (l, &a) in self.lens.iter_mut().zip(active) {
            *l += a as usize;
        }
    }

    /// Sets `mask_some` to `active` in encoder order (so that appends of other masks recorded
    /// before or after, in this encoder or others, each read their own): 1s copied from
    /// `mask_all` over each run of active sequences, 0s over each run of inactive ones, as
    /// buffer commands; nothing allocated, no host write.
    fn record_mask(&self, enc: &mut wgpu::CommandEncoder, active: &[bool]) {
        let mut b = 0;
        while b < active.len() {
            let run = active[b..].iter().take_while(|&&a| a == active[b]).count();
            let (off, len) = (b as u64 * 4, run as u64 * 4);
            if active[b] {
                enc.copy_buffer_to_buffer(&self.mask_all, off, &self.mask_some, off, len);
            } else {
                enc.clear_buffer(&self.mask_some, off, Some(len));
            }
            b += run;
        }
    }

    /// The append's dispatches for `io` (`all`: every sequence appends, else the mask in
    /// `mask_some`): `positions`, one `append` per K/V shard (one workgroup per flat
    /// (sequence, KV head) row of it; both write the pyramid, so wgpu orders them), `advance`;
    /// one pass.
    fn append_stages(&self, io: &AppendIo, all: bool) -> Result<Vec<Stage>> {
        let ctx = &self.ctx;
        // `advance` stops a length at the capacity (see the shader).
        let cap = [("CAPACITY", self.layout.key_len() as f64)];
        let lens_pipe = |entry| {
            let ov: &[(&str, f64)] = if entry == "advance" { &cap } else { &[] };
            ctx.pipelines
                .get(&ctx.device, &LENS_SHADER, entry, Storage::F32, &[], ov)
        };
        let m = if all { &self.mask_all } else { &self.mask_some };
        let (l, p) = (&self.lens_gpu, &self.pos_gpu);
        let mut stages = vec![self.make_stage(
            lens_pipe("positions")?,
            &vec![whole(0, m), whole(1, l), whole(2, p)],
            1,
        )?];
        let rows = self.shape.batch * self.shape.kv_heads;
        let pipe = self.append_pipeline("append")?;
        let sq = self.pyr.sq.as_ref().unwrap_or(&self.dummy);
        for (i, shard) in self.kv.iter().enumerate() {
            let (r0, r1) = (i * self.kv_rows, ((i + 1) * self.kv_rows).min(rows));
            let u = ctx.uniform(
                "append params",
                &Params {
                    wg_count: r1 as u32,
                    kv_row0: r0 as u32,
                    ..self.base()
                },
            )?;
            let b: Binds = vec![
                whole(0, &u),
                whole(1, p),
                range(2, &io.k),
                range(3, &io.v),
                whole(4, &shard.0.buffer),
                whole(5, &shard.1.buffer),
                whole(6, &self.pyr.means.buffer),
                whole(7, &sq.buffer),
            ];
            stages.push(self.make_stage(pipe.clone(), &b, (r1 - r0) as u64)?);
        }
        stages.push(self.make_stage(lens_pipe("advance")?, &vec![whole(0, m), whole(3, l)], 1)?);
        Ok(stages)
    }
}

/// What one append binds: the key and value rows. With whether every sequence appends (which
/// mask buffer it binds), the key of the cache of recorded append dispatches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct AppendIo {
    pub k: InPlace,
    pub v: InPlace,
}
