# Call 2 (thirteenth session, cubins .cubins_16): the final rule (norm.SUM_MAX_BLOCKS as
# committed): every norm GPU test beside the small suites that take norms at few rows;
# then bench --latency for both norms.
export CACHE=.cubins_16
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res2
P="-m gpu -q -rs -p no:cacheprovider"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 200 python3 -m pytest $P -n 2 tests/test_norm.py \
    -k "not test_forward_backward" > res2/norm_rest.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 200 python3 -m pytest $P tests/test_fuzz.py \
    tests/test_export.py tests/test_registry.py tests/test_lowering_path.py tests/test_bench.py \
    tests/test_sharding.py > res2/misc.log 2>&1 &
wait
stamp "rest and misc"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.28 timeout 100 python3 -m pytest $P -n 3 tests/test_norm.py \
    -k "test_forward_backward and not 16384-" > res2/norm_fb.log 2>&1
stamp "fb rc=$?"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 130 python3 -m pytest $P \
    tests/test_norm.py -k "test_forward_backward and 16384-" > res2/norm_fb16384.log 2>&1
stamp "fb16384 rc=$?"
settle
for op in rms_norm layer_norm; do
    timeout $(( $(left 590) - 3 )) python3 -m quack_jax.bench --latency --ops $op \
        --out res2/latency > res2/latency_$op.log 2>&1
    stamp "latency $op rc=$?"
done
for f in res2/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res2/times.txt
tar czf $OUT/res2.tgz res2
