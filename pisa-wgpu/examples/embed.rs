//! pisa inside an application that owns its wgpu device and buffers.
//!
//! The application opens its own device, hands it to pisa (`Context::from_device`), keeps one
//! packed QKV buffer of a varlen batch (3 sequences, rows `[tokens, (Hq + 2 Hkv) * D]` after
//! 256 bytes of something else), runs a planned prefill of each sequence straight from that
//! buffer (read in place: no copy) into its own O / LSE buffers, then a decode loop of the batch whose K/V rows, queries
//! and outputs are its own buffers too. Every result is checked against pisa-core's CPU
//! reference; the max errors are printed.
//!
//! `cargo run -p pisa-wgpu --example embed`
use pisa_core::reference::{select_pisa, sparse_attention, DecodeState};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout::Bhnd};
use pisa_wgpu::ops::decode::{KvCache, StepOutputs};
use pisa_wgpu::ops::prefill::{PlanViews, PrefillOptions, PrefillOutputs, PrefillPlan};
use pisa_wgpu::{wgpu, Context, DType::F32, Storage, TensorView};

const HQ: usize = 6;
const HKV: usize = 2;
const D: usize = 32;
const LENS: [usize; 3] = [150, 97, 230];
const ROW: usize = (HQ + 2 * HKV) * D;
const PAD: u64 = 256;
const STEPS: usize = 16;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn max_err(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0.0, f64::max)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The application's device.
    let instance = pisa_wgpu::instance();
    let adapter = pollster::block_on(instance.request_adapter(&Default::default()))?;
    // (pisa's features where the adapter has them, its limits; add the app's own.)
    let (device, queue) =
        pollster::block_on(adapter.request_device(&pisa_wgpu::app_device_descriptor(&adapter)))?;
    let ctx = Context::from_device(&adapter, device.clone(), queue.clone())?;
    println!("adapter: {}", adapter.get_info().name);
    let buffer = |size: u64| {
        use wgpu::BufferUsages as U;
        device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: U::STORAGE | U::COPY_DST | U::COPY_SRC,
            mapped_at_creation: false,
        })
    };
    let read = |buf: &wgpu::Buffer, offset: u64, n: usize| -> Vec<f32> {
        let staging = device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: n as u64 * 4,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buf, offset, &staging, 0, n as u64 * 4);
        queue.submit([enc.finish()]);
        staging
            .slice(..)
            .map_async(wgpu::MapMode::Read, |r| r.unwrap());
        device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .unwrap();
        let data = bytemuck::cast_slice(&staging.slice(..).get_mapped_range().unwrap()).to_vec();
        data
    };

    // The packed QKV buffer of the batch, and views of each sequence's Q, K, V in it.
    let total: usize = LENS.iter().sum();
    let cu: Vec<usize> = (0..=3).map(|i| LENS[..i].iter().sum()).collect();
    let host = values(total * ROW, 1);
    let qkv = buffer(PAD + (total * ROW * 4) as u64);
    queue.write_buffer(&qkv, PAD, bytemuck::cast_slice(&host));
    let part = |p: usize, i: usize| {
        let (col, h) = [(0, HQ), (HQ * D, HKV), ((HQ + HKV) * D, HKV)][p];
        let all = TensorView::new(
            &qkv,
            PAD + col as u64 * 4,
            F32,
            [1, h, total, D],
            [0, D, ROW, 1],
        );
        let host: Vec<f32> = (0..h * LENS[i] * D)
            .map(|e| host[(cu[i] + e / D % LENS[i]) * ROW + col + e / (D * LENS[i]) * D + e % D])
            .collect();
        (all.and_then(|v| v.tokens(cu[i], LENS[i])), host)
    };

    // Prefill: one plan per sequence, outputs O [total, Hq, D] and LSE [total, Hq].
    let cfg = SelectionConfig::new(32, 4)?;
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let o_buf = buffer((total * HQ * D * 4) as u64);
    let lse_buf = buffer((total * HQ * 4) as u64);
    let o_all = TensorView::new(&o_buf, 0, F32, [1, HQ, total, D], [0, D, HQ * D, 1])?;
    let lse_all = TensorView::new(&lse_buf, 0, F32, [1, HQ, total, 1], [0, 1, HQ, 1])?;
    let mut enc = device.create_command_encoder(&Default::default());
    let mut plans = Vec::new();
    for (i, &n) in LENS.iter().enumerate() {
        let (out, lse) = (o_all.tokens(cu[i], n)?, lse_all.tokens(cu[i], n)?);
        let outs = PrefillOutputs {
            out: &out,
            lse: &lse,
            selection: None,
        };
        let qkv = [part(0, i).0?, part(1, i).0?, part(2, i).0?];
        // Rows of 1280 bytes after 256: every view starts on a binding boundary, so the kernels
        // read Q, K and V straight from the packed buffer (no gather), and the plan needs no
        // staging of its own (`PrefillPlan::new` keeps one, for views that must be gathered).
        // O rows of 768 bytes from byte 0 of their own buffer: written in place as well.
        let shape = AttentionShape::prefill(1, HQ, HKV, n, D)?;
        let views = PlanViews {
            q: &qkv[0],
            k: &qkv[1],
            v: &qkv[2],
            out: Some(&out),
        };
        let plan = PrefillPlan::new_in_place(&ctx, &shape, &opts, &views)?;
        plan.run(&mut enc, &qkv[0], &qkv[1], &qkv[2], &outs, None)?;
        let direct = qkv.iter().map(|v| plan.reads_in_place(v));
        println!(
            "sequence {i}: q, k, v read in place: {:?}",
            direct.collect::<Vec<_>>()
        );
        plans.push(plan);
    }
    queue.submit([enc.finish()]);
    let (o_got, lse_got) = (
        read(&o_buf, 0, total * HQ * D),
        read(&lse_buf, 0, total * HQ),
    );
    for (i, &n) in LENS.iter().enumerate() {
        let shape = AttentionShape::prefill(1, HQ, HKV, n, D)?;
        let (q, k, v) = (part(0, i).1, part(1, i).1, part(2, i).1);
        let sel = select_pisa(&q, &k, &shape, Bhnd, &cfg)?;
        let (o, lse) = sparse_attention(&q, &k, &v, &shape, Bhnd, &cfg, &sel.indices)?;
        // The reference is [Hq, n, D]; the application's rows are [n, Hq, D].
        let (mut eo, mut el) = (0f64, 0f64);
        for h in 0..HQ {
            for t in 0..n {
                let g = (cu[i] + t) * HQ + h;
                let w = h * n + t;
                eo = eo.max(max_err(&o_got[g * D..(g + 1) * D], &o[w * D..(w + 1) * D]));
                el = el.max(max_err(&lse_got[g..g + 1], &lse[w..w + 1]));
            }
        }
        println!("prefill seq {i} ({n} tokens): max |O err| {eo:.2e}, max |LSE err| {el:.2e}");
    }

    // Decode: the batch's K/V loaded from the packed buffer, then steps in the app's buffers.
    let mut cache = KvCache::new(&ctx, 3, 230 + STEPS, HQ, HKV, D, cfg, Storage::F32)?;
    let mut refs = Vec::new();
    for (i, &n) in LENS.iter().enumerate() {
        cache.prefill_view(i, &part(1, i).0?, &part(2, i).0?)?;
        let (k, v) = (part(1, i).1, part(2, i).1);
        let mut st = DecodeState::new(HQ, HKV, D, cfg)?;
        let row = |x: &[f32], t| -> Vec<f32> {
            (0..HKV)
                .flat_map(|h| x[(h * n + t) * D..(h * n + t + 1) * D].to_vec())
                .collect()
        };
        for t in 0..n {
            st.append(&row(&k, t), &row(&v, t))?;
        }
        refs.push(st);
    }
    let slot = ((3 * HQ * D * 4) as u64)
        .next_multiple_of(device.limits().min_storage_buffer_offset_alignment as u64);
    let (io_in, io_out) = (buffer(3 * slot), buffer(2 * slot));
    let view = |b, at, h, d| TensorView::contiguous(b, at, F32, [3, h, 1, d], Bhnd);
    let (kv, vv, qv) = (
        view(&io_in, 0, HKV, D)?,
        view(&io_in, slot, HKV, D)?,
        view(&io_in, 2 * slot, HQ, D)?,
    );
    let (ov, lv) = (view(&io_out, 0, HQ, D)?, view(&io_out, slot, HQ, 1)?);
    let outs = StepOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    let (mut eo, mut el) = (0f64, 0f64);
    for step in 0..STEPS {
        let (k, v, q) = (
            values(3 * HKV * D, 10 + 3 * step as u64),
            values(3 * HKV * D, 11 + 3 * step as u64),
            values(3 * HQ * D, 12 + 3 * step as u64),
        );
        queue.write_buffer(&io_in, 0, bytemuck::cast_slice(&k));
        queue.write_buffer(&io_in, slot, bytemuck::cast_slice(&v));
        queue.write_buffer(&io_in, 2 * slot, bytemuck::cast_slice(&q));
        let mut enc = device.create_command_encoder(&Default::default());
        cache.record_append_view(&mut enc, &kv, &vv, &[true; 3], None)?;
        cache.record_step_into(&mut enc, &qv, Some(&outs), None)?;
        queue.submit([enc.finish()]);
        let (o, lse) = (read(&io_out, 0, 3 * HQ * D), read(&io_out, slot, 3 * HQ));
        for (b, st) in refs.iter_mut().enumerate() {
            st.append(
                &k[b * HKV * D..(b + 1) * HKV * D],
                &v[b * HKV * D..(b + 1) * HKV * D],
            )?;
            let (_, want_o, want_lse) = st.step(&q[b * HQ * D..(b + 1) * HQ * D])?;
            eo = eo.max(max_err(&o[b * HQ * D..(b + 1) * HQ * D], &want_o));
            el = el.max(max_err(&lse[b * HQ..(b + 1) * HQ], &want_lse));
        }
    }
    println!("decode, {STEPS} steps of 3 sequences: max |O err| {eo:.2e}, max |LSE err| {el:.2e}");
    Ok(())
}
