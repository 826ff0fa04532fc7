//! The synchronous wrappers of the decode step (append, step, append-and-step, reset,
//! accessors); the recording itself is in `record.rs`.

use super::write::AppendIo;
use super::{DecodeOutput, FusedPlan, KvCache, Plan, StepOutputs};
use crate::error::{GpuError, Result};
use crate::ops::pyramid::GpuPyramid;
use crate::runtime::buffers::{check_len, GpuTensor};
use crate::runtime::pipeline::Storage;
use crate::runtime::view::InPlace;
use pisa_core::{AttentionShape, PyramidLayout, SelectionConfig};

impl KvCache {
    /// Appends one key and value per active sequence (`k_rows`, `v_rows`: `[B, Hkv, D]` f32;
    /// `active`: `[B]`), in one submission. Errors: [`pisa_core::PisaError::BufferLen`] for
    /// rows or `active` of the wrong length, [`pisa_core::PisaError::TooLarge`] when an active
    /// sequence is full, [`crate::GpuError::Misuse`] when a sequence's KV heads were loaded at
    /// different lengths ([`Self::prefill_view_heads`]); nothing changes on error. Non-finite
    /// rows are not checked (see
    /// [`KvCache`]'s "Non-finite inputs").
    pub fn append(&mut self, k_rows: &[f32], v_rows: &[f32], active: &[bool]) -> Result<()> {
        self.run(Some((k_rows, v_rows, active)), None, false)
            .map(|_| ())
    }

    /// One decode step for `q` (`[B, Hq, D]` f32, one token per sequence at position
    /// `len - 1`) in one submission; reads back O, LSE and, if `with_selection`, the selection.
    /// Blocks until the readback is done. `q` goes into the cache's own input buffer by a queue
    /// write and the outputs come back through its own readback buffer, so a step allocates
    /// no GPU memory and reuses the dispatches the first one recorded (without blocking and
    /// without the host copies: [`Self::record_step_into`]).
    /// Errors: [`pisa_core::PisaError::BufferLen`] for a `q` of the wrong length, GPU errors.
    /// A non-finite `q` is not checked (see [`KvCache`]'s "Non-finite inputs").
    pub fn step(&mut self, q: &[f32], with_selection: bool) -> Result<DecodeOutput> {
        self.run(None, Some(q), with_selection)
            .map(|o| o.expect("step output"))
    }

    /// The inference-loop step: append (as [`Self::append`]) then step (as [`Self::step`]),
    /// both recorded into ONE submission. Errors: those of both; nothing changes on error.
    /// Non-finite inputs are not checked (see [`KvCache`]'s "Non-finite inputs").
    pub fn append_and_step(
        &mut self,
        k_rows: &[f32],
        v_rows: &[f32],
        active: &[bool],
        q: &[f32],
        with_selection: bool,
    ) -> Result<DecodeOutput> {
        self.run(Some((k_rows, v_rows, active)), Some(q), with_selection)
            .map(|o| o.expect("step output"))
    }

    fn run(
        &mut self,
        rows: Option<(&[f32], &[f32], &[bool])>,
        q: Option<&[f32]>,
        with_selection: bool,
    ) -> Result<Option<DecodeOutput>> {
        let _call = self.ctx.public_call()?;
        let s = self.shape;
        let n = s.batch * s.kv_heads * s.head_dim;
        if let Some((k, v, active)) = rows {
            check_len("appended keys", k.len(), n)?;
            check_len("appended values", v.len(), n)?;
            self.check_append(n, active)?;
        }
        if let Some(q) = q {
            check_len("q", q.len(), s.batch * s.q_heads * s.head_dim)?;
        }
        let ctx = &self.ctx.clone();
        // The inputs go into the cache's own input buffers by queue writes (no buffer per
        // call), so every call binds the same buffers and reuses its recorded dispatches.
        if let Some((k, v, _)) = rows {
            ctx.write_host(&self.k_in, k)?;
            ctx.write_host(&self.v_in, v)?;
        }
        if let Some(q) = q {
            ctx.write_host(&self.q_in, q)?;
        }
        // The step, its outputs' copy to a mappable buffer, one submission, one map.
        let sizes = [
            self.out.buffer.size(),
            self.lse.buffer.size(),
            self.sel.buffer.size(),
        ];
        let staging = q.map(|_| self.readback.clone());
        ctx.scoped("decode step", || {
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            if let Some((_, _, a)) = rows {
                let io = AppendIo {
                    k: InPlace::whole(&self.k_in.buffer),
                    v: InPlace::whole(&self.v_in.buffer),
                };
                self.record_append_io(&mut enc, io, a, None)?;
            }
            if let Some(st) = &staging {
                Self::record_steps(&mut enc, &[(&*self, &self.q_in)], None)?;
                let mut off = 0;
                for (t, n) in [&self.out, &self.lse, &self.sel].iter().zip(sizes) {
                    enc.copy_buffer_to_buffer(&t.buffer, 0, st, off, n);
                    off += n;
                }
            }
            ctx.queue.submit([enc.finish()]);
            Ok(())
        })?;
        let Some(st) = staging else {
            return Ok(None);
        };
        let bytes = map_read(ctx, &st)?;
        let (o_bytes, rest) = bytes.split_at(sizes[0] as usize);
        let (l_bytes, s_bytes) = rest.split_at(sizes[1] as usize);
        let n_out = self.out.len;
        let out = crate::runtime::readback::widen(o_bytes, self.storage.output(), n_out);
        let lse = bytemuck::cast_slice::<u8, f32>(l_bytes)[..self.lse.len].to_vec();
        let sel = bytemuck::cast_slice::<u8, i32>(s_bytes)[..self.sel.len].to_vec();
        Ok(Some(DecodeOutput {
            out,
            lse,
            selection: with_selection.then_some(sel),
        }))
    }

    /// Empties sequence `seq` (its length becomes 0; the next append or prefill refills it).
    /// Queue-ordered: a queue write of `seq`'s GPU length alone, which lands before the next
    /// submission. So commands recorded into an encoder not submitted yet run after it: the
    /// other sequences' recorded appends and steps are unaffected, but a recorded append to
    /// `seq` itself would land after the reset; while an encoder holds commands for `seq`,
    /// use [`Self::record_reset`] (encoder-ordered) instead. Errors:
    /// [`pisa_core::PisaError::TooLarge`] for a `seq` out of range.
    pub fn reset(&mut self, seq: usize) -> Result<()> {
        self.check_seq(seq)?;
        self.lens[seq] = 0;
        self.head_lens[seq] = None;
        self.ctx
            .queue
            .write_buffer(&self.lens_gpu, seq as u64 * 4, bytemuck::bytes_of(&0u32));
        Ok(())
    }

    /// Tokens held by sequence `seq` (as the host tracks them, see [`Self::lens`]).
    /// Errors: [`pisa_core::PisaError::TooLarge`] for a `seq` out of range (`seq >= B`), as
    /// [`Self::reset`].
    pub fn len(&self, seq: usize) -> Result<usize> {
        self.check_seq(seq)?;
        Ok(self.lens[seq])
    }
    /// Tokens held by every sequence, `[B]`.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }
    /// Whether sequence `seq` holds no token. Errors: [`pisa_core::PisaError::TooLarge`] for
    /// a `seq` out of range (`seq >= B`), as [`Self::len`].
    pub fn is_empty(&self, seq: usize) -> Result<bool> {
        Ok(self.len(seq)? == 0)
    }
    /// Batch, heads and head dim (`q_len` 1, `k_len` = capacity).
    pub fn shape(&self) -> &AttentionShape {
        &self.shape
    }
    /// The selection configuration.
    pub fn config(&self) -> &SelectionConfig {
        &self.cfg
    }
    /// Storage precision of keys, values and queries, and of the outputs except for bf16
    /// (whose outputs are f32: [`Storage::output`]).
    pub fn storage(&self) -> Storage {
        self.storage
    }
    /// The pyramid layout of the capacity (the allocation's offsets: levels and node counts of
    /// `capacity` keys, PISA.md 1).
    pub fn pyramid_layout(&self) -> &PyramidLayout {
        &self.layout
    }
    /// [`Self::pyramid_layout`] (a name that read as a [`pisa_core::TensorLayout`]).
    #[deprecated(note = "use pyramid_layout: this is the pyramid's layout, not a tensor layout")]
    pub fn layout(&self) -> &PyramidLayout {
        self.pyramid_layout()
    }
    /// The key pyramid (means f32 `[B*Hkv, capacity nodes, D]`, second moments for `meanvar`);
    /// only the nodes of each sequence's current layout are meaningful.
    #[doc(hidden)]
    pub fn pyramid(&self) -> &GpuPyramid {
        &self.pyr
    }
    /// Keys and values in storage precision, as shards of `[rows, capacity, D]` each: the flat
    /// (sequence, KV head) rows `b * Hkv + h` from `i * rows_per_shard` in shard i. One shard
    /// (`[B, Hkv, capacity, D]`) unless the cache exceeds one storage binding; two at most.
    #[doc(hidden)]
    pub fn kv_shards(&self) -> (&[(GpuTensor, GpuTensor)], usize) {
        (&self.kv, self.kv_rows)
    }
    /// The cache's own step outputs, which every step writes unless given the caller's
    /// ([`Self::record_step_into`]): views of the cache's buffers, BHND contiguous from byte 0,
    /// to bind or copy from in the application's own commands (the buffers have `STORAGE` and
    /// `COPY_SRC` usage) or to read with [`crate::Context::read_async`]:
    /// - `out`: O `[B, Hq, 1, D]` in the storage dtype ([`crate::Storage::output`]: f32 for a
    ///   bf16 cache);
    /// - `lse`: LSE `[B, Hq, 1, 1]` f32 (natural log; `-inf` for an empty sequence);
    /// - `selection`: always `Some`, the selected leaves `[B, Hkv, 1, K]` i32, ascending, -1
    ///   padded.
    ///
    /// They hold the last step recorded with the cache's outputs (or the last token of
    /// [`Self::record_chunk`]) once its submission finishes (unspecified before any step);
    /// the next such step overwrites them: copy them out first to keep them. A step given the
    /// caller's outputs writes through these too where the kernels cannot bind the caller's
    /// view in place (another dtype than the step writes, an offset off the device's storage
    /// alignment, or a layout other than contiguous BHND), then copies them out; so such a
    /// step overwrites that output (O, LSE or selection) here as well.
    pub fn outputs(&self) -> StepOutputs<'_> {
        let [out, lse, selection] = &self.out_views;
        StepOutputs {
            out,
            lse,
            selection: Some(selection),
        }
    }
    /// Workgroup memory of the step's largest kernel, bytes: the fused kernel's when the step
    /// runs fused ([`Self::is_fused`]), else the largest of `route`, `leaf`, `merge`.
    pub fn workgroup_memory(&self) -> u64 {
        match self.fplan {
            Some(f) if self.is_fused() => f.smem,
            _ => self.plan.smem,
        }
    }

    /// Caps the step kernels' workgroup memory at `bytes` (tuning and tests; the device's
    /// limit still applies, and so does [`Self::set_workgroup_size_limit`]). `leaf` then uses
    /// fewer P.V parts, fewer lanes per key and, at the least, blocks in several chunks of keys
    /// (more online-softmax rescaling rounds); `route` fewer lanes per row; the fused kernel
    /// fewer lanes per key, then fewer keys per block and pass, and where even its minimum does
    /// not fit the step runs split. Results agree within rounding. Errors:
    /// [`crate::GpuError::Limit`] when a split kernel's minimum does not fit (the split step is
    /// the fallback); nothing changes on error.
    pub fn set_workgroup_memory_limit(&mut self, bytes: u32) -> Result<()> {
        let mut lim = self.limits.clone();
        let dev = self.ctx.limits().max_compute_workgroup_storage_size;
        lim.max_compute_workgroup_storage_size = dev.min(bytes);
        self.replan(lim)
    }

    /// Caps the invocations per workgroup of the step kernels at `invocations` (tests: the
    /// workgroup-size dependent paths of a smaller device; the device's limit still applies,
    /// and so does [`Self::set_workgroup_memory_limit`]). Each kernel takes the largest power
    /// of two within the cap. Results agree within rounding. Errors:
    /// [`crate::GpuError::Limit`] for a cap below what the step needs (an invocation per
    /// query head of a GQA group and per 4 dims of a head: the largest power of two within
    /// the cap and the device's workgroup x size must hold both; its `limit` is that power of
    /// two), or when a kernel's minimum does not fit; nothing changes on error.
    pub fn set_workgroup_size_limit(&mut self, invocations: u32) -> Result<()> {
        let mut lim = self.limits.clone();
        let dev = self.ctx.limits().max_compute_invocations_per_workgroup;
        let cap = dev.min(invocations.max(1));
        let (gq, d) = (self.shape.gqa_group(), self.shape.head_dim);
        let needed = (gq as u64).max((d as u64).div_ceil(4));
        lim.max_compute_invocations_per_workgroup = cap;
        // The kernels take the largest power of two within the cap (and the device's x size).
        let usable = super::plan::max_workgroup(&lim);
        if usable < needed {
            return Err(GpuError::Limit {
                what: format!("a decode step (GQA group {gq}, head dim {d})"),
                needed: needed.next_power_of_two(),
                limit: usable,
                unit: "invocations per workgroup",
                hint: "the step needs an invocation per query head of a group and per 4 dims of a head; raise the cap",
            });
        }
        self.replan(lim)
    }

    /// Sizes both paths' kernels for `lim`, kept only when the split step fits.
    fn replan(&mut self, lim: wgpu::Limits) -> Result<()> {
        let (gq, d) = (self.shape.gqa_group(), self.shape.head_dim);
        self.plan = Plan::new(&lim, gq, d, &self.cfg)?;
        self.fplan = FusedPlan::new(&lim, gq, d, &self.cfg, self.key_lanes);
        self.fused_loops_ok = super::fused::loops_within_cap(
            self.fplan.as_ref(),
            &self.ctx,
            (gq, d),
            &self.cfg,
            self.layout.num_levels(),
        );
        self.limits = lim;
        self.stage_cache.clear();
        Ok(())
    }
}

/// Maps a finished MAP_READ buffer and returns its bytes; the buffer is left unmapped, on error
/// too (the cache's readback buffer serves every host call): a map still pending after a failed
/// wait is cancelled, a mapped one unmapped; a map that failed left it unmapped.
fn map_read(ctx: &crate::Context, buf: &wgpu::Buffer) -> Result<Vec<u8>> {
    let slice = buf.slice(..);
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    if let Err(e) = ctx.wait() {
        buf.unmap();
        return Err(e);
    }
    let poll = |e: String| GpuError::Poll(format!("decode readback: {e}"));
    rx.recv()
        .map_err(|e| poll(e.to_string()))?
        .map_err(|e| poll(e.to_string()))?;
    let data = slice.get_mapped_range().map(|v| v.to_vec());
    buf.unmap();
    data.map_err(|e| poll(e.to_string()))
}
