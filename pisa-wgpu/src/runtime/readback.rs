//! Reading tensors back to the host: [`Context::read_f32`], [`Context::read_i32`] and
//! [`Context::read_bytes`] (a copy into a mappable buffer, then a map; a device lost before or
//! during the read is a [`GpuError::DeviceLost`], never a panic).

use super::buffers::GpuTensor;
use super::context::Context;
use super::pipeline::Storage;
use crate::error::{GpuError, Result};

impl Context {
    /// Reads a tensor back as f32 (f16 and bf16 storage are widened).
    #[doc(hidden)]
    pub fn read_f32(&self, t: &GpuTensor) -> Result<Vec<f32>> {
        t.check_fits("tensor read back")?;
        let bytes = self.read_bytes(&t.buffer)?;
        Ok(widen(&bytes, t.storage, t.len))
    }

    /// Reads a tensor of 4-byte integers back.
    #[doc(hidden)]
    pub fn read_i32(&self, t: &GpuTensor) -> Result<Vec<i32>> {
        t.check_fits("tensor read back")?;
        if t.storage != Storage::F32 {
            return Err(GpuError::Unsupported(format!(
                "read_i32 reads 4-byte words; the tensor is {:?}",
                t.storage
            )));
        }
        let bytes = self.read_bytes(&t.buffer)?;
        Ok(bytemuck::cast_slice::<u8, i32>(&bytes)[..t.len].to_vec())
    }

    /// Copies a buffer into a mappable one and returns its bytes (a map, then a wait).
    /// Errors: [`GpuError::View`] for a buffer without `COPY_SRC` usage (the copy would fail
    /// validation and the read return zeros) or whose size is not a multiple of 4 bytes (copies
    /// are of whole 4-byte words, wgpu's `COPY_BUFFER_ALIGNMENT`); [`GpuError::Validation`] for a buffer of another
    /// device or a destroyed one (see `Context::copy_out`); [`GpuError::DeviceLost`] (before or during the read),
    /// [`GpuError::Poll`]; [`GpuError::Unsupported`] on wasm32 (it blocks: use
    /// [`Context::read_async`]).
    pub fn read_bytes(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>> {
        let _call = self.public_call()?;
        check_copy_src(buffer)?;
        if !buffer.size().is_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT) {
            return Err(GpuError::View(format!(
                "read_bytes copies whole 4-byte words: the buffer's size, {} bytes, is not a \
                 multiple of 4 (make the buffer's size a multiple of 4, or read a view of it \
                 with Context::read_async)",
                buffer.size()
            )));
        }
        let staging = self.copy_out("read_bytes", buffer, 0, buffer.size())?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        // A map that fails because the device died meanwhile is reported as such.
        let mapped = rx
            .recv()
            .map_err(|e| GpuError::Poll(e.to_string()))
            .and_then(|r| r.map_err(|e| GpuError::Poll(format!("buffer map failed: {e}"))))
            .and_then(|()| mapped_bytes(&staging));
        if mapped.is_err() {
            self.check_alive_after_error()?;
        }
        mapped
    }

    /// Records the copy of `size` bytes of `buffer` from `offset` into a new mappable buffer,
    /// submits it and returns that buffer (to map). wgpu checks a recorded copy (the buffer's
    /// device among the rest) when its encoder finishes, and a destroyed buffer when the copy is
    /// submitted: both here, in this context's error scopes (`scope_now`), so such a buffer is a
    /// [`GpuError::Validation`] naming `op` rather than an error for the device's
    /// uncaptured-error handler (whose default panics). Errors: those of `scope_now`.
    fn copy_out(
        &self,
        op: &'static str,
        buffer: &wgpu::Buffer,
        offset: u64,
        size: u64,
    ) -> Result<wgpu::Buffer> {
        self.scope_now(op, || {
            let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("pisa readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = self.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(buffer, offset, &staging, 0, size);
            self.queue.submit([enc.finish()]);
            Ok(staging)
        })
    }
}

/// The bytes of `staging`, mapped for reading; unmapped after. Errors: [`GpuError::Poll`].
fn mapped_bytes(staging: &wgpu::Buffer) -> Result<Vec<u8>> {
    let bytes = staging
        .slice(..)
        .get_mapped_range()
        .map_err(|e| GpuError::Poll(format!("buffer map failed: {e}")))?
        .to_vec();
    staging.unmap();
    Ok(bytes)
}

/// The state a mapping callback shares with the future waiting on it.
type Slot = std::sync::Arc<
    std::sync::Mutex<(
        Option<std::result::Result<(), String>>,
        Option<std::task::Waker>,
    )>,
>;

/// A future resolved by a `map_async` callback. Natively nothing completes a mapping unless
/// someone polls the device, so each `poll` of this future first polls the device without
/// blocking (which runs the callback once the copy is done) and, while the mapping is not done,
/// asks to be polled again: the read completes under any executor (`pollster::block_on`
/// included) whether or not the application polls the device itself. In the browser the
/// mapping completes by itself, and the callback wakes the future.
struct Mapped(
    Slot,
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))] wgpu::Device,
);

impl std::future::Future for Mapped {
    type Output = std::result::Result<(), String>;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            // An error here (a lost device) also fails the mapping, which reports it.
            let _ = self.1.poll(wgpu::PollType::Poll);
        }
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match s.0.take() {
            Some(r) => std::task::Poll::Ready(r),
            None => {
                s.1 = Some(cx.waker().clone());
                #[cfg(not(target_arch = "wasm32"))]
                cx.waker().wake_by_ref();
                std::task::Poll::Pending
            }
        }
    }
}

impl Context {
    /// Reads the bytes of a view back without blocking: records a copy of the view's byte range
    /// (contiguous views only) into a mappable buffer, submits it, and resolves once the
    /// mapping is done. In the browser the mapping completes by itself; on native backends the
    /// future polls the device without blocking each time it is polled, and asks to be polled
    /// again until the mapping is done (so it keeps its executor busy meanwhile; the blocking
    /// [`Context::read_bytes`] sleeps instead). Errors: [`GpuError::View`] for a view that
    /// is not contiguous (BHND or BNHD), not 4-byte aligned or in a buffer without `COPY_SRC`
    /// usage; [`GpuError::Validation`] for a view in a buffer of another device or a destroyed
    /// buffer (natively; in
    /// the browser, which has no error scopes, the device's uncaptured-error handler gets the
    /// error, and the call may still return `Ok`); [`GpuError::DeviceLost`]
    /// for a device lost before the call; [`GpuError::Poll`] when the mapping fails (a device
    /// lost during the read included).
    pub async fn read_async(&self, view: &crate::TensorView) -> Result<Vec<u8>> {
        // The check of a public call, without its mark: that is the thread's, and this awaits.
        self.check_alive()?;
        let bytes = view.elems() as u64 * view.dtype().bytes();
        if !view.is_contiguous() || !view.offset().is_multiple_of(4) || !bytes.is_multiple_of(4) {
            return Err(GpuError::View(format!(
                "read_async reads contiguous views of whole 4-byte words at a 4-byte offset (offset {}, {} bytes, strides {:?})",
                view.offset(),
                bytes,
                view.strides()
            )));
        }
        check_copy_src(view.buffer())?;
        let staging = self.copy_out("read_async", view.buffer(), view.offset(), bytes)?;
        let slot: Slot = Default::default();
        let s2 = slot.clone();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let mut s = s2.lock().unwrap_or_else(|p| p.into_inner());
            s.0 = Some(r.map_err(|e| e.to_string()));
            if let Some(w) = s.1.take() {
                w.wake();
            }
        });
        Mapped(slot, self.device().clone())
            .await
            .map_err(|e| GpuError::Poll(format!("buffer map failed: {e}")))?;
        mapped_bytes(&staging)
    }
}

/// A read copies out of `buffer`: it needs `COPY_SRC` usage.
fn check_copy_src(buffer: &wgpu::Buffer) -> Result<()> {
    if !buffer.usage().contains(wgpu::BufferUsages::COPY_SRC) {
        return Err(GpuError::View(format!(
            "reading back a buffer without COPY_SRC usage (its usage: {:?}); create it with wgpu::BufferUsages::COPY_SRC",
            buffer.usage()
        )));
    }
    Ok(())
}

/// The first `n` elements of `bytes` (elements of `storage`) as f32 (widened exactly).
pub(crate) fn widen(bytes: &[u8], storage: Storage, n: usize) -> Vec<f32> {
    match storage {
        Storage::F32 => bytemuck::cast_slice::<u8, f32>(bytes)[..n].to_vec(),
        Storage::F16 => (bytemuck::cast_slice::<u8, half::f16>(bytes)[..n].iter())
            .map(|h| h.to_f32())
            .collect(),
        Storage::Bf16 => (bytemuck::cast_slice::<u8, half::bf16>(bytes)[..n].iter())
            .map(|h| h.to_f32())
            .collect(),
    }
}
