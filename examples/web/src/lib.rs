//! # pisa-web
//!
//! PISA in the browser: the page `examples/web/index.html` loads this crate compiled to wasm32
//! (wasm-bindgen), which runs a PISA prefill and a few decode steps on a cut of the demo input
//! (`data/demo-smollm2-layer15-4096.safetensors`) through the browser's WebGPU with
//! `pisa-wgpu`, runs the CPU reference of `pisa-core` on the same input, and returns a report
//! (JSON) of the adapter, the kernel path, the checks and the timings.
//!
//! The demo itself ([`demo`]) is target-independent; only the entry point [`run`] is wasm32's.

pub mod demo;

#[cfg(target_arch = "wasm32")]
mod web {
    use wasm_bindgen::prelude::*;

    use crate::demo;

    #[wasm_bindgen]
    extern "C" {
        #[wasm_bindgen(js_namespace = console)]
        fn error(s: &str);
    }

    /// Panics go to the console (and the page sees the trap as an exception).
    #[wasm_bindgen(start)]
    pub fn start() {
        std::panic::set_hook(Box::new(|info| {
            error(&format!("pisa-web panicked: {info}"))
        }));
    }

    /// Runs the demo on `input` (the bytes of the demo's safetensors file) with `params` (JSON
    /// of [`demo::Params`]; missing fields take their defaults), calling `progress(line)` per
    /// phase. Resolves to the report as JSON; rejects with a message (no WebGPU adapter, a
    /// device error, a bad parameter).
    #[wasm_bindgen]
    pub async fn run(
        input: Vec<u8>,
        params: String,
        progress: js_sys::Function,
    ) -> Result<String, JsValue> {
        let mut say = |s: &str| {
            let _ = progress.call1(&JsValue::NULL, &JsValue::from_str(s));
        };
        let p: demo::Params = serde_json::from_str(if params.trim().is_empty() {
            "{}"
        } else {
            &params
        })
        .map_err(|e| JsValue::from_str(&format!("parameters: {e}")))?;
        say("loading the input");
        let input = demo::load(&input, &p).map_err(|e| JsValue::from_str(&e))?;
        say("opening the WebGPU adapter and device");
        let t = web_time::Instant::now();
        let (ctx, errors) = demo::open()
            .await
            .map_err(|e| JsValue::from_str(&format!("WebGPU: {e}")))?;
        let open_ms = t.elapsed().as_secs_f64() * 1e3;
        let report = demo::run(&ctx, &errors, &input, &p, open_ms, &mut say)
            .await
            .map_err(|e| {
                let seen = errors.lock().unwrap_or_else(|p| p.into_inner()).join("; ");
                match seen.is_empty() {
                    true => JsValue::from_str(&e),
                    false => JsValue::from_str(&format!("{e} (WebGPU: {seen})")),
                }
            })?;
        serde_json::to_string(&report).map_err(|e| JsValue::from_str(&e.to_string()))
    }
}
