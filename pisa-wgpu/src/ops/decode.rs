//! Decode (PISA.md sections 1, 3, 4, 5): [`KvCache`], a GPU KV cache of B sequences with an
//! incrementally updated key pyramid, and the decode step: selection, leaf scoring and
//! attention for the newest token of every sequence, recorded into the caller's encoder.
//!
//! An inference loop, per layer: make the cache once ([`KvCache::with_sizes`]); load each
//! sequence's prompt (its keys and values from views, [`KvCache::record_prefill_view`], or
//! from a prefill plan that has run, [`KvCache::record_prefill_from_plan`]); then per token
//! append its key and value ([`KvCache::record_append_view`]) and record the step
//! ([`KvCache::record_step_into`]), whose query is the token at position `len - 1` of each
//! sequence. [`KvCache::record_chunk`] appends and attends T tokens a sequence (a chunked
//! prefill into the cache); [`KvCache::record_reset`] empties a sequence. None of
//! [`KvCache::record_append_view`], [`KvCache::record_step_into`] and [`KvCache::record_reset`]
//! allocates, writes from the host or waits after the first call with a given set of buffers
//! (loading a prefill, `record_prefill_view` or `record_prefill_from_plan`, may allocate
//! scratch or upload a length).
//! The results are those of `pisa_core::reference::DecodeState::step` (selections up to
//! near-ties of f32 rounding).
//!
//! ```no_run
//! # fn f(ctx: &pisa_wgpu::Context, k_prompt: &pisa_wgpu::TensorView,
//! #      v_prompt: &pisa_wgpu::TensorView, k_row: &pisa_wgpu::TensorView,
//! #      v_row: &pisa_wgpu::TensorView, q_row: &pisa_wgpu::TensorView,
//! #      o_row: &pisa_wgpu::TensorView, lse_row: &pisa_wgpu::TensorView)
//! #      -> pisa_wgpu::Result<()> {
//! use pisa_wgpu::ops::decode::{CacheSizes, KvCache, StepOutputs};
//! // One sequence of up to 64K tokens, 32 query heads over 8 KV heads of 128.
//! let sizes = CacheSizes { batch: 1, capacity: 65536, q_heads: 32, kv_heads: 8, head_dim: 128 };
//! let cfg = pisa_core::SelectionConfig::new(64, 16)?;
//! let mut cache = KvCache::with_sizes(ctx, sizes, cfg, pisa_wgpu::Storage::F16)?;
//! let mut enc = ctx.device().create_command_encoder(&Default::default());
//! // The prompt's keys and values, [1, Hkv, P, D] views of any strides and float dtype.
//! cache.record_prefill_view(&mut enc, 0, k_prompt, v_prompt)?;
//! ctx.queue().submit([enc.finish()]);
//! let outs = StepOutputs { out: o_row, lse: lse_row, selection: None };
//! for _token in 0..16 {
//!     let mut enc = ctx.device().create_command_encoder(&Default::default());
//!     // k_row, v_row: [B, Hkv, 1, D]; q_row, o_row: [B, Hq, 1, D]; lse_row: [B, Hq, 1, 1] f32.
//!     cache.record_append_view(&mut enc, k_row, v_row, &[true], None)?;
//!     cache.record_step_into(&mut enc, q_row, Some(&outs), None)?;
//!     ctx.queue().submit([enc.finish()]);
//! }
//! # Ok(()) }
//! ```
//!
//! Limits: D a multiple of 4 up to 1024, GQA groups up to 256 (see "Requirements" at the end).
//!
//! # Implementation
//!
//! ONE compute pass per step, of one dispatch (the fused step) or a few (the split step).
//! Shaders `shaders/decode.wgsl` (shared declarations),
//! `decode_levels.wgsl` (the routing) and `decode_cut.wgsl` (the top-K cut), followed by
//! `decode_route.wgsl`, `decode_attend.wgsl` or `decode_merge.wgsl` (the split step's three
//! modules), `decode_route_leaf.wgsl` (route and leaf as one) and
//! `decode_route_leaf_merge.wgsl` (the whole split step as one), or `decode_fused.wgsl` (the
//! fused step), each ending with the block states' declaration (`decode_parts.wgsl`, or
//! `decode_parts_coherent.wgsl` for the one-dispatch split step); and
//! `shaders/decode_append.wgsl` (the append and the prefill copy).
//!
//! Paths. [`crate::Tuning::decode_fused`] of the context when a cache is made (default
//! split), or [`KvCache::set_fused`] per cache; [`KvCache::is_fused`] says which runs (the fused step
//! falls back to split where its workgroup memory does not fit, and for a cache split over two
//! storage bindings).
//!
//! Fused step (`decode_fused.wgsl`): ONE dispatch, one workgroup of up to 1024 invocations per
//! (sequence, KV head), where the split step pays a dependent dispatch per stage (about 1.7 us
//! each inside one pass on an H200; its `merge`, little work, still measured 17-26 us in
//! knock-outs: docs/benchmarks.md, A.5). The workgroup routes (as `route`), computes the
//! exact block state (m, l) per head of every slot (candidates and forced: g(K+1) + K at most)
//! in passes of whole blocks (LK = 4 invocations per key row, two barriers a pass), cuts the
//! top K (as `merge`), then attends the K selected blocks only, their keys read again (from
//! cache): the selection's max and sum per head are known from the states, so a pass is
//! scores | exp | P.V (two barriers), and the P.V parts are summed through workgroup memory
//! at the end. About 30 KiB of workgroup memory at g_q = 4, D = 128, C = 64, K = 16
//! ([`KvCache::workgroup_memory`]). The shader's header has the details.
//!
//! Split step. PISA.md 5 describes one fused dispatch; a single workgroup per (sequence, KV
//! head) is what that gives, and at B = 1, Hkv = 8 an earlier version of it left a 132-SM GPU
//! nearly idle with every key load of the step on one SM's critical path (0.48 ms at 1M tokens
//! on an H200). So this path splits the step where the work fans out; the three dispatches are
//! recorded in ONE compute pass (wgpu puts a barrier between them), so a step is still one pass
//! and one timestamp pair ("decode"):
//! 1. `route`, one workgroup of WR invocations (up to 1024, enough for all rows of a level) per
//!    (sequence, KV head), walks the intermediate levels (serial by nature) with the g_q heads
//!    of its group together. Per level: the g(K+1) candidates' g children's mean rows (`lse`;
//!    the candidates' own rows for `mean`/`meanvar`), LR = 8 consecutive invocations per row
//!    (coalesced, fixed-trip loads; each load per invocation still costs about 0.6 us a level
//!    on the H200, see below) against the
//!    queries in workgroup memory | per-candidate LSE over the children, summed over the heads,
//!    as an order-preserving integer key | the rank-based top-K cut (ties to the lower index),
//!    each kept node writing its children straight into the next level's slots: five
//!    barriers per level (`lse`; four for `mean`, `meanvar`), no serial loop over candidates.
//!    Where the device has subgroups ([`crate::Tuning::decode_route_subgroups`], default on;
//!    `lse`, g_q <= 8, g a power of two, subgroups of at least 8 lanes), a level takes two
//!    barriers instead (`shaders/decode_levels_sg.wgsl`): a candidate's g x LR invocations
//!    are consecutive lanes of one subgroup and sum their dot products, take the children's
//!    LSEs and add the heads by shuffles, with their query slices in registers; then each
//!    candidate's counting lanes add their rank counts by shuffles and the first writes the
//!    kept node's children, the lanes' query slices in registers where they fit (16 vec4s:
//!    g_q 4 at D 128 with 8 lanes) (route at 1M 34.2 -> 25.4 us on the H200,
//!    docs/benchmarks.md A.25).
//!    It writes g(K+1) leaf candidates and the forced leaves (`cands`, NS = g(K+1) + K slots).
//! 2. `leaf`, one workgroup of 128 (up to 256 where D/4 or g_q needs it) per (sequence, KV
//!    head, slot) (B * Hkv * NS workgroups,
//!    400 at Hkv = 8, K = 16, g = 2; empty slots exit at once), computes the slot block's
//!    online-softmax state per head (max, sum, unnormalised P.V) over its C keys: scores with
//!    LK consecutive invocations per key row (one round trip), per-head max, exponentials,
//!    P.V with invocations owning one output vec4 for a subset of the keys (their value rows
//!    loaded before the scores, so both round trips overlap); six barriers per chunk of keys
//!    (one chunk = the whole block when workgroup memory allows). Candidates are attended
//!    speculatively: g(K+1) blocks instead of K, ~2x the key/value bytes of the step, spread
//!    over the whole GPU, in exchange for no second dependent pass over the keys.
//! 3. `merge`, one workgroup of 512 (or the device's limit) per (sequence, KV head): a
//!    candidate's score is its block LSE summed over the group (exactly PISA.md 2's leaf
//!    score), the forced leaves plus the best K - forced are the selection (ascending; the
//!    rank counts split several ways per candidate), and the K blocks' states are merged
//!    (FlashDecoding: M = max m, L = sum l e^(m-M), O = sum O e^(m-M) / L) into O and LSE,
//!    the weights e^(m-M) / L computed once per (head, block) for K <= 32.
//!
//! `route` and `leaf` as one dispatch (`route_leaf`, `shaders/decode_route_leaf.wgsl`), where
//! [`crate::Tuning::decode_route_workgroups`] allows it (by default on adapters named H100 or
//! H200 only) and its workgroup memory fits ([`KvCache::route_leaf_blocks`]): NS / NB
//! workgroups per (sequence, KV head), 13 at K = 16, g = 2, each routing the token the same way
//! (copies on idle SMs cost the route nothing) and then attending NB = WR / 128 of the leaf
//! slots at once with `leaf`'s code (128 invocations a block), the first writing the slots for
//! `merge`. The step is then two dependent dispatches: 43.8 against 46.1 us at 1M on the H200
//! (docs/benchmarks.md A.28).
//!
//! And the whole split step as ONE dispatch (`route_leaf_merge`,
//! `shaders/decode_route_leaf_merge.wgsl`), where `route_leaf` runs,
//! [`crate::Tuning::decode_merge_in_route`] allows it (default on), the device has
//! `Features::MEMORY_DECORATION_COHERENT` and 13 storage buffers per stage, on Vulkan
//! ([`KvCache::merges_in_route`]): each copy, its states written, counts itself in a per-head
//! atomic (`done`, u32 `[B*Hkv]`, 0 between steps), and the last to finish runs `merge`'s cut
//! and merge over the states of all of them, read through a `@coherent` binding after a
//! device-scope barrier. A step whose query lies in one of its output buffers runs the two
//! dispatches (one would bind it read-only beside the writable outputs). On the H100 the step
//! took 44.2 against 46.4 us at 1M and 20.0 against 20.8 at 1K (docs/benchmarks.md A.81): the
//! merge's own chain in the last workgroup (about 7.5 us at 1M) stays, its dispatch is gone.
//! Vulkan only: the visibility of the other workgroups' states rests on SPIR-V's device-scope
//! barrier semantics and the `Coherent` decoration (naga's Metal barrier orders a workgroup
//! only).
//!
//! What the H200 showed about these small kernels (docs/benchmarks.md, A.6): their time
//! goes to each invocation's chain of dependent instructions, not to bandwidth. Runtime u32
//! divisions in the route (2.8 us of 38 at 1M), a serial 34-step rank loop in the cut (3.2 us),
//! and extra loads per invocation (each vec4 row load per invocation about 0.6 us a route
//! level) cost far more than a barrier (about 64 ns at 1024 invocations) or a subgroup shuffle
//! (about 21 ns); so the kernels spread loops over invocations. (Since then the route's level
//! steps on shuffles, which save three of a level's five barriers, made the step 17% faster at
//! 1M: A.25.)
//!
//! A cache whose K/V exceed one storage binding splits them over two (`leaf` reads either, the
//! writes dispatch once per shard; the fused step reads one, so such a cache runs split).
//! [`KvCache::record_steps_into`] records the steps of several caches (KV heads
//! past two bindings) in one pass, their dispatches interleaved by stage, so they run as one
//! chain of (up to) three dispatches rather than one chain per cache; even so they wait on
//! each other's barriers (two caches of 4 heads cost 15 us more per step than one of 8 at 1M
//! on the H200: docs/benchmarks.md, A.5).
//!
//! Scratch between the dispatches: `cands` (u32 `[B*Hkv, NS]`), the block states (f32
//! `[B*Hkv, NS, g_q, D+2]`) and `route_leaf_merge`'s counts (u32 `[B*Hkv]`), allocated with
//! the cache.
//!
//! f32 arithmetic throughout. Subgroup operations only in the split step's `route` where
//! [`crate::Tuning::decode_route_subgroups`] allows (any subgroup size of 8 lanes or more; a
//! candidate's lanes are consecutive invocations, which the drivers pisa runs on put in one
//! subgroup, as the prefill routing kernel assumes) and, where
//! [`crate::Tuning::decode_leaf_subgroups`] is on (off by default), in the leaf slots' block
//! attention (`shaders/decode_attend_sg.wgsl`); elsewhere none. Lengths
//! live in a storage buffer, so sequences of different lengths share the dispatches. The
//! semantics are those of `pisa_core::reference::select_pisa` at position `len - 1` (causal,
//! ancestor never scored, a level with <= K candidates keeps all; ties: higher score then lower
//! index) and of `reference::DecodeState::step`; results agree with the fused formulation
//! within f32 rounding (the attention sums per block, then across blocks).
//!
//! Requirements: D a multiple of 4 (at most 1024), g_q at most 256, the device's 9 storage
//! buffers per stage and the workgroup memory of the split kernels (about 20 KiB for g_q = 4,
//! D = 128, C = 64; the fused kernel, when it fits, about 30 KiB).

mod cache;
mod chunk;
mod fused;
mod plan;
mod shaders;

use pisa_core::{AttentionShape, PisaError, PyramidLayout, SelectionConfig};

pub use self::cache::CacheSizes;
pub use self::chunk::ChunkOutputs;
use self::fused::FusedPlan;
use self::plan::{Params, Plan};
pub use self::record::{
    route_leaves_on_this_thread, route_merges_on_this_thread, subgroup_leaves_on_this_thread,
    subgroup_routes_on_this_thread, DecodeStep, StepOutputs,
};
pub use self::shaders::{
    APPEND_SHADER, FUSED_SHADER, LENS_SHADER, MERGE_SHADER, ROUTE_LEAF_MERGE_SG_SHADER,
    ROUTE_LEAF_MERGE_SHADER, ROUTE_LEAF_SG_SHADER, ROUTE_LEAF_SHADER, ROUTE_SG_SHADER,
    ROUTE_SHADER, SHADER,
};
use crate::error::GpuError;
use crate::ops::pyramid::GpuPyramid;
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;

const APPEND_WG: u32 = 128;

/// What one decode step returns, read back to the host.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeOutput {
    /// `[B, Hq, D]` attention output (storage precision widened to f32).
    pub out: Vec<f32>,
    /// `[B, Hq]` natural-log LSE of the scaled scores attended (`-inf` for an empty sequence).
    pub lse: Vec<f32>,
    /// `[B, Hkv, K]` selected leaves, ascending, -1 padded, when asked for.
    pub selection: Option<Vec<i32>>,
}

/// A GPU KV cache of `B` sequences growing up to `capacity` tokens each, with its key pyramid.
///
/// Keys and values are stored `[B, Hkv, capacity, D]` in the storage precision (as two shards
/// of flat (sequence, KV head) rows past one storage binding); the pyramid is the prefill's
/// (PISA.md 1: mean keys per node, f32), allocated for the layout of `capacity` (a shorter
/// length's nodes are a prefix of each level), f32. Lengths are tracked per sequence on the
/// host and passed to every dispatch in a storage buffer.
///
/// # Non-finite inputs (NaN, ±inf)
///
/// [`KvCache::append`], [`KvCache::step`] and [`KvCache::append_and_step`] do not scan their
/// inputs; check them with [`crate::ops::check_finite`] (e.g. `check_finite("q", q)`, which
/// returns [`GpuError::NonFinite`] with the flat index of the first bad value) where non-finite
/// activations cannot be ruled out. Without the check, on every adapter: the calls succeed;
/// every selection is well formed (exactly `min(K, visible leaves)` leaves, ascending, the own
/// block and the other forced leaves always in it; a NaN score ranks as `-inf`, ties to the lower
/// block index); the other sequences of the batch are bitwise unaffected; the sequence's steps
/// before the bad token are unaffected; and [`KvCache::reset`] clears it. The outputs of the
/// later steps of that sequence that attend the bad key or value are unspecified. On Mesa
/// lavapipe: a NaN key gives **finite** outputs, as if the key were absent; a +inf key gives NaN,
/// zeros with LSE -inf (like an empty sequence) or finite outputs depending on the step; a NaN
/// value gives NaN; a non-finite query element makes that step's row of its head **zeros with
/// LSE -inf** (every score of the row is non-finite and ranks as -inf: it looks like an empty
/// sequence, not like NaN; test the LSE, or check the inputs). Once a bad
/// key is in the cache it also enters the pyramid means above it, so it can change the selection
/// (not only the output) of every later step of its sequence until a reset.
///
/// A cache of [`Storage::F16`] stores what it is given rounded to f16: a finite value above
/// 65504 in magnitude becomes ±inf there (and below about 6e-8 becomes 0), so such a key,
/// value or query is a non-finite input as above (an f16 value row of 1e5 makes every later
/// output of its head inf; an f16 query element of 1e6 makes the step's row of its head zeros
/// with LSE -inf). `check_finite` does not catch them: check the range, or use f32 storage.
///
/// # Recorded commands
///
/// The `record_*` methods (append, reset, prefill, take-over) change the cache's host state, its
/// lengths ([`KvCache::lens`]), when they record, and the GPU state when the encoder runs. An
/// encoder holding them must be submitted: if it is dropped instead (after an error, say), the
/// host lengths of the sequences it touched are ahead of the GPU's, and those sequences'
/// outputs are unspecified until [`KvCache::reset`] or a prefill, which set both. The other
/// sequences are unaffected: an append that would land past a sequence's capacity on the GPU
/// is skipped there, never written into another sequence's rows, and a sequence's GPU length
/// stops at the capacity, so its step never reads another sequence's rows. So after an error
/// of a later call recorded into the same encoder (a step with a misaligned output, a prefill
/// run), submit the encoder with what it holds (an erroring cache call records nothing) and
/// redo the failed call in the next one; the appends before it then count on both sides.
///
/// The calls that submit their own commands ([`KvCache::reset`], [`KvCache::append`],
/// [`KvCache::prefill`], [`KvCache::prefill_view`], [`KvCache::step`]) are queue-ordered: they
/// land before commands recorded earlier into an encoder that is submitted after them, while
/// the host lengths count in call order. So an `append` made while an encoder holds a
/// `record_append_view` of the same sequence stores its row first on the GPU, and the two
/// sides then disagree on which row is where (that sequence's outputs are unspecified until a
/// reset or prefill; nothing signals it). Submit an encoder before mixing in a submitting
/// call for the sequences it touches, or use the `record_*` forms throughout
/// ([`KvCache::record_reset`] keeps a reset in order the same way).
///
/// A cache keeps the recorded dispatches of the buffers it was given (up to 64 sets each of
/// steps, appends, and gathers or scatters of views it cannot bind), and with them references
/// to those buffers: their memory is freed when both the application and the cache have let
/// go of them (a kept set is dropped when a 65th is made, all of that kind at once).
#[derive(Debug)]
pub struct KvCache {
    ctx: Context,
    shape: AttentionShape,
    cfg: SelectionConfig,
    storage: Storage,
    layout: PyramidLayout,
    /// The limits the step's kernels are sized for: the device's, lowered by
    /// [`KvCache::set_workgroup_memory_limit`] and [`KvCache::set_workgroup_size_limit`].
    limits: wgpu::Limits,
    plan: Plan,
    /// The fused kernel's sizes, `None` when it does not fit the device.
    fplan: Option<FusedPlan>,
    /// Whether `fplan`'s loops stay within the device's cap on an invocation's loop iterations
    /// ([`fused::loops_within_cap`], computed with `fplan`).
    fused_loops_ok: bool,
    /// Whether the step runs fused (when `fplan` allows): [`crate::Tuning::decode_fused`], or
    /// [`KvCache::set_fused`].
    fused: bool,
    /// The fused step's lanes per key row asked for when the cache was made
    /// ([`crate::Tuning::decode_key_lanes`]), kept for re-planning.
    key_lanes: Option<u32>,
    /// Whether the split step's route may run its level steps on subgroup shuffles
    /// ([`crate::Tuning::decode_route_subgroups`] when the cache was made).
    route_subgroups: bool,
    /// Whether `route_leaf`'s block attention may run on subgroup shuffles
    /// ([`crate::Tuning::decode_leaf_subgroups`] when the cache was made).
    leaf_subgroups: bool,
    /// `route_leaf`'s value rows loaded with the keys
    /// ([`crate::Tuning::decode_leaf_prefetch`] when the cache was made).
    leaf_prefetch: bool,
    /// The most workgroups of a `route_leaf` dispatch ([`crate::Tuning::decode_route_workgroups`]
    /// when the cache was made).
    route_workgroups: u32,
    /// Whether `route_leaf` may merge in its last workgroup (`route_leaf_merge`):
    /// [`crate::Tuning::decode_merge_in_route`] when the cache was made, on a Vulkan device with
    /// `MEMORY_DECORATION_COHERENT` (decided once: the device does not change).
    merge_in_route: bool,
    /// `route_leaf_merge`'s counters of finished copies, u32 `[B*Hkv]`, 0 between steps.
    done: wgpu::Buffer,
    /// K/V shards `[rows, capacity, D]` each: flat (sequence, KV head) rows `i * kv_rows ..`
    /// in shard i; one shard unless the cache exceeds one storage binding, two at most.
    kv: Vec<(GpuTensor, GpuTensor)>,
    kv_rows: usize,
    pyr: GpuPyramid,
    dummy: GpuTensor,
    out: GpuTensor,
    lse: GpuTensor,
    sel: GpuTensor,
    /// `out`, `lse` and `sel` as the views [`KvCache::outputs`] lends: `[B, Hq, 1, D]`,
    /// `[B, Hq, 1, 1]`, `[B, Hkv, 1, K]`, BHND from byte 0.
    out_views: [crate::TensorView; 3],
    /// Step scratch: leaf slots `[B*Hkv, NS]` u32 and their states `[B*Hkv, NS, g_q, D+2]` f32.
    cands: GpuTensor,
    parts: GpuTensor,
    lens: Vec<usize>,
    /// Per sequence, `None` while all its KV heads hold `lens[b]` tokens; after a load of some
    /// heads ([`KvCache::record_prefill_heads`]) that left others at another length, the
    /// length each head was last loaded at: steps, appends and chunks are refused until every
    /// head holds the same (`KvCache::check_heads_loaded`).
    head_lens: Vec<Option<Vec<usize>>>,
    /// Gather targets of query, key and value views that cannot be bound in place
    /// (`[B, Hq, D]`, `[B, Hkv, D]` in storage precision).
    q_in: GpuTensor,
    k_in: GpuTensor,
    v_in: GpuTensor,
    /// The host calls' readback of O, LSE and the selection (MAP_READ; mapped and unmapped
    /// within [`KvCache::step`] and [`KvCache::append_and_step`]).
    readback: wgpu::Buffer,
    /// The lengths on the GPU, u32 `[B]`: written by the host calls that set them
    /// ([`KvCache::prefill`], [`KvCache::reset`]) and advanced by every recorded append, so the
    /// recorded steps of an inference loop need no host write.
    lens_gpu: wgpu::Buffer,
    /// The append positions, u32 `[B]`, computed on the GPU from `lens_gpu` and the mask.
    pos_gpu: wgpu::Buffer,
    /// The append mask of every sequence active, u32 `[B]` of 1 (written once): bound by an
    /// append of all sequences, and the source the partial masks are copied from.
    mask_all: wgpu::Buffer,
    /// The append mask of an append of some sequences, u32 `[B]`, set in encoder order by the
    /// append itself (`write.rs`, `record_mask`): one buffer whatever the mask, so a new mask
    /// builds nothing.
    mask_some: wgpu::Buffer,
    /// Recorded step dispatches by bound buffers (see `record.rs`).
    stage_cache: record::StageCache<record::StepIo>,
    /// Recorded append dispatches by bound buffers and whether all sequences append (see
    /// `write.rs`).
    append_cache: record::StageCache<(write::AppendIo, bool)>,
    /// Recorded gathers of input views that cannot be bound in place (see `record.rs`).
    gather_cache: record::StageCache<record::GatherKey>,
}

fn input(e: PisaError) -> GpuError {
    GpuError::Input(e)
}

mod record;
mod step;
mod write;
