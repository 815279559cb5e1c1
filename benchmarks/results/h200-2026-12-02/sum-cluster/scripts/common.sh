# Sourced by each call: the cubin cache and the CuTe-DSL wheel parts live in /tmp/keep,
# which survives between calls on a warm machine (the call's tree may not).
# CACHE names the cache folder in caches.tgz (call 3: .cubins_12, after the fix in kernels/norm.py).
T0=$(date +%s)
mkdir -p /tmp/keep
ln -sfn ../kernels quack_jax/kernels
if [ -f caches.tgz ] && [ $(ls /tmp/keep/${CACHE:-.cubins_11} 2>/dev/null | wc -l) -lt $(tar tzf caches.tgz | grep -c json) ]; then
    rm -rf /tmp/keep/${CACHE:-.cubins_11}; tar xzf caches.tgz -C /tmp/keep
fi
export PYTHONPATH=$PWD QUACK_JAX_CACHE=/tmp/keep/${CACHE:-.cubins_11} PYTHONUNBUFFERED=1
RES=$1; rm -rf "$RES"; mkdir -p "$RES"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$RES/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$RES/gpu.txt" 2>&1
ls /tmp/keep/${CACHE:-.cubins_11} | wc -l >> "$RES/gpu.txt"
stamp() { echo "$1 $(( $(date +%s) - T0 )) s" >> "$RES/times.txt"; }
left() { echo $(( ${1} - ($(date +%s) - T0) )); }  # seconds left of a budget
# ncu over one op (and dtype) of a bench folder, one process: ncu_one STACK FOLDER OP [DTYPE]
ncu_one() {
    local stack=$1 folder=$2 op=$3 dtype=${4:-} name
    name=ncu_${stack}_${op}${dtype:+_$dtype}
    timeout ${NCU_SECONDS:-110} ncu --clock-control none --profile-from-start off \
        --metrics gpu__time_duration.sum --csv --print-units base \
        --log-file "$folder/$name.csv" \
        python3 benchmarks/profile_kernels.py "$stack" "$folder" --op "$op" ${dtype:+--dtype $dtype} \
        > "$RES/$name.log" 2>&1
    stamp "$name rc=$?"
    settle
}
# after a process that may have crashed or timed out: kill what it left, so that the
# next process finds the GPU's memory free
settle() {
    pkill -9 -f profile_kernels.py; pkill -9 -f exp_sum_cluster.py; pkill -9 -f exp_norm_bwd_path.py; pkill -9 -f exp_norm_recompute.py; pkill -9 -f exp_norm_vjp.py; pkill -9 -f exp_norm_pair.py; pkill -9 -f pytest; pkill -9 -f quack_jax.bench
    sleep 1
    nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$RES/memory.txt"
}
