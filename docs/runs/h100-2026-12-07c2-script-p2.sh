#!/usr/bin/env bash
# Full run with the peers: tests first, then pisa bench, torch peers, NSA, 16k, short, d64, ggml.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s); T() { echo "t=$(( $(date +%s) - S ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
export PISA_REQUIRE_NV_CM2=1
mkdir -p /tmp/tb; for f in .bin/t_*.xz; do xz -dc $f > /tmp/tb/$(basename $f .xz); chmod +x /tmp/tb/$(basename $f .xz); done
xz -dc .bin/pn.xz > /tmp/tb/pn; chmod +x /tmp/tb/pn; P=/tmp/tb/pn
[ -n "$NOTESTS" ] || for t in /tmp/tb/t_*; do n=$(basename $t); timeout 200 $t --test-threads 1 > $R/test-$n.txt 2>&1; echo "test $n rc=$? $(grep 'test result' $R/test-$n.txt | tail -1) $(T)" >> $R/summary.txt; done
if [ -f .bin/px.xz ]; then xz -dc .bin/px.xz > /tmp/tb/px; chmod +x /tmp/tb/px; for r in 1 2; do for v in base xt_ko1 xt_ko2 xt_ko3; do SW=""; [ $v != base ] && SW="route_table_d128=.bin/v1/$v.spv"; PISA_EXP_NV_SWAP=$SW timeout 60 /tmp/tb/px bench --storages f16 --sizes 64k,256k --dense-max 1k --backward-max 0 --decode-sizes= --reps 3 --budget-s 1 > $R/x-$v-$r.txt 2>&1; echo "x $v $r rc=$? $(T)" >> $R/summary.txt; done; done; fi
if [ -z "$FULL" ]; then [ -n "$NOPRICE" ] || for n in 96 224 480 96 224 480; do timeout 60 $P bench --storages f16 --sizes 64k,256k --dense-max 1k --backward-max 0 --decode-sizes= --reps 3 --budget-s 1 --tune route_table_nodes=$n > $R/tbl-$n-$(date +%s).txt 2>&1; echo "tbl $n rc=$? $(T)" >> $R/summary.txt; done; cd $OUT && tar czf r.tgz r && rm -rf r; exit 0; fi
S0=$(date +%s); timeout 150 $P bench --storages f16 --sizes 64k,128k,256k --dense-max 64k --backward-max 0 --decode-sizes 1m --reps 3 --budget-s 2 --json $R/bench.json > $R/bench-main.txt 2>&1; echo "main rc=$? secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
S0=$(date +%s); timeout 120 python3 benches/peers/torch_peers.py --sizes 65536,131072,262144 --decode-sizes 1048576 --backends default --budget-s 1 --backward-max 0 --out $R/peers.json > $R/peers.txt 2>&1; echo "torch rc=$? secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
S0=$(date +%s); ( cd .peers/nsa-triton && timeout 80 python3 bench_nsa.py --sizes 65536,131072 --sections a,b --min-reps 5 --max-reps 10 --target-s 0.5 > $R/nsa.txt 2>&1; timeout 60 python3 bench_nsa.py --sizes 262144 --sections a --min-reps 3 --max-reps 5 --target-s 0.5 > $R/nsa256.txt 2>&1 ); echo "nsa secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
timeout 60 $P bench --storages f16 --sizes 16k --dense-max 16k --backward-max 0 --decode-sizes= --reps 3 --budget-s 2 --json $R/bench16k.json > $R/bench-16k.txt 2>&1; echo "16k rc=$? $(T)" >> $R/summary.txt
timeout 60 $P bench --storages f16 --sizes 512,1k,2k,4k,8k --dense-max 8k --backward-max 0 --decode-sizes= --reps 5 --budget-s 1 --json $R/short.json > $R/bench-short.txt 2>&1; echo "short rc=$? $(T)" >> $R/summary.txt
timeout 60 $P bench --d 64 --storages f16 --sizes 16k,64k,256k --dense-max 64k --backward-max 0 --decode-sizes= --reps 3 --budget-s 1 --json $R/d64.json > $R/bench-d64.txt 2>&1; echo "d64 rc=$? $(T)" >> $R/summary.txt
S0=$(date +%s); OUT=$R PEERS_BUDGET_S=${PB:-110} timeout 170 bash .peers/ggml-vulkan/run.sh > $R/ggml-log.txt 2>&1; echo "ggml rc=$? secs=$(( $(date +%s) - S0 )) $(T)" >> $R/summary.txt
echo "total $(T)" >> $R/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
