#!/usr/bin/env bash
# The full run with the peers (no tests) on any GPU, then the GPU tests of the carried binaries in the time left.
cd "$(dirname "$0")/.." ; S=$(date +%s)
NOTESTS=1 FULL=1 bash .bin/p2.sh
mv $OUT/r.tgz $OUT/timing.tgz 2>/dev/null
L=$(( 560 - ($(date +%s) - S) )); [ $L -gt 30 ] && timeout $L bash .bin/p7.sh $(ls .bin/t_*.xz | sed 's#.bin/t_##; s#.xz##')
cd $OUT && tar czf tests.tgz r 2>/dev/null && rm -rf r; ls -la $OUT
