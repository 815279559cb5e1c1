# Call 3: QuACK from the wheel parts kept, on the rows of call 1's bench (carried back in
# bench1/); ncu for QuACK per op and for quack_jax and XLA over the float32 rows; report.
. benchmarks/results/h200-2026-12-02/three-stacks/scripts/common.sh res3
cp .dslc/cu13.part.* /tmp/keep/
mkdir -p /tmp/w && cat /tmp/keep/cu13.part.* > /tmp/w/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
cp .dslc/*.whl /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl > res3/pip.log 2>&1
stamp "pip rc=$?"
export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site
cp -r bench1 res3/bench
timeout 200 python3 benchmarks/quack_torch.py --like res3/bench > res3/quack_torch.log 2>&1
stamp "quack_torch rc=$?"
for op in softmax rms_norm layer_norm cross_entropy; do
    [ $(left 560) -gt 110 ] && ncu_one quack res3/bench $op
done
for op in softmax rms_norm layer_norm cross_entropy; do
    [ $(left 560) -gt 110 ] && ncu_one jax res3/bench $op float32
done
[ $(left 560) -gt 110 ] && ncu_one jax res3/bench softmax bfloat16  # call 1's crashed (rc 139)
python3 benchmarks/profile_kernels.py report res3/bench > res3/ncu_report.txt 2>&1
cat res3/times.txt
tar czf $OUT/res3.tgz res3
