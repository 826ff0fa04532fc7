//! Reading tensors back to the host: [`Context::read_f32`], [`Context::read_i32`] and
//! [`Context::read_bytes`] (a copy into a mappable buffer, then a map; a device lost before or
//! during the read is a [`GpuError::DeviceLost`], never a panic).

use super::buffers::GpuTensor;
use super::context::Context;
use super::pipeline::Storage;
use crate::error::{GpuError, Result};

impl Context {
    /// Reads a tensor back as f32 (f16 storage is widened).
    pub fn read_f32(&self, t: &GpuTensor) -> Result<Vec<f32>> {
        let bytes = self.read_bytes(&t.buffer)?;
        Ok(match t.storage {
            Storage::F32 => bytemuck::cast_slice::<u8, f32>(&bytes)[..t.len].to_vec(),
            Storage::F16 => bytemuck::cast_slice::<u8, half::f16>(&bytes)[..t.len]
                .iter()
                .map(|h| h.to_f32())
                .collect(),
        })
    }

    /// Reads a tensor of 4-byte integers back.
    pub fn read_i32(&self, t: &GpuTensor) -> Result<Vec<i32>> {
        let bytes = self.read_bytes(&t.buffer)?;
        Ok(bytemuck::cast_slice::<u8, i32>(&bytes)[..t.len].to_vec())
    }

    /// Copies a buffer into a mappable one and returns its bytes. Errors:
    /// [`GpuError::DeviceLost`] (before or during the read), [`GpuError::Poll`].
    pub fn read_bytes(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>> {
        self.check_alive()?;
        let size = buffer.size();
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buffer, 0, &staging, 0, size);
        self.queue.submit([enc.finish()]);
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        // A map that fails because the device died meanwhile is reported as such.
        let mapped = rx
            .recv()
            .map_err(|e| GpuError::Poll(e.to_string()))
            .and_then(|r| r.map_err(|e| GpuError::Poll(format!("buffer map failed: {e}"))));
        if mapped.is_err() {
            self.check_alive()?;
        }
        mapped?;
        let data = slice
            .get_mapped_range()
            .map_err(|e| GpuError::Poll(format!("buffer map failed: {e}")))?
            .to_vec();
        staging.unmap();
        Ok(data)
    }
}
