#!/usr/bin/env bash
# The test command of README.md (and of CI): a Vulkan driver (lavapipe when no GPU), the whole
# workspace's tests, the subgroup kernels at subgroup sizes 32 and 64, the check of the NVIDIA
# kernels' SPIR-V, the no_std build of pisa-core,
# the wasm32 build of pisa-wgpu, the kernel
# tests on wgpu's OpenGL backend, the browser test of the WebGPU demo, and the formatting check
# (where rustfmt is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's wall time, so that a slow run shows where its time went.
phase() { echo "== ${SECONDS}s: $*"; }
phase "Vulkan driver"
bash scripts/setup-vulkan.sh
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}  # quiets Mesa's WSI warning on headless machines
# A one-off build keeps no incremental caches (they double target/ for nothing on a clean clone).
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
# rustfmt is installed through rustup where missing; without rustup (or a network), the
# check is skipped with a note rather than failing the run.
if ! cargo fmt --version >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then
  timeout 300 rustup component add rustfmt >/dev/null 2>&1 || true
fi
if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all -- --check
else
  echo "rustfmt not installed and rustup could not add it: formatting not checked"
fi
phase "no_std build of pisa-core"
cargo build -p pisa-core --no-default-features --locked
# The library builds for the browser (wasm32, WebGPU): no blocking call is reachable there
# (runtime/block.rs refuses them).
phase "wasm32 check of pisa-wgpu"
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
cargo check --target wasm32-unknown-unknown -p pisa-wgpu --locked
# tests/translate.rs compiles the GLSL naga writes for every pipeline with glslang (Debian
# glslang-tools); without it that test only translates. A failed install does not stop the run.
command -v glslangValidator >/dev/null 2>&1 || { S=$([ "$(id -u)" = 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; $S apt-get install -y -qq glslang-tools >/dev/null 2>&1 || { $S apt-get update -qq && $S apt-get install -y -qq glslang-tools >/dev/null; }; } || echo "glslang-tools not installed: GLSL translations not compiled"
phase "workspace tests"
# Every pipeline the tests build is also written out as WGSL (PISA_DUMP_WGSL), for the browser
# compiler's check in scripts/test-web.sh (examples/web/wgsl-check.mjs).
export PISA_WGSL_CHECK_DIR="$PWD/target/wgsl-dump"
# (A clean run dumped 1079 pipelines on 2026-12-06, 821 of them for Tint to compile.)
export PISA_WGSL_CHECK_MIN=${PISA_WGSL_CHECK_MIN:-600}
rm -rf "$PISA_WGSL_CHECK_DIR"
PISA_DUMP_WGSL="$PISA_WGSL_CHECK_DIR" cargo test --workspace --locked
# The subgroup kernels in subgroups of 32 and 64 invocations (NVIDIA's and AMD's sizes), as
# llvmpipe makes them with wider vectors: the shuffle probe, the routing's subgroup score step
# and the decode route's subgroup level steps, against the reference (lavapipe only: a GPU
# ignores the variable); and in subgroups of 32, the decode leaf attention on shuffles.
phase "subgroups of 32 and 64 (llvmpipe)"
for w in 1024 2048; do
  LP_NATIVE_VECTOR_WIDTH=$w cargo test --locked -p pisa-wgpu --test subgroup_shuffle \
    --test select_route --test decode -- shuffle_xor_within_shuffle_lanes pisa_route_subgroups \
    route_with_and_without_subgroups
done
LP_NATIVE_VECTOR_WIDTH=1024 cargo test --locked -p pisa-wgpu --test decode -- \
  route_leaf_attention_with_and_without_subgroups
# The NVIDIA kernels' embedded SPIR-V (shaders/nv/spv) is what their GLSL sources make with the
# pinned glslang (tools/spirv builds glslang from source: about 2 minutes).
phase "SPIR-V check"
cargo run --release --locked --manifest-path tools/spirv/Cargo.toml -- --check
# The kernel tests again on wgpu's OpenGL backend (Mesa llvmpipe, headless EGL).
phase "OpenGL backend tests"
bash scripts/test-gl.sh
# The WebGPU demo page in headless Chromium (Dawn and its WGSL compiler Tint, on SwiftShader),
# checked against the CPU reference, and the tests' pipelines compiled by Tint.
phase "WebGPU demo in Chromium"
bash scripts/test-web.sh
phase "done"
