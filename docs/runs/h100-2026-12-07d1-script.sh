#!/usr/bin/env bash
# pc = the CLI of 9913fcc (kernels of b66edc2). At a 1M cache: the driver's registers and spills
# of route_leaf_merge as it is, with decode_leaf_prefetch=0 (nopf), and with the knock-outs of
# its block attention (ko.py: k1 no P.V, k2 no softmax work, k3 no score work, k4 none; timing
# only) through Tuning::shader_override; then the step at 1K and 1M for each, two interleaved
# rounds. Then, on an H200 (or FULL=1), the full run with the peers.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
mkdir -p /tmp/tb; for f in .bin/*.xz; do xz -dc $f > /tmp/tb/$(basename $f .xz); chmod +x /tmp/tb/$(basename $f .xz); done
P=/tmp/tb/pc; B="bench --storages f16 --sizes= --backward-max 0"
timeout 60 $P $B --reps 1 --budget-s 0.2 --decode-sizes 1m --tune dump_wgsl=/tmp/wg_base > $R/dump-base.txt 2>&1
timeout 60 $P $B --reps 1 --budget-s 0.2 --decode-sizes 1m --tune decode_leaf_prefetch=0 --tune dump_wgsl=/tmp/wg_nopf > $R/dump-nopf.txt 2>&1
python3 .bin/ko.py /tmp/wg_base /tmp/ov > $R/ko-py.txt 2>&1; echo "dumps, ko.py rc=$? $(T)" >> $R/summary.txt
for v in base nopf k1 k2 k3 k4; do d=/tmp/wg_$v; [ -d /tmp/ov/$v ] && d=/tmp/ov/$v; PISA_WGSL_DIR=$d timeout 60 /tmp/tb/t_shader_stats --ignored --nocapture --exact shader_stats > $R/stats-$v.txt 2>&1; echo "stats $v rc=$? $(T)" >> $R/summary.txt; done
grep -h "route_leaf_merge" $R/stats-*.txt | cut -c1-300 >> $R/summary.txt
A() { case $1 in nopf) echo "--tune decode_leaf_prefetch=0";; base) ;; *) echo "--tune shader_override=/tmp/ov/$1";; esac; }
for r in 1 2; do for v in base nopf k1 k2 k3 k4; do timeout 40 $P $B --reps 5 --budget-s 1 --decode-sizes ${DS:-1k,1m} $(A $v) > $R/ko-$v-r$r.txt 2>&1; echo "ko $v r$r rc=$? $(T)" >> $R/summary.txt; done; done
for v in base nopf k1 k2 k3 k4; do echo "== $v" >> $R/summary.txt; grep -hE "^ +(1024|1048576) " $R/ko-$v-r*.txt | awk '{print $1, $2, $5, $8, $10}' >> $R/summary.txt; done
if [ -z "$NOFULL" ] && { grep -q H200 $R/gpu.txt || [ -n "$FULL" ]; }; then
S0=$(date +%s); timeout 150 $P bench --storages f16 --sizes 64k,128k,256k --dense-max 64k --backward-max 0 --decode-sizes 1m --reps 3 --budget-s 2 --json $R/bench.json > $R/bench-main.txt 2>&1; echo "main rc=$? secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
S0=$(date +%s); timeout 120 python3 benches/peers/torch_peers.py --sizes 65536,131072,262144 --decode-sizes 1048576 --backends default --budget-s 1 --backward-max 0 --out $R/peers.json > $R/peers.txt 2>&1; echo "torch rc=$? secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
S0=$(date +%s); ( cd .peers/nsa-triton && timeout 80 python3 bench_nsa.py --sizes 65536,131072 --sections a,b --min-reps 5 --max-reps 10 --target-s 0.5 > $R/nsa.txt 2>&1; timeout 60 python3 bench_nsa.py --sizes 262144 --sections a --min-reps 3 --max-reps 5 --target-s 0.5 > $R/nsa256.txt 2>&1 ); echo "nsa secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
timeout 60 $P bench --storages f16 --sizes 16k --dense-max 16k --backward-max 0 --decode-sizes= --reps 3 --budget-s 2 --json $R/bench16k.json > $R/bench-16k.txt 2>&1; echo "16k rc=$? $(T)" >> $R/summary.txt
S0=$(date +%s); OUT=$R PEERS_BUDGET_S=${PB:-100} timeout 160 bash .peers/ggml-vulkan/run.sh > $R/ggml-log.txt 2>&1; echo "ggml rc=$? secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
fi
echo "total $(T)" >> $R/summary.txt; cat $R/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
