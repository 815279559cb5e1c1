# Call 4 (sixteenth session, cubins .cubins_17, the code of call 3): scripts/exp_norm_pair.py
# again (one process, three samples), then the training step
# (benchmarks/train_lm.py --config h200).
export CACHE=.cubins_17
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res4
timeout 90 python3 benchmarks/results/h200-2026-12-03/recompute/scripts/exp_norm_pair.py \
    res4 3 > res4/exp.log 2>&1
stamp "exp rc=$?"
rm -rf res4/hlo
settle
timeout 150 python3 benchmarks/train_lm.py --config h200 --steps 60 --variants stock quack \
    --out res4 > res4/train_lm.log 2>&1
stamp "train_lm rc=$?"
cat res4/times.txt; tail -n 4 res4/train_lm.log
tar czf $OUT/res4.tgz res4
