# Call 5: ncu for quack_jax and XLA over the float32 norm rows, with more time each
# (call 3's timed out at 110 s).
. benchmarks/results/h200-2026-12-02/three-stacks/scripts/common.sh res5
cp -r bench1 res5/bench
NCU_SECONDS=210 ncu_one jax res5/bench rms_norm float32
[ $(left 420) -gt 150 ] && NCU_SECONDS=$(left 420) ncu_one jax res5/bench layer_norm float32
cat res5/times.txt
tar czf $OUT/res5.tgz res5
