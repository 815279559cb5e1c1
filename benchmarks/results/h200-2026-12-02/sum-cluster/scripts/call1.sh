# Call 1: the new tests of the summing cluster on the GPU; the backward's grids at few
# rows by kernel time (one ncu process); then bench --latency for the norms.
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res1
P="-m gpu -q -rs -p no:cacheprovider"
timeout 150 python3 -m pytest $P tests/test_norm.py -k "summed_in_one_cluster or persistent_grid" \
    > res1/tests.log 2>&1
stamp "tests rc=$?"
settle
S=benchmarks/results/h200-2026-12-02/sum-cluster/scripts/exp_sum_cluster.py
timeout 330 ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file res1/ncu.csv \
    python3 $S run res1 > res1/exp.log 2>&1
stamp "exp rc=$?"
settle
python3 $S report res1 > res1/report.txt 2>&1
for op in rms_norm layer_norm; do
    [ $(left 570) -gt 80 ] || break
    timeout $(( $(left 570) - 10 )) python3 -m quack_jax.bench --latency --ops $op \
        --out res1/latency > res1/latency_$op.log 2>&1
    stamp "latency $op rc=$?"
    settle
done
tail -3 res1/tests.log; cat res1/report.txt res1/times.txt; tail -3 res1/exp.log
tar czf $OUT/res1.tgz res1
