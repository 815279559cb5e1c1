T0=$(date +%s)
ln -sfn ../kernels quack_jax/kernels
rm -rf resE; mkdir -p resE
[ -d .cubins_10 ] && [ $(ls .cubins_10 | wc -l) -ge 1644 ] || { rm -rf .cubins_10; tar xzf caches.tgz; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > resE/gpu.txt
export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10
timeout ${L:-420} python exp_soft3.py resE/soft3 > resE/soft3.log 2>&1
echo exp $(( $(date +%s) - T0 )) s >> resE/times.txt
tail -n 3 resE/soft3.log
tar czf $OUT/resE.tgz resE
