# Call 6 (twelfth session, cubins .cubins_14): kernel time by ncu over the norms' rows of
# the latency bench (calls 4 and 5, in ../latency), quack_jax and XLA, one process per op.
export CACHE=.cubins_14
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res6
F=benchmarks/results/h200-2026-12-02/final-suites/latency
for op in rms_norm layer_norm; do NCU_SECONDS=150 ncu_one jax $F $op; done
python3 benchmarks/profile_kernels.py report $F > res6/report.log 2>&1
cp $F/ncu_* $F/jax_* $F/kernel_times.* res6/ 2>/dev/null
cat res6/times.txt; tail -n 5 res6/report.log
tar czf $OUT/res6.tgz res6
