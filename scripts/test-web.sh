#!/usr/bin/env bash
# Browser test of the WebGPU demo page (examples/web): builds pisa-web for wasm32, generates its
# JS bindings with wasm-bindgen, serves the repository root on 127.0.0.1 and opens the page in
# headless Chromium with WebGPU (Dawn; SwiftShader's Vulkan on a machine without a GPU), which
# runs a PISA prefill and decode steps and checks them against the CPU reference (compiled to
# wasm). Exits non-zero on a mismatch, an error, or no WebGPU (printing the page's message).
# Installs what is missing: Debian's chromium (apt-get), the wasm32 target, wasm-bindgen-cli at
# the version of the wasm-bindgen crate in Cargo.lock, and the npm packages of
# examples/web/package-lock.json (playwright-core).
# `--build`: build the page (examples/web/pkg) and stop, without chromium or npm (then
# `node examples/web/serve.mjs` serves it on http://127.0.0.1:8000/examples/web/).
# Environment: PISA_WEB_QUERY (page parameters, e.g. "tokens=2048&kv_heads=3": that page
# only), CHROMIUM, PISA_WGSL_CHECK_DIR (a folder of dumped WGSL to compile with Tint).
set -euo pipefail
BUILD_ONLY=0
[ "${1:-}" = "--build" ] && BUILD_ONLY=1
cd "$(dirname "$0")/.."

step() { printf '\n== %s (%ds)\n' "$1" "$SECONDS"; }

if [ "$BUILD_ONLY" = 0 ] && [ -z "${CHROMIUM:-}" ]; then
  if ! command -v chromium >/dev/null 2>&1; then
    step "installing chromium"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
  fi
  CHROMIUM=$(command -v chromium)
fi
export CHROMIUM="${CHROMIUM:-}"

rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
# wasm-bindgen-cli must match the wasm-bindgen crate exactly.
WB_VERSION=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock)
if [ "$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')" != "$WB_VERSION" ]; then
  step "installing wasm-bindgen-cli $WB_VERSION"
  # A debug build: it compiles in about a quarter of the time of a release build (2 against
  # 8 minutes on 2 cores) and generates the bindings of this small module as fast.
  cargo install --debug wasm-bindgen-cli --version "$WB_VERSION" --locked \
    || cargo install --debug wasm-bindgen-cli --version "$WB_VERSION"  # a registry without a locked dependency
fi

step "building pisa-web for wasm32"
cargo build --release --locked --target wasm32-unknown-unknown -p pisa-web
step "wasm-bindgen"
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
wasm-bindgen --target web --no-typescript --out-dir examples/web/pkg \
  "$TARGET_DIR/wasm32-unknown-unknown/release/pisa_web.wasm"
[ "$BUILD_ONLY" = 1 ] && exit 0

cd examples/web
if [ ! -d node_modules/playwright-core ]; then
  step "npm ci"
  npm ci --no-audit --no-fund
fi
if [ -n "${PISA_WEB_QUERY:-}" ]; then
  step "browser test ($PISA_WEB_QUERY)"
  node test.mjs
else
  # The page as a user opens it (no parameters: on SwiftShader the adapter's default order is
  # leaf-major, Tuning::for_adapter; see test.mjs), then a prompt of at most top_k x C tokens
  # (dense attention: the portable tile kernel).
  for q in "" "tokens=256"; do
    step "browser test (${q:-no parameters})"
    PISA_WEB_QUERY="$q" node test.mjs
  done
fi
# The WGSL of every pipeline the workspace's tests built (scripts/test.sh dumps them there):
# Tint checks what naga does not (uniformity), so a kernel naga accepts may fail in a browser.
if [ -n "${PISA_WGSL_CHECK_DIR:-}" ]; then
  step "Tint check of the tests' pipelines"
  node wgsl-check.mjs "$PISA_WGSL_CHECK_DIR"
else
  echo "PISA_WGSL_CHECK_DIR not set (scripts/test.sh sets it): Tint check of the pipelines skipped"
fi
step "done"
