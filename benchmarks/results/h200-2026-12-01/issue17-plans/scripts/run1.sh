set -x
T0=$(date +%s)
ln -sfn ../kernels quack_jax/kernels
mkdir -p res _plan
tar xzf caches.tgz
tar xzf plan_tree.tgz -C _plan
cp quack_jax/libquack_jax_ffi.so _plan/quack_jax/
ln -sfn ../kernels _plan/quack_jax/kernels
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > res/gpu.txt
python -c "import jax; print(jax.__version__, jax.devices())" >> res/gpu.txt 2>&1
echo setup $(( $(date +%s) - T0 )) s >> res/times.txt
(export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10; timeout 150 python exp_nbwd.py res/nbwd_main.json main > res/nbwd_main.log 2>&1)
echo main $(( $(date +%s) - T0 )) s >> res/times.txt
(cd _plan; export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/../.cubins_plan; timeout 150 python ../exp_nbwd.py ../res/nbwd_plan.json plan > ../res/nbwd_plan.log 2>&1)
echo plan $(( $(date +%s) - T0 )) s >> res/times.txt
(cd _plan; export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/../.cubins_plan; timeout $(( 560 - $(date +%s) + T0 )) python ../exp_soft.py ../res > ../res/soft.log 2>&1)
echo soft $(( $(date +%s) - T0 )) s >> res/times.txt
tar czf $OUT/res.tgz res
