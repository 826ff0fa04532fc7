// Headless Chromium with WebGPU for the page's tests (test.mjs, wgsl-check.mjs): Dawn on
// SwiftShader's Vulkan where the machine has no GPU. Environment: CHROMIUM (the executable,
// default /usr/bin/chromium), PISA_WEB_CHROMIUM_ARGS (more flags, space-separated).
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

export const executable = process.env.CHROMIUM || "/usr/bin/chromium";

// Launches it with a fresh profile; `close()` closes it and removes the profile.
export async function launch() {
  const profile = mkdtempSync(join(tmpdir(), "pisa-web-chromium-"));
  const browser = await chromium.launchPersistentContext(profile, {
    executablePath: executable,
    headless: true,
    args: [
      "--no-sandbox",
      "--enable-unsafe-webgpu",
      "--enable-unsafe-swiftshader",
      "--use-webgpu-adapter=swiftshader",
      "--enable-features=Vulkan",
      "--use-angle=swiftshader",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      ...(process.env.PISA_WEB_CHROMIUM_ARGS || "").split(" ").filter(Boolean),
    ],
  });
  const close = async () => {
    await browser.close().catch(() => {});
    rmSync(profile, { recursive: true, force: true });
  };
  return { browser, close };
}
