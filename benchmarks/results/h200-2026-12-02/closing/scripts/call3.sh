# Call 3: QuACK from the wheel parts kept; the softmax forward at 32768 x 1024 by kernel
# time, every candidate tiling and QuACK, in one process under ncu.
. benchmarks/results/h200-2026-12-02/closing/scripts/common.sh res3
cp .dslc/cu13.part.* /tmp/keep/
mkdir -p /tmp/w && cat /tmp/keep/cu13.part.* > /tmp/w/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
cp .dslc/*.whl /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl > res3/pip.log 2>&1
stamp "pip rc=$?"
export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site
S=benchmarks/results/h200-2026-12-02/closing/scripts/exp_soft_1024.py
timeout $(( $(left 570) - 20 )) ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file res3/ncu.csv \
    python3 $S run res3 --quack > res3/exp.log 2>&1
stamp "exp rc=$?"
settle
python3 $S report res3 > res3/report.txt 2>&1
cat res3/report.txt res3/times.txt
tar czf $OUT/res3.tgz res3
