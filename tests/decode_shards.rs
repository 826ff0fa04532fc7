//! Tests of a decode cache split over two storage bindings (a module of `tests/decode.rs`):
//! K/V shards by flat (sequence, KV head) row, `prefill_device_heads` and
//! `prefill_view_heads`, on a context whose
//! binding limit is lowered so that small caches split.

use super::common::*;
use super::decode_harness::{base, cfg, Run};
use pisa_core::{PisaError, Scoring, TensorLayout};
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::{DType, GpuError, Storage, TensorView};

/// A cache past one storage binding (lowered here to 5 of its 9 flat (sequence, KV head) rows
/// of K/V) is split over two shards, rows 0..5 and 5..9, so that sequence 1's heads straddle
/// them: every step's selection, output and LSE match the reference (split step: the fused one
/// reads one shard, so a split cache refuses it even when asked). Then a prefill loaded a few
/// heads at a time (`prefill_device_heads`, 1 + 2 heads, the 2 straddling the shards for
/// sequence 1; and `prefill_view_heads`, from strided views of head ranges of one BNHD buffer
/// of all heads after 12 bytes of padding) lands every key and value where the whole prefill
/// does (read back from the shards) and gives the same outputs, bit for bit.
#[test]
fn cache_split_over_two_bindings() {
    static SMALL: std::sync::OnceLock<pisa_wgpu::Context> = std::sync::OnceLock::new();
    let small = SMALL.get_or_init(|| {
        let c = pisa_wgpu::Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
        c.set_max_binding_bytes(5 * 400 * 32 * 4); // 5 rows of capacity 400, D 32, f32
        c
    });
    let mut c = base(
        "two_shards",
        6,
        3,
        32,
        cfg(4, 5, 2, Scoring::Lse).with_forced(1, 1),
    );
    c.prefill = vec![300, 120, 157];
    c.steps = 20;
    let mut run = Run::new_in(small, c, 400);
    let (shards, rows) = run.cache.kv_shards();
    assert_eq!(
        (shards.len(), rows),
        (2, 5),
        "the cache is split over two bindings"
    );
    run.cache.set_fused(true);
    assert!(
        run.cache.fused_workgroup_memory().is_some(),
        "the fused kernel would fit"
    );
    assert!(!run.cache.is_fused(), "a split cache runs the split step");
    run.run();
    // f16 storage and `meanvar` scoring (second moments in the pyramid) on the same split: 5
    // rows of f16 K at capacity 600 fit the lowered binding, 9 do not (C = 16 keeps the f32
    // pyramid, never split, within it).
    if small.has_f16() {
        let cf = cfg(16, 5, 2, Scoring::MeanVar).with_forced(1, 0);
        let mut c = base("two_shards_f16_meanvar", 6, 3, 32, cf);
        c.storage = Storage::F16;
        c.prefill = vec![590, 333, 0];
        c.steps = 9;
        let run = Run::new_in(small, c, 600);
        assert_eq!(run.cache.kv_shards().0.len(), 2, "split over two bindings");
        run.run();
    } else {
        eprintln!("two_shards f16: skipped, no SHADER_F16 on this adapter");
    }

    let (hkv, d, p) = (3, 32, 211);
    let mut r = rng(seed("two_shards_heads"));
    let k = random(&mut r, hkv * p * d, 1.0);
    let v = random(&mut r, hkv * p * d, 1.0);
    let q = random(&mut r, 3 * 6 * d, 1.5);
    let cf = cfg(4, 5, 2, Scoring::Lse).with_forced(1, 1);
    let lay = TensorLayout::Bhnd;
    let mut outs = Vec::new();
    // The whole K and V as one app buffer each, BNHD [1, p, Hkv, d] after 12 bytes.
    let kb = storage_buffer(small, 12, &to_bnhd(&k, 1, hkv, p, d), Storage::F32);
    let vb = storage_buffer(small, 12, &to_bnhd(&v, 1, hkv, p, d), Storage::F32);
    let head_view = |buf, h0: usize, n: usize| {
        let strides = [p * hkv * d, d, hkv * d, 1];
        TensorView::new(
            buf,
            12 + (h0 * d * 4) as u64,
            DType::F32,
            [1, n, p, d],
            strides,
        )
        .unwrap()
    };
    for mode in ["whole", "device heads", "view heads"] {
        let mut cache = KvCache::new(small, 3, 400, 6, hkv, d, cf, Storage::F32).unwrap();
        for b in 0..3 {
            if mode == "view heads" {
                for (h0, n) in [(0, 2), (2, 1)] {
                    let (kv, vv) = (head_view(&kb, h0, n), head_view(&vb, h0, n));
                    cache.prefill_view_heads(b, h0, &kv, &vv).unwrap();
                }
            } else if mode == "device heads" {
                for (h0, n) in [(0, 1), (1, 2)] {
                    let r = h0 * p * d..(h0 + n) * p * d;
                    let kt = small.upload("k", &k[r.clone()], Storage::F32).unwrap();
                    let vt = small.upload("v", &v[r], Storage::F32).unwrap();
                    cache.prefill_device_heads(b, h0, n, &kt, &vt, lay).unwrap();
                }
            } else {
                cache.prefill(b, &k, &v, lay).unwrap();
            }
        }
        let o = cache.step(&q, true).unwrap();
        let (shards, _) = cache.kv_shards();
        let mut kv = Vec::new();
        for (ks, vs) in shards {
            kv.push((small.read_f32(ks).unwrap(), small.read_f32(vs).unwrap()));
        }
        // Row r = b * Hkv + h of the cache (shard r / 5, row r % 5), tokens 0..p.
        for b in 0..3 {
            for h in 0..hkv {
                let r = b * hkv + h;
                let (ks, vs) = &kv[r / 5];
                let at = (r % 5) * 400 * d;
                let want = h * p * d..(h + 1) * p * d;
                assert_eq!(
                    &ks[at..at + p * d],
                    &k[want.clone()],
                    "{mode}: keys of seq {b} head {h}"
                );
                assert_eq!(
                    &vs[at..at + p * d],
                    &v[want],
                    "{mode}: values of seq {b} head {h}"
                );
            }
        }
        outs.push((o.out, o.lse, o.selection));
    }
    assert!(outs[0].0.iter().all(|x| x.is_finite()), "outputs written");
    assert_eq!(outs[0], outs[1], "prefill by heads equals prefill at once");
    assert_eq!(
        outs[0], outs[2],
        "prefill by head views equals prefill at once"
    );
    // A head view of another head dim, or a range past Hkv, is refused and changes nothing.
    let mut cache = KvCache::new(small, 1, 400, 6, hkv, d, cf, Storage::F32).unwrap();
    let past = cache.prefill_view_heads(0, 2, &head_view(&kb, 1, 2), &head_view(&vb, 1, 2));
    assert!(
        matches!(past, Err(GpuError::Input(PisaError::TooLarge { .. }))),
        "{:?}",
        past.map(|_| ())
    );
    let narrow = TensorView::new(&kb, 12, DType::F32, [1, 1, p, d - 1], [0, 0, hkv * d, 1]);
    let e = cache.prefill_view_heads(0, 0, &narrow.unwrap(), &head_view(&vb, 0, 1));
    assert!(matches!(e, Err(GpuError::View(_))), "{:?}", e.map(|_| ()));
    assert_eq!(cache.lens(), &[0], "nothing loaded on error");
    // Heads loaded at different lengths, or some left out: steps and appends are refused
    // until every head holds the sequence's length (a head loaded again at that length, a
    // whole prefill or a reset ends it).
    let q1 = random(&mut r, 6 * d, 1.0);
    let kv1 = random(&mut r, hkv * d, 1.0);
    let misuse = |e: pisa_wgpu::Result<()>, what: &str| {
        let e = e.unwrap_err();
        assert!(matches!(e, GpuError::Misuse(_)), "{what}: {e}");
    };
    cache
        .prefill_view_heads(0, 0, &head_view(&kb, 0, 2), &head_view(&vb, 0, 2))
        .unwrap();
    misuse(
        cache.step(&q1, true).map(|_| ()),
        "head 2 never loaded: step",
    );
    misuse(
        cache.append(&kv1, &kv1, &[true]),
        "head 2 never loaded: append",
    );
    let short = |b| {
        let strides = [p * hkv * d, d, hkv * d, 1];
        TensorView::new(b, 12 + 2 * d as u64 * 4, DType::F32, [1, 1, 50, d], strides).unwrap()
    };
    cache
        .prefill_view_heads(0, 2, &short(&kb), &short(&vb))
        .unwrap();
    assert_eq!(cache.lens(), &[50]);
    misuse(
        cache.step(&q1, true).map(|_| ()),
        "heads 0, 1 at another length",
    );
    cache
        .prefill_view_heads(0, 2, &head_view(&kb, 2, 1), &head_view(&vb, 2, 1))
        .unwrap();
    let by_heads = cache.step(&q1, true).unwrap();
    cache.prefill(0, &k, &v, lay).unwrap();
    assert_eq!(
        by_heads.out,
        cache.step(&q1, true).unwrap().out,
        "every head at p tokens"
    );
    cache
        .prefill_view_heads(0, 1, &short(&kb), &short(&vb))
        .unwrap();
    misuse(cache.step(&q1, true).map(|_| ()), "head 1 reloaded shorter");
    cache.reset(0).unwrap();
    let empty = cache.step(&q1, true).unwrap();
    assert!(
        empty.lse.iter().all(|&l| l == f32::NEG_INFINITY),
        "reset: empty"
    );
}
