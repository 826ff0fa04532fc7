//! Pseudo-random tensor fill on the GPU (`shaders/fill.wgsl`): benchmark inputs of any size
//! without a host round trip. Values are uniform in `[-scale, scale)`, a hash of (seed, index).

use bytemuck::{Pod, Zeroable};

use crate::error::Result;
use crate::runtime::buffers::{GpuTensor, POISON_F32};
use crate::runtime::context::Context;
use crate::runtime::pipeline::{ShaderSource, Storage};

/// `shaders/fill.wgsl`.
pub const SHADER: ShaderSource = ShaderSource {
    name: "fill",
    wgsl: include_str!("../../../shaders/fill.wgsl"),
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    len: u32,
    seed: u32,
    scale: f32,
    per_thread: u32,
}

/// A new tensor of `len` elements of `storage`, filled with random values in `[-scale, scale)`
/// (bf16 included: the value rounded to nearest even). Its buffer holds an even number of
/// elements (the kernel writes pairs). Errors: [`pisa_core::PisaError::InvalidValue`] for a
/// scale that is not finite, allocation and device errors.
pub fn random_tensor(
    ctx: &Context,
    label: &str,
    len: usize,
    storage: Storage,
    seed: u32,
    scale: f32,
) -> Result<GpuTensor> {
    let _call = ctx.public_call()?;
    if !scale.is_finite() {
        return Err(pisa_core::PisaError::InvalidValue {
            what: "random_tensor's scale must be finite",
        }
        .into());
    }
    let mut t = ctx.alloc(label, len.next_multiple_of(2), storage, POISON_F32)?;
    t.len = len;
    let pairs = len.div_ceil(2);
    let per_thread = 16u32;
    let p = Params {
        len: pairs as u32,
        seed,
        scale,
        per_thread,
    };
    let u = ctx.uniform("fill params", &p)?;
    let pipe = ctx
        .pipelines
        .get(&ctx.device, &SHADER, "main", storage, &[], &[])?;
    ctx.scoped("fill", || {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let groups = (pairs as u64).div_ceil(256 * per_thread as u64);
        ctx.dispatch(&mut enc, &pipe, &[(0, &u), (1, &t.buffer)], groups, None)?;
        ctx.queue.submit([enc.finish()]);
        Ok(())
    })?;
    Ok(t)
}
