//! One context used from several threads while one of them changes its settings (the kernel
//! path, the leaf order, the tuning): every call sees one set of settings from start to end
//! (`runtime/gate.rs`). A varlen plan re-plans for settings changed between its runs and never
//! fails; a prefill plan either runs or refuses, before recording, with the documented
//! "changed since this prefill was planned"; every output equals the CPU reference (f32:
//! relative error <= 1e-4; selections up to near-ties of rounding). Before the gate, about
//! half of such varlen runs failed half-recorded ("plan replay diverged from its recording").
mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::*;
use pisa_core::reference::{select_pisa, sparse_attention};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::prefill::{PrefillOptions, PrefillOutputs, PrefillPlan};
use pisa_wgpu::{
    AdapterChoice, Context, DType, GpuError, KernelPath, LeafOrder, TensorView, VarlenPrefillPlan,
};

/// An application's outputs of `n` tokens, NaN-filled: O `[1, Hq, n, D]` and LSE `[1, Hq, n, 1]`
/// f32, the selection `[1, Hkv, n, K]` i32, all BHND.
struct Outs {
    buffers: [pisa_wgpu::wgpu::Buffer; 3],
    views: [TensorView; 3],
}

impl Outs {
    fn new(ctx: &Context, [hq, hkv, n, d, k]: [usize; 5]) -> Self {
        let buffers =
            [hq * n * d, hq * n, hkv * n * k].map(|len| app_buffer(ctx, &vec![f32::NAN; len]));
        let views = [
            bhnd_f32(&buffers[0], [1, hq, n, d]),
            bhnd_f32(&buffers[1], [1, hq, n, 1]),
            TensorView::contiguous(
                &buffers[2],
                0,
                DType::I32,
                [1, hkv, n, k],
                TensorLayout::Bhnd,
            )
            .unwrap(),
        ];
        Self { buffers, views }
    }

    fn get(&self) -> PrefillOutputs<'_> {
        PrefillOutputs {
            out: &self.views[0],
            lse: &self.views[1],
            selection: Some(&self.views[2]),
        }
    }

    /// Every output NaN again (before each run, so that one that writes nothing shows).
    fn poison(&self, ctx: &Context) {
        for b in &self.buffers {
            let nan = vec![f32::NAN; (b.size() / 4) as usize];
            ctx.queue().write_buffer(b, 0, bytemuck::cast_slice(&nan));
        }
    }

    /// O, LSE and the selection as the GPU left them.
    fn read(&self, ctx: &Context) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
        let bytes = |b| ctx.read_bytes(b).unwrap();
        (
            bytemuck::cast_slice(&bytes(&self.buffers[0])).to_vec(),
            bytemuck::cast_slice(&bytes(&self.buffers[1])).to_vec(),
            bytemuck::cast_slice(&bytes(&self.buffers[2])).to_vec(),
        )
    }
}

/// O, LSE and the selection of `n` queries (heads `h` of `total` tokens, from token `t0`, BHND)
/// against the reference of the sequence `[q, k, v]` (`[1, H, n, D]` each).
#[allow(clippy::too_many_arguments)]
fn check(
    what: &str,
    (shape, cfg): (&AttentionShape, &SelectionConfig),
    [q, k, v]: [&[f32]; 3],
    (o, lse, sel): (&[f32], &[f32], &[i32]),
    (t0, total): (usize, usize),
) {
    let (hq, hkv, n, d, kk) = (
        shape.q_heads,
        shape.kv_heads,
        shape.q_len,
        shape.head_dim,
        cfg.top_k,
    );
    let rows = |x: &[f32], h: usize, w: usize| -> Vec<f32> {
        (0..h)
            .flat_map(|hh| x[(hh * total + t0) * w..(hh * total + t0 + n) * w].to_vec())
            .collect()
    };
    let sel: Vec<i32> = (0..hkv)
        .flat_map(|hh| sel[(hh * total + t0) * kk..(hh * total + t0 + n) * kk].to_vec())
        .collect();
    let want = select_pisa(q, k, shape, TensorLayout::Bhnd, cfg).unwrap();
    let tie = tie_tol_of(shape, cfg, q, k, pisa_wgpu::Storage::F32);
    check_selection_ties(what, &sel, &want, kk, tie);
    let (ro, rl) = sparse_attention(q, k, v, shape, TensorLayout::Bhnd, cfg, &sel).unwrap();
    let (eo, el) = (
        rel_err(&rows(o, hq, d), &ro),
        rel_err(&rows(lse, hq, 1), &rl),
    );
    assert!(eo <= 1e-4 && el <= 1e-4, "{what}: O {eo:.2e} LSE {el:.2e}");
}

#[test]
fn settings_changed_on_one_thread_while_others_run() {
    // A context of its own: the changes would make the other tests' plans refuse.
    let ctx = Context::new(&AdapterChoice::HighPerformance).unwrap();
    let (hq, hkv, d) = (4usize, 2usize, 32usize);
    let cfg = SelectionConfig::new(32, 3).unwrap();
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let mut r = rng(seed("settings_changed_on_one_thread_while_others_run"));
    // Two sequences of 96 and 70 tokens, packed [T, H, D] read as [1, H, T, D] views.
    let (lens, cu, total) = ([96usize, 70], [0usize, 96, 166], 166usize);
    let [q, k, v] = [hq, hkv, hkv].map(|h| random(&mut r, h * total * d, 1.0));
    let seq = |x: &[f32], h: usize, i: usize| -> Vec<f32> {
        (0..h)
            .flat_map(|hh| (cu[i]..cu[i + 1]).flat_map(move |t| (0..d).map(move |j| (t, hh, j))))
            .map(|(t, hh, j)| x[(t * h + hh) * d + j])
            .collect()
    };
    let bnhd = |data: &[f32], h: usize| {
        let b = app_buffer(&ctx, data);
        TensorView::contiguous(&b, 0, DType::F32, [1, h, total, d], TensorLayout::Bnhd).unwrap()
    };
    let (qv, kv, vv) = (bnhd(&q, hq), bnhd(&k, hkv), bnhd(&v, hkv));
    let stop = AtomicBool::new(false);
    let (changes, refused) = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|s| {
        // The thread that changes the settings, every few hundred microseconds.
        s.spawn(|| {
            let base = ctx.tuning();
            let full = ctx.max_binding_bytes();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                match i % 4 {
                    0 => ctx.set_leaf_order([LeafOrder::Tiles, LeafOrder::Leaves][i / 4 % 2]),
                    1 => {
                        ctx.set_kernel_path([KernelPath::Portable, KernelPath::CoopMat][i / 4 % 2]);
                    }
                    2 => {
                        let mut t = ctx.tuning();
                        t.route_tile = [Some(1), base.route_tile][i / 4 % 2];
                        ctx.set_tuning(t).unwrap();
                    }
                    // Regression: the binding limit changed outside the settings gate, between
                    // a varlen run's check of its kept plan and that plan's own, and the run
                    // failed ("make a new plan").
                    _ => ctx.set_max_binding_bytes([200_000, full][i / 4 % 2]),
                }
                i += 1;
                changes.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
        });
        // A prefill plan of the first sequence: runs, or refuses before recording (then it
        // is made again, as the error says).
        let prefill = s.spawn(|| {
            let shape = AttentionShape::prefill(1, hq, hkv, lens[0], d).unwrap();
            let [qs, ks, vs] = [(&q, hq), (&k, hkv), (&v, hkv)].map(|(x, h)| seq(x, h, 0));
            let inputs = [(&qs, hq), (&ks, hkv), (&vs, hkv)]
                .map(|(x, h)| (app_buffer(&ctx, x), [1, h, lens[0], d]));
            let views = inputs.each_ref().map(|(b, sh)| bhnd_f32(b, *sh));
            let outs = Outs::new(&ctx, [hq, hkv, lens[0], d, cfg.top_k]);
            let mut plan = PrefillPlan::new(&ctx, &shape, &opts).unwrap();
            for it in 0..12 {
                outs.poison(&ctx);
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                match plan.run(&mut enc, &views[0], &views[1], &views[2], &outs.get(), None) {
                    Ok(()) => {
                        ctx.queue().submit([enc.finish()]);
                        let (o, l, sel) = outs.read(&ctx);
                        check(
                            &format!("prefill run {it}"),
                            (&shape, &cfg),
                            [&qs, &ks, &vs],
                            (&o, &l, &sel),
                            (0, lens[0]),
                        );
                    }
                    Err(GpuError::Unsupported(m))
                        if m.contains("changed since this prefill was planned") =>
                    {
                        refused.fetch_add(1, Ordering::Relaxed);
                        plan = PrefillPlan::new(&ctx, &shape, &opts).unwrap();
                    }
                    Err(e) => panic!("prefill run {it}: {e}"),
                }
            }
        });
        // A varlen plan of both sequences: every run succeeds.
        let varlen = s.spawn(|| {
            let plan = VarlenPrefillPlan::new(&ctx, hq, hkv, d, &opts).unwrap();
            let outs = Outs::new(&ctx, [hq, hkv, total, d, cfg.top_k]);
            for it in 0..12 {
                outs.poison(&ctx);
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                plan.run(&mut enc, &cu, &qv, &kv, &vv, &outs.get(), None)
                    .unwrap_or_else(|e| panic!("varlen run {it}: {e}"));
                ctx.queue().submit([enc.finish()]);
                let (o, l, sel) = outs.read(&ctx);
                for (i, &n) in lens.iter().enumerate() {
                    let shape = AttentionShape::prefill(1, hq, hkv, n, d).unwrap();
                    let qkv = [(&q, hq), (&k, hkv), (&v, hkv)].map(|(x, h)| seq(x, h, i));
                    check(
                        &format!("varlen run {it} sequence {i}"),
                        (&shape, &cfg),
                        [&qkv[0], &qkv[1], &qkv[2]],
                        (&o, &l, &sel),
                        (cu[i], total),
                    );
                }
            }
        });
        let (p, v) = (prefill.join(), varlen.join());
        stop.store(true, Ordering::Relaxed);
        if let Err(e) = p.and(v) {
            std::panic::resume_unwind(e);
        }
    });
    let (n, refused) = (changes.into_inner(), refused.into_inner());
    eprintln!("{n} settings changes; {refused} prefill runs refused and planned again");
    assert!(n > 0, "the settings never changed while the plans ran");
}
