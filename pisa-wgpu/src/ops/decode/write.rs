//! The writes of the KV cache: prefill (copy and pyramid build) and the append with its
//! ancestor-path update (PISA.md section 1), `shaders/decode_append.wgsl`.

use std::sync::Arc;

use pisa_core::{PisaError, TensorLayout};

use super::{check_len, input, KvCache, Params, APPEND_SHADER, APPEND_WG};
use crate::error::Result;
use crate::ops::pyramid;
use crate::runtime::buffers::GpuTensor;
use crate::runtime::profiler::Profiler;

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
        let kt = self.ctx.upload("prefill keys", k, self.storage)?;
        let vt = self.ctx.upload("prefill values", v, self.storage)?;
        self.prefill_device(seq, &kt, &vt, layout)
    }

    /// [`Self::prefill`] from tensors already on the GPU (in the cache's storage precision).
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
    /// before a step (a head left out keeps what it held: another length's keys, or poison).
    /// Errors: as [`Self::prefill_device`]; [`PisaError::Zero`] for no heads,
    /// [`PisaError::TooLarge`] for a head range past Hkv; nothing changes on error.
    pub fn prefill_device_heads(
        &mut self,
        seq: usize,
        h0: usize,
        heads: usize,
        k: &GpuTensor,
        v: &GpuTensor,
        layout: TensorLayout,
    ) -> Result<()> {
        self.check_seq(seq)?;
        let (hkv, d) = (self.shape.kv_heads, self.shape.head_dim);
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
        let p_len = k.len / (heads * d);
        // A positive multiple of heads * D: else name the nearest length that would be.
        check_len("prefill keys", k.len, p_len.max(1) * heads * d)?;
        self.check_tensor("prefill keys", k, p_len * heads * d)?;
        self.check_tensor("prefill values", v, p_len * heads * d)?;
        if p_len > self.layout.key_len() {
            return Err(input(PisaError::TooLarge {
                what: "prefill length",
                value: p_len as u64,
                limit: self.layout.key_len() as u64,
            }));
        }
        let ctx = &self.ctx;
        let geo = Self::geometry(1, heads, p_len, d, layout);
        let tmp = pyramid::alloc(ctx, self.layout, &geo, self.pyr.sq.is_some())?;
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
        ctx.scoped("decode prefill", || {
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            for (u, shard, count) in &copies {
                let b = [
                    (0, u),
                    (4, &shard.0.buffer),
                    (5, &shard.1.buffer),
                    (8, &k.buffer),
                    (9, &v.buffer),
                ];
                ctx.dispatch(&mut enc, &pipe, &b, count.div_ceil(APPEND_WG) as u64, None)?;
            }
            pyramid::record_build(ctx, &mut enc, k, &geo, p_len, &tmp, None)?;
            enc.copy_buffer_to_buffer(&tmp.means.buffer, 0, &self.pyr.means.buffer, off, bytes);
            if let (Some(s), Some(d)) = (&tmp.sq, &self.pyr.sq) {
                enc.copy_buffer_to_buffer(&s.buffer, 0, &d.buffer, off, bytes);
            }
            ctx.queue.submit([enc.finish()]);
            Ok(())
        })?;
        self.lens[seq] = p_len;
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

    pub(super) fn check_append(&self, rows: usize, active: &[bool]) -> Result<()> {
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
    /// labelled "append" in `prof`. Lengths advance at once on the host: submit `enc` before
    /// reading results. Errors: as [`Self::append`]; nothing changes on error.
    pub fn record_append(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        k_rows: &GpuTensor,
        v_rows: &GpuTensor,
        active: &[bool],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let n = self.shape.batch * self.shape.kv_heads * self.shape.head_dim;
        self.check_tensor("appended keys", k_rows, n)?;
        self.check_tensor("appended values", v_rows, n)?;
        self.check_append(n, active)?;
        let pos: Vec<u32> = active
            .iter()
            .zip(&self.lens)
            .map(|(&a, &l)| if a { l as u32 } else { u32::MAX })
            .collect();
        let ctx = &self.ctx;
        let pos_buf = ctx.upload_u32("append positions", &pos)?;
        let rows = self.shape.batch * self.shape.kv_heads;
        let pipe = self.append_pipeline("append")?;
        let sq = self.pyr.sq.as_ref().unwrap_or(&self.dummy);
        // One dispatch per K/V shard, one workgroup per flat (sequence, KV head) row of it, in
        // one pass timed as "append" (both write the pyramid, so wgpu orders them).
        let mut stages = Vec::new();
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
            let b = [
                (0, &u),
                (1, &pos_buf.buffer),
                (2, &k_rows.buffer),
                (3, &v_rows.buffer),
                (4, &shard.0.buffer),
                (5, &shard.1.buffer),
                (6, &self.pyr.means.buffer),
                (7, &sq.buffer),
            ];
            stages.push(ctx.stage(&pipe, &b, (r1 - r0) as u64)?);
        }
        ctx.check_alive()?;
        ctx.record_pass(enc, "append", &stages, prof);
        for (l, &a) in self.lens.iter_mut().zip(active) {
            *l += a as usize;
        }
        Ok(())
    }
}
