#!/usr/bin/env bash
# The decode step, the build before (pa, c69665d) against the build with the merge's (m, l) kept
# from the scores' load (pn, fa0a896+), one dispatch (m1) and two (m0), three interleaved rounds;
# the decode step against the cache size (1K to 1M, pn); then the release test binaries at their
# defaults (the one-dispatch decode step on this GPU) and the 100k-step soak.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
export PISA_REQUIRE_NV_CM2=1
mkdir -p /tmp/tb; for f in .bin/t_*.xz .bin/pn.xz .bin/pa.xz; do xz -dc $f > /tmp/tb/$(basename $f .xz); chmod +x /tmp/tb/$(basename $f .xz); done; P=/tmp/tb/pn
for r in 1 2 3; do for b in pa pn; do for m in 1 0; do timeout 40 /tmp/tb/$b bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1 --decode-sizes 1k,8k,64k,1m --tune decode_merge_in_route=$m > $R/ab-$b-m$m-r$r.txt 2>&1; echo "ab $b m$m r$r rc=$? $(T)" >> $R/summary.txt; done; done; done
timeout 40 $P bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1 --decode-sizes 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m --json $R/levels.json > $R/levels.txt 2>&1; echo "levels rc=$? $(T)" >> $R/summary.txt
for t in /tmp/tb/t_*; do n=$(basename $t); timeout 150 $t --test-threads 1 > $R/test-$n.txt 2>&1; echo "test $n rc=$? $(grep 'test result' $R/test-$n.txt | tail -1) $(T)" >> $R/summary.txt; done
timeout 60 /tmp/tb/t_reliability_soak --ignored soak_100k_steps --nocapture --test-threads 1 > $R/soak100k.txt 2>&1; echo "soak rc=$? $(grep 'test result' $R/soak100k.txt|tail -1) $(T)" >> $R/summary.txt
cat $R/summary.txt; grep -hE "FAILED|panicked" $R/test-*.txt | head -20
cd $OUT && tar czf r.tgz r && rm -rf r
