# Call 5, the summing step as a kernel variant of its own (.cubins_13): the norm GPU tests
# but the 16384-row cases (those take only the other variant, whose cubins are main's,
# byte for byte); the backward at few rows, XLA's sum against the rule; then bench
# --latency for RMSNorm if time is left.
export CACHE=.cubins_13
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res5
P="-m gpu -q -rs -p no:cacheprovider"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 150 python3 -m pytest $P -n 2 tests/test_norm.py \
    -k "not test_forward_backward" > res5/norm_rest.log 2>&1
stamp "rest rc=$?"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.28 timeout 120 python3 -m pytest $P -n 3 tests/test_norm.py \
    -k "test_forward_backward and not 16384-" > res5/norm_fb.log 2>&1
stamp "fb rc=$?"
settle
S=benchmarks/results/h200-2026-12-02/sum-cluster/scripts/exp_sum_cluster.py
timeout 80 ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file res5/ncu.csv \
    python3 $S run res5 rule > res5/exp.log 2>&1
stamp "exp rc=$?"
settle
python3 $S report res5 > res5/report.txt 2>&1
if [ $(left 580) -gt 70 ]; then
    timeout $(( $(left 580) - 5 )) python3 -m quack_jax.bench --latency --ops rms_norm \
        --out res5/latency > res5/latency_rms_norm.log 2>&1
    stamp "latency rms_norm rc=$?"
fi
tail -1 res5/norm_*.log; cat res5/times.txt
tar czf $OUT/res5.tgz res5
