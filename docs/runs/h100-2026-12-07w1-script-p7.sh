#!/usr/bin/env bash
# GPU tests of the named release test binaries (.bin/t_NAME.xz).
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
export PISA_REQUIRE_NV_CM2=1
mkdir -p /tmp/tb; for n in "$@"; do xz -dc .bin/t_$n.xz > /tmp/tb/t_$n; chmod +x /tmp/tb/t_$n; timeout 200 /tmp/tb/t_$n --test-threads 1 > $R/test-t_$n.txt 2>&1; echo "test t_$n rc=$? $(grep 'test result' $R/test-t_$n.txt | tail -1) $(T)" >> $R/summary.txt; done
cat $R/summary.txt
