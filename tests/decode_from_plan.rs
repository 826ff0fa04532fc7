//! A decode cache taking over a prefill plan's keys, values and key pyramid
//! (`KvCache::record_prefill_from_plan`: buffer copies, no gather, no pyramid build) decodes
//! bitwise like a cache loaded from the same keys and values through views
//! (`record_prefill_view`: gather and pyramid build, itself checked against the CPU reference in
//! `tests/embedding.rs`), over append + step rounds that cross pyramid level boundaries. Both
//! caches start poisoned, so a missed copy shows as NaN; everything is recorded without waits
//! (`record_*`), the plan's run and the take-over in one submission.
mod common;

use common::*;
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::{
    wgpu, Context, DType, GpuError, KvCache, PrefillOptions, PrefillOutputs, PrefillPlan,
    StepOutputs, Storage, TensorView,
};

fn buffer(ctx: &Context, data: &[f32]) -> wgpu::Buffer {
    let b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("app"),
        size: (data.len() * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    ctx.queue().write_buffer(&b, 0, bytemuck::cast_slice(data));
    b
}

fn bhnd(b: &wgpu::Buffer, shape: [usize; 4]) -> TensorView {
    TensorView::contiguous(b, 0, DType::F32, shape, TensorLayout::Bhnd).unwrap()
}

#[test]
fn cache_from_plan_decodes_like_cache_from_views() {
    let ctx = ctx();
    let (bsz, hq, hkv, n, d) = (2usize, 6usize, 2usize, 120usize, 32usize);
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let shape = AttentionShape::prefill(bsz, hq, hkv, n, d).unwrap();
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let mut r = rng(seed("cache_from_plan"));
    let (q, k, v) = (
        random(&mut r, shape.q_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
    );
    let (qb, kb, vb) = (buffer(ctx, &q), buffer(ctx, &k), buffer(ctx, &v));
    let (ob, lb) = (
        buffer(ctx, &vec![0f32; shape.q_elems()]),
        buffer(ctx, &vec![0f32; shape.lse_elems()]),
    );
    let plan = PrefillPlan::new(ctx, &shape, &opts).unwrap();
    let capacity = 200;
    let new_cache = || KvCache::new(ctx, bsz, capacity, hq, hkv, d, cfg, Storage::F32).unwrap();
    let (mut from_plan, mut from_views) = (new_cache(), new_cache());

    let mut enc = ctx.device().create_command_encoder(&Default::default());
    // A plan of another block size is refused.
    let other = PrefillOptions {
        cfg: SelectionConfig::new(32, 3).unwrap(),
        ..Default::default()
    };
    let other_plan = PrefillPlan::new(ctx, &shape, &other).unwrap();
    let e = from_plan
        .record_prefill_from_plan(&mut enc, 0, &other_plan, 0)
        .unwrap_err();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e}");

    let (qv, kv, vv) = (
        bhnd(&qb, [bsz, hq, n, d]),
        bhnd(&kb, [bsz, hkv, n, d]),
        bhnd(&vb, [bsz, hkv, n, d]),
    );
    let (ov, lv) = (bhnd(&ob, [bsz, hq, n, d]), bhnd(&lb, [bsz, hq, n, 1]));
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    plan.run(&mut enc, &qv, &kv, &vv, &outs, None).unwrap();
    for b in 0..bsz {
        from_plan
            .record_prefill_from_plan(&mut enc, b, &plan, b)
            .unwrap();
        let at = (b * hkv * n * d * 4) as u64;
        let view = |buf| {
            TensorView::contiguous(buf, at, DType::F32, [1, hkv, n, d], TensorLayout::Bhnd).unwrap()
        };
        from_views
            .record_prefill_view(&mut enc, b, &view(&kb), &view(&vb))
            .unwrap();
    }
    ctx.scoped("submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    assert_eq!(from_plan.lens(), &[n, n]);

    // Append + step rounds: 120 -> 180 tokens crosses the 128-token level boundary (C 16, g 2).
    let row = |len: usize, seed: u64| random(&mut rng(seed), len, 1.0);
    let out_buf = |len: usize| buffer(ctx, &vec![f32::NAN; len]);
    let (o1, l1, o2, l2) = (
        out_buf(bsz * hq * d),
        out_buf(bsz * hq),
        out_buf(bsz * hq * d),
        out_buf(bsz * hq),
    );
    let (ov1, lv1, ov2, lv2) = (
        bhnd(&o1, [bsz, hq, 1, d]),
        bhnd(&l1, [bsz, hq, 1, 1]),
        bhnd(&o2, [bsz, hq, 1, d]),
        bhnd(&l2, [bsz, hq, 1, 1]),
    );
    let base = seed("cache_from_plan_steps");
    for step in 0..60u64 {
        let (kr, vr, qr) = (
            buffer(ctx, &row(bsz * hkv * d, base + 3 * step)),
            buffer(ctx, &row(bsz * hkv * d, base + 3 * step + 1)),
            buffer(ctx, &row(bsz * hq * d, base + 3 * step + 2)),
        );
        let (krv, vrv, qrv) = (
            bhnd(&kr, [bsz, hkv, 1, d]),
            bhnd(&vr, [bsz, hkv, 1, d]),
            bhnd(&qr, [bsz, hq, 1, d]),
        );
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        for (cache, o, l) in [(&mut from_plan, &ov1, &lv1), (&mut from_views, &ov2, &lv2)] {
            cache
                .record_append_view(&mut enc, &krv, &vrv, &[true, true], None)
                .unwrap();
            let so = StepOutputs {
                out: o,
                lse: l,
                selection: None,
            };
            cache
                .record_step_into(&mut enc, &qrv, Some(&so), None)
                .unwrap();
        }
        ctx.queue().submit([enc.finish()]);
        if step % 6 == 5 || step == 8 {
            let (a, b) = (ctx.read_bytes(&o1).unwrap(), ctx.read_bytes(&o2).unwrap());
            let fa: &[f32] = bytemuck::cast_slice(&a);
            assert!(
                fa.iter().all(|x| x.is_finite()),
                "step {step}: O not written"
            );
            assert_eq!(a, b, "step {step}: O differs");
            assert_eq!(
                ctx.read_bytes(&l1).unwrap(),
                ctx.read_bytes(&l2).unwrap(),
                "step {step}: LSE differs"
            );
        }
    }
    assert_eq!(from_plan.lens(), &[n + 60, n + 60]);
}
