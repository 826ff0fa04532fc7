//! Recording of the decode step: [`KvCache::record_step`] and [`KvCache::record_steps`], ONE
//! compute pass of one dispatch per cache (`fused`, or `route_leaf_merge`), two (`route_leaf`,
//! `merge`) or three (`route`, `leaf`, `merge`; see the module docs of [`crate::ops::decode`]
//! for the paths).

use std::sync::Arc;

use pisa_core::TensorLayout;

use super::{
    KvCache, Params, MERGE_SHADER, ROUTE_LEAF_MERGE_SG_SHADER, ROUTE_LEAF_MERGE_SHADER,
    ROUTE_LEAF_SG_SHADER, ROUTE_LEAF_SHADER, ROUTE_SG_SHADER, ROUTE_SHADER, SHADER,
};
use crate::error::{GpuError, Result};
use crate::runtime::buffers::GpuTensor;
use crate::runtime::pipeline::Storage;
use crate::runtime::profiler::Profiler;
use crate::runtime::view::{check_disjoint_among, check_float_input, DType, InPlace, TensorView};

/// Bindings of one dispatch: `(binding, buffer, byte offset, bytes)`.
pub(super) type Binds<'a> = Vec<(u32, &'a wgpu::Buffer, u64, u64)>;

/// A whole buffer as a binding.
pub(super) fn whole(i: u32, b: &wgpu::Buffer) -> (u32, &wgpu::Buffer, u64, u64) {
    (i, b, 0, b.size())
}

/// A view range as a binding.
pub(super) fn range(i: u32, r: &InPlace) -> (u32, &wgpu::Buffer, u64, u64) {
    (i, &r.buffer, r.offset, r.size)
}

/// What one step binds: the query and the three outputs, each a buffer range (the cache's own
/// buffers, or a caller's views bound in place). The key of the cache of recorded dispatches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct StepIo {
    pub fused: bool,
    /// The split step as one dispatch, `route_leaf_merge` ([`KvCache::merges_in_route`]).
    pub merge_in_route: bool,
    pub q: InPlace,
    pub out: InPlace,
    pub lse: InPlace,
    pub sel: InPlace,
}

/// The outputs of a decode step: the caller's, given to [`KvCache::record_step_into`], or the
/// cache's own, lent by [`KvCache::outputs`]. A view of the type below, contiguous, at an
/// offset that is a multiple of the device's `min_storage_buffer_offset_alignment`, is bound
/// in place (written by the step itself); any other (strided, unaligned, or an O of another
/// float dtype) is written from the cache's own outputs by a scatter recorded after the step,
/// kept per view (a 2-byte O view needs whole words: an even D). LSE is f32 only (another
/// dtype is refused with [`crate::GpuError::View`]).
#[derive(Debug, Clone, Copy)]
pub struct StepOutputs<'a> {
    /// O `[B, Hq, 1, D]`: bound in place when it is of the cache's output dtype
    /// ([`crate::Storage::output`]: the storage dtype, f32 for a bf16 cache) and can be bound;
    /// f32, f16 or bf16 otherwise, written by a scatter (a 2-byte O needs an even D, a D stride
    /// of 1, an even element offset and even strides, else [`crate::GpuError::View`]).
    pub out: &'a TensorView,
    /// LSE `[B, Hq, 1, 1]` f32 (natural log).
    pub lse: &'a TensorView,
    /// The selection `[B, Hkv, 1, K]` i32, ascending, -1 padded; `None` leaves it in
    /// [`KvCache::outputs`].
    pub selection: Option<&'a TensorView>,
}

pub(super) use crate::runtime::buffers::Stage;

thread_local! {
    static SG_ROUTES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static ROUTE_LEAVES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static SG_LEAVES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static ROUTE_MERGES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Split decode steps built on the calling thread so far that run as one dispatch
/// (`route_leaf_merge`, [`KvCache::merges_in_route`]): lets a test tell that a case took it.
#[doc(hidden)]
pub fn route_merges_on_this_thread() -> u64 {
    ROUTE_MERGES.with(|c| c.get())
}

/// Split decode steps built on the calling thread so far whose `route_leaf` attends its blocks
/// on subgroup shuffles (`decode_attend_sg.wgsl`): lets a test tell that a case took it.
#[doc(hidden)]
pub fn subgroup_leaves_on_this_thread() -> u64 {
    SG_LEAVES.with(|c| c.get())
}

/// Split decode steps built on the calling thread so far whose `route` and `leaf` run as one
/// dispatch (`route_leaf`): lets a test tell that a case took that kernel.
#[doc(hidden)]
pub fn route_leaves_on_this_thread() -> u64 {
    ROUTE_LEAVES.with(|c| c.get())
}

/// Split decode steps built on the calling thread so far whose `route` runs its level steps on
/// subgroup shuffles ([`ROUTE_SG_SHADER`]): lets a test tell that a case took that kernel.
#[doc(hidden)]
pub fn subgroup_routes_on_this_thread() -> u64 {
    SG_ROUTES.with(|c| c.get())
}

/// What a kept gather of a decode input (or scatter of an output) binds: the view's buffer,
/// byte offset and dtype, its shape and strides, and the cache's buffer on the other side.
pub(super) type GatherKey = (
    (wgpu::Buffer, u64, crate::DType),
    ([usize; 4], [usize; 4]),
    wgpu::Buffer,
);

/// The [`GatherKey`] of `view` and the cache's buffer `other`.
fn gather_key(view: &TensorView, other: &wgpu::Buffer) -> GatherKey {
    (
        (view.buffer().clone(), view.offset(), view.dtype()),
        (view.shape(), view.strides()),
        other.clone(),
    )
}

/// The gather of a decode input that cannot be bound in place, to record before what reads
/// it (`None`: bound in place).
pub(super) type Gather = Option<Arc<[Stage]>>;

/// A decode step built and not recorded: its dispatches, the gather of its query, and the
/// scatters of its outputs.
pub(super) type StepBuilt = (Arc<[Stage]>, Gather, Vec<Arc<[Stage]>>);

/// Most sets of buffers a cache keeps recorded dispatches for (per kind: steps, appends,
/// gathers).
const STAGE_CACHE_MAX: usize = 64;

/// Recorded dispatches by what they bind (a step's or an append's buffers), built on first use
/// and shared afterwards; bounded, so an app that binds ever new buffers rebuilds rather than
/// grows the cache without end.
pub(super) struct StageCache<K>(std::sync::Mutex<std::collections::HashMap<K, Arc<[Stage]>>>);

impl<K> Default for StageCache<K> {
    fn default() -> Self {
        Self(Default::default())
    }
}

impl<K> std::fmt::Debug for StageCache<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StageCache")
    }
}

impl<K: std::hash::Hash + Eq + Clone> StageCache<K> {
    /// The dispatches kept for `key`, or those `build` makes (then kept).
    pub(super) fn get_or_build(
        &self,
        key: &K,
        build: impl FnOnce() -> Result<Vec<Stage>>,
    ) -> Result<Arc<[Stage]>> {
        let mut cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(st) = cache.get(key) {
            return Ok(st.clone());
        }
        let stages: Arc<[Stage]> = build()?.into();
        if cache.len() >= STAGE_CACHE_MAX {
            cache.clear();
        }
        cache.insert(key.clone(), stages.clone());
        Ok(stages)
    }

    /// How many sets of dispatches are kept.
    pub(super) fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Forgets every kept dispatch (their sizes changed).
    pub(super) fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

impl KvCache {
    /// The sets of recorded dispatches this cache keeps: `[steps, appends, gathers]` (tests:
    /// an inference loop that binds the same buffers at every step builds each set once,
    /// whatever its append masks).
    #[doc(hidden)]
    pub fn kept_dispatch_sets(&self) -> [usize; 3] {
        [
            self.stage_cache.len(),
            self.append_cache.len(),
            self.gather_cache.len(),
        ]
    }

    /// Records the decode step (PISA.md 3, 4, 5) of every sequence, labelled "decode" in
    /// `prof`: ONE compute pass of one dispatch when the cache runs fused ([`Self::is_fused`]:
    /// `fused`, one workgroup per (sequence, KV head)), else of three (see the module docs:
    /// `route`, one workgroup per (sequence, KV head); `leaf`, one per (sequence, KV head,
    /// leaf slot); `merge`, one per (sequence, KV head)), two ([`Self::route_leaf_blocks`]) or
    /// one ([`Self::merges_in_route`]). `q`: `[B, Hq, D]` in the cache's storage
    /// precision, the token at position `len(b) - 1` of each sequence (append its key first).
    /// Writes [`Self::outputs`]: O `[B, Hq, D]` (storage precision; f32 for bf16), LSE `[B, Hq]` f32,
    /// selection `[B, Hkv, K]` i32. An empty sequence gets zeros, LSE `-inf` and no blocks.
    /// Errors: [`pisa_core::PisaError::BufferLen`] or [`crate::GpuError::Unsupported`] for a
    /// `q` of the wrong size or precision.
    #[doc(hidden)]
    pub fn record_step(
        &self,
        enc: &mut wgpu::CommandEncoder,
        q: &GpuTensor,
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_steps(enc, &[(self, q)], prof)
    }

    /// Records the decode step (PISA.md 3, 4, 5) of every sequence for the query `q` of each:
    /// the token at position `len(b) - 1` of sequence `b` (append its key and value first, as
    /// [`Self::record_append_view`] does), writing O, LSE and the selection into the caller's
    /// `outputs` (or, with `outputs` `None`, into [`Self::outputs`]). An empty sequence gets
    /// zeros, LSE `-inf` and no blocks. Labelled "decode" in `prof`: one compute pass of one
    /// dispatch when the cache runs fused ([`Self::is_fused`]), else of a few (see the
    /// [module docs](crate::ops::decode)). The plan/run split of an inference loop:
    /// the first step of a given set of buffers builds its bind groups (and pipelines), every
    /// later one only records the pass: no GPU allocation (buffer, bind group or pipeline), no
    /// host write to the GPU, no wait (the lengths live on the GPU, advanced by the recorded
    /// appends); on the host, the call's liveness probe ([`crate::Context::check_alive`]: a
    /// non-blocking poll and, on an application's device, a queue write the device refuses in
    /// an error scope) makes a few small heap allocations. `q`: `[B, Hq, 1, D]` in the cache's
    /// storage dtype, contiguous, at an aligned offset (see [`TensorView`]) to be bound in place;
    /// any other query view (a row of a packed QKV projection, another dtype) is gathered first by one
    /// small dispatch. The outputs are bound in place where they can be, else written by a
    /// scatter recorded after the step ([`StepOutputs`]).
    ///
    /// Errors: [`GpuError::View`] for a view of the wrong shape, an output of the wrong dtype
    /// (an integer O, an LSE that is not f32, a float selection) or one the scatter cannot
    /// write (an output written by a scatter that lies in the cache's own output buffers,
    /// [`Self::outputs`], its source), or, when the step runs fused, an output bound in place
    /// in the buffer of a `q` bound in place; [`GpuError::Validation`] for a buffer of
    /// another device; [`GpuError::Misuse`] for a sequence whose KV heads were loaded at
    /// different lengths ([`Self::prefill_view_heads`]).
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context, cache: &mut pisa_wgpu::ops::decode::KvCache,
    /// #      k: &pisa_wgpu::TensorView, v: &pisa_wgpu::TensorView, q: &pisa_wgpu::TensorView,
    /// #      o: &pisa_wgpu::TensorView, lse: &pisa_wgpu::TensorView) -> pisa_wgpu::Result<()> {
    /// use pisa_wgpu::ops::decode::StepOutputs;
    /// let mut enc = ctx.device().create_command_encoder(&Default::default());
    /// cache.record_append_view(&mut enc, k, v, &[true; 3], None)?;
    /// let outs = StepOutputs { out: o, lse, selection: None };
    /// cache.record_step_into(&mut enc, q, Some(&outs), None)?;
    /// ctx.queue().submit([enc.finish()]);
    /// # Ok(()) }
    /// ```
    pub fn record_step_into(
        &self,
        enc: &mut wgpu::CommandEncoder,
        q: &TensorView,
        outputs: Option<&StepOutputs<'_>>,
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let _call = self.ctx.public_call()?;
        self.check_heads_loaded()?;
        let (stages, gather, scatters) = self.step_stages(q, outputs)?;
        self.record_gather_of(enc, gather.as_ref());
        self.ctx.record_pass(enc, "decode", stages.iter(), prof);
        for s in &scatters {
            self.ctx.record_pass(enc, "scatter", s.iter(), None);
        }
        Ok(())
    }

    /// Everything [`Self::record_step_into`] records, built (and kept) but not recorded
    /// ([`StepBuilt`]): the
    /// step's dispatches, the gather of `q` where it is not bound in place, and the scatters of
    /// the outputs that are not. Everything that can fail (a buffer of another device among
    /// them: the builds run under error scopes) fails here, before anything is recorded.
    pub(super) fn step_stages(
        &self,
        q: &TensorView,
        outputs: Option<&StepOutputs<'_>>,
    ) -> Result<StepBuilt> {
        let mut scatters = Vec::new();
        let (io, gather) = self.step_io(q, outputs, &mut scatters)?;
        let stages = self.cached_stages(&io)?;
        let scatters = (scatters.into_iter())
            .map(|(view, src, storage)| self.scatter_built(&src, storage, view))
            .collect::<Result<Vec<_>>>()?;
        Ok((stages, gather, scatters))
    }

    /// The scatter of the cache's `src` (of `storage`) into the caller's `view`, built on first
    /// use under an error scope and kept ([`GatherKey`]); nothing recorded.
    pub(super) fn scatter_built(
        &self,
        src: &wgpu::Buffer,
        storage: Storage,
        view: &TensorView,
    ) -> Result<Arc<[Stage]>> {
        self.gather_cache.get_or_build(&gather_key(view, src), || {
            self.ctx.scope_now("decode output scatter", || {
                crate::ops::gather::scatter_stages(&self.ctx, src, storage, view)
            })
        })
    }

    /// An output view as a binding: in place when it is of `dt`, contiguous and at an offset
    /// the device binds; else the cache's own `own` (of `storage`), with a scatter from it into
    /// the view pushed to `scatters` (recorded after the step), where the scatter can write the
    /// view: a float view for O and LSE, an i32 one for the selection (`dt` I32). Errors:
    /// [`GpuError::View`] for the wrong shape, a dtype of the wrong kind, or a view the
    /// scatter cannot write (a 2-byte view whose pairs along D are not whole words).
    fn out_binding<'v>(
        &self,
        what: &str,
        view: &'v TensorView,
        (dt, shape): (DType, [usize; 4]),
        (own, storage): (&GpuTensor, Storage),
        scatters: &mut Vec<(&'v TensorView, wgpu::Buffer, Storage)>,
    ) -> Result<InPlace> {
        let align = self.ctx.limits().min_storage_buffer_offset_alignment as u64;
        if view.shape() == shape && view.dtype() == dt {
            if let Some(r) = view.binding_words(TensorLayout::Bhnd, align) {
                return Ok(r);
            }
        }
        if view.shape() != shape || (dt == DType::I32) != (view.dtype() == DType::I32) {
            return Err(GpuError::View(format!(
                "{what}: expected {dtype} {shape:?}, got {:?} {:?}",
                view.dtype(),
                view.shape(),
                dtype = match dt {
                    DType::I32 => "I32",
                    _ => "a float (f32, f16, bf16) view of",
                },
            )));
        }
        crate::ops::gather::check_scatter_dst(what, storage, view)?;
        scatters.push((view, own.buffer.clone(), storage));
        Ok(InPlace::whole(&own.buffer))
    }

    /// The bindings of a step for a query view and optional output views, checked; outputs
    /// that cannot be bound in place are written through the cache's own, their scatters
    /// pushed to `scatters`.
    fn step_io<'v>(
        &self,
        q: &TensorView,
        outputs: Option<&StepOutputs<'v>>,
        scatters: &mut Vec<(&'v TensorView, wgpu::Buffer, Storage)>,
    ) -> Result<(StepIo, Option<Arc<[Stage]>>)> {
        let s = &self.shape;
        // O is of the kernels' output type: the storage's, f32 for bf16.
        let dt = DType::from(self.storage.output());
        let (b, hq, hkv, d, k) = (s.batch, s.q_heads, s.kv_heads, s.head_dim, self.cfg.top_k);
        // The outputs and the query are checked before the query's gather (if any) is
        // recorded: nothing is recorded on error.
        self.check_input_view("q", q, [b, hq, 1, d])?;
        if let Some(o) = outputs {
            let mut named = vec![("decode output", o.out), ("decode lse", o.lse)];
            named.extend(o.selection.map(|sel| ("decode selection", sel)));
            check_disjoint_among(&named)?;
        }
        if let Some(o) = outputs.filter(|o| o.lse.dtype() != DType::F32) {
            return Err(GpuError::View(format!(
                "decode lse: must be f32, is {:?}",
                o.lse.dtype()
            )));
        }
        let (out, lse, sel) = match outputs {
            Some(o) => (
                self.out_binding(
                    "decode output",
                    o.out,
                    (dt, [b, hq, 1, d]),
                    (&self.out, self.storage.output()),
                    scatters,
                )?,
                self.out_binding(
                    "decode lse",
                    o.lse,
                    (DType::F32, [b, hq, 1, 1]),
                    (&self.lse, Storage::F32),
                    scatters,
                )?,
                match o.selection {
                    Some(v) => self.out_binding(
                        "decode selection",
                        v,
                        (DType::I32, [b, hkv, 1, k]),
                        (&self.sel, Storage::F32),
                        scatters,
                    )?,
                    None => InPlace::whole(&self.sel.buffer),
                },
            ),
            None => (
                InPlace::whole(&self.out.buffer),
                InPlace::whole(&self.lse.buffer),
                InPlace::whole(&self.sel.buffer),
            ),
        };
        let (q, gather) = self.input_binding("q", q, [b, hq, 1, d], &self.q_in)?;
        let outputs = [&out.buffer, &lse.buffer, &sel.buffer];
        if self.is_fused() {
            check_q_apart(&q, outputs)?;
        }
        let io = StepIo {
            fused: self.is_fused(),
            // (q in an output buffer: the two dispatches, which bind them apart)
            merge_in_route: self.merges_in_route() && !q_in_outputs(&q, outputs),
            q,
            out,
            lse,
            sel,
        };
        Ok((io, gather))
    }

    /// The checks of [`Self::input_view`] that come before it records anything: the shape, a
    /// float dtype, and, for a view it would gather, the gather's own checks. Errors:
    /// [`GpuError::View`] and those of the gather.
    pub(super) fn check_input_view(
        &self,
        what: &str,
        view: &TensorView,
        shape: [usize; 4],
    ) -> Result<()> {
        if view.shape() != shape {
            return Err(GpuError::View(format!(
                "{what}: expected shape {shape:?}, got {:?}",
                view.shape()
            )));
        }
        check_float_input(what, view)?;
        crate::ops::gather::check_gather_src(what, view, self.storage)
    }

    /// An input `view` of `shape` as a range to bind: in place when it is contiguous, of the
    /// cache's storage dtype and at an aligned offset; else (a packed QKV projection, another
    /// dtype, an unaligned offset) the cache's `scratch`, with the gather that fills it on the
    /// GPU (one small dispatch, returned to be recorded before what reads it; its parameter
    /// buffer and bind group are built for the first gather of a view and kept, [`GatherKey`],
    /// so an inference loop that gathers the same rows of its buffers at every step allocates
    /// nothing). Records nothing, so a caller builds everything that can fail before it
    /// records anything.
    pub(super) fn input_binding(
        &self,
        what: &str,
        view: &TensorView,
        shape: [usize; 4],
        scratch: &GpuTensor,
    ) -> Result<(InPlace, Option<Arc<[Stage]>>)> {
        if view.shape() != shape {
            return Err(GpuError::View(format!(
                "{what}: expected shape {shape:?}, got {:?}",
                view.shape()
            )));
        }
        let align = self.ctx.limits().min_storage_buffer_offset_alignment as u64;
        if view.dtype() == DType::from(self.storage) {
            if let Some(r) = view.binding_words(TensorLayout::Bhnd, align) {
                return Ok((r, None));
            }
        }
        let key = gather_key(view, &scratch.buffer);
        // Built under an error scope (a view in another device's buffer is a Validation
        // error, and nothing is kept).
        let stages = self.gather_cache.get_or_build(&key, || {
            self.ctx.scope_now("decode input gather", || {
                crate::ops::gather::gather_stages(&self.ctx, view, &scratch.buffer, self.storage)
            })
        })?;
        Ok((InPlace::whole(&scratch.buffer), Some(stages)))
    }

    /// Records the gather [`Self::input_binding`] returned, if any.
    pub(super) fn record_gather_of(
        &self,
        enc: &mut wgpu::CommandEncoder,
        gather: Option<&Arc<[Stage]>>,
    ) {
        if let Some(g) = gather {
            self.ctx.record_pass(enc, "gather", g.iter(), None);
        }
    }

    /// The recorded dispatches of a step for `io`, built on first use and kept (the bind
    /// groups hold the buffers, the uniforms and the pipelines) until the step's sizes change.
    pub(super) fn cached_stages(&self, io: &StepIo) -> Result<Arc<[Stage]>> {
        self.stage_cache.get_or_build(io, || {
            self.ctx.scope_now("decode step", || {
                Ok(if io.fused {
                    vec![self.fused_stage(io)?]
                } else {
                    self.stages(io)?
                })
            })
        })
    }

    /// Records the decode steps of several caches, each for its own query `q` (as
    /// [`Self::record_step_into`], writing each cache's own outputs, [`Self::outputs`]), in ONE
    /// compute pass labelled "decode" in `prof`: every fused cache's dispatch and every split
    /// cache's first, then the split caches' second, then their last, so the caches' steps run
    /// side by side as one dependent chain (of one dispatch when all are fused) instead of one
    /// chain per cache. For KV heads spread over several caches: K or V of all heads past two
    /// storage bindings (1M tokens x 8 heads x 128 x f32; one cache holds up to two bindings),
    /// each cache holding some of the heads. Outputs are bitwise those of separate steps. Each
    /// `q` is `[B, Hq, 1, D]` of its cache; one that cannot be bound in place (strided, another
    /// float dtype, an unaligned offset) is gathered first into the cache's own scratch, as by
    /// [`Self::record_step_into`].
    ///
    /// Errors: [`GpuError::View`] for a `q` of the wrong shape or an integer one, or, where
    /// its cache runs the fused step, one in that cache's own output buffers (as
    /// [`KvCache::outputs`]: the step writes them in the dispatch that reads q), or one in
    /// another listed cache's output buffers (the steps run side by side: it would read that
    /// cache's earlier outputs);
    /// [`GpuError::Unsupported`] for caches of different contexts; [`GpuError::Misuse`] for a
    /// sequence whose KV heads were loaded at different lengths, or for one cache listed
    /// twice (its steps would share its scratch and outputs); [`GpuError::Validation`] for a
    /// buffer of another device. Everything is checked, and every dispatch built, before
    /// anything is recorded: nothing is recorded on error.
    ///
    /// ```no_run
    /// # fn f(ctx: &pisa_wgpu::Context, lo: &pisa_wgpu::KvCache, hi: &pisa_wgpu::KvCache,
    /// #      q_lo: &pisa_wgpu::TensorView, q_hi: &pisa_wgpu::TensorView)
    /// #      -> pisa_wgpu::Result<()> {
    /// use pisa_wgpu::KvCache;
    /// // KV heads 0..4 in `lo`, 4..8 in `hi`: one step of both, one pass.
    /// let mut enc = ctx.device().create_command_encoder(&Default::default());
    /// KvCache::record_steps_into(&mut enc, &[(lo, q_lo), (hi, q_hi)], None)?;
    /// ctx.queue().submit([enc.finish()]);
    /// # Ok(()) }
    /// ```
    pub fn record_steps_into(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &TensorView)],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_view_passes(enc, steps, prof, false)
    }

    /// As [`Self::record_steps_into`], but always the split step (whatever [`Self::is_fused`]
    /// says), its dispatches grouped by stage, each group in its own timed compute pass
    /// labelled "decode_route", "decode_leaf" and "decode_merge" in `prof` (where the route
    /// and the leaf slots run as one dispatch, `route_leaf`, that dispatch is timed as
    /// "decode_route" and there is no "decode_leaf"): where a step's GPU time goes. The pass
    /// boundaries add a little time against the one-pass step. Same errors; the outputs of the
    /// split step (those of the fused step within rounding).
    pub fn record_steps_by_stage_into(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &TensorView)],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_view_passes(enc, steps, prof, true)
    }

    /// [`Self::record_steps_into`] for queries in the library's own tensors (tests).
    #[doc(hidden)]
    pub fn record_steps(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &GpuTensor)],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_tensor_passes(enc, steps, prof, false)
    }

    /// [`Self::record_steps_by_stage_into`] for queries in the library's own tensors (tests).
    #[doc(hidden)]
    pub fn record_steps_by_stage(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &GpuTensor)],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        Self::record_tensor_passes(enc, steps, prof, true)
    }

    /// The tensor forms as views `[B, Hq, 1, D]` of each cache's storage dtype.
    fn record_tensor_passes(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &GpuTensor)],
        prof: Option<&mut Profiler>,
        by_stage: bool,
    ) -> Result<()> {
        let views = (steps.iter())
            .map(|(cache, q)| {
                // The tensor's own length and precision (the view below takes the cache's).
                let s = &cache.shape;
                cache.check_tensor("q", q, s.batch * s.q_heads * s.head_dim)?;
                let dt = DType::from(cache.storage);
                TensorView::contiguous(&q.buffer, 0, dt, cache.q_shape(), TensorLayout::Bhnd)
            })
            .collect::<Result<Vec<_>>>()?;
        let steps: Vec<_> = steps.iter().map(|x| x.0).zip(&views).collect();
        Self::record_view_passes(enc, &steps, prof, by_stage)
    }

    fn record_view_passes(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, &TensorView)],
        prof: Option<&mut Profiler>,
        by_stage: bool,
    ) -> Result<()> {
        let Some(first) = steps.first() else {
            return Ok(());
        };
        let _call = first.0.ctx.public_call()?;
        // Every check before the first gather is recorded.
        for (i, (cache, q)) in steps.iter().enumerate() {
            cache.check_input_view("q", q, cache.q_shape())?;
            cache.check_step_of(first.0)?;
            // Two steps of one cache in one pass would share its scratch and outputs: the
            // first step's would be lost.
            if steps[..i].iter().any(|(c, _)| std::ptr::eq(*c, *cache)) {
                return Err(GpuError::Misuse(format!(
                    "decode steps: the cache of step {i} is also an earlier step's; one pass \
                     takes one step a cache (record the next step after this one)"
                )));
            }
            // The steps run side by side (every gather first, then the steps' dispatches by
            // stage): a q in another listed cache's outputs would read what that cache held
            // before this pass, not what its step writes in it.
            let reads_another = steps.iter().enumerate().find(|(j, (c, _))| {
                *j != i
                    && [&c.out, &c.lse, &c.sel]
                        .iter()
                        .any(|t| t.buffer == *q.buffer())
            });
            if let Some((j, _)) = reads_another {
                return Err(GpuError::View(format!(
                    "decode steps: the q of step {i} is in the outputs of step {j}'s cache, \
                     which this pass writes while the steps run side by side (q would read \
                     its earlier outputs); record step {j} first on its own \
                     (record_step_into), then this one"
                )));
            }
        }
        let mut bound = Vec::with_capacity(steps.len());
        for (cache, q) in steps {
            let (q, gather) = cache.input_binding("q", q, cache.q_shape(), &cache.q_in)?;
            // The fused step writes the cache's own outputs in the dispatch that reads q.
            if cache.is_fused() && !by_stage {
                let own = [&cache.out.buffer, &cache.lse.buffer, &cache.sel.buffer];
                check_q_apart(&q, own)?;
            }
            bound.push((*cache, q, gather));
        }
        Self::record_passes(enc, &bound, prof, by_stage)
    }

    /// The shape of a step's query, `[B, Hq, 1, D]`.
    fn q_shape(&self) -> [usize; 4] {
        let s = &self.shape;
        [s.batch, s.q_heads, 1, s.head_dim]
    }

    /// Whether this cache's step may be recorded beside `first`'s in one pass: the same
    /// context, every KV head of every sequence loaded at one length.
    fn check_step_of(&self, first: &KvCache) -> Result<()> {
        if !self.ctx.same(&first.ctx) {
            return Err(GpuError::Unsupported(
                "decode steps of caches from different contexts in one pass".into(),
            ));
        }
        self.check_heads_loaded()
    }

    /// The passes of [`Self::record_steps_into`] for queries already bound (the caches
    /// checked by [`Self::record_view_passes`], which holds the public-call guard).
    fn record_passes(
        enc: &mut wgpu::CommandEncoder,
        steps: &[(&KvCache, InPlace, Gather)],
        mut prof: Option<&mut Profiler>,
        by_stage: bool,
    ) -> Result<()> {
        let Some(first) = steps.first() else {
            return Ok(());
        };
        let mut stages: [Vec<Stage>; 3] = Default::default();
        for (cache, q, _) in steps {
            let own = [&cache.out.buffer, &cache.lse.buffer, &cache.sel.buffer];
            let io = StepIo {
                fused: cache.is_fused() && !by_stage,
                merge_in_route: cache.merges_in_route() && !by_stage && !q_in_outputs(q, own),
                q: q.clone(),
                out: InPlace::whole(&cache.out.buffer),
                lse: InPlace::whole(&cache.lse.buffer),
                sel: InPlace::whole(&cache.sel.buffer),
            };
            let st = cache.cached_stages(&io)?;
            if io.fused || io.merge_in_route {
                stages[0].extend(st.iter().cloned());
                continue;
            }
            // route, leaf, merge; or route_leaf, merge: the last is always the merge.
            let n = st.len();
            for (i, x) in st.iter().enumerate() {
                stages[if i + 1 == n { 2 } else { i }].push(x.clone());
            }
        }
        let passes: Vec<(&'static str, Vec<&Stage>)> = if by_stage {
            ["decode_route", "decode_leaf", "decode_merge"]
                .into_iter()
                .zip(stages.iter())
                .filter(|(_, group)| !group.is_empty())
                .map(|(label, group)| (label, group.iter().collect()))
                .collect()
        } else {
            vec![("decode", stages.iter().flatten().collect())]
        };
        // (the queries' gathers once every step is built: nothing is recorded on error)
        for (cache, _, gather) in steps {
            cache.record_gather_of(enc, gather.as_ref());
        }
        for (label, group) in passes {
            first
                .0
                .ctx
                .record_pass(enc, label, group, prof.as_deref_mut());
        }
        Ok(())
    }

    /// A dispatch of `n` workgroups of pipeline `p` with bindings `b`.
    pub(super) fn make_stage(
        &self,
        p: Arc<wgpu::ComputePipeline>,
        b: &Binds,
        n: u64,
    ) -> Result<Stage> {
        self.ctx.stage_ranges(&p, b, n)
    }

    /// Lanes per pyramid row of the split step's `route` with its level steps on subgroup
    /// shuffles ([`ROUTE_SG_SHADER`]), or `None` where it does not run: where
    /// [`crate::Tuning::decode_route_subgroups`] asked when the cache was made and the device
    /// has `Features::SUBGROUP`, by the plan's rule ([`super::plan::Plan::route_subgroup_lanes`]).
    pub(super) fn route_subgroup_lanes(&self) -> Option<u32> {
        let ctx = &self.ctx;
        let lse = self.cfg.scoring == pisa_core::Scoring::Lse;
        (self.route_subgroups && ctx.features().contains(wgpu::Features::SUBGROUP))
            .then(|| self.plan.route_subgroup_lanes(ctx.shuffle_lanes(), lse))
            .flatten()
    }

    /// Lanes per group of `route_leaf`'s block attention on subgroup shuffles
    /// (`decode_attend_sg.wgsl`), or `None` where it does not run: with the route's subgroup
    /// level steps (`sg_route`, whose shader holds it), where
    /// [`crate::Tuning::decode_leaf_subgroups`] asked when the cache was made, by the plan's
    /// rule ([`super::plan::Plan::attend_subgroup_lanes`]).
    pub(super) fn attend_subgroup_lanes(&self, sg_route: bool) -> Option<u32> {
        (sg_route && self.leaf_subgroups)
            .then(|| {
                self.plan
                    .attend_subgroup_lanes(self.ctx.shuffle_lanes(), self.cfg.block_size as u32)
            })
            .flatten()
    }

    /// Where this cache's split step runs `route` and `leaf` as one dispatch (`route_leaf`):
    /// the leaf slots each of its workgroups attends at once and the workgroups per (sequence,
    /// KV head), `(NB, copies)`. `None` runs them apart: B * Hkv * copies above
    /// [`crate::Tuning::decode_route_workgroups`] (as the cache was made), or the kernel's
    /// workgroup memory above the cache's limit. Where the step merges in it too
    /// ([`Self::merges_in_route`]), the sizes of `route_leaf_merge`.
    pub fn route_leaf_blocks(&self) -> Option<(u32, u32)> {
        self.route_leaf_plan().map(|(nb, copies, _)| (nb, copies))
    }

    /// Whether this cache's split step runs as ONE dispatch, `route_leaf_merge`
    /// (`shaders/decode_route_leaf_merge.wgsl`: `route_leaf` whose last workgroup of each
    /// (sequence, KV head) to finish does `merge`'s work): where `route_leaf` runs
    /// ([`Self::route_leaf_blocks`]), [`crate::Tuning::decode_merge_in_route`] asked for it
    /// when the cache was made on a Vulkan device with `MEMORY_DECORATION_COHERENT`, the step
    /// is not fused, and the kernel's 13 storage buffers and
    /// workgroup memory fit the cache's limits (with fewer blocks at once than `route_leaf`
    /// would attend, where memory needs it). Steps recorded by stage
    /// ([`Self::record_steps_by_stage_into`]) keep `merge` apart, to time it.
    pub fn merges_in_route(&self) -> bool {
        self.route_leaf_plan().is_some_and(|(_, _, merge)| merge)
    }

    /// The dispatches of this cache's step ([`DecodeStep`]): fused ([`Self::is_fused`]), one
    /// ([`Self::merges_in_route`]), route and leaf then merge ([`Self::route_leaf_blocks`]), or
    /// three.
    pub fn decode_step(&self) -> DecodeStep {
        if self.is_fused() {
            DecodeStep::Fused
        } else {
            match self.route_leaf_plan() {
                Some((_, _, true)) => DecodeStep::OneDispatch,
                Some(_) => DecodeStep::RouteLeafAndMerge,
                None => DecodeStep::ThreeDispatches,
            }
        }
    }

    /// `route_leaf_merge`'s counts of finished copies, one per (sequence, KV head), read back:
    /// 0 between steps (the last copy of each step sets its head's back to 0). For tests.
    #[doc(hidden)]
    pub fn route_merge_counts(&self) -> Result<Vec<u32>> {
        let bytes = self.ctx.read_bytes(&self.done)?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }

    /// `(NB, copies, merge)` of [`Self::route_leaf_blocks`] and [`Self::merges_in_route`]:
    /// `route_leaf_merge`'s where it runs, else `route_leaf`'s.
    fn route_leaf_plan(&self) -> Option<(u32, u32, bool)> {
        let heads = (self.shape.batch * self.shape.kv_heads) as u64;
        let limit = self.limits.max_compute_workgroup_storage_size as u64;
        // (route_leaf binds 10 storage buffers, route_leaf_merge 13)
        let buffers = self.limits.max_storage_buffers_per_shader_stage;
        let within = |merge: bool| {
            (buffers >= if merge { 13 } else { 10 })
                .then(|| self.plan.route_leaf_blocks(limit, merge))
                .flatten()
                .filter(|&(_, copies)| heads * copies as u64 <= self.route_workgroups as u64)
                .map(|(nb, copies)| (nb, copies, merge))
        };
        // (`merge_in_route` holds the device's condition: Context::one_dispatch_decode)
        let merge = self.merge_in_route && !self.is_fused();
        merge
            .then(|| within(true))
            .flatten()
            .or_else(|| within(false))
    }

    /// The dispatches of this cache's split step for `q`: `route`, `leaf`, `merge`, or
    /// `route_leaf`, `merge` ([`Self::route_leaf_blocks`]), or `route_leaf_merge` alone
    /// (`io.merge_in_route`, [`Self::merges_in_route`]).
    fn stages(&self, io: &StepIo) -> Result<Vec<Stage>> {
        let s = &self.shape;
        let ctx = &self.ctx;
        let heads = (s.batch * s.kv_heads) as u64;
        let slots = heads * self.plan.slots() as u64;
        let uniform = |wg_count: u64| {
            ctx.uniform(
                "decode params",
                &Params {
                    wg_count: wg_count as u32,
                    ..self.base()
                },
            )
        };
        let (u_heads, u_slots) = (uniform(heads)?, uniform(slots)?);
        let route_leaf = self.route_leaf_blocks();
        let pipe = |shader, entry, wg| {
            let consts = self.plan.consts(wg);
            ctx.pipelines
                .get(&ctx.device, shader, entry, self.storage, &consts, &[])
        };
        // The route with its level steps on subgroup shuffles where it can run
        // (decode_levels_sg.wgsl): LR lowered to fit g * LR lanes in the smallest subgroup.
        let sg_lanes = self.route_subgroup_lanes();
        let route_consts = match sg_lanes {
            Some(lr) => {
                SG_ROUTES.with(|c| c.set(c.get() + 1));
                self.plan.route_subgroup_consts(lr, ctx.shuffle_lanes())
            }
            None => self.plan.consts(self.plan.wr).to_vec(),
        };
        let one = io.merge_in_route && route_leaf.is_some();
        let (shader, entry, consts) = match route_leaf {
            Some((nb, _)) => {
                let mut consts = self.plan.route_leaf_consts(route_consts, nb);
                // The block attention on subgroup shuffles (decode_attend_sg.wgsl, in the
                // subgroup route's shader only) where the plan's shapes allow it.
                let sga = self.attend_subgroup_lanes(sg_lanes.is_some());
                if let Some(g) = sga {
                    SG_LEAVES.with(|c| c.set(c.get() + 1));
                    consts.extend([("SGA", 1), ("SGA_G", g)]);
                }
                // Value rows loaded in the P.V loop (Tuning::decode_leaf_prefetch), but by the
                // subgroup attention, which always loads its rows ahead (PVR = CH / PARTS).
                if !self.leaf_prefetch && sga.is_none() {
                    consts.retain(|c| c.0 != "PVR");
                    consts.push(("PVR", 1));
                }
                match (one, sg_lanes.is_some()) {
                    (true, true) => (&ROUTE_LEAF_MERGE_SG_SHADER, "route_leaf_merge", consts),
                    (true, false) => (&ROUTE_LEAF_MERGE_SHADER, "route_leaf_merge", consts),
                    (false, true) => (&ROUTE_LEAF_SG_SHADER, "route_leaf", consts),
                    (false, false) => (&ROUTE_LEAF_SHADER, "route_leaf", consts),
                }
            }
            None => {
                let shader = match sg_lanes {
                    Some(_) => &ROUTE_SG_SHADER,
                    None => &ROUTE_SHADER,
                };
                (shader, "route", route_consts)
            }
        };
        let route_pipe =
            ctx.pipelines
                .get(&ctx.device, shader, entry, self.storage, &consts, &[])?;
        let sq = self.pyr.sq.as_ref().unwrap_or(&self.dummy);
        let (l, c, pa) = (&self.lens_gpu, &self.cands.buffer, &self.parts.buffer);
        let last = self.kv.len() - 1;
        let route: Binds = vec![
            whole(0, &u_heads),
            whole(1, l),
            range(2, &io.q),
            whole(5, &self.pyr.means.buffer),
            whole(6, &sq.buffer),
            whole(10, c),
        ];
        let leaf: Binds = vec![
            whole(0, &u_slots),
            whole(1, l),
            range(2, &io.q),
            whole(3, &self.kv[0].0.buffer),
            whole(4, &self.kv[0].1.buffer),
            whole(12, &self.kv[last].0.buffer),
            whole(13, &self.kv[last].1.buffer),
            whole(10, c),
            whole(11, pa),
        ];
        let merge: Binds = vec![
            whole(0, &u_heads),
            whole(1, l),
            range(7, &io.out),
            range(8, &io.lse),
            range(9, &io.sel),
            whole(10, c),
            whole(11, pa),
        ];
        let stage = |p, b: Binds, n| self.make_stage(p, &b, n);
        let merge_stage = |b: Binds| stage(pipe(&MERGE_SHADER, "merge", self.plan.wm)?, b, heads);
        if let Some((_, copies)) = route_leaf {
            ROUTE_LEAVES.with(|c| c.set(c.get() + 1));
            // The route's bindings and the leaf's, as one.
            let mut both = route;
            both.extend(leaf.into_iter().filter(|b| ![0, 1, 2, 10].contains(&b.0)));
            let n = heads * copies as u64;
            let u_copies = uniform(n)?;
            both[0] = whole(0, &u_copies);
            if one {
                // and the merge's but the slots (each copy holds its own), and the counters.
                ROUTE_MERGES.with(|c| c.set(c.get() + 1));
                both.retain(|b| b.0 != 10);
                both.extend(merge.into_iter().filter(|b| [7, 8, 9].contains(&b.0)));
                both.push(whole(14, &self.done));
                return Ok(vec![stage(route_pipe, both, n)?]);
            }
            return Ok(vec![stage(route_pipe, both, n)?, merge_stage(merge)?]);
        }
        Ok(vec![
            stage(route_pipe, route, heads)?,
            stage(pipe(&SHADER, "leaf", self.plan.wg)?, leaf, slots)?,
            merge_stage(merge)?,
        ])
    }
}

/// Whether the query binding `q` lies in one of the step's output buffers `outputs` (O, LSE,
/// the selection): the split step then runs `merge` as its own dispatch (the one-dispatch step,
/// as the fused one, binds q read-only and the outputs writable in one dispatch, which wgpu
/// refuses for one buffer).
fn q_in_outputs(q: &InPlace, outputs: [&wgpu::Buffer; 3]) -> bool {
    outputs.iter().any(|&o| *o == q.buffer)
}

/// Errors ([`GpuError::View`]) when the fused step's query binding `q` lies in one of the
/// buffers its dispatch writes (`outputs`: O, LSE, the selection): the fused step binds q
/// read-only and the outputs writable in one dispatch, which wgpu refuses for one buffer, even
/// for disjoint ranges (a gathered q is in the cache's own scratch, never an output).
fn check_q_apart(q: &InPlace, outputs: [&wgpu::Buffer; 3]) -> Result<()> {
    if q_in_outputs(q, outputs) {
        return Err(GpuError::View(
            "q and a decode output in one buffer: the fused step binds q read-only and the \
             outputs writable in one dispatch, which wgpu refuses for one buffer (even for \
             disjoint ranges); put them in separate buffers, or run the split step"
                .into(),
        ));
    }
    Ok(())
}

/// The dispatches of a decode step (the paths of the module docs of [`crate::ops::decode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeStep {
    /// `fused`: one dispatch, one workgroup per (sequence, KV head)
    /// ([`crate::Tuning::decode_fused`]).
    Fused,
    /// `route_leaf_merge`: route and leaf slots in several workgroups per (sequence, KV head),
    /// the last to finish merging ([`crate::Tuning::decode_merge_in_route`]).
    OneDispatch,
    /// `route_leaf`, then `merge` ([`crate::Tuning::decode_route_workgroups`]).
    RouteLeafAndMerge,
    /// `route`, `leaf`, `merge`.
    ThreeDispatches,
}

impl DecodeStep {
    /// The step a cache made with `tuning` on a device of `report` runs where its kernels fit
    /// and its sequences x KV heads x workgroups per head are within
    /// [`crate::Tuning::decode_route_workgroups`] (else [`Self::ThreeDispatches`]; a cache's
    /// own is [`KvCache::decode_step`]): fused where `decode_fused`, else route and leaf as one
    /// where `decode_route_workgroups` is above 0, merging there too where
    /// `decode_merge_in_route` and [`crate::AdapterReport::one_dispatch_decode`] allow.
    pub fn planned(tuning: &crate::Tuning, report: &crate::AdapterReport) -> Self {
        if tuning.decode_fused {
            Self::Fused
        } else if tuning.decode_route_workgroups == 0 {
            Self::ThreeDispatches
        } else if tuning.decode_merge_in_route && report.one_dispatch_decode().is_ok() {
            Self::OneDispatch
        } else {
            Self::RouteLeafAndMerge
        }
    }

    /// The step's name as `pisa bench` records it: `fused`, `one-dispatch`, `route-leaf+merge`
    /// or `route+leaf+merge`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fused => "fused",
            Self::OneDispatch => "one-dispatch",
            Self::RouteLeafAndMerge => "route-leaf+merge",
            Self::ThreeDispatches => "route+leaf+merge",
        }
    }
}
