# Call 2, on the final rule (up to 16 CTAs, 2 row blocks a CTA): bench --latency for the
# norms and ncu over the same rows (quack_jax and XLA); then the norm GPU tests other
# than test_forward_backward (call 3 runs those).
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res2
for op in rms_norm layer_norm; do
    timeout 90 python3 -m quack_jax.bench --latency --ops $op --out res2/latency \
        > res2/latency_$op.log 2>&1
    stamp "latency $op rc=$?"
    settle
done
for op in rms_norm layer_norm; do
    NCU_SECONDS=110 ncu_one jax res2/latency $op
done
python3 benchmarks/profile_kernels.py report res2/latency > res2/ncu_report.txt 2>&1
P="-m gpu -q -rs -p no:cacheprovider"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout $(( $(left 575) - 5 )) python3 -m pytest $P -n 2 \
    tests/test_norm.py -k "not test_forward_backward" > res2/norm_rest.log 2>&1
stamp "tests rc=$?"
tail -2 res2/norm_*.log; cat res2/times.txt
tar czf $OUT/res2.tgz res2
