# Call 4: QuACK's end-to-end rows again (call 3's quack_torch.py stopped at the token
# log-probs' JSON, fixed), then ncu for quack_jax and XLA over softmax's bfloat16 rows.
. benchmarks/results/h200-2026-12-02/three-stacks/scripts/common.sh res4
export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site
cp -r bench1 res4/bench
timeout 240 python3 benchmarks/quack_torch.py --like res4/bench > res4/quack_torch.log 2>&1
stamp "quack_torch rc=$?"
[ $(left 420) -gt 100 ] && ncu_one jax res4/bench softmax bfloat16
cat res4/times.txt
tar czf $OUT/res4.tgz res4
