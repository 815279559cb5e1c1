# Call 2 (sixteenth session, cubins .cubins_17, no kernel changed): the norms' backward
# reference written as the VJP of the forward reference (scripts/exp_norm_vjp.py), two
# processes of three samples; the optimised HLO of each way at three shapes.
export CACHE=.cubins_17
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res2
for p in a b; do
    timeout $(( $(left 400) / 2 )) python3 benchmarks/results/h200-2026-12-03/recompute/scripts/exp_norm_vjp.py \
        res2 3 > res2/exp_$p.log 2>&1
    stamp "exp $p rc=$?"
    mv res2/norm_vjp.json res2/norm_vjp_$p.json
    settle
done
cat res2/times.txt
tar czf $OUT/res2.tgz res2
