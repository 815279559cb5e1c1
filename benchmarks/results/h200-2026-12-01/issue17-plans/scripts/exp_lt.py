"""Why bench.launched_tiling returned None on the GPU (seventh session)."""

import jax

from quack_jax import _cache, bench
from quack_jax._primitive import lowering_path

op = bench.benchmarks()["rms_norm"]
t = next(t for t in op.tuned if t.name == "bwd")
args = bench.make_inputs(op.arguments(16384, 4096, "bfloat16"), 1, seed=1)[0]
operands = jax.eval_shape(t.prepare, *args)
print("operands", operands)
with _cache.kernels_used() as used, lowering_path("kernel"):
    low = jax.jit(t.fn).trace(*operands).lower(lowering_platforms=("cuda",))
print("cuda lowering: used", used, "custom calls", low.as_text().count("custom_call @"))
print("launched_tiling", bench.launched_tiling(t, args))
with _cache.kernels_used() as used2, lowering_path("kernel"):
    low2 = jax.jit(t.fn).lower(*operands)
print("default lowering: used", used2, "custom calls", low2.as_text().count("custom_call @"))
print([line for line in low.as_text().splitlines() if "custom_call" in line][:3])
