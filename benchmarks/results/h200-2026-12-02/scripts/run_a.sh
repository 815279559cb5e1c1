set -x
T0=$(date +%s)
ln -sfn ../kernels quack_jax/kernels
rm -rf resA; mkdir -p resA
[ -d .cubins_10 ] && [ $(ls .cubins_10 | wc -l) -ge 1644 ] || { rm -rf .cubins_10; tar xzf caches.tgz; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > resA/gpu.txt
python -c "import jax, xdist; print('jax', jax.__version__, jax.devices())" >> resA/gpu.txt 2>&1
export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10
P="-m gpu -q -rs -p no:cacheprovider"
L=${L:-520}
XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 timeout $L python -m pytest $P -n 3 tests/test_norm.py -k test_forward_backward > resA/norm_fb.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 timeout $L python -m pytest $P -n 3 tests/test_softmax.py tests/test_lowering_path.py > resA/softmax.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout $L python -m pytest $P tests/test_cross_entropy.py > resA/ce.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 timeout $L python -m pytest $P tests/test_linear_cross_entropy.py > resA/lce.log 2>&1 &
wait
echo tests $(( $(date +%s) - T0 )) s >> resA/times.txt
tail -3 resA/*.log
tar czf $OUT/resA.tgz resA
