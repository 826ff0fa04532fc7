#!/usr/bin/env bash
# If the GPU is an H200: the full run with the peers first. Then the decode step against the
# number of routed levels (caches of 1K to 1M tokens), then the GPU tests of the carried binaries.
cd "$(dirname "$0")/.." ; S=$(date +%s)
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "gpu: $G"
if echo "$G" | grep -q H200; then NOTESTS=1 FULL=1 bash .bin/p2.sh; mv $OUT/r.tgz $OUT/timing.tgz 2>/dev/null; fi
mkdir -p $OUT/r /tmp/tb; xz -dc .bin/pn.xz > /tmp/tb/pn; chmod +x /tmp/tb/pn
T0=$(date +%s); timeout 120 /tmp/tb/pn bench --storages f16 --sizes= --decode-sizes 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m --backward-max 0 --reps 5 --budget-s 1 --json $OUT/r/levels.json > $OUT/r/levels.txt 2>&1
echo "levels rc=$? secs=$(( $(date +%s) - T0 ))" >> $OUT/r/summary.txt
L=$(( ${BUDGET:-560} - ($(date +%s) - S) )); [ $L -gt 30 ] && timeout $L bash .bin/p7.sh $(ls .bin/t_*.xz | sed 's#.bin/t_##; s#.xz##')
cd $OUT && tar czf tests.tgz r 2>/dev/null && rm -rf r; ls -la $OUT
