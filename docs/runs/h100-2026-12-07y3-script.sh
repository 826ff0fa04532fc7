#!/usr/bin/env bash
# Is the decode step's slowness at 128K / 256K after smaller caches repeatable, transient, or
# the GPU's clock? seq1 twice; with a 4 s budget per size; with a CUDA process holding the clock.
cd "$(dirname "$0")/.." ; R=$OUT/r; mkdir -p $R; S=$(date +%s)
xz -dc .bin/pn.xz > /tmp/pn; chmod +x /tmp/pn
nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu,memory.used --format=csv -lms 50 > $R/clocks.txt 2>&1 &
SM=$!
mark() { echo "$(date +%Y/%m/%d\ %H:%M:%S.%3N) $1 t=$(( $(date +%s) - S ))" >> $R/marks.txt; }
B="bench --storages f16 --sizes= --backward-max 0 --reps 5"
Z=1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m
for c in "s1 1" "s2 1" "s3 4"; do set -- $c; mark "$1 start"; timeout 150 /tmp/pn $B --budget-s $2 --decode-sizes $Z > $R/$1.txt 2>&1; mark "$1 end rc=$?"; done
python3 -c "
import torch,time
t=time.time()
while time.time()-t<60:
    torch.cuda._sleep(2000000); torch.cuda.synchronize()
" > $R/holder.txt 2>&1 &
HP=$!; sleep 3
mark "h start"; timeout 100 /tmp/pn $B --budget-s 1 --decode-sizes $Z > $R/h.txt 2>&1; mark "h end rc=$?"
kill $HP; sleep 1
mark "s4 start"; timeout 100 /tmp/pn $B --budget-s 1 --decode-sizes $Z > $R/s4.txt 2>&1; mark "s4 end rc=$?"
kill $SM
cd $OUT && tar czf r.tgz r && rm -rf r
