//! Ignored micro-benchmark: the GPU time of tiny dispatches (one workgroup of 64 invocations
//! bumping one word), to find the fixed cost per dispatch and per compute pass on an adapter.
//! Cases: one pass of N dependent dispatches (same read_write buffer), one pass of N
//! independent ones (a buffer each), and N passes of one dispatch, each timed.
//! Run: `cargo test --release -p pisa-wgpu --test dispatch_floor -- --ignored --nocapture`.

mod common;

use common::{bind_group, compute_pipeline, ctx};
use pisa_wgpu::Profiler;

const WGSL: &str = "@group(0) @binding(0) var<storage, read_write> buf: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) { if (i == 0u) { buf[0] = buf[0] + 1u; } }";

const N: usize = 64;

#[test]
#[ignore]
fn dispatch_floor() {
    let ctx = ctx();
    if !ctx.has_timestamps() {
        eprintln!("no timestamps: nothing to measure");
        return;
    }
    let dev = ctx.device();
    let pipe = compute_pipeline("floor", WGSL, "main", wgpu::ShaderRuntimeChecks::checked());
    let bufs: Vec<wgpu::Buffer> = (0..N)
        .map(|_| {
            dev.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: 256,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        })
        .collect();
    let groups: Vec<wgpu::BindGroup> = bufs.iter().map(|b| bind_group(&pipe, &[(0, b)])).collect();
    // (label, passes, dispatches per pass, independent buffers)
    for (label, passes, per, indep) in [
        ("1 pass x 1 dispatch", 1, 1, false),
        ("1 pass x N dependent", 1, N, false),
        ("1 pass x N independent", 1, N, true),
        ("N passes x 1 dependent", N, 1, false),
        ("N passes x 1 independent", N, 1, true),
    ] {
        let mut spans = Vec::new();
        for rep in 0..6 {
            let mut prof = Profiler::new(ctx, passes as u32);
            let mut enc = dev.create_command_encoder(&Default::default());
            let mut j = 0;
            for _ in 0..passes {
                let mut pass = prof.compute_pass(&mut enc, "floor");
                pass.set_pipeline(&pipe);
                for _ in 0..per {
                    pass.set_bind_group(0, &groups[if indep { j } else { 0 }], &[]);
                    pass.dispatch_workgroups(1, 1, 1);
                    j += 1;
                }
            }
            ctx.queue().submit([enc.finish()]);
            let _ = dev.poll(wgpu::PollType::wait_indefinitely());
            let span = prof.finish_span(ctx, "floor").unwrap().unwrap();
            if rep > 0 {
                spans.push(span * 1e3);
            }
        }
        spans.sort_by(f64::total_cmp);
        let med = spans[spans.len() / 2];
        let count = passes * per;
        eprintln!(
            "{label:>26}: span {med:9.2} us, {:7.2} us per dispatch ({count} dispatches)",
            med / count as f64
        );
    }
}
