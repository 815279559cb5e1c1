"""Device experiment (issue 17, 2026-12-01): kernel time (ncu) of softmax's kernels and
XLA's fusions at small shapes, one op per run."""

import pathlib
import sys

sys.path.insert(0, "benchmarks")
import jax
import profile_kernels as pk

import quack_jax
from quack_jax import bench
from quack_jax._primitive import lowering_path
from quack_jax._spec import fwd_bwd
from quack_jax._tiling import override_tiling

folder = pathlib.Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
op = bench.benchmarks()["softmax"]
tuned = {t.name: t for t in op.tuned}
ALT = {
    "fwd": {1024: (32, 256, 1), 4096: (128, 512, 1), 8192: (128, 256, 2)},
    "bwd": {1024: (32, 512, 1), 4096: (128, 512, 1), 8192: (256, 512, 1)},
}


def functions():
    for m, n in [(1, 1024), (8, 4096), (64, 4096), (512, 4096), (8, 8192), (64, 8192), (512, 8192)]:
        (x, dy) = bench.make_inputs([((m, n), "bfloat16")] * 2, 1, seed=m * n)[0]
        y = jax.nn.softmax(x)
        lab = dict(op="softmax", dtype="bfloat16", m=m, n=n)
        for p in ("fwd", "bwd"):
            t = tuned[p]
            args = (x,) if p == "fwd" else (dy, y)
            for name in ("default", "alt"):
                runs = t.runs(n, 2, None)
                tiling = (
                    runs[0][1]
                    if name == "default"
                    else next(
                        tl
                        for _, tl, _ in runs
                        if (tl.threads_per_row, tl.num_threads, tl.cluster_n) == ALT[p][n]
                    )
                )
                with override_tiling(t.family, n, 2, tiling), lowering_path("kernel"):
                    f = jax.jit(t.fn).lower(*args).compile()
                yield lab | dict(stack=f"quack_{name}", pass_=p), (lambda f=f, a=args: f(*a))
        fx = jax.jit(jax.nn.softmax).lower(x).compile()
        yield lab | dict(stack="XLA", pass_="fwd"), (lambda f=fx, a=(x,): f(*a))
        fb = jax.jit(fwd_bwd(jax.nn.softmax)).lower(x, dy).compile()
        yield lab | dict(stack="XLA", pass_="fwd_bwd"), (lambda f=fb, a=(x, dy): f(*a))
        with lowering_path("auto"):
            fq = jax.jit(fwd_bwd(quack_jax.softmax)).lower(x, dy).compile()
        yield lab | dict(stack="quack_auto", pass_="fwd_bwd"), (lambda f=fq, a=(x, dy): f(*a))


pk.run_marked(functions(), folder / "small_labels.json", jax.block_until_ready)
