# Call 4 (thirteenth session, cubins .cubins_16): the backward by wall time, XLA's sum
# against the summing variant (time_grid_summing.py), with what is left of the budget.
export CACHE=.cubins_16
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res4
timeout 170 python3 benchmarks/results/h200-2026-12-02/grid-summing/scripts/time_grid_summing.py \
    > res4/time.md 2> res4/time.log
stamp "time rc=$?"
cat res4/time.md; tail -3 res4/time.log; cat res4/times.txt
tar czf $OUT/res4.tgz res4
