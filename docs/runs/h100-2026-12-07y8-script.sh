#!/usr/bin/env bash
# The first process on a freshly started GPU, with the run's first warm-up: a 2K prefill and a
# 64K decode (default warm-up), then the same without a warm-up, then with it again.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R
xz -dc .bin/pn.xz > /tmp/pn; chmod +x /tmp/pn
nvidia-smi --query-gpu=name,driver_version,pstate,clocks.sm --format=csv > $R/gpu.txt 2>&1
S="--sizes 2k --decode-sizes 64k --hq 8 --hkv 2 --storages f16 --backward-max 0 --reps 5 --budget-s 1"
i=0; for w in "" "--warmup-ms 0" ""; do i=$((i+1)); timeout 40 /tmp/pn bench $S $w --json $R/p$i.json > $R/p$i.txt 2>&1; echo "p$i ($w) rc=$? $(grep -E '^ +(2048|65536) ' $R/p$i.txt | awk '{print $1, $9, $10}' | tr '\n' ' ')" >> $R/summary.txt; done
cat $R/summary.txt; cd $OUT && tar czf r.tgz r && rm -rf r
