//! `subgroupShuffleXor`, the one subgroup operation pisa's kernels use (the routing's score step,
//! `shaders/route_sg.wgsl`, and the decode route's level steps, `shaders/decode_levels_sg.wgsl`),
//! on this device: every invocation of a workgroup of 256 exchanges its index with each mask
//! below `Context::shuffle_lanes`, the span the kernels plan their lanes within, and must get
//! its index xor the mask. The output is poisoned (`POISON_F32`'s bits, no lane index), so an
//! unwritten element fails.
//!
//! Why: llvmpipe's shuffles are wrong for masks of 16 and above in the subgroups of 32 and 64
//! it makes with `LP_NATIVE_VECTOR_WIDTH` 1024 and 2048 (Mesa 22.3, LLVM 15), which made the
//! routing kernel return wrong selections at GQA group 16 there; `shuffle_lanes` is at most 16
//! on llvmpipe since (`AdapterReport::shuffle_lanes`). CI runs this test at those widths too
//! (`scripts/test.sh`). On llvmpipe with subgroups above 16 the test also checks that the masks
//! past the cap are still wrong: when a Mesa fixes them, it fails, and the cap can go.

mod common;

use common::{bind_group, compute_pipeline, ctx};

const SHADER: &str = r#"
@group(0) @binding(0) var<storage, read_write> out: array<u32>;

// out[lid * 8 + b]: the value of lane lid ^ (1 << b) as seen by lid, for b < 8 (masks 1..128,
// each only where it is below the subgroup size); elsewhere the poison the host wrote.
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) ss: u32) {
    for (var b = 0u; b < 8u; b++) {
        let m = 1u << b;
        if (m < ss) {
            out[lid * 8u + b] = subgroupShuffleXor(lid, m);
        }
    }
}
"#;

#[test]
fn shuffle_xor_within_shuffle_lanes() {
    let ctx = ctx();
    if !ctx.features().contains(wgpu::Features::SUBGROUP) {
        eprintln!("no subgroups on {}: nothing to check", ctx.report().name);
        return;
    }
    let (sg_min, sg_max) = ctx.report().subgroup_size;
    let lanes = ctx.shuffle_lanes();
    eprintln!(
        "{}: subgroups {sg_min}..{sg_max}, shuffle lanes {lanes}",
        ctx.report().name
    );
    assert!(lanes >= 1 && lanes <= sg_min);
    let pipe = compute_pipeline(
        "shuffle probe",
        SHADER,
        "main",
        wgpu::ShaderRuntimeChecks::checked(),
    );
    let out = ctx
        .alloc(
            "shuffle probe",
            256 * 8,
            pisa_wgpu::Storage::F32,
            pisa_wgpu::POISON_F32,
        )
        .unwrap();
    let bind = bind_group(&pipe, &[(0, &out.buffer)]);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    ctx.queue().submit([enc.finish()]);
    let got: Vec<u32> = ctx
        .read_f32(&out)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    // Masks below the kernels' span: right for every invocation (the poison is no lane index).
    let mut checked = 0;
    for b in 0..8 {
        let m = 1u32 << b;
        if m >= lanes {
            break;
        }
        for lid in 0..256u32 {
            let v = got[(lid * 8 + b) as usize];
            assert_eq!(v, lid ^ m, "lane {lid}, mask {m}: got {v:#x}");
        }
        checked += 1;
    }
    assert_eq!(checked, lanes.trailing_zeros(), "masks checked");
    // llvmpipe above the cap: the fault the cap is for must still be there.
    if ctx.report().name.contains("llvmpipe") && sg_min > lanes {
        let wrong = (lanes.trailing_zeros()..sg_min.trailing_zeros())
            .any(|b| (0..256u32).any(|lid| got[(lid * 8 + b) as usize] != lid ^ (1 << b)));
        assert!(
            wrong,
            "llvmpipe's shuffles are right for masks {lanes} and above now: \
             AdapterReport::shuffle_lanes need not cap them"
        );
    }
}
