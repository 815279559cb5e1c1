# Call 2: keep the second part of the wheel; ncu over call 1's latency rows (carried
# back in lat1/), one process per op; any op that call 1 did not finish, again.
. benchmarks/results/h200-2026-12-02/closing/scripts/common.sh res2
cp .dslb/* /tmp/keep/
cp -r lat1 res2/latency
for op in softmax rms_norm layer_norm cross_entropy; do
    if [ ! -f res2/latency/${op}_latency.json ] && [ $(left 570) -gt 200 ]; then
        timeout $(( $(left 570) - 100 )) python3 -m quack_jax.bench --latency --ops $op \
            --out res2/latency > res2/latency_$op.log 2>&1
        stamp "latency $op rc=$?"
        settle
    fi
done
for op in softmax rms_norm layer_norm cross_entropy; do
    [ -f res2/latency/${op}_latency.json ] && [ $(left 570) -gt 100 ] && \
        NCU_SECONDS=$(( $(left 570) > 150 ? 140 : $(left 570) - 10 )) ncu_one jax res2/latency $op
done
python3 benchmarks/profile_kernels.py report res2/latency > res2/ncu_report.txt 2>&1
cat res2/times.txt
tar czf $OUT/res2.tgz res2
