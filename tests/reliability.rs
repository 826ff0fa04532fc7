//! Reliability of the GPU library (`docs/reliability.md`), bad input: typed errors for
//! bad shapes, lengths and configurations of prefill, attention, selection and the KV cache, each
//! naming the value, with the context usable (and giving the same result) afterwards; no adapter.
//! The other reliability tests are in `reliability_*.rs`: device limits and faults
//! (`reliability_device`), determinism and threads (`reliability_determinism`), NaN/Inf inputs
//! (`reliability_nonfinite`, `reliability_nonfinite_rows`, `reliability_nonfinite_decode`) and the
//! decode soak (`reliability_soak`); `cargo test -p pisa-wgpu --test 'reliability*'` runs them all.
mod common;
#[path = "reliability_util.rs"]
mod reliability_util;

use common::*;
use pisa_core::{AttentionShape, PisaError, TensorLayout};
use pisa_wgpu::ops::attention::dense_attention_host;
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::ops::prefill::{prefill_host, PrefillOptions};
use pisa_wgpu::ops::select::{select_host, Method};
use pisa_wgpu::{AdapterChoice, Context, GpuError, Storage};
use reliability_util::{inputs, opts, same_output, small};

#[test]
fn no_adapter_is_a_typed_error_with_a_hint() {
    for choice in [
        AdapterChoice::Name("no-such-gpu".into()),
        AdapterChoice::Index(10_000),
    ] {
        let e = Context::new(&choice).unwrap_err();
        assert!(matches!(e, GpuError::NoAdapter(_)), "{choice:?}: {e:?}");
        // The adapters that do exist are listed (this test runs where one does).
        let msg = e.to_string();
        assert!(msg.contains("adapters found: [0] "), "{msg}");
    }
    let msg = Context::new(&AdapterChoice::Name("no-such-gpu".into()))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no-such-gpu"), "{msg}");
    // A failed open leaves nothing behind: a real context still opens.
    assert!(Context::new(&AdapterChoice::HighPerformance).is_ok());
}

/// Bad shapes, lengths and configurations for prefill, attention, selection and the KV cache:
/// each a typed error (counted in docs/reliability.md), and a valid call works afterwards.
#[test]
fn bad_inputs_give_typed_errors_and_the_context_stays_usable() {
    let ctx = ctx();
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 1);
    let good = prefill_host(ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    let mut cases = 0;
    let mut check = |what: &str, r: pisa_wgpu::Result<()>, ok: &dyn Fn(&GpuError) -> bool| {
        cases += 1;
        match r {
            Ok(()) => panic!("{what}: accepted"),
            Err(e) => {
                assert!(ok(&e), "{what}: unexpected error {e:?}");
                assert!(!e.to_string().is_empty());
            }
        }
    };
    let buf_len = |want: &'static str| move |e: &GpuError| matches!(e, GpuError::Input(PisaError::BufferLen { what, .. }) if *what == want);
    let p = |q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape, o: &PrefillOptions| {
        prefill_host(ctx, q, k, v, s, o).map(|_| ())
    };
    let o = opts(cfg);
    check("short q", p(&q[1..], &k, &v, &shape, &o), &buf_len("q"));
    check(
        "long k",
        p(&q, &[&k[..], &[0.0]].concat(), &v, &shape, &o),
        &buf_len("k"),
    );
    check("empty v", p(&q, &k, &[], &shape, &o), &buf_len("v"));
    let mut s = shape;
    s.kv_heads = 3;
    check("GQA 4/3", p(&q, &k, &v, &s, &o), &|e| {
        matches!(
            e,
            GpuError::Input(PisaError::GqaNotDivisible {
                q_heads: 4,
                kv_heads: 3
            })
        )
    });
    let mut s = shape;
    s.q_len = 201;
    check("q_len > k_len", p(&q, &k, &v, &s, &o), &|e| {
        matches!(e, GpuError::Input(PisaError::QueryLongerThanKeys { .. }))
    });
    let mut s = shape;
    s.batch = 0;
    check("batch 0", p(&q, &k, &v, &s, &o), &|e| {
        matches!(e, GpuError::Input(PisaError::Zero { what: "batch" }))
    });
    let mut bad = o;
    bad.cfg = cfg.with_forced(2, 2);
    check("top_k below forced", p(&q, &k, &v, &shape, &bad), &|e| {
        matches!(
            e,
            GpuError::Input(PisaError::TopKBelowForced {
                top_k: 4,
                forced: 5
            })
        )
    });
    bad.cfg = cfg.with_merge_factor(1);
    check("merge factor 1", p(&q, &k, &v, &shape, &bad), &|e| {
        matches!(
            e,
            GpuError::Input(PisaError::MergeFactor { merge_factor: 1 })
        )
    });
    bad.cfg = cfg.with_scale(Some(f32::NAN));
    check("NaN scale", p(&q, &k, &v, &shape, &bad), &|e| {
        matches!(e, GpuError::Input(PisaError::InvalidValue { .. }))
    });
    bad.cfg = cfg;
    bad.cfg.block_size = 0;
    check("block size 0", p(&q, &k, &v, &shape, &bad), &|e| {
        matches!(e, GpuError::Input(PisaError::Zero { what: "block_size" }))
    });
    let mut bad = o;
    bad.q_tile = 0;
    check("q_tile 0", p(&q, &k, &v, &shape, &bad), &|e| {
        matches!(e, GpuError::Input(PisaError::Zero { what: "q_tile" }))
    });
    // Head dims the kernels do not support (D = 3: not a multiple of 4; D = 1024: too large;
    // D = 512: the selection takes it, the attention does not), named with the attention's
    // set, the prefill's (it was the selection's "1 to 512" for D = 1024).
    for d in [3usize, 1024, 512] {
        let s = AttentionShape::new(1, 2, 1, 32, 32, d).unwrap();
        let (q2, k2, v2) = inputs(&s, 2);
        let r = p(&q2, &k2, &v2, &s, &o);
        check(
            &format!("head dim {d}"),
            r,
            &|e| matches!(e, GpuError::Input(PisaError::HeadDim { head_dim, supported }) if *head_dim == d && *supported == pisa_wgpu::ops::attention::SUPPORTED_HEAD_DIMS),
        );
    }
    // Dense and sparse attention, selection.
    let r = dense_attention_host(
        ctx,
        &q,
        &k[1..],
        &v,
        &shape,
        TensorLayout::Bhnd,
        true,
        0.1,
        Storage::F32,
    );
    check("dense short k", r.map(|_| ()), &buf_len("k"));
    // A q_tile of 0 is refused by selection as by prefill (it was clamped to 1).
    for method in [Method::Pisa, Method::Bsa] {
        let r = select_host(
            ctx,
            &q,
            &k,
            &shape,
            TensorLayout::Bhnd,
            &cfg,
            Storage::F32,
            method,
            0,
        );
        check(
            &format!("select q_tile 0 ({method:?})"),
            r.map(|_| ()),
            &|e| matches!(e, GpuError::Input(PisaError::Zero { what: "q_tile" })),
        );
    }
    let r = select_host(
        ctx,
        &q[..8],
        &k,
        &shape,
        TensorLayout::Bhnd,
        &cfg,
        Storage::F32,
        Method::Bsa,
        4,
    );
    check("select short q", r.map(|_| ()), &buf_len("q"));
    let r = pisa_wgpu::ops::attention::sparse_attention_host(
        ctx,
        &q,
        &k,
        &v,
        &shape,
        TensorLayout::Bhnd,
        &cfg,
        Storage::F32,
        &[0; 3],
    );
    check(
        "sparse short selection",
        r.map(|_| ()),
        &buf_len("selection"),
    );
    // KV cache: construction, append, step, reset.
    let kv =
        |b, cap, hq, hkv, d, c| KvCache::new(ctx, b, cap, hq, hkv, d, c, Storage::F32).map(|_| ());
    check("cache GQA", kv(1, 64, 3, 2, 32, cfg), &|e| {
        matches!(e, GpuError::Input(PisaError::GqaNotDivisible { .. }))
    });
    check("cache capacity 0", kv(1, 0, 2, 1, 32, cfg), &|e| {
        matches!(e, GpuError::Input(PisaError::Zero { what: "capacity" }))
    });
    check(
        "cache u32 overflow",
        kv(1, 1 << 23, 8, 8, 128, cfg),
        &|e| matches!(e, GpuError::Input(PisaError::TooLarge { value, limit, .. }) if *value == 1 << 33 && *limit == u32::MAX as u64),
    );
    let mut cache = KvCache::new(ctx, 2, 40, 4, 2, 32, cfg, Storage::F32).unwrap();
    let row = vec![0.5f32; 2 * 2 * 32];
    let q1 = vec![0.25f32; 2 * 4 * 32];
    check(
        "append short rows",
        cache.append(&row[1..], &row, &[true, true]),
        &buf_len("appended keys"),
    );
    check(
        "append short active",
        cache.append(&row, &row, &[true]),
        &|e| matches!(e, GpuError::Input(_)),
    );
    check(
        "step short q",
        cache.step(&q1[1..], false).map(|_| ()),
        &buf_len("q"),
    );
    check("reset seq 2", cache.reset(2), &|e| {
        matches!(
            e,
            GpuError::Input(PisaError::TooLarge {
                what: "sequence index",
                value: 2,
                limit: 1
            })
        )
    });
    check(
        "prefill past capacity",
        cache.prefill(
            0,
            &vec![0.0; 2 * 41 * 32],
            &vec![0.0; 2 * 41 * 32],
            TensorLayout::Bhnd,
        ),
        &|e| matches!(e, GpuError::Input(PisaError::TooLarge { .. })),
    );
    check(
        "workgroup memory 64 bytes",
        cache.set_workgroup_memory_limit(64),
        &|e| matches!(e, GpuError::Limit { .. }),
    );
    for _ in 0..40 {
        cache.append(&row, &row, &[true, false]).unwrap();
    }
    assert_eq!(cache.lens(), &[40, 0]);
    check(
        "append to a full sequence",
        cache.append(&row, &row, &[true, true]),
        &|e| matches!(e, GpuError::Input(PisaError::TooLarge { .. })),
    );
    assert_eq!(cache.lens(), &[40, 0], "a failed append changes nothing");
    let out = cache.step(&q1, true).unwrap();
    assert!(out.out[..4 * 32].iter().all(|x| x.is_finite()));
    // Empty sequence 1: zeros, -inf, no blocks.
    assert!(out.out[4 * 32..].iter().all(|&x| x == 0.0));
    assert!(out.lse[4..].iter().all(|&x| x == f32::NEG_INFINITY));
    eprintln!("bad-input cases: {cases}");
    // The context is still usable and gives the same result as before the errors.
    let again = prefill_host(ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    assert!(same_output(&good, &again));
}

/// A shape built field by field (its fields are public) is checked by every call that takes
/// one, as `AttentionShape::new` checks it: 0 KV heads (a division by zero in the GQA group),
/// a query longer than the keys (an underflowing position offset) and a GQA group that does not
/// divide were a panic or a silent result of `select_host`, `oracle_host` and the backward pass
/// before; the buffers here have the lengths the bad shape implies, so only the shape check can
/// refuse them. Also the backward pass given an LSE that is not f32 (it read f16 words as f32
/// and returned wrong gradients).
#[test]
fn shapes_built_field_by_field_are_checked_at_every_entry() {
    use pisa_wgpu::ops::attention::sparse_attention_host;
    use pisa_wgpu::ops::backward::{backward_host, record_backward};
    use pisa_wgpu::oracle_host;
    let ctx = ctx();
    let (shape, cfg) = small();
    let lay = TensorLayout::Bhnd;
    let bad = [
        (
            "0 KV heads",
            AttentionShape {
                kv_heads: 0,
                ..shape
            },
        ),
        (
            "q_len > k_len",
            AttentionShape {
                q_len: shape.k_len + 8,
                ..shape
            },
        ),
        (
            "GQA 3/2",
            AttentionShape {
                q_heads: 3,
                kv_heads: 2,
                ..shape
            },
        ),
    ];
    let shape_error = |e: &GpuError| {
        matches!(
            e,
            GpuError::Input(
                PisaError::Zero { what: "kv_heads" }
                    | PisaError::QueryLongerThanKeys { .. }
                    | PisaError::GqaNotDivisible { .. }
            )
        )
    };
    let mut cases = 0;
    for (name, s) in bad {
        // Lengths from the fields, as a caller trusting the shape would make them.
        let nq = s.batch * s.q_heads * s.q_len * s.head_dim;
        let nk = s.batch * s.kv_heads * s.k_len * s.head_dim;
        let rows = s.batch * s.q_heads * s.q_len;
        let q: Vec<f32> = (0..nq).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let k: Vec<f32> = (0..nk).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.1).collect();
        let sel = vec![0i32; s.batch * s.kv_heads * s.q_len * cfg.top_k];
        let sel_t = ctx.upload_u32("selection", &sel).unwrap();
        let mut results: Vec<(String, pisa_wgpu::Result<()>)> = Vec::new();
        for method in [Method::Pisa, Method::Bsa, Method::Oracle] {
            let r = select_host(ctx, &q, &k, &s, lay, &cfg, Storage::F32, method, 4);
            results.push((format!("select_host {method:?}"), r.map(|_| ())));
        }
        let r = oracle_host(ctx, &q, &k, &s, lay, &cfg, Storage::F32);
        results.push(("oracle_host".into(), r.map(|_| ())));
        let r = sparse_attention_host(ctx, &q, &k, &k, &s, lay, &cfg, Storage::F32, &sel);
        results.push(("sparse_attention_host".into(), r.map(|_| ())));
        let r = dense_attention_host(ctx, &q, &k, &k, &s, lay, true, 0.1, Storage::F32);
        results.push(("dense_attention_host".into(), r.map(|_| ())));
        let lse = vec![0.5f32; rows];
        let r = backward_host(
            ctx,
            &q,
            &k,
            &k,
            &q,
            &lse,
            &q,
            &s,
            lay,
            &cfg,
            Storage::F32,
            &sel,
        );
        results.push(("backward_host".into(), r.map(|_| ())));
        // The kernel queries answer a call that would be refused without panicking.
        let kind = pisa_wgpu::ops::attention::AttentionKind::Dense {
            causal: true,
            scale: 0.1,
        };
        let _ = pisa_wgpu::ops::attention::attention_kernel(
            ctx,
            &s,
            Storage::F32,
            Default::default(),
            &kind,
            None,
        );
        let _ = pisa_wgpu::ops::attention::prefill_attention_kernel(ctx, &s, Storage::F32, &kind);
        let sparse = pisa_wgpu::ops::attention::AttentionKind::Sparse {
            selection: &sel_t,
            cfg: &cfg,
        };
        let _ = pisa_wgpu::ops::attention::prefill_attention_kernel(ctx, &s, Storage::F32, &sparse);
        for (what, r) in results {
            cases += 1;
            match r {
                Ok(()) => panic!("{name}: {what} accepted the shape"),
                Err(e) => assert!(shape_error(&e), "{name}: {what}: unexpected error {e:?}"),
            }
        }
    }
    // The backward pass with an LSE of 16-bit words (right length, wrong element type).
    let (q, k, v) = inputs(&shape, 3);
    let rows = shape.batch * shape.q_heads * shape.q_len;
    let up = |name, x: &[f32], st| ctx.upload(name, x, st).unwrap();
    let (qt, kt, vt) = (
        up("q", &q, Storage::F32),
        up("k", &k, Storage::F32),
        up("v", &v, Storage::F32),
    );
    // (bf16: 2-byte words on every device; f16 needs SHADER_F16, which GL lacks.)
    let lse16 = up("lse", &vec![0.5f32; rows], Storage::Bf16);
    let sel = ctx
        .upload_u32(
            "selection",
            &vec![0; shape.batch * shape.kv_heads * shape.q_len * cfg.top_k],
        )
        .unwrap();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let r = record_backward(
        ctx, &mut enc, &qt, &kt, &vt, &qt, &lse16, &qt, &sel, &shape, lay, &cfg, None,
    );
    match r {
        Ok(_) => panic!("backward accepted a bf16 LSE"),
        Err(e) => assert!(
            matches!(&e, GpuError::Unsupported(m) if m.contains("lse")),
            "bf16 LSE: unexpected error {e:?}"
        ),
    }
    // The pyramid of a hand-built shape.
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let no_heads = AttentionShape {
        kv_heads: 0,
        ..shape
    };
    let r = pisa_wgpu::ops::select::build_pyramid(ctx, &mut enc, &kt, &no_heads, lay, &cfg);
    assert!(
        r.as_ref().is_err_and(shape_error),
        "build_pyramid of 0 KV heads: {:?}",
        r.err()
    );
    eprintln!("shape cases: {cases}, plus the bf16 LSE and the pyramid");
}

/// A tensor whose public fields do not match its buffer, and the other inputs the audit of
/// the public entry points found unchecked: each is a typed error, or (for the questions of
/// which kernel runs) an answer without a panic. Before: dense attention over a tensor whose
/// `len` passes its buffer, or whose `storage` is not its bytes', returned wrong outputs;
/// `KvCache::record_step` read a q of another precision or length as its own; `read_f32` and
/// `read_i32` panicked on a `len` past the buffer; the pyramid build panicked for keys past its
/// capacity and averaged zeros in for a K shorter than its geometry; the block index of the
/// backward pass took any shape; the kernel questions divided by zero heads or a zero block
/// size; `check_head_dim(0)` was Ok; `record_prefill` took a `q_tile` of 0 on a prompt whose
/// queries keep every leaf; `random_tensor` filled NaN for a NaN scale.
#[test]
fn tensors_and_sizes_that_lie_are_refused() {
    use pisa_wgpu::ops::attention::{by_leaf, record_dense_attention, split_k, QkvLayouts};
    use pisa_wgpu::ops::pyramid::{self, KeyGeometry};
    use pisa_wgpu::GpuTensor;
    let ctx = ctx();
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 4);
    let lay = QkvLayouts::from(TensorLayout::Bhnd);
    let buf_len = |e: &GpuError| matches!(e, GpuError::Input(PisaError::BufferLen { .. }));
    let up = |x: &[f32], st| ctx.upload("t", x, st).unwrap();
    let (qt, kt, vt) = (
        up(&q, Storage::F32),
        up(&k, Storage::F32),
        up(&v, Storage::F32),
    );
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    // Q's len past its buffer (a buffer of one row); K in bf16 (half the bytes) labelled f32.
    let one_row = up(&q[..32], Storage::F32);
    let q_long = GpuTensor::from_buffer(one_row.buffer.clone(), shape.q_elems(), Storage::F32);
    let k16 = up(&k, Storage::Bf16);
    let k_lie = GpuTensor::from_buffer(k16.buffer.clone(), k.len(), Storage::F32);
    for (what, q, k) in [
        ("q past its buffer", &q_long, &kt),
        ("bf16 K as f32", &qt, &k_lie),
    ] {
        let r = record_dense_attention(ctx, &mut enc, q, k, &vt, &shape, lay, true, 0.2, None);
        assert!(r.as_ref().is_err_and(buf_len), "{what}: {:?}", r.err());
    }
    // A selection of 16-bit elements (the kernels read i32 words).
    let n = shape.batch * shape.kv_heads * shape.q_len * cfg.top_k;
    let sel16 = up(&vec![0.0; n], Storage::Bf16);
    let r = pisa_wgpu::ops::attention::record_sparse_attention(
        ctx, &mut enc, &qt, &kt, &vt, &sel16, &shape, lay, &cfg, None,
    );
    assert!(
        matches!(r, Err(GpuError::Unsupported(_))),
        "bf16 selection: {:?}",
        r.err()
    );
    // Reading back past the buffer.
    let mut t = up(&[1.0; 4], Storage::F32);
    t.len = 100;
    assert!(ctx.read_f32(&t).as_ref().is_err_and(buf_len));
    assert!(ctx.read_i32(&t).as_ref().is_err_and(buf_len));
    // A decode step's q of another precision, or length, than the cache's.
    let cache = pisa_wgpu::KvCache::new(ctx, 1, 64, 4, 2, 32, cfg, Storage::F32).unwrap();
    let q_bf16 = up(&[0.5; 4 * 32], Storage::Bf16);
    let r = cache.record_step(&mut enc, &q_bf16, None);
    assert!(
        matches!(r, Err(GpuError::Unsupported(_))),
        "bf16 q for an f32 cache: {r:?}"
    );
    let q_twice = up(&[0.5; 2 * 4 * 32], Storage::F32);
    let r = cache.record_step(&mut enc, &q_twice, None);
    assert!(
        r.as_ref().is_err_and(buf_len),
        "q of twice the length: {r:?}"
    );
    // The pyramid: keys past its capacity, and a K shorter than its geometry.
    let cap = pisa_core::PyramidLayout::new(64, 16, 2).unwrap();
    let geo = KeyGeometry {
        batch: 1,
        kv_heads: 1,
        tokens: 64,
        head_dim: 16,
        layout: TensorLayout::Bhnd.into(),
    };
    let pyr = pyramid::alloc(ctx, cap, &geo, false).unwrap();
    let k64 = up(&k[..64 * 16], Storage::F32);
    let geo256 = KeyGeometry { tokens: 256, ..geo };
    let geo32 = KeyGeometry { tokens: 32, ..geo };
    let geo_huge = KeyGeometry {
        batch: usize::MAX / 2,
        ..geo
    };
    for (what, g, k_len) in [
        ("keys past the capacity", &geo256, 256),
        ("keys past K's token dimension", &geo32, 64),
        ("a geometry whose span overflows", &geo_huge, 64),
    ] {
        let r = pyramid::record_build(ctx, &mut enc, &k64, g, k_len, &pyr, None);
        assert!(
            matches!(r, Err(GpuError::Input(PisaError::TooLarge { .. }))),
            "{what}: {r:?}"
        );
    }
    let k_short = up(&k[..256], Storage::F32);
    let r = pyramid::record_build(ctx, &mut enc, &k_short, &geo, 64, &pyr, None);
    assert!(
        r.as_ref().is_err_and(buf_len),
        "K shorter than its geometry: {r:?}"
    );
    pyramid::record_build(ctx, &mut enc, &k64, &geo, 64, &pyr, None).unwrap();
    // The backward pass's block index with a shape it cannot have.
    let sel = ctx.upload_u32("selection", &[0; 2 * 256 * 16]).unwrap();
    let long_q = AttentionShape {
        q_len: 256,
        k_len: 64,
        ..shape
    };
    let r = pisa_wgpu::ops::backward::index::record_block_index(
        ctx, &mut enc, &sel, &long_q, &cfg, None,
    );
    assert!(
        matches!(
            r,
            Err(GpuError::Input(PisaError::QueryLongerThanKeys { .. }))
        ),
        "block index of q_len > k_len: {:?}",
        r.err()
    );
    // The kernel questions: answers, no panic. 0 KV heads (gqa_group divided by it); a zero
    // block size, asked of a context that runs leaf-major wherever it fits (under Auto the
    // question returns before the block size for these f32 inputs) and of the prefill's
    // every-leaf test.
    let no_heads = AttentionShape {
        kv_heads: 0,
        ..shape
    };
    let mut no_block = cfg;
    no_block.block_size = 0;
    assert_eq!(split_k::tile_workgroups(&no_heads), 0);
    assert!(split_k::plan(ctx, &no_heads, Storage::F32).is_none());
    let mut t = ctx.tuning();
    t.leaf_order = pisa_wgpu::LeafOrder::Leaves;
    let leaves =
        pisa_wgpu::Context::with_tuning(&pisa_wgpu::AdapterChoice::HighPerformance, t).unwrap();
    assert!(by_leaf::leaf_major_path(&leaves, Storage::F32, &shape, lay, &cfg).is_some());
    for (s, c) in [(&no_heads, &cfg), (&shape, &no_block)] {
        assert!(by_leaf::leaf_major_path(&leaves, Storage::F32, s, lay, c).is_none());
        assert!(!by_leaf::leaf_major_pairs(&leaves, Storage::F32, s, lay, c));
        assert!(by_leaf::leaf_major_range(&leaves, Storage::F32, s, lay, c).is_none());
    }
    let sel_t = ctx.upload_u32("selection", &vec![0; n]).unwrap();
    let sparse = pisa_wgpu::ops::attention::AttentionKind::Sparse {
        selection: &sel_t,
        cfg: &no_block,
    };
    let _ = pisa_wgpu::ops::attention::prefill_attention_kernel(ctx, &shape, Storage::F32, &sparse);
    assert!(pisa_wgpu::check_head_dim(0).is_err());
    // q_tile 0 on a prompt whose queries keep every leaf (64 tokens, C 16, K 8).
    let short = AttentionShape::new(1, 4, 2, 64, 64, 32).unwrap();
    let scfg = pisa_core::SelectionConfig::new(16, 8).unwrap();
    let (sq, sk, sv) = inputs(&short, 5);
    let (sqt, skt, svt) = (
        up(&sq, Storage::F32),
        up(&sk, Storage::F32),
        up(&sv, Storage::F32),
    );
    let mut o = opts(scfg);
    o.q_tile = 0;
    let r =
        pisa_wgpu::ops::prefill::record_prefill(ctx, &mut enc, &sqt, &skt, &svt, &short, &o, None);
    assert!(
        matches!(r, Err(GpuError::Input(PisaError::Zero { what: "q_tile" }))),
        "q_tile 0: {:?}",
        r.err()
    );
    let r = pisa_wgpu::ops::fill::random_tensor(ctx, "x", 8, Storage::F32, 1, f32::NAN);
    assert!(
        matches!(r, Err(GpuError::Input(PisaError::InvalidValue { .. }))),
        "NaN scale: {:?}",
        r.err()
    );
    drop(enc);
}
