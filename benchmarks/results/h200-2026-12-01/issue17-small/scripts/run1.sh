set -x
ln -sfn ../kernels quack_jax/kernels
export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10
mkdir -p res
nvidia-smi --query-gpu=name,driver_version --format=csv > res/gpu.txt
python -c "import jax; print(jax.__version__, jax.devices())" >> res/gpu.txt 2>&1
timeout 200 python exp_small.py res > res/small.log 2>&1
timeout 330 python exp_norm.py res > res/norm.log 2>&1
tar czf $OUT/res.tgz res
