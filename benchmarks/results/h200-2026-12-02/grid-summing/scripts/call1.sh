# Call 1 (thirteenth session, cubins .cubins_16): the backward by kernel time, XLA's sum
# against the summing variant on clusters, at 8-16384 rows; then every norm GPU test
# with the summing variant at any number of row blocks (the unbounded.py plugin).
export CACHE=.cubins_16
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res1
D=benchmarks/results/h200-2026-12-02/grid-summing/scripts
timeout 170 ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file res1/ncu.csv \
    python3 $D/exp_grid_summing.py run res1 > res1/exp.log 2>&1
stamp "exp rc=$?"
pkill -9 -f exp_grid_summing.py
settle
python3 $D/exp_grid_summing.py report res1 > res1/report.txt 2>&1
export PYTHONPATH=$PYTHONPATH:$PWD/$D
P="-m gpu -q -rs -p no:cacheprovider -p unbounded"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 170 python3 -m pytest $P -n 2 tests/test_norm.py \
    -k "not test_forward_backward and not test_persistent_grid" > res1/norm_rest.log 2>&1
stamp "rest rc=$?"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.28 timeout 110 python3 -m pytest $P -n 3 tests/test_norm.py \
    -k "test_forward_backward and not 16384-" > res1/norm_fb.log 2>&1
stamp "fb rc=$?"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout $(( $(left 585) - 5 )) python3 -m pytest $P \
    tests/test_norm.py -k "test_forward_backward and 16384-" > res1/norm_fb16384.log 2>&1
stamp "fb16384 rc=$?"
for f in res1/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res1/times.txt
tar czf $OUT/res1.tgz res1
