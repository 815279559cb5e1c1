# Call 3 (thirteenth session, cubins .cubins_16; ncu had crashed at the start of the
# experiment in calls 1 and 2): bench --latency for both norms with SUM_MAX_BLOCKS = 1024,
# then the summing test, fixed to check the lowering only where the row blocks are exact.
export CACHE=.cubins_16
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res3
for op in rms_norm layer_norm; do
    timeout 150 python3 -m quack_jax.bench --latency --ops $op --out res3/latency > res3/latency_$op.log 2>&1
    stamp "latency $op rc=$?"
done
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout $(( $(left 420) - 3 )) python3 -m pytest -m gpu -q -rs \
    -p no:cacheprovider tests/test_norm.py -k summed_in_the_kernel > res3/summed.log 2>&1
stamp "summed rc=$?"
for f in res3/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res3/times.txt
tar czf $OUT/res3.tgz res3
