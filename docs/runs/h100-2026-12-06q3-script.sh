#!/usr/bin/env bash
# Clocks during long decode loops, without and with a background heater of tiny CUDA kernels.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R
xz -dc .bin/pn.xz > /tmp/pn; chmod +x /tmp/pn
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu --format=csv,noheader -lms 20 > $R/clocks.txt 2>&1 & S=$!
run() { date +%T.%N > $R/mark-$1.txt; /tmp/pn bench --storages f16 --sizes= --decode-sizes 64k,1m --backward-max 0 --reps 5 --budget-s 4 > $R/dec-$1.txt 2>&1; date +%T.%N >> $R/mark-$1.txt; }
run a
cat > /tmp/heat.py <<'PY'
import torch, time
x = torch.zeros(1, device='cuda'); t = time.time()
while time.time() - t < float(__import__('sys').argv[1]):
    x.add_(1); torch.cuda.synchronize()
PY
python3 /tmp/heat.py 40 & H=$!; sleep 3
run h
kill $H 2>/dev/null; wait $H 2>/dev/null; sleep 2
run b
kill $S
cd $OUT && tar czf r.tgz r && rm -rf r
