# Call 1 (fifteenth session, cubins .cubins_17: the build by row regimes): every norm GPU
# test beside the small suites that take norms at few rows (fuzz, export, registry,
# lowering path, bench, the one-GPU sharding cases); then the norm fwd+bwd tests, the
# 16384-row cases alone. The device has no CuTe-DSL: a kernel missing from the cache fails
# its test (MissingKernelError), so a pass also shows the build covered it.
export CACHE=.cubins_17
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res1
P="-m gpu -q -rs -p no:cacheprovider"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 220 python3 -m pytest $P -n 2 tests/test_norm.py \
    -k "not test_forward_backward" > res1/norm_rest.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 220 python3 -m pytest $P tests/test_fuzz.py \
    tests/test_export.py tests/test_registry.py tests/test_lowering_path.py tests/test_bench.py \
    tests/test_sharding.py > res1/misc.log 2>&1 &
wait
stamp "rest and misc"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.28 timeout 150 python3 -m pytest $P -n 3 tests/test_norm.py \
    -k "test_forward_backward and not 16384-" > res1/norm_fb.log 2>&1
stamp "fb rc=$?"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout $(( $(left 585) - 5 )) python3 -m pytest $P \
    tests/test_norm.py -k "test_forward_backward and 16384-" > res1/norm_fb16384.log 2>&1
stamp "fb16384 rc=$?"
ls /tmp/keep/$CACHE | wc -l >> res1/gpu.txt
for f in res1/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res1/times.txt
tar czf $OUT/res1.tgz res1
