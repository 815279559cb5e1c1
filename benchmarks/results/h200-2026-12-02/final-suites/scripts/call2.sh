# Call 2 (twelfth session, cubins .cubins_14): the other kernel suites on the final bytes,
# at once: softmax and log-softmax, cross-entropy, linear cross-entropy, token log-probs.
export CACHE=.cubins_14
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res2
P="-m gpu -q -rs -p no:cacheprovider"
L=$(( $(left 585) - 10 ))
XLA_PYTHON_CLIENT_MEM_FRACTION=0.16 timeout $L python3 -m pytest $P -n 2 tests/test_softmax.py \
    > res2/softmax.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.28 timeout $L python3 -m pytest $P tests/test_cross_entropy.py \
    > res2/ce.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.14 timeout $L python3 -m pytest $P \
    tests/test_linear_cross_entropy.py > res2/lce.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.16 timeout $L python3 -m pytest $P tests/test_token_logprobs.py \
    > res2/tlp.log 2>&1 &
wait
stamp "suites"
for f in res2/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res2/times.txt
tar czf $OUT/res2.tgz res2
