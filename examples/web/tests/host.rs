//! The page's demo on a native adapter (lavapipe in CI): the same code the browser runs, with a
//! thread polling the device so `Context::read_async` resolves. Skipped without an adapter.
#![cfg(not(target_arch = "wasm32"))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pisa_web::demo::{self, Params};
use pisa_wgpu::wgpu;

const INPUT: &[u8] = include_bytes!("../../../data/demo-smollm2-layer15-4096.safetensors");

/// `demo::run` on the demo input cut by `p`, with a thread polling the device meanwhile (as the
/// browser's event loop does), so that its reads resolve.
fn run_polled(
    ctx: &pisa_wgpu::Context,
    errors: &demo::Errors,
    p: &Params,
) -> Result<demo::Report, String> {
    let input = demo::load(INPUT, p)?;
    let done = Arc::new(AtomicBool::new(false));
    let poller = {
        let (device, done) = (ctx.device().clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let _ = device.poll(wgpu::PollType::Poll);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let r = pollster::block_on(demo::run(ctx, errors, &input, p, 0.0, &mut |s| {
        eprintln!("{s}")
    }));
    done.store(true, Ordering::Relaxed);
    poller.join().unwrap();
    r
}

#[test]
fn demo_matches_the_reference_on_a_native_adapter() {
    let Ok((ctx, errors)) = pollster::block_on(demo::open()) else {
        eprintln!("skipped: no adapter");
        return;
    };
    let p = Params {
        tokens: 384,
        kv_heads: 1,
        steps: 4,
        block_size: 16,
        top_k: 8,
        merge: 2,
        repeats: 1,
        ..Default::default()
    };
    let r = run_polled(&ctx, &errors, &p).expect("demo runs");
    eprintln!("{}", serde_json::to_string_pretty(&r).unwrap());
    assert_eq!(r.prefill.rows, 384);
    assert_eq!(r.decode.rows, 4);
    assert!(r.prefill.pass(), "prefill: {:?}", r.prefill);
    assert!(r.decode.pass(), "decode: {:?}", r.decode);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.ok);
}

#[test]
fn bad_parameters_are_errors() {
    let p = Params {
        tokens: 5000,
        ..Default::default()
    };
    assert!(demo::load(INPUT, &p).unwrap_err().contains("tokens 5000"));
    let p = Params {
        kv_heads: 4,
        ..Default::default()
    };
    assert!(demo::load(INPUT, &p).unwrap_err().contains("kv_heads 4"));
}

/// The page's URL parameters (main.js passes them as they are): an unknown name, a negative or
/// fractional count and a text are refused, so the page shows why instead of running the
/// defaults; a known name with a count is taken.
#[test]
fn url_parameters_are_checked() {
    let parse = |s: &str| serde_json::from_str::<Params>(s);
    for bad in [
        r#"{"token": 64}"#,
        r#"{"tokens": -5}"#,
        r#"{"tokens": 1.5}"#,
        r#"{"tokens": "abc"}"#,
    ] {
        assert!(parse(bad).is_err(), "{bad} was taken");
    }
    let p = parse(r#"{"tokens": 256, "leaf_order": 2}"#).unwrap();
    assert_eq!(
        (p.tokens, p.leaf_order, p.top_k),
        (256, Some(2), Params::default().top_k)
    );
    // Absent: the context's order (the adapter's default) is kept.
    assert_eq!(parse(r#"{"tokens": 256}"#).unwrap().leaf_order, None);
}

/// A device of WebGPU's default 8 storage buffers per shader stage holds no decode cache (its
/// kernels bind 9): the page reports the prefill, checked, and the decode as skipped with the
/// reason, instead of only an error.
#[test]
fn decode_skipped_on_a_device_of_eight_storage_buffers() {
    let open = demo::open_with(|mut l| {
        l.max_storage_buffers_per_shader_stage = 8;
        l
    });
    let Ok((ctx, errors)) = pollster::block_on(open) else {
        eprintln!("skipped: no adapter");
        return;
    };
    let p = Params {
        tokens: 256,
        steps: 2,
        block_size: 16,
        repeats: 0,
        ..Default::default()
    };
    let r = run_polled(&ctx, &errors, &p).expect("the prefill runs");
    let why = r.decode_skipped.as_deref().expect("decode skipped");
    assert!(why.contains("storage buffers"), "{why}");
    assert_eq!((r.prefill.rows, r.decode.rows), (256, 0));
    assert!(r.prefill.pass(), "prefill: {:?}", r.prefill);
    assert!(r.ok && r.errors.is_empty(), "{:?}", r.errors);
}
