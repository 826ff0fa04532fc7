#!/usr/bin/env bash
# One benchmark run on the H200 (see docs/benchmarks.md): Vulkan loader from .gl/, the release
# `pisa` binary and test binaries from .bin/, results under $OUT.
#   MODE=check  : pisa info + GPU correctness tests (.bin/tests.tar.xz: release test binaries)
#   MODE=bench  : pisa bench (+ PyTorch peers when PEERS=1)
#   MODE=all    : both (default)
#   MODE=ab     : .bin/pisa-base (a build of an earlier commit) and .bin/pisa interleaved,
#                 AB_ROUNDS times (3), each `pisa bench ${AB_ARGS}` (default: prefill 256K and
#                 decode at 1M, f16), into $OUT/ab-<base|head>-<round>.{txt,json}: the same
#                 GPU state for both builds, for before/after comparisons
# More than 8 result files are packed into one archive, $OUT/res.tgz (PACK=0: left as they are).
# With MODE=bench or all, pisa bench dumps its pipelines' WGSL (PISA_DUMP_WGSL) and, when
# .bin/test-shader_stats is there, the driver's registers / local / shared memory of each go
# to $OUT/shader-stats.txt (tests/shader_stats.rs).
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
[ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
export XDG_RUNTIME_DIR=/tmp
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# Binaries may come xz-compressed (to keep the files moved to the GPU host small): unpack them.
for f in .bin/*.xz; do case "$f" in *.tar.xz) ;; *) [ -e "$f" ] && xz -d -f "$f" ;; esac; done
chmod +x .bin/pisa* 2>/dev/null
[ -f .bin/tests.tar.xz ] && tar xJf .bin/tests.tar.xz -C .bin
./.bin/pisa info | tee "$OUT/info.txt"
MODE=${MODE:-all}
if [ "$MODE" = check ] || [ "$MODE" = all ]; then
  for t in .bin/test-*; do
    echo "== $t"; PISA_REQUIRE_NV_CM2=${PISA_REQUIRE_NV_CM2:-1} timeout 120 "$t" --test-threads 4 2>&1 | grep -v "^test .* ok$" | tail -25
  done | tee "$OUT/check.txt"
fi
if [ "$MODE" = ab ]; then
  AB_ARGS=${AB_ARGS:---storages f16 --sizes 256k --dense-max 1k --backward-max 0 --decode-sizes 1m --reps 3 --budget-s 2}
  for i in $(seq "${AB_ROUNDS:-3}"); do
    for b in base head; do
      bin=.bin/pisa; [ "$b" = base ] && bin=.bin/pisa-base
      timeout 200 "$bin" bench $AB_ARGS --json "$OUT/ab-$b-$i.json" > "$OUT/ab-$b-$i.txt" 2>&1
    done
  done
fi
if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  PISA_DUMP_WGSL=/tmp/pisa-wgsl ./.bin/pisa bench ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
  if [ -x .bin/test-shader_stats ]; then
    PISA_WGSL_DIR=/tmp/pisa-wgsl timeout 120 .bin/test-shader_stats --ignored --nocapture \
      > "$OUT/shader-stats.txt" 2>&1
  fi
  if [ "${PEERS:-0}" = 1 ]; then
    python3 benches/peers/torch_peers.py --out "$OUT/peers.json" ${PEER_ARGS:-} 2>&1 \
      | grep -v -E "^(USDT|STAGE|WARNING:2|ERROR:2)" | tee "$OUT/peers.txt"
  fi
fi
# Past 8 result files, everything under $OUT goes into one archive
# ($OUT/res.tgz), for transfers that take few files; the files themselves are removed.
if [ "${PACK:-1}" = 1 ] && [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/h200-res.tgz --exclude=res.tgz . && find . -maxdepth 1 -type f -delete \
    && mv /tmp/h200-res.tgz res.tgz)
fi
