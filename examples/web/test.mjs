// Browser test of the demo page: serves the repository root, opens the page in headless
// Chromium with WebGPU (Dawn; on a machine without a GPU, SwiftShader's Vulkan), waits for the
// page's result and checks it: selection rows equal to the CPU reference's, O relative error
// <= 1e-4 and LSE within 1e-4 (f32).
// Exits non-zero on any mismatch, missing WebGPU, or error, printing the page's
// message. Environment: CHROMIUM (default /usr/bin/chromium), PISA_WEB_QUERY (URL parameters,
// e.g. "tokens=2048&kv_heads=3"; default none, the page as a user opens it), PISA_WEB_TIMEOUT_S
// (default 300).
import { executable as exe, launch } from "./chromium.mjs";
import { serve } from "./serve.mjs";

// SwiftShader (the adapter of a machine without a GPU) does not finish compiling the query-tile
// kernel of selection stage 2 (leaf_select) in minutes, and Chromium's GPU watchdog then ends the
// GPU process (the device is lost): pisa's defaults for a browser's fallback adapter run stage 2
// and attention leaf-major (Tuning::for_adapter), which the test checks when the page is opened
// without a leaf_order. (leaf_order=1 forces the query tiles, which time out there.)
const query = process.env.PISA_WEB_QUERY ?? "";
const timeoutMs = 1000 * Number(process.env.PISA_WEB_TIMEOUT_S || 300);

const { server, port } = await serve(0);
const url = `http://127.0.0.1:${port}/examples/web/index.html${query ? "?" + query : ""}`;
let code = 1;
let browser;
let close = async () => {};
try {
  ({ browser, close } = await launch());
  const page = browser.pages()[0] || (await browser.newPage());
  page.on("console", (m) => console.log(`[page ${m.type()}] ${m.text()}`));
  page.on("pageerror", (err) => console.log(`[page error] ${err}`));
  console.log(`opening ${url} in ${exe} (${browser.browser()?.version() ?? "?"})`);
  const t0 = Date.now();
  await page.goto(url);
  await page.waitForFunction(() => window.pisaResult !== undefined, null, {
    timeout: timeoutMs,
    polling: 500,
  });
  const r = await page.evaluate(() => window.pisaResult);
  console.log(`page (${((Date.now() - t0) / 1000).toFixed(1)} s): ${r.message}`);
  if (r.report) {
    const a = r.report.adapter;
    console.log(`adapter: ${a.name || (r.adapter && r.adapter.name) || "(hidden)"} | ${a.backend} ${a.device_type} | ${a.driver}`);
    console.log(`kernel path ${a.kernel_path}, order ${a.leaf_order}, storage ${a.storage}, f16 ${a.shader_f16}, subgroups ${a.subgroups}, timestamps ${a.timestamps}`);
    for (const n of a.notes) console.log(`note: ${n}`);
    if (r.adapter) console.log(`WebGPU features of the adapter: ${r.adapter.features.join(", ")}`);
    console.log(`times: ${JSON.stringify(r.report.times)}`);
    const failures = [];
    for (const err of r.report.errors) failures.push(`WebGPU error: ${err}`);
    // The last prefill run is timed by Profiler::finish_async where the adapter has timestamps.
    const gpu = r.report.times.prefill_gpu_ms;
    if (a.timestamps && !(typeof gpu === "number" && gpu > 0)) failures.push(`no GPU time of the prefill (timestamps ${a.timestamps}): ${gpu}`);
    if (a.device_type === "Cpu" && !new URLSearchParams(query).has("leaf_order") && a.leaf_order !== "Leaves")
      failures.push(`order ${a.leaf_order} on a fallback adapter: the default should be Leaves`);
    // (The page skips the decode on a device that cannot hold a cache; this one can.)
    if (r.report.decode_skipped) failures.push(`decode skipped: ${r.report.decode_skipped}`);
    for (const [name, c] of [["prefill", r.report.prefill], ["decode", r.report.decode]]) {
      const ex = (x) => (typeof x === "number" ? x.toExponential(3) : String(x));
      console.log(`${name}: ${c.rows_equal}/${c.rows} selection rows equal, O rel. err ${ex(c.o_rel_err)}, LSE max abs ${ex(c.lse_max_abs)}`);
      if (!(c.rows > 0 && c.rows_equal === c.rows)) failures.push(`${name}: selection rows differ, the first: ${JSON.stringify(c.differing.slice(0, 3))}`);
      // (A NaN or infinite error comes through JSON as null, which is not a number.)
      const within = (x) => typeof x === "number" && x <= 1e-4;
      if (!within(c.o_rel_err)) failures.push(`${name}: O rel. err ${c.o_rel_err} > 1e-4`);
      if (!within(c.lse_max_abs)) failures.push(`${name}: LSE max abs diff ${c.lse_max_abs} > 1e-4`);
    }
    if (failures.length) console.log("FAILED:\n  " + failures.join("\n  "));
    code = r.ok && failures.length === 0 ? 0 : 1;
  }
  console.log(code === 0 ? "browser test passed" : `browser test FAILED (${r.status})`);
} catch (err) {
  console.log(`browser test FAILED: ${err}`);
} finally {
  await close();
  server.close();
}
process.exit(code);
