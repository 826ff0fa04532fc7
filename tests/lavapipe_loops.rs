//! What the test device itself gets wrong: lavapipe (Mesa's llvmpipe) stops the loops of a
//! shader invocation after 65535 iterations in all. gallivm's loop limiter is one counter per
//! invocation, shared by every loop and never reset. Past that budget every loop exits at
//! once, silently, so a long-running kernel returns wrong outputs there.
//!
//! Found 2026-11-29 (docs/benchmarks.md, A.8; commit 1f9a7fd). A run of `pisa forward` with a
//! block of 36000 tokens gave NaN. A tile attention walk over 24576 keys (dense, 64 queries,
//! non-causal) gave relative error 0.4 on lavapipe, and 20000 keys did not. Real GPU drivers
//! have no such limit.
//!
//! This test pins the behaviour down on the adapter at hand:
//! - on llvmpipe, the counts must be clipped exactly as described, so a Mesa change shows up
//!   here;
//! - elsewhere, every loop must run to its end.
//!
//! So the CI suite keeps each kernel invocation well under 65535 loop iterations: short
//! sequences, small blocks.
mod common;

use common::{bind_group, compute_pipeline, ctx};
use wgpu::util::DeviceExt;

/// One invocation: a loop of `n[0]` iterations, then two nested loops of `n[1]` x `n[2]`;
/// writes both counts.
const WGSL: &str = "
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<storage, read> n: array<u32>;
@compute @workgroup_size(1)
fn main() {
    var a = 0u;
    for (var i = 0u; i < n[0]; i++) { a += 1u; }
    var b = 0u;
    for (var j = 0u; j < n[1]; j++) {
        for (var k = 0u; k < n[2]; k++) { b += 1u; }
    }
    out[0] = a;
    out[1] = b;
}";

/// Runs the shader with loop counts `n`; returns the two counts it wrote.
fn counts(n: [u32; 3]) -> [u32; 2] {
    let ctx = ctx();
    let dev = ctx.device();
    let pipe = compute_pipeline("loops", WGSL, "main", wgpu::ShaderRuntimeChecks::checked());
    let out = ctx
        .alloc("counts", 4, pisa_wgpu::Storage::F32, pisa_wgpu::POISON_F32)
        .unwrap();
    let nb = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("n"),
        contents: bytemuck::cast_slice(&[n[0], n[1], n[2], 0]),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let bind = bind_group(&pipe, &[(0, &out.buffer), (1, &nb)]);
    let mut enc = dev.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    ctx.queue().submit([enc.finish()]);
    let words = ctx.read_f32(&out).unwrap();
    [words[0].to_bits(), words[1].to_bits()]
}

#[test]
fn loops_run_to_their_end_except_on_llvmpipe() {
    let name = &ctx().report().name;
    let llvmpipe = name.contains("llvmpipe");
    for n in [
        [1000, 30, 30],
        [70000, 100, 100],
        [50000, 200, 100],
        [10, 300, 300],
    ] {
        let got = counts(n);
        let full = [n[0], n[1] * n[2]];
        eprintln!("{name}: loops {n:?}: counted {got:?} of {full:?}");
        if !llvmpipe {
            assert_eq!(got, full, "{name}: loops {n:?}");
            continue;
        }
        // One budget of 65535 back edges for the whole invocation (the nested loops spend it
        // on both levels), so the first loop is clipped at 65535 and the second gets the rest.
        assert_eq!(got[0], n[0].min(65535), "loops {n:?}");
        let total = n[0] + n[1] * n[2] + n[1];
        if total <= 65535 {
            assert_eq!(got, full, "loops {n:?}: within the budget");
        } else {
            assert!(got[1] < full[1], "loops {n:?}: {got:?} not clipped");
        }
    }
}
