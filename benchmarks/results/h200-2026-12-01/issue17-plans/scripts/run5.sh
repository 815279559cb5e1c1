set -x
T0=$(date +%s)
ln -sfn ../kernels quack_jax/kernels
rm -rf res5; mkdir -p res5
[ -d .cubins_10 ] || tar xzf caches.tgz
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > res5/gpu.txt
git log -1 --format=%H > res5/commit.txt 2>&1
export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10 XLA_PYTHON_CLIENT_MEM_FRACTION=0.14
P="-m gpu -q -rs -p no:cacheprovider"
L=390
timeout $L python -m pytest $P tests/test_norm.py -k test_forward_backward > res5/norm_fb.log 2>&1 &
timeout $L python -m pytest $P tests/test_norm.py -k "not test_forward_backward" > res5/norm_rest.log 2>&1 &
timeout $L python -m pytest $P tests/test_softmax.py > res5/softmax.log 2>&1 &
timeout $L python -m pytest $P tests/test_cross_entropy.py > res5/ce.log 2>&1 &
timeout $L python -m pytest $P tests/test_token_logprobs.py tests/test_linear_cross_entropy.py tests/test_sharding.py > res5/tlp_lce_shard.log 2>&1 &
timeout $L python -m pytest $P tests/test_fuzz.py tests/test_build.py tests/test_lowering_path.py tests/test_registry.py tests/test_export.py tests/test_flax.py tests/test_train.py tests/test_implementation.py tests/test_bench.py tests/test_cli.py tests/test_imports.py > res5/misc.log 2>&1 &
wait
echo tests $(( $(date +%s) - T0 )) s >> res5/times.txt
tar czf $OUT/res5.tgz res5
