# Call 1 (twelfth session, cubins .cubins_14): every norm GPU test on the final rule of the
# summing backward, beside the small suites that take norms at few rows (fuzz, export,
# registry, lowering path, bench, the one-GPU sharding cases); then the norm fwd+bwd
# tests, the 16384-row cases alone.
export CACHE=.cubins_14
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
for f in res1/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res1/times.txt
tar czf $OUT/res1.tgz res1
