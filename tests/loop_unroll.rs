//! Ignored micro-benchmark: does the adapter's shader compiler unroll naga's constant-trip
//! loops, so that the independent loads of one iteration space are in flight together, and does
//! it keep a small private array indexed by a loop counter in registers? The kernels' comments
//! assume both ("a fixed trip count, so the loads are in flight together"); this measures it.
//!
//! One workgroup of 64 invocations runs R dependent rounds (each round's addresses depend on
//! the previous round's sum, which is 0 at run time but unknown to the compiler). A round is 16
//! independent loads summed: as a `for` loop, hand-unrolled, or a loop of 4 loads per trip;
//! from global memory (L2-resident, new lines each round) or workgroup memory; and 4 loads
//! accumulated into a private `array<f32, 4>` indexed in loops against a `vec4`. Also the cost
//! of a workgroup barrier round (write, barrier, read a neighbour's word, barrier) at 64, 256
//! and 1024 invocations; and of subgroup shuffles (where the adapter has SUBGROUP): rounds of
//! three dependent `subgroupShuffleXor` butterflies (masks 1, 2, 4) at 64 and 1024
//! invocations, written out, as a loop over the masks, and under a non-uniform branch (that
//! leaves whole subgroups idle: 544 invocations of 1024).
//! If a loop's round costs about 16 load latencies and the unrolled one about 1, the loop was
//! not unrolled. Run: `cargo test --release -p pisa-wgpu --test loop_unroll -- --ignored --nocapture`.

mod common;

use common::ctx;
use pisa_wgpu::Profiler;

const WGSL: &str = "
@group(0) @binding(0) var<storage, read_write> buf: array<u32>;
@group(0) @binding(1) var<storage, read_write> outb: array<u32>;
const R: u32 = 256u;
var<workgroup> sh: array<u32, 2048>;

fn at(idx: u32, r: u32, i: u32) -> u32 { return idx + (r * 16u + i) * 64u; }

@compute @workgroup_size(64)
fn gl_loop(@builtin(local_invocation_index) lid: u32) {
    var idx = lid;
    for (var r = 0u; r < R; r++) {
        var s = 0u;
        for (var i = 0u; i < 16u; i++) { s += buf[at(idx, r, i)]; }
        idx = lid + s;
    }
    outb[lid] = idx;
}

@compute @workgroup_size(64)
fn gl_loop4(@builtin(local_invocation_index) lid: u32) {
    var idx = lid;
    for (var r = 0u; r < R; r++) {
        var s = 0u;
        for (var i = 0u; i < 16u; i += 4u) {
            let a = buf[at(idx, r, i)];
            let b = buf[at(idx, r, i + 1u)];
            let c = buf[at(idx, r, i + 2u)];
            let d = buf[at(idx, r, i + 3u)];
            s += a + b + c + d;
        }
        idx = lid + s;
    }
    outb[lid] = idx;
}

@compute @workgroup_size(64)
fn gl_unroll(@builtin(local_invocation_index) lid: u32) {
    var idx = lid;
    for (var r = 0u; r < R; r++) {
        let s = buf[at(idx, r, 0u)] + buf[at(idx, r, 1u)] + buf[at(idx, r, 2u)] + buf[at(idx, r, 3u)]
            + buf[at(idx, r, 4u)] + buf[at(idx, r, 5u)] + buf[at(idx, r, 6u)] + buf[at(idx, r, 7u)]
            + buf[at(idx, r, 8u)] + buf[at(idx, r, 9u)] + buf[at(idx, r, 10u)] + buf[at(idx, r, 11u)]
            + buf[at(idx, r, 12u)] + buf[at(idx, r, 13u)] + buf[at(idx, r, 14u)] + buf[at(idx, r, 15u)];
        idx = lid + s;
    }
    outb[lid] = idx;
}

fn fill_sh(lid: u32) {
    for (var i = lid; i < 2048u; i += 64u) { sh[i] = buf[i]; }
    workgroupBarrier();
}

@compute @workgroup_size(64)
fn sh_loop(@builtin(local_invocation_index) lid: u32) {
    fill_sh(lid);
    var idx = lid;
    for (var r = 0u; r < R; r++) {
        var s = 0u;
        for (var i = 0u; i < 16u; i++) { s += sh[(idx + i * 64u) & 2047u]; }
        idx = lid + s;
    }
    outb[lid] = idx;
}

@compute @workgroup_size(64)
fn sh_unroll(@builtin(local_invocation_index) lid: u32) {
    fill_sh(lid);
    var idx = lid;
    for (var r = 0u; r < R; r++) {
        let s = sh[idx & 2047u] + sh[(idx + 64u) & 2047u] + sh[(idx + 128u) & 2047u]
            + sh[(idx + 192u) & 2047u] + sh[(idx + 256u) & 2047u] + sh[(idx + 320u) & 2047u]
            + sh[(idx + 384u) & 2047u] + sh[(idx + 448u) & 2047u] + sh[(idx + 512u) & 2047u]
            + sh[(idx + 576u) & 2047u] + sh[(idx + 640u) & 2047u] + sh[(idx + 704u) & 2047u]
            + sh[(idx + 768u) & 2047u] + sh[(idx + 832u) & 2047u] + sh[(idx + 896u) & 2047u]
            + sh[(idx + 960u) & 2047u];
        idx = lid + s;
    }
    outb[lid] = idx;
}

@compute @workgroup_size(64)
fn arr_loop(@builtin(local_invocation_index) lid: u32) {
    fill_sh(lid);
    var idx = lid;
    for (var r = 0u; r < R; r++) {
        var a: array<f32, 4>;
        for (var i = 0u; i < 4u; i++) {
            let m = f32(sh[(idx + i * 64u) & 2047u]);
            for (var h = 0u; h < 4u; h++) { a[h] += m * f32(h + 1u); }
        }
        var t = 0.0;
        for (var h = 0u; h < 4u; h++) { t += a[h]; }
        idx = lid + u32(t);
    }
    outb[lid] = idx;
}

@compute @workgroup_size(64)
fn arr_vec(@builtin(local_invocation_index) lid: u32) {
    fill_sh(lid);
    var idx = lid;
    for (var r = 0u; r < R; r++) {
        let m0 = f32(sh[idx & 2047u]);
        let m1 = f32(sh[(idx + 64u) & 2047u]);
        let m2 = f32(sh[(idx + 128u) & 2047u]);
        let m3 = f32(sh[(idx + 192u) & 2047u]);
        let w = vec4<f32>(1.0, 2.0, 3.0, 4.0);
        let a = (m0 + m1 + m2 + m3) * w;
        idx = lid + u32(a.x + a.y + a.z + a.w);
    }
    outb[lid] = idx;
}

var<workgroup> bx: array<u32, 1024>;

// R rounds of: write a word, barrier, read a neighbour's, barrier (2 barriers a round).
fn bar_rounds(lid: u32, n: u32) {
    var idx = lid + buf[0]; // (every kernel uses both bindings: one bind group layout)
    for (var r = 0u; r < R; r++) {
        bx[lid] = idx;
        workgroupBarrier();
        idx = bx[(lid + 1u) % n] + 1u;
        workgroupBarrier();
    }
    outb[lid % 64u] = idx;
}
@compute @workgroup_size(64)
fn bar64(@builtin(local_invocation_index) lid: u32) { bar_rounds(lid, 64u); }
@compute @workgroup_size(256)
fn bar256(@builtin(local_invocation_index) lid: u32) { bar_rounds(lid, 256u); }
@compute @workgroup_size(1024)
fn bar1024(@builtin(local_invocation_index) lid: u32) { bar_rounds(lid, 1024u); }
";

const KERNELS: [&str; 12] = [
    "gl_loop",
    "gl_loop4",
    "gl_unroll",
    "sh_loop",
    "sh_unroll",
    "arr_loop",
    "arr_vec",
    "bar64",
    "bar256",
    "bar1024",
    "code_once",
    "code_loop",
];

/// The shuffle kernels (a module of their own: it needs SUBGROUP). A round: three dependent
/// xor shuffles, each added to the running value.
const SHUFFLE_WGSL: &str = "
@group(0) @binding(0) var<storage, read_write> buf: array<u32>;
@group(0) @binding(1) var<storage, read_write> outb: array<u32>;
const R: u32 = 256u;

fn round3(x: u32) -> u32 {
    var a = x + subgroupShuffleXor(x, 1u);
    a = a + subgroupShuffleXor(a, 2u);
    return a + subgroupShuffleXor(a, 4u);
}
fn rounds(lid: u32) -> u32 {
    var x = buf[lid];
    for (var r = 0u; r < R; r++) { x = round3(x); }
    return x;
}
@compute @workgroup_size(64)
fn shuf64(@builtin(local_invocation_index) lid: u32) { outb[lid % 64u] = rounds(lid); }
@compute @workgroup_size(1024)
fn shuf1024(@builtin(local_invocation_index) lid: u32) { outb[lid % 64u] = rounds(lid); }
@compute @workgroup_size(1024)
fn shufloop1024(@builtin(local_invocation_index) lid: u32) {
    var x = buf[lid];
    for (var r = 0u; r < R; r++) {
        for (var m = 1u; m < 8u; m <<= 1u) { x += subgroupShuffleXor(x, m); }
    }
    outb[lid % 64u] = x;
}
@compute @workgroup_size(1024)
fn shufdiv1024(@builtin(local_invocation_index) lid: u32) {
    var x = 0u;
    if (lid < 544u) { x = rounds(lid); }
    outb[lid % 64u] = x;
}
";

const SHUFFLE_KERNELS: [&str; 4] = ["shuf64", "shuf1024", "shufloop1024", "shufdiv1024"];

/// Two more kernels, generated: `code_once` runs 2048 distinct dependent multiply-adds of
/// straight-line code once (cold instruction cache: every line of code fetched once), and
/// `code_loop` the same count of multiply-adds as a loop of 8 per trip (a few hundred bytes of
/// code, fetched once and reused). Their gap is the cost of executing cold code once, as a
/// decode kernel does.
fn icache_kernels() -> String {
    let mut s = String::from(
        "@compute @workgroup_size(64)\nfn code_once(@builtin(local_invocation_index) lid: u32) {\n    var x = f32(buf[lid]);\n",
    );
    for k in 0..2048 {
        s.push_str(&format!(
            "    x = x * {:.6} + {:.6};\n",
            1.0 + k as f64 * 1e-6,
            k as f64 * 1e-3
        ));
    }
    s.push_str("    outb[lid] = u32(x);\n}\n");
    s.push_str(
        "@compute @workgroup_size(64)\nfn code_loop(@builtin(local_invocation_index) lid: u32) {\n    var x = f32(buf[lid]);\n    let n = 256u + buf[lid + 64u];\n    for (var k = 0u; k < n; k++) {\n        let c = f32(k) * 1e-6;\n",
    );
    for k in 0..8 {
        s.push_str(&format!(
            "        x = x * ({:.1} + c) + c;\n",
            1.0 + k as f64
        ));
    }
    s.push_str("    }\n    outb[lid] = u32(x);\n}\n");
    s
}

#[test]
#[ignore]
fn loop_unroll() {
    let ctx = ctx();
    if !ctx.has_timestamps() {
        eprintln!("no timestamps: nothing to measure");
        return;
    }
    let dev = ctx.device();
    // wgpu's default checks (naga adds a counter to every loop), the library's (bounds checks
    // only: `checks::ShaderChecks::Bounds`), and none (`DriverBounded`).
    let mut library = wgpu::ShaderRuntimeChecks::checked();
    library.force_loop_bounding = false;
    library.int_div_checks = false;
    let checks = [
        ("all checks", wgpu::ShaderRuntimeChecks::checked()),
        ("bounds only", library),
        ("no checks", wgpu::ShaderRuntimeChecks::unchecked()),
    ];
    // 256 rounds x 16 loads x 64 words (+ 64): zero-filled at creation, 1 MiB (L2-resident).
    let words = 256 * 16 * 64 + 64;
    let mk = |size: u64| {
        dev.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let (buf, outb) = (mk(4 * words), mk(4 * 64));
    for (label, check) in checks {
        eprintln!("{label}:");
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some("loop_unroll"),
            source: wgpu::ShaderSource::Wgsl(format!("{WGSL}{}", icache_kernels()).into()),
        };
        // SAFETY: the kernels index within their bindings (the buffer is sized for them).
        let module = unsafe { dev.create_shader_module_trusted(desc, check) };
        time_kernels(ctx, &module, &KERNELS, &buf, &outb);
        if ctx.features().contains(wgpu::Features::SUBGROUP) {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some("shuffles"),
                source: wgpu::ShaderSource::Wgsl(SHUFFLE_WGSL.into()),
            };
            // SAFETY: as above (indices below 1024 in a buffer of 256 * 16 * 64 + 64 words).
            let module = unsafe { dev.create_shader_module_trusted(desc, check) };
            time_kernels(ctx, &module, &SHUFFLE_KERNELS, &buf, &outb);
        }
    }
}

fn time_kernels(
    ctx: &pisa_wgpu::Context,
    module: &wgpu::ShaderModule,
    kernels: &[&'static str],
    buf: &wgpu::Buffer,
    outb: &wgpu::Buffer,
) {
    let dev = ctx.device();
    for &name in kernels {
        let pipe = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(name),
            layout: None,
            module,
            entry_point: Some(name),
            compilation_options: Default::default(),
            cache: None,
        });
        let group = common::bind_group(&pipe, &[(0, buf), (1, outb)]);
        let mut spans = Vec::new();
        for rep in 0..8 {
            let mut prof = Profiler::new(ctx, 1);
            let mut enc = dev.create_command_encoder(&Default::default());
            {
                let mut pass = prof.compute_pass(&mut enc, name);
                pass.set_pipeline(&pipe);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups(1, 1, 1);
            }
            ctx.queue().submit([enc.finish()]);
            let _ = dev.poll(wgpu::PollType::wait_indefinitely());
            let span = prof.finish_span(ctx, name).unwrap().unwrap();
            if rep > 1 {
                spans.push(span * 1e6);
            }
        }
        spans.sort_by(f64::total_cmp);
        let med = spans[spans.len() / 2];
        eprintln!(
            "{name:>10}: {med:9.1} ns per dispatch, {:7.2} ns per round",
            med / 256.0
        );
    }
}
