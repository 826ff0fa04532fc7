#!/usr/bin/env bash
# Stage "t": the release test binaries of HEAD (PISA_REQUIRE_NV_CM2=1), the 100k-step decode
# soak, the decode step at 1K..1M. Stage "f": the full run with the peers (p2.sh FULL=1).
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
export PISA_REQUIRE_NV_CM2=1
mkdir -p /tmp/tb; for f in .bin/t_*.xz .bin/pn.xz; do xz -dc $f > /tmp/tb/$(basename $f .xz); chmod +x /tmp/tb/$(basename $f .xz); done; P=/tmp/tb/pn
if [[ "$1" == *l* ]]; then
for r in 1 2; do timeout 40 $P bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1 --decode-sizes 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m --json $R/levels-$r.json > $R/levels-$r.txt 2>&1; echo "levels $r rc=$? $(T)" >> $R/summary.txt; done
fi
if [[ "$1" == *t* ]]; then
for t in /tmp/tb/t_*; do n=$(basename $t); timeout 200 $t --test-threads 1 > $R/test-$n.txt 2>&1; echo "test $n rc=$? $(grep 'test result' $R/test-$n.txt | tail -1) $(T)" >> $R/summary.txt; done
timeout 60 /tmp/tb/t_reliability_soak --ignored soak_100k_steps --nocapture --test-threads 1 > $R/soak100k.txt 2>&1; echo "soak rc=$? $(grep 'test result' $R/soak100k.txt|tail -1) $(T)" >> $R/summary.txt
fi
cat $R/summary.txt; grep -hE "FAILED|panicked" $R/test-*.txt 2>/dev/null | head -20
cd $OUT && tar czf r.tgz r && rm -rf r
