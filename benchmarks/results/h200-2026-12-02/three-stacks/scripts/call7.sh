# Call 7 (a fresh machine): second and third ncu samples of quack_jax and XLA over the
# rows where call 1-6's kernel times put quack_jax 3-4% behind QuACK (RMSNorm bfloat16,
# softmax's 32768 x 1024 rows), each process into its own copy of the bench folder.
. benchmarks/results/h200-2026-12-02/three-stacks/scripts/common.sh res7
for s in a b; do
    cp -r bench1 res7/bench_$s
    [ $(left 230) -gt 40 ] && ncu_one jax res7/bench_$s rms_norm bfloat16
done
[ $(left 230) -gt 40 ] && ncu_one jax res7/bench_a softmax bfloat16
[ $(left 230) -gt 40 ] && ncu_one jax res7/bench_a softmax float32
cat res7/times.txt
tar czf $OUT/res7.tgz res7
