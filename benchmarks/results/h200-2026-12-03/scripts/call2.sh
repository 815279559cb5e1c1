# Call 2 (fifteenth session, cubins .cubins_17): the other kernel suites at once (softmax
# and log-softmax, cross-entropy, linear cross-entropy, token log-probs); their failures
# again with more GPU memory (pytest --lf: in earlier sessions five cases ran out of
# memory in their own reference code at these fractions); the training step; then the
# norms' fwd+bwd at small shapes with each primitive's path (scripts/exp_norm_bwd_path.py).
export CACHE=.cubins_17
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res2
P="-m gpu -q -rs"
suite() {  # suite NAME MEMORY FILE [xdist workers]
    XLA_PYTHON_CLIENT_MEM_FRACTION=$2 timeout 220 python3 -m pytest $P -o cache_dir=/tmp/pc_$1 \
        ${4:+-n $4} tests/$3 > res2/$1.log 2>&1
}
suite softmax 0.16 test_softmax.py 2 &
suite ce 0.28 test_cross_entropy.py &
suite lce 0.14 test_linear_cross_entropy.py &
suite tlp 0.16 test_token_logprobs.py &
wait
stamp "suites"
settle
for s in softmax:test_softmax.py ce:test_cross_entropy.py lce:test_linear_cross_entropy.py \
    tlp:test_token_logprobs.py; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 120 python3 -m pytest $P -o cache_dir=/tmp/pc_${s%%:*} \
        --lf --lfnf=none tests/${s#*:} > res2/${s%%:*}_again.log 2>&1
done
stamp "again"
settle
timeout 120 python3 benchmarks/train_lm.py --config h200 --steps 60 --variants stock quack \
    --out res2 > res2/train_lm.log 2>&1
stamp "train_lm rc=$?"
settle
timeout $(( $(left 590) - 8 )) python3 benchmarks/results/h200-2026-12-03/scripts/exp_norm_bwd_path.py \
    res2 > res2/exp_norm_bwd_path.log 2>&1
stamp "exp rc=$?"
for f in res2/*.log; do echo "$f: $(tail -n 1 $f)"; done; cat res2/times.txt
tar czf $OUT/res2.tgz res2
