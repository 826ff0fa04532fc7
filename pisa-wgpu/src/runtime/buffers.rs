//! Storage buffers: upload (with f16 conversion), poisoned output allocation, scratch, uniform
//! parameters, binding-size checks, and the pool of recycled buffers; the dispatch helper that
//! splits grids past the per-dimension workgroup limit, the bind groups and the multi-dispatch
//! pass are in `buffers/dispatch.rs` (readback: `readback.rs`).
//!
//! Invariants: every buffer a kernel binds is checked against [`Context::max_binding_bytes`]
//! before creation (a tensor that does not fit is split by the operation, or refused with
//! [`GpuError::Limit`]); output buffers are filled with a poison pattern (NaN for floats,
//! `i32::MIN` for indices) so an element a kernel forgets to write shows in every test; only
//! intermediates whose every element read is written first by an earlier kernel are created
//! unfilled ([`Context::scratch`]).
//! Every entry point starts with the device check of a step (`Context::check_step`: the lost
//! flag and a poll, and the probe of the application's device when called outside a public
//! call, see `context.rs`), so a lost or destroyed device is a [`GpuError::DeviceLost`];
//! buffers are created unmapped and filled with `Queue::write_buffer` (never
//! `mapped_at_creation`, whose mapping panics inside wgpu on a dead device), so a device lost
//! in the middle of a call gives a wgpu error, not a panic.

mod dispatch;

use bytemuck::Pod;

pub use self::dispatch::Bind;
pub(crate) use self::dispatch::Stage;
use super::context::Context;
use super::pipeline::Storage;
use crate::error::{GpuError, Result};
use pisa_core::PisaError;

/// Poison for float outputs: a quiet NaN bit pattern (also NaN as two f16 halves: 0xFFFF).
pub const POISON_F32: u32 = 0xFFFF_FFFF;
/// Poison for index outputs: `i32::MIN`, never a valid block index nor the -1 padding.
pub const POISON_I32: u32 = 0x8000_0000;

/// A tensor in GPU memory: a storage buffer holding `len` elements of `storage` precision
/// (f32, f16 or bf16; index buffers use `Storage::F32`, whose 4-byte element is an i32 or u32).
#[derive(Debug)]
pub struct GpuTensor {
    /// The buffer, size padded up to a multiple of 4 bytes.
    pub buffer: wgpu::Buffer,
    /// Elements.
    pub len: usize,
    /// Element precision.
    pub storage: Storage,
    /// `(byte offset, bytes)` of the range the kernels bind when the tensor is part of a
    /// caller's buffer read in place (offset a multiple of the device's
    /// `min_storage_buffer_offset_alignment`, bytes a multiple of 4, `len` elements from the
    /// offset); `None`: the whole buffer. Only the prefill plan makes ranged tensors, and only
    /// as kernel inputs (never read back, recycled or written).
    pub(crate) range: Option<(u64, u64)>,
}

impl GpuTensor {
    /// The tensor of `len` elements of `storage` that is the whole of `buffer` (a buffer of
    /// the context's device with `STORAGE` usage, at least `len` elements long).
    #[doc(hidden)]
    pub fn from_buffer(buffer: wgpu::Buffer, len: usize, storage: Storage) -> Self {
        GpuTensor {
            buffer,
            len,
            storage,
            range: None,
        }
    }

    /// Checks that the tensor's `len` elements of its `storage` fit the bytes it binds (its
    /// buffer, or its range of a caller's buffer). The fields are public, so a tensor's `len`
    /// or `storage` may have been changed after it was made; a kernel given more elements than
    /// its binding holds reads zeros past the end (a silent wrong result, as robust buffer
    /// access has it). The calls that validate their inputs check every tensor with this
    /// (attention, selection, prefill, the backward pass, decode, the pyramid build, the GEMM,
    /// read-back); the kernel-level record functions whose docs say their caller validates
    /// (`record_coop`, `record_split_k`) do not. Errors:
    /// [`PisaError::BufferLen`] with the elements the binding holds as `actual`.
    pub(crate) fn check_fits(&self, what: &'static str) -> Result<()> {
        let bytes = self.range.map_or(self.buffer.size(), |(_, b)| b);
        let holds = bytes / self.storage.bytes();
        if self.len as u64 > holds {
            return Err(PisaError::BufferLen {
                what,
                expected: self.len,
                actual: usize::try_from(holds).unwrap_or(usize::MAX),
            }
            .into());
        }
        Ok(())
    }

    /// Checks the tensor's `len` against `expected` (the elements its shape needs), then
    /// [`check_fits`](Self::check_fits), in that order, so that a tensor claiming more elements
    /// than its buffer holds is named by the shape's need. Errors: [`PisaError::BufferLen`].
    pub(crate) fn check_shape(&self, what: &'static str, expected: usize) -> Result<()> {
        check_len(what, self.len, expected)?;
        self.check_fits(what)
    }

    /// Another handle on the same elements (the buffer is shared, not copied).
    pub(crate) fn alias(&self) -> GpuTensor {
        GpuTensor {
            buffer: self.buffer.clone(),
            len: self.len,
            storage: self.storage,
            range: self.range,
        }
    }
}

/// Most bytes the pool of recycled buffers keeps; a buffer returned past it is freed.
pub const POOL_MAX_BYTES: u64 = 1 << 30;

/// Storage buffers kept for reuse, keyed by byte size. Buffers of one shape's call come back
/// from [`Context::recycle`] and serve the next call of the same shape (an inference loop, a
/// benchmark's repetitions) without a new allocation; every reuse is fully rewritten (upload
/// data or poison) before any kernel reads it, except a scratch tensor's, whose elements the
/// kernels write before they read them.
#[derive(Default)]
pub struct BufferPool {
    free: std::collections::HashMap<u64, Vec<wgpu::Buffer>>,
    bytes: u64,
}

/// `bytes` rounded up to a whole, non-zero number of 4-byte words (saturating at `u64::MAX`,
/// which no binding limit admits).
fn padded(bytes: u64) -> u64 {
    bytes.div_ceil(4).max(1).saturating_mul(4)
}

/// Usage of every storage tensor (the pooled kind).
const STORAGE_USAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC);

impl Context {
    fn take_pooled(&self, size: u64) -> Option<wgpu::Buffer> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        let b = pool.free.get_mut(&size)?.pop()?;
        pool.bytes -= size;
        Some(b)
    }

    /// Returns a tensor's buffer to the context's pool, for the next allocation of the same
    /// byte size (kept up to [`POOL_MAX_BYTES`] in all; freed beyond). Call it when the tensor
    /// is no longer needed, e.g. after reading an output back.
    #[doc(hidden)]
    pub fn recycle(&self, t: GpuTensor) {
        let size = t.buffer.size();
        if t.range.is_some() || t.buffer.usage() != STORAGE_USAGE | wgpu::BufferUsages::COPY_DST {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.bytes + size <= POOL_MAX_BYTES {
            pool.bytes += size;
            pool.free.entry(size).or_default().push(t.buffer);
        }
    }

    /// Frees every pooled buffer.
    #[doc(hidden)]
    pub fn clear_pool(&self) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        pool.free.clear();
        pool.bytes = 0;
    }

    /// Bytes held by the pool of recycled buffers.
    #[doc(hidden)]
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }

    /// Errors with [`GpuError::Limit`] when `bytes` exceed the storage-binding limit.
    #[doc(hidden)]
    pub fn check_binding(&self, what: &str, bytes: u64) -> Result<()> {
        let limit = self.max_binding_bytes();
        if bytes > limit {
            return Err(GpuError::Limit {
                what: what.to_string(),
                needed: bytes,
                limit,
                unit: "bytes",
                hint: "split the call into fewer heads or a shorter sequence",
            });
        }
        Ok(())
    }

    /// A buffer of `size` bytes (a multiple of 4) holding `contents` (at most `size` bytes; the
    /// rest is zero), created unmapped and written through the queue.
    fn buffer_with(
        &self,
        label: &str,
        size: u64,
        contents: &[u8],
        usage: wgpu::BufferUsages,
    ) -> wgpu::Buffer {
        use super::arena::{insert_buffer, lookup_buffer, Lookup};
        let c = (!contents.is_empty()).then_some(contents);
        let lookup = lookup_buffer(self.id(), size, usage, c);
        if let Lookup::Hit(buffer, write) = lookup {
            if write {
                self.queue.write_buffer(&buffer, 0, contents);
            }
            return buffer;
        }
        // A plan's buffers are its own, never the pool's.
        let pooled = (usage == STORAGE_USAGE && matches!(lookup, Lookup::None))
            .then(|| self.take_pooled(size))
            .flatten();
        let buffer = pooled.unwrap_or_else(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: usage | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        if !contents.is_empty() {
            self.queue.write_buffer(&buffer, 0, contents);
        }
        if matches!(lookup, Lookup::Miss) {
            insert_buffer(self.id(), &buffer, usage, c);
        }
        buffer
    }

    /// Uploads `data` as a storage tensor of `storage` precision. Errors:
    /// [`GpuError::DeviceLost`], [`GpuError::Limit`] past the binding limit,
    /// [`GpuError::Unsupported`] for f16 storage without SHADER_F16.
    #[doc(hidden)]
    pub fn upload(&self, label: &str, data: &[f32], storage: Storage) -> Result<GpuTensor> {
        self.check_step()?;
        let bytes = self.host_bytes(data, storage)?;
        self.upload_bytes(label, bytes, data.len(), storage)
    }

    /// `data` as the bytes of `storage` (f16 and bf16 rounded to nearest even). Errors:
    /// [`GpuError::Unsupported`] for f16 on a device without `SHADER_F16`.
    fn host_bytes(&self, data: &[f32], storage: Storage) -> Result<Vec<u8>> {
        Ok(match storage {
            Storage::F32 => bytemuck::cast_slice(data).to_vec(),
            Storage::F16 => {
                if !self.has_f16() {
                    return Err(self.no_f16(""));
                }
                let h: Vec<half::f16> = data.iter().map(|&x| half::f16::from_f32(x)).collect();
                bytemuck::cast_slice(&h).to_vec()
            }
            Storage::Bf16 => {
                // Rounded to nearest even (NaN stays NaN), as the GPU gather rounds.
                let h: Vec<half::bf16> = data.iter().map(|&x| half::bf16::from_f32(x)).collect();
                bytemuck::cast_slice(&h).to_vec()
            }
        })
    }

    /// A storage tensor of `len` elements that [`Context::write_host`] writes (a host call's
    /// input, written by the queue rather than uploaded into a new buffer each call).
    pub(crate) fn host_input(
        &self,
        label: &str,
        len: usize,
        storage: Storage,
    ) -> Result<GpuTensor> {
        let bytes = self.storage_bytes(label, len, storage)?;
        let usage = STORAGE_USAGE.union(wgpu::BufferUsages::COPY_DST);
        let buffer = self.buffer_with(label, bytes, &[], usage);
        Ok(GpuTensor {
            buffer,
            len,
            storage,
            range: None,
        })
    }

    /// Writes `data` (exactly `t.len` values, converted to `t`'s storage) into `t`, a tensor of
    /// [`Context::host_input`], by a queue write: it lands before the next submission.
    pub(crate) fn write_host(&self, t: &GpuTensor, data: &[f32]) -> Result<()> {
        debug_assert_eq!(data.len(), t.len);
        let mut bytes = self.host_bytes(data, t.storage)?;
        bytes.resize(padded(bytes.len() as u64) as usize, 0);
        self.queue.write_buffer(&t.buffer, 0, &bytes);
        Ok(())
    }

    /// Uploads 4-byte integers (indices, lengths) as a storage tensor.
    #[doc(hidden)]
    pub fn upload_u32<T: Pod>(&self, label: &str, data: &[T]) -> Result<GpuTensor> {
        self.check_step()?;
        self.upload_bytes(
            label,
            bytemuck::cast_slice(data).to_vec(),
            data.len(),
            Storage::F32,
        )
    }

    fn upload_bytes(
        &self,
        label: &str,
        mut bytes: Vec<u8>,
        len: usize,
        storage: Storage,
    ) -> Result<GpuTensor> {
        self.check_binding(label, bytes.len() as u64)?;
        bytes.resize(padded(bytes.len() as u64) as usize, 0);
        let buffer = self.buffer_with(
            label,
            bytes.len() as u64,
            &bytes,
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        );
        Ok(GpuTensor {
            buffer,
            len,
            storage,
            range: None,
        })
    }

    /// A storage tensor of `len` elements filled with the 4-byte `poison` pattern. Errors:
    /// [`GpuError::DeviceLost`], [`PisaError::TooLarge`](pisa_core::PisaError::TooLarge) when
    /// the byte size overflows `u64`, [`GpuError::Limit`] past the binding limit.
    #[doc(hidden)]
    pub fn alloc(
        &self,
        label: &str,
        len: usize,
        storage: Storage,
        poison: u32,
    ) -> Result<GpuTensor> {
        let bytes = self.storage_bytes(label, len, storage)?;
        // A plan's replay in a release build does not poison its outputs (every element is
        // written by the kernels; the tests, in debug builds, still see unwritten ones).
        let fill = cfg!(debug_assertions) || !super::arena::replaying(self.id());
        let words = vec![poison; if fill { (bytes / 4) as usize } else { 0 }];
        let buffer = self.buffer_with(
            label,
            bytes,
            bytemuck::cast_slice(&words),
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        );
        Ok(GpuTensor {
            buffer,
            len,
            storage,
            range: None,
        })
    }

    /// Padded bytes of a storage tensor of `len` elements, checked against the binding limit
    /// (errors as [`Context::alloc`]).
    fn storage_bytes(&self, label: &str, len: usize, storage: Storage) -> Result<u64> {
        self.check_step()?;
        if storage == Storage::F16 && !self.has_f16() {
            return Err(self.no_f16(&format!(" for {label}")));
        }
        let bytes =
            (len as u64)
                .checked_mul(storage.bytes())
                .ok_or(pisa_core::PisaError::TooLarge {
                    what: "buffer bytes",
                    value: u64::MAX,
                    limit: self.max_binding_bytes(),
                })?;
        let bytes = padded(bytes);
        self.check_binding(label, bytes)?;
        Ok(bytes)
    }

    /// A storage scratch tensor of `len` elements whose contents are unspecified (zero when
    /// new, stale when recycled from the pool): for intermediates whose every element a kernel
    /// reads is written first by an earlier kernel, where a host-filled poison upload would cost
    /// a transfer of the whole buffer per call (hundreds of MB for leaf-major attention).
    /// Outputs keep [`Context::alloc`]'s poison. Errors as [`Context::alloc`].
    #[doc(hidden)]
    pub fn scratch(&self, label: &str, len: usize, storage: Storage) -> Result<GpuTensor> {
        let bytes = self.storage_bytes(label, len, storage)?;
        let buffer = self.buffer_with(label, bytes, &[], STORAGE_USAGE);
        Ok(GpuTensor {
            buffer,
            len,
            storage,
            range: None,
        })
    }

    /// A uniform buffer holding `params`. Errors: [`GpuError::DeviceLost`].
    #[doc(hidden)]
    pub fn uniform<T: Pod>(&self, label: &str, params: &T) -> Result<wgpu::Buffer> {
        self.check_step()?;
        let bytes = bytemuck::bytes_of(params);
        let mut words = vec![0u8; padded(bytes.len() as u64) as usize];
        words[..bytes.len()].copy_from_slice(bytes);
        Ok(self.buffer_with(
            label,
            words.len() as u64,
            &words,
            wgpu::BufferUsages::UNIFORM,
        ))
    }
}

/// `actual` elements against the `expected` a shape needs: [`PisaError::BufferLen`] when they
/// differ. The one length check of the ops' validation (tensors, host slices, appended rows).
pub(crate) fn check_len(what: &'static str, actual: usize, expected: usize) -> Result<()> {
    if actual != expected {
        return Err(PisaError::BufferLen {
            what,
            expected,
            actual,
        }
        .into());
    }
    Ok(())
}
