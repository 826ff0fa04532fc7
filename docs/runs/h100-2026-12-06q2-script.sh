#!/usr/bin/env bash
# Clocks during the decode benchmark and during a prefill benchmark.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R
xz -dc .bin/pn.xz > /tmp/pn; chmod +x /tmp/pn
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader -lms 20 > $R/clocks-decode.txt 2>&1 & S=$!
sleep 1; date +%T.%N > $R/marks.txt
/tmp/pn bench --storages f16 --sizes= --decode-sizes 64k,1m --backward-max 0 --reps 5 --budget-s 2 > $R/bench-decode.txt 2>&1
date +%T.%N >> $R/marks.txt; sleep 1; kill $S
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader -lms 20 > $R/clocks-prefill.txt 2>&1 & S=$!
sleep 1; date +%T.%N >> $R/marks.txt
/tmp/pn bench --storages f16 --sizes 64k --dense-max 1k --backward-max 0 --decode-sizes= --reps 3 --budget-s 1 > $R/bench-prefill.txt 2>&1
date +%T.%N >> $R/marks.txt; sleep 1; kill $S
cd $OUT && tar czf r.tgz r && rm -rf r
