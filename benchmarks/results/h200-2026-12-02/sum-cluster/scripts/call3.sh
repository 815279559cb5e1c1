# Call 3, on the kernel with the summing cluster only along x (.cubins_12): the backward
# at training shapes by kernel time in this tree and in oldtree/ (ff30cec, before the
# summing cluster); then every norm GPU test.
export CACHE=.cubins_12
. benchmarks/results/h200-2026-12-02/sum-cluster/scripts/common.sh res3
S=benchmarks/results/h200-2026-12-02/sum-cluster/scripts/exp_large.py
NCU="ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base"
mkdir -p res3/new res3/old
timeout 100 $NCU --log-file res3/new/ncu.csv python3 $S run res3/new > res3/new/exp.log 2>&1
stamp "new rc=$?"
settle
(cd oldtree && ln -sfn ../kernels quack_jax/kernels && QUACK_JAX_CACHE=$PWD/.cubins_old \
    PYTHONPATH=$PWD timeout 100 $NCU --log-file ../res3/old/ncu.csv python3 exp_large.py run \
    ../res3/old > ../res3/old/exp.log 2>&1)
stamp "old rc=$?"
settle
python3 $S report res3/new res3/old > res3/large.md 2>&1
P="-m gpu -q -rs -p no:cacheprovider"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 150 python3 -m pytest $P -n 2 tests/test_norm.py \
    -k "not test_forward_backward" > res3/norm_rest.log 2>&1
stamp "rest rc=$?"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.28 timeout 170 python3 -m pytest $P -n 3 tests/test_norm.py \
    -k "test_forward_backward and not 16384-" > res3/norm_fb.log 2>&1
stamp "fb rc=$?"
settle
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout $(( $(left 575) - 5 )) python3 -m pytest $P \
    tests/test_norm.py -k "test_forward_backward and 16384-" > res3/norm_fb_16384.log 2>&1
stamp "fb 16384 rc=$?"
cat res3/large.md; tail -2 res3/norm_*.log; cat res3/times.txt
tar czf $OUT/res3.tgz res3
