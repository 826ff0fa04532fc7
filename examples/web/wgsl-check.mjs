// Compiles WGSL files with the browser's WGSL compiler (Chromium's Dawn and Tint, headless, on
// SwiftShader where there is no GPU): `node wgsl-check.mjs <dir>` creates a shader module of
// every `*.wgsl` in <dir> (the pipelines a native run dumped with PISA_DUMP_WGSL) on a WebGPU
// device and prints each one Tint reports errors for. Tint checks more than naga, which wgpu
// uses natively: WGSL's uniformity analysis (a barrier only in uniform control flow) among
// others, so a kernel naga accepts can fail in a browser. Modules that enable an extension
// the device does not have are counted as skipped (pisa builds those only where the device
// has the feature: cooperative matrices never in a browser), and so are the subgroup kernels
// (below). Exits 1 on any error, a lost device, or fewer modules compiled than
// PISA_WGSL_CHECK_MIN (default 1). Environment: that, and chromium.mjs's.
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { launch } from "./chromium.mjs";
import { serve } from "./serve.mjs";

const dir = process.argv[2];
if (!dir) {
  console.log("usage: node wgsl-check.mjs <folder of .wgsl files>");
  process.exit(2);
}
// The fewest modules that must compile (default 1): scripts/test.sh asks for most of what its
// tests build, so that a dump that mostly failed does not pass.
const min = Math.max(1, Number(process.env.PISA_WGSL_CHECK_MIN || 1));
const files = readdirSync(dir).filter((f) => f.endsWith(".wgsl")).sort();
const sources = files.map((f) => [f, readFileSync(join(dir, f), "utf8")]);
const { server, port } = await serve(0);
let code = 1;
let browser;
let close = async () => {};
try {
  ({ browser, close } = await launch());
  const page = browser.pages()[0] || (await browser.newPage());
  // Any page of the local server: a secure context, where navigator.gpu exists.
  await page.goto(`http://127.0.0.1:${port}/examples/web/package.json`);
  const r = await page.evaluate(async (sources) => {
    if (!navigator.gpu) return { error: "no navigator.gpu" };
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) return { error: "no WebGPU adapter" };
    const wanted = ["shader-f16", "subgroups"].filter((f) => adapter.features.has(f));
    const device = await adapter.requestDevice({ requiredFeatures: wanted });
    let lost = null;
    device.lost.then((info) => { lost = `${info.reason}: ${info.message}`; });
    const have = { f16: device.features.has("shader-f16"), subgroups: device.features.has("subgroups") };
    const out = { have, failed: [], skipped: [], compiled: 0 };
    for (const [name, src] of sources) {
      const enables = [...src.matchAll(/^\s*enable\s+([^;]+);/gm)].flatMap((m) => m[1].split(",").map((x) => x.trim()));
      const missing = enables.filter((e) => !((e === "f16" && have.f16) || (e === "subgroups" && have.subgroups)));
      if (missing.length) {
        out.skipped.push(`${name} (enable ${missing.join(", ")})`);
        continue;
      }
      // Subgroup kernels carry no `enable subgroups;` (naga of wgpu 30 refuses the directive)
      // and wgpu's WebGPU backend does not expose the feature, so pisa never builds them in a
      // browser.
      if (/\bsubgroup[A-Z]\w*\s*\(/.test(src)) {
        out.skipped.push(`${name} (subgroup builtins: never built in a browser)`);
        continue;
      }
      // `@coherent` is a native decoration (wgpu's MEMORY_DECORATION_COHERENT, which WebGPU
      // does not have): pisa builds the one module that declares it only where the device has
      // the feature.
      if (/@coherent\b/.test(src)) {
        out.skipped.push(`${name} (@coherent: a native feature, never built in a browser)`);
        continue;
      }
      // Both what the compiler says of the module and a validation error of its creation.
      device.pushErrorScope("validation");
      const info = await device.createShaderModule({ code: src }).getCompilationInfo();
      const scoped = await device.popErrorScope();
      const errors = info.messages.filter((m) => m.type === "error").map((m) => `${m.lineNum}:${m.linePos} ${m.message}`);
      if (scoped) errors.push(`validation: ${scoped.message}`);
      if (errors.length) out.failed.push(`${name}: ${errors.join(" | ")}`);
      out.compiled++;
    }
    out.lost = lost;
    return out;
  }, sources);
  if (r.error) {
    console.log(`WGSL check FAILED: ${r.error}`);
  } else {
    console.log(`WGSL check: ${r.compiled} of ${files.length} modules compiled by Tint (device: shader-f16 ${r.have.f16}, subgroups ${r.have.subgroups}), ${r.skipped.length} skipped, ${r.failed.length} with errors`);
    for (const s of r.skipped) console.log(`  skipped: ${s}`);
    for (const f of r.failed) console.log(`  ERROR ${f}`);
    if (r.lost) console.log(`  ERROR the device was lost (${r.lost})`);
    if (r.compiled < min) console.log(`  ERROR fewer than ${min} modules compiled (PISA_WGSL_CHECK_MIN)`);
    code = r.failed.length === 0 && !r.lost && r.compiled >= min ? 0 : 1;
  }
} catch (err) {
  console.log(`WGSL check FAILED: ${err}`);
} finally {
  await close();
  server.close();
}
process.exit(code);
