#!/usr/bin/env bash
# The decode step's time against the caches built before it, with the GPU's clocks and P-state
# sampled every 20 ms (the 128K / 256K slowness of run y1).
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s)
xz -dc .bin/pn.xz > /tmp/pn; chmod +x /tmp/pn
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu,utilization.memory,memory.used,clocks_throttle_reasons.active --format=csv -lms 20 > $R/clocks.txt 2>&1 &
SM=$!
mark() { echo "$(date +%Y/%m/%d\ %H:%M:%S.%3N) $1 t=$(( $(date +%s) - S ))" >> $R/marks.txt; }
B="bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1"
for c in "seq1 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m" "a 256k" "b 128k,256k" "c 1m,256k,64k" "d 64k,256k,64k,256k" "seq2 16k,32k,64k,128k,256k,512k,1m"; do
  set -- $c; mark "$1 start"; timeout 100 /tmp/pn $B --decode-sizes $2 > $R/$1.txt 2>&1; mark "$1 end rc=$?"
done
kill $SM; nvidia-smi -q -d PERFORMANCE,CLOCK > $R/perf.txt 2>&1
cd $OUT && tar czf r.tgz r && rm -rf r
