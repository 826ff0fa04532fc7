#!/usr/bin/env bash
# GPU tests of every carried test binary (reliability_soak last), then its ignored 100,000-step soak.
cd "$(dirname "$0")/.." ; S=$(date +%s)
L=$(ls .bin/t_*.xz | sed 's#.bin/t_##; s#.xz##' | grep -v reliability_soak)
bash .bin/p7.sh $L reliability_soak
R=$OUT/r; T0=$(date +%s)
timeout 200 /tmp/tb/t_reliability_soak --ignored soak_100k_steps --nocapture --test-threads 1 > $R/test-t_reliability_soak-100k.txt 2>&1
echo "soak 100k rc=$? secs=$(( $(date +%s) - T0 )) $(grep 'test result' $R/test-t_reliability_soak-100k.txt | tail -1)" >> $R/summary.txt
tail -3 $R/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
