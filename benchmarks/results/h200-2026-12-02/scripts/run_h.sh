T0=$(date +%s)
ln -sfn ../kernels quack_jax/kernels
rm -rf resH; mkdir -p resH
[ -d .cubins_10 ] && [ $(ls .cubins_10 | wc -l) -ge 1650 ] || { rm -rf .cubins_10; tar xzf caches.tgz; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > resH/gpu.txt
export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10
timeout ${L:-420} python exp_soft4.py resH/soft4 > resH/soft3.log 2>&1
echo exp $(( $(date +%s) - T0 )) s >> resH/times.txt
tail -n 3 resH/soft3.log
tar czf $OUT/resH.tgz resH
