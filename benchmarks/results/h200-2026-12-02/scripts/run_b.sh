T0=$(date +%s)
ln -sfn ../kernels quack_jax/kernels
rm -rf resB; mkdir -p resB
ls .cubins_10 2>/dev/null | wc -l > resB/cache_count.txt; [ -d .cubins_10 ] && [ $(ls .cubins_10 | wc -l) -ge 1644 ] || { rm -rf .cubins_10; tar xzf caches.tgz; }
export PYTHONPATH=$PWD QUACK_JAX_CACHE=$PWD/.cubins_10
P="-m gpu -q -rs -p no:cacheprovider"
L=${L:-400}
XLA_PYTHON_CLIENT_MEM_FRACTION=0.22 timeout $L python -m pytest $P tests/test_norm.py -k "test_forward_backward and 16384-" > resB/norm_fb.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.22 timeout $L python -m pytest $P tests/test_softmax.py -k "test_values_and_gradients and (1000-131071 or 1000-262144 or 32768-)" > resB/softmax.log 2>&1 &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout $L python -m pytest $P tests/test_cross_entropy.py -k "test_mean_and_sum_gradient_from_the_forward and 16384-262144" > resB/ce.log 2>&1 &
wait
echo tests $(( $(date +%s) - T0 )) s >> resB/times.txt
for f in resB/*.log; do tail -n 2 $f; done
tar czf $OUT/resB.tgz resB
