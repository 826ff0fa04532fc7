//! `PrefillPlan`: plan once, run into the caller's encoder over the caller's views. Each run is
//! compared with `prefill_host` on the same data (itself checked against the CPU reference in
//! `prefill.rs`): the plan runs the same kernels on the same (gathered) BHND data, so O, LSE
//! and the selection must be bitwise equal. Inputs are BNHD views at a byte offset that is not a
//! multiple of 256 inside larger buffers; outputs are poisoned first; runs are replays of the
//! plan's arena, two "layers" (two sets of views) are recorded into ONE submission, and a
//! strided output (LSE `[N, Hq]`-major) goes through the scatter.
mod common;

use common::*;
use pisa_core::{AttentionShape, PisaError, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::attention::{by_leaf::leaf_major_path, QkvLayouts};
use pisa_wgpu::ops::prefill::{
    prefill_host, PlanViews, PrefillOptions, PrefillOutputs, PrefillPlan,
};
use pisa_wgpu::runtime::view::KernelLayout;
use pisa_wgpu::{wgpu, Context, DType, GpuError, LeafOrder, Storage, TensorView};

/// A buffer holding `data` (f32) after `pad` bytes of 0x5A.
fn buffer_with(ctx: &Context, pad: usize, data: &[f32]) -> wgpu::Buffer {
    let mut bytes = vec![0x5Au8; pad];
    bytes.extend_from_slice(bytemuck::cast_slice(data));
    bytes.resize(bytes.len().div_ceil(4) * 4, 0);
    bytes_buffer(ctx, "app", &bytes)
}

fn read_f32(ctx: &Context, b: &wgpu::Buffer, pad: usize, n: usize) -> Vec<f32> {
    let bytes = ctx.read_bytes(b).unwrap();
    bytemuck::cast_slice::<u8, f32>(&bytes[pad..pad + 4 * n]).to_vec()
}

struct Layer {
    q: TensorView,
    k: TensorView,
    v: TensorView,
    o: wgpu::Buffer,
    lse: wgpu::Buffer,
    sel: wgpu::Buffer,
    host: pisa_wgpu::ops::prefill::PrefillOutput,
}

const PAD: usize = 52; // not a multiple of 256 (nor of 16)

fn layer(ctx: &Context, s: &AttentionShape, opts: &PrefillOptions, seed: u64) -> Layer {
    let mut r = rng(seed);
    let q = random(&mut r, s.q_elems(), 1.0);
    let k = random(&mut r, s.kv_elems(), 1.0);
    let v = random(&mut r, s.kv_elems(), 1.0);
    let host = prefill_host(ctx, &q, &k, &v, s, opts).unwrap();
    let (b, hq, hkv, n, d) = (s.batch, s.q_heads, s.kv_heads, s.q_len, s.head_dim);
    let view = |data: &[f32], h: usize| {
        let buf = buffer_with(ctx, PAD, &to_bnhd(data, b, h, n, d));
        TensorView::contiguous(
            &buf,
            PAD as u64,
            DType::F32,
            [b, h, n, d],
            TensorLayout::Bnhd,
        )
        .unwrap()
    };
    let poison = |n: usize| buffer_with(ctx, PAD, &vec![f32::from_bits(0xFFFF_FFFF); n]);
    Layer {
        q: view(&q, hq),
        k: view(&k, hkv),
        v: view(&v, hkv),
        o: poison(s.q_elems()),
        lse: poison(s.lse_elems()),
        // (i32::MIN: no entry, index or -1 padding, is that)
        sel: buffer_with(
            ctx,
            PAD,
            &vec![f32::from_bits(0x8000_0000); b * hkv * n * opts.cfg.top_k],
        ),
        host,
    }
}

fn outputs(l: &Layer, s: &AttentionShape, top_k: usize) -> [TensorView; 3] {
    let (b, hq, hkv, n, d) = (s.batch, s.q_heads, s.kv_heads, s.q_len, s.head_dim);
    let p = PAD as u64;
    [
        TensorView::contiguous(&l.o, p, DType::F32, [b, hq, n, d], TensorLayout::Bhnd).unwrap(),
        // LSE stored [B, N, Hq]: strided, written by the scatter.
        TensorView::new(&l.lse, p, DType::F32, [b, hq, n, 1], [n * hq, 1, hq, 1]).unwrap(),
        // The selection must be contiguous at a 4-byte offset.
        TensorView::contiguous(
            &l.sel,
            p,
            DType::I32,
            [b, hkv, n, top_k],
            TensorLayout::Bhnd,
        )
        .unwrap(),
    ]
}

#[test]
fn plan_runs_equal_prefill_host_across_replays_and_layers() {
    let ctx = ctx();
    let s = AttentionShape::prefill(2, 6, 2, 203, 32).unwrap(); // GQA group 3, N not a multiple of C
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(32, 3).unwrap(),
        return_selection: true,
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &s, &opts).unwrap();
    let base = seed("plan_runs_equal_prefill_host");
    // Run 1 alone; then runs 2 and 3 (two layers) recorded into one submission.
    for round in [vec![0u64], vec![1, 2]] {
        let layers: Vec<Layer> = round
            .iter()
            .map(|i| layer(ctx, &s, &opts, base + i))
            .collect();
        let outs: Vec<[TensorView; 3]> = layers.iter().map(|l| outputs(l, &s, 3)).collect();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        for (l, [o, lse, sel]) in layers.iter().zip(&outs) {
            let po = PrefillOutputs {
                out: o,
                lse,
                selection: Some(sel),
            };
            plan.run(&mut enc, &l.q, &l.k, &l.v, &po, None).unwrap();
        }
        // Any wgpu error of the recorded work fails the test with its message.
        ctx.scoped("test submit", || {
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })
        .unwrap();
        for l in &layers {
            let o = read_f32(ctx, &l.o, PAD, s.q_elems());
            assert_eq!(o, l.host.out, "O differs from prefill_host");
            let lse = read_f32(ctx, &l.lse, PAD, s.lse_elems());
            let (hq, n) = (s.q_heads, s.q_len);
            for bi in 0..s.batch {
                for h in 0..hq {
                    for t in 0..n {
                        let got = lse[(bi * n + t) * hq + h];
                        let want = l.host.lse[(bi * hq + h) * n + t];
                        assert_eq!(got.to_bits(), want.to_bits(), "LSE at b{bi} h{h} t{t}");
                    }
                }
            }
            let sel = ctx.read_bytes(&l.sel).unwrap();
            let sel: &[i32] =
                bytemuck::cast_slice(&sel[PAD..PAD + 4 * l.host.selection.as_ref().unwrap().len()]);
            assert_eq!(sel, l.host.selection.as_ref().unwrap().as_slice());
            // The padding before the views is untouched.
            let head = ctx.read_bytes(&l.o).unwrap();
            assert!(head[..PAD].iter().all(|&x| x == 0x5A));
        }
    }
}

/// Regression (found by an embedder's trial): an output view the plan would copy into (contiguous
/// BHND of O's dtype) in a buffer without `COPY_DST` made `run` succeed and the encoder's
/// `finish` panic inside wgpu. Such a view now takes the scatter, which binds it as storage
/// only: O (poisoned, in a `STORAGE | COPY_SRC` buffer) must equal `prefill_host`'s.
#[test]
fn outputs_without_copy_dst_take_the_scatter() {
    let ctx = ctx();
    let s = AttentionShape::prefill(1, 4, 2, 77, 32).unwrap();
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(16, 3).unwrap(),
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &s, &opts).unwrap();
    let l = layer(ctx, &s, &opts, seed("outputs_without_copy_dst"));
    let poison = vec![f32::from_bits(0xFFFF_FFFF); s.q_elems()];
    let o_buf = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("app o without COPY_DST"),
        size: 4 * s.q_elems() as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: true,
    });
    o_buf
        .slice(..)
        .get_mapped_range_mut()
        .unwrap()
        .copy_from_slice(bytemuck::cast_slice(&poison));
    o_buf.unmap();
    let [b, hq, n, d] = [s.batch, s.q_heads, s.q_len, s.head_dim];
    let o = TensorView::contiguous(&o_buf, 0, DType::F32, [b, hq, n, d], TensorLayout::Bhnd);
    let o = o.unwrap();
    let [_, lse, _] = outputs(&l, &s, 3);
    let po = PrefillOutputs {
        out: &o,
        lse: &lse,
        selection: None,
    };
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    plan.run(&mut enc, &l.q, &l.k, &l.v, &po, None).unwrap();
    ctx.scoped("test submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    assert_eq!(read_f32(ctx, &o_buf, 0, s.q_elems()), l.host.out);
}

/// A varlen plan refuses a head dim the attention kernels do not take when it is made, as a
/// prefill plan does (it was accepted, and its first run failed); so is a GQA group above 32.
#[test]
fn varlen_plan_refuses_unsupported_head_dims() {
    let ctx = ctx();
    let opts = PrefillOptions::default();
    for d in [20, 8, 272] {
        for e in [
            pisa_wgpu::VarlenPrefillPlan::new(ctx, 4, 2, d, &opts).unwrap_err(),
            pisa_wgpu::VarlenPrefillPlan::new_in_place(ctx, 4, 2, d, &opts).unwrap_err(),
        ] {
            assert!(
                matches!(e, GpuError::Input(PisaError::HeadDim { head_dim, .. }) if head_dim == d),
                "D {d}: {e}"
            );
        }
        let s = AttentionShape::prefill(1, 4, 2, 64, d).unwrap();
        assert!(PrefillPlan::new(ctx, &s, &opts).is_err(), "D {d}");
    }
    pisa_wgpu::VarlenPrefillPlan::new(ctx, 4, 2, 48, &opts).unwrap();
    // And a GQA group above the selection's 32, as PrefillPlan::new does, whatever the lengths
    // of the sequences a run would bring (short ones skip the routing that holds the limit).
    for e in [
        pisa_wgpu::VarlenPrefillPlan::new(ctx, 33, 1, 64, &opts).unwrap_err(),
        pisa_wgpu::VarlenPrefillPlan::new_in_place(ctx, 66, 2, 64, &opts).unwrap_err(),
    ] {
        assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
    }
    let s = AttentionShape::prefill(1, 33, 1, 64, 64).unwrap();
    let e = PrefillPlan::new(ctx, &s, &opts).unwrap_err();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
}

#[test]
fn plan_refuses_views_it_cannot_use() {
    let ctx = ctx();
    let s = AttentionShape::prefill(1, 2, 1, 70, 16).unwrap();
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(16, 2).unwrap(),
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &s, &opts).unwrap();
    let l = layer(ctx, &s, &opts, seed("plan_refuses"));
    let [o, lse, _] = outputs(&l, &s, 2);
    let po = PrefillOutputs {
        out: &o,
        lse: &lse,
        selection: None,
    };
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    // q given where k is expected: wrong shape.
    let e = plan.run(&mut enc, &l.q, &l.q, &l.v, &po, None).unwrap_err();
    assert!(matches!(e, GpuError::View(_)), "{e}");
    // A run with these outputs is a View error whose message holds `needle`.
    let mut refused = |outs: PrefillOutputs<'_>, needle: &str| {
        let e = plan
            .run(&mut enc, &l.q, &l.k, &l.v, &outs, None)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::View(ref m) if m.contains(needle)),
            "{e}"
        );
    };
    // LSE must be f32.
    let bad = TensorView::new(&l.lse, 0, DType::I32, [1, 2, 70, 1], [140, 70, 1, 1]).unwrap();
    refused(PrefillOutputs { lse: &bad, ..po }, "lse");
    // Outputs sharing bytes (LSE over O) are refused.
    let lse_over_o = TensorView::new(o.buffer(), 0, DType::F32, lse.shape(), lse.strides());
    let lse_over_o = lse_over_o.unwrap();
    refused(
        PrefillOutputs {
            lse: &lse_over_o,
            ..po
        },
        "share bytes",
    );
    // O must be a float type; a 2-byte O that its scatter cannot write in whole words (an odd
    // token stride) is refused before anything is recorded.
    let [n_o, d_o] = [o.shape()[2], o.shape()[3]];
    let bad = TensorView::new(o.buffer(), 0, DType::I32, o.shape(), o.strides()).unwrap();
    refused(PrefillOutputs { out: &bad, ..po }, "I32");
    let odd_strides = [0, n_o * (d_o + 1), d_o + 1, 1];
    let odd = TensorView::new(o.buffer(), 0, DType::F16, o.shape(), odd_strides).unwrap();
    refused(PrefillOutputs { out: &odd, ..po }, "stride");
    // A buffer without STORAGE usage cannot make a view.
    let staging = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4096,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
        mapped_at_creation: false,
    });
    let e = TensorView::contiguous(&staging, 0, DType::F32, [1, 2, 8, 16], TensorLayout::Bhnd)
        .unwrap_err();
    assert!(matches!(e, GpuError::View(_)), "{e}");
    // A view past the end of its buffer.
    let e = TensorView::contiguous(
        &l.o,
        PAD as u64 + 4,
        DType::F32,
        [1, 2, 70, 16],
        TensorLayout::Bhnd,
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::View(_)), "{e}");
    // The binding limit changed since planning: a new plan is needed.
    let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
    let plan2 = PrefillPlan::new(&own, &s, &opts).unwrap();
    own.set_max_binding_bytes(1 << 20);
    let e = plan2
        .run(&mut enc, &l.q, &l.k, &l.v, &po, None)
        .unwrap_err();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
}

/// bf16 where the kernels do not read it is a typed error, never bf16 words read as f32: a
/// kernel that does not opt in (the oracle baseline's, here through the public selection call)
/// and split-K attention called with an explicit plan.
#[test]
fn bf16_is_refused_where_the_kernels_do_not_read_it() {
    use pisa_wgpu::ops::attention::split_k::{record_split_k, SplitK};
    let ctx = ctx();
    let cfg = SelectionConfig::new(16, 2).unwrap();
    let dshape = AttentionShape::new(1, 4, 2, 1, 40, 32).unwrap();
    let up = |n: usize, s: u64| {
        let x = random(&mut rng(s), n, 1.0);
        ctx.upload("x", &x, Storage::Bf16).unwrap()
    };
    let base = seed("bf16_refused_split");
    let (q, k, v) = (
        up(dshape.q_elems(), base),
        up(dshape.kv_elems(), base + 1),
        up(dshape.kv_elems(), base + 2),
    );
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let plan = SplitK {
        split_keys: 16,
        pairs_per_range: 1,
    };
    let e = record_split_k(
        ctx,
        &mut enc,
        &q,
        &k,
        &v,
        &dshape,
        pisa_wgpu::ops::attention::QkvLayouts::from(TensorLayout::Bhnd),
        (true, 0.2),
        &plan,
        None,
    )
    .unwrap_err();
    assert!(
        matches!(e, GpuError::Unsupported(ref m) if m.contains("bf16")),
        "{e}"
    );
    let shape = AttentionShape::prefill(1, 4, 2, 40, 32).unwrap();
    let mut r = rng(seed("bf16_refused"));
    let (q, k) = (
        random(&mut r, shape.q_elems(), 1.0),
        random(&mut r, shape.kv_elems(), 1.0),
    );
    let e = pisa_wgpu::ops::select::select_host(
        ctx,
        &q,
        &k,
        &shape,
        TensorLayout::Bhnd,
        &cfg,
        Storage::Bf16,
        pisa_wgpu::ops::select::Method::Oracle,
        4,
    )
    .unwrap_err();
    assert!(
        matches!(e, GpuError::Unsupported(ref m) if m.contains("bf16")),
        "{e}"
    );
}

#[test]
fn read_async_returns_a_views_bytes_without_blocking_the_caller() {
    let ctx = ctx();
    let data: Vec<f32> = random(&mut rng(seed("read_async")), 3 * 5 * 7 * 8, 1.0);
    let buf = buffer_with(ctx, 256, &data);
    let view =
        TensorView::contiguous(&buf, 256, DType::F32, [3, 5, 7, 8], TensorLayout::Bhnd).unwrap();
    let fut = ctx.read_async(&view);
    // The application drives the device (here a thread); the future resolves by itself.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (d2, dev) = (done.clone(), ctx.device().clone());
    let poller = std::thread::spawn(move || {
        while !d2.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = dev.poll(wgpu::PollType::Poll);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
    let bytes = pollster::block_on(fut).unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    poller.join().unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&bytes), data.as_slice());
    // Without anyone polling the device, the future polls it itself (natively nothing else
    // would complete the mapping): `block_on` returns, here within a minute or the test fails.
    // On a context of its own, so that the other tests of this binary, which poll the shared
    // context's device, cannot complete the mapping for it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
        let b = buffer_with(&own, 256, &data);
        let v = TensorView::contiguous(&b, 256, DType::F32, [3, 5, 7, 8], TensorLayout::Bhnd);
        let _ = tx.send(pollster::block_on(own.read_async(&v.unwrap())).map(|r| (r, data)));
    });
    let (bytes, data) = (rx.recv_timeout(std::time::Duration::from_secs(60)))
        .expect("read_async did not complete without the application polling the device")
        .unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&bytes), data.as_slice());
    // A strided view is refused with a typed error.
    let strided = TensorView::new(&buf, 256, DType::F32, [1, 5, 7, 4], [280, 56, 8, 2]).unwrap();
    let e = pollster::block_on(ctx.read_async(&strided)).unwrap_err();
    assert!(matches!(e, GpuError::View(_)), "{e}");
    // A buffer without COPY_SRC usage cannot be read: a typed error, not zeros.
    let storage_only = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 256,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let e = ctx.read_bytes(&storage_only).unwrap_err();
    assert!(
        matches!(e, GpuError::View(ref m) if m.contains("COPY_SRC")),
        "{e}"
    );
    let v = TensorView::contiguous(
        &storage_only,
        0,
        DType::F32,
        [1, 1, 4, 16],
        TensorLayout::Bhnd,
    )
    .unwrap();
    let e = pollster::block_on(ctx.read_async(&v)).unwrap_err();
    assert!(
        matches!(e, GpuError::View(ref m) if m.contains("COPY_SRC")),
        "{e}"
    );
}

#[test]
fn varlen_prefill_equals_each_sequence_alone() {
    let ctx = ctx();
    let (hq, hkv, d, top_k) = (6usize, 2usize, 32usize, 3usize);
    // Empty sequences (a repeated offset, as flash_attn_varlen_func takes them) first, between
    // and last: skipped, every token still written.
    let lens = [0usize, 150, 97, 0, 230, 97, 0];
    let cu: Vec<usize> = std::iter::once(0)
        .chain(lens.iter().scan(0, |a, &n| {
            *a += n;
            Some(*a)
        }))
        .collect();
    let total = cu[lens.len()];
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(32, top_k).unwrap(),
        return_selection: true,
        ..Default::default()
    };
    // Packed [T, H, D] rows (BNHD with B = 1), as a varlen batch arrives.
    let mut r = rng(seed("varlen_prefill"));
    let (q, k, v) = (
        random(&mut r, total * hq * d, 1.0),
        random(&mut r, total * hkv * d, 1.0),
        random(&mut r, total * hkv * d, 1.0),
    );
    let packed = |data: &[f32], h: usize| {
        let b = buffer_with(ctx, PAD, data);
        TensorView::contiguous(
            &b,
            PAD as u64,
            DType::F32,
            [1, h, total, d],
            TensorLayout::Bnhd,
        )
        .unwrap()
    };
    let (qv, kv, vv) = (packed(&q, hq), packed(&k, hkv), packed(&v, hkv));
    let nan = f32::from_bits(0xFFFF_FFFF);
    let (ob, lb, sb) = (
        buffer_with(ctx, PAD, &vec![nan; total * hq * d]),
        buffer_with(ctx, PAD, &vec![nan; total * hq]),
        // (i32::MIN: no entry, index or -1 padding, is that)
        buffer_with(
            ctx,
            PAD,
            &vec![f32::from_bits(0x8000_0000); total * hkv * top_k],
        ),
    );
    let p = PAD as u64;
    let ov =
        TensorView::contiguous(&ob, p, DType::F32, [1, hq, total, d], TensorLayout::Bnhd).unwrap();
    let lv = TensorView::new(&lb, p, DType::F32, [1, hq, total, 1], [0, 1, hq, 1]).unwrap();
    // The selection [1, Hkv, T, K] row-major: each sequence's part is a strided view.
    let sv = TensorView::contiguous(
        &sb,
        p,
        DType::I32,
        [1, hkv, total, top_k],
        TensorLayout::Bhnd,
    )
    .unwrap();
    let plan = pisa_wgpu::VarlenPrefillPlan::new(ctx, hq, hkv, d, &opts).unwrap();
    // Every length planned ahead, the empty sequences' 0 included (which needs no plan).
    plan.prepare(&lens).unwrap();
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&sv),
    };
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    // Bad cu_seqlens are refused, each with a message that says what is wrong.
    for (bad, says) in [
        (vec![0usize], "sequences"),
        (vec![1, total], "first offset must be 0"),
        (vec![0, 0, 0], "tokens of all sequences"),
        (vec![0, 100, 50, total], "offsets must not decrease"),
    ] {
        let e = plan
            .run(&mut enc, &bad, &qv, &kv, &vv, &outs, None)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::Input(_)) && e.to_string().contains(says),
            "{bad:?}: {e}"
        );
    }
    plan.run(&mut enc, &cu, &qv, &kv, &vv, &outs, None).unwrap();
    ctx.scoped("test submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    let o = read_f32(ctx, &ob, PAD, total * hq * d);
    let l = read_f32(ctx, &lb, PAD, total * hq);
    let sel_bytes = ctx.read_bytes(&sb).unwrap();
    let sel: &[i32] = bytemuck::cast_slice(&sel_bytes[PAD..PAD + 4 * total * hkv * top_k]);
    for (i, &n) in lens.iter().enumerate().filter(|(_, &n)| n > 0) {
        let t0 = cu[i];
        // Sequence i alone, BHND, through prefill_host.
        let part = |x: &[f32], h: usize| {
            let mut out = vec![0f32; h * n * d];
            for hi in 0..h {
                for t in 0..n {
                    let s = ((t0 + t) * h + hi) * d;
                    out[(hi * n + t) * d..][..d].copy_from_slice(&x[s..s + d]);
                }
            }
            out
        };
        let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
        let want = prefill_host(
            ctx,
            &part(&q, hq),
            &part(&k, hkv),
            &part(&v, hkv),
            &shape,
            &opts,
        )
        .unwrap();
        for h in 0..hq {
            for t in 0..n {
                let got = &o[((t0 + t) * hq + h) * d..][..d];
                assert_eq!(
                    got,
                    &want.out[(h * n + t) * d..][..d],
                    "seq {i} O h{h} t{t}"
                );
                assert_eq!(
                    l[(t0 + t) * hq + h].to_bits(),
                    want.lse[h * n + t].to_bits()
                );
            }
        }
        let ws = want.selection.as_ref().unwrap();
        for h in 0..hkv {
            for t in 0..n {
                let got = &sel[(h * total + t0 + t) * top_k..][..top_k];
                assert_eq!(
                    got,
                    &ws[(h * n + t) * top_k..][..top_k],
                    "seq {i} selection"
                );
            }
        }
    }

    // In place only (VarlenPrefillPlan::new_in_place): the same rows at byte 0, where every
    // sequence's view starts on a binding boundary (a token row of Hkv * D * 4 = 256 bytes,
    // of Hq * D * 4 = 768), give the same outputs bit for bit; the views at byte 52 are refused
    // with a typed error, and so is `prepare`.
    let only = pisa_wgpu::VarlenPrefillPlan::new_in_place(ctx, hq, hkv, d, &opts).unwrap();
    let e = only.prepare(&[97]).unwrap_err();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let e = only
        .run(&mut enc, &cu, &qv, &kv, &vv, &outs, None)
        .unwrap_err();
    assert!(
        matches!(e, GpuError::View(ref m) if m.contains("in place")),
        "{e}"
    );
    let at0 = |data: &[f32], h: usize| {
        let b = buffer_with(ctx, 0, data);
        TensorView::contiguous(&b, 0, DType::F32, [1, h, total, d], TensorLayout::Bnhd).unwrap()
    };
    let (q0, k0, v0) = (at0(&q, hq), at0(&k, hkv), at0(&v, hkv));
    let (ob2, lb2) = (
        buffer_with(ctx, PAD, &vec![nan; total * hq * d]),
        buffer_with(ctx, PAD, &vec![nan; total * hq]),
    );
    let ov2 =
        TensorView::contiguous(&ob2, p, DType::F32, [1, hq, total, d], TensorLayout::Bnhd).unwrap();
    let lv2 = TensorView::new(&lb2, p, DType::F32, [1, hq, total, 1], [0, 1, hq, 1]).unwrap();
    let outs2 = PrefillOutputs {
        out: &ov2,
        lse: &lv2,
        selection: None,
    };
    only.run(&mut enc, &cu, &q0, &k0, &v0, &outs2, None)
        .unwrap();
    ctx.scoped("test submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert!(
        bits(read_f32(ctx, &ob2, PAD, total * hq * d)) == bits(o),
        "in-place varlen O differs"
    );
    assert!(
        bits(read_f32(ctx, &lb2, PAD, total * hq)) == bits(l),
        "in-place varlen LSE differs"
    );

    // The varlen prefill handed over to a decode cache (two sequences share the length 97, so
    // one plan: each take-over must copy its own sequence's keys and pyramid), into cache
    // sequences in another order; it decodes bitwise like a cache loaded from each sequence's
    // K and V views.
    use pisa_wgpu::ops::decode::{KvCache, StepOutputs};
    // An empty sequence empties its cache sequence (here one that held 50 tokens).
    let seqs = [4usize, 2, 0, 5, 3, 1, 6];
    let nb = seqs.len();
    let cap = 256;
    let new_cache = || KvCache::new(ctx, nb, cap, hq, hkv, d, opts.cfg, Storage::F32).unwrap();
    let (mut handed, mut loaded) = (new_cache(), new_cache());
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let (k50, v50) = (kv.tokens(0, 50).unwrap(), vv.tokens(0, 50).unwrap());
    handed.record_prefill_view(&mut enc, 4, &k50, &v50).unwrap();
    // A seqs list of the wrong length, or naming a sequence twice: typed input errors.
    for (bad, what) in [
        (&seqs[..6], "one cache sequence per"),
        (&[4, 2, 0, 5, 3, 1, 4], "named twice"),
    ] {
        let e = plan
            .run_into_cache(&mut enc, &cu, &qv, &kv, &vv, &outs, &mut handed, bad, None)
            .unwrap_err();
        assert!(
            matches!(e, GpuError::Input(PisaError::InvalidValue { what: w }) if w.starts_with("seqs: ") && w.contains(what)),
            "{e}"
        );
    }
    // Outputs over the inputs (sequence i's O would overwrite later sequences' Q): refused
    // before anything is recorded.
    let o_over_q = PrefillOutputs { out: &qv, ..outs };
    let e = plan
        .run(&mut enc, &cu, &qv, &kv, &vv, &o_over_q, None)
        .unwrap_err();
    assert!(
        matches!(e, GpuError::View(ref m) if m.contains("share bytes")),
        "{e}"
    );
    // O and LSE in one buffer, apart within every sequence but not across them: the LSE rows
    // of the sequences before the last lie in the last sequence's O rows, which are written
    // after them. Refused, as PrefillPlan::run refuses outputs that share bytes.
    let last = cu[lens.iter().rposition(|&n| n > 0).unwrap()];
    let (o_bytes, row) = (total * hq * d * 4, hq * 4);
    let both = buffer_with(ctx, 0, &vec![nan; total * hq * d + (total - last) * hq]);
    let o_both =
        TensorView::contiguous(&both, 0, DType::F32, [1, hq, total, d], TensorLayout::Bnhd)
            .unwrap();
    let l0 = (o_bytes - last * row) as u64;
    let l_both = TensorView::new(&both, l0, DType::F32, [1, hq, total, 1], [0, 1, hq, 1]).unwrap();
    for (i, &n) in lens.iter().enumerate().filter(|(_, &n)| n > 0) {
        // (sequence i's O bytes end where its LSE bytes could begin: apart within it)
        let (o_end, l_start) = ((cu[i] + n) * hq * d * 4, l0 as usize + cu[i] * row);
        let (o_start, l_end) = (cu[i] * hq * d * 4, l0 as usize + (cu[i] + n) * row);
        assert!(
            l_start >= o_end || o_start >= l_end,
            "sequence {i}'s own outputs overlap"
        );
    }
    let cross = PrefillOutputs {
        out: &o_both,
        lse: &l_both,
        selection: None,
    };
    let e = plan
        .run(&mut enc, &cu, &qv, &kv, &vv, &cross, None)
        .unwrap_err();
    assert!(
        matches!(e, GpuError::View(ref m) if m.contains("output and lse share bytes")),
        "{e}"
    );
    // A selection of more tokens than T (its last rows would be left unwritten): refused like
    // an O or LSE of another token count.
    let long_buf = buffer_with(ctx, 0, &vec![nan; (total + 5) * hkv * top_k]);
    let sel_long = TensorView::contiguous(
        &long_buf,
        0,
        DType::I32,
        [1, hkv, total + 5, top_k],
        TensorLayout::Bhnd,
    )
    .unwrap();
    let outs_long = PrefillOutputs {
        selection: Some(&sel_long),
        ..outs
    };
    let e = plan
        .run(&mut enc, &cu, &qv, &kv, &vv, &outs_long, None)
        .unwrap_err();
    assert!(
        matches!(e, GpuError::View(ref m) if m.starts_with("selection: expected shape")),
        "{e}"
    );
    plan.run_into_cache(
        &mut enc,
        &cu,
        &qv,
        &kv,
        &vv,
        &outs,
        &mut handed,
        &seqs,
        None,
    )
    .unwrap();
    for (i, &n) in lens.iter().enumerate().filter(|(_, &n)| n > 0) {
        let (ks, vs) = (kv.tokens(cu[i], n).unwrap(), vv.tokens(cu[i], n).unwrap());
        loaded
            .record_prefill_view(&mut enc, seqs[i], &ks, &vs)
            .unwrap();
    }
    ctx.queue().submit([enc.finish()]);
    assert_eq!(handed.lens(), loaded.lens());
    assert_eq!(
        handed.lens()[4],
        0,
        "the empty sequence's cache sequence was not emptied"
    );
    let q_row = buffer_with(ctx, 0, &random(&mut r, nb * hq * d, 1.0));
    let qrv =
        TensorView::contiguous(&q_row, 0, DType::F32, [nb, hq, 1, d], TensorLayout::Bhnd).unwrap();
    let mut got = Vec::new();
    for cache in [&handed, &loaded] {
        let (o, l) = (
            buffer_with(ctx, 0, &vec![nan; nb * hq * d]),
            buffer_with(ctx, 0, &vec![nan; nb * hq]),
        );
        let ov = TensorView::contiguous(&o, 0, DType::F32, [nb, hq, 1, d], TensorLayout::Bhnd);
        let lv = TensorView::contiguous(&l, 0, DType::F32, [nb, hq, 1, 1], TensorLayout::Bhnd);
        let (ov, lv) = (ov.unwrap(), lv.unwrap());
        let so = StepOutputs {
            out: &ov,
            lse: &lv,
            selection: None,
        };
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        cache
            .record_step_into(&mut enc, &qrv, Some(&so), None)
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        let o = read_f32(ctx, &o, 0, nb * hq * d);
        assert!(o.iter().all(|x| x.is_finite()), "decode O not written");
        got.push((bits(o), bits(read_f32(ctx, &l, 0, nb * hq))));
    }
    assert!(
        got[0] == got[1],
        "a varlen prefill handed to the cache decodes differently"
    );
}

/// `Context::set_tuning`: a knob out of range and other shader checks than the context's are
/// typed errors that change nothing; a plan keeps running after a change of a knob it does not
/// use (the decode step's), refuses after one of its own (the route's), and a new plan under
/// the new tuning gives the same outputs (the knobs change speed only).
#[test]
fn tuning_changes_and_plans() {
    let own = Context::with_tuning(
        &pisa_wgpu::AdapterChoice::HighPerformance,
        pisa_wgpu::Tuning::default(),
    )
    .unwrap();
    let before = own.tuning();
    let mut bad = before.clone();
    bad.route_lanes = 3;
    let e = own.set_tuning(bad).unwrap_err();
    assert!(matches!(e, GpuError::Tuning(_)), "{e}");
    let mut other_checks = before.clone();
    other_checks.shader_checks = Some(pisa_wgpu::ShaderChecks::All);
    let e = own.set_tuning(other_checks).unwrap_err();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
    assert_eq!(
        own.tuning(),
        before,
        "a refused tuning changed the context's"
    );

    let s = AttentionShape::prefill(1, 4, 2, 150, 32).unwrap();
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(16, 3).unwrap(),
        return_selection: true,
        ..Default::default()
    };
    let l = layer(&own, &s, &opts, seed("tuning_changes_and_plans"));
    let [o, lse, sel] = outputs(&l, &s, 3);
    let po = PrefillOutputs {
        out: &o,
        lse: &lse,
        selection: Some(&sel),
    };
    let plan = PrefillPlan::new(&own, &s, &opts).unwrap();
    let run = |plan: &PrefillPlan| -> pisa_wgpu::Result<Vec<f32>> {
        let mut enc = own.device().create_command_encoder(&Default::default());
        plan.run(&mut enc, &l.q, &l.k, &l.v, &po, None)?;
        own.queue().submit([enc.finish()]);
        Ok(read_f32(&own, &l.o, PAD, s.q_elems()))
    };
    let mut t = own.tuning();
    t.decode_fused = !t.decode_fused;
    own.set_tuning(t.clone()).unwrap();
    assert_eq!(
        run(&plan).unwrap(),
        l.host.out,
        "after a decode knob changed"
    );
    t.route_lanes = if t.route_lanes == 2 { 1 } else { 2 };
    t.route_tile = Some(3);
    // (the lanes and tile shape the workgroup-memory routing, not the subgroup one)
    t.route_subgroups = false;
    own.set_tuning(t).unwrap();
    let e = run(&plan).unwrap_err();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
    let replanned = PrefillPlan::new(&own, &s, &opts).unwrap();
    assert_eq!(
        run(&replanned).unwrap(),
        l.host.out,
        "under other route knobs"
    );

    // The routing table (the portable kernel here), in chunks of 20 queries (rounded down to
    // whole routing tiles of the route knobs above, at least one): every replay of a
    // plan binds each chunk's own parameters, and equals prefill_host under the same knobs.
    let mut t = own.tuning();
    t.route_table_portable = true;
    t.route_table_nodes = 4096;
    t.route_table_queries = Some(20);
    own.set_tuning(t).unwrap();
    let l2 = layer(&own, &s, &opts, seed("tuning_changes_and_plans, table"));
    let [o2, lse2, sel2] = outputs(&l2, &s, 3);
    let po2 = PrefillOutputs {
        out: &o2,
        lse: &lse2,
        selection: Some(&sel2),
    };
    let tabled = PrefillPlan::new(&own, &s, &opts).unwrap();
    for replay in 0..2 {
        let (a0, n0) = pisa_wgpu::ops::route::table_dispatches_on_this_thread();
        let mut enc = own.device().create_command_encoder(&Default::default());
        tabled
            .run(&mut enc, &l2.q, &l2.k, &l2.v, &po2, None)
            .unwrap();
        own.queue().submit([enc.finish()]);
        let (a1, n1) = pisa_wgpu::ops::route::table_dispatches_on_this_thread();
        assert!(
            (a1 - a0) + (n1 - n0) >= 2,
            "replay {replay}: the table ran in fewer than two chunks"
        );
        assert_eq!(
            read_f32(&own, &l2.o, PAD, s.q_elems()),
            l2.host.out,
            "replay {replay} with the routing table"
        );
    }
}

/// One packed QKV case: (B, Hq, Hkv, N, D, C, K, storage). Every `Hq * D` and `(Hq + Hkv) * D`
/// row offset is a multiple of 256 bytes, so K and V start on a binding boundary.
type PackedCase = (usize, usize, usize, usize, usize, usize, usize, Storage);

/// The view dtype of storage `st`.
fn dtype_of(st: Storage) -> DType {
    DType::from(st)
}

/// A packed QKV projection `[B, N, Hq + 2 Hkv, D]` of the storage dtype at byte `off` of an
/// application buffer (filled with 0x5A around), and its Q, K, V views.
fn packed(ctx: &Context, c: PackedCase, off: u64, x: [&[f32]; 3]) -> [TensorView; 3] {
    let (b, hq, hkv, n, d, _, _, st) = c;
    let t = hq + 2 * hkv;
    let e = st.bytes() as usize;
    let mut rows = vec![0f32; b * n * t * d];
    for (part, (h0, h, src)) in [(0, hq, x[0]), (hq, hkv, x[1]), (hq + hkv, hkv, x[2])]
        .into_iter()
        .enumerate()
    {
        let _ = part;
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..n {
                    let s = ((bi * h + hi) * n + ti) * d;
                    let o = ((bi * n + ti) * t + h0 + hi) * d;
                    rows[o..o + d].copy_from_slice(&src[s..s + d]);
                }
            }
        }
    }
    let buf = storage_buffer(ctx, off as usize, &rows, st);
    let dt = dtype_of(st);
    let strides = [n * t * d, d, t * d, 1];
    let view = |h0: usize, h: usize| {
        let o = off + (h0 * d * e) as u64;
        TensorView::new(&buf, o, dt, [b, h, n, d], strides).unwrap()
    };
    [view(0, hq), view(hq, hkv), view(hq + hkv, hkv)]
}

/// Contiguous BHND views of the same data at an offset of 52 bytes (not a binding boundary):
/// the plan gathers these.
fn unaligned(ctx: &Context, c: PackedCase, x: [&[f32]; 3]) -> [TensorView; 3] {
    let (b, hq, hkv, n, d, _, _, st) = c;
    let dt = dtype_of(st);
    let mk = |data: &[f32], h: usize| {
        let buf = storage_buffer(ctx, PAD, data, st);
        TensorView::contiguous(&buf, PAD as u64, dt, [b, h, n, d], TensorLayout::Bhnd).unwrap()
    };
    [mk(x[0], hq), mk(x[1], hkv), mk(x[2], hkv)]
}

/// A buffer holding O of `s` of storage `st`'s output dtype (poisoned), and its
/// `[B, Hq, N, D]` view: an O the kernels can write in place, as BNHD `[B, N, Hq, D]` at byte
/// 256 (`bnhd`) or as BHND at byte 512.
fn out_in_place(
    ctx: &Context,
    s: &AttentionShape,
    st: Storage,
    bnhd: bool,
) -> (wgpu::Buffer, TensorView) {
    let (b, hq, n, d) = (s.batch, s.q_heads, s.q_len, s.head_dim);
    let at = if bnhd { 256 } else { 512 };
    let buf = storage_buffer(ctx, at, &vec![f32::NAN; s.q_elems()], st.output());
    let strides = match bnhd {
        true => [n * hq * d, d, hq * d, 1],
        false => [hq * n * d, n * d, d, 1],
    };
    let dt = DType::from(st.output());
    let view = TensorView::new(&buf, at as u64, dt, [b, hq, n, d], strides).unwrap();
    (buf, view)
}

/// O written through `view` (of [`out_in_place`]) in `buf`, as BHND f32 (widened exactly from
/// f16).
fn read_o(ctx: &Context, buf: &wgpu::Buffer, view: &TensorView, st: Storage) -> Vec<f32> {
    let [b, hq, n, d] = view.shape();
    let [sb, sh, sn, _] = view.strides();
    let at = view.offset() as usize;
    let bytes = ctx.read_bytes(buf).unwrap();
    let e = st.output().bytes() as usize;
    let raw = &bytes[at..at + b * hq * n * d * e];
    let x: Vec<f32> = match st.output() {
        Storage::F16 => (bytemuck::cast_slice::<u8, u16>(raw).iter())
            .map(|&h| half::f16::from_bits(h).to_f32())
            .collect(),
        _ => bytemuck::cast_slice::<u8, f32>(raw).to_vec(),
    };
    let mut out = Vec::with_capacity(x.len());
    for bi in 0..b {
        for h in 0..hq {
            for t in 0..n {
                let at = bi * sb + h * sh + t * sn;
                out.extend_from_slice(&x[at..at + d]);
            }
        }
    }
    out
}

/// Contiguous f32 O and LSE views of `s` in new buffers (for runs expected to fail).
fn outputs_for(ctx: &Context, s: &AttentionShape) -> (TensorView, TensorView) {
    let (b, hq, n, d) = (s.batch, s.q_heads, s.q_len, s.head_dim);
    let o = buffer_with(ctx, 0, &vec![f32::NAN; s.q_elems()]);
    let l = buffer_with(ctx, 0, &vec![f32::NAN; s.lse_elems()]);
    (
        TensorView::contiguous(&o, 0, DType::F32, [b, hq, n, d], TensorLayout::Bhnd).unwrap(),
        TensorView::contiguous(&l, 0, DType::F32, [b, hq, n, 1], TensorLayout::Bhnd).unwrap(),
    )
}

/// Runs `plan` on `qkv` and returns (O, LSE, selection), all BHND, O as f32.
fn run_plan(
    ctx: &Context,
    plan: &PrefillPlan,
    s: &AttentionShape,
    top_k: usize,
    qkv: &[TensorView; 3],
) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
    run_plan_out(ctx, plan, s, top_k, qkv, None)
}

/// [`run_plan`] for a plan that writes O in place, into `out` ([`out_in_place`]'s buffer and
/// view, `st` the plan's storage): O read back from there, as BHND f32.
fn run_plan_into(
    ctx: &Context,
    plan: &PrefillPlan,
    s: &AttentionShape,
    top_k: usize,
    qkv: &[TensorView; 3],
    (buf, view): (&wgpu::Buffer, &TensorView),
    st: Storage,
) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
    let (_, lse, sel) = run_plan_out(ctx, plan, s, top_k, qkv, Some(view));
    (read_o(ctx, buf, view, st), lse, sel)
}

fn run_plan_out(
    ctx: &Context,
    plan: &PrefillPlan,
    s: &AttentionShape,
    top_k: usize,
    qkv: &[TensorView; 3],
    o_view: Option<&TensorView>,
) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
    let (b, hq, hkv, n, d) = (s.batch, s.q_heads, s.kv_heads, s.q_len, s.head_dim);
    let poisoned = |elems: usize| buffer_with(ctx, 0, &vec![f32::NAN; elems]);
    let (o, lse, sel) = (
        poisoned(s.q_elems()),
        poisoned(s.lse_elems()),
        poisoned(b * hkv * n * top_k),
    );
    let own = TensorView::contiguous(&o, 0, DType::F32, [b, hq, n, d], TensorLayout::Bhnd);
    let own = own.unwrap();
    let ov = o_view.unwrap_or(&own);
    let lv = TensorView::contiguous(&lse, 0, DType::F32, [b, hq, n, 1], TensorLayout::Bhnd);
    let sv = TensorView::contiguous(&sel, 0, DType::I32, [b, hkv, n, top_k], TensorLayout::Bhnd);
    let (lv, sv) = (lv.unwrap(), sv.unwrap());
    let po = PrefillOutputs {
        out: ov,
        lse: &lv,
        selection: Some(&sv),
    };
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    plan.run(&mut enc, &qkv[0], &qkv[1], &qkv[2], &po, None)
        .unwrap();
    ctx.scoped("test submit", || {
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })
    .unwrap();
    let sel = read_f32(ctx, &sel, 0, b * hkv * n * top_k);
    (
        read_f32(ctx, &o, 0, s.q_elems()),
        read_f32(ctx, &lse, 0, s.lse_elems()),
        sel.iter().map(|x| x.to_bits() as i32).collect(),
    )
}

/// A packed QKV projection (`[B, N, Hq + 2 Hkv, D]`, one buffer, Q, K and V at offsets that are
/// multiples of 256 bytes) is read in place: no gather, the kernels address the views with
/// their strides. Checked against the CPU reference (selection equal except rows whose K-th and
/// (K+1)-th scores tie within 1e-3, 2e-2 for f16: the reference's margin says which; O and LSE
/// within 1e-4, 5e-3 for f16), and bitwise against the same plan fed contiguous views at an
/// unaligned offset, which it gathers. Both stage-2 and attention orders (tiles and leaves:
/// the leaf-major merge writes O at its own strides), GQA groups 1, 2, 3, 4, 7, 8, f32, f16
/// and bf16 storage (bf16: the kernels widen the words exactly and compute in f32, so the
/// tolerances are f32's, against the reference on the bf16-rounded inputs).
#[test]
fn packed_qkv_is_read_in_place() {
    use pisa_core::reference::{select_pisa, sparse_attention};
    // Its own context: the leaf order changes below, and the other tests of this binary plan
    // and run on the shared one meanwhile.
    let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
    let ctx = &own;
    let f = Storage::F32;
    let h = Storage::F16;
    let bf = Storage::Bf16;
    let cases: [PackedCase; 17] = [
        (2, 6, 2, 203, 32, 32, 3, f),
        (1, 7, 1, 150, 64, 16, 4, f),
        (1, 8, 8, 97, 48, 16, 2, h),
        (2, 4, 2, 130, 64, 16, 3, h),
        (1, 8, 1, 77, 64, 16, 2, f),
        (1, 8, 2, 120, 64, 32, 2, h),
        // bf16: the kernels widen the words themselves (no SHADER_F16 needed).
        (2, 6, 2, 203, 32, 32, 3, bf),
        (1, 7, 1, 150, 64, 16, 4, bf),
        (1, 8, 4, 97, 48, 16, 2, bf),
        (2, 4, 1, 130, 128, 16, 3, bf),
        (1, 8, 1, 77, 64, 16, 2, bf),
        (1, 3, 3, 61, 32, 16, 2, bf),
        // Prompts in which every query selects every leaf it sees (at most K leaves of keys):
        // the dense kernels run the attention (the NVIDIA one for f16 at D 64 and 128 where
        // the device has it), chosen the same for the staging's BHND and the packed views.
        (2, 6, 2, 203, 32, 32, 7, f),
        (1, 8, 2, 120, 64, 32, 4, h),
        (1, 8, 1, 100, 128, 64, 2, h),
        (1, 7, 1, 150, 64, 16, 10, bf),
        (2, 6, 2, 199, 128, 64, 4, h),
    ];
    let align = ctx.device().limits().min_storage_buffer_offset_alignment as u64;
    let off = align.max(256);
    let base = seed("packed_qkv_in_place");
    let mut checked = 0;
    for order in [LeafOrder::Tiles, LeafOrder::Leaves] {
        ctx.set_leaf_order(order);
        for (i, &c) in cases.iter().enumerate() {
            let (b, hq, hkv, n, d, cb, kk, st) = c;
            if st == h && !ctx.has_f16() {
                eprintln!("no SHADER_F16: f16 case {i} skipped");
                continue;
            }
            let s = AttentionShape::prefill(b, hq, hkv, n, d).unwrap();
            let cfg = SelectionConfig::new(cb, kk).unwrap();
            let opts = PrefillOptions {
                cfg,
                storage: st,
                return_selection: true,
                ..Default::default()
            };
            let mut r = rng(base + i as u64);
            let mut x = [
                random(&mut r, s.q_elems(), 1.0),
                random(&mut r, s.kv_elems(), 1.0),
                random(&mut r, s.kv_elems(), 1.0),
            ];
            x = x.map(|v| through_storage(&v, st));
            let xs = [&x[0][..], &x[1][..], &x[2][..]];
            let plan = PrefillPlan::new(ctx, &s, &opts).unwrap();
            let direct = packed(ctx, c, off, xs);
            let gathered = unaligned(ctx, c, xs);
            for v in &direct {
                assert!(plan.reads_in_place(v), "case {i}: packed view not in place");
            }
            for v in &gathered {
                assert!(!plan.reads_in_place(v), "case {i}: unaligned view in place");
            }
            // Under `Leaves`, the leaf-major kernels run for the packed layouts as for the
            // staging's BHND (the same kernels either way, so the arena's replay holds); where
            // every query selects every leaf it sees, the dense kernel runs instead (checked in
            // tests/prefill.rs), in either order.
            let every_leaf = n.div_ceil(cb) <= kk;
            if order == LeafOrder::Leaves && !every_leaf {
                let t = hq + 2 * hkv;
                let packed_layout = KernelLayout::Strided {
                    batch: n * t * d,
                    head: d,
                    token: t * d,
                };
                let packed = QkvLayouts {
                    q: packed_layout,
                    k: packed_layout,
                    v: packed_layout,
                    o: TensorLayout::Bhnd,
                };
                let bhnd = QkvLayouts::from(TensorLayout::Bhnd);
                let path = leaf_major_path(ctx, st, &s, bhnd, &cfg);
                assert!(path.is_some(), "case {i}: not leaf-major under Leaves");
                assert_eq!(leaf_major_path(ctx, st, &s, packed, &cfg), path, "case {i}");
            }
            let got = run_plan(ctx, &plan, &s, kk, &direct);
            let staged = run_plan(ctx, &plan, &s, kk, &gathered);
            // A plan without staging (in place only) on the same views; it refuses views that
            // would need a gather, at planning and at run time, with a typed error.
            let [dq, dk, dv] = &direct;
            let views = |q, k, v, out| PlanViews { q, k, v, out };
            let only = PrefillPlan::new_in_place(ctx, &s, &opts, &views(dq, dk, dv, None)).unwrap();
            let only_got = run_plan(ctx, &only, &s, kk, &direct);
            // And writing O in place too: a BNHD O in a buffer of its own, of the output dtype.
            let (o_in_place, o_view) = out_in_place(ctx, &s, st, true);
            let with_o = views(dq, dk, dv, Some(&o_view));
            let only_o = PrefillPlan::new_in_place(ctx, &s, &opts, &with_o).unwrap();
            let only_o_got =
                run_plan_into(ctx, &only_o, &s, kk, &direct, (&o_in_place, &o_view), st);
            // The same plan writing another O buffer (new strides in its parameters, a new bind
            // group): the same O.
            let (o2, o2_view) = out_in_place(ctx, &s, st, false);
            let again = run_plan_into(ctx, &only_o, &s, kk, &direct, (&o2, &o2_view), st);
            assert!(
                again
                    .0
                    .iter()
                    .map(|x| x.to_bits())
                    .eq(only_o_got.0.iter().map(|x| x.to_bits())),
                "case {i} {order:?}: O in place into a second buffer differs"
            );
            // O in the buffer of the inputs, or of the wrong dtype, is refused.
            let e = PrefillPlan::new_in_place(ctx, &s, &opts, &views(dq, dk, dv, Some(dq)))
                .unwrap_err();
            assert!(matches!(e, GpuError::View(_)), "{e}");
            let [gq, gk, gv] = &gathered;
            let e =
                PrefillPlan::new_in_place(ctx, &s, &opts, &views(gq, dk, dv, None)).unwrap_err();
            assert!(
                matches!(e, GpuError::View(ref m) if m.contains("in place")),
                "{e}"
            );
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let (o, l) = outputs_for(ctx, &s);
            let po = PrefillOutputs {
                out: &o,
                lse: &l,
                selection: None,
            };
            let e = only.run(&mut enc, dq, gk, gv, &po, None).unwrap_err();
            assert!(
                matches!(e, GpuError::View(ref m) if m.contains("in place")),
                "{e}"
            );
            // Q gathered with K and V in place, and Q in place with K and V gathered.
            let [gq, gk, gv] = gathered.clone();
            let [dq, dk, dv] = direct.clone();
            let mixed = [
                ("Q gathered", run_plan(ctx, &plan, &s, kk, &[gq, dk, dv])),
                ("K, V gathered", run_plan(ctx, &plan, &s, kk, &[dq, gk, gv])),
            ];
            // Bitwise: the first differing element, if any.
            let first = |a: &[u32], b: &[u32]| a.iter().zip(b).position(|(x, y)| x != y);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let sel_bits = |v: &[i32]| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
            for (run, out) in [
                ("in place", &got),
                ("in place, no staging", &only_got),
                ("in place, no staging, O in place", &only_o_got),
                (mixed[0].0, &mixed[0].1),
                (mixed[1].0, &mixed[1].1),
            ] {
                for (what, a, b) in [
                    ("O", bits(&out.0), bits(&staged.0)),
                    ("LSE", bits(&out.1), bits(&staged.1)),
                    ("selection", sel_bits(&out.2), sel_bits(&staged.2)),
                ] {
                    assert_eq!(a.len(), b.len());
                    if let Some(e) = first(&a, &b) {
                        panic!(
                            "case {i} {order:?}: {what} {run} differs from gathered at {e}: {:#x} vs {:#x}",
                            a[e], b[e]
                        );
                    }
                }
            }
            // Against the reference.
            let want = select_pisa(xs[0], xs[1], &s, TensorLayout::Bhnd, &cfg).unwrap();
            let tie = tie_tol_of(&s, &cfg, xs[0], xs[1], st);
            check_selection_ties(&format!("case {i} {order:?}"), &got.2, &want, kk, tie);
            let (o, lse) =
                sparse_attention(xs[0], xs[1], xs[2], &s, TensorLayout::Bhnd, &cfg, &got.2)
                    .unwrap();
            let tol = if st == h { 5e-3 } else { 1e-4 };
            let e = rel_err(&got.0, &o);
            assert!(e < tol, "case {i} {order:?}: O rel err {e}");
            let e = rel_err(&got.1, &lse);
            assert!(e < tol, "case {i} {order:?}: LSE rel err {e}");
            checked += 1;
        }
    }
    // Every case of each order ran, the f16 ones where the device has SHADER_F16.
    let runnable = cases.iter().filter(|c| c.7 != h || ctx.has_f16()).count();
    assert_eq!(checked, 2 * runnable, "cases that ran");
    assert!(runnable >= 3);
}

/// A top_k whose stage-1 candidates (g (top_k + 1) per query) exceed one storage binding is a
/// `Limit` error whose hint names top_k (it named f16 storage, which does not shrink them).
/// 1024 queries x 2 (2^20 + 1) candidates x 4 bytes = 8 GiB, past any binding.
#[test]
fn a_top_k_past_one_binding_is_named_in_the_hint() {
    let ctx = ctx();
    let s = AttentionShape::prefill(1, 2, 1, 1024, 16).unwrap();
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(16, 1 << 20).unwrap(),
        ..Default::default()
    };
    let e = PrefillPlan::new(ctx, &s, &opts).unwrap_err();
    assert!(
        matches!(e, GpuError::Limit { hint, .. } if hint.contains("smaller top_k")),
        "{e}"
    );
}

/// `reads_in_place_qkv` applies the rule that K and V are read in place only together (both
/// qualifying, with the same strides): a BHND K beside a BNHD V (each qualifying alone) is
/// reported gathered, as the run gathers both; K and V of one layout are read in place.
#[test]
fn reads_in_place_qkv_follows_the_kv_rule() {
    let ctx = ctx();
    let (hq, hkv, n, d) = (4usize, 2usize, 40usize, 32usize);
    let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
    let opts = PrefillOptions {
        cfg: SelectionConfig::new(16, 2).unwrap(),
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &shape, &opts).unwrap();
    let data: Vec<f32> = random(&mut rng(seed("reads_in_place_qkv")), hq * n * d, 1.0);
    let (qb, kb, vb) = (
        buffer_with(ctx, 0, &data),
        buffer_with(ctx, 0, &data),
        buffer_with(ctx, 0, &data),
    );
    let view = |b, h, lay| TensorView::contiguous(b, 0, DType::F32, [1, h, n, d], lay).unwrap();
    let q = view(&qb, hq, TensorLayout::Bhnd);
    let k = view(&kb, hkv, TensorLayout::Bhnd);
    let v_bhnd = view(&vb, hkv, TensorLayout::Bhnd);
    let v_bnhd = view(&vb, hkv, TensorLayout::Bnhd);
    assert!(plan.reads_in_place(&k) && plan.reads_in_place(&v_bnhd));
    assert_eq!(
        plan.reads_in_place_qkv(&q, &k, &v_bnhd),
        [true, false, false]
    );
    assert_eq!(plan.reads_in_place_qkv(&q, &k, &v_bhnd), [true, true, true]);
}
