# Call 5: the RMSNorm backward's candidate tilings at 8-512 rows by kernel time (one
# process under ncu); then softmax's and RMSNorm's latency tables again (a second sample).
. benchmarks/results/h200-2026-12-02/closing/scripts/common.sh res5
S=benchmarks/results/h200-2026-12-02/closing/scripts/exp_norm_small.py
timeout 330 ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file res5/ncu.csv \
    python3 $S run res5 > res5/exp.log 2>&1
stamp "exp rc=$?"
settle
python3 $S report res5 > res5/report.txt 2>&1
for op in softmax rms_norm; do
    [ $(left 570) -gt 110 ] || break
    timeout $(( $(left 570) - 10 )) python3 -m quack_jax.bench --latency --ops $op \
        --out res5/latency > res5/latency_$op.log 2>&1
    stamp "latency $op rc=$?"
    settle
done
cat res5/report.txt res5/times.txt; tail -3 res5/exp.log
tar czf $OUT/res5.tgz res5
