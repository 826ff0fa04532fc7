#!/usr/bin/env bash
# A/B of the decode step: pa (HEAD's build) against pn (the candidate), three interleaved
# rounds at 1K, 8K, 64K, 1M; then the candidate's release decode test binary (t_decode) with
# PISA_REQUIRE_NV_CM2=1.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
export PISA_REQUIRE_NV_CM2=1
mkdir -p /tmp/tb; for f in .bin/*.xz; do xz -dc $f > /tmp/tb/$(basename $f .xz); chmod +x /tmp/tb/$(basename $f .xz); done
for r in 1 2 3; do for b in pa pn; do timeout 40 /tmp/tb/$b bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1 --decode-sizes 1k,8k,64k,1m > $R/ab-$b-r$r.txt 2>&1; echo "ab $b r$r rc=$? $(T)" >> $R/summary.txt; done; done
for t in /tmp/tb/t_*; do n=$(basename $t); timeout 150 $t --test-threads 1 > $R/test-$n.txt 2>&1; echo "test $n rc=$? $(grep 'test result' $R/test-$n.txt | tail -1) $(T)" >> $R/summary.txt; done
cat $R/summary.txt; grep -hE "FAILED|panicked" $R/test-*.txt 2>/dev/null | head -20
for b in pa pn; do echo "== $b"; grep -hE "^ +(1024|8192|65536|1048576) " $R/ab-$b-r*.txt | awk '{print $1, $2, $5}'; done
cd $OUT && tar czf r.tgz r && rm -rf r
