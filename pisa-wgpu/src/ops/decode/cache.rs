//! Construction of the KV cache ([`KvCache::new`]): validation of the shape, the
//! configuration and the device (u32 indices, f16 support, storage buffers per stage, the step's
//! workgroup memory), allocation of the cache, its pyramid, the step's outputs and scratch; and
//! the small helpers the other parts share (key geometry, the uniform parameters' base, the
//! sequence and tensor checks).

use pisa_core::{AttentionShape, PisaError, PyramidLayout, SelectionConfig, TensorLayout};

use super::fused::FusedPlan;
use super::plan::{needs_sq, Params, Plan};
use super::{input, KvCache};
use crate::error::{GpuError, Result};
use crate::ops::pyramid::{self, KeyGeometry};
use crate::runtime::buffers::{GpuTensor, POISON_F32, POISON_I32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;
use crate::runtime::view::{DType, TensorView};

/// The sizes of a [`KvCache`] by name, for [`KvCache::with_sizes`] (the five sizes of
/// [`KvCache::new`] in a row are easy to swap unnoticed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSizes {
    /// Sequences, B.
    pub batch: usize,
    /// Most tokens a sequence holds.
    pub capacity: usize,
    /// Query heads, Hq (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// KV heads, Hkv.
    pub kv_heads: usize,
    /// Head dim, D.
    pub head_dim: usize,
}

impl KvCache {
    /// [`Self::new`] with its sizes named. Errors: those of [`Self::new`].
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context) -> pisa_wgpu::Result<()> {
    /// use pisa_wgpu::ops::decode::{CacheSizes, KvCache};
    /// let sizes = CacheSizes { batch: 4, capacity: 65536, q_heads: 32, kv_heads: 8, head_dim: 128 };
    /// let cfg = pisa_core::SelectionConfig::new(64, 16)?;
    /// let cache = KvCache::with_sizes(ctx, sizes, cfg, pisa_wgpu::Storage::F16)?;
    /// # Ok(()) }
    /// ```
    pub fn with_sizes(
        ctx: &Context,
        sizes: CacheSizes,
        cfg: SelectionConfig,
        storage: Storage,
    ) -> Result<Self> {
        let s = sizes;
        Self::new(
            ctx, s.batch, s.capacity, s.q_heads, s.kv_heads, s.head_dim, cfg, storage,
        )
    }

    /// An empty cache (every length 0) for `batch` sequences of up to `capacity` tokens,
    /// `q_heads` (Hq) query heads, `kv_heads` (Hkv) KV heads, head dim D, selection `cfg`, keys,
    /// values and queries in `storage` precision, outputs in [`Storage::output`] (f32 for
    /// bf16: the kernels widen the bf16 cache as they read it).
    ///
    /// Errors: the shape's and configuration's validation errors ([`GpuError::Input`]);
    /// [`PisaError::TooLarge`] when an index would not fit u32 (cache elements, pyramid
    /// elements, `capacity * g`, `top_k * block_size`); [`GpuError::Limit`] when K/V exceed two storage bindings
    /// (one binding holds them when it can; else they are split in two by flat (sequence, KV
    /// head) row), the pyramid one, or the step's workgroup memory its
    /// limit;
    /// [`PisaError::HeadDim`] for D not a multiple of 4 (or above 1024);
    /// [`GpuError::Limit`] in "bindings" for a device with fewer than 9 storage buffers per
    /// shader stage (wgpu's default limits allow 8, its downlevel defaults 4: open it with the
    /// adapter's limits);
    /// [`GpuError::Unsupported`] for f16 without SHADER_F16, or g_q above the workgroup size.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Context,
        batch: usize,
        capacity: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        cfg: SelectionConfig,
        storage: Storage,
    ) -> Result<Self> {
        let _call = ctx.public_call()?;
        if capacity == 0 {
            // (AttentionShape would name it k_len)
            return Err(PisaError::Zero { what: "capacity" }.into());
        }
        let shape = AttentionShape::new(batch, q_heads, kv_heads, 1, capacity, head_dim)?;
        cfg.validate()?;
        let layout = PyramidLayout::new(capacity, cfg.block_size, cfg.merge_factor)?;
        let u32_max = u32::MAX as u64;
        let big = |what, value: u64| {
            (value > u32_max).then_some(input(PisaError::TooLarge {
                what,
                value,
                limit: u32_max,
            }))
        };
        let bh = (batch * kv_heads) as u64;
        let d = head_dim as u64;
        let kv_elems = bh * capacity as u64 * d;
        let checks = [
            big("KV cache elements", kv_elems),
            big("pyramid elements", bh * layout.total_nodes() as u64 * d),
            big(
                "capacity * merge factor",
                capacity as u64 * cfg.merge_factor as u64,
            ),
            big("top_k * block_size", (cfg.top_k * cfg.block_size) as u64),
        ];
        if let Some(e) = checks.into_iter().flatten().next() {
            return Err(e);
        }
        if storage == Storage::F16 && !ctx.has_f16() {
            return Err(ctx.no_f16(" for a decode cache"));
        }
        let storage_limit = ctx.limits().max_storage_buffers_per_shader_stage;
        if storage_limit < 9 {
            return Err(GpuError::Limit {
                what: "storage buffers per shader stage of the decode kernels".into(),
                needed: 9,
                limit: storage_limit as u64,
                unit: "bindings",
                hint: crate::runtime::pipeline::BINDINGS_HINT,
            });
        }
        let plan = Plan::new(ctx.limits(), shape.gqa_group(), head_dim, &cfg)?;
        let tuning = ctx.tuning();
        let fplan = FusedPlan::new(
            ctx.limits(),
            shape.gqa_group(),
            head_dim,
            &cfg,
            tuning.decode_key_lanes,
        );
        let kv_rows = Self::shard_rows(ctx, bh, capacity as u64 * d * storage.bytes())?;
        let mut kv = Vec::new();
        for r0 in (0..bh).step_by(kv_rows as usize) {
            let n = (kv_rows.min(bh - r0) * capacity as u64 * d) as usize;
            kv.push((
                ctx.alloc("kv cache keys", n, storage, POISON_F32)?,
                ctx.alloc("kv cache values", n, storage, POISON_F32)?,
            ));
        }
        let geo = Self::geometry(batch, kv_heads, capacity, head_dim, TensorLayout::Bhnd);
        let pyr = pyramid::alloc(ctx, layout, &geo, needs_sq(&cfg))?;
        let q_elems = batch * q_heads * head_dim;
        let slots = batch * kv_heads * plan.slots() as usize;
        let part_elems = slots * shape.gqa_group() * (head_dim + 2);
        let out = ctx.alloc("decode out", q_elems, storage.output(), POISON_F32)?;
        let lse = ctx.alloc("decode lse", batch * q_heads, Storage::F32, POISON_F32)?;
        let sel = ctx.alloc(
            "decode selection",
            batch * kv_heads * cfg.top_k,
            Storage::F32,
            POISON_I32,
        )?;
        let readback = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("decode readback"),
            size: out.buffer.size() + lse.buffer.size() + sel.buffer.size(),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let view = |t: &GpuTensor, dtype, shape| {
            TensorView::contiguous(&t.buffer, 0, dtype, shape, TensorLayout::Bhnd)
        };
        let out_views = [
            view(&out, storage.output().into(), [batch, q_heads, 1, head_dim])?,
            view(&lse, DType::F32, [batch, q_heads, 1, 1])?,
            view(&sel, DType::I32, [batch, kv_heads, 1, cfg.top_k])?,
        ];
        Ok(Self {
            ctx: ctx.clone(),
            shape,
            cfg,
            storage,
            layout,
            limits: ctx.limits().clone(),
            plan,
            fplan,
            fused_loops_ok: super::fused::loops_within_cap(
                fplan.as_ref(),
                ctx,
                (shape.gqa_group(), head_dim),
                &cfg,
                layout.num_levels(),
            ),
            fused: tuning.decode_fused,
            key_lanes: tuning.decode_key_lanes,
            route_subgroups: tuning.decode_route_subgroups,
            leaf_subgroups: tuning.decode_leaf_subgroups,
            leaf_prefetch: tuning.decode_leaf_prefetch,
            route_workgroups: tuning.decode_route_workgroups,
            merge_in_route: tuning.decode_merge_in_route && ctx.one_dispatch_decode().is_ok(),
            // (zeroed by wgpu: every counter starts at 0; COPY_SRC for the tests' read back)
            done: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("decode copies done"),
                size: (batch * kv_heads) as u64 * 4,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            kv,
            kv_rows: kv_rows as usize,
            pyr,
            dummy: ctx.alloc("unused", 4, Storage::F32, 0)?,
            out,
            lse,
            sel,
            out_views,
            cands: ctx.alloc("decode leaf slots", slots, Storage::F32, POISON_I32)?,
            parts: ctx.alloc("decode block states", part_elems, Storage::F32, POISON_F32)?,
            lens: vec![0; batch],
            head_lens: vec![None; batch],
            readback,
            q_in: ctx.host_input("decode q rows", q_elems, storage)?,
            k_in: ctx.host_input("appended key rows", batch * kv_heads * head_dim, storage)?,
            v_in: ctx.host_input("appended value rows", batch * kv_heads * head_dim, storage)?,
            lens_gpu: Self::u32_buffer(ctx, "decode lengths", batch),
            pos_gpu: Self::u32_buffer(ctx, "append positions", batch),
            mask_all: {
                let b = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("append mask, all"),
                    size: batch as u64 * 4,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                // Once, at creation: ordered before any submission that reads it.
                ctx.queue
                    .write_buffer(&b, 0, bytemuck::cast_slice(&vec![1u32; batch]));
                b
            },
            mask_some: Self::u32_buffer(ctx, "append mask, some", batch),
            stage_cache: Default::default(),
            append_cache: Default::default(),
            gather_cache: Default::default(),
        })
    }

    /// Flat (sequence, KV head) rows per K/V shard: all `rows` in one storage binding when they
    /// fit, else split evenly over two (the step's `leaf` binds two shards; the rows of one
    /// sequence may straddle them). Errors: [`GpuError::Limit`] when one row, or half of them,
    /// exceeds the binding limit.
    fn shard_rows(ctx: &Context, rows: u64, row_bytes: u64) -> Result<u64> {
        let per_binding = ctx.max_binding_bytes() / row_bytes.max(1);
        let half = rows.div_ceil(2);
        if rows <= per_binding {
            Ok(rows)
        } else if half <= per_binding {
            Ok(half)
        } else {
            Err(GpuError::Limit {
                what: "KV cache keys per storage binding (two bindings at most)".into(),
                needed: half * row_bytes,
                limit: ctx.max_binding_bytes(),
                unit: "bytes",
                hint: "use a smaller capacity or batch, or split the KV heads over several caches",
            })
        }
    }

    /// A zeroed u32 `[n]` storage buffer the host can write.
    pub(super) fn u32_buffer(ctx: &Context, label: &str, n: usize) -> wgpu::Buffer {
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (n as u64 * 4).max(4),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    pub(super) fn geometry(
        b: usize,
        h: usize,
        tokens: usize,
        d: usize,
        l: TensorLayout,
    ) -> KeyGeometry {
        KeyGeometry {
            batch: b,
            kv_heads: h,
            tokens,
            head_dim: d,
            layout: l.into(),
        }
    }

    pub(super) fn base(&self) -> Params {
        let s = &self.shape;
        Params {
            kv_split: self.kv_rows as u32,
            ..Params::base(
                s.batch,
                s.q_heads,
                s.kv_heads,
                s.head_dim,
                &self.layout,
                &self.cfg,
            )
        }
    }

    pub(crate) fn check_seq(&self, seq: usize) -> Result<()> {
        if seq >= self.shape.batch {
            return Err(input(PisaError::TooLarge {
                what: "sequence index",
                value: seq as u64,
                limit: self.shape.batch as u64 - 1,
            }));
        }
        Ok(())
    }

    pub(super) fn check_tensor(&self, what: &'static str, t: &GpuTensor, len: usize) -> Result<()> {
        if t.storage != self.storage {
            return Err(GpuError::Unsupported(format!(
                "{what} in {:?} storage for a {:?} cache",
                t.storage, self.storage
            )));
        }
        t.check_shape(what, len)
    }
}
