//! Recording dispatches: the bind group of a pipeline's bindings, [`Context::dispatch`] (one
//! compute pass of one dispatch, the grid split past the per-dimension workgroup limit), and the
//! multi-dispatch pass ([`Context::stage`], [`Context::record_pass`]) used by the decode step
//! and leaf-major attention to record a dependent chain of small dispatches as ONE pass.

use std::sync::Arc;

use crate::error::Result;
use crate::runtime::arena;
use crate::runtime::buffers::GpuTensor;
use crate::runtime::context::Context;
use crate::runtime::profiler::Profiler;

/// What a binding binds: a whole buffer, or a range of one (a tensor read in place from a
/// caller's buffer, [`GpuTensor::range`]). Binding sites take anything that converts: a
/// `&wgpu::Buffer` (the whole buffer) or a `&GpuTensor` (its range, or its whole buffer).
#[derive(Debug, Clone, Copy)]
#[doc(hidden)]
pub struct Bind<'a> {
    /// The buffer.
    pub buffer: &'a wgpu::Buffer,
    /// Byte offset and size; `None`: the whole buffer.
    pub range: Option<(u64, u64)>,
}

impl<'a> From<&'a wgpu::Buffer> for Bind<'a> {
    fn from(buffer: &'a wgpu::Buffer) -> Self {
        Bind {
            buffer,
            range: None,
        }
    }
}

impl<'a> From<&'a GpuTensor> for Bind<'a> {
    fn from(t: &'a GpuTensor) -> Self {
        Bind {
            buffer: &t.buffer,
            range: t.range,
        }
    }
}

impl<'a> Bind<'a> {
    fn resource(self) -> wgpu::BindingResource<'a> {
        match self.range {
            None => self.buffer.as_entire_binding(),
            Some((offset, size)) => wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: self.buffer,
                offset,
                size: wgpu::BufferSize::new(size),
            }),
        }
    }
}

/// One recorded dispatch of a multi-dispatch pass ([`Context::record_pass`]): pipeline, bind
/// group, grid.
pub(crate) type Stage = (Arc<wgpu::ComputePipeline>, wgpu::BindGroup, [u32; 3]);

impl Context {
    /// The bind group of `bindings` (`(i, buffer)` at `@group(0) @binding(i)`) for
    /// `pipeline`'s layout (derived from its entry point: name exactly the bindings it uses).
    ///
    /// Made inside its own validation and out-of-memory scopes ([`Context::scope_now`]), so a
    /// binding wgpu refuses (a buffer of another device, a destroyed one, a range past its
    /// buffer) is an error here, before the caller records anything with the group: an invalid
    /// group set in the caller's encoder would fail its `finish` and submit, and with them every
    /// command the encoder held (a decode cache's appends recorded before, which its docs tell
    /// the application to submit). (wasm32: the browser's scopes resolve later; there the error
    /// goes to the device's uncaptured-error handler and the group is returned.) Under a plan's
    /// arena only a valid group is kept (runtime/arena.rs). Errors: [`GpuError::Validation`],
    /// [`GpuError::OutOfMemory`].
    ///
    /// [`GpuError::Validation`]: crate::GpuError::Validation
    /// [`GpuError::OutOfMemory`]: crate::GpuError::OutOfMemory
    pub(crate) fn bind_group<'a, B: Copy + Into<Bind<'a>>>(
        &self,
        pipeline: &wgpu::ComputePipeline,
        bindings: &[(u32, B)],
    ) -> Result<wgpu::BindGroup> {
        let key: Vec<(u32, &wgpu::Buffer, u64, u64)> = bindings
            .iter()
            .map(|&(i, b)| {
                let b: Bind<'a> = b.into();
                let (o, n) = b.range.unwrap_or((0, u64::MAX));
                (i, b.buffer, o, n)
            })
            .collect();
        if let Some(g) = arena::lookup_group(self.id(), pipeline, &key) {
            return Ok(g);
        }
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry> = bindings
            .iter()
            .map(|&(i, b)| wgpu::BindGroupEntry {
                binding: i,
                resource: b.into().resource(),
            })
            .collect();
        let descriptor = wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        };
        let g = self.scope_now(
            "bind group (a buffer of another device, destroyed, or too small)",
            || Ok(self.device.create_bind_group(&descriptor)),
        )?;
        arena::insert_group(self.id(), pipeline, &key, &g);
        Ok(g)
    }

    /// [`Context::stage`] with bindings of buffer ranges (`(i, buffer, byte offset, bytes)`):
    /// tensor views of the caller's buffers bound in place. Offsets must be multiples of the
    /// device's `min_storage_buffer_offset_alignment` (the callers check, see
    /// `TensorView::binding`).
    pub(crate) fn stage_ranges(
        &self,
        pipeline: &Arc<wgpu::ComputePipeline>,
        bindings: &[(u32, &wgpu::Buffer, u64, u64)],
        workgroups: u64,
    ) -> Result<Stage> {
        let max_dim = self.limits().max_compute_workgroups_per_dimension;
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry> = bindings
            .iter()
            .map(|&(i, buffer, offset, size)| wgpu::BindGroupEntry {
                binding: i,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset,
                    size: wgpu::BufferSize::new(size),
                }),
            })
            .collect();
        let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        Ok((
            pipeline.clone(),
            bg,
            pisa_core::grid_for(workgroups, max_dim)?,
        ))
    }

    /// One dispatch of `workgroups` workgroups of `pipeline` with `bindings`, for
    /// [`Context::record_pass`] (the grid split as [`Context::dispatch`] splits it).
    pub(crate) fn stage<'a, B: Copy + Into<Bind<'a>>>(
        &self,
        pipeline: &Arc<wgpu::ComputePipeline>,
        bindings: &[(u32, B)],
        workgroups: u64,
    ) -> Result<Stage> {
        let max_dim = self.limits().max_compute_workgroups_per_dimension;
        Ok((
            pipeline.clone(),
            self.bind_group(pipeline, bindings)?,
            pisa_core::grid_for(workgroups, max_dim)?,
        ))
    }

    /// Records `stages` in order as ONE compute pass labelled `label`, timed as `label` in `prof`
    /// (wgpu orders the dispatches of a pass: each sees the writes of those before it). For
    /// dependent chains of small dispatches, where a pass per dispatch would add a pass
    /// boundary each (the decode step, leaf-major attention).
    pub(crate) fn record_pass<'s>(
        &self,
        enc: &mut wgpu::CommandEncoder,
        label: &'static str,
        stages: impl IntoIterator<Item = &'s Stage>,
        prof: Option<&mut Profiler>,
    ) {
        let mut pass = match prof {
            Some(p) => p.pass_on(self, enc, label),
            None => enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(label),
                timestamp_writes: None,
            }),
        };
        for (p, bg, grid) in stages {
            pass.set_pipeline(p);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
        }
    }

    /// Records one compute pass running `pipeline` over `workgroups` workgroups, with
    /// each `(i, buffer)` of `bindings` bound at `@group(0) @binding(i)`. Name exactly the
    /// bindings the entry point uses: wgpu derives the layout from the entry point, so a binding
    /// it does not use is not in the layout. The grid is split over x, y, z so no
    /// dimension exceeds the device limit; shaders rebuild the linear id from
    /// `@builtin(num_workgroups)` and skip ids past the count they are given. `timer` labels the
    /// pass for GPU timestamps.
    #[doc(hidden)]
    pub fn dispatch<'a, B: Copy + Into<Bind<'a>>>(
        &self,
        enc: &mut wgpu::CommandEncoder,
        pipeline: &wgpu::ComputePipeline,
        bindings: &[(u32, B)],
        workgroups: u64,
        timer: Option<(&mut Profiler, &'static str)>,
    ) -> Result<()> {
        self.check_step()?;
        if workgroups == 0 {
            return Ok(());
        }
        let grid = pisa_core::grid_for(
            workgroups,
            self.limits().max_compute_workgroups_per_dimension,
        )?;
        log::trace!("dispatch {workgroups} workgroups as grid {grid:?}");
        let bg = self.bind_group(pipeline, bindings)?;
        let mut pass = match timer {
            Some((p, label)) => p.pass_on(self, enc, label),
            None => enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            }),
        };
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
        Ok(())
    }
}
