# Call 3 (sixteenth session, cubins .cubins_17, no kernel changed), on the change (the
# backward's reference with rstd outside its row sum; the fwd+bwd pair on XLA by
# norm_pair_on_xla): scripts/exp_norm_pair.py (one process, three samples); the norms'
# GPU tests beside the small suites that lower by shape; `bench --latency` for both
# norms; the norm fwd+bwd tests (the 16384-row cases last, with the time left).
export CACHE=.cubins_17
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res3
timeout 90 python3 benchmarks/results/h200-2026-12-03/recompute/scripts/exp_norm_pair.py \
    res3 3 > res3/exp.log 2>&1
stamp "exp rc=$?"
settle
P="-m gpu -q -rs -p no:cacheprovider"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 200 python3 -m pytest $P -n 2 tests/test_norm.py \
    -k "not test_forward_backward" > res3/norm_rest.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 200 python3 -m pytest $P tests/test_fuzz.py \
    tests/test_export.py tests/test_registry.py tests/test_lowering_path.py tests/test_bench.py \
    tests/test_sharding.py > res3/misc.log 2>&1 &
wait
stamp "rest and misc"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.28 timeout 120 python3 -m pytest $P -n 3 tests/test_norm.py \
    -k "test_forward_backward and not 16384-" > res3/norm_fb.log 2>&1
stamp "fb rc=$?"
settle
for op in rms_norm layer_norm; do
    timeout 150 python3 -m quack_jax.bench --latency --ops $op --out res3/latency > res3/latency_$op.log 2>&1
    stamp "latency $op rc=$?"
    settle
done
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout $(( $(left 585) - 5 )) python3 -m pytest $P \
    tests/test_norm.py -k "test_forward_backward and 16384-" > res3/norm_fb16384.log 2>&1
stamp "fb16384 rc=$?"
ls /tmp/keep/$CACHE | wc -l >> res3/gpu.txt
for f in res3/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res3/times.txt
tar czf $OUT/res3.tgz res3
