# Call 1: keep the first part of the CuTe-DSL wheel; quack_jax's bench, every op and
# dtype; ncu for quack_jax and XLA over the bfloat16 rows.
. benchmarks/results/h200-2026-12-02/three-stacks/scripts/common.sh res1
cp .dsla/* /tmp/keep/
timeout 300 python3 -m quack_jax.bench --out res1/bench > res1/bench.log 2>&1
stamp "bench rc=$?"
for op in softmax rms_norm layer_norm cross_entropy; do
    [ $(left 540) -gt 110 ] && ncu_one jax res1/bench $op bfloat16
done
cat res1/times.txt
tar czf $OUT/res1.tgz res1
