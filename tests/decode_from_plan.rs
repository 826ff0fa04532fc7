//! A decode cache taking over a prefill plan's keys, values and key pyramid
//! (`KvCache::record_prefill_from_plan`: no pyramid build; the keys and values copied from the
//! plan's staging, or gathered from the caller's views when the run read them in place) decodes
//! bitwise like a cache loaded from the same keys and values through views
//! (`record_prefill_view`: gather and pyramid build, itself checked against the CPU reference in
//! `tests/embedding.rs`), over append + step rounds that cross pyramid level boundaries. Both
//! caches start poisoned, so a missed copy shows as NaN; everything is recorded without waits
//! (`record_*`), the plan's run and the take-over in one submission.
mod common;

use common::*;
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::{
    wgpu, Context, DType, GpuError, KvCache, PlanViews, PrefillOptions, PrefillOutputs,
    PrefillPlan, StepOutputs, Storage, TensorView,
};

/// The take-over after a run that read K and V in place (views at byte 0: the take-over
/// gathers each batch entry from the caller's views) and after one that gathered them (views
/// at byte 52, not a binding boundary: the take-over copies the plan's staging), with f32 and
/// bf16 storage (bf16 views read in place, a bf16 cache); with views read in place, also the
/// take-over from a plan without staging ([`PrefillPlan::new_in_place`]).
#[test]
fn cache_from_plan_decodes_like_cache_from_views() {
    for pad in [0usize, 52] {
        take_over(pad, Storage::F32);
    }
    // bf16: the plan reads bf16 views in place (pad 0) or gathers them, the caches hold bf16.
    for pad in [0usize, 52] {
        take_over(pad, Storage::Bf16);
    }
}

/// A buffer holding `data` in the dtype of `st` (f32 or bf16) after `pad` bytes of 0x5A.
fn padded(ctx: &Context, pad: usize, data: &[f32], st: Storage) -> wgpu::Buffer {
    let mut bytes = vec![0x5Au8; pad];
    match st {
        Storage::Bf16 => {
            let h: Vec<u16> = (data.iter().map(|&x| half::bf16::from_f32(x).to_bits())).collect();
            bytes.extend_from_slice(bytemuck::cast_slice(&h));
        }
        _ => bytes.extend_from_slice(bytemuck::cast_slice(data)),
    }
    let b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("app"),
        size: bytes.len().div_ceil(4) as u64 * 4,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    bytes.resize(bytes.len().div_ceil(4) * 4, 0);
    ctx.queue().write_buffer(&b, 0, &bytes);
    b
}

fn take_over(pad: usize, st: Storage) {
    let ctx = ctx();
    let (bsz, hq, hkv, n, d) = (2usize, 6usize, 2usize, 120usize, 32usize);
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let shape = AttentionShape::prefill(bsz, hq, hkv, n, d).unwrap();
    let opts = PrefillOptions {
        cfg,
        storage: st,
        ..Default::default()
    };
    let mut r = rng(seed("cache_from_plan"));
    let (q, k, v) = (
        random(&mut r, shape.q_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
    );
    let (qb, kb, vb) = (
        padded(ctx, pad, &q, st),
        padded(ctx, pad, &k, st),
        padded(ctx, pad, &v, st),
    );
    let (ob, lb) = (
        app_buffer(ctx, &vec![0f32; shape.q_elems()]),
        app_buffer(ctx, &vec![0f32; shape.lse_elems()]),
    );
    let plan = PrefillPlan::new(ctx, &shape, &opts).unwrap();
    let capacity = 200;
    let new_cache = || KvCache::new(ctx, bsz, capacity, hq, hkv, d, cfg, st).unwrap();
    let (mut from_plan, mut from_views) = (new_cache(), new_cache());
    // With views read in place, also a plan without staging (new_in_place), whose take-over
    // gathers from the views into tensors of its own.
    let mut from_only = (pad == 0).then(new_cache);

    let mut enc = ctx.device().create_command_encoder(&Default::default());
    // A plan of another block size is refused.
    let other = PrefillOptions {
        cfg: SelectionConfig::new(32, 3).unwrap(),
        storage: st,
        ..Default::default()
    };
    let other_plan = PrefillPlan::new(ctx, &shape, &other).unwrap();
    let e = from_plan
        .record_prefill_from_plan(&mut enc, 0, &other_plan, 0)
        .unwrap_err();
    assert!(
        matches!(e, GpuError::Unsupported(ref m) if m.contains("block size")),
        "{e}"
    );
    // A plan of another context (another device) is refused: the take-over's copies would
    // panic inside wgpu when the encoder finishes (found by an embedder's trial).
    if pad == 0 && st == Storage::F32 {
        let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
        let foreign = PrefillPlan::new(&own, &shape, &opts).unwrap();
        let e = from_plan
            .record_prefill_from_plan(&mut enc, 0, &foreign, 0)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::Unsupported(ref m) if m.contains("different contexts")),
            "{e}"
        );
    }
    // A plan that has not run has nothing to hand over (its buffers hold no sequence yet).
    let e = from_plan
        .record_prefill_from_plan(&mut enc, 0, &plan, 0)
        .unwrap_err();
    assert!(
        matches!(e, GpuError::Unsupported(ref m) if m.contains("run first")),
        "{e}"
    );

    let at_pad = |b: &wgpu::Buffer, shape: [usize; 4]| {
        TensorView::contiguous(b, pad as u64, DType::from(st), shape, TensorLayout::Bhnd).unwrap()
    };
    let (qv, kv, vv) = (
        at_pad(&qb, [bsz, hq, n, d]),
        at_pad(&kb, [bsz, hkv, n, d]),
        at_pad(&vb, [bsz, hkv, n, d]),
    );
    for view in [&qv, &kv, &vv] {
        assert_eq!(plan.reads_in_place(view), pad == 0, "pad {pad} {st:?}");
    }
    let (ov, lv) = (
        bhnd_f32(&ob, [bsz, hq, n, d]),
        bhnd_f32(&lb, [bsz, hq, n, 1]),
    );
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    plan.run(&mut enc, &qv, &kv, &vv, &outs, None).unwrap();
    let only = from_only.as_ref().map(|_| {
        let views = PlanViews {
            q: &qv,
            k: &kv,
            v: &vv,
            out: None,
        };
        let p = PrefillPlan::new_in_place(ctx, &shape, &opts, &views).unwrap();
        p.run(&mut enc, &qv, &kv, &vv, &outs, None).unwrap();
        p
    });
    for b in 0..bsz {
        from_plan
            .record_prefill_from_plan(&mut enc, b, &plan, b)
            .unwrap();
        if let (Some(c), Some(p)) = (&mut from_only, &only) {
            c.record_prefill_from_plan(&mut enc, b, p, b).unwrap();
        }
        let at = pad as u64 + (b * hkv * n * d) as u64 * st.bytes();
        let view = |buf| {
            TensorView::contiguous(buf, at, DType::from(st), [1, hkv, n, d], TensorLayout::Bhnd)
                .unwrap()
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
    let out_buf = |len: usize| app_buffer(ctx, &vec![f32::NAN; len]);
    let (o1, l1, o2, l2) = (
        out_buf(bsz * hq * d),
        out_buf(bsz * hq),
        out_buf(bsz * hq * d),
        out_buf(bsz * hq),
    );
    let (ov1, lv1, ov2, lv2) = (
        bhnd_f32(&o1, [bsz, hq, 1, d]),
        bhnd_f32(&l1, [bsz, hq, 1, 1]),
        bhnd_f32(&o2, [bsz, hq, 1, d]),
        bhnd_f32(&l2, [bsz, hq, 1, 1]),
    );
    let (o3, l3) = (out_buf(bsz * hq * d), out_buf(bsz * hq));
    let (ov3, lv3) = (
        bhnd_f32(&o3, [bsz, hq, 1, d]),
        bhnd_f32(&l3, [bsz, hq, 1, 1]),
    );
    let base = seed("cache_from_plan_steps");
    for step in 0..60u64 {
        let (kr, vr, qr) = (
            app_buffer(ctx, &row(bsz * hkv * d, base + 3 * step)),
            app_buffer(ctx, &row(bsz * hkv * d, base + 3 * step + 1)),
            app_buffer(ctx, &row(bsz * hq * d, base + 3 * step + 2)),
        );
        let (krv, vrv, qrv) = (
            bhnd_f32(&kr, [bsz, hkv, 1, d]),
            bhnd_f32(&vr, [bsz, hkv, 1, d]),
            bhnd_f32(&qr, [bsz, hq, 1, d]),
        );
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let mut caches = vec![(&mut from_plan, &ov1, &lv1), (&mut from_views, &ov2, &lv2)];
        if let Some(c) = &mut from_only {
            caches.push((c, &ov3, &lv3));
        }
        for (cache, o, l) in caches {
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
            if from_only.is_some() {
                assert_eq!(
                    a,
                    ctx.read_bytes(&o3).unwrap(),
                    "step {step}: O (no staging)"
                );
                assert_eq!(
                    ctx.read_bytes(&l1).unwrap(),
                    ctx.read_bytes(&l3).unwrap(),
                    "step {step}: LSE (no staging)"
                );
            }
        }
    }
    assert_eq!(from_plan.lens(), &[n + 60, n + 60]);
}

/// Decode rows taken from a packed QKV projection `[B, (Hq + 2 Hkv) * D]` (views that are not
/// contiguous, so the cache gathers them) and from bf16 copies decode bitwise like the same rows
/// in separate contiguous buffers (bound in place); the bf16 rows are exactly representable, so
/// the conversion must be exact.
#[test]
fn packed_and_bf16_rows_decode_like_contiguous_rows() {
    let ctx = ctx();
    let (bsz, hq, hkv, d) = (3usize, 4usize, 2usize, 32usize);
    let cfg = SelectionConfig::new(16, 2).unwrap();
    let new_cache = || KvCache::new(ctx, bsz, 96, hq, hkv, d, cfg, Storage::F32).unwrap();
    let mut caches = [new_cache(), new_cache(), new_cache()];
    let row = (hq + 2 * hkv) * d;
    let out_buf = || app_buffer(ctx, &vec![f32::NAN; bsz * hq * d]);
    let lse_buf = || app_buffer(ctx, &vec![f32::NAN; bsz * hq]);
    let outs: Vec<(wgpu::Buffer, wgpu::Buffer)> = (0..3).map(|_| (out_buf(), lse_buf())).collect();
    let base = seed("packed_rows");
    // The application's buffers, the same at every step (rewritten with each step's rows).
    let packed = app_buffer(ctx, &vec![0.0; bsz * row]);
    let (cq, ck, cv) = (
        app_buffer(ctx, &vec![0.0; bsz * hq * d]),
        app_buffer(ctx, &vec![0.0; bsz * hkv * d]),
        app_buffer(ctx, &vec![0.0; bsz * hkv * d]),
    );
    let bf = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("bf16 qkv"),
        size: (bsz * row * 2).div_ceil(4) as u64 * 4,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    for step in 0..40u64 {
        // Rows exactly representable in bf16 (8 significant bits), so bf16 loses nothing.
        let mut qkv = random(&mut rng(base + step), bsz * row, 1.0);
        for x in qkv.iter_mut() {
            *x = half::bf16::from_f32(*x).to_f32();
        }
        ctx.queue()
            .write_buffer(&packed, 0, bytemuck::cast_slice(&qkv));
        let strides = [row, d, row, 1];
        let pv = |off: usize, h: usize| {
            TensorView::new(
                &packed,
                (off * 4) as u64,
                DType::F32,
                [bsz, h, 1, d],
                strides,
            )
            .unwrap()
        };
        let (pq, pk, pvv) = (pv(0, hq), pv(hq * d, hkv), pv((hq + hkv) * d, hkv));
        // The same rows in separate contiguous buffers.
        let part = |off: usize, h: usize| -> Vec<f32> {
            (0..bsz)
                .flat_map(|b| qkv[b * row + off..b * row + off + h * d].to_vec())
                .collect()
        };
        for (b, off, h) in [(&cq, 0, hq), (&ck, hq * d, hkv), (&cv, (hq + hkv) * d, hkv)] {
            ctx.queue()
                .write_buffer(b, 0, bytemuck::cast_slice(&part(off, h)));
        }
        // And as bf16 words, packed like the f32 projection.
        let words: Vec<u16> = qkv
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        ctx.queue()
            .write_buffer(&bf, 0, bytemuck::cast_slice(&words));
        let bv = |off: usize, h: usize| {
            TensorView::new(&bf, (off * 2) as u64, DType::BF16, [bsz, h, 1, d], strides).unwrap()
        };
        let (bq, bk, bvv) = (bv(0, hq), bv(hq * d, hkv), bv((hq + hkv) * d, hkv));
        let inputs = [
            (pq, pk, pvv),
            (
                bhnd_f32(&cq, [bsz, hq, 1, d]),
                bhnd_f32(&ck, [bsz, hkv, 1, d]),
                bhnd_f32(&cv, [bsz, hkv, 1, d]),
            ),
            (bq, bk, bvv),
        ];
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        for ((cache, (q, k, v)), (o, l)) in caches.iter_mut().zip(&inputs).zip(&outs) {
            cache
                .record_append_view(&mut enc, k, v, &[true, step % 3 != 0, true], None)
                .unwrap();
            let (ov, lv) = (bhnd_f32(o, [bsz, hq, 1, d]), bhnd_f32(l, [bsz, hq, 1, 1]));
            let so = StepOutputs {
                out: &ov,
                lse: &lv,
                selection: None,
            };
            cache
                .record_step_into(&mut enc, q, Some(&so), None)
                .unwrap();
        }
        ctx.queue().submit([enc.finish()]);
        if step % 8 == 7 {
            let o: Vec<Vec<u8>> = outs
                .iter()
                .map(|(o, _)| ctx.read_bytes(o).unwrap())
                .collect();
            let f: &[f32] = bytemuck::cast_slice(&o[1]);
            assert!(
                f.iter().all(|x| x.is_finite()),
                "step {step}: O not written"
            );
            assert_eq!(o[0], o[1], "step {step}: packed rows differ");
            assert_eq!(o[2], o[1], "step {step}: bf16 rows differ");
        }
    }
    // The same buffers at every step, masks alternating: each cache built one step, one
    // append per mask kind (all, some) and one gather per gathered view (none for the
    // contiguous f32 rows), not a set per step or per mask.
    for (cache, gathers) in caches.iter().zip([3, 0, 3]) {
        assert_eq!(cache.kept_dispatch_sets(), [1, 2, gathers]);
    }
}

/// A run that read K and V in place and wrote an output over their bytes (which a run may do:
/// its outputs are copied out after its kernels) leaves no keys and values to take over: the
/// take-over is refused with a `View` error naming the output, where it used to load the
/// output's bytes into the cache as keys. The same plan's take-over after a run with its outputs
/// elsewhere works.
#[test]
fn take_over_after_an_output_over_keys_read_in_place_is_refused() {
    let ctx = ctx();
    let (hq, hkv, n, d) = (2usize, 1usize, 64usize, 32usize);
    let cfg = SelectionConfig::new(16, 3).unwrap();
    let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
    let opts = PrefillOptions {
        cfg,
        storage: Storage::F32,
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &shape, &opts).unwrap();
    // Q, K, V in one buffer, each at a multiple of 256 bytes (read in place).
    let mut r = rng(11);
    let (qn, kn) = (hq * n * d, hkv * n * d);
    let qkv = padded(ctx, 0, &random(&mut r, qn + 2 * kn, 1.0), Storage::F32);
    let view = |off: usize, h: usize| {
        TensorView::contiguous(
            &qkv,
            4 * off as u64,
            DType::F32,
            [1, h, n, d],
            TensorLayout::Bhnd,
        )
        .unwrap()
    };
    let (q, k, v) = (view(0, hq), view(qn, hkv), view(qn + kn, hkv));
    assert!(plan.reads_in_place(&k) && plan.reads_in_place(&v));
    let lse_buf = padded(ctx, 0, &vec![f32::NAN; hq * n], Storage::F32);
    let lse =
        TensorView::contiguous(&lse_buf, 0, DType::F32, [1, hq, n, 1], TensorLayout::Bhnd).unwrap();
    let o_buf = padded(ctx, 0, &vec![f32::NAN; qn], Storage::F32);
    let apart =
        TensorView::contiguous(&o_buf, 0, DType::F32, [1, hq, n, d], TensorLayout::Bhnd).unwrap();
    // O over K and V (the same 2 * kn floats).
    let over = view(qn, hq);
    let mut cache = KvCache::new(ctx, 1, 128, hq, hkv, d, cfg, Storage::F32).unwrap();
    for (out, refused) in [(&over, true), (&apart, false)] {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let outs = PrefillOutputs {
            out,
            lse: &lse,
            selection: None,
        };
        plan.run(&mut enc, &q, &k, &v, &outs, None).unwrap();
        let r = cache.record_prefill_from_plan(&mut enc, 0, &plan, 0);
        if refused {
            let e = r.unwrap_err();
            assert!(
                matches!(e, GpuError::View(ref m) if m.contains("wrote its output over")),
                "{e}"
            );
            assert_eq!(cache.lens(), &[0]);
        } else {
            r.unwrap();
            assert_eq!(cache.lens(), &[n]);
        }
        ctx.queue().submit([enc.finish()]);
    }
}

/// A run refused for one of its input views records nothing: the docs promise the views are
/// checked before anything is recorded. Here the second run's V (f16, gathered into the f32
/// staging) ends inside the last, partial 4-byte word of its buffer, a view error; its Q and
/// K, which qualify, were gathered into the plan's staging before V was checked, so the
/// take-over of the first run recorded after it (in the same encoder, which the application
/// submits for the first run) copied the second run's keys under the first run's pyramid.
#[test]
fn a_run_refused_for_an_input_view_records_nothing() {
    let ctx = ctx();
    let (hq, hkv, n, d) = (2usize, 1usize, 40usize, 32usize);
    let cfg = SelectionConfig::new(8, 2).unwrap();
    let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &shape, &opts).unwrap();
    let mut r = rng(seed("refused_run_records_nothing"));
    // Views at byte 52 (not a binding boundary): gathered into the staging.
    let views = |r: &mut _| {
        let q = padded(ctx, 52, &random(r, hq * n * d, 1.0), Storage::F32);
        let k = random(r, hkv * n * d, 1.0);
        let v = random(r, hkv * n * d, 1.0);
        let (kb, vb) = (
            padded(ctx, 52, &k, Storage::F32),
            padded(ctx, 52, &v, Storage::F32),
        );
        let view = |b: &wgpu::Buffer, h: usize| {
            TensorView::contiguous(b, 52, DType::F32, [1, h, n, d], TensorLayout::Bhnd).unwrap()
        };
        ([view(&q, hq), view(&kb, hkv), view(&vb, hkv)], (k, v))
    };
    let ([q1, k1, v1], (k1_host, v1_host)) = views(&mut r);
    let ([q2, k2, _], _) = views(&mut r);
    assert!(!plan.reads_in_place(&k1) && !plan.reads_in_place(&k2));
    // V of the second run: f16 from byte 2 to the end of a buffer of 2 + 2 * elems bytes.
    let elems = hkv * n * d;
    let vbuf = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("odd-sized v"),
        size: (2 + 2 * elems) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let v2 =
        TensorView::contiguous(&vbuf, 2, DType::F16, [1, hkv, n, d], TensorLayout::Bhnd).unwrap();
    let (ob, lb) = (
        app_buffer(ctx, &vec![0f32; hq * n * d]),
        app_buffer(ctx, &vec![0f32; hq * n]),
    );
    let (o, lse) = (bhnd_f32(&ob, [1, hq, n, d]), bhnd_f32(&lb, [1, hq, n, 1]));
    let outs = PrefillOutputs {
        out: &o,
        lse: &lse,
        selection: None,
    };
    let mut taken = KvCache::new(ctx, 1, 64, hq, hkv, d, cfg, Storage::F32).unwrap();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    plan.run(&mut enc, &q1, &k1, &v1, &outs, None).unwrap();
    let e = plan.run(&mut enc, &q2, &k2, &v2, &outs, None).unwrap_err();
    taken
        .record_prefill_from_plan(&mut enc, 0, &plan, 0)
        .unwrap();
    ctx.queue().submit([enc.finish()]);
    // The same keys and values loaded from the host.
    let mut loaded = KvCache::new(ctx, 1, 64, hq, hkv, d, cfg, Storage::F32).unwrap();
    loaded
        .prefill(0, &k1_host, &v1_host, TensorLayout::Bhnd)
        .unwrap();
    let qd = random(&mut r, hq * d, 1.0);
    let (a, b) = (
        taken.step(&qd, true).unwrap(),
        loaded.step(&qd, true).unwrap(),
    );
    assert_eq!(a.selection, b.selection);
    assert_eq!(
        a.out, b.out,
        "the take-over loaded other keys than the first run's"
    );
    // The error names the view.
    assert!(
        matches!(e, GpuError::View(ref m) if m.starts_with("v: ") && m.contains("partial")),
        "{e}"
    );
}

/// A view that ends inside its buffer's last, partial 4-byte word is refused by every call that
/// gathers or scatters it, with an error that names the view (it was anonymous: "the gather
/// source view ends at byte ..."), and before anything is recorded.
#[test]
fn a_partial_word_view_is_named_in_the_error() {
    let ctx = ctx();
    let (hq, hkv, n, d) = (2usize, 1usize, 40usize, 32usize);
    let cfg = SelectionConfig::new(8, 2).unwrap();
    let mut r = rng(seed("partial_word_view_named"));
    let rows = hkv * n * d;
    let good = app_buffer(ctx, &random(&mut r, rows, 1.0));
    let good =
        TensorView::contiguous(&good, 0, DType::F32, [1, hkv, n, d], TensorLayout::Bhnd).unwrap();
    // f16 from byte 2 to the end of a buffer of 2 + 2 * elements bytes.
    let odd = |elems: usize, shape: [usize; 4]| {
        let b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
            label: Some("odd-sized"),
            size: (2 + 2 * elems) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        TensorView::contiguous(&b, 2, DType::F16, shape, TensorLayout::Bhnd).unwrap()
    };
    let named = |e: GpuError, name: &str| {
        assert!(
            matches!(e, GpuError::View(ref m) if m.starts_with(&format!("{name}: ")) && m.contains("partial")),
            "expected the view named {name:?}: {e}"
        );
    };
    let mut cache = KvCache::new(ctx, 1, 64, hq, hkv, d, cfg, Storage::F32).unwrap();
    let bad = odd(rows, [1, hkv, n, d]);
    named(
        cache.prefill_view(0, &good, &bad).unwrap_err(),
        "prefill values",
    );
    named(
        cache.prefill_view(0, &bad, &good).unwrap_err(),
        "prefill keys",
    );
    // Nothing was loaded: the sequence is still empty.
    assert_eq!(cache.len(0).unwrap(), 0);
    let row = odd(hkv * d, [1, hkv, 1, d]);
    let full = app_buffer(ctx, &random(&mut r, hkv * d, 1.0));
    let full =
        TensorView::contiguous(&full, 0, DType::F32, [1, hkv, 1, d], TensorLayout::Bhnd).unwrap();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let e = cache
        .record_append_view(&mut enc, &full, &row, &[true], None)
        .unwrap_err();
    named(e, "appended values");
}
