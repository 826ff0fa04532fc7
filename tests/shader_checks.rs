//! The guarantee behind the library's shader runtime checks (`pisa_wgpu::runtime::checks`): with
//! the checks the context chose for this device, no shader reads or writes outside the buffer
//! range it was bound to. Where the driver bounds buffer accesses (Vulkan's robustBufferAccess2)
//! the library builds its shaders with no checks at all and relies on the driver for this;
//! elsewhere naga's bounds checks do it.
//!
//! A buffer of 3 x 256-byte regions, the outer two filled with sentinels, the middle one bound
//! alone (the sentinels share the binding's VkBuffer, so plain robustBufferAccess, which only
//! bounds accesses to the whole buffer, would not pass). One workgroup of 128 invocations writes
//! and reads 128 words of that 64-word binding, and writes at wrapped-around indices
//! (`i - 64` for i < 64, near 2^32). The test fails if a write lands in a sentinel region or a
//! read returns a sentinel. On the H200 (passed 2026-11-30 at commit 254dea8,
//! docs/benchmarks.md) it exercises the driver's robustBufferAccess2; llvmpipe may bound every
//! access whatever the features, so on lavapipe it may not be able to fail.
mod common;

use common::{compute_pipeline, ctx};
use pisa_wgpu::runtime::checks::ShaderChecks;
use wgpu::util::DeviceExt;

/// Every invocation i < 128: `dst[i] = src[i] + 1000` (past index 63 both are out of range);
/// invocations i < 64 also write 5000 at index `i - 64`, wrapped around (all out of range).
const WGSL: &str = "
@group(0) @binding(0) var<storage, read_write> dst: array<u32>;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) i: u32) {
    dst[i] = src[i] + 1000u;
    if (i < 64u) { dst[i - 64u] = 5000u; }
}";

const REGION: u64 = 256;
const WORDS: usize = (REGION / 4) as usize;

#[test]
fn no_access_escapes_its_binding() {
    let ctx = ctx();
    let checks = ctx.shader_checks();
    eprintln!("{}: shader checks {checks:?}", ctx.report().name);
    if checks == ShaderChecks::None {
        eprintln!("PISA_SHADER_CHECKS=none without driver bounds: nothing is guaranteed");
        return;
    }
    let align = ctx.device().limits().min_storage_buffer_offset_alignment as u64;
    assert!(REGION.is_multiple_of(align), "offset alignment {align}");
    let dev = ctx.device();
    // dst: sentinels 7 and 9 around a middle of 5; src: 77, 0..64, 99.
    let mut d = vec![7u32; WORDS];
    d.extend(vec![5u32; WORDS]);
    d.extend(vec![9u32; WORDS]);
    let mut s = vec![77u32; WORDS];
    s.extend(0..WORDS as u32);
    s.extend(vec![99u32; WORDS]);
    let mk = |label, data: &[u32], usage| {
        dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytemuck::cast_slice(data),
            usage,
        })
    };
    let dst = mk(
        "dst",
        &d,
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
    );
    let src = mk("src", &s, wgpu::BufferUsages::STORAGE);
    let pipe = compute_pipeline("escape", WGSL, "main", checks.runtime_checks());
    fn middle(b: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: b,
            offset: REGION,
            size: std::num::NonZeroU64::new(REGION),
        })
    }
    let bind = dev.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipe.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: middle(&dst),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: middle(&src),
            },
        ],
    });
    let read = dev.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read"),
        size: 3 * REGION,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
        mapped_at_creation: false,
    });
    let mut enc = dev.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    enc.copy_buffer_to_buffer(&dst, 0, &read, 0, 3 * REGION);
    ctx.queue().submit([enc.finish()]);
    read.slice(..)
        .map_async(wgpu::MapMode::Read, |r| r.unwrap());
    dev.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let got: Vec<u32> = bytemuck::cast_slice(&read.slice(..).get_mapped_range().unwrap()).to_vec();
    assert_eq!(
        &got[..WORDS],
        &d[..WORDS],
        "a write escaped below the binding"
    );
    assert_eq!(
        &got[2 * WORDS..],
        &d[2 * WORDS..],
        "a write escaped above the binding"
    );
    // In range: the sum; the out-of-range writes were dropped or clamped onto the last word,
    // whose value must then come from a read inside the binding (0..64) or a zero.
    for (i, &v) in got[WORDS..2 * WORDS - 1].iter().enumerate() {
        assert_eq!(v, i as u32 + 1000, "word {i}");
    }
    let last = got[2 * WORDS - 1];
    assert!(
        (1000..1000 + WORDS as u32).contains(&last),
        "last word {last}: a read escaped the binding (77 or 99 + 1000) or was not written"
    );
}

/// The probe finds the driver's bounds where they are known to be: lavapipe (Mesa 22.3) and
/// NVIDIA's Vulkan driver both have robustBufferAccess2, so the library builds their shaders
/// without checks. A wgpu upgrade that broke the probe would otherwise only show as a slowdown.
#[test]
fn known_drivers_bound_buffers_themselves() {
    if std::env::var_os("PISA_SHADER_CHECKS").is_some() {
        eprintln!("PISA_SHADER_CHECKS set: the choice is the environment's");
        return;
    }
    let ctx = ctx();
    let r = ctx.report();
    let known = r.backend == "Vulkan" && (r.name.contains("llvmpipe") || r.vendor == 0x10de);
    eprintln!("{} ({}): {:?}", r.name, r.backend, ctx.shader_checks());
    if known {
        assert_eq!(
            ctx.shader_checks(),
            ShaderChecks::DriverBounded,
            "{}",
            r.name
        );
    }
}
