#!/usr/bin/env bash
# The tuning knobs of the tensor-core and NVIDIA paths on the GPU: per setting (PISA_* variables),
# the leaf-major, scorer, prefill and coopmat selection tests, then pisa bench at 64K and 256K.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
mkdir -p /tmp/tb; for f in .bin/t_*.xz .bin/pn.xz; do n=$(basename $f .xz); xz -dc $f > /tmp/tb/$n; chmod +x /tmp/tb/$n; done
i=0
while read -r cfg; do
  i=$((i+1)); echo "== $i: ${cfg:-defaults}" >> $R/summary.txt
  for t in select_by_leaf attention_by_leaf prefill coopmat_select; do
    env $cfg timeout 120 /tmp/tb/t_$t --test-threads 1 > $R/c$i-test-$t.txt 2>&1
    echo "  test $t rc=$? $(grep 'test result' $R/c$i-test-$t.txt | tail -1 | cut -d. -f2) $(T)" >> $R/summary.txt
  done
  env $cfg timeout 90 /tmp/tb/pn bench --storages f16 --sizes 64k,256k --dense-max 1k --backward-max 0 --decode-sizes= --reps 3 --budget-s 1 > $R/c$i-bench.txt 2>&1
  echo "  bench rc=$? $(T)" >> $R/summary.txt
  [ $(date +%s) -gt $(( ${SWEEP_END:-$(( S + 470 ))} - 45 )) ] && { echo "stopped: time" >> $R/summary.txt; break; }
done <<'CFGS'

PISA_NV_SCORER=0
PISA_LEAF_PAIRS=0
PISA_ATTENTION_PAIRS=0
PISA_NV_SCORER=0 PISA_LEAF_NSG=2 PISA_LEAF_KSTAGE=0
PISA_LEAF_ORDER=tiles PISA_LEAF_LPI=4
PISA_NV_CM2=0
PISA_KERNEL_PATH=portable
CFGS
cat $R/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
