# One device call (run from the repository root, with the wheel in dist_w/ and
# pkg_check.py beside this script copied to the root): install the wheel alone (no
# CuTe-DSL on the GPU machine, an empty cubin cache) and check its norm kernels in four
# processes. Run 7 also ran `python -m quack_jax.bench --quick --out $OUT/w/quick` here.
python3 -m pip install -q --no-deps --no-compile --target /tmp/site dist_w/*.whl || exit 1
mkdir -p /tmp/empty_cache /tmp/w $OUT/w && cp pkg_check.py /tmp/w/ && cd /tmp/w
export PYTHONPATH=/tmp/site QUACK_JAX_CACHE=/tmp/empty_cache PYTHONUNBUFFERED=1
python3 -c "import quack_jax; print(quack_jax.__file__)"
python3 -c "import cutlass" 2>&1 | tail -1
for p in 0 1 2 3; do XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 timeout 300 python3 /tmp/w/pkg_check.py $p 4 > $OUT/w/pkg_check_$p.log 2>&1 & done
wait
tail -n 2 $OUT/w/pkg_check_*.log
tar czf $OUT/w.tgz -C $OUT w && rm -r $OUT/w
