T0=$(date +%s)
ln -sfn ../kernels quack_jax/kernels
rm -rf resF; mkdir -p resF
[ -d .cubins_10 ] && [ $(ls .cubins_10 | wc -l) -ge 1645 ] || { rm -rf .cubins_10; tar xzf caches.tgz; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > resF/gpu.txt
git log -1 --format=%H > resF/commit.txt 2>&1; git diff --stat >> resF/commit.txt 2>&1
export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10 PYTHONUNBUFFERED=1
timeout 330 python -m quack_jax.bench --latency --ops softmax --out resF/latency > resF/latency.log 2>&1
echo latency $(( $(date +%s) - T0 )) s >> resF/times.txt
timeout 90 python -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_lowering_path.py > resF/lowering_path.log 2>&1
echo tests $(( $(date +%s) - T0 )) s >> resF/times.txt
tail -n 2 resF/lowering_path.log; cat resF/times.txt
tar czf $OUT/resF.tgz resF
