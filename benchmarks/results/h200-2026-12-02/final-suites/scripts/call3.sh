# Call 3 (twelfth session, cubins .cubins_14): the five cases of call 2 that ran out of GPU
# memory in their own reference code, again with more memory; then the training step.
export CACHE=.cubins_14
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res3
P="-m gpu -q -rs -p no:cacheprovider"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 200 python3 -m pytest $P tests/test_cross_entropy.py \
    -k "test_mean_and_sum_gradient_from_the_forward and 16384-262144" > res3/ce.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 timeout 200 python3 -m pytest $P tests/test_softmax.py \
    -k "test_values_and_gradients and 1000-262144" > res3/softmax.log 2>&1 &
wait
stamp "reruns"
settle
timeout $(( $(left 585) - 5 )) python3 benchmarks/train_lm.py --config h200 --steps 60 \
    --variants stock quack --out res3 > res3/train_lm.log 2>&1
stamp "train_lm rc=$?"
for f in res3/ce.log res3/softmax.log; do echo "$f: $(tail -n 1 $f)"; done
tail -n 4 res3/train_lm.log; cat res3/times.txt
tar czf $OUT/res3.tgz res3
