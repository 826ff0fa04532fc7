//! Gather and scatter on the GPU (`shaders/gather.wgsl`): between a caller's tensor view
//! ([`TensorView`]: any strides, f32, f16 or bf16, at any byte offset that is a multiple of its
//! element size) and a contiguous BHND tensor `[B, H, N, D]` of the kernels' storage (f32,
//! f16 or bf16) at byte 0 of a buffer, converting the element type on the way. One pass over the
//! view's bytes, no host transfer.
//!
//! Conversions are integer operations on the bits (the shader needs no SHADER_F16): f16 -> f32
//! and bf16 -> f32 are exact; f32 -> f16 and f32 -> bf16 round to nearest even, as
//! `half::f16::from_f32` and `half::bf16::from_f32` do (overflow gives infinity, NaN stays NaN);
//! bf16 -> f16 and f16 -> bf16 round the exact f32 value once; f32 -> f32 and f16 -> f16 copy
//! the bits. i32 views (indices) are copied word for word to and from f32 storage.
//!
//! Bindings: the view is bound from its offset rounded down to the device's
//! `min_storage_buffer_offset_alignment` (the rest of the offset is passed in elements), so an
//! unaligned view (a packed QKV projection's K part, say) needs no copy first. A tensor whose
//! view or contiguous side spans more than [`Context::max_binding_bytes`] is split into boxes
//! (whole batches, else heads of one batch, else tokens of one head), one dispatch each, each
//! binding only the part it reads and writes; a single row (`D` elements) that does not fit is
//! a [`GpuError::Limit`].

use bytemuck::{Pod, Zeroable};

use crate::error::{GpuError, Result};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};
use crate::runtime::view::{DType, TensorView};

/// `shaders/gather.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "gather",
    wgsl: include_str!("../../../shaders/gather.wgsl"),
};

/// Invocations per workgroup (the shader's `@workgroup_size`).
const WG: u64 = 256;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct Params {
    /// Elements (gather, or scatter to f32) or pairs (scatter to 2 bytes) of this dispatch.
    count: u32,
    /// Invocations: `count`, or the destination words covered (gather to f16).
    units: u32,
    /// The box's first element on the contiguous side, index in its binding.
    first: u32,
    /// The box's first element on the view side, index in its binding.
    base: u32,
    d: u32,
    nn: u32,
    nh: u32,
    pad: u32,
    /// View strides in elements (0 for a dimension of extent 1 in the box).
    sb: u32,
    sh: u32,
    sn: u32,
    sd: u32,
}

/// A box of the tensor one dispatch covers: batches `b0..b0+nb`, heads `h0..h0+nh`, tokens
/// `n0..n0+nn`, all of D; always a contiguous range of the BHND order.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    b0: usize,
    h0: usize,
    n0: usize,
    nb: usize,
    nh: usize,
    nn: usize,
}

/// A buffer range to bind: byte offset and size, and the index (in elements) of the range's
/// first element from the binding's start.
#[derive(Debug, Clone, Copy)]
struct Range {
    offset: u64,
    size: u64,
    first: u64,
}

/// Where a view's elements lie: byte offset, bytes an element, shape `[B, H, N, D]` and strides
/// in elements (a [`TensorView`] without its buffer).
#[derive(Debug, Clone, Copy)]
struct Geometry {
    offset: u64,
    bytes: u64,
    shape: [usize; 4],
    strides: [usize; 4],
}

impl Geometry {
    fn of(v: &TensorView) -> Self {
        Self {
            offset: v.offset(),
            bytes: v.dtype().bytes(),
            shape: v.shape(),
            strides: v.strides(),
        }
    }
}

/// Records into `enc` a gather of every element of `src` into `dst` from byte 0, as a
/// contiguous BHND tensor `[B, H, N, D]` (`src.shape()`) of `dst_storage`: element
/// `(b, h, n, d)` at element index `((b * H + h) * N + n) * D + d`, converted from the view's
/// dtype (see the module docs for the rounding). Writes `B*H*N*D` elements of `dst` and
/// nothing else, except that with 2-byte storage (f16, bf16) and an odd element count the upper
/// half of the last word keeps its contents. Runs on the GPU when `enc` is submitted. Its
/// dispatch is built under an error scope, so a buffer the device cannot use (one of another
/// device) is an error here, with nothing recorded.
///
/// An i32 view (indices) is copied word for word into f32 storage.
///
/// Errors: [`GpuError::Unsupported`] for an i32 view with 2-byte (f16, bf16) storage; [`GpuError::View`] when `dst` lacks `STORAGE` usage, holds fewer than the tensor's
/// bytes (rounded up to 4), is the view's own buffer, or when the view's last element ends in
/// a 4-byte word past its buffer's end (a buffer whose size is not a multiple of 4);
/// [`GpuError::Limit`] when one row of the view (or of `dst`) does not fit in a storage
/// binding ([`Context::max_binding_bytes`]); [`GpuError::Validation`] for a buffer of another
/// device; [`GpuError::DeviceLost`].
pub fn record_gather(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    src: &TensorView,
    dst: &wgpu::Buffer,
    dst_storage: Storage,
) -> Result<()> {
    let _call = ctx.public_call()?;
    let stages = ctx.scope_now("gather", || gather_stages(ctx, src, dst, dst_storage))?;
    ctx.record_pass(enc, "gather", stages.iter(), None);
    Ok(())
}

/// The dispatches of [`record_gather`] (pipeline, bind group, grid), to record now or keep
/// and record again for the same view and destination (the decode step's gathered rows, which
/// are the same buffers at every step). Errors: those of [`record_gather`].
pub(crate) fn gather_stages(
    ctx: &Context,
    src: &TensorView,
    dst: &wgpu::Buffer,
    dst_storage: Storage,
) -> Result<Vec<crate::runtime::buffers::Stage>> {
    let g = Geometry::of(src);
    let [_, _, _, d] = g.shape;
    let db = dst_storage.bytes();
    let kinds = [
        ("SRC_KIND", kind(src.dtype(), dst_storage)?),
        ("DST_KIND", kind(dst_storage.into(), dst_storage)?),
    ];
    check_contiguous(dst, words(src.elems() as u64 * db), "gather destination")?;
    if dst == src.buffer() {
        return Err(GpuError::View(
            "the gather source view lies in the destination buffer".into(),
        ));
    }
    check_gather_src("src", src, dst_storage)?;

    let align = align(ctx);
    let limit = limit(ctx);
    let chunks = plan(&g, db, align, limit)?;
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "gather", Storage::F32, &[], &kinds)?;
    let mut dispatches = Vec::with_capacity(chunks.len());
    for c in chunks {
        let (view, cont) = ranges(&g, c, db, align);
        let count = (c.nb * c.nh * c.nn * d) as u64;
        let units = match dst_storage {
            Storage::F32 => count,
            Storage::F16 | Storage::Bf16 => ((cont.first + count - 1) >> 1) - (cont.first >> 1) + 1,
        };
        let p = params(c, d, g.strides, count, units, cont.first, view.first)?;
        dispatches.push((p, view, cont, units));
    }
    stages(ctx, "gather", &pipe, (src.buffer(), (dst, 2)), &dispatches)
}

/// Records into `enc` a scatter of `src` (a contiguous BHND tensor `[B, H, N, D]` of
/// `src_storage` from byte 0, `dst.shape()`) into the caller's view `dst`, converting to the
/// view's dtype: f32 exactly (from f16, or the bits from f32), f16 and bf16 rounded to nearest
/// even. Writes exactly the view's elements: the rest of the view's buffer is left as it was.
///
/// A 2-byte view is written in whole 4-byte words, pairs of elements `(d, d + 1)`, `d` even,
/// so no two invocations write halves of one word: it needs an even D, a D stride of 1, a byte
/// offset that is a multiple of 4 (an even element offset) and even strides for every other
/// dimension of extent above 1. An f32 view may have any strides. An i32 view (indices)
/// takes the words of f32 storage unchanged.
///
/// Errors: [`GpuError::Unsupported`] for an i32 view with 2-byte (f16, bf16) storage; [`GpuError::View`] for a 2-byte view that breaks those conditions (the message says
/// which), a `src` without `STORAGE` usage or holding fewer than the tensor's bytes (rounded up
/// to 4), a `src` that is the view's own buffer, a view whose last element ends in a 4-byte
/// word past its buffer's end; [`GpuError::Limit`] when one row does not fit in a storage
/// binding; [`GpuError::Validation`] for a buffer of another device (built under an error
/// scope, nothing recorded); [`GpuError::DeviceLost`].
pub fn record_scatter(
    ctx: &Context,
    enc: &mut wgpu::CommandEncoder,
    src: &wgpu::Buffer,
    src_storage: Storage,
    dst: &TensorView,
) -> Result<()> {
    let _call = ctx.public_call()?;
    let stages = ctx.scope_now("scatter", || scatter_stages(ctx, src, src_storage, dst))?;
    ctx.record_pass(enc, "scatter", stages.iter(), None);
    Ok(())
}

/// The dispatches of [`record_scatter`], to record now or keep and record again for the same
/// source and view (a decode step's outputs written into views it cannot bind). Errors: those
/// of [`record_scatter`].
pub(crate) fn scatter_stages(
    ctx: &Context,
    src: &wgpu::Buffer,
    src_storage: Storage,
    dst: &TensorView,
) -> Result<Vec<crate::runtime::buffers::Stage>> {
    let g = Geometry::of(dst);
    let [_, _, _, d] = g.shape;
    let sb = src_storage.bytes();
    let kinds = [
        ("SRC_KIND", kind(src_storage.into(), src_storage)?),
        ("DST_KIND", kind(dst.dtype(), src_storage)?),
    ];
    check_contiguous(src, words(dst.elems() as u64 * sb), "scatter source")?;
    if src == dst.buffer() {
        return Err(GpuError::View(
            "the scatter destination view lies in the source buffer".into(),
        ));
    }
    check_scatter_dst("dst", src_storage, dst)?;

    let align = align(ctx);
    let limit = limit(ctx);
    let chunks = plan(&g, sb, align, limit)?;
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "scatter", Storage::F32, &[], &kinds)?;
    let mut dispatches = Vec::with_capacity(chunks.len());
    for c in chunks {
        let (view, cont) = ranges(&g, c, sb, align);
        let elems = (c.nb * c.nh * c.nn * d) as u64;
        let count = if g.bytes == 2 { elems / 2 } else { elems };
        let p = params(c, d, g.strides, count, count, cont.first, view.first)?;
        dispatches.push((p, cont, view, count));
    }
    stages(ctx, "scatter", &pipe, (src, (dst.buffer(), 2)), &dispatches)
}

/// The shader's code of the view's element type `d`, the contiguous side being of `storage`:
/// f32, f16 and bf16 are converted; i32 (indices) is copied word for word to or from f32
/// storage (whose 4-byte elements then hold the integers), and refused with f16 storage
/// ([`GpuError::Unsupported`]).
fn kind(d: DType, storage: Storage) -> Result<f64> {
    match (d, storage) {
        (DType::F32, _) | (DType::I32, Storage::F32) => Ok(0.0),
        (DType::F16, _) => Ok(1.0),
        (DType::BF16, _) => Ok(2.0),
        (DType::I32, Storage::F16 | Storage::Bf16) => Err(GpuError::Unsupported(
            "gather and scatter between i32 views and 2-byte storage (i32 is copied to and from \
             f32 storage only)"
                .into(),
        )),
    }
}

/// The checks of [`record_scatter`] on its destination alone (its conversion from
/// `src_storage`, its extent, the pairs of a 2-byte view; a view's buffer has `STORAGE` usage
/// by construction), for callers that check their outputs before recording anything, and for
/// [`record_scatter`] itself. Errors as [`record_scatter`]'s for `dst`.
pub(crate) fn check_scatter_dst(name: &str, src_storage: Storage, dst: &TensorView) -> Result<()> {
    kind(dst.dtype(), src_storage)?;
    check_view_end(dst, name, "scatter destination")?;
    if dst.dtype().bytes() == 2 {
        check_pairs(dst)?;
    }
    Ok(())
}

/// The checks of [`record_gather`] on its source alone (its conversion into `dst_storage`, its
/// extent), for callers that check their inputs before recording anything, and for
/// [`record_gather`] itself. Errors as
/// [`record_gather`]'s for `src`.
pub(crate) fn check_gather_src(name: &str, src: &TensorView, dst_storage: Storage) -> Result<()> {
    kind(src.dtype(), dst_storage)?;
    check_view_end(src, name, "gather source")
}

/// `bytes` rounded up to whole 4-byte words.
fn words(bytes: u64) -> u64 {
    bytes.div_ceil(4) * 4
}

/// Binding offset alignment (at least a word: the shader indexes words).
fn align(ctx: &Context) -> u64 {
    (ctx.limits().min_storage_buffer_offset_alignment as u64).max(4)
}

/// Largest binding planned with: the context's, and below 4 GiB so that every element index
/// inside a binding fits the shader's u32.
fn limit(ctx: &Context) -> u64 {
    ctx.max_binding_bytes().min(u32::MAX as u64) / 4 * 4
}

/// The contiguous side: a storage buffer of at least `need` bytes.
fn check_contiguous(buf: &wgpu::Buffer, need: u64, what: &str) -> Result<()> {
    if !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
        return Err(GpuError::View(format!(
            "the {what} buffer was not created with BufferUsages::STORAGE (it has {:?})",
            buf.usage()
        )));
    }
    if buf.size() < need {
        return Err(GpuError::View(format!(
            "the {what} buffer holds {} bytes, the contiguous tensor needs {need}",
            buf.size()
        )));
    }
    Ok(())
}

/// The view's last element lies in a whole 4-byte word of its buffer (bindings are words).
fn check_view_end(v: &TensorView, name: &str, what: &str) -> Result<()> {
    let last: u64 = (v.shape().iter().zip(v.strides()))
        .map(|(&n, s)| (n as u64 - 1) * s as u64)
        .sum();
    let end = v.offset() + (last + 1) * v.dtype().bytes();
    if words(end) > v.buffer().size() {
        return Err(GpuError::View(format!(
            "{name}: the {what} view ends at byte {end} of a {}-byte buffer, inside its last, partial \
             4-byte word; views are bound in whole words (make the buffer's size a multiple of 4)",
            v.buffer().size()
        )));
    }
    Ok(())
}

/// A 2-byte scatter destination is written in whole words: pairs along D.
fn check_pairs(v: &TensorView) -> Result<()> {
    let [_, _, _, d] = v.shape();
    let s = v.strides();
    let why = if !d.is_multiple_of(2) {
        format!("its head dim D = {d} is odd")
    } else if s[3] != 1 {
        format!("its D stride is {}, not 1", s[3])
    } else if !v.offset().is_multiple_of(4) {
        format!(
            "its byte offset {} is not a multiple of 4 (an odd element offset)",
            v.offset()
        )
    } else if let Some(i) = (0..3).find(|&i| v.shape()[i] > 1 && !s[i].is_multiple_of(2)) {
        format!(
            "its {} stride {} is odd",
            ["batch", "head", "token"][i],
            s[i]
        )
    } else {
        return Ok(());
    };
    Err(GpuError::View(format!(
        "a scatter destination of {} is written in whole 4-byte words (pairs of elements along \
         D), which needs an even D, a D stride of 1, an even element offset and even strides \
         elsewhere, but {why}",
        format!("{:?}", v.dtype()).to_lowercase()
    )))
}

/// The boxes the tensor is split into so that each dispatch's bindings (the view's span of the
/// box, and the contiguous side's, `cb` bytes an element, from byte 0, each aligned
/// down to `align` and rounded up to a word) fit in `limit` bytes: the whole tensor if it fits,
/// else runs of whole batches, else runs of heads of one batch, else runs of tokens of one
/// (batch, head). Error: [`GpuError::Limit`] when a single row does not fit.
fn plan(g: &Geometry, cb: u64, align: u64, limit: u64) -> Result<Vec<Chunk>> {
    let (shape, strides, vb) = (g.shape, g.strides, g.bytes);
    let d = shape[3] as u64;
    // Elements spanned by a box of extents `e` (b, h, n) and all of D.
    let span = |e: [u64; 3]| -> u64 {
        (0..3).map(|i| (e[i] - 1) * strides[i] as u64).sum::<u64>()
            + (d - 1) * strides[3] as u64
            + 1
    };
    let ext = shape.map(|x| x as u64);
    let whole = [ext[0], ext[1], ext[2]];
    // Worst case of the alignment slack (below `align`) and the rounding up to a word.
    let slack = align + 4;
    let fits_whole =
        slack + span(whole) * vb <= limit && words(whole.iter().product::<u64>() * d * cb) <= limit;
    let whole_chunk = Chunk {
        b0: 0,
        h0: 0,
        n0: 0,
        nb: shape[0],
        nh: shape[1],
        nn: shape[2],
    };
    if fits_whole {
        return Ok(vec![whole_chunk]);
    }
    let avail = limit.saturating_sub(slack);
    for c in 0..3 {
        // Dimensions before `c` one at a time, `c` in runs of k, the later ones whole.
        let mut inner = whole;
        for e in inner.iter_mut().take(c + 1) {
            *e = 1;
        }
        let inner_span = span(inner);
        let inner_elems = inner.iter().product::<u64>() * d;
        let s = strides[c] as u64;
        let k_view = if inner_span * vb > avail {
            0
        } else if ext[c] == 1 || s == 0 {
            ext[c]
        } else {
            (avail / vb - inner_span) / s + 1
        };
        let k = ext[c].min(k_view).min(avail / (inner_elems * cb));
        if k == 0 {
            continue;
        }
        let k = k as usize;
        let mut chunks = Vec::new();
        let outer_b = if c == 0 { 1 } else { shape[0] };
        let outer_h = if c <= 1 { 1 } else { shape[1] };
        for b in 0..outer_b {
            for h in 0..outer_h {
                for start in (0..shape[c]).step_by(k) {
                    let len = k.min(shape[c] - start);
                    let mut ch = whole_chunk;
                    match c {
                        0 => (ch.b0, ch.nb) = (start, len),
                        1 => (ch.b0, ch.nb, ch.h0, ch.nh) = (b, 1, start, len),
                        _ => (ch.b0, ch.nb, ch.h0, ch.nh, ch.n0, ch.nn) = (b, 1, h, 1, start, len),
                    }
                    chunks.push(ch);
                }
            }
        }
        return Ok(chunks);
    }
    let row = (d - 1) * strides[3] as u64 + 1;
    Err(GpuError::Limit {
        what: format!(
            "one row of a [.., .., .., {d}] tensor view with D stride {}",
            strides[3]
        ),
        needed: slack + (row * vb).max(d * cb),
        limit,
        unit: "bytes",
        hint: "use a smaller head dim or a denser layout",
    })
}

/// The ranges a dispatch of box `c` binds: the view's span of the box and the contiguous
/// side's (`cb` bytes an element, from byte 0), each from its first byte aligned down to
/// `align`, to its end rounded up to a word.
fn ranges(g: &Geometry, c: Chunk, cb: u64, align: u64) -> (Range, Range) {
    let [_, h, n, d] = g.shape.map(|x| x as u64);
    let s = g.strides.map(|x| x as u64);
    let e = [c.nb, c.nh, c.nn].map(|x| x as u64);
    let first = c.b0 as u64 * s[0] + c.h0 as u64 * s[1] + c.n0 as u64 * s[2];
    let span = (0..3).map(|i| (e[i] - 1) * s[i]).sum::<u64>() + (d - 1) * s[3] + 1;
    let view = range(g.offset + first * g.bytes, span, g.bytes, align);
    let cfirst = ((c.b0 as u64 * h + c.h0 as u64) * n + c.n0 as u64) * d;
    let cont = range(cfirst * cb, e.iter().product::<u64>() * d, cb, align);
    (view, cont)
}

/// The binding of `elems` elements of `bytes` each from byte `start`.
fn range(start: u64, elems: u64, bytes: u64, align: u64) -> Range {
    let offset = start / align * align;
    Range {
        offset,
        size: words(start + elems * bytes) - offset,
        first: (start - offset) / bytes,
    }
}

/// The shader's parameters of box `c`.
fn params(
    c: Chunk,
    d: usize,
    strides: [usize; 4],
    count: u64,
    units: u64,
    first: u64,
    base: u64,
) -> Result<Params> {
    let u = |x: u64| {
        u32::try_from(x).map_err(|_| GpuError::Limit {
            what: "an element index inside one gather binding".into(),
            needed: x,
            limit: u32::MAX as u64,
            unit: "elements",
            hint: "split the call into fewer heads or a shorter sequence",
        })
    };
    // A stride only counts where the box has more than one index.
    let stride = |ext: usize, s: usize| if ext > 1 { s as u64 } else { 0 };
    Ok(Params {
        count: u(count)?,
        units: u(units)?,
        first: u(first)?,
        base: u(base)?,
        d: u(d as u64)?,
        nn: u(c.nn as u64)?,
        nh: u(c.nh as u64)?,
        pad: 0,
        sb: u(stride(c.nb, strides[0]))?,
        sh: u(stride(c.nh, strides[1]))?,
        sn: u(stride(c.nn, strides[2]))?,
        sd: u(stride(d, strides[3]))?,
    })
}

/// Opt-in finiteness check of a tensor view on the GPU (the GPU-side twin of
/// [`crate::ops::check_finite`], for inputs that live in an application's buffers): one pass
/// over the view's elements (f32, f16 or bf16, any strides, split past the storage binding
/// limit as a gather is), then a read back of one word per box. `Ok` when every element is
/// finite; [`GpuError::NonFinite`] naming `tensor`, the first NaN or infinite element's flat
/// index in BHND order (`((b * H + h) * N + n) * D + d` of the view's `[B, H, N, D]`) and its
/// value (NaN, `inf` or `-inf`). It waits for the GPU (work submitted before it runs first);
/// on wasm32, where nothing may block, [`check_finite_view_async`].
///
/// Errors besides: [`GpuError::View`] for an integer (i32) view, or one ending in a word past
/// its buffer's end; [`GpuError::Validation`] for a
/// view in another device's buffer; [`GpuError::Limit`] for a row past a binding;
/// [`GpuError::Unsupported`] on wasm32; those of [`Context::read_bytes`].
pub fn check_finite_view(ctx: &Context, tensor: &'static str, view: &TensorView) -> Result<()> {
    let (found, starts) = {
        let _call = ctx.public_call()?;
        record_find(ctx, tensor, view)?
    };
    first_nonfinite(tensor, &ctx.read_bytes(&found)?, &starts)
}

/// [`check_finite_view`] without blocking: resolves once the read back is done (natively the
/// future polls the device itself, as [`Context::read_async`]). Errors: those of
/// [`check_finite_view`], less the wasm32 one.
pub async fn check_finite_view_async(
    ctx: &Context,
    tensor: &'static str,
    view: &TensorView,
) -> Result<()> {
    let (found, starts) = {
        let _call = ctx.public_call()?;
        record_find(ctx, tensor, view)?
    };
    let words = TensorView::contiguous(
        &found,
        0,
        DType::I32,
        [1, 1, 1, starts.len()],
        pisa_core::TensorLayout::Bhnd,
    )?;
    let bytes = ctx.read_async(&words).await?;
    first_nonfinite(tensor, &bytes, &starts)
}

/// Submits the find pass of [`check_finite_view`]: the buffer of one result word per box, and
/// each box's first element in BHND order.
fn record_find(
    ctx: &Context,
    tensor: &'static str,
    view: &TensorView,
) -> Result<(wgpu::Buffer, Vec<u64>)> {
    if view.dtype() == DType::I32 {
        return Err(GpuError::View(format!(
            "{tensor}: a finiteness check of an integer (i32) view"
        )));
    }
    check_view_end(view, tensor, "checked")?;
    // Under one error scope: a view in another device's buffer is a Validation error of the
    // call (its bind group), not a panic of wgpu's default handler.
    ctx.scope_now("finiteness check", || find_pass(ctx, view))
}

/// [`record_find`]'s pass, built and submitted.
fn find_pass(ctx: &Context, view: &TensorView) -> Result<(wgpu::Buffer, Vec<u64>)> {
    let g = Geometry::of(view);
    let [_, h, n, d] = g.shape.map(|x| x as u64);
    let align = align(ctx);
    let chunks = find_plan(&g, align, limit(ctx))?;
    let kinds = [
        ("SRC_KIND", kind(view.dtype(), Storage::F32)?),
        ("DST_KIND", 0.0),
    ];
    let pipe = (ctx.pipelines).get(
        &ctx.device,
        &SHADER,
        "find_nonfinite",
        Storage::F32,
        &[],
        &kinds,
    )?;
    let found = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("non-finite search"),
        size: chunks.len() as u64 * 4,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    ctx.queue
        .write_buffer(&found, 0, &vec![0xFF; chunks.len() * 4]);
    // One result word per box, bound whole at binding 3 (find_plan keeps each box's key
    // below 2^32: see there).
    let whole = Range {
        offset: 0,
        size: found.size(),
        first: 0,
    };
    let mut starts = Vec::with_capacity(chunks.len());
    let mut dispatches = Vec::with_capacity(chunks.len());
    for (i, c) in chunks.into_iter().enumerate() {
        let (vr, _) = ranges(&g, c, 1, align);
        let count = (c.nb * c.nh * c.nn) as u64 * d;
        starts.push(((c.b0 as u64 * h + c.h0 as u64) * n + c.n0 as u64) * d);
        let p = params(c, d as usize, g.strides, count, count, i as u64, vr.first)?;
        dispatches.push((p, vr, whole, count));
    }
    let bind = (view.buffer(), (&found, 3));
    let stages = stages(ctx, "find_nonfinite", &pipe, bind, &dispatches)?;
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    ctx.record_pass(&mut enc, "find_nonfinite", stages.iter(), None);
    ctx.queue.submit([enc.finish()]);
    Ok((found, starts))
}

/// The boxes of the finiteness check. No contiguous side is bound; planning as if it were 4
/// bytes an element bounds a box to fewer than 2^30 elements (4 per element within a binding
/// below 4 GiB), so that the shader's key (l << 2 | class) fits a word whatever the view's
/// element size.
fn find_plan(g: &Geometry, align: u64, limit: u64) -> Result<Vec<Chunk>> {
    plan(g, 4, align, limit)
}

/// The first non-finite element of the boxes' result words (`starts`: each box's first
/// element in BHND order), as [`GpuError::NonFinite`].
fn first_nonfinite(tensor: &'static str, bytes: &[u8], starts: &[u64]) -> Result<()> {
    let words: &[u32] = bytemuck::cast_slice(bytes);
    match (words.iter().zip(starts)).find(|(w, _)| **w != u32::MAX) {
        None => Ok(()),
        Some((w, start)) => Err(GpuError::NonFinite {
            tensor,
            index: (start + (*w >> 2) as u64) as usize,
            value: [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(*w & 3).min(2) as usize],
        }),
    }
}

/// The dispatches of a gather, scatter or finiteness check, to record in order as one compute
/// pass: each binds its parameters, its range of `src` (binding 1) and of `dst` (at binding
/// `dst_binding`: 2, or 3 for the check's result words), and runs `units` invocations (the
/// grid split past the per-dimension workgroup limit).
fn stages<'a>(
    ctx: &Context,
    label: &'static str,
    pipe: &std::sync::Arc<wgpu::ComputePipeline>,
    (src, (dst, dst_binding)): (&'a wgpu::Buffer, (&'a wgpu::Buffer, u32)),
    dispatches: &[(Params, Range, Range, u64)],
) -> Result<Vec<crate::runtime::buffers::Stage>> {
    let layout = pipe.get_bind_group_layout(0);
    let max_dim = ctx.limits().max_compute_workgroups_per_dimension;
    let mut stages = Vec::with_capacity(dispatches.len());
    for (p, s, d, units) in dispatches {
        let u = ctx.uniform("gather params", p)?;
        let part = |buffer: &'a wgpu::Buffer, r: &Range| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset: r.offset,
                size: wgpu::BufferSize::new(r.size),
            })
        };
        let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &layout,
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: u.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: part(src, s),
                },
                wgpu::BindGroupEntry {
                    binding: dst_binding,
                    resource: part(dst, d),
                },
            ],
        });
        let grid = pisa_core::grid_for(units.div_ceil(WG), max_dim)?;
        stages.push((pipe.clone(), bg, grid));
    }
    Ok(stages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random views (shapes, permuted strides with gaps, offsets), element sizes, alignments
    /// and limits: a plan's boxes are consecutive ranges of the BHND order covering every
    /// element once, each binding aligned, whole words, within the limit and holding the box's
    /// elements; a plan fails (with [`GpuError::Limit`]) only where one row does not fit.
    #[test]
    fn plans_tile_the_tensor_within_the_limit() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        eprintln!("seed {seed}");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..3000 {
            let shape = [
                rng.random_range(1..5),
                rng.random_range(1..6),
                rng.random_range(1..40),
                rng.random_range(1..10),
            ];
            // Strides of a random nesting order, each dimension with a gap after it.
            let mut order = [0usize, 1, 2, 3];
            for i in (1..4).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
            let mut strides = [0usize; 4];
            let mut step = 1;
            for &i in order.iter().rev() {
                strides[i] = step;
                step = step * shape[i] + rng.random_range(0..3);
            }
            let bytes = [2u64, 4][rng.random_range(0..2)];
            let cb = [2u64, 4][rng.random_range(0..2)];
            let align = [4u64, 32, 256][rng.random_range(0..3)];
            let g = Geometry {
                offset: rng.random_range(0..500u64) * bytes,
                bytes,
                shape,
                strides,
            };
            let elems: u64 = shape.iter().map(|&x| x as u64).product();
            let limit = rng.random_range(64..(step as u64 * bytes + 600)) / 4 * 4;
            let d = shape[3] as u64;
            let row = (d - 1) * strides[3] as u64 + 1;
            let what = format!("{g:?} cb {cb} align {align} limit {limit}");
            match plan(&g, cb, align, limit) {
                Ok(chunks) => {
                    let mut next = 0u64;
                    for c in chunks {
                        let (view, cont) = ranges(&g, c, cb, align);
                        for r in [view, cont] {
                            assert_eq!(r.offset % align, 0, "{what}: {c:?}");
                            assert_eq!(r.size % 4, 0, "{what}: {c:?}");
                            assert!(r.size <= limit, "{what}: {c:?} binds {r:?}");
                        }
                        let count = (c.nb * c.nh * c.nn) as u64 * d;
                        assert_eq!(cont.offset + cont.first * cb, next * cb, "{what}: {c:?}");
                        assert!(cont.first * cb + count * cb <= cont.size, "{what}: {c:?}");
                        let e = [c.nb, c.nh, c.nn, shape[3]];
                        let last: u64 = (0..4).map(|i| ((e[i] - 1) * strides[i]) as u64).sum();
                        assert!(
                            view.first * bytes + (last + 1) * bytes <= view.size,
                            "{what}"
                        );
                        let o = [c.b0, c.h0, c.n0];
                        let first: u64 = (0..3).map(|i| (o[i] * strides[i]) as u64).sum();
                        assert_eq!(
                            view.offset + view.first * bytes,
                            g.offset + first * bytes,
                            "{what}: {c:?}"
                        );
                        next += count;
                    }
                    assert_eq!(next, elems, "{what}");
                }
                Err(GpuError::Limit { .. }) => assert!(
                    align + 4 + (row * bytes).max(d * cb) > limit,
                    "{what}: refused though a row fits"
                ),
                Err(e) => panic!("{what}: {e}"),
            }
        }
    }

    /// The finiteness check's boxes stay below 2^30 elements (the shader's key bound) for a
    /// 2-byte view under the largest binding limit (4 GiB less 4, as on Metal with large
    /// buffers): a contiguous f16 view of 2^30 + 4096 elements is split, not one box.
    #[test]
    fn find_boxes_stay_below_the_key_bound() {
        let n = (1usize << 30) / 256 + 16;
        let g = Geometry {
            offset: 0,
            bytes: 2,
            shape: [1, 1, n, 256],
            strides: [n * 256, n * 256, 256, 1],
        };
        let chunks = find_plan(&g, 256, u32::MAX as u64 / 4 * 4).unwrap();
        assert!(chunks.len() > 1);
        for c in chunks {
            assert!(((c.nb * c.nh * c.nn) as u64 * 256) < 1 << 30, "{c:?}");
        }
    }
}
