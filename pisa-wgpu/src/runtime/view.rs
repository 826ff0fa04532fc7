//! Tensor views: a tensor of the caller's inside a `wgpu::Buffer` the caller owns, given by byte
//! offset, logical shape `[B, H, N, D]`, element strides and element type ([`DType`]).
//!
//! A view is checked once, at construction, against its buffer (usage, extent, alignment of its
//! elements); what an operation can bind in place is then decided by
//! the operation: a view of the kernels' storage type whose byte offset is a multiple of the
//! device's `min_storage_buffer_offset_alignment` is bound at its offset without a copy where
//! the operation's kernels can address its strides (a prefill plan reads strided views, a
//! packed QKV projection included: `PrefillPlan`, "How the inputs are read"; a decode step
//! binds contiguous ones); any other view (another dtype, an unaligned offset) is gathered on
//! the GPU into the operation's contiguous scratch by `ops::gather` (one pass over the view's
//! bytes, no host transfer).
//!
//! Which device a buffer belongs to cannot be read from a `wgpu::Buffer`. Views are checked by
//! wgpu itself when they are bound, an output a plan only copies into by a zero-byte queue
//! write (wgpu validates recorded copies only when the encoder finishes), and a buffer read
//! back by finishing the copy's encoder in the read's error scope: a buffer of another device
//! of the same instance is a validation error, which the operations return as
//! [`GpuError::Validation`] (never a panic, never the wrong buffer). Buffers of a different
//! `wgpu::Instance` are the one case wgpu cannot tell apart (its ids are per instance);
//! [`crate::Context::from_device`] makes the context on the application's own device, so an
//! application that creates its buffers with that device (`ctx.device()`) never has such a
//! buffer.

use pisa_core::{PisaError, TensorLayout};

use crate::error::{GpuError, Result};
use crate::runtime::pipeline::Storage;

/// Element type of a tensor in a caller's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision, 4 bytes.
    F32,
    /// IEEE half precision, 2 bytes (binding in place needs SHADER_F16).
    F16,
    /// bfloat16, 2 bytes (the upper half of an f32): read in place by bf16 storage
    /// ([`Storage::Bf16`]), converted on the GPU to f32 (exactly) or f16 storage by
    /// `ops::gather`.
    BF16,
    /// 32-bit signed integers: selections (block indices, -1 padded).
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The kernels' storage type this dtype is bound as without conversion, if any.
    pub fn storage(self) -> Option<Storage> {
        match self {
            DType::F32 => Some(Storage::F32),
            DType::F16 => Some(Storage::F16),
            DType::BF16 => Some(Storage::Bf16),
            DType::I32 => None,
        }
    }
}

impl From<Storage> for DType {
    fn from(s: Storage) -> Self {
        match s {
            Storage::F32 => DType::F32,
            Storage::F16 => DType::F16,
            Storage::Bf16 => DType::BF16,
        }
    }
}

/// A 4-D tensor `[B, H, N, D]` (batch, heads, tokens, head dim) in a caller's buffer:
/// element `(b, h, n, d)` is at byte `offset + (b*sb + h*sh + n*sn + d*sd) * dtype.bytes()`.
///
/// The buffer is shared (a `wgpu::Buffer` clone is a reference), so the caller keeps using it;
/// pisa reads (inputs) or writes (outputs) only the view's elements. Made with
/// [`TensorView::new`] (any strides) or [`TensorView::contiguous`] (BHND or BNHD).
///
/// Buffer usages: every view's buffer needs `STORAGE` (checked here: [`GpuError::View`]);
/// an output's buffer may have `COPY_DST` too, which lets a plan write a contiguous output by
/// a buffer copy instead of a scatter pass (either way the same values); reading a view back
/// ([`crate::Context::read_bytes`], [`crate::Context::read_async`]) needs `COPY_SRC`.
///
/// ```
/// # fn main() -> Result<(), pisa_wgpu::GpuError> {
/// use pisa_wgpu::{wgpu, DType, TensorView};
/// # let ctx = match pisa_wgpu::Context::new(&pisa_wgpu::AdapterChoice::HighPerformance) { Ok(c) => c, Err(_) => return Ok(()) };
/// // A packed QKV projection of 100 tokens: each row holds Hq = 4 query heads, then
/// // Hkv = 2 key heads, then 2 value heads, of D = 32 f32 each.
/// let (t, hq, hkv, d) = (100usize, 4usize, 2usize, 32usize);
/// let row = (hq + 2 * hkv) * d;
/// let qkv = ctx.device().create_buffer(&wgpu::BufferDescriptor {
///     label: Some("qkv"),
///     size: (t * row * 4) as u64,
///     usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
///     mapped_at_creation: false,
/// });
/// // [B, H, N, D] strides in elements: a head is D apart, a token a row apart.
/// let q = TensorView::new(&qkv, 0, DType::F32, [1, hq, t, d], [t * row, d, row, 1])?;
/// let k = TensorView::new(&qkv, (hq * d * 4) as u64, DType::F32, [1, hkv, t, d], [t * row, d, row, 1])?;
/// assert!(!k.is_contiguous());
/// # let _ = q; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct TensorView {
    buffer: wgpu::Buffer,
    offset: u64,
    dtype: DType,
    shape: [usize; 4],
    strides: [usize; 4],
}

/// How a kernel addresses a `[B, H, N, D]` tensor of its storage type: a contiguous layout,
/// or explicit element strides (batch, head, token; the head-dim stride is 1), as a view of a
/// caller's buffer read in place has them (a packed QKV projection's Q, K or V, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelLayout {
    /// Contiguous BHND or BNHD.
    Contiguous(TensorLayout),
    /// Element strides of the batch, head and token dimensions.
    Strided {
        /// Batch stride, elements.
        batch: usize,
        /// Head stride, elements.
        head: usize,
        /// Token stride, elements.
        token: usize,
    },
}

impl Default for KernelLayout {
    fn default() -> Self {
        KernelLayout::Contiguous(TensorLayout::Bhnd)
    }
}

impl From<TensorLayout> for KernelLayout {
    fn from(l: TensorLayout) -> Self {
        KernelLayout::Contiguous(l)
    }
}

impl KernelLayout {
    /// Element strides `(batch, head, token)` of a tensor of `heads` heads, `tokens` tokens and
    /// head dim `dim` (the explicit ones when strided).
    pub fn strides(self, heads: usize, tokens: usize, dim: usize) -> (usize, usize, usize) {
        match self {
            KernelLayout::Contiguous(l) => l.strides(heads, tokens, dim),
            KernelLayout::Strided { batch, head, token } => (batch, head, token),
        }
    }

    /// The contiguous layout, if it is one.
    pub fn contiguous(self) -> Option<TensorLayout> {
        match self {
            KernelLayout::Contiguous(l) => Some(l),
            KernelLayout::Strided { .. } => None,
        }
    }

    /// Elements from the first to one past the last element of a `[batch, heads, tokens, dim]`
    /// tensor in this layout (the element count when contiguous); `usize::MAX` (a length no
    /// buffer has) where [`Self::checked_span`] is `None`.
    pub fn span(self, batch: usize, heads: usize, tokens: usize, dim: usize) -> usize {
        self.checked_span(batch, heads, tokens, dim)
            .unwrap_or(usize::MAX)
    }

    /// [`Self::span`], or `None` for a zero batch, head or token count or a span past `usize`
    /// (sizes from public fields, which nothing has checked yet).
    pub fn checked_span(
        self,
        batch: usize,
        heads: usize,
        tokens: usize,
        dim: usize,
    ) -> Option<usize> {
        let (sb, sh, sn) = self.strides(heads, tokens, dim);
        [
            batch.checked_sub(1)?.checked_mul(sb),
            heads.checked_sub(1)?.checked_mul(sh),
            tokens.checked_sub(1)?.checked_mul(sn),
            Some(dim),
        ]
        .into_iter()
        .try_fold(0usize, |acc, x| acc.checked_add(x?))
    }
}

/// A buffer range to bind in place: the buffer, its byte offset and size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct InPlace {
    pub buffer: wgpu::Buffer,
    pub offset: u64,
    pub size: u64,
}

impl InPlace {
    /// The range of a whole buffer (the library's own tensors).
    pub(crate) fn whole(buffer: &wgpu::Buffer) -> Self {
        Self {
            buffer: buffer.clone(),
            offset: 0,
            size: buffer.size(),
        }
    }
}

impl TensorView {
    /// A view of `buffer` from byte `offset` with `shape` `[B, H, N, D]` and `strides` in
    /// elements. Errors ([`GpuError::Input`] or [`GpuError::View`]): a zero dimension; a
    /// buffer without `STORAGE` usage; an offset that is not a multiple of the element size
    /// (4 bytes for f32, 2 for f16 and bf16); a last element past the buffer's end; strides
    /// that make two elements overlap (checked as: each stride at least the extent of the
    /// dimensions it nests, in some order). A view whose last element lies inside the last,
    /// partial 4-byte word of a buffer whose size is not a multiple of 4 is accepted here and
    /// refused ([`GpuError::View`]) by the operations that use it, which bind whole words.
    pub fn new(
        buffer: &wgpu::Buffer,
        offset: u64,
        dtype: DType,
        shape: [usize; 4],
        strides: [usize; 4],
    ) -> Result<Self> {
        if let Some(i) = shape.iter().position(|&s| s == 0) {
            return Err(GpuError::Input(PisaError::Zero {
                what: ["view batch", "view heads", "view tokens", "view head dim"][i],
            }));
        }
        if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
            return Err(GpuError::View(format!(
                "the buffer was not created with BufferUsages::STORAGE (it has {:?})",
                buffer.usage()
            )));
        }
        if !offset.is_multiple_of(dtype.bytes()) {
            return Err(GpuError::View(format!(
                "byte offset {offset} is not a multiple of the {dtype:?} element size ({})",
                dtype.bytes()
            )));
        }
        // Non-overlap: sorted by stride, each stride covers the span of the smaller ones.
        let mut dims: [(usize, usize); 4] = core::array::from_fn(|i| (strides[i], shape[i]));
        dims.sort_unstable();
        let mut span = 1usize;
        for (st, n) in dims {
            if n > 1 && st < span {
                return Err(GpuError::View(format!(
                    "strides {strides:?} overlap for shape {shape:?}"
                )));
            }
            span = st
                .checked_mul(n)
                .filter(|_| n > 1)
                .map_or(span, |x| x.max(span));
        }
        let last = shape
            .iter()
            .zip(strides)
            .try_fold(0u64, |acc, (&n, s)| {
                (n as u64 - 1)
                    .checked_mul(s as u64)
                    .and_then(|x| acc.checked_add(x))
            })
            .and_then(|e| e.checked_add(1))
            .and_then(|e| e.checked_mul(dtype.bytes()))
            .and_then(|b| b.checked_add(offset));
        match last {
            Some(end) if end <= buffer.size() => {}
            _ => {
                return Err(GpuError::View(format!(
                    "a {dtype:?} view of shape {shape:?}, strides {strides:?} from byte {offset} \
                     ends past the buffer's {} bytes",
                    buffer.size()
                )))
            }
        }
        Ok(Self {
            buffer: buffer.clone(),
            offset,
            dtype,
            shape,
            strides,
        })
    }

    /// A contiguous view `[B, H, N, D]` in `layout` (BHND: `[B, H, N, D]` row-major; BNHD:
    /// `[B, N, H, D]` row-major) from byte `offset`. Errors as [`TensorView::new`].
    pub fn contiguous(
        buffer: &wgpu::Buffer,
        offset: u64,
        dtype: DType,
        shape: [usize; 4],
        layout: TensorLayout,
    ) -> Result<Self> {
        Self::new(
            buffer,
            offset,
            dtype,
            shape,
            contiguous_strides(shape, layout),
        )
    }

    /// The buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }
    /// Byte offset of element `(0, 0, 0, 0)`.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Logical shape `[B, H, N, D]`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    /// Strides in elements of `[B, H, N, D]`.
    pub fn strides(&self) -> [usize; 4] {
        self.strides
    }
    /// Elements of the view.
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// The bytes from the view's first element to past its last, `start..end` in its buffer.
    pub(crate) fn byte_span(&self) -> std::ops::Range<u64> {
        let last: u64 = (self.shape.iter().zip(&self.strides))
            .map(|(&n, &s)| (n.saturating_sub(1) * s) as u64)
            .sum();
        self.offset..self.offset + (last + 1) * self.dtype.bytes()
    }

    /// Whether `self` and `other` lie in one buffer with intersecting byte spans (a
    /// conservative test: strided views may interleave without sharing an element; the
    /// operations that refuse overlapping views say so).
    pub(crate) fn overlaps(&self, other: &TensorView) -> bool {
        let (a, b) = (self.byte_span(), other.byte_span());
        self.buffer == other.buffer && a.start < b.end && b.start < a.end
    }

    /// The layout in which the view is contiguous (BHND is reported first where both hold,
    /// e.g. H = 1), if any.
    pub fn contiguous_layout(&self) -> Option<TensorLayout> {
        [TensorLayout::Bhnd, TensorLayout::Bnhd]
            .into_iter()
            .find(|&l| same_strides(self.shape, self.strides, contiguous_strides(self.shape, l)))
    }

    /// The tokens `start .. start + len` of the view (dimension N), same strides: one
    /// sequence of a packed varlen batch. Errors: [`GpuError::View`] for a range past N or
    /// empty.
    pub fn tokens(&self, start: usize, len: usize) -> Result<TensorView> {
        if len == 0 || start.checked_add(len).is_none_or(|e| e > self.shape[2]) {
            return Err(GpuError::View(format!(
                "tokens from {start}, {len} of them, of a view of {} tokens: the range must hold \
                 at least one token and end within the view",
                self.shape[2]
            )));
        }
        let mut shape = self.shape;
        shape[2] = len;
        Ok(TensorView {
            buffer: self.buffer.clone(),
            offset: self.offset + (start * self.strides[2]) as u64 * self.dtype.bytes(),
            dtype: self.dtype,
            shape,
            strides: self.strides,
        })
    }

    /// Whether the view is contiguous in BHND or BNHD.
    pub fn is_contiguous(&self) -> bool {
        self.contiguous_layout().is_some()
    }

    /// The range to bind in place for kernels reading the view in `layout` (the caller checked
    /// the dtype), or `None` when the view is not contiguous in `layout`, its offset is not a
    /// multiple of `align` (the device's `min_storage_buffer_offset_alignment`), or its last
    /// 4-byte word would pass the buffer's end.
    pub(crate) fn binding_words(&self, layout: TensorLayout, align: u64) -> Option<InPlace> {
        let contiguous = same_strides(
            self.shape,
            self.strides,
            contiguous_strides(self.shape, layout),
        );
        // Bindings are whole 4-byte words: an f16 view of odd length ending at the buffer's end
        // cannot be bound in place.
        let size = (self.elems() as u64 * self.dtype.bytes()).div_ceil(4) * 4;
        let fits = self.offset + size <= self.buffer.size();
        (contiguous && fits && self.offset.is_multiple_of(align.max(1))).then(|| InPlace {
            buffer: self.buffer.clone(),
            offset: self.offset,
            size,
        })
    }
}

/// Strides of a contiguous `[B, H, N, D]` tensor in `layout`.
pub fn contiguous_strides(shape: [usize; 4], layout: TensorLayout) -> [usize; 4] {
    let [_, h, n, d] = shape;
    match layout {
        TensorLayout::Bhnd => [h * n * d, n * d, d, 1],
        TensorLayout::Bnhd => [n * h * d, d, h * d, 1],
    }
}

/// Whether two stride sets address the same elements for `shape` (strides of size-1
/// dimensions do not matter).
fn same_strides(shape: [usize; 4], a: [usize; 4], b: [usize; 4]) -> bool {
    (0..4).all(|i| shape[i] == 1 || a[i] == b[i])
}

/// An input of attention (Q, K, V, decode rows) must hold floats: an i32 view would be read as
/// raw bits. Errors: [`GpuError::View`] naming it.
pub(crate) fn check_float_input(what: &str, view: &TensorView) -> Result<()> {
    if view.dtype() == DType::I32 {
        return Err(GpuError::View(format!(
            "{what}: an input of attention must be f32, f16 or bf16, is I32"
        )));
    }
    Ok(())
}

/// No two of `views` (views an operation writes) share bytes. Errors: [`GpuError::View`]
/// naming the two.
pub(crate) fn check_disjoint_among(views: &[(&str, &TensorView)]) -> Result<()> {
    for (i, a) in views.iter().enumerate() {
        check_disjoint_between(&[*a], &views[i + 1..])?;
    }
    Ok(())
}

/// No view of `writes` shares bytes with a view of `others` (views read after, or written
/// beside, them). Errors: [`GpuError::View`] naming the two.
pub(crate) fn check_disjoint_between(
    writes: &[(&str, &TensorView)],
    others: &[(&str, &TensorView)],
) -> Result<()> {
    for (a, va) in writes {
        for (b, vb) in others {
            if va.overlaps(vb) {
                return Err(GpuError::View(format!(
                    "{a} and {b} share bytes of one buffer (bytes {:?} and {:?}); they must not, as one is written while or before the other is used",
                    va.byte_span(),
                    vb.byte_span()
                )));
            }
        }
    }
    Ok(())
}
