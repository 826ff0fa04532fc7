#!/usr/bin/env bash
# The full run with the peers (no tests), then the decode sizes 1K..1M in one process (default warm-up).
cd "$(dirname "$0")/.." ; S=$(date +%s)
NOTESTS=1 FULL=1 bash .bin/p2.sh
mv $OUT/r.tgz $OUT/timing.tgz 2>/dev/null
mkdir -p $OUT/r; timeout 100 /tmp/tb/pn bench --storages f16 --sizes= --backward-max 0 --reps 5 --budget-s 1 --decode-sizes 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m --json $OUT/r/levels.json > $OUT/r/levels.txt 2>&1
echo "levels rc=$? total t=$(( $(date +%s) - S ))" >> $OUT/r/summary.txt
cd $OUT && tar czf levels.tgz r && rm -rf r; ls -la $OUT
