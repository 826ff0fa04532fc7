for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
P=target/release/pisa
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
$P info 2>&1 | head -8
S="--sizes 2k --decode-sizes 64k --hq 8 --hkv 2 --storages f16 --backward-max 0 --reps 5 --budget-s 1"
$P bench $S --json $OUT/def.json > $OUT/def.txt 2>&1; echo rc=$?
$P bench $S --warmup-ms 0 --json $OUT/w0.json > $OUT/w0.txt 2>&1; echo rc=$?
head -1 $OUT/def.txt; head -1 $OUT/w0.txt
$P bench --compare $OUT/w0.json $OUT/def.json
python3 -c "import json;[print(f, json.load(open('$OUT/'+f))['params'].get('warmup_ms')) for f in ['def.json','w0.json']]"
# actual warm-up length: wall time of many submissions
T="--sizes 1k --decode-sizes= --hq 8 --hkv 2 --storages f16 --backward-max 0 --dense-max 0 --reps 200 --budget-s 1000"
for w in 0 20 100 0.0001; do s=$(date +%s.%N); $P bench $T --warmup-ms $w > $OUT/t$w.txt 2>&1; e=$(date +%s.%N); echo "warmup $w wall $(echo "$e - $s" | bc) $(grep -o 'GPU warm-up [0-9.]* ms' $OUT/t$w.txt)"; done
s=$(date +%s.%N); $P bench --sizes 1k --decode-sizes= --hq 8 --hkv 2 --storages f16 --backward-max 0 --dense-max 0 --reps 3 --warmup-ms 1000 > $OUT/t1000.txt 2>&1; e=$(date +%s.%N); echo "warmup 1000 reps3 wall $(echo "$e - $s" | bc) $(grep -o 'GPU warm-up [0-9.]* ms' $OUT/t1000.txt)"
