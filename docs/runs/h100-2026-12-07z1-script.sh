#!/usr/bin/env bash
# GPU tests of the decode binaries (route_leaf_merge by default on this GPU), the 100k soak, then
# the decode step with decode_merge_in_route on and off, two interleaved rounds.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
export PISA_REQUIRE_NV_CM2=1 PISA_DECODE_MERGE_IN_ROUTE=1
mkdir -p /tmp/tb; for f in .bin/t_*.xz .bin/pn.xz; do xz -dc $f > /tmp/tb/$(basename $f .xz); chmod +x /tmp/tb/$(basename $f .xz); done; P=/tmp/tb/pn
for n in decode reliability_soak; do timeout 200 /tmp/tb/t_$n --test-threads 1 > $R/test-t_$n.txt 2>&1; echo "test t_$n rc=$? $(grep 'test result' $R/test-t_$n.txt | tail -1) $(T)" >> $R/summary.txt; done
timeout 100 /tmp/tb/t_reliability_soak --ignored soak_100k_steps --nocapture --test-threads 1 > $R/soak100k.txt 2>&1; echo "soak rc=$? $(grep 'test result' $R/soak100k.txt|tail -1) $(T)" >> $R/summary.txt
for r in 1 2; do for m in 1 0 1s; do X="--tune decode_merge_in_route=${m%s}"; [ $m = 1s ] && X="$X --tune decode_leaf_subgroups=1"; timeout 90 $P bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1 --decode-sizes 1k,8k,64k,1m $X > $R/dec-m$m-r$r.txt 2>&1; echo "dec m$m r$r rc=$? $(T)" >> $R/summary.txt; done; done
cat $R/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
