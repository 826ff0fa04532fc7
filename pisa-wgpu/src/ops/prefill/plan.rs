//! Prefill as plan / run (FlashInfer's split): [`PrefillPlan::new`] once per shape and
//! options builds the pipelines, the contiguous Q/K/V staging, every intermediate, the uniform
//! parameters and the bind groups (by recording the prefill once, see `runtime/arena.rs`);
//! [`PrefillPlan::run`] records into the caller's encoder, reading the caller's Q/K/V views and
//! writing the caller's O, LSE (and optional selection) views, with no allocation of tensors,
//! no host fill in release builds and no wait. What a run makes is small and independent of N:
//! the parameter buffers and bind groups of the gathers and scatters, and, the first time a
//! set of views is read in place, the bind groups and parameter buffers of those views (the
//! arena keeps up to 16 sets, the layers of a model reusing one QKV buffer among them, and makes
//! them anew each run past that; the kept sets hold references to the caller's buffers).
//!
//! How a run reads its inputs (in place or gathered) and writes its outputs: see
//! [`PrefillPlan`].

use pisa_core::{AttentionShape, PisaError, TensorLayout};

use crate::ops::attention::{OutTarget, QkvLayouts};
use crate::runtime::view::KernelLayout;

use super::{record_prefill_parts, PrefillOptions};
use crate::error::{GpuError, Result};
use crate::ops::decode::KvCache;
use crate::ops::gather::{check_gather_src, check_scatter_dst, record_gather, record_scatter};
use crate::runtime::arena::{with_arena, Arena};
use crate::runtime::buffers::{GpuTensor, POISON_F32};
use crate::runtime::context::{Context, KernelPath, LeafOrder};
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;
use crate::runtime::tuning::Tuning;
use crate::runtime::view::{
    check_disjoint_among, check_disjoint_between, check_float_input, contiguous_strides, DType,
    TensorView,
};

/// The caller's outputs of a prefill run.
#[derive(Debug, Clone, Copy)]
pub struct PrefillOutputs<'a> {
    /// O `[B, Hq, Nq, D]`, f32, f16 or bf16 (converted from the plan's storage): an f32 O of
    /// any strides; an f16 or bf16 O (written in whole 4-byte words) needs an even D, a D
    /// stride of 1, an even element offset and even strides (those of dimensions of extent
    /// above 1), else [`crate::GpuError::View`].
    pub out: &'a TensorView,
    /// LSE `[B, Hq, Nq, 1]` f32 (natural log), any strides.
    pub lse: &'a TensorView,
    /// The selection `[B, Hkv, Nq, K]` i32, any strides: ascending leaf indices, -1 padded.
    pub selection: Option<&'a TensorView>,
}

/// The caller's views a plan made by [`PrefillPlan::new_in_place`] is made for: Q, K, V read in
/// place, and optionally O written in place.
#[derive(Debug, Clone, Copy)]
pub struct PlanViews<'a> {
    /// Q `[B, Hq, Nq, D]`.
    pub q: &'a TensorView,
    /// K `[B, Hkv, Nk, D]`.
    pub k: &'a TensorView,
    /// V `[B, Hkv, Nk, D]` (with K's strides).
    pub v: &'a TensorView,
    /// O `[B, Hq, Nq, D]` to be written in place by the kernels (in a buffer other than Q's,
    /// K's and V's, of the plan's [`Storage::output`] dtype, laid out as a view read in place
    /// must be), or `None` to have the plan write its own O and copy it into each run's output
    /// view (any strides and dtype).
    pub out: Option<&'a TensorView>,
}

/// A prefill planned for one shape and options, as FlashInfer splits plan and run:
/// [`PrefillPlan::new`] once per shape and options builds the pipelines, the contiguous Q/K/V
/// staging, every intermediate, the uniform parameters and the bind groups (by recording the
/// prefill once); [`PrefillPlan::run`] records into the caller's encoder, reading the caller's
/// Q/K/V views and writing the caller's O, LSE (and optional selection) views, with no
/// allocation of tensors, no host write of data and no wait. What a run makes is small and
/// independent of N: the parameter buffers and bind groups of the gathers and scatters, and,
/// the first time a set of views is read in place, the bind groups and parameter buffers of
/// those views (a plan keeps up to 16 such sets, the layers of a model reusing one QKV buffer
/// among them, and makes them anew each run past that; the kept sets hold references to the
/// caller's buffers). What the stages compute, and what non-finite inputs produce: the
/// [module docs](crate::ops::prefill).
///
/// # How the inputs are read
///
/// The kernels read a view **in place**, with no copy, when they can address it directly:
/// - its dtype is the plan's storage (f16 views for f16 storage, bf16 for bf16, f32 for f32);
/// - its head-dim stride is 1 and its batch, head and token strides (those of dimensions of
///   extent above 1) are multiples of 8 elements, so every row starts on a 16-byte boundary
///   as the vector loads need (a packed QKV projection `[B, N, Hq + 2 Hkv, D]` qualifies,
///   when D is a multiple of 8);
/// - its byte offset is a multiple of the device's `min_storage_buffer_offset_alignment`
///   (256 bytes on most desktop GPUs), because a binding starts there (in a packed QKV
///   buffer: when the buffer offset, `Hq * D` and `(Hq + Hkv) * D` elements are such
///   multiples, and so is each view's first token for a varlen sequence);
/// - the bytes from its first to past its last element fit one storage binding
///   ([`Context::max_binding_bytes`]);
/// - for K and V: both qualify and have the same strides (the leaf-major kernels address V
///   with K's strides).
///
/// Any other view (another dtype, an unaligned offset, a wider span) is **gathered** on
/// the GPU into the plan's contiguous BHND staging (`ops::gather`: any strides, f32 / f16 /
/// bf16, any element-aligned offset), one read and one write of the tensor on the device.
/// [`PrefillPlan::reads_in_place`] says which way a view goes. The kernels and the result are
/// the same either way (bit for bit: the tests compare both). A plan made by
/// [`PrefillPlan::new_in_place`] holds no staging (Q, K and V in the plan's storage: 3 GiB at
/// 256K tokens with 32 query and 8 KV heads of 128 in f16) and refuses views it would have to
/// gather.
///
/// The outputs are written by the kernels into the plan's O (of [`Storage::output`]: f32 for
/// bf16 storage), LSE and selection, then copied (`copy_buffer_to_buffer`, when the caller's
/// view is contiguous BHND of O's dtype at a 4-byte offset in a buffer with `COPY_DST`) or
/// scattered
/// (`ops::gather::record_scatter`, converting to the view's dtype) into the caller's views;
/// a plan made by [`PrefillPlan::new_in_place`] with [`PlanViews::out`] has the kernels write
/// the caller's O directly (no O of its own, no copy).
///
/// # bf16
///
/// With [`Storage::Bf16`] the kernels bind bf16 views and the bf16 staging as 16-bit words
/// and widen each element to f32 as they load it (exact: a bf16 is the upper half of an f32),
/// so results equal f32 storage on the same bf16 values. Those are the portable kernels (the
/// plan never picks a cooperative-matrix or NVIDIA kernel for bf16). A bf16 decode cache takes
/// over a bf16 plan's keys, values and pyramid
/// ([`crate::ops::decode::KvCache::record_prefill_from_plan`]) as for the other storages.
///
/// # Example
///
/// ```no_run
/// # fn f(ctx: &pisa_wgpu::Context, q: &pisa_wgpu::TensorView, k: &pisa_wgpu::TensorView,
/// #      v: &pisa_wgpu::TensorView, o: &pisa_wgpu::TensorView, lse: &pisa_wgpu::TensorView)
/// #      -> pisa_wgpu::Result<()> {
/// use pisa_core::{AttentionShape, SelectionConfig};
/// use pisa_wgpu::ops::prefill::{PrefillOptions, PrefillOutputs, PrefillPlan};
/// let shape = AttentionShape::prefill(1, 32, 8, 4096, 128)?;
/// let opts = PrefillOptions { cfg: SelectionConfig::new(64, 16)?, ..Default::default() };
/// let plan = PrefillPlan::new(ctx, &shape, &opts)?; // once per shape
/// let mut enc = ctx.device().create_command_encoder(&Default::default());
/// plan.run(&mut enc, q, k, v, &PrefillOutputs { out: o, lse, selection: None }, None)?;
/// ctx.queue().submit([enc.finish()]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PrefillPlan {
    ctx: Context,
    shape: AttentionShape,
    opts: PrefillOptions,
    /// The context's knobs the prefill depends on, and its binding limit, when the plan was
    /// made.
    knobs: PrefillKnobs,
    binding: u64,
    /// The contiguous BHND staging of Q, K and V that a run gathers views into; `None` for a
    /// plan made by [`Self::new_in_place`], which reads its inputs in place only.
    staging: Option<[GpuTensor; 3]>,
    /// The kernels write O into the caller's output view (a plan made by
    /// [`Self::new_in_place`] with [`PlanViews::out`]): the plan holds no O of its own.
    out_in_place: bool,
    arena: std::sync::Mutex<Arena>,
    /// What the last run read K and V from, for a decode cache taking over the keys and values
    /// ([`Self::parts`]): `None` before any run, `Some(None)` when it gathered them into the
    /// staging, `Some(Some(views))` when it read the caller's views in place. Set while the
    /// arena is held, so it always goes with the pyramid of the same run.
    last_kv: std::sync::Mutex<Option<Option<InPlaceKv>>>,
    /// The key pyramid the prefill builds (an arena buffer: the same one every run), kept for a
    /// decode cache to take over.
    pyramid: std::sync::Mutex<Option<(wgpu::Buffer, Option<wgpu::Buffer>)>>,
}

impl PrefillPlan {
    /// The context the plan was made with.
    pub(crate) fn context(&self) -> &Context {
        &self.ctx
    }

    /// Plans the prefill of `shape` with `opts` (its `layout` is not used: the views carry
    /// their own strides). Records the prefill once (into an encoder that is dropped):
    /// pipelines are built and every buffer and bind group is made here.
    ///
    /// `q_len` may be below `k_len`: the queries are then the last `q_len` tokens of the
    /// `k_len` keys (query `i` at position `k_len - q_len + i`, PISA.md "Notation"), as in a
    /// chunk of a prompt prefilled over the keys and values of its earlier chunks. The run
    /// builds the key pyramid of all `k_len` keys and selects and attends for the `q_len`
    /// queries only; a decode cache taking over ([`KvCache::record_prefill_from_plan`]) gets
    /// all `k_len` keys.
    ///
    /// Limits: head dims that are multiples of 16 from 16 to 256 (the decode cache takes any
    /// multiple of 4 up to 1024), GQA groups (`q_heads / kv_heads`) up to 32.
    ///
    /// Errors: the shape's and options' validation errors ([`GpuError::Input`]: among them
    /// [`PisaError::HeadDim`] for a head dim outside the limits above, [`PisaError::Zero`] for a
    /// `q_tile` of 0); [`GpuError::Unsupported`] for a GQA group above 32, or f16 storage on a
    /// device opened without SHADER_F16; [`GpuError::Limit`] when a tensor
    /// of the call exceeds one storage binding (the host convenience
    /// [`super::prefill_host`] splits such calls by KV head; plan per head group instead);
    /// device errors.
    pub fn new(ctx: &Context, shape: &AttentionShape, opts: &PrefillOptions) -> Result<Self> {
        let _call = ctx.public_call()?;
        let (shape, opts) = Self::checked(ctx, shape, opts)?;
        let st = opts.storage;
        let staging = [
            ctx.alloc("plan q", shape.q_elems(), st, POISON_F32)?,
            ctx.alloc("plan k", shape.kv_elems(), st, POISON_F32)?,
            ctx.alloc("plan v", shape.kv_elems(), st, POISON_F32)?,
        ];
        let plan = Self::unrecorded(ctx, shape, opts, Some(staging));
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let staged = plan.staging.as_ref().map(|[q, k, v]| [q, k, v]);
        let staged = staged.expect("made with staging");
        let bhnd = QkvLayouts::from(TensorLayout::Bhnd);
        ctx.scope_now("prefill plan", || {
            let io = RunIo {
                out: None,
                last_kv: None,
            };
            plan.record(&mut enc, None, staged, bhnd, io).map(|_| ())
        })?;
        drop(enc);
        Ok(plan)
    }

    /// Plans a prefill that reads Q, K and V **in place only**: the plan holds no staging of
    /// the inputs (at 256K tokens, 32 query and 8 KV heads of 128 f16, that is 3 GiB less than
    /// [`Self::new`]), and, with [`PlanViews::out`], no O either (2 GiB more; the kernels write
    /// the caller's O directly, no copy). `views` are the caller's
    /// ([How the inputs are read](PrefillPlan#how-the-inputs-are-read)); the prefill is
    /// recorded once with them (pipelines, intermediates and bind groups made here, as by
    /// [`Self::new`]). Every later [`Self::run`] must be given views the kernels can read (and,
    /// with `out`, an O they can write) in place too: the same ones, or others of the same
    /// shape and dtype (the next layer's QKV projection, say); one that would need a gather or
    /// a copy is a [`GpuError::View`]. The decode take-over
    /// ([`crate::ops::decode::KvCache::record_prefill_from_plan`]) gathers the keys and values
    /// from the views the last run read.
    ///
    /// Errors: as [`Self::new`], and [`GpuError::View`] for a view of the wrong shape, one the
    /// kernels cannot read or write in place, or an O in the buffer of Q, K or V (wgpu binds a
    /// buffer either read-only or writable in one dispatch); the message says why.
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context, q: &pisa_wgpu::TensorView, k: &pisa_wgpu::TensorView,
    /// #      v: &pisa_wgpu::TensorView, o: &pisa_wgpu::TensorView, lse: &pisa_wgpu::TensorView)
    /// #      -> pisa_wgpu::Result<()> {
    /// use pisa_core::{AttentionShape, SelectionConfig};
    /// use pisa_wgpu::ops::prefill::{PlanViews, PrefillOptions, PrefillOutputs, PrefillPlan};
    /// let shape = AttentionShape::prefill(1, 32, 8, 4096, 128)?;
    /// let opts = PrefillOptions { cfg: SelectionConfig::new(64, 16)?, ..Default::default() };
    /// // q, k, v: views of a packed QKV projection at aligned offsets; o in another buffer.
    /// let views = PlanViews { q, k, v, out: Some(o) };
    /// let plan = PrefillPlan::new_in_place(ctx, &shape, &opts, &views)?;
    /// let mut enc = ctx.device().create_command_encoder(&Default::default());
    /// plan.run(&mut enc, q, k, v, &PrefillOutputs { out: o, lse, selection: None }, None)?;
    /// ctx.queue().submit([enc.finish()]);
    /// # Ok(()) }
    /// ```
    pub fn new_in_place(
        ctx: &Context,
        shape: &AttentionShape,
        opts: &PrefillOptions,
        views: &PlanViews<'_>,
    ) -> Result<Self> {
        let _call = ctx.public_call()?;
        let (shape, opts) = Self::checked(ctx, shape, opts)?;
        let mut plan = Self::unrecorded(ctx, shape, opts, None);
        plan.out_in_place = views.out.is_some();
        let (qt, kt, vt, layouts) = plan.in_place_inputs(views.q, views.k, views.v)?;
        let out = match views.out {
            Some(o) => Some(plan.out_target(o, [views.q, views.k, views.v])?),
            None => None,
        };
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        ctx.scope_now("prefill plan", || {
            let io = RunIo {
                out: out.as_ref(),
                last_kv: None,
            };
            plan.record(&mut enc, None, [&qt, &kt, &vt], layouts, io)
                .map(|_| ())
        })?;
        drop(enc);
        Ok(plan)
    }

    /// `out` as the kernels write it in place. Errors: [`GpuError::View`] for a view of the
    /// wrong shape or dtype, one they cannot address, or one in the buffer of an input.
    fn out_target(&self, out: &TensorView, inputs: [&TensorView; 3]) -> Result<OutTarget> {
        let s = &self.shape;
        check_shape("output", out, [s.batch, s.q_heads, s.q_len, s.head_dim])?;
        let st = self.opts.storage.output();
        let (o, layout) = in_place(&self.ctx, out, st).ok_or_else(|| {
            GpuError::View(format!(
                "output: this plan writes O in place (PrefillPlan::new_in_place with PlanViews::out), and this view cannot be: it must be {:?} (the output type of {:?} storage), head dim contiguous, its other strides multiples of 8 elements, its byte offset a multiple of {} and its span within one binding",
                DType::from(st),
                self.opts.storage,
                (self.ctx.limits().min_storage_buffer_offset_alignment as u64).max(4)
            ))
        })?;
        if inputs.iter().any(|v| v.buffer() == out.buffer()) {
            return Err(GpuError::View(
                "output: O is written in place and lies in the buffer of Q, K or V: a dispatch binds a buffer either read-only or writable, so put O in another buffer".into(),
            ));
        }
        Ok(OutTarget { o, layout })
    }

    /// The checked shape and options of a plan (`layout` set to BHND: unused).
    fn checked(
        ctx: &Context,
        shape: &AttentionShape,
        opts: &PrefillOptions,
    ) -> Result<(AttentionShape, PrefillOptions)> {
        let shape = super::validated(shape, opts)?;
        if opts.q_tile == 0 {
            return Err(pisa_core::PisaError::Zero { what: "q_tile" }.into());
        }
        let units = super::chunks::units_per_chunk(ctx, &shape, opts)?;
        if units < shape.batch * shape.kv_heads {
            return Err(GpuError::Limit {
                what: format!(
                    "a planned prefill of {} tokens (its buffers in one storage binding each)",
                    shape.k_len
                ),
                needed: (shape.batch * shape.kv_heads) as u64,
                limit: units as u64,
                unit: "(batch, KV head) pairs",
                hint: "plan fewer KV heads per call (at most the number that fits one binding)",
            });
        }
        let opts = PrefillOptions {
            layout: TensorLayout::Bhnd,
            ..*opts
        };
        Ok((shape, opts))
    }

    /// A plan with nothing recorded yet.
    fn unrecorded(
        ctx: &Context,
        shape: AttentionShape,
        opts: PrefillOptions,
        staging: Option<[GpuTensor; 3]>,
    ) -> Self {
        Self {
            ctx: ctx.clone(),
            shape,
            opts,
            knobs: PrefillKnobs::of(ctx),
            binding: ctx.max_binding_bytes(),
            staging,
            out_in_place: false,
            arena: Default::default(),
            last_kv: Default::default(),
            pyramid: Default::default(),
        }
    }

    /// `q`, `k`, `v` as the kernels read them in place, with their layouts: checked against
    /// the plan's shape and the rule of [How the inputs are read](PrefillPlan#how-the-inputs-are-read).
    /// Errors: [`GpuError::View`] saying which view does not qualify.
    fn in_place_inputs(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
    ) -> Result<(GpuTensor, GpuTensor, GpuTensor, QkvLayouts)> {
        let s = &self.shape;
        let (b, hq, hkv, d) = (s.batch, s.q_heads, s.kv_heads, s.head_dim);
        check_shape("q", q, [b, hq, s.q_len, d])?;
        check_shape("k", k, [b, hkv, s.k_len, d])?;
        check_shape("v", v, [b, hkv, s.k_len, d])?;
        in_place_qkv(&self.ctx, self.opts.storage, q, k, v)
    }

    /// What a decode cache takes over of batch entry `batch` after a run: contiguous BHND K
    /// and V (`[B', Hkv, N, D]` in the plan's storage), the entry of those that holds `batch`'s
    /// keys and values, and the key pyramid's means and second moments (`[B*Hkv, nodes of N,
    /// D]` f32, the layout of N). Their contents are those of the last recorded run once it has
    /// executed. When that run gathered K and V, they are the plan's staging; when it read them
    /// in place, entry `batch` of the caller's views is gathered (recorded into `enc`) into
    /// entry 0 of the staging, or, for a plan without staging ([`Self::new_in_place`]), into
    /// new `[1, Hkv, N, D]` tensors: the views must then still hold the run's keys and values
    /// when `enc` executes.
    #[allow(clippy::type_complexity)]
    pub(crate) fn parts(
        &self,
        enc: &mut wgpu::CommandEncoder,
        batch: usize,
    ) -> Result<(
        GpuTensor,
        GpuTensor,
        Option<(wgpu::Buffer, Option<wgpu::Buffer>)>,
        usize,
    )> {
        // Held while both are read: a run sets them together under the arena's lock.
        let _arena = self.arena.lock().unwrap_or_else(|p| p.into_inner());
        let last = self
            .last_kv
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                GpuError::Unsupported(
                    "the plan has no keys to take over: record its run first".into(),
                )
            })?;
        let pyr = self
            .pyramid
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if pyr.is_none() {
            return Err(GpuError::Unsupported(
                "the plan has no pyramid to take over: record its run first".into(),
            ));
        }
        let st = self.opts.storage;
        let (k, v, entry) = match (last, &self.staging) {
            (None, Some([_, k, v])) => (k.alias(), v.alias(), batch),
            // (A plan without staging reads K and V in place on every run.)
            (None, None) => {
                return Err(GpuError::Unsupported(
                    "the plan has no keys to take over: record its run first".into(),
                ))
            }
            (Some(InPlaceKv { overwritten_by: Some(o), .. }), _) => {
                return Err(GpuError::View(format!(
                    "the plan's last run read K and V in place and wrote its {o} over their bytes, so its keys and values are gone: give that run outputs apart from K and V, or load the cache from the keys and values (KvCache::record_prefill_view)"
                )))
            }
            (Some(InPlaceKv { k: kv, v: vv, .. }), staging) => {
                let (k, v) = match staging {
                    Some([_, k, v]) => (k.alias(), v.alias()),
                    None => {
                        let n = self.shape.kv_elems() / self.shape.batch;
                        (
                            self.ctx.scratch("take-over keys", n, st)?,
                            self.ctx.scratch("take-over values", n, st)?,
                        )
                    }
                };
                record_gather(&self.ctx, enc, &batch_entry(&kv, batch)?, &k.buffer, st)?;
                record_gather(&self.ctx, enc, &batch_entry(&vv, batch)?, &v.buffer, st)?;
                (k, v, 0)
            }
        };
        Ok((k, v, pyr, entry))
    }

    /// Whether [`Self::run`] reads `view` in place (no copy) rather than gathering it into the
    /// plan's staging: see [How the inputs are read](PrefillPlan#how-the-inputs-are-read) for
    /// the rule. (K and V are read in place only when both are, with the same strides:
    /// [`Self::reads_in_place_qkv`] applies that too.) It looks at how the view lies in its
    /// buffer, not at its shape: a view of the wrong shape is refused by [`Self::run`].
    pub fn reads_in_place(&self, view: &TensorView) -> bool {
        in_place(&self.ctx, view, self.opts.storage).is_some()
    }

    /// Whether [`Self::run`] with these inputs reads each of Q, K and V in place, as it will
    /// decide: `[q, k, v]`. Unlike [`Self::reads_in_place`] of each view alone, it applies the
    /// rule that K and V are read in place only together (both qualifying, with the same
    /// strides), so a V that qualifies beside a K that does not is reported as gathered.
    pub fn reads_in_place_qkv(&self, q: &TensorView, k: &TensorView, v: &TensorView) -> [bool; 3] {
        let st = self.opts.storage;
        let kv = match (in_place(&self.ctx, k, st), in_place(&self.ctx, v, st)) {
            (Some(k), Some(v)) => k.1 == v.1,
            _ => false,
        };
        [in_place(&self.ctx, q, st).is_some(), kv, kv]
    }

    /// Whether the context still runs the kernels this plan recorded: the knobs of its stages
    /// ([`PrefillKnobs`]) and its binding limit are those of the plan's making.
    pub(crate) fn current(&self) -> bool {
        let ctx = &self.ctx;
        PrefillKnobs::of(ctx) == self.knobs && ctx.max_binding_bytes() == self.binding
    }

    /// The planned shape.
    pub fn shape(&self) -> &AttentionShape {
        &self.shape
    }
    /// The planned options (`layout` is BHND, and unused: the views carry their strides).
    pub fn options(&self) -> &PrefillOptions {
        &self.opts
    }

    /// Records the prefill into `enc`: reads `q` (`[B, Hq, Nq, D]`), `k`, `v` (`[B, Hkv, Nk, D]`)
    /// from the caller's views (any strides, f32/f16/bf16), in place where the kernels can
    /// address them and gathered into the plan's staging otherwise (see [How the inputs are
    /// read](PrefillPlan#how-the-inputs-are-read)), runs the planned prefill and writes
    /// `outputs`. Stage times go to `prof` (the prefill's stages; the gathers and output
    /// copies are not timed). Nothing is submitted.
    ///
    /// Errors: [`GpuError::View`] for a view of the wrong shape, an output the plan cannot
    /// write, or, for a plan made by [`Self::new_in_place`], an input it cannot read in place;
    /// [`GpuError::Unsupported`] when a setting the prefill's kernels depend on changed since
    /// the plan was made (make a new plan): the kernel path, the leaf order, the NVIDIA kernels'
    /// switches, a prefill stage's knob of [`crate::Tuning`] (through [`Context::set_tuning`] and
    /// the switches that set it), or the binding limit; a change to the other knobs (the
    /// decode step's, for one) leaves the plan usable; [`GpuError::Validation`] for a buffer
    /// of another device, at every run that binds it, or a destroyed one that the run binds
    /// (an input; an output written in place or scattered) when it makes the bind group: a
    /// buffer destroyed after a run with the same views (whose bind groups the plan keeps),
    /// and an output the run only copies into (contiguous in a `COPY_DST` buffer), are checked
    /// by wgpu where the encoder is submitted, as every recorded copy is. (On wasm32 these
    /// errors go to the device's uncaptured-error handler instead: the browser's error scopes
    /// resolve later.) The views are checked
    /// before anything is recorded; an error found later (wgpu's own while recording, a replay
    /// that does not match the plan's recording, an output copy that fails) leaves part of the
    /// prefill recorded in `enc`: drop the encoder, unless it also holds commands of a decode
    /// cache (`KvCache`'s `record_*`), which must be submitted (`KvCache`, "Recorded
    /// commands"); then submit it and run the prefill again, as its outputs are unspecified.
    ///
    /// A plan keeps the bind groups of the views it ran on (up to 16 sets, see [`PrefillPlan`]'s
    /// docs), and with them references to the caller's buffers: their memory is freed when
    /// both the caller and the plan have dropped them.
    pub fn run(
        &self,
        enc: &mut wgpu::CommandEncoder,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        outputs: &PrefillOutputs<'_>,
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let ctx = &self.ctx;
        if !self.current() {
            return Err(GpuError::Unsupported(
                "the context's tuning (kernel path, leaf order, NVIDIA kernels, other knobs) or binding limit changed since this prefill was planned: make a new plan".into(),
            ));
        }
        let s = &self.shape;
        let (b, hq, hkv, nq, d, kk) = (
            s.batch,
            s.q_heads,
            s.kv_heads,
            s.q_len,
            s.head_dim,
            self.opts.cfg.top_k,
        );
        check_shape("q", q, [b, hq, nq, d])?;
        check_shape("k", k, [b, hkv, s.k_len, d])?;
        check_shape("v", v, [b, hkv, s.k_len, d])?;
        check_inputs([q, k, v], self.opts.storage)?;
        check_outputs(
            outputs,
            [b, hq, hkv, nq, d, kk],
            self.opts.storage,
            self.out_in_place,
        )?;
        let st = self.opts.storage;
        let q_in = in_place(ctx, q, st);
        let (k_in, v_in) = match (in_place(ctx, k, st), in_place(ctx, v, st)) {
            (Some(k), Some(v)) if k.1 == v.1 => (Some(k), Some(v)),
            _ => (None, None),
        };
        if self.staging.is_none() && (q_in.is_none() || k_in.is_none()) {
            // The typed error naming the view that would need a gather.
            self.in_place_inputs(q, k, v)?;
        }
        let out = match self.out_in_place {
            true => Some(self.out_target(outputs.out, [q, k, v])?),
            false => None,
        };
        ctx.scope_now("prefill", || {
            // The gathers and scatters bind the caller's views: their small parameter buffers
            // and bind groups are made per run (a constant few, whatever N); the prefill
            // itself replays the plan's arena, with the bind groups of in-place views among
            // its alternatives (runtime/arena.rs).
            let mut layouts = QkvLayouts::from(TensorLayout::Bhnd);
            let mut read = |view: &TensorView,
                            i: usize,
                            direct: Option<(GpuTensor, KernelLayout)>,
                            lay: &mut KernelLayout|
             -> Result<GpuTensor> {
                match (direct, &self.staging) {
                    (Some((t, l)), _) => {
                        *lay = l;
                        Ok(t)
                    }
                    (None, Some(staging)) => {
                        record_gather(ctx, enc, view, &staging[i].buffer, st)?;
                        Ok(staging[i].alias())
                    }
                    // Checked above: a plan without staging reads every input in place.
                    (None, None) => Err(GpuError::View("an input needs a gather".into())),
                }
            };
            let qt = read(q, 0, q_in, &mut layouts.q)?;
            let kv_in_place = k_in.is_some();
            let kt = read(k, 1, k_in, &mut layouts.k)?;
            let vt = read(v, 2, v_in, &mut layouts.v)?;
            let last = kv_in_place.then(|| InPlaceKv {
                k: k.clone(),
                v: v.clone(),
                overwritten_by: output_views(outputs)
                    .find(|(_, o)| o.overlaps(k) || o.overlaps(v))
                    .map(|(name, _)| name),
            });
            let run = RunIo {
                out: out.as_ref(),
                last_kv: Some(last),
            };
            let (o, lse, sel) = self.record(enc, prof, [&qt, &kt, &vt], layouts, run)?;
            // (O is of the kernels' output type: f32 for bf16 inputs; written in place already
            // when the plan writes the caller's O.)
            if out.is_none() {
                write_out(ctx, enc, &o.buffer, o.storage, outputs.out)?;
            }
            write_out(ctx, enc, &lse.buffer, Storage::F32, outputs.lse)?;
            if let Some(view) = outputs.selection {
                // i32 words: copied as they are (f32 storage is the 4-byte word kind).
                write_out(ctx, enc, &sel.buffer, Storage::F32, view)?;
            }
            Ok(())
        })
    }

    /// The prefill itself, inside the plan's arena (recording the first time).
    fn record(
        &self,
        enc: &mut wgpu::CommandEncoder,
        prof: Option<&mut Profiler>,
        qkv: [&GpuTensor; 3],
        layouts: QkvLayouts,
        io: RunIo<'_>,
    ) -> Result<(GpuTensor, GpuTensor, GpuTensor)> {
        let mut arena = self.arena.lock().unwrap_or_else(|p| p.into_inner());
        let (o, lse, sel, pyr) = with_arena(self.ctx.id(), &mut arena, || {
            let (s, opts) = (&self.shape, &self.opts);
            record_prefill_parts(&self.ctx, enc, qkv, layouts, s, opts, io.out, prof)
        })?;
        // Both set while the arena is held: a take-over sees the pyramid and K, V of one run.
        *self.pyramid.lock().unwrap_or_else(|p| p.into_inner()) = Some((
            pyr.means.buffer.clone(),
            pyr.sq.as_ref().map(|t| t.buffer.clone()),
        ));
        if let Some(last) = io.last_kv {
            *self.last_kv.lock().unwrap_or_else(|p| p.into_inner()) = Some(last);
        }
        Ok((o, lse, sel))
    }
}

/// What a recording writes besides its own buffers: the caller's O (`out`), and, for a run (not
/// the recording at planning), where its keys and values were read (for [`PrefillPlan::parts`]).
struct RunIo<'a> {
    out: Option<&'a OutTarget>,
    last_kv: Option<Option<InPlaceKv>>,
}

/// The caller's K and V views a run read in place, and which of its outputs (if any) it wrote
/// over their bytes: a run may (its outputs are copied out after the kernels), but then the
/// keys and values are gone for a take-over ([`PrefillPlan::parts`] refuses it).
#[derive(Debug, Clone)]
struct InPlaceKv {
    k: TensorView,
    v: TensorView,
    overwritten_by: Option<&'static str>,
}

/// What a prefill's recording depends on in the context's tuning: the kernel path, leaf order
/// and NVIDIA kernels in force, and the knobs of the route and leaf stages (not the decode
/// knobs, nor a switch that changes nothing on this device).
#[derive(Debug, Clone, PartialEq, Eq)]
struct PrefillKnobs {
    path: KernelPath,
    order: LeafOrder,
    nv: (bool, bool),
    stages: Tuning,
}

impl PrefillKnobs {
    fn of(ctx: &Context) -> Self {
        let t = ctx.tuning();
        let d = Tuning::default();
        // The switches of kernels this device does not run are left at their defaults.
        let nv_scorer = ctx.nv_cm2() && t.nv_scorer;
        let subgroups = ctx.features().contains(wgpu::Features::SUBGROUP);
        let stages = Tuning {
            leaf_tiles_per_iteration: t.leaf_tiles_per_iteration,
            leaf_subgroups: t.leaf_subgroups,
            leaf_stage_keys: t.leaf_stage_keys,
            leaf_score_pairs: if nv_scorer {
                t.leaf_score_pairs
            } else {
                d.leaf_score_pairs
            },
            attention_pairs: t.attention_pairs,
            route_lanes: t.route_lanes,
            route_max_workgroup: t.route_max_workgroup,
            route_tile: t.route_tile,
            route_subgroups: if subgroups {
                t.route_subgroups
            } else {
                d.route_subgroups
            },
            route_table_nodes: t.route_table_nodes,
            route_table_portable: t.route_table_portable,
            route_table_queries: t.route_table_queries,
            ..Tuning::default()
        };
        Self {
            path: ctx.kernel_path(),
            order: t.leaf_order,
            nv: (ctx.nv_cm2(), nv_scorer),
            stages,
        }
    }
}

fn check_shape(what: &str, view: &TensorView, shape: [usize; 4]) -> Result<()> {
    if view.shape() != shape {
        return Err(GpuError::View(format!(
            "{what}: expected shape {shape:?}, got {:?}",
            view.shape()
        )));
    }
    Ok(())
}

/// Batch entry `b` of `view`, as a view of batch 1. Errors as [`TensorView::new`] (none for an
/// entry of a valid view).
fn batch_entry(view: &TensorView, b: usize) -> Result<TensorView> {
    let [_, h, n, d] = view.shape();
    let s = view.strides();
    let offset = view.offset() + (b * s[0]) as u64 * view.dtype().bytes();
    TensorView::new(view.buffer(), offset, view.dtype(), [1, h, n, d], s)
}

/// `view` as the kernels read it in place, with its layout, or `None` when it must be gathered:
/// the rule of [How the inputs are read](PrefillPlan#how-the-inputs-are-read). Strides of
/// extent-1 dimensions are taken as 0 (they multiply 0).
fn in_place(
    ctx: &Context,
    view: &TensorView,
    storage: Storage,
) -> Option<(GpuTensor, KernelLayout)> {
    let shape = view.shape();
    let s = view.strides();
    let st = |i: usize| if shape[i] == 1 { 0 } else { s[i] };
    let align = (ctx.limits().min_storage_buffer_offset_alignment as u64).max(4);
    let layout = KernelLayout::Strided {
        batch: st(0),
        head: st(1),
        token: st(2),
    };
    let span = layout.span(shape[0], shape[1], shape[2], shape[3]);
    let bytes = (span as u64 * view.dtype().bytes()).div_ceil(4) * 4;
    let ok = view.dtype().storage() == Some(storage)
        && (shape[3] == 1 || s[3] == 1)
        && (0..3).all(|i| st(i) % 8 == 0)
        && view.offset().is_multiple_of(align)
        && view.offset() + bytes <= view.buffer().size()
        && bytes <= ctx.max_binding_bytes()
        && span <= u32::MAX as usize;
    ok.then(|| {
        let t = GpuTensor {
            buffer: view.buffer().clone(),
            len: span,
            storage,
            range: Some((view.offset(), bytes)),
        };
        (t, layout)
    })
}

/// The checks of a run's inputs before anything is recorded: floats, and what a gather into
/// the staging of storage `st` needs of them (a view that ends inside the last, partial 4-byte
/// word of its buffer is refused: a run that found it only at its gather had recorded the
/// gathers of the views before it, overwriting the staging that a decode take-over of the
/// previous run copies). A view the kernels read in place passes them too. Errors:
/// [`GpuError::View`] naming the view.
fn check_inputs([q, k, v]: [&TensorView; 3], st: Storage) -> Result<()> {
    for (what, view) in [("q", q), ("k", k), ("v", v)] {
        check_float_input(what, view)?;
        check_gather_src(what, view, st)?;
    }
    Ok(())
}

/// `cu_seqlens` of a varlen call (`keys`: the list is `cu_seqlens_k`, named so in the
/// errors): at least one sequence, from token 0, non-decreasing (an empty sequence repeats an
/// offset, as `flash_attn_varlen_func` takes it), and at least one token in all. Errors:
/// [`GpuError::Input`].
fn check_cu_seqlens(cu_seqlens: &[usize], keys: bool) -> Result<()> {
    use pisa_core::PisaError::{InvalidValue, Zero};
    let err = |e| Err(GpuError::Input(e));
    let pick = |q: &'static str, k: &'static str| if keys { k } else { q };
    if cu_seqlens.len() < 2 {
        return err(Zero {
            what: pick(
                "cu_seqlens: sequences (it holds n + 1 offsets)",
                "cu_seqlens_k: sequences (it holds n + 1 offsets)",
            ),
        });
    }
    if cu_seqlens[0] != 0 {
        return err(InvalidValue {
            what: pick(
                "cu_seqlens: the first offset must be 0",
                "cu_seqlens_k: the first offset must be 0",
            ),
        });
    }
    if cu_seqlens.windows(2).any(|w| w[1] < w[0]) {
        return err(InvalidValue {
            what: pick(
                "cu_seqlens: offsets must not decrease",
                "cu_seqlens_k: offsets must not decrease",
            ),
        });
    }
    if cu_seqlens[cu_seqlens.len() - 1] == 0 {
        return err(Zero {
            what: pick(
                "cu_seqlens: tokens of all sequences together",
                "cu_seqlens_k: tokens of all sequences together",
            ),
        });
    }
    Ok(())
}

/// `cu_seqlens_q` and `cu_seqlens_k` of a varlen call (equal lists for the calls without keys
/// of their own): each as [`check_cu_seqlens`], one offset of each per sequence, and no
/// sequence with fewer keys than queries. Errors: [`GpuError::Input`].
fn check_seqlens(cu_q: &[usize], cu_k: &[usize]) -> Result<()> {
    check_cu_seqlens(cu_q, false)?;
    check_cu_seqlens(cu_k, true)?;
    let bad = |what| Err(GpuError::Input(PisaError::InvalidValue { what }));
    if cu_k.len() != cu_q.len() {
        return bad("cu_seqlens_k: one offset per offset of cu_seqlens_q");
    }
    if cu_q
        .windows(2)
        .zip(cu_k.windows(2))
        .any(|(a, b)| b[1] - b[0] < a[1] - a[0])
    {
        return bad("cu_seqlens_k: a sequence has fewer keys than queries");
    }
    Ok(())
}

/// The checks of a run's outputs (`dims`: B, Hq, Hkv, Nq, D, K) before anything is recorded:
/// shapes and dtypes, the scatters that will write them (unless a buffer copy does; O not at all
/// when written in place), and no two of them sharing bytes. Errors: [`GpuError::View`].
fn check_outputs(
    outputs: &PrefillOutputs<'_>,
    [b, hq, hkv, n, d, kk]: [usize; 6],
    storage: Storage,
    out_in_place: bool,
) -> Result<()> {
    check_shape("output", outputs.out, [b, hq, n, d])?;
    check_shape("lse", outputs.lse, [b, hq, n, 1])?;
    if outputs.lse.dtype() != DType::F32 {
        return Err(GpuError::View(format!(
            "lse: must be f32, is {:?}",
            outputs.lse.dtype()
        )));
    }
    if let Some(sel) = outputs.selection {
        check_shape("selection", sel, [b, hkv, n, kk])?;
        if sel.dtype() != DType::I32 {
            return Err(GpuError::View(format!(
                "selection: must be i32, is {:?}",
                sel.dtype()
            )));
        }
    }
    if outputs.out.dtype() == DType::I32 {
        return Err(GpuError::View(
            "output: O must be f32, f16 or bf16, is I32".into(),
        ));
    }
    let scatters = |name: &str, st: Storage, dst: &TensorView| match copy_of(st, dst) {
        Some(_) => Ok(()),
        None => check_scatter_dst(name, st, dst),
    };
    if !out_in_place {
        scatters("output", storage.output(), outputs.out)?;
    }
    scatters("lse", Storage::F32, outputs.lse)?;
    if let Some(sel) = outputs.selection {
        scatters("selection", Storage::F32, sel)?;
    }
    check_disjoint_among(&output_views(outputs).collect::<Vec<_>>())
}

/// The named views of `outputs` (no allocation: a run's overlap check iterates them).
fn output_views<'a>(
    outputs: &PrefillOutputs<'a>,
) -> impl Iterator<Item = (&'static str, &'a TensorView)> {
    let named = [
        ("output", Some(outputs.out)),
        ("lse", Some(outputs.lse)),
        ("selection", outputs.selection),
    ];
    named.into_iter().filter_map(|(n, v)| v.map(|v| (n, v)))
}

/// `q`, `k`, `v` as the kernels read them in place from views of storage `st`, with their
/// layouts. Errors: [`GpuError::View`] saying which view does not qualify (the rule of [How the
/// inputs are read](PrefillPlan#how-the-inputs-are-read)).
fn in_place_qkv(
    ctx: &Context,
    st: Storage,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
) -> Result<(GpuTensor, GpuTensor, GpuTensor, QkvLayouts)> {
    let not_in_place = |what: &str| {
        GpuError::View(format!(
            "{what}: this plan reads its inputs in place only (PrefillPlan::new_in_place), and this view would need a gather: it must be of the plan's storage dtype ({:?}), head dim contiguous, its other strides multiples of 8 elements, its byte offset a multiple of {} and its span within one binding (K and V with equal strides); use PrefillPlan::new to gather other views",
            DType::from(st),
            (ctx.limits().min_storage_buffer_offset_alignment as u64).max(4)
        ))
    };
    let (qt, ql) = in_place(ctx, q, st).ok_or_else(|| not_in_place("q"))?;
    let (kt, kl) = in_place(ctx, k, st).ok_or_else(|| not_in_place("k"))?;
    let (vt, vl) = in_place(ctx, v, st).ok_or_else(|| not_in_place("v"))?;
    if kl != vl {
        return Err(not_in_place("k and v"));
    }
    let mut layouts = QkvLayouts::from(TensorLayout::Bhnd);
    (layouts.q, layouts.k, layouts.v) = (ql, kl, vl);
    Ok((qt, kt, vt, layouts))
}

/// `(byte offset, bytes)` of a view a buffer copy can write: contiguous BHND at a 4-byte
/// offset and a whole number of 4-byte words.
fn copy_range(view: &TensorView, shape: [usize; 4]) -> Option<(u64, u64)> {
    let bytes = view.elems() as u64 * view.dtype().bytes();
    let bhnd = (0..4).all(|i| {
        shape[i] == 1 || view.strides()[i] == contiguous_strides(shape, TensorLayout::Bhnd)[i]
    });
    (bhnd && view.offset().is_multiple_of(4) && bytes.is_multiple_of(4))
        .then_some((view.offset(), bytes))
}

/// Writes the plan's contiguous BHND `src` of `storage` into the caller's `dst`: a buffer
/// copy when `dst` is contiguous BHND of the same dtype at a 4-byte offset in a buffer with
/// `COPY_DST`, else a scatter. A `dst` the copy cannot write (another device's, or mapped) is
/// a [`GpuError::Validation`] with nothing recorded (through the zero-byte queue write below,
/// in an error scope of its own); a destroyed one is not caught there (wgpu's zero-byte write
/// does not check it) and fails where the encoder is submitted, as `PrefillPlan::run` says.
fn write_out(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    src: &wgpu::Buffer,
    storage: Storage,
    dst: &TensorView,
) -> Result<()> {
    // (a buffer without COPY_DST takes the scatter, which binds it as storage only)
    let copyable = dst.buffer().usage().contains(wgpu::BufferUsages::COPY_DST);
    match copy_of(storage, dst).filter(|_| copyable) {
        Some((off, bytes)) => {
            // wgpu validates a recorded copy only when the encoder finishes (the caller's
            // `finish`, outside pisa), while a bound buffer of another device fails at once
            // when its bind group is made. A zero-byte queue write to `dst` is validated at
            // once against this context's device (the buffer's device, usage and offset) and
            // writes and allocates nothing: it brings the copy's device check into the call.
            // (It also requires `dst` to be unmapped now, where the recorded copy needs that
            // only at submission: a mapped output buffer is refused here.)
            // In a scope of its own, so that a refused buffer returns before the copy is
            // recorded: a copy of another device's buffer in the caller's encoder would fail
            // its submit, and with it every command the encoder held (a decode cache's
            // appends recorded before this run, which its docs tell the app to submit).
            // (The error's op names the output copy: wgpu's message names the queue write.)
            ctx.scope_now(
                "prefill output copy (a buffer of another device, mapped or destroyed)",
                || {
                    ctx.queue.write_buffer(dst.buffer(), off, &[]);
                    Ok(())
                },
            )?;
            enc.copy_buffer_to_buffer(src, 0, dst.buffer(), off, bytes);
            Ok(())
        }
        None => record_scatter(ctx, enc, src, storage, dst),
    }
}

/// `(byte offset, bytes)` of the buffer copy that writes a contiguous BHND tensor of `storage`
/// into `dst`, when one can: `dst` contiguous BHND of the same dtype (i32 taking f32 storage's
/// words) at a 4-byte offset; `None` when it takes a scatter.
fn copy_of(storage: Storage, dst: &TensorView) -> Option<(u64, u64)> {
    let same = dst.dtype() == DType::from(storage)
        || (dst.dtype() == DType::I32 && storage == Storage::F32);
    copy_range(dst, dst.shape()).filter(|_| same)
}

/// A varlen prefill (as `flash_attn_varlen_func`): a batch of sequences packed along the token
/// dimension, sequence `i` being tokens `cu_seqlens[i] .. cu_seqlens[i + 1]` of the views, each
/// attending causally to itself only ([`VarlenPrefillPlan::run`]), or each sequence's queries
/// over keys of their own ([`VarlenPrefillPlan::run_with_keys`], `cu_seqlens_k`). One
/// [`PrefillPlan`] per distinct (queries, keys) pair of a sequence, made on first use (or ahead
/// with [`VarlenPrefillPlan::prepare`]) and kept; a run records every sequence's plan over its
/// token ranges of the caller's views ([`TensorView::tokens`]). Made with
/// [`VarlenPrefillPlan::new_in_place`], its plans hold no staging ([`PrefillPlan::new_in_place`]).
///
/// # Memory
///
/// Each kept plan holds the buffers of its shape (its staging of Q, K and V, unless made in
/// place, and its intermediates: at 128K tokens, 32 query and 8 KV heads of 128 in f16, about
/// 1.5 GiB of staging alone). At most [`VarlenPrefillPlan::DEFAULT_KEPT_PLANS`] plans are kept
/// ([`VarlenPrefillPlan::with_kept_plans`] sets another bound): past it, making a plan drops
/// the least recently used one (its buffers are freed once the work recorded with them has
/// run), so a chunked prefill whose key count grows every call does not grow GPU memory
/// without end. A run over more distinct pairs than the bound makes some plans again on every
/// run: same results, the cost of planning each time.
#[derive(Debug)]
pub struct VarlenPrefillPlan {
    ctx: Context,
    heads: (usize, usize, usize),
    opts: PrefillOptions,
    /// Plans read their inputs in place only (made at their first run, from its views).
    in_place: bool,
    plans: std::sync::Mutex<KeptPlans>,
}

/// The plans of a [`VarlenPrefillPlan`] by (query tokens, key tokens) of a sequence, each with
/// the tick of its last use, at most `max` of them (the least recently used dropped first).
#[derive(Debug)]
struct KeptPlans {
    plans: std::collections::BTreeMap<(usize, usize), (std::sync::Arc<PrefillPlan>, u64)>,
    tick: u64,
    max: usize,
}

impl KeptPlans {
    fn new(max: usize) -> Self {
        Self {
            plans: Default::default(),
            tick: 0,
            max: max.max(1),
        }
    }

    /// The plan of `key` when it is kept and `fresh`, marked used.
    fn get(
        &mut self,
        key: (usize, usize),
        fresh: impl Fn(&PrefillPlan) -> bool,
    ) -> Option<std::sync::Arc<PrefillPlan>> {
        self.tick += 1;
        let tick = self.tick;
        let (p, used) = self.plans.get_mut(&key).filter(|(p, _)| fresh(p))?;
        *used = tick;
        Some(p.clone())
    }

    /// Keeps `plan` for `key`, dropping the least recently used plans past the bound.
    fn insert(&mut self, key: (usize, usize), plan: std::sync::Arc<PrefillPlan>) {
        self.tick += 1;
        self.plans.insert(key, (plan, self.tick));
        while self.plans.len() > self.max {
            let oldest = self.plans.iter().min_by_key(|(_, (_, used))| *used);
            let Some((&k, _)) = oldest else { break };
            self.plans.remove(&k);
        }
    }
}

impl VarlenPrefillPlan {
    /// A varlen prefill of `q_heads` (Hq) query heads, `kv_heads` (Hkv) KV heads of `head_dim`
    /// (D) with `opts`. Errors: the options' and heads' validation errors ([`PisaError::Zero`]
    /// for a `q_tile` of 0 included),
    /// [`PisaError::HeadDim`](pisa_core::PisaError::HeadDim) for a head dim the attention
    /// kernels do not take, and [`GpuError::Unsupported`] for more than 32 query heads per KV
    /// head or f16 storage on a device without `SHADER_F16` (as [`PrefillPlan::new`]), before
    /// any run.
    pub fn new(
        ctx: &Context,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        opts: &PrefillOptions,
    ) -> Result<Self> {
        opts.cfg.validate()?;
        if opts.q_tile == 0 {
            return Err(PisaError::Zero { what: "q_tile" }.into());
        }
        AttentionShape::prefill(1, q_heads, kv_heads, 1, head_dim)?;
        crate::ops::attention::check_head_dim(head_dim)?;
        crate::ops::route::check_query_group(q_heads / kv_heads)?;
        // (as PrefillPlan::new refuses it: not first at a run, as the plans' allocation)
        if opts.storage == Storage::F16 && !ctx.has_f16() {
            return Err(ctx.no_f16(" for a varlen prefill plan"));
        }
        Ok(Self {
            ctx: ctx.clone(),
            heads: (q_heads, kv_heads, head_dim),
            opts: *opts,
            in_place: false,
            plans: std::sync::Mutex::new(KeptPlans::new(Self::DEFAULT_KEPT_PLANS)),
        })
    }

    /// How many sequence plans a varlen plan keeps unless told otherwise (see
    /// [Memory](VarlenPrefillPlan#memory)).
    pub const DEFAULT_KEPT_PLANS: usize = 8;

    /// This plan keeping at most `max` sequence plans (a `max` of 0 keeps 1: the plan a run
    /// is using; see
    /// [Memory](VarlenPrefillPlan#memory)): the number of distinct (queries, keys) pairs of a
    /// batch, to plan each only once, or fewer, to bound the memory held between runs.
    pub fn with_kept_plans(self, max: usize) -> Self {
        let plans = KeptPlans::new(max);
        Self {
            plans: std::sync::Mutex::new(plans),
            ..self
        }
    }

    /// The number of sequence plans kept now (at most the bound of
    /// [Memory](VarlenPrefillPlan#memory)).
    pub fn kept_plans(&self) -> usize {
        self.plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .plans
            .len()
    }

    /// [`Self::new`] for views read in place only: each sequence's plan is a
    /// [`PrefillPlan::new_in_place`] (no staging of Q, K and V), made at the first run that
    /// meets that sequence's shape, from that run's views of the sequence; a run whose views the kernels
    /// cannot read in place is a [`GpuError::View`]. [`Self::prepare`] is refused (a plan needs
    /// views to be made). Errors: as [`Self::new`].
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context, q: &pisa_wgpu::TensorView, k: &pisa_wgpu::TensorView,
    /// #      v: &pisa_wgpu::TensorView, o: &pisa_wgpu::TensorView, lse: &pisa_wgpu::TensorView)
    /// #      -> pisa_wgpu::Result<()> {
    /// use pisa_core::SelectionConfig;
    /// use pisa_wgpu::{PrefillOptions, PrefillOutputs, VarlenPrefillPlan};
    /// let opts = PrefillOptions { cfg: SelectionConfig::new(64, 16)?, ..Default::default() };
    /// // q, k, v: a packed QKV projection [T, Hq + 2 Hkv, D] whose sequences start on binding
    /// // boundaries (a token row of (Hq + 2 Hkv) * D elements a multiple of 256 bytes).
    /// let varlen = VarlenPrefillPlan::new_in_place(ctx, 32, 8, 128, &opts)?;
    /// let outs = PrefillOutputs { out: o, lse, selection: None };
    /// let mut enc = ctx.device().create_command_encoder(&Default::default());
    /// varlen.run(&mut enc, &[0, 1024, 3072], q, k, v, &outs, None)?;
    /// ctx.queue().submit([enc.finish()]);
    /// # Ok(()) }
    /// ```
    pub fn new_in_place(
        ctx: &Context,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        opts: &PrefillOptions,
    ) -> Result<Self> {
        Ok(Self {
            in_place: true,
            ..Self::new(ctx, q_heads, kv_heads, head_dim, opts)?
        })
    }

    /// Makes the plans of these sequence lengths now, each of its queries over its own keys as
    /// [`Self::run`] has them (a run with a length not planned yet makes its plan then:
    /// allocation and pipeline builds on that run); a length of 0 (an empty sequence, which a
    /// run skips) needs none. Only the last lengths within the bound of kept plans stay
    /// ([Memory](VarlenPrefillPlan#memory)). Errors: as
    /// [`PrefillPlan::new`]; [`GpuError::Unsupported`] for a plan made by
    /// [`Self::new_in_place`].
    pub fn prepare(&self, lengths: &[usize]) -> Result<()> {
        let shapes: Vec<(usize, usize)> = lengths.iter().map(|&n| (n, n)).collect();
        self.prepare_with_keys(&shapes)
    }

    /// [`Self::prepare`] for [`Self::run_with_keys`]: makes the plans of these (queries, keys)
    /// sequence shapes now, each sequence's queries the last of its keys (`queries <= keys`).
    /// A shape without queries (a sequence a run skips, or whose keys only go to a decode
    /// cache) needs none. Errors: [`GpuError::Input`] for a shape with more queries than keys
    /// (as [`AttentionShape::new`]), checked before any plan is made; otherwise as
    /// [`Self::prepare`].
    pub fn prepare_with_keys(&self, shapes: &[(usize, usize)]) -> Result<()> {
        let _call = self.ctx.public_call()?;
        if self.in_place {
            return Err(GpuError::Unsupported(
                "VarlenPrefillPlan::prepare on a plan made by new_in_place: its plans are made at their first run, from the run's views".into(),
            ));
        }
        // Every shape checked before any plan is made.
        let (hq, hkv, d) = self.heads;
        for &(nq, nk) in shapes.iter().filter(|&&(nq, _)| nq > 0) {
            AttentionShape::new(1, hq, hkv, nq, nk, d)?;
        }
        for &(nq, nk) in shapes.iter().filter(|&&(nq, _)| nq > 0) {
            self.plan(nq, nk, None)?;
        }
        Ok(())
    }

    /// The plan of a sequence of `nq` queries over `nk` keys, made if missing (in place from
    /// `views`, for a plan made by [`Self::new_in_place`]).
    fn plan(
        &self,
        nq: usize,
        nk: usize,
        views: Option<[&TensorView; 3]>,
    ) -> Result<std::sync::Arc<PrefillPlan>> {
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        // A plan made before the context's kernel switches changed is made again.
        if let Some(p) = plans.get((nq, nk), PrefillPlan::current) {
            return Ok(p);
        }
        let (hq, hkv, d) = self.heads;
        let shape = AttentionShape::new(1, hq, hkv, nq, nk, d)?;
        let p = match (self.in_place, views) {
            (true, Some([q, k, v])) => {
                let views = PlanViews { q, k, v, out: None };
                PrefillPlan::new_in_place(&self.ctx, &shape, &self.opts, &views)?
            }
            (true, None) => {
                return Err(GpuError::Unsupported(
                    "an in-place varlen plan is made from a run's views".into(),
                ))
            }
            (false, _) => PrefillPlan::new(&self.ctx, &shape, &self.opts)?,
        };
        let p = std::sync::Arc::new(p);
        plans.insert((nq, nk), p.clone());
        Ok(p)
    }

    /// Records the prefill of every sequence into `enc`. `q` `[1, Hq, T, D]`, `k`, `v`
    /// `[1, Hkv, T, D]` (any strides and dtype, e.g. `[T, H, D]` packed rows), the outputs
    /// `[1, Hq, T, D]`, `[1, Hq, T, 1]` and the optional selection `[1, Hkv, T, K]` over the
    /// same T = `cu_seqlens[last]` tokens; `cu_seqlens` `[n + 1]`, starting at 0,
    /// non-decreasing (an empty sequence repeats an offset and is skipped), T at least 1. The
    /// outputs must not share bytes with the inputs or with each other
    /// (sequence `i`'s are written before sequence `i + 1`'s inputs are read). Errors:
    /// [`GpuError::View`] for views whose token count is not T or whose other dimensions do not
    /// match, outputs that share bytes with inputs or each other, an input of i32;
    /// [`pisa_core::PisaError`] input errors for `cu_seqlens` (fewer than 2 entries, not
    /// starting at 0, decreasing, no tokens at all); those of
    /// [`PrefillPlan::run`] (and, for a plan made by [`Self::new_in_place`], of
    /// [`PrefillPlan::new_in_place`] when a sequence's plan is made).
    #[allow(clippy::too_many_arguments)] // flash_attn_varlen_func's arguments, plus the encoder
    pub fn run(
        &self,
        enc: &mut wgpu::CommandEncoder,
        cu_seqlens: &[usize],
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        outputs: &PrefillOutputs<'_>,
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let cu = [cu_seqlens, cu_seqlens];
        self.run_to(enc, cu, [q, k, v], outputs, None, prof)
    }

    /// [`Self::run`] with the keys of each sequence apart from its queries (as
    /// `flash_attn_varlen_func` with `cu_seqlens_k`): sequence `i` has the queries
    /// `cu_seqlens_q[i] .. cu_seqlens_q[i + 1]` of `q` and the keys and values
    /// `cu_seqlens_k[i] .. cu_seqlens_k[i + 1]` of `k` and `v`, at least as many keys as
    /// queries, the queries being the last of its key positions (a prompt chunk over the keys
    /// of its earlier chunks and its own: [`PrefillPlan::new`] over a prefix). Sequences with
    /// no queries are skipped. One plan per distinct (queries, keys) pair, made on first use.
    /// `q` `[1, Hq, Tq, D]`, `k`, `v` `[1, Hkv, Tk, D]`, the outputs `[1, Hq, Tq, D]`,
    /// `[1, Hq, Tq, 1]` and the optional selection `[1, Hkv, Tq, K]`, with Tq and Tk the last
    /// offsets. Errors: those of [`Self::run`] for either offset list;
    /// [`PisaError::InvalidValue`] when the lists differ in length or a sequence has fewer keys
    /// than queries.
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context, q: &pisa_wgpu::TensorView, k: &pisa_wgpu::TensorView,
    /// #      v: &pisa_wgpu::TensorView, o: &pisa_wgpu::TensorView, lse: &pisa_wgpu::TensorView)
    /// #      -> pisa_wgpu::Result<()> {
    /// use pisa_core::SelectionConfig;
    /// use pisa_wgpu::{PrefillOptions, PrefillOutputs, VarlenPrefillPlan};
    /// let opts = PrefillOptions { cfg: SelectionConfig::new(64, 16)?, ..Default::default() };
    /// let varlen = VarlenPrefillPlan::new(ctx, 32, 8, 128, &opts)?;
    /// // Two sequences: 512 new queries over 4096 keys, then 300 queries over their own 300.
    /// let (cu_q, cu_k) = ([0, 512, 812], [0, 4096, 4396]);
    /// let outs = PrefillOutputs { out: o, lse, selection: None };
    /// let mut enc = ctx.device().create_command_encoder(&Default::default());
    /// varlen.run_with_keys(&mut enc, &cu_q, &cu_k, q, k, v, &outs, None)?;
    /// ctx.queue().submit([enc.finish()]);
    /// # Ok(()) }
    /// ```
    #[allow(clippy::too_many_arguments)] // flash_attn_varlen_func's arguments, plus the encoder
    pub fn run_with_keys(
        &self,
        enc: &mut wgpu::CommandEncoder,
        cu_seqlens_q: &[usize],
        cu_seqlens_k: &[usize],
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        outputs: &PrefillOutputs<'_>,
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let cu = [cu_seqlens_q, cu_seqlens_k];
        self.run_to(enc, cu, [q, k, v], outputs, None, prof)
    }

    /// [`Self::run`], then each sequence `i` loaded into sequence `seqs[i]` of the decode
    /// `cache` right after its prefill ([`KvCache::record_prefill_from_plan`]: its keys, values
    /// and key pyramid, no pyramid build), all recorded into `enc`: the varlen prefill of a
    /// batch hands over to decode. (Sequences of one length share a plan, whose buffers the next
    /// one's run reuses: each take-over is recorded before that next run, so it copies its own
    /// sequence's.) The cache must match the plan's KV heads, head dim, storage, block size,
    /// merge factor and scoring, and hold `seqs.len()` sequences of these lengths.
    ///
    /// Errors: those of [`Self::run`]; [`PisaError::InvalidValue`] when `seqs` does not have one
    /// entry per sequence, or names a sequence twice; those of
    /// [`KvCache::record_prefill_from_plan`] (a cache that does not match, a sequence or length
    /// past its own), checked before anything is recorded.
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context, q: &pisa_wgpu::TensorView, k: &pisa_wgpu::TensorView,
    /// #      v: &pisa_wgpu::TensorView, o: &pisa_wgpu::TensorView, lse: &pisa_wgpu::TensorView)
    /// #      -> pisa_wgpu::Result<()> {
    /// use pisa_core::SelectionConfig;
    /// use pisa_wgpu::{KvCache, PrefillOptions, PrefillOutputs, Storage, VarlenPrefillPlan};
    /// let opts = PrefillOptions { cfg: SelectionConfig::new(64, 16)?, ..Default::default() };
    /// let varlen = VarlenPrefillPlan::new(ctx, 32, 8, 128, &opts)?;
    /// let mut cache = KvCache::new(ctx, 3, 1 << 16, 32, 8, 128, opts.cfg, Storage::F32)?;
    /// // Three sequences of 1000, 700 and 1000 tokens packed along q, k, v's token dimension,
    /// // loaded into cache sequences 0, 1 and 2.
    /// let cu = [0, 1000, 1700, 2700];
    /// let outs = PrefillOutputs { out: o, lse, selection: None };
    /// let mut enc = ctx.device().create_command_encoder(&Default::default());
    /// varlen.run_into_cache(&mut enc, &cu, q, k, v, &outs, &mut cache, &[0, 1, 2], None)?;
    /// ctx.queue().submit([enc.finish()]);
    /// # Ok(()) }
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn run_into_cache(
        &self,
        enc: &mut wgpu::CommandEncoder,
        cu_seqlens: &[usize],
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        outputs: &PrefillOutputs<'_>,
        cache: &mut KvCache,
        seqs: &[usize],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let cu = [cu_seqlens, cu_seqlens];
        self.run_to_cache(enc, cu, [q, k, v], outputs, cache, seqs, prof)
    }

    /// [`Self::run_with_keys`], then each sequence `i` loaded into sequence `seqs[i]` of the
    /// decode `cache` with all its keys, as [`Self::run_into_cache`] does (a sequence with keys
    /// and no queries is loaded from its keys and values, [`KvCache::record_prefill_view`]: a
    /// pyramid build; one with neither empties its cache sequence). The cache sequence then
    /// holds `cu_seqlens_k[i + 1] - cu_seqlens_k[i]` tokens. Errors: those of
    /// [`Self::run_with_keys`] and [`Self::run_into_cache`], checked before anything is
    /// recorded.
    #[allow(clippy::too_many_arguments)]
    pub fn run_with_keys_into_cache(
        &self,
        enc: &mut wgpu::CommandEncoder,
        cu_seqlens_q: &[usize],
        cu_seqlens_k: &[usize],
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        outputs: &PrefillOutputs<'_>,
        cache: &mut KvCache,
        seqs: &[usize],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        let cu = [cu_seqlens_q, cu_seqlens_k];
        self.run_to_cache(enc, cu, [q, k, v], outputs, cache, seqs, prof)
    }

    /// The checks of a run into `cache`, then the run ([`Self::run_to`]).
    #[allow(clippy::too_many_arguments)]
    fn run_to_cache(
        &self,
        enc: &mut wgpu::CommandEncoder,
        [cu_q, cu_k]: [&[usize]; 2],
        qkv: [&TensorView; 3],
        outputs: &PrefillOutputs<'_>,
        cache: &mut KvCache,
        seqs: &[usize],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        check_seqlens(cu_q, cu_k)?;
        let n_seqs = cu_q.len() - 1;
        if seqs.len() != n_seqs {
            return Err(GpuError::Input(PisaError::InvalidValue {
                what:
                    "seqs: one cache sequence per prefilled sequence (cu_seqlens.len() - 1 of them)",
            }));
        }
        if (1..seqs.len()).any(|i| seqs[..i].contains(&seqs[i])) {
            return Err(GpuError::Input(PisaError::InvalidValue {
                what: "seqs: a cache sequence named twice",
            }));
        }
        let (hq, hkv, d) = self.heads;
        for (i, (a, b)) in cu_q.windows(2).zip(cu_k.windows(2)).enumerate() {
            let (nq, nk) = (a[1] - a[0], b[1] - b[0]);
            if nq == 0 {
                // An empty sequence empties its cache sequence (checked as a reset is); one of
                // keys only is loaded from them (checked as that load is).
                cache.check_seq(seqs[i])?;
                cache.check_prefill_len(nk)?;
                continue;
            }
            let shape = AttentionShape::new(1, hq, hkv, nq, nk, d)?;
            cache.check_plan(&self.ctx, &shape, &self.opts, seqs[i], 0)?;
        }
        self.run_to(enc, [cu_q, cu_k], qkv, outputs, Some((cache, seqs)), prof)
    }

    /// Records every sequence of `cu_q` queries over `cu_k` keys (equal lists for
    /// [`Self::run`]), each followed by its take-over into `cache` when given.
    #[allow(clippy::too_many_arguments)]
    fn run_to(
        &self,
        enc: &mut wgpu::CommandEncoder,
        [cu_q, cu_k]: [&[usize]; 2],
        [q, k, v]: [&TensorView; 3],
        outputs: &PrefillOutputs<'_>,
        mut cache: Option<(&mut KvCache, &[usize])>,
        mut prof: Option<&mut Profiler>,
    ) -> Result<()> {
        check_seqlens(cu_q, cu_k)?;
        let (tq, tk) = (cu_q[cu_q.len() - 1], cu_k[cu_k.len() - 1]);
        let (hq, hkv, d) = self.heads;
        check_shape("q", q, [1, hq, tq, d])?;
        check_shape("k", k, [1, hkv, tk, d])?;
        check_shape("v", v, [1, hkv, tk, d])?;
        check_shape("output", outputs.out, [1, hq, tq, d])?;
        check_shape("lse", outputs.lse, [1, hq, tq, 1])?;
        if let Some(sel) = outputs.selection {
            check_shape("selection", sel, [1, hkv, tq, self.opts.cfg.top_k])?;
        }
        // (Each sequence's views lie within these: their ends are checked with them.)
        check_inputs([q, k, v], self.opts.storage)?;
        // Sequence i's outputs are written before sequence i + 1's inputs are read: outputs
        // must not share bytes with inputs, nor with each other across sequences (sequence
        // i + 1's O written over sequence i's LSE); `check_outputs` below checks each
        // sequence's own.
        let outs = output_views(outputs).collect::<Vec<_>>();
        check_disjoint_between(&outs, &[("q", q), ("k", k), ("v", v)])?;
        check_disjoint_among(&outs)?;
        // Every sequence's views are checked before any is recorded (whether a view is read in
        // place, or an output written by a scatter, depends on where its sequence starts).
        let kk = self.opts.cfg.top_k;
        // Sequence i's token ranges of the queries and of the keys: (q0, nq, k0, nk).
        let ranges = || {
            (cu_q.windows(2).zip(cu_k.windows(2)))
                .map(|(a, b)| (a[0], a[1] - a[0], b[0], b[1] - b[0]))
        };
        // Sequence views: Q, K, V, then O, LSE and the selection's rows.
        let seq = |(q0, nq, k0, nk)| -> Result<([TensorView; 5], Option<TensorView>)> {
            let (qs, ks, vs) = (q.tokens(q0, nq)?, k.tokens(k0, nk)?, v.tokens(k0, nk)?);
            let sel = outputs.selection.map(|s| s.tokens(q0, nq)).transpose()?;
            let (o, l) = (outputs.out.tokens(q0, nq)?, outputs.lse.tokens(q0, nq)?);
            Ok(([qs, ks, vs, o, l], sel))
        };
        for r in ranges().filter(|r| r.1 > 0) {
            let n = r.1;
            let ([qs, ks, vs, o, l], sel) = seq(r)?;
            if self.in_place {
                in_place_qkv(&self.ctx, self.opts.storage, &qs, &ks, &vs)?;
            }
            let outs = PrefillOutputs {
                out: &o,
                lse: &l,
                selection: sel.as_ref(),
            };
            check_outputs(&outs, [1, hq, hkv, n, d, kk], self.opts.storage, false)?;
        }
        // Every sequence's plan is made (or its error found: a length past a binding, an
        // in-place view the kernels cannot read) before anything is recorded, so that an error
        // leaves the encoder and the cache as they were. Held here, a plan the bound of kept
        // plans drops on the way stays alive until its run is recorded.
        let mut plans = Vec::new();
        for r in ranges() {
            plans.push(match r.1 {
                0 => None,
                _ => {
                    let ([qs, ks, vs, ..], _) = seq(r)?;
                    Some(self.plan(r.1, r.3, Some([&qs, &ks, &vs]))?)
                }
            });
        }
        for (i, (r, plan)) in ranges().zip(plans).enumerate() {
            let Some(plan) = plan else {
                if let Some((cache, seqs)) = &mut cache {
                    match r.3 {
                        0 => cache.record_reset(enc, seqs[i])?,
                        // Keys and no queries: the cache holds them all the same.
                        nk => {
                            let (ks, vs) = (k.tokens(r.2, nk)?, v.tokens(r.2, nk)?);
                            cache.record_prefill_view(enc, seqs[i], &ks, &vs)?;
                        }
                    }
                }
                continue;
            };
            let ([qs, ks, vs, o, l], sel) = seq(r)?;
            let outs = PrefillOutputs {
                out: &o,
                lse: &l,
                selection: sel.as_ref(),
            };
            plan.run(enc, &qs, &ks, &vs, &outs, prof.as_deref_mut())?;
            if let Some((cache, seqs)) = &mut cache {
                cache.record_prefill_from_plan(enc, seqs[i], &plan, 0)?;
            }
        }
        Ok(())
    }
}
