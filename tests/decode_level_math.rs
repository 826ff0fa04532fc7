//! The route's level-width arithmetic (`shaders/decode_levels.wgsl`: `div_pw`, `cdiv_pw`,
//! `mul_pw`, shifts when the merge factor g is a power of two, divisions otherwise) against u64
//! arithmetic on the CPU (a module of `tests/decode.rs`). A small test entry point appended to
//! the route shader runs them on the device for g = 2, 3, 4, 8 and every width pw = g^e within
//! u32, at values around the multiples of pw (remainders 0, 1 and pw - 1: the rounding-up arm)
//! and near u32::MAX (the saturating product). The decode tests exercise these functions only
//! where random inputs make a level's partial last node matter, which is rare.

use super::common::*;
use pisa_wgpu::ops::decode::ROUTE_SHADER;
use pisa_wgpu::runtime::pipeline::preprocess;
use pisa_wgpu::{ShaderSource, Storage, POISON_I32};

const ENTRY: &str = "
@compute @workgroup_size(64)
fn level_math(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&lens) / 2u) { return; }
    let a = lens[2u * i];
    let pw = lens[2u * i + 1u];
    cands[3u * i] = div_pw(a, pw);
    cands[3u * i + 1u] = cdiv_pw(a, pw);
    cands[3u * i + 2u] = mul_pw(a, pw);
}
";

/// (a, pw) pairs for merge factor g.
fn inputs(g: u64) -> Vec<(u32, u32)> {
    let mut v = Vec::new();
    let mut pw = 1u64;
    while pw <= u32::MAX as u64 {
        for a in [
            0,
            1,
            pw - 1,
            pw,
            pw + 1,
            2 * pw - 1,
            2 * pw,
            3 * pw + 1,
            1000 * pw + 1,
            1000 * pw + pw - 1,
            u32::MAX as u64 / pw,
            u32::MAX as u64 / pw + 1,
            u32::MAX as u64 - 1,
            u32::MAX as u64,
        ] {
            if a <= u32::MAX as u64 {
                v.push((a as u32, pw as u32));
            }
        }
        pw *= g;
    }
    v
}

#[test]
fn level_width_arithmetic_matches_u64() {
    let ctx = ctx();
    let dev = ctx.device();
    for g in [2u64, 3, 4, 8] {
        let pairs = inputs(g);
        let flat: Vec<u32> = pairs.iter().flat_map(|&(a, pw)| [a, pw]).collect();
        let src = ShaderSource {
            name: "decode_level_math",
            wgsl: Box::leak(format!("{}{ENTRY}", ROUTE_SHADER.wgsl).into_boxed_str()),
        };
        let text = preprocess(&src, Storage::F32, &[("MG", g as u32)]).unwrap();
        let pipe = compute_pipeline(
            "decode_level_math",
            &text,
            "level_math",
            wgpu::ShaderRuntimeChecks::checked(),
        );
        let input = ctx.upload_u32("pairs", &flat).unwrap();
        let out = ctx
            .alloc("results", 3 * pairs.len(), Storage::F32, POISON_I32)
            .unwrap();
        let group = bind_group(&pipe, &[(1, &input.buffer), (10, &out.buffer)]);
        let mut enc = dev.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipe);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(pairs.len().div_ceil(64) as u32, 1, 1);
        }
        ctx.queue().submit([enc.finish()]);
        let got = ctx.read_i32(&out).unwrap();
        for (i, &(a, pw)) in pairs.iter().enumerate() {
            let (a64, pw64) = (a as u64, pw as u64);
            let want = [
                a64 / pw64,
                a64.div_ceil(pw64),
                (a64 * pw64).min(u32::MAX as u64),
            ];
            for (k, name) in ["div_pw", "cdiv_pw", "mul_pw"].into_iter().enumerate() {
                assert_eq!(
                    got[3 * i + k] as u32 as u64,
                    want[k],
                    "g {g}: {name}({a}, {pw})"
                );
            }
        }
    }
}
