# Call 1 (sixteenth session, cubins .cubins_17, no kernel changed): the norms' fwd+bwd at
# small shapes with a backward reference that recomputes the row statistics from h
# (scripts/exp_norm_recompute.py), in two processes of three samples each.
export CACHE=.cubins_17
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res1
for p in a b; do
    timeout $(( $(left 560) / 2 )) python3 benchmarks/results/h200-2026-12-03/recompute/scripts/exp_norm_recompute.py \
        res1 3 > res1/exp_$p.log 2>&1
    stamp "exp $p rc=$?"
    mv res1/norm_recompute.json res1/norm_recompute_$p.json
    settle
done
cat res1/times.txt
tar czf $OUT/res1.tgz res1
