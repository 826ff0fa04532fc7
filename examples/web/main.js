// The page: checks for WebGPU, loads the wasm module and the demo input, runs the demo and
// shows its report. The outcome is also left in `window.pisaResult` (for the browser test):
// { ok, status: "pass" | "fail" | "no-webgpu" | "error", message, report }.

const INPUT = new URL("../../data/demo-smollm2-layer15-4096.safetensors", import.meta.url);
const statusEl = document.getElementById("status");
const reportEl = document.getElementById("report");
const logEl = document.getElementById("log");

const t0 = performance.now();
function log(line) {
  line = `[${((performance.now() - t0) / 1000).toFixed(2)} s] ${line}`;
  logEl.textContent += line + "\n";
  if (!window.pisaResult) statusEl.textContent = "running: " + line;
  console.log("pisa-web: " + line);
}

function finish(status, message, report = null) {
  statusEl.className = status;
  statusEl.textContent = message;
  window.pisaResult = { ok: status === "pass", status, message, report, adapter: jsAdapter };
  document.title = `PISA on WebGPU: ${status}`;
}

function esc(s) {
  return String(s).replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c]);
}

function table(rows) {
  return "<table>" + rows.map(([k, v]) => `<tr><th>${esc(k)}</th><td>${v}</td></tr>`).join("") + "</table>";
}

// The URL's parameters as they are (a number where the value reads as one, else the text): the
// wasm side refuses an unknown name or a value that is not a count, and the page shows why.
function params() {
  const p = {};
  for (const [k, v] of new URLSearchParams(location.search)) {
    // (Decimal numbers only: Number() would also read "0x10" or "1e3".)
    p[k] = /^-?\d+(\.\d+)?$/.test(v.trim()) ? Number(v) : v;
  }
  return p;
}

let jsAdapter = null; // what navigator.gpu says of the adapter (wgpu's report may lack the name)

const f = (x, d = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
const e = (x) => (x === null || x === undefined ? "–" : Number(x).toExponential(2));

function check(c) {
  const sel = `${c.rows_equal} of ${c.rows} rows equal` + (c.rows_equal === c.rows ? " ✔" : " ✘");
  let diff = "";
  for (const [row, gpu, want, margin] of c.differing) {
    diff += `<br>row ${row}: GPU [${gpu}] vs reference [${want}] (reference margin ${e(margin)})`;
  }
  return [
    ["selection", sel + diff],
    ["O rel. error (≤ 1e-4)", e(c.o_rel_err) + (c.o_rel_err <= 1e-4 ? " ✔" : " ✘")],
    ["LSE max abs diff", e(c.lse_max_abs)],
  ];
}

function show(r) {
  const a = r.adapter, t = r.times;
  const steps = t.step_ms;
  const mean = steps.length ? steps.reduce((x, y) => x + y, 0) / steps.length : null;
  reportEl.innerHTML =
    "<h2>Adapter</h2>" +
    table([
      ["adapter", esc(a.name || (jsAdapter && jsAdapter.name) || "(name hidden by the browser)")],
      ["backend / type", esc(`${a.backend} / ${a.device_type}`)],
      ["driver", esc(a.driver || "–")],
      ["kernel path", esc(a.kernel_path)],
      ["stage-2 / attention order", esc(a.leaf_order)],
      ["storage", esc(a.storage)],
      ["shader-f16 / subgroups / timestamps", `${a.shader_f16} / ${a.subgroups} / ${a.timestamps}`],
      ["notes", a.notes.map(esc).join("<br>")],
      ["WebGPU features of the adapter", esc(jsAdapter ? jsAdapter.features.join(", ") || "none" : "–")],
    ]) +
    (r.errors.length ? "<h2>WebGPU errors</h2><pre>" + r.errors.map(esc).join("\n\n") + "</pre>" : "") +
    "<h2>Input</h2>" +
    table([["input", esc(r.input)], ["config", esc(r.config)], ["decode steps", r.params.steps]]) +
    "<h2>Prefill vs CPU reference</h2>" + table(check(r.prefill)) +
    "<h2>Decode vs CPU reference</h2>" +
    (r.decode_skipped ? `<p>Skipped: ${esc(r.decode_skipped)}</p>` : table(check(r.decode))) +
    "<h2>Times (ms, wall clock on the page)</h2>" +
    table([
      ["open adapter + device", f(t.open_ms)],
      ["prefill plan", f(t.plan_ms)],
      ["prefill, first run (to readback)", f(t.prefill_first_ms)],
      ["prefill, best later run", f(t.prefill_best_ms)],
      ["prefill, last run on the GPU (timestamps)", t.prefill_gpu_ms == null ? "no timestamp-query" : `${f(t.prefill_gpu_ms)}: ${t.prefill_gpu_stages.map(([s, x]) => `${esc(s)} ${f(x)}`).join(", ")}`],
      ["KV cache", f(t.cache_ms)],
      [`decode prefix (${r.params.tokens - r.params.steps} appends)`, f(t.prefix_ms)],
      ["decode step (append + step + readback)", `mean ${f(mean)}; ${steps.map((x) => f(x)).join(", ")}`],
      ["CPU reference: selection / attention / decode", `${f(t.cpu_select_ms)} / ${f(t.cpu_attention_ms)} / ${f(t.cpu_decode_ms)}`],
    ]);
}

async function main() {
  if (!("gpu" in navigator) || !navigator.gpu) {
    const why = window.isSecureContext
      ? "this browser has no WebGPU (navigator.gpu is missing): use a browser with WebGPU enabled (Chrome/Edge 113+, or Chromium with --enable-unsafe-webgpu)"
      : "WebGPU needs a secure context: open the page from http://localhost or http://127.0.0.1 (or https), not from a file or another host";
    finish("no-webgpu", "No WebGPU: " + why + ".");
    return;
  }
  log("requesting a WebGPU adapter");
  const timeout = new Promise((ok) => setTimeout(() => ok("timeout"), 20000));
  const adapter = await Promise.race([navigator.gpu.requestAdapter({ powerPreference: "high-performance" }), timeout]);
  if (adapter === "timeout") {
    finish("no-webgpu", "No WebGPU adapter: navigator.gpu.requestAdapter() did not answer within 20 s (the browser's GPU process may be disabled, e.g. by --disable-gpu).");
    return;
  }
  if (!adapter) {
    finish("no-webgpu", "No WebGPU adapter: navigator.gpu exists but requestAdapter() returned null (WebGPU is disabled or blocklisted for this GPU; in Chromium try --enable-unsafe-webgpu, and on a machine without a GPU --use-webgpu-adapter=swiftshader --enable-unsafe-swiftshader).");
    return;
  }
  const info = adapter.info || {};
  jsAdapter = {
    name: [info.vendor, info.architecture, info.device, info.description].filter(Boolean).join(" "),
    features: [...adapter.features].sort(),
  };
  log(`adapter: ${[info.vendor, info.architecture, info.device, info.description].filter(Boolean).join(" ") || "(no info)"}; features: ${[...adapter.features].sort().join(", ") || "none"}`);

  log("loading the wasm module");
  let wasm;
  try {
    wasm = await import("./pkg/pisa_web.js");
    await wasm.default();
  } catch (err) {
    finish("error", `Could not load the wasm module (./pkg/pisa_web.js): ${err}. Build it first (see README: scripts/test-web.sh or the wasm-bindgen step).`);
    return;
  }
  log(`fetching ${INPUT.pathname}`);
  const resp = await fetch(INPUT);
  if (!resp.ok) {
    finish("error", `Could not fetch the demo input ${INPUT.pathname}: HTTP ${resp.status}. Serve the repository root (the page reads ../../data/).`);
    return;
  }
  const bytes = new Uint8Array(await resp.arrayBuffer());
  try {
    const json = await wasm.run(bytes, JSON.stringify(params()), (line) => log(line));
    const report = JSON.parse(json);
    show(report);
    const p = report.prefill, d = report.decode;
    const errs = report.errors.length ? `; ${report.errors.length} WebGPU error(s), the first: ${report.errors[0].split("\n")[0]}` : "";
    const dec = report.decode_skipped
      ? `decode skipped (${report.decode_skipped})`
      : `decode: ${d.rows_equal}/${d.rows} rows equal, O rel. err ${e(d.o_rel_err)}`;
    const summary = `prefill: ${p.rows_equal}/${p.rows} selection rows equal, O rel. err ${e(p.o_rel_err)}; ${dec}; ${report.adapter.kernel_path} kernels, ${report.adapter.storage}${errs}`;
    if (report.ok) finish("pass", "PASS: results equal the CPU reference (" + summary + ").", report);
    else finish("fail", "FAIL: results differ from the CPU reference (" + summary + ").", report);
  } catch (err) {
    finish("error", `Error: ${err && err.message ? err.message : err}`);
  }
}

main().catch((err) => finish("error", `Error: ${err && err.message ? err.message : err}`));
