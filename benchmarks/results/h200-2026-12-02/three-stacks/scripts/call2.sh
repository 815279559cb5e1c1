# Call 2: keep the second part of the wheel; the training step, both variants.
. benchmarks/results/h200-2026-12-02/three-stacks/scripts/common.sh res2
cp .dslb/* /tmp/keep/
timeout 420 python3 benchmarks/train_lm.py --config h200 --steps 60 --variants stock quack \
    --out res2 > res2/train_lm.log 2>&1
stamp "train_lm rc=$?"
tail -n 4 res2/train_lm.log; cat res2/times.txt
tar czf $OUT/res2.tgz res2
