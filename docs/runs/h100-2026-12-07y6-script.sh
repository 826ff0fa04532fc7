#!/usr/bin/env bash
# The two settings A.76 left out, PISA_NV_CM2=0 (the WGSL kernels on KHR cooperative matrices)
# and PISA_KERNEL_PATH=portable (no tensor cores): the GPU tests of the carried binaries under
# each, then pisa bench of the KHR path's dense attention against llama.cpp's cm1 (16K, 64K).
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
mkdir -p /tmp/tb; for f in .bin/t_*.xz .bin/pn.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/tb/$n; chmod +x /tmp/tb/$n; done
i=0
for cfg in PISA_NV_CM2=0 PISA_KERNEL_PATH=portable; do
  i=$((i+1)); echo "== $i: $cfg" >> $R/summary.txt
  for t in $(ls .bin/t_*.xz | sed 's#.bin/t_##; s#.xz##'); do
    env $cfg timeout 120 /tmp/tb/t_$t --test-threads 1 > $R/c$i-test-$t.txt 2>&1
    echo "  test $t rc=$? $(grep 'test result' $R/c$i-test-$t.txt | tail -1 | cut -d. -f2) $(T)" >> $R/summary.txt
  done
done
timeout 150 /tmp/tb/pn bench --storages f16 --sizes 16k,64k --dense-max 64k --backward-max 0 --decode-sizes= --reps 3 --budget-s 2 --tune nv_cm2=0 --json $R/khr.json > $R/khr-bench.txt 2>&1
echo "khr bench rc=$? $(T)" >> $R/summary.txt
cat $R/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
