//! Reliability of the GPU library (`docs/reliability.md`), determinism and threads:
//! prefill, selection, dense attention and decode give bitwise identical results run after run;
//! `Context` and `KvCache` are `Send + Sync`; two threads calling prefill and decode on one
//! context get bitwise the single-thread results; an error in one thread does not reach another
//! thread's call. Inputs come from fixed seeds (`reliability_util`).
mod common;
#[path = "reliability_util.rs"]
mod reliability_util;

use std::sync::Arc;

use common::*;
use pisa_core::TensorLayout;
use pisa_wgpu::ops::attention::dense_attention_host;
use pisa_wgpu::ops::decode::KvCache;
use pisa_wgpu::ops::prefill::{prefill_host, PrefillOutput};
use pisa_wgpu::ops::select::{select_host, Method};
use pisa_wgpu::{Context, Storage};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use reliability_util::{bits, inputs, opts, private_ctx, same_output, small};

#[test]
fn same_inputs_give_bitwise_identical_results() {
    let ctx = ctx();
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 6);
    for cfg in [cfg, cfg.with_forced(1, 1).with_merge_factor(3)] {
        let runs: Vec<PrefillOutput> = (0..3)
            .map(|_| prefill_host(ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap())
            .collect();
        assert!(
            runs.iter().all(|r| same_output(&runs[0], r)),
            "prefill differs between runs"
        );
    }
    for method in [Method::Pisa, Method::Bsa, Method::Oracle] {
        let runs: Vec<Vec<i32>> = (0..3)
            .map(|_| {
                select_host(
                    ctx,
                    &q,
                    &k,
                    &shape,
                    TensorLayout::Bhnd,
                    &cfg,
                    Storage::F32,
                    method,
                    4,
                )
                .unwrap()
            })
            .collect();
        assert!(
            runs.iter().all(|r| *r == runs[0]),
            "{method:?} selection differs between runs"
        );
    }
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let (o, l) = dense_attention_host(
                ctx,
                &q,
                &k,
                &v,
                &shape,
                TensorLayout::Bnhd,
                true,
                0.2,
                Storage::F32,
            )
            .unwrap();
            (bits(&o), bits(&l))
        })
        .collect();
    assert!(
        runs.iter().all(|r| *r == runs[0]),
        "dense attention differs between runs"
    );
    if ctx.has_f16() {
        let mut o = opts(cfg);
        o.storage = Storage::F16;
        let a = prefill_host(ctx, &q, &k, &v, &shape, &o).unwrap();
        let b = prefill_host(ctx, &q, &k, &v, &shape, &o).unwrap();
        assert!(same_output(&a, &b), "f16 prefill differs between runs");
    }
    // Decode: two caches fed the same tokens give identical steps.
    let run = || {
        let mut r = ChaCha8Rng::seed_from_u64(7);
        let mut cache = KvCache::new(ctx, 2, 100, 4, 2, 32, cfg, Storage::F32).unwrap();
        (0..60)
            .map(|_| {
                let kr = random(&mut r, 2 * 2 * 32, 1.0);
                let vr = random(&mut r, 2 * 2 * 32, 1.0);
                let q = random(&mut r, 2 * 4 * 32, 1.0);
                let o = cache
                    .append_and_step(&kr, &vr, &[true, true], &q, true)
                    .unwrap();
                (bits(&o.out), bits(&o.lse), o.selection)
            })
            .collect::<Vec<_>>()
    };
    let (a, b) = (run(), run());
    assert!(a == b, "decode differs between runs");
}

#[test]
fn context_and_cache_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Context>();
    send_sync::<KvCache>();
    send_sync::<Arc<Context>>();
}

/// Two threads call prefill and decode on one shared context at the same time; every result
/// equals the single-thread result bitwise.
#[test]
fn concurrent_calls_from_two_threads_match_single_thread_results() {
    let ctx = Arc::new(private_ctx());
    let (shape, cfg) = small();
    let data: Vec<_> = (0..2).map(|t| inputs(&shape, 100 + t)).collect();
    let single: Vec<PrefillOutput> = data
        .iter()
        .map(|(q, k, v)| prefill_host(&ctx, q, k, v, &shape, &opts(cfg)).unwrap())
        .collect();
    let decode = |ctx: &Context, seed: u64| {
        let mut r = ChaCha8Rng::seed_from_u64(seed);
        let mut cache = KvCache::new(ctx, 1, 64, 4, 2, 32, cfg, Storage::F32).unwrap();
        (0..40)
            .map(|_| {
                let kr = random(&mut r, 2 * 32, 1.0);
                let vr = random(&mut r, 2 * 32, 1.0);
                let q = random(&mut r, 4 * 32, 1.0);
                let o = cache.append_and_step(&kr, &vr, &[true], &q, true).unwrap();
                (bits(&o.out), bits(&o.lse), o.selection)
            })
            .collect::<Vec<_>>()
    };
    let single_dec: Vec<_> = (0..2).map(|t| decode(&ctx, 200 + t)).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let ctx = ctx.clone();
                let (data, single, single_dec) = (&data[t], &single[t], &single_dec[t]);
                s.spawn(move || {
                    for i in 0..4 {
                        let (q, k, v) = data;
                        let got = prefill_host(&ctx, q, k, v, &shape, &opts(cfg)).unwrap();
                        assert!(
                            same_output(single, &got),
                            "thread {t} call {i}: prefill differs"
                        );
                        let got = decode(&ctx, 200 + t as u64);
                        assert!(got == *single_dec, "thread {t} call {i}: decode differs");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}

/// An error in one thread is not reported to another thread's call (wgpu error scopes are per
/// thread): neither one caught by a pisa scope, nor one of the application's own commands
/// outside any scope, which reaches the context's uncaptured-error slot and stays there for
/// `take_uncaptured_error` (pisa's calls used to take it from the slot at their end and return
/// it as their own error).
#[test]
fn an_error_in_one_thread_does_not_leak_into_another() {
    let ctx = private_ctx();
    let (shape, cfg) = small();
    let (q, k, v) = inputs(&shape, 8);
    let want = prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
    std::thread::scope(|s| {
        let good = s.spawn(|| {
            for _ in 0..6 {
                let got = prefill_host(&ctx, &q, &k, &v, &shape, &opts(cfg)).unwrap();
                assert!(same_output(&want, &got));
            }
        });
        let bad = s.spawn(|| {
            let mut errors = 0;
            for _ in 0..6 {
                let too_big = ctx.limits().max_buffer_size + 4;
                let r = ctx.scoped("oversized buffer", || {
                    let _b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
                        label: Some("too big"),
                        size: too_big,
                        usage: wgpu::BufferUsages::STORAGE,
                        mapped_at_creation: false,
                    });
                    Ok(())
                });
                errors += r.is_err() as usize;
            }
            errors
        });
        // The application's invalid copies (size 3: not a multiple of 4), outside any scope.
        let app = s.spawn(|| {
            let buf = |label| {
                ctx.device().create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: 16,
                    usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            };
            let (a, b) = (buf("app a"), buf("app b"));
            for _ in 0..20 {
                let mut enc = ctx.device().create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(&a, 0, &b, 0, 3);
                ctx.queue().submit([enc.finish()]);
            }
        });
        good.join().unwrap();
        app.join().unwrap();
        assert_eq!(bad.join().unwrap(), 6);
    });
    let left = ctx.take_uncaptured_error();
    assert!(
        left.as_deref()
            .is_some_and(|m| m.contains("COPY_BUFFER_ALIGNMENT")),
        "the application's error: {left:?}"
    );
}
