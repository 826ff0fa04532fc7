//! GPU backward pass of block-sparse attention (PISA.md section 4) against the f64 CPU
//! reference: GQA groups 1, 2, 3, 4, 7, 8, 129, 160; head dims 8, 64, 80, 96, 128, 256; lengths
//! not multiples of C; batch 2; both layouts; f32 and f16 storage; causal and not; PISA's selections (a sink block every
//! query selected), a block no query selected (exactly zero dK/dV), random selections with
//! padding, repeats and future blocks; bitwise determinism; the key-block-major index against a
//! CPU stable sort.
mod common;

use common::*;
use pisa_core::reference::{select_pisa, sparse_attention, sparse_attention_backward};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::backward::{self, index};
use pisa_wgpu::{GpuError, Storage};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use TensorLayout::{Bhnd, Bnhd};

enum Sel {
    /// PISA's selection; `Some(j)`: then block j removed from every row.
    Pisa(Option<i32>),
    /// Random entries in `0..nb0` or -1 (repeats and, when causal, future blocks included).
    Random,
}

struct Case {
    shape: AttentionShape,
    layout: TensorLayout,
    cfg: SelectionConfig,
    storage: Storage,
    sel: Sel,
}

fn random_sel(r: &mut ChaCha8Rng, s: &AttentionShape, cfg: &SelectionConfig) -> Vec<i32> {
    let nb0 = s.k_len.div_ceil(cfg.block_size) as i32;
    let n = s.batch * s.kv_heads * s.q_len * cfg.top_k;
    (0..n)
        .map(|_| match r.random_range(0..4) {
            0 => -1,
            _ => r.random_range(0..nb0),
        })
        .collect()
}

type Grads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Runs one case on the GPU and checks it against the reference; returns the GPU gradients
/// and the selection.
fn run(case: &Case, r: &mut ChaCha8Rng, seed: u64) -> (Grads, Vec<i32>) {
    let (s, l, cfg, st) = (&case.shape, case.layout, &case.cfg, case.storage);
    let mut q = random(r, s.q_elems(), 1.5);
    let mut k = random(r, s.kv_elems(), 1.5);
    let mut v = random(r, s.kv_elems(), 1.0);
    let mut d_o = random(r, s.q_elems(), 1.0);
    if st == Storage::F16 {
        (q, k, v, d_o) = (
            through_f16(&q),
            through_f16(&k),
            through_f16(&v),
            through_f16(&d_o),
        );
    }
    let sel = match case.sel {
        Sel::Pisa(drop) => {
            let mut sel = select_pisa(&q, &k, s, l, cfg).unwrap().indices;
            if let Some(j) = drop {
                sel.iter_mut().filter(|x| **x == j).for_each(|x| *x = -1);
            }
            sel
        }
        Sel::Random => random_sel(r, s, cfg),
    };
    let (o, lse) = sparse_attention(&q, &k, &v, s, l, cfg, &sel).unwrap();
    let mut o32: Vec<f32> = o.iter().map(|&x| x as f32).collect();
    if st == Storage::F16 {
        o32 = through_f16(&o32);
    }
    let o_ref: Vec<f64> = o32.iter().map(|&x| x as f64).collect();
    let lse32: Vec<f32> = lse.iter().map(|&x| x as f32).collect();
    let want = sparse_attention_backward(&q, &k, &v, &o_ref, &lse, &d_o, s, l, cfg, &sel).unwrap();
    let got = backward::backward_host(ctx(), &q, &k, &v, &o32, &lse32, &d_o, s, l, cfg, st, &sel)
        .unwrap();
    // The gradients are f32 in both storages and the reference sees the f16-rounded inputs and
    // O, so f16 is held to f32's tolerance: observed 2e-7 to 5e-7 (a 0.1% error in the row
    // statistics D gives 9e-4 and fails it).
    let tol = 2e-5;
    for (name, g, w) in [
        ("dQ", &got.0, &want.dq),
        ("dK", &got.1, &want.dk),
        ("dV", &got.2, &want.dv),
    ] {
        let e = rel_err(g, w);
        eprintln!("  {name}: rel err {e:.2e}");
        assert!(
            e <= tol,
            "{name} rel err {e} > {tol} ({s:?}, {l:?}, {st:?}, seed {seed})"
        );
    }
    // Keys no query attended to (reference dV exactly 0) get exactly zero dK and dV.
    for (e, &w) in want.dv.iter().enumerate() {
        assert!(
            w != 0.0 || (got.1[e] == 0.0 && got.2[e] == 0.0),
            "unattended key element {e}: dK {} dV {} (seed {seed})",
            got.1[e],
            got.2[e]
        );
    }
    (got, sel)
}

#[test]
fn gradients_match_reference() {
    let seed = seed("backward");
    let mut r = rng(seed);
    let sh = |b, hq, hkv, nq, nk, d| AttentionShape::new(b, hq, hkv, nq, nk, d).unwrap();
    let cfg = |c, k| SelectionConfig::new(c, k).unwrap();
    let cases = [
        // GQA 1, D 64, 75 = 4*16 + 11; block 0 is every query's sink.
        Case {
            shape: sh(2, 2, 2, 75, 75, 64),
            layout: Bhnd,
            cfg: cfg(16, 3).with_forced(1, 0),
            storage: Storage::F32,
            sel: Sel::Pisa(None),
        },
        // GQA 3, D 128, C 48 (several key tiles per block), queries the suffix of the keys;
        // block 1 removed from every row: its dK, dV must be exactly 0.
        Case {
            shape: sh(2, 6, 2, 100, 150, 128),
            layout: Bnhd,
            cfg: cfg(48, 3).with_forced(1, 0),
            storage: Storage::F32,
            sel: Sel::Pisa(Some(1)),
        },
        // GQA 4, D 80, not causal, random rows (padding, repeats, rows with nothing).
        Case {
            shape: sh(1, 4, 1, 45, 45, 80),
            layout: Bnhd,
            cfg: cfg(8, 4).with_causal(false),
            storage: Storage::F32,
            sel: Sel::Random,
        },
        // GQA 3, causal random rows with future blocks (ignored) and a short query suffix.
        Case {
            shape: sh(2, 3, 1, 5, 33, 64),
            layout: Bhnd,
            cfg: cfg(16, 3),
            storage: Storage::F32,
            sel: Sel::Random,
        },
        // GQA 2, D 96, the keys' last block partial (50 = 3*16 + 2).
        Case {
            shape: sh(1, 4, 2, 50, 50, 96),
            layout: Bhnd,
            cfg: cfg(16, 3).with_forced(1, 1),
            storage: Storage::F32,
            sel: Sel::Pisa(None),
        },
        // GQA 7, causal random rows, 33 queries over 40 keys.
        Case {
            shape: sh(1, 7, 1, 33, 40, 64),
            layout: Bnhd,
            cfg: cfg(8, 3),
            storage: Storage::F32,
            sel: Sel::Random,
        },
        // D 256 (several dK/dV key sub-tiles per block on a 32 KiB device), GQA 1.
        Case {
            shape: sh(1, 2, 2, 20, 20, 256),
            layout: Bnhd,
            cfg: cfg(8, 2).with_forced(0, 1),
            storage: Storage::F32,
            sel: Sel::Pisa(None),
        },
    ];
    for (n, case) in cases.iter().enumerate() {
        eprintln!("case {n}");
        let (_, sel) = run(case, &mut r, seed);
        if n == 0 {
            let k = case.cfg.top_k;
            assert!(
                sel.chunks(k).all(|row| row.contains(&0)),
                "sink in every row"
            );
        }
    }
}

/// A GQA group larger than the kernels' 128 invocations: grad_q's row statistics are loaded in
/// a loop over the group (heads 128 and up had read none).
#[test]
fn gqa_group_past_the_workgroup() {
    let seed = seed("backward_wide_group");
    let mut r = rng(seed);
    for hq in [129, 160] {
        let case = Case {
            shape: AttentionShape::new(1, hq, 1, 20, 20, 8).unwrap(),
            layout: Bhnd,
            cfg: SelectionConfig::new(4, 3).unwrap(),
            storage: Storage::F32,
            sel: Sel::Random,
        };
        run(&case, &mut r, seed);
    }
}

/// A sink block every query selects, 117 queries x 8 heads = 936 rows of D 256: on a device
/// that caps an invocation's loop iterations (lavapipe) more than one grad_kv workgroup can
/// walk, so the rows are split over several and summed by `sum_splits` (asserted below where
/// the cap exists); elsewhere one workgroup walks them.
#[test]
fn sink_rows_past_the_loop_limit() {
    let seed = seed("backward_sink_split");
    let mut r = rng(seed);
    let case = Case {
        shape: AttentionShape::new(1, 8, 1, 117, 149, 256).unwrap(),
        layout: Bhnd,
        cfg: SelectionConfig::new(16, 2).unwrap().with_forced(1, 0),
        storage: Storage::F32,
        sel: Sel::Pisa(None),
    };
    if let Some(limit) = ctx().loop_limit() {
        let t = backward::BackwardTiles::for_device(ctx(), 256, 8, 16).unwrap();
        let (fixed, round) = t.grad_kv_iterations(256, 117 * 2);
        let one_workgroup = fixed + (117 * 8usize).div_ceil(t.kv_rows) as u64 * round;
        assert!(
            one_workgroup > limit,
            "{one_workgroup} iterations: the case no longer needs a split"
        );
    }
    let (_, sel) = run(&case, &mut r, seed);
    assert!(
        sel.chunks(2).all(|row| row.contains(&0)),
        "sink in every row"
    );
}

/// Where the device caps an invocation's loop iterations, a dQ whose loops for one query
/// (top_k blocks of D 256, a group of 8) pass the cap is refused with `GpuError::Limit`, not
/// computed wrong.
#[test]
fn grad_q_past_the_loop_limit_is_refused() {
    let Some(limit) = ctx().loop_limit() else {
        eprintln!("no loop limit on this device: skipped");
        return;
    };
    let s = AttentionShape::new(1, 8, 1, 70, 70, 256).unwrap();
    let cfg = SelectionConfig::new(64, 32).unwrap();
    let t = backward::BackwardTiles::for_device(ctx(), 256, 8, 64).unwrap();
    assert!(t.grad_q_iterations(256, 8, 64, 32) > limit);
    let mut r = rng(seed("backward_refused"));
    let (x, kv) = (
        random(&mut r, s.q_elems(), 1.0),
        random(&mut r, s.kv_elems(), 1.0),
    );
    let lse = random(&mut r, s.lse_elems(), 1.0);
    let sel = vec![0i32; s.q_len * 32];
    let e = backward::backward_host(
        ctx(),
        &x,
        &kv,
        &kv,
        &x,
        &lse,
        &x,
        &s,
        Bhnd,
        &cfg,
        Storage::F32,
        &sel,
    );
    assert!(matches!(e, Err(GpuError::Limit { .. })), "{e:?}");
}

#[test]
fn f16_storage_matches_reference_on_rounded_inputs() {
    if !ctx().has_f16() {
        eprintln!("no SHADER_F16: skipped");
        return;
    }
    let seed = seed("backward_f16");
    let mut r = rng(seed);
    let case = Case {
        shape: AttentionShape::prefill(2, 8, 2, 40, 128).unwrap(),
        layout: Bhnd,
        cfg: SelectionConfig::new(12, 3).unwrap().with_forced(1, 1),
        storage: Storage::F16,
        sel: Sel::Pisa(None),
    };
    run(&case, &mut r, seed);
}

#[test]
fn two_runs_are_bitwise_equal() {
    let seed = seed("backward_determinism");
    let case = Case {
        shape: AttentionShape::prefill(2, 6, 2, 70, 64).unwrap(),
        layout: Bhnd,
        cfg: SelectionConfig::new(16, 3).unwrap().with_forced(1, 0),
        storage: Storage::F32,
        sel: Sel::Pisa(None),
    };
    let a = run(&case, &mut rng(seed), seed).0;
    let b = run(&case, &mut rng(seed), seed).0;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, x, y) in [("dQ", &a.0, &b.0), ("dK", &a.1, &b.1), ("dV", &a.2, &b.2)] {
        assert!(
            bits(x) == bits(y),
            "{name} differs between runs (seed {seed})"
        );
    }
}

/// The index equals a stable sort by block of (key, query) with unusable entries keyed nb0.
#[test]
fn block_index_is_a_stable_sort_by_block() {
    let ctx = ctx();
    let seed = seed("backward_index");
    let mut r = rng(seed);
    // nb0 = 88 (two 4-bit passes, 4 tiles) and 263 (three passes).
    for (nq, nk, c, k, causal) in [(700, 700, 8, 5, true), (300, 2100, 8, 4, false)] {
        let s = AttentionShape::new(2, 2, 2, nq, nk, 64).unwrap();
        let cfg = SelectionConfig::new(c, k).unwrap().with_causal(causal);
        let sel = random_sel(&mut r, &s, &cfg);
        let nb0 = nk.div_ceil(c) as u32;
        let mut want = Vec::new();
        for row in sel.chunks(k * nq) {
            let mut seg: Vec<(u32, u32)> = Vec::new();
            for (e, &j) in row.iter().enumerate() {
                let (i, slot) = (e / k, e % k);
                let ok = j >= 0
                    && (!causal || j as usize * c <= nk - nq + i)
                    && !row[e - slot..e].contains(&j);
                seg.push((if ok { j as u32 } else { nb0 }, i as u32));
            }
            seg.sort_by_key(|p| p.0);
            want.extend(seg.into_iter().flat_map(|(a, b)| [a, b]));
        }
        let st = ctx.upload_u32("sel", &sel).unwrap();
        let idx = ctx
            .scoped("test", || {
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                let idx = index::record_block_index(ctx, &mut enc, &st, &s, &cfg, None)?;
                ctx.queue().submit([enc.finish()]);
                Ok(idx)
            })
            .unwrap();
        let got: Vec<u32> = ctx
            .read_i32(&idx.pairs)
            .unwrap()
            .into_iter()
            .map(|x| x as u32)
            .collect();
        assert!(
            got == want,
            "index differs (nq {nq}, nb0 {nb0}, seed {seed})"
        );
    }
}

#[test]
fn bad_inputs_are_errors() {
    let ctx = ctx();
    let s = AttentionShape::prefill(1, 2, 1, 10, 64).unwrap();
    let cfg = SelectionConfig::new(4, 2).unwrap();
    let x = vec![0.5f32; s.q_elems()];
    let kv = vec![0.5f32; s.kv_elems()];
    let lse = vec![0.0f32; s.lse_elems()];
    let sel = vec![0i32; s.q_len * 2];
    let run = |lse: &[f32], sel: &[i32]| {
        backward::backward_host(
            ctx,
            &x,
            &kv,
            &kv,
            &x,
            lse,
            &x,
            &s,
            Bhnd,
            &cfg,
            Storage::F32,
            sel,
        )
    };
    assert!(matches!(run(&lse[1..], &sel), Err(GpuError::Input(_))));
    assert!(matches!(run(&lse, &sel[1..]), Err(GpuError::Input(_))));
    // Each of Q, K, V, O and dO one element short.
    for which in 0..5 {
        let t = |i: usize, full: &[f32]| full[usize::from(i == which)..].to_vec();
        let (q, k, v, o, d_o) = (t(0, &x), t(1, &kv), t(2, &kv), t(3, &x), t(4, &x));
        let e = backward::backward_host(
            ctx,
            &q,
            &k,
            &v,
            &o,
            &lse,
            &d_o,
            &s,
            Bhnd,
            &cfg,
            Storage::F32,
            &sel,
        );
        assert!(
            matches!(e, Err(GpuError::Input(_))),
            "tensor {which}: {e:?}"
        );
    }
    if ctx.has_f16() {
        // One storage for q, k, v, o, d_o.
        let up = |x: &[f32], st| ctx.upload("t", x, st).unwrap();
        let (q16, k32) = (up(&x, Storage::F16), up(&kv, Storage::F32));
        let (o32, l32) = (up(&x, Storage::F32), up(&lse, Storage::F32));
        let st = ctx.upload_u32("sel", &sel).unwrap();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let e = backward::record_backward(
            ctx, &mut enc, &q16, &k32, &k32, &o32, &l32, &o32, &st, &s, Bhnd, &cfg, None,
        );
        assert!(matches!(e, Err(GpuError::Unsupported(_))));
    }
}

#[test]
fn tiles_fit_and_split_blocks() {
    use backward::BackwardTiles;
    for budget in [16384u64, 32768, 49152] {
        for hd in [64, 80, 96, 128, 256] {
            for g in [1, 3, 4, 8] {
                for c in [1, 16, 20, 48, 64, 128] {
                    let Ok(t) = BackwardTiles::plan(budget, hd, g, c) else {
                        // Only when the g_q rows of grad_q alone nearly fill the budget.
                        assert!(8 * (g * hd) as u64 + 2200 > budget, "{budget} {hd} {g}");
                        continue;
                    };
                    assert!(t.q_keys >= 1 && t.q_keys <= c, "{t:?}");
                    assert!(t.kv_keys >= 1 && t.kv_keys <= c && t.kv_rows >= 1, "{t:?}");
                }
            }
        }
    }
    // The C = 48, D = 128, g_q = 3 case above walks several tiles per block on lavapipe.
    let t = BackwardTiles::plan(32768, 128, 3, 48).unwrap();
    assert!(t.q_keys < 48 && t.kv_keys < 48, "{t:?}");
    assert!(BackwardTiles::plan(16384, 256, 8, 64).is_err());
}

/// An app's device on the first adapter, with `limit` storage buffers per shader stage where
/// given, and the context pisa makes of it (wgpu's default error handler: an error no scope
/// catches panics).
fn app_context(storage_buffers: Option<u32>) -> pisa_wgpu::Context {
    use pisa_wgpu::wgpu;
    let instance = pisa_wgpu::instance();
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).unwrap();
    let mut limits = adapter.limits();
    if let Some(n) = storage_buffers {
        limits.max_storage_buffers_per_shader_stage = n;
    }
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        required_features: pisa_wgpu::wanted_features(&adapter)
            - wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        required_limits: limits,
        ..Default::default()
    }))
    .unwrap();
    let ctx = pisa_wgpu::Context::from_device(&adapter, device, queue).unwrap();
    assert!(
        ctx.features().contains(wgpu::Features::TIMESTAMP_QUERY),
        "the check needs timestamps"
    );
    ctx
}

/// `record_backward` of random inputs of 40 tokens (Hq 4, Hkv 2, D 64, blocks of 8, top_k 2)
/// into a fresh encoder, with dO replaced by `d_o` where given, timed by a profiler of 16
/// slots: the result, and whether every slot is left (nothing recorded).
fn record_small(
    ctx: &pisa_wgpu::Context,
    d_o: Option<pisa_wgpu::GpuTensor>,
) -> (pisa_wgpu::Result<()>, bool) {
    let s = AttentionShape::prefill(1, 4, 2, 40, 64).unwrap();
    let cfg = SelectionConfig::new(8, 2).unwrap();
    let mut r = rng(seed("backward_refused_limit"));
    let mut up = |n, name| {
        ctx.upload(name, &random(&mut r, n, 1.0), Storage::F32)
            .unwrap()
    };
    let (q, o) = (up(s.q_elems(), "q"), up(s.q_elems(), "o"));
    let d_o = d_o.unwrap_or_else(|| up(s.q_elems(), "d_o"));
    let (k, v, lse) = (
        up(s.kv_elems(), "k"),
        up(s.kv_elems(), "v"),
        up(s.lse_elems(), "lse"),
    );
    let sel = ctx.upload_u32("sel", &vec![0; s.q_len * 2 * 2]).unwrap();
    let mut prof = pisa_wgpu::Profiler::new(ctx, 16);
    let slots = prof.remaining();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let e = backward::record_backward(
        ctx,
        &mut enc,
        &q,
        &k,
        &v,
        &o,
        &lse,
        &d_o,
        &sel,
        &s,
        Bhnd,
        &cfg,
        Some(&mut prof),
    );
    let untouched = slots == 16 && prof.remaining() == 16;
    // The encoder is whole: it submits (an empty one where the call was refused).
    ctx.queue().submit([enc.finish()]);
    (e.map(drop), untouched)
}

/// A device of 6 storage buffers per shader stage cannot run the gradient kernels (grad_q binds
/// 7): the call is refused with `GpuError::Limit` before anything is recorded (the profiler,
/// which every pass of the backward takes a timed slot of, has every slot left).
#[test]
fn refused_by_a_device_limit_records_nothing() {
    let (e, untouched) = record_small(&app_context(Some(6)), None);
    assert!(matches!(e, Err(GpuError::Limit { .. })), "{e:?}");
    assert!(untouched, "passes were recorded");
}

/// Regression: a dO in a buffer without STORAGE usage, on an app's device, made
/// `record_backward` panic inside wgpu (its bind groups were made outside any error scope; on
/// pisa's own device the call returned Ok and the submit failed). It is now a
/// `GpuError::Validation` with nothing recorded; the same call with a usable dO records.
#[test]
fn a_buffer_the_passes_cannot_bind_is_a_typed_error() {
    use pisa_wgpu::wgpu;
    let ctx = app_context(None);
    let n = 4 * 40 * 64;
    let not_storage = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("dO without STORAGE"),
        size: 4 * n as u64,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let d_o = pisa_wgpu::GpuTensor::from_buffer(not_storage, n, Storage::F32);
    let (e, untouched) = record_small(&ctx, Some(d_o));
    assert!(matches!(e, Err(GpuError::Validation { .. })), "{e:?}");
    assert!(untouched, "passes were recorded");
    let (e, untouched) = record_small(&ctx, None);
    assert!(e.is_ok() && !untouched, "{e:?}");
}

/// A tensor whose length is not the shape's is named by the shape's need, also where the
/// tensor claims more elements than its buffer holds (the message said "q has 5120
/// elements, the shape needs 5220": the buffer's size against the tensor's own claim).
#[test]
fn a_tensor_longer_than_its_buffer_is_named_by_the_shape() {
    let ctx = ctx();
    let s = AttentionShape::prefill(1, 4, 2, 40, 32).unwrap();
    let cfg = SelectionConfig::new(8, 2).unwrap();
    let mut r = rng(seed("a_tensor_longer_than_its_buffer"));
    let mut up = |n, name| {
        ctx.upload(name, &random(&mut r, n, 1.0), Storage::F32)
            .unwrap()
    };
    let (q, o, d_o) = (
        up(s.q_elems(), "q"),
        up(s.q_elems(), "o"),
        up(s.q_elems(), "d_o"),
    );
    let (k, v, lse) = (
        up(s.kv_elems(), "k"),
        up(s.kv_elems(), "v"),
        up(s.lse_elems(), "lse"),
    );
    let sel = ctx.upload_u32("sel", &vec![0; s.q_len * 2 * 2]).unwrap();
    let q_long =
        pisa_wgpu::GpuTensor::from_buffer(q.buffer.clone(), s.q_elems() + 100, Storage::F32);
    let sel_huge = pisa_wgpu::GpuTensor::from_buffer(sel.buffer.clone(), usize::MAX, Storage::F32);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for (what, q, sel, want) in [
        ("q", &q_long, &sel, (s.q_elems(), s.q_elems() + 100)),
        ("selection", &q, &sel_huge, (s.q_len * 2 * 2, usize::MAX)),
    ] {
        let e = backward::record_backward(
            ctx, &mut enc, q, &k, &v, &o, &lse, &d_o, sel, &s, Bhnd, &cfg, None,
        )
        .map(drop)
        .unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::Input(pisa_core::PisaError::BufferLen { what: w, expected, actual })
                    if w == what && (expected, actual) == want
            ),
            "{what}: {e}"
        );
    }
}
