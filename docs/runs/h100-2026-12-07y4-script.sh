#!/usr/bin/env bash
# The decode sizes 1K..1M in one process with --warmup-ms 0 / 5 / 1 / 20 (and 0 again), then
# short prompts and 64K prefill with 0 / 5, alternated.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s)
xz -dc .bin/pn.xz > /tmp/pn; chmod +x /tmp/pn
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
mark() { echo "$(date +%H:%M:%S.%3N) $1 t=$(( $(date +%s) - S ))" >> $R/marks.txt; }
B="bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1"
Z=1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m
for w in 0 5 1 20 0 5; do mark "w$w start"; timeout 120 /tmp/pn $B --decode-sizes $Z --warmup-ms $w --json $R/dec-w$w-$(date +%s).json > $R/dec-w$w-$(date +%s).txt 2>&1; mark "w$w end rc=$?"; done
for w in 0 5 0 5; do mark "p$w start"; timeout 60 /tmp/pn bench --storages f16 --sizes 512,1k,2k,4k,8k,64k --dense-max 8k --backward-max 0 --decode-sizes= --reps 5 --budget-s 1 --warmup-ms $w > $R/pre-w$w-$(date +%s).txt 2>&1; mark "p$w end rc=$?"; done
cd $OUT && tar czf r.tgz r && rm -rf r
