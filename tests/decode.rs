//! GPU KV cache and decode step against the CPU reference (`DecodeState`, `select_pisa` on the
//! prefix, `sparse_attention`), step by step. The tests here run the path `PISA_DECODE` selects
//! (split by default: run again with `PISA_DECODE=fused`); `decode_split` and `decode_fused`
//! pin one path each; `decode_shards` tests caches split over two storage bindings;
//! `decode_level_math` the route's level-width arithmetic.
mod common;
#[path = "decode_fused.rs"]
mod decode_fused;
#[path = "decode_harness.rs"]
mod decode_harness;
#[path = "decode_level_math.rs"]
mod decode_level_math;
#[path = "decode_shards.rs"]
mod decode_shards;
#[path = "decode_split.rs"]
mod decode_split;

use decode_harness::{base, cfg, Run};

use common::*;
use pisa_core::reference::{self, DecodeState};
use pisa_core::{AttentionShape, PisaError, Scoring, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::{GpuError, Storage};

#[test]
fn steps_match_reference_group3_g2() {
    Run::new(
        base("group3_g2", 6, 2, 64, cfg(16, 4, 2, Scoring::Lse)),
        300,
    )
    .run();
}

#[test]
fn steps_match_reference_group3_g3_bnhd() {
    let mut c = base("group3_g3", 6, 2, 64, cfg(16, 4, 3, Scoring::Lse));
    c.layout = TensorLayout::Bnhd;
    Run::new(c, 290).run();
}

/// Small blocks: 150 leaves for K = 4, so routing starts five levels up (and with g = 3,
/// three levels up), where the ancestor's children matter at every level.
#[test]
fn steps_match_reference_deep_routing() {
    let mut c = base("deep_g2", 8, 2, 64, cfg(2, 4, 2, Scoring::Lse));
    c.steps = 150;
    Run::new(c, 200).run();
    let mut c = base(
        "deep_g3",
        3,
        1,
        64,
        cfg(4, 3, 3, Scoring::Mean).with_forced(0, 1),
    );
    c.steps = 150;
    c.layout = TensorLayout::Bnhd;
    Run::new(c, 200).run();
}

#[test]
fn steps_match_reference_group1_meanvar_sink_local() {
    let cf = cfg(16, 4, 2, Scoring::MeanVar).with_forced(1, 1);
    Run::new(base("group1_meanvar", 2, 2, 80, cf), 300).run();
}

#[test]
fn exact_ties_prefer_lower_blocks() {
    let mut c = base("ties", 4, 2, 64, cfg(4, 3, 2, Scoring::Lse));
    c.prefill = vec![100, 61];
    c.steps = 20;
    c.tied = true;
    Run::new(c, 130).run();
    let mut c = base(
        "ties_mean",
        2,
        1,
        64,
        cfg(4, 4, 3, Scoring::Mean).with_forced(1, 0),
    );
    c.steps = 20;
    c.tied = true;
    Run::new(c, 130).run();
}

#[test]
fn batch_of_different_lengths_in_one_step() {
    let mut c = base("batch3", 8, 2, 96, cfg(8, 3, 2, Scoring::Mean));
    c.prefill = vec![1, 7, 9];
    c.steps = 100;
    c.active = 0.8;
    c.layout = TensorLayout::Bnhd;
    Run::new(c, 120).run();
}

#[test]
fn attention_in_several_chunks() {
    let mut c = base("chunks", 4, 2, 64, cfg(32, 10, 2, Scoring::Lse));
    c.prefill = vec![400, 333];
    c.steps = 30;
    let mut r = Run::new(c, 450);
    // The least workgroup memory the step accepts (fewer P.V parts in the leaf kernel; a
    // 32-key block still fits one chunk: `leaf_blocks_in_several_chunks` splits blocks).
    let needed = match r.cache.set_workgroup_memory_limit(0) {
        Err(GpuError::Limit { needed, .. }) => needed,
        other => panic!("expected a Limit error, got {other:?}"),
    };
    r.cache.set_workgroup_memory_limit(needed as u32).unwrap();
    r.run();
}

#[test]
fn non_causal_decode() {
    let mut c = base(
        "non_causal",
        4,
        2,
        64,
        cfg(8, 4, 2, Scoring::Lse).with_causal(false),
    );
    c.prefill = vec![20, 45];
    c.steps = 40;
    Run::new(c, 100).run();
    // Deep non-causal routing: 75+ leaves of 4 keys, several levels whose last node is partial
    // (the route's rounded-up level sizes).
    let mut c = base(
        "non_causal_deep",
        4,
        2,
        64,
        cfg(4, 4, 2, Scoring::Lse).with_causal(false),
    );
    c.prefill = vec![301, 150];
    c.steps = 40;
    Run::new(c, 400).run();
}

/// `reset` of one sequence while an encoder holding recorded appends of the batch is pending (a
/// serving loop freeing a finished request's slot before it submits): the other sequence's
/// append lands as recorded, and its next step equals the reference. (`reset` wrote every
/// sequence's host length, which already counted the pending appends, so they counted twice and
/// the other sequence attended an unwritten, poisoned row: NaN.)
#[test]
fn reset_beside_pending_appends_of_another_sequence() {
    let mut c = base("reset_pending", 2, 1, 16, cfg(4, 2, 2, Scoring::Lse));
    c.prefill = vec![10, 10];
    c.steps = 0;
    let mut r = Run::new(c, 64);
    let d = 16;
    let (k_rows, v_rows) = (
        random(&mut r.rng, 2 * d, 1.0),
        random(&mut r.rng, 2 * d, 1.0),
    );
    let (kb, vb) = (app_buffer(ctx(), &k_rows), app_buffer(ctx(), &v_rows));
    let (kv, vv) = (bhnd_f32(&kb, [2, 1, 1, d]), bhnd_f32(&vb, [2, 1, 1, d]));
    let mut enc = ctx().device().create_command_encoder(&Default::default());
    r.cache
        .record_append_view(&mut enc, &kv, &vv, &[true, true], None)
        .unwrap();
    r.cache.reset(0).unwrap();
    ctx().queue().submit([enc.finish()]);
    assert_eq!(r.cache.lens(), &[0, 11]);
    r.refs[1].append(&k_rows[d..], &v_rows[d..]).unwrap();
    let q = random(&mut r.rng, 2 * 2 * d, 1.5);
    let o = r.cache.step(&q, true).unwrap();
    r.check(0, 1, &q[2 * d..], &o);
}

#[test]
fn reset_then_reuse() {
    let mut c = base(
        "reset",
        7,
        1,
        128,
        cfg(16, 6, 2, Scoring::Lse).with_forced(2, 0),
    );
    c.prefill = vec![100, 30];
    c.steps = 30;
    let mut r = Run::new(c, 200).run();
    r.cache.reset(0).unwrap();
    r.refs[0] = DecodeState::new(7, 1, 128, r.case.cfg).unwrap();
    // Seq 0 stays empty for a step (zeros, -inf, no blocks), then grows from nothing.
    r.case.active = 1.0;
    let q = random(&mut r.rng, 2 * 7 * 128, 1.0);
    let o = r.cache.step(&q, true).unwrap();
    r.check(0, 0, &q[..7 * 128], &o);
    r.check(0, 1, &q[7 * 128..], &o);
    r.case.steps = 120;
    let mut r = r.run();
    r.prefill(1, 150);
    r.case.steps = 10;
    r.run();
}

#[test]
fn f16_storage() {
    if !ctx().has_f16() {
        eprintln!("f16_storage: skipped, no SHADER_F16 on this adapter");
        return;
    }
    let mut c = base(
        "f16",
        8,
        1,
        256,
        cfg(16, 4, 2, Scoring::Lse).with_forced(0, 1),
    );
    c.storage = Storage::F16;
    c.prefill = vec![50, 17];
    c.steps = 40;
    Run::new(c, 120).run();
}

/// bf16 storage: the cache holds bf16 words (appended rows rounded to bf16, prefill rows copied
/// a pair at a time), the kernels widen them as they read (exactly), so the steps match the
/// reference on the bf16-rounded inputs at f32's tolerance (O is f32). Both step paths (fused
/// and split), both layouts of the prefill copy, GQA 3 and 1, mean and mean+variance scoring
/// (the second moments updated from the bf16 keys on append). No feature needed.
#[test]
fn bf16_storage() {
    for (i, fused) in [true, false].into_iter().enumerate() {
        let (hq, hkv, d, scoring, layout) = [
            (6, 2, 64, Scoring::Lse, TensorLayout::Bhnd),
            (3, 3, 32, Scoring::MeanVar, TensorLayout::Bnhd),
        ][i];
        let mut c = base(
            ["bf16 fused", "bf16 split"][i],
            hq,
            hkv,
            d,
            cfg(16, 4, 2, scoring).with_forced(0, 1),
        );
        c.storage = Storage::Bf16;
        c.layout = layout;
        c.prefill = vec![50, 17];
        c.steps = 40;
        let mut r = Run::new(c, 120);
        r.cache.set_fused(fused);
        assert_eq!(r.cache.is_fused(), fused, "{}", r.case.name);
        r.run();
    }
}

#[test]
fn incremental_pyramid_equals_rebuild() {
    let mut c = base("pyramid", 3, 3, 64, cfg(8, 4, 3, Scoring::MeanVar));
    c.prefill = vec![5, 30];
    c.steps = 100;
    c.active = 0.7;
    let r = Run::new(c, 160).run();
    let (hkv, d) = (3, 64);
    let mut fresh = KvCache::new(ctx(), 2, 160, 3, hkv, d, r.case.cfg, Storage::F32).unwrap();
    for b in 0..2 {
        let st = &r.refs[b];
        fresh
            .prefill(b, st.keys(), st.values(), TensorLayout::Bnhd)
            .unwrap();
    }
    let read = |c: &KvCache| {
        let p = c.pyramid();
        (
            ctx().read_f32(&p.means).unwrap(),
            ctx().read_f32(p.sq.as_ref().unwrap()).unwrap(),
        )
    };
    let (got_m, got_s) = read(&r.cache);
    let (reb_m, reb_s) = read(&fresh);
    let cap = r.cache.pyramid_layout();
    for b in 0..2 {
        let st = &r.refs[b];
        let shape = AttentionShape::new(1, 3, hkv, 1, st.len(), d).unwrap();
        let cpu =
            reference::build_pyramid(st.keys(), &shape, TensorLayout::Bnhd, &r.case.cfg).unwrap();
        let lay = cpu.layout;
        let (mut g, mut gs) = (Vec::<f32>::new(), Vec::<f32>::new());
        let (mut w, mut ws, mut c_m, mut c_s) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for h in 0..hkv {
            for l in 0..lay.num_levels() {
                for j in 0..lay.nodes(l) {
                    let o = ((b * hkv + h) * cap.total_nodes() + cap.flat(l, j)) * d;
                    g.extend_from_slice(&got_m[o..o + d]);
                    gs.extend_from_slice(&got_s[o..o + d]);
                    w.extend(reb_m[o..o + d].iter().map(|&x| x as f64));
                    ws.extend(reb_s[o..o + d].iter().map(|&x| x as f64));
                    let (m, v) = (cpu.mean(0, h, l, j), cpu.var(0, h, l, j));
                    c_m.extend_from_slice(m);
                    c_s.extend(m.iter().zip(v).map(|(m, v)| v + m * m));
                }
            }
        }
        let at = format!("seq {b} len {} seed {}", st.len(), r.seed);
        for (what, e) in [
            ("means vs rebuild", rel_err(&g, &w)),
            ("second moments vs rebuild", rel_err(&gs, &ws)),
            ("means vs CPU", rel_err(&g, &c_m)),
            ("second moments vs CPU", rel_err(&gs, &c_s)),
        ] {
            assert!(e < 1e-5, "{what}: rel err {e} ({at})");
        }
    }
}

#[test]
fn errors_are_typed_and_leave_the_cache_unchanged() {
    let ctx = ctx();
    let cf = cfg(4, 2, 2, Scoring::Lse);
    let mut c = KvCache::new(ctx, 2, 6, 2, 1, 8, cf, Storage::F32).unwrap();
    let row = vec![0.5f32; 2 * 8];
    c.prefill(0, &[0.25; 5 * 8], &[0.25; 5 * 8], TensorLayout::Bhnd)
        .unwrap();
    c.append(&row, &row, &[true, false]).unwrap();
    assert_eq!(c.lens(), &[6, 0]);
    let full = c.append(&row, &row, &[true, true]).unwrap_err();
    assert!(
        matches!(
            full,
            GpuError::Input(PisaError::TooLarge {
                value: 7,
                limit: 6,
                ..
            })
        ),
        "{full}"
    );
    assert_eq!(c.lens(), &[6, 0]);
    let short = c.append(&row[1..], &row, &[false, true]).unwrap_err();
    assert!(
        matches!(short, GpuError::Input(PisaError::BufferLen { .. })),
        "{short}"
    );
    let mask = c.append(&row, &row, &[true]).unwrap_err();
    assert!(
        matches!(mask, GpuError::Input(PisaError::BufferLen { .. })),
        "{mask}"
    );
    let q = c.step(&[1.0; 2 * 2 * 8 - 1], false).unwrap_err();
    assert!(
        matches!(q, GpuError::Input(PisaError::BufferLen { .. })),
        "{q}"
    );
    let long = c.prefill(1, &[0.0; 7 * 8], &[0.0; 7 * 8], TensorLayout::Bhnd);
    assert!(matches!(
        long,
        Err(GpuError::Input(PisaError::TooLarge { .. }))
    ));
    let ragged = c.prefill(1, &[0.0; 12], &[0.0; 12], TensorLayout::Bhnd);
    assert!(matches!(
        ragged,
        Err(GpuError::Input(PisaError::BufferLen { .. }))
    ));
    assert!(c.reset(2).is_err());
    // A prefill of some KV heads: none, past Hkv, or a range whose end overflows.
    let kt = ctx.upload("k", &[0.5; 3 * 8], Storage::F32).unwrap();
    for (h0, n) in [(0, 0), (1, 1), (0, 2), (usize::MAX, 2)] {
        let e = c.prefill_device_heads(1, h0, n, &kt, &kt, TensorLayout::Bhnd);
        assert!(
            matches!(
                e,
                Err(GpuError::Input(PisaError::Zero { .. }))
                    | Err(GpuError::Input(PisaError::TooLarge { .. }))
            ),
            "heads {h0}+{n}: {:?}",
            e.map(|_| ())
        );
    }
    assert_eq!(c.lens(), &[6, 0]);
    // A capacity past the storage-binding limit (or past u32 indexing) is refused up front.
    let cap = (ctx.max_binding_bytes() / (64 * 4) + 1) as usize;
    match KvCache::new(ctx, 1, cap, 1, 1, 64, cf, Storage::F32) {
        Err(GpuError::Limit { .. }) | Err(GpuError::Input(PisaError::TooLarge { .. })) => {}
        other => panic!("capacity {cap}: {:?}", other.map(|_| ())),
    }
    // A zero capacity is named as such (not as the shape's key length).
    match KvCache::new(ctx, 1, 0, 1, 1, 64, cf, Storage::F32) {
        Err(GpuError::Input(PisaError::Zero { what: "capacity" })) => {}
        other => panic!("capacity 0: {:?}", other.map(|_| ())),
    }
    let ok = c.step(&[1.0; 2 * 2 * 8], true).unwrap();
    assert_eq!(&ok.selection.unwrap()[2..], &[-1, -1]);
}

/// The per-sequence accessors answer a sequence index out of range with the typed error of
/// the other per-sequence calls ([`KvCache::reset`]), not a panic; in range they agree with
/// [`KvCache::lens`].
#[test]
fn sequence_accessors_out_of_range_are_typed_errors() {
    let ctx = ctx();
    let cf = cfg(4, 2, 2, Scoring::Lse);
    let mut c = KvCache::new(ctx, 2, 6, 2, 1, 8, cf, Storage::F32).unwrap();
    c.prefill(0, &[0.25; 3 * 8], &[0.25; 3 * 8], TensorLayout::Bhnd)
        .unwrap();
    assert_eq!(c.lens(), &[3, 0]);
    assert_eq!(c.len(0).unwrap(), 3);
    assert_eq!(c.len(1).unwrap(), 0);
    assert!(!c.is_empty(0).unwrap());
    assert!(c.is_empty(1).unwrap());
    let out_of_range = |e: GpuError| {
        matches!(
            e,
            GpuError::Input(PisaError::TooLarge {
                what: "sequence index",
                value: 2,
                limit: 1
            })
        )
    };
    let len = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.len(2)))
        .expect("KvCache::len panicked on a sequence index out of range");
    assert!(out_of_range(len.unwrap_err()));
    let empty = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.is_empty(2)))
        .expect("KvCache::is_empty panicked on a sequence index out of range");
    assert!(out_of_range(empty.unwrap_err()));
    assert_eq!(c.lens(), &[3, 0]);
}

#[test]
fn head_dim_must_be_a_multiple_of_4() {
    let e = KvCache::new(
        ctx(),
        1,
        8,
        1,
        1,
        6,
        cfg(4, 2, 2, Scoring::Lse),
        Storage::F32,
    )
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(e, GpuError::Input(PisaError::HeadDim { head_dim: 6, .. })),
        "{e}"
    );
}

/// The widest head dim (1024) and GQA group (256) a cache takes, against the reference: the
/// `leaf` workgroup grows from its 128 invocations to what D/4 and g_q need.
#[test]
fn widest_head_dim_and_group() {
    for (name, hq, d) in [("d1024", 1, 1024), ("gq256", 256, 4)] {
        let mut c = base(name, hq, 1, d, cfg(4, 2, 2, Scoring::Lse));
        c.prefill = vec![13];
        c.steps = 2;
        Run::new(c, 16).run();
    }
    for (hq, d) in [(1, 1028), (257, 4)] {
        let r = KvCache::new(
            ctx(),
            1,
            8,
            hq,
            1,
            d,
            cfg(4, 2, 2, Scoring::Lse),
            Storage::F32,
        );
        assert!(r.is_err(), "Hq {hq} D {d} taken");
    }
}

/// Appends of different masks (some sequences appending, others not; masks that repeat,
/// alternate and cover all) recorded into one encoder, each followed by a step into outputs of
/// its own (poisoned), then one submit: each append reads its own mask (set in encoder order,
/// one mask buffer for all partial masks) and each step sees exactly the appends recorded
/// before it, checked per step and sequence against the reference replayed in the same order
/// (selection exactly except within the tie margin, output and LSE within tolerance).
#[test]
fn appends_of_many_masks_in_one_encoder() {
    let mut c = base("masks_one_encoder", 6, 2, 32, cfg(8, 3, 2, Scoring::Lse));
    c.prefill = vec![13, 40, 1, 27];
    c.steps = 0;
    let mut r = Run::new(c, 128);
    let (bn, hq, hkv, d, k) = (4, 6, 2, 32, 3);
    let (t, f) = (true, false);
    let masks = [
        [t, f, t, f],
        [f, t, f, f],
        [t, t, t, t],
        [f, f, f, t],
        [t, f, f, t],
        [f, t, t, f],
        [t, f, t, f],
        [f, f, f, f],
        [f, t, t, t],
    ];
    let ctx = ctx();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let mut recorded = Vec::new();
    for m in masks {
        let (kr, vr, q) = (
            random(&mut r.rng, bn * hkv * d, 1.0),
            random(&mut r.rng, bn * hkv * d, 1.0),
            random(&mut r.rng, bn * hq * d, 1.5),
        );
        let (kb, vb, qb) = (
            app_buffer(ctx, &kr),
            app_buffer(ctx, &vr),
            app_buffer(ctx, &q),
        );
        let ob = app_buffer(ctx, &vec![f32::NAN; bn * hq * d]);
        let lb = app_buffer(ctx, &vec![f32::NAN; bn * hq]);
        let sb = app_buffer(ctx, &vec![f32::NAN; bn * hkv * k]);
        r.cache
            .record_append_view(
                &mut enc,
                &bhnd_f32(&kb, [bn, hkv, 1, d]),
                &bhnd_f32(&vb, [bn, hkv, 1, d]),
                &m,
                None,
            )
            .unwrap();
        let sel = pisa_wgpu::TensorView::contiguous(
            &sb,
            0,
            pisa_wgpu::DType::I32,
            [bn, hkv, 1, k],
            TensorLayout::Bhnd,
        )
        .unwrap();
        let (ov, lv) = (bhnd_f32(&ob, [bn, hq, 1, d]), bhnd_f32(&lb, [bn, hq, 1, 1]));
        let outs = pisa_wgpu::ops::decode::StepOutputs {
            out: &ov,
            lse: &lv,
            selection: Some(&sel),
        };
        r.cache
            .record_step_into(&mut enc, &bhnd_f32(&qb, [bn, hq, 1, d]), Some(&outs), None)
            .unwrap();
        recorded.push((m, kr, vr, q, ob, lb, sb));
    }
    ctx.queue().submit([enc.finish()]);
    for (step, (m, kr, vr, q, ob, lb, sb)) in recorded.into_iter().enumerate() {
        let o = pisa_wgpu::ops::decode::DecodeOutput {
            out: bytemuck::cast_slice(&ctx.read_bytes(&ob).unwrap()).to_vec(),
            lse: bytemuck::cast_slice(&ctx.read_bytes(&lb).unwrap()).to_vec(),
            selection: Some(bytemuck::cast_slice(&ctx.read_bytes(&sb).unwrap()).to_vec()),
        };
        for b in 0..bn {
            if m[b] {
                let rows = b * hkv * d..(b + 1) * hkv * d;
                r.refs[b].append(&kr[rows.clone()], &vr[rows]).unwrap();
            }
            r.check(step, b, &q[b * hq * d..(b + 1) * hq * d], &o);
        }
    }
    for b in 0..bn {
        assert_eq!(r.cache.len(b).unwrap(), r.refs[b].len(), "seq {b}");
    }
}

/// Step outputs the step cannot bind in place (O with gaps between heads, LSE with gaps, a
/// strided selection, and, where the device's binding alignment is above 4 bytes, O at an
/// unaligned offset) are written through the cache's own outputs and a scatter recorded
/// after the step: the same values as a step into contiguous outputs, bitwise, and every byte
/// outside the views as it was (poisoned). An output of the wrong kind (an f32 selection, an
/// i32 O) or that a scatter cannot write (an f16 LSE: D = 1) is a `View` error.
#[test]
fn step_outputs_that_cannot_be_bound_are_scattered() {
    let mut c = base("scatter_outputs", 6, 2, 40, cfg(8, 3, 2, Scoring::Lse));
    c.prefill = vec![30, 70, 5];
    c.steps = 0;
    let mut r = Run::new(c, 128);
    let (bn, hq, hkv, d, k) = (3usize, 6usize, 2usize, 40usize, 3usize);
    let ctx = ctx();
    let q = random(&mut r.rng, bn * hq * d, 1.5);
    let qb = app_buffer(ctx, &q);
    let qv = bhnd_f32(&qb, [bn, hq, 1, d]);
    let poison = f32::from_bits(0xFFFF_FFFF);
    let step = |outs: &pisa_wgpu::ops::decode::StepOutputs| {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        r.cache.record_step_into(&mut enc, &qv, Some(outs), None)?;
        ctx.queue().submit([enc.finish()]);
        Ok::<(), GpuError>(())
    };
    let words = |b: &pisa_wgpu::wgpu::Buffer| -> Vec<u32> {
        bytemuck::cast_slice(&ctx.read_bytes(b).unwrap()).to_vec()
    };
    // Contiguous outputs, bound in place.
    let (ob, lb, sb) = (
        app_buffer(ctx, &vec![poison; bn * hq * d]),
        app_buffer(ctx, &vec![poison; bn * hq]),
        // (i32::MIN: no entry, index or -1 padding, is that)
        app_buffer(ctx, &vec![f32::from_bits(0x8000_0000); bn * hkv * k]),
    );
    let sel_of = |b, strides| {
        pisa_wgpu::TensorView::new(b, 0, pisa_wgpu::DType::I32, [bn, hkv, 1, k], strides).unwrap()
    };
    let (ov, lv, sv) = (
        bhnd_f32(&ob, [bn, hq, 1, d]),
        bhnd_f32(&lb, [bn, hq, 1, 1]),
        sel_of(&sb, [hkv * k, k, k, 1]),
    );
    step(&pisa_wgpu::ops::decode::StepOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&sv),
    })
    .unwrap();
    let (o0, l0, s0) = (words(&ob), words(&lb), words(&sb));
    assert!(o0.iter().all(|&w| w != 0xFFFF_FFFF), "O not written");
    assert!(l0.iter().all(|&w| w != 0xFFFF_FFFF), "LSE not written");
    assert!(
        s0.iter().all(|&w| w != 0x8000_0000),
        "selection not written"
    );
    // O with a gap of D after every head, at an unaligned offset where the device has one;
    // LSE f16; the selection with a gap after every KV head.
    let a = ctx.limits().min_storage_buffer_offset_alignment as usize;
    let off = if a > 4 { 1 } else { 0 };
    let (ob2, lb2, sb2) = (
        app_buffer(ctx, &vec![poison; off + bn * hq * 2 * d]),
        app_buffer(ctx, &vec![poison; bn * hq * 2]),
        app_buffer(ctx, &vec![poison; bn * hkv * 2 * k]),
    );
    let ov2 = pisa_wgpu::TensorView::new(
        &ob2,
        (off * 4) as u64,
        pisa_wgpu::DType::F32,
        [bn, hq, 1, d],
        [hq * 2 * d, 2 * d, d, 1],
    )
    .unwrap();
    let lv2 = pisa_wgpu::TensorView::new(
        &lb2,
        0,
        pisa_wgpu::DType::F32,
        [bn, hq, 1, 1],
        [hq * 2, 2, 1, 1],
    )
    .unwrap();
    let sv2 = sel_of(&sb2, [hkv * 2 * k, 2 * k, k, 1]);
    let outs2 = pisa_wgpu::ops::decode::StepOutputs {
        out: &ov2,
        lse: &lv2,
        selection: Some(&sv2),
    };
    step(&outs2).unwrap();
    let (o2, l2, s2) = (words(&ob2), words(&lb2), words(&sb2));
    for b in 0..bn {
        for h in 0..hq {
            let got = &o2[off + (b * hq + h) * 2 * d..][..2 * d];
            let want = &o0[(b * hq + h) * d..][..d];
            assert_eq!(&got[..d], want, "O seq {b} head {h}");
            assert!(got[d..].iter().all(|&w| w == 0xFFFF_FFFF), "O gap written");
            let i = b * hq + h;
            assert_eq!(l2[2 * i], l0[i], "LSE seq {b} head {h}");
            assert_eq!(l2[2 * i + 1], 0xFFFF_FFFF, "LSE gap written");
        }
        for h in 0..hkv {
            let got = &s2[(b * hkv + h) * 2 * k..][..2 * k];
            assert_eq!(
                &got[..k],
                &s0[(b * hkv + h) * k..][..k],
                "selection {b} {h}"
            );
            assert!(
                got[k..].iter().all(|&w| w == 0xFFFF_FFFF),
                "selection gap written"
            );
        }
    }
    assert!(
        o2[..off].iter().all(|&w| w == 0xFFFF_FFFF),
        "bytes before O written"
    );
    // Outputs of the wrong kind, and a 2-byte LSE (D = 1: a scatter writes 2-byte views in
    // pairs of elements along D).
    let f16_lse = pisa_wgpu::TensorView::contiguous(
        &lb2,
        0,
        pisa_wgpu::DType::F16,
        [bn, hq, 1, 1],
        TensorLayout::Bhnd,
    )
    .unwrap();
    let e = step(&pisa_wgpu::ops::decode::StepOutputs {
        out: &ov,
        lse: &f16_lse,
        selection: None,
    });
    assert!(matches!(e, Err(GpuError::View(_))), "{e:?}");
    let f32_sel = pisa_wgpu::TensorView::contiguous(
        &sb,
        0,
        pisa_wgpu::DType::F32,
        [bn, hkv, 1, k],
        TensorLayout::Bhnd,
    )
    .unwrap();
    let e = step(&pisa_wgpu::ops::decode::StepOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&f32_sel),
    });
    assert!(matches!(e, Err(GpuError::View(_))), "{e:?}");
    let i32_o = pisa_wgpu::TensorView::contiguous(
        &ob,
        0,
        pisa_wgpu::DType::I32,
        [bn, hq, 1, d],
        TensorLayout::Bhnd,
    )
    .unwrap();
    let e = step(&pisa_wgpu::ops::decode::StepOutputs {
        out: &i32_o,
        lse: &lv,
        selection: None,
    });
    assert!(matches!(e, Err(GpuError::View(_))), "{e:?}");
}

/// `KvCache::with_sizes` names the sizes `KvCache::new` takes in a row: each lands where its
/// name says (B, capacity as k_len, Hq, Hkv, D), and bad sizes are refused as by `new`.
#[test]
fn cache_sizes_by_name() {
    use pisa_wgpu::CacheSizes;
    let sizes = CacheSizes {
        batch: 3,
        capacity: 200,
        q_heads: 6,
        kv_heads: 2,
        head_dim: 64,
    };
    let c = cfg(16, 4, 2, Scoring::Lse);
    let cache = KvCache::with_sizes(ctx(), sizes, c, Storage::F32).unwrap();
    let s = cache.shape();
    assert_eq!(
        (s.batch, s.k_len, s.q_heads, s.kv_heads, s.head_dim),
        (3, 200, 6, 2, 64)
    );
    assert_eq!(cache.lens(), &[0, 0, 0]);
    let bad = CacheSizes {
        q_heads: 5,
        ..sizes
    };
    assert!(matches!(
        KvCache::with_sizes(ctx(), bad, c, Storage::F32),
        Err(GpuError::Input(_))
    ));
}
