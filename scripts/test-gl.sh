#!/usr/bin/env bash
# The kernel tests on wgpu's OpenGL backend (WGPU_BACKEND=gl), headless, on Mesa's llvmpipe:
# installs EGL and Mesa's GL driver (Debian/Ubuntu) when missing and runs the test binaries that
# pass there (docs/gl-backend.md says what does not run on GL and why).
#
#   bash scripts/test-gl.sh                 # the binaries below
#   bash scripts/test-gl.sh attention gather  # only these
set -euo pipefail
cd "$(dirname "$0")/.."

# libEGL (glvnd) + Mesa's EGL vendor library + Mesa's DRI drivers (llvmpipe's swrast_dri.so).
PACKAGES=(libegl1 libegl-mesa0 libgl1-mesa-dri)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  echo "installing ${missing[*]}"
  # The package lists may be stale or absent (fresh containers): update and retry once.
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null; }
fi

export WGPU_BACKEND=gl
# Mesa's surfaceless EGL platform first tries a hardware driver (none on a headless machine) and
# logs "DRI2: failed to load driver"; go straight to the software rasterizer.
export LIBGL_ALWAYS_SOFTWARE=1
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}

# The kernel test binaries (their f16 cases are skipped, or checked to be refused with a typed
# error: llvmpipe GL has no SHADER_F16), about 4 minutes on 2 cores once built. decode,
# select_by_leaf and select_real pass on GL too (docs/gl-backend.md) but take another 3 minutes
# there, so CI leaves them to the Vulkan run (decode on GL is still covered by decode_from_plan,
# embedding and reliability_nonfinite_decode); name them to run them:
#   bash scripts/test-gl.sh decode select_by_leaf select_real
# Left out: the cooperative-matrix and Vulkan-only binaries.
BINS=(pyramid fill gather prefill prefill_plan attention attention_edge attention_split
  attention_union select select_route coopmat_select backward attention_by_leaf
  select_baselines embedding decode_from_plan decode_chunk reliability reliability_device
  reliability_determinism reliability_nonfinite reliability_nonfinite_rows
  reliability_nonfinite_decode)
if [ $# -gt 0 ]; then BINS=("$@"); fi
args=()
for b in "${BINS[@]}"; do args+=(--test "$b"); done

# One test thread. pisa gives each context it opens on the GL backend an instance (and EGL
# context) of its own (wgpu-hal's GL backend shares one EGL context among the devices of an
# instance, and two threads using it at once panic inside wgpu-hal); but the tests also share
# one context between threads, and wgpu-hal holds a GL device's context lock while it waits for
# the GPU: another thread using the same device gives up after a second and panics ("Could not
# lock adapter context", wgpu-hal 30 gles/device.rs), which llvmpipe's slow kernels reach.
cargo test -p pisa-wgpu --locked "${args[@]}" -- --test-threads=1
