# Call 1: keep the first part of the CuTe-DSL wheel; bench --latency for every op, one
# process per op.
. benchmarks/results/h200-2026-12-02/closing/scripts/common.sh res1
cp .dsla/* /tmp/keep/
for op in softmax rms_norm layer_norm cross_entropy; do
    budget=$(left 570)
    [ $budget -gt 60 ] || break
    timeout $(( budget - 15 )) python3 -m quack_jax.bench --latency --ops $op \
        --out res1/latency > res1/latency_$op.log 2>&1
    stamp "latency $op rc=$?"
    settle
done
cat res1/times.txt
tar czf $OUT/res1.tgz res1
