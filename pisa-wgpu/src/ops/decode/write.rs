//! The writes of the KV cache: prefill (copy and pyramid build) and the append with its
//! ancestor-path update (PISA.md section 1), `shaders/decode_append.wgsl`.

use std::sync::Arc;

use pisa_core::{PisaError, TensorLayout};

use super::{check_len, input, KvCache, Params, APPEND_SHADER, APPEND_WG};
use crate::error::Result;
use crate::ops::pyramid;
use crate::runtime::buffers::GpuTensor;
use crate::runtime::profiler::Profiler;

impl KvCache<'_> {
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
        self.check_seq(seq)?;
        let (hkv, d) = (self.shape.kv_heads, self.shape.head_dim);
        let p_len = k.len / (hkv * d);
        // A positive multiple of Hkv * D: else name the nearest length that would be.
        check_len("prefill keys", k.len, p_len.max(1) * hkv * d)?;
        self.check_tensor("prefill keys", k, p_len * hkv * d)?;
        self.check_tensor("prefill values", v, p_len * hkv * d)?;
        if p_len > self.layout.key_len() {
            return Err(input(PisaError::TooLarge {
                what: "prefill length",
                value: p_len as u64,
                limit: self.layout.key_len() as u64,
            }));
        }
        let ctx = self.ctx;
        let geo = Self::geometry(1, hkv, p_len, d, layout);
        let tmp = pyramid::alloc(ctx, self.layout, &geo, self.pyr.sq.is_some())?;
        let (_, sh, sn) = layout.strides(hkv, p_len, d);
        let count = (hkv * p_len * d) as u32;
        let pr = Params {
            seq: seq as u32,
            src_sh: sh as u32,
            src_sn: sn as u32,
            count,
            src_len: p_len as u32,
            ..self.base()
        };
        let u = ctx.uniform("decode copy params", &pr)?;
        let pipe = self.append_pipeline("copy_rows")?;
        let row_bytes = (hkv * self.layout.total_nodes() * d * 4) as u64;
        ctx.scoped("decode prefill", || {
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            let b = [
                (0, &u),
                (4, &self.k.buffer),
                (5, &self.v.buffer),
                (8, &k.buffer),
                (9, &v.buffer),
            ];
            ctx.dispatch(&mut enc, &pipe, &b, count.div_ceil(APPEND_WG) as u64, None)?;
            pyramid::record_build(ctx, &mut enc, k, &geo, p_len, &tmp, None)?;
            let off = seq as u64 * row_bytes;
            enc.copy_buffer_to_buffer(&tmp.means.buffer, 0, &self.pyr.means.buffer, off, row_bytes);
            if let (Some(s), Some(d)) = (&tmp.sq, &self.pyr.sq) {
                enc.copy_buffer_to_buffer(&s.buffer, 0, &d.buffer, off, row_bytes);
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
        let ctx = self.ctx;
        let pos_buf = ctx.upload_u32("append positions", &pos)?;
        let wg = (self.shape.batch * self.shape.kv_heads) as u32;
        let u = ctx.uniform(
            "append params",
            &Params {
                wg_count: wg,
                ..self.base()
            },
        )?;
        let pipe = self.append_pipeline("append")?;
        let sq = self.pyr.sq.as_ref().unwrap_or(&self.dummy);
        let b = [
            (0, &u),
            (1, &pos_buf.buffer),
            (2, &k_rows.buffer),
            (3, &v_rows.buffer),
            (4, &self.k.buffer),
            (5, &self.v.buffer),
            (6, &self.pyr.means.buffer),
            (7, &sq.buffer),
        ];
        let timer = prof.map(|p| (p, "append"));
        ctx.dispatch(enc, &pipe, &b, wg as u64, timer)?;
        for (l, &a) in self.lens.iter_mut().zip(active) {
            *l += a as usize;
        }
        Ok(())
    }
}
