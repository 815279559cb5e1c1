#!/usr/bin/env bash
# One call on the GPU machine: install, GPU tests, benchmark. Results land in $OUT.
#   QUACK_JAX_CACHE=.cubins bash benchmarks/device_run.sh [tests] [bench] [ncu] [latency] [tune]
# The cubin cache comes from `python benchmarks/prebuild.py --cache .cubins [--tune]`
# on a CPU machine; the GPU machine has no CuTe-DSL.
# bench runs every op (softmax, rms_norm, layer_norm, cross_entropy). Tuning several takes
# longer than one device call: pick them with TUNE_OPS="rms_norm" (default: softmax,
# rms_norm, layer_norm). latency runs bench --latency. ncu (after bench or latency) times
# each function of their rows by kernel time (benchmarks/profile_kernels.py), a process per
# op and dtype, into the bench's and the latency's folder (kernel_times.md).
set -uo pipefail
export PYTHONUNBUFFERED=1 QUACK_JAX_CACHE=${QUACK_JAX_CACHE:-.cubins}
OUT=${OUT:-/tmp/quack_jax_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
if ! python3 -m pip install --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1; then
    tail -20 /tmp/install.log; exit 1
fi
status=0
for step in "$@"; do
    case $step in
    tests) timeout "${TEST_SECONDS:-240}" python3 -m pytest -m gpu -q -rs --maxfail=10 \
               -p no:cacheprovider tests \
               2>&1 | tee "$OUT/gpu_tests.log" || status=1 ;;
    bench) python3 -m quack_jax.bench --out "$OUT/bench" || status=1 ;;
    tune) timeout "${TUNE_SECONDS:-400}" python3 -m quack_jax.bench --tune --reps 5 \
              --ops ${TUNE_OPS:-softmax rms_norm layer_norm} \
              2>&1 | tee "$OUT/tune.log" || status=1 ;;
    nocmdbuf) XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 -m quack_jax.bench \
              2>&1 | tee "$OUT/bench_no_command_buffers.log" || status=1 ;;
    latency) timeout "${LATENCY_SECONDS:-300}" python3 -m quack_jax.bench --latency \
                 --out "$OUT/latency" 2>&1 | tee "$OUT/latency.log" || status=1 ;;
    ncu) for folder in "$OUT/bench" "$OUT/latency"; do  # the bench's rows, --latency's
             [ -d "$folder" ] || continue
             for op in softmax rms_norm layer_norm cross_entropy; do  # a process per op, dtype
                 for dtype in bfloat16 float32; do
                     timeout "${NCU_SECONDS:-90}" ncu --clock-control none \
                         --profile-from-start off --metrics gpu__time_duration.sum --csv \
                         --print-units base --log-file "$folder/ncu_jax_${op}_$dtype.csv" \
                         python3 benchmarks/profile_kernels.py jax "$folder" --op $op \
                         --dtype $dtype >/dev/null 2>&1 || status=1
                 done
             done
             python3 benchmarks/profile_kernels.py report "$folder" | tee "$folder/ncu.txt"
         done ;;
    esac
done
exit $status
