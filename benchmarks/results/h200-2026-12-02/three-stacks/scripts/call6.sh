# Call 6: ncu for quack_jax and XLA over the float32 cross-entropy and softmax rows.
. benchmarks/results/h200-2026-12-02/three-stacks/scripts/common.sh res6
cp -r bench1 res6/bench
NCU_SECONDS=170 ncu_one jax res6/bench cross_entropy float32
[ $(left 360) -gt 60 ] && NCU_SECONDS=$(left 360) ncu_one jax res6/bench softmax float32
cat res6/times.txt
tar czf $OUT/res6.tgz res6
