"""The benchmark inside the package (``python -m quack_jax.bench``) and the side-by-side
report built from its JSON and a QuACK file, on the CPU with small shapes."""

import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

import quack_jax
from quack_jax import _timing, bench
from quack_jax._spec import Benchmark
from quack_jax.norm.spec import QK_NORM_SHAPES


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["--quick", "--ops", "softmax", "rms_norm", "--dtypes", "float32", "--reps", "1"]
    bench.main([*args, "--out", str(out)])
    return out


def test_bench_writes_tables_with_byte_counts(bench_dir):
    for op, passes in (("softmax", 5), ("rms_norm", 5)):
        result = json.loads((bench_dir / f"{op}.json").read_text())
        assert "XLA fallback" in result["meta"]["device"]
        assert result["meta"]["passes"]["quack_fwd_bwd"] == passes
        assert [(r["m"], r["n"]) for r in result["rows"]] == bench.benchmarks()[op].quick_shapes
        for row in result["rows"]:
            assert all(row[key] > 0 for key in result["meta"]["passes"])
            assert row["k"] == 1  # one input per call on the fallback: a quick run
        table = (bench_dir / f"{op}.md").read_text()
        assert "| float32 |" in table
        # XLA against XLA: no speedup presented
        assert "No speedups: quack_jax ran its XLA fallback" in table
        assert "speedup" not in table.split("No speedups")[1] and "x |" not in table


def test_bench_on_a_cpu_says_how_long(capsys):
    bench.main(["--ops", "softmax", "--sizes", "1"])  # the full shapes, none of them run
    out = capsys.readouterr().out
    assert "XLA fallback" in out and "take hours" in out and "--quick" in out


def test_report_beside_quack(bench_dir, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    import report

    rows = []
    for op in ("softmax", "rms_norm"):
        for i, r in enumerate(json.loads((bench_dir / f"{op}.json").read_text())["rows"]):
            # QuACK twice as fast on the first row of each op, absent on the others
            seconds = {c: r[f"quack_{c}"] / 2 for c in report.CASES} if i == 0 else None
            row = dict(op=op, dtype=r["dtype"], m=r["m"], n=r["n"])
            if seconds:
                passes = bench.benchmarks()[op].passes
                size = r["m"] * r["n"] * 4
                row |= {
                    f"{c}_tbps": passes[f"quack_{c}"] * size / s / 1e12 for c, s in seconds.items()
                }
            rows.append(row)
    meta = dict(device="test", torch="-", quack="-", cuda="-")
    (bench_dir / "quack_torch.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    notes = bench_dir / "notes.md"
    notes.write_text("Hand-written analysis.")
    report.main([str(bench_dir), "--notes", str(notes)])
    text = (bench_dir / "report.md").read_text()
    assert "Hand-written analysis." in text
    # fwd and fwd+bwd of each op's first row (a "vs XLA" cell may be 0.50x too on a
    # loaded CPU, where both columns time XLA)
    assert text.count("| 0.50x |") >= 4
    behind = text.split("## Where quack_jax is behind QuACK")[1]
    assert behind.count("0.50x of QuACK") == 4 and "4096 x 1024" in behind
    assert (bench_dir / "report.png").stat().st_size > 10_000


def test_bench_skips_kernels_it_cannot_get(monkeypatch, tmp_path, capsys):
    """A wheel without CuTe-DSL lacks the unpackaged configs: those cells stay empty."""
    timed = _timing.time_per_call

    def time_per_call(fn, inputs, reps, require_kernel=False):
        if fn is quack_jax.softmax:
            raise quack_jax.MissingKernelError("no cubin for softmax_fwd (n=1024)")
        return timed(fn, inputs, reps, require_kernel)

    monkeypatch.setattr(_timing, "time_per_call", time_per_call)
    args = ["--quick", "--ops", "softmax", "--dtypes", "float32", "--reps", "1"]
    bench.main([*args, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "quack_jax fwd float32 4096x1024 not timed: no cubin" in out
    assert "softmax float32 4096x1024 (1 of 2)" in err  # progress, before each shape
    rows = json.loads((tmp_path / "softmax.json").read_text())["rows"]
    assert all(r["quack_fwd"] is None and r["xla_fwd"] > 0 for r in rows)
    table = (tmp_path / "softmax.md").read_text().splitlines()
    cells = [c.strip() for c in next(x for x in table if "4096 x 1024" in x).split("|")]
    assert cells[4] == "-" and cells[5] != "-" and cells[6] == "-"  # quack, XLA, fwd / copy


@pytest.fixture(scope="module")
def latency_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("latency")
    bench.main(["--latency", "--quick", "--ops", "rms_norm", "--reps", "1", "--out", str(out)])
    return out


def test_latency_writes_microseconds_per_op(latency_dir):
    result = json.loads((latency_dir / "rms_norm_latency.json").read_text())
    assert result["meta"]["unit"] == "seconds per op"
    assert result["meta"]["options"]["dtypes"] == ["bfloat16"]  # the default with --latency
    assert [(r["m"], r["n"]) for r in result["rows"]] == [(1, 1024), (64, 1024)]
    paths = ("", "_kernel", "_reference")
    keys = [f"quack_{p}{s}" for p in ("fwd", "fwd_bwd") for s in paths] + ["xla_fwd", "xla_fwd_bwd"]
    for row in result["rows"]:
        assert row["dtype"] == "bfloat16" and row["k"] == 2  # a chain of two on the fallback
        assert all(row[key] > 0 for key in keys)
        assert "flax_fwd_bwd" not in row
        # on the fallback every path lowers to the same program: compiled and timed once
        assert row["quack_fwd"] == row["quack_fwd_kernel"] == row["quack_fwd_reference"]
    table = (latency_dir / "rms_norm_latency.md").read_text()
    assert table.startswith("rms_norm latency, ") and "Microseconds per op" in table
    headers = ["dtype", "M x N", "K"] + [
        f"{who} {label} µs"
        for label in ("fwd", "fwd+bwd")
        for who in ("quack_jax", "kernel", "reference", "XLA")
    ]
    assert "| " + " | ".join(headers) + " |" in table.splitlines()
    assert "| bfloat16 | 1 x 1024 | 2 |" in table and "| bfloat16 | 64 x 1024 | 2 |" in table
    assert "speedup" not in table.split("No speedups")[1] and "x |" not in table


def test_kernel_times_of_the_latency_rows(latency_dir, monkeypatch):
    """``profile_kernels.py`` takes a --latency folder's rows, and its report puts each
    stack's kernel time side by side (a made-up ncu log: XLA's kernels take twice as long
    as quack_jax's, fwd+bwd of the second row missing for XLA)."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    import profile_kernels

    rows = list(profile_kernels.bench_rows(latency_dir, None, None))
    shapes = [(op, r["m"], r["n"]) for op, r in rows]
    assert shapes == [("rms_norm", 1, 1024), ("rms_norm", 64, 1024)]
    labels, log = [], ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']

    def launch(name, ns):
        log.append(f'"{len(log) - 1}","{name}","gpu__time_duration.sum","ns","{ns:,}"')

    for _, r in rows:
        for stack, ns in (("quack_jax", 2500), ("XLA", 5000)):
            for pass_ in profile_kernels.PASSES:
                if (stack, r["m"], pass_) == ("XLA", 64, "fwd_bwd"):
                    continue
                labels.append(dict(stack=stack, op="rms_norm", dtype=r["dtype"], m=r["m"]))
                labels[-1] |= dict(n=r["n"], pass_=pass_)
                launch("spin_kernel", 1000)
                for _ in range(1 + (pass_ == "fwd_bwd")):
                    launch(f"{stack} kernel", ns)
                launch("spin_kernel", 1000)
    (latency_dir / "jax_labels.json").write_text(json.dumps(labels))
    (latency_dir / "ncu_jax.csv").write_text("==PROF== a line ncu adds\n" + "\n".join(log))
    profile_kernels.report(latency_dir)
    table = (latency_dir / "kernel_times.md").read_text().splitlines()
    assert table[0] == "| op | dtype | M x N | pass | quack_jax µs | XLA µs | XLA / quack_jax |"
    assert "| rms_norm | bfloat16 | 1 x 1024 | fwd_bwd | 5.0 | 10.0 | 2.00x |" in table
    assert "| rms_norm | bfloat16 | 64 x 1024 | fwd_bwd | 5.0 | - | - |" in table
    # the sums: only the shapes both stacks ran
    assert table[-2:] == ["| rms_norm | fwd | 2.00x |", "| rms_norm | fwd_bwd | 2.00x |"]


def test_latency_shapes_are_declared_per_family():
    ops = bench.benchmarks()
    rows = set(Benchmark.LATENCY_ROWS)
    for name, sizes in [
        ("softmax", {1024, 4096, 8192}),
        ("layer_norm", {1024, 2048, 4096, 8192}),
        ("rms_norm", {1024, 2048, 4096, 8192}),
        ("cross_entropy", {32000, 128256, 256000}),
    ]:
        shapes = set(ops[name].latency_shapes)
        assert {(m, n) for m in rows for n in sizes} <= shapes
        assert shapes - {(m, n) for m in rows for n in sizes} == (
            set(QK_NORM_SHAPES) if name == "rms_norm" else set()
        )


def test_chained_ops_wait_for_each_other():
    """K ops in a chain: each op's arguments pass through a barrier with the previous
    result (in the lowered program), and the results are the unchained ones."""
    inputs = [(jnp.full((4, 8), float(k)), jnp.ones((8,))) for k in range(3)]

    def fn(x, w):
        return jax.nn.softmax(x * w)

    lowered = _timing.lower_calls(fn, inputs, chain=True)
    assert lowered.as_text().count("stablehlo.optimization_barrier") == 2
    assert "optimization_barrier" not in _timing.lower_calls(fn, inputs).as_text()
    jaxpr = jax.make_jaxpr(_timing.chained(fn))(inputs).jaxpr
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    # barrier k takes op k+1's arguments and op k's result (the function's k-th output)
    assert [b.invars[-1] for b in barriers] == jaxpr.outvars[:2]
    compiled = lowered.compile()
    for got, want in zip(compiled(inputs), [fn(*args) for args in inputs], strict=True):
        assert jnp.array_equal(got, want)
    assert 0 < _timing.time_compiled([(compiled, inputs)], 1)[0] < 1


@pytest.mark.parametrize("name", sorted(bench.benchmarks()))
def test_every_tuned_kernel_runs_on_its_candidates(name):
    """What ``--tune`` times, on the XLA fallback at a small shape: each tuned function
    runs on its prepared operands and gives finite results, and has candidate tilings."""
    op = bench.benchmarks()[name]
    n = op.quick_shapes[-1][1]
    arguments = _timing.make_inputs(op.arguments(4, n, "float32"), 1, seed=0)[0]
    for t in op.tuned:
        for one_wave in t.grids(n, 4):
            assert t.candidates(n, 4, None, one_wave), t.name
        out = jax.jit(t.fn)(*jax.jit(t.prepare)(*arguments))
        for leaf in jax.tree.leaves(out):
            assert jnp.all(jnp.isfinite(leaf)), (name, t.name)


def test_linear_ce_rows_hold_every_variant_of_a_set(tmp_path, monkeypatch):
    """benchmarks/linear_ce.py: one row per shape, dtype and set, every variant timed in
    the row's own process, with its temporaries and loss, and the targets read off."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    import linear_ce

    args = ["--out", str(tmp_path), "--shapes", "64", "16", "100", "--dtypes", "float32"]
    linear_ce.main([*args, "--reps", "1"])
    rows = json.loads((tmp_path / "linear_ce.json").read_text())["rows"]
    assert [(r["variant_set"], r["tokens"], r["vocab"], r["dtype"]) for r in rows] == [
        ("ce", 64, 100, "float32"),
        ("grpo", 64, 100, "float32"),
    ]
    for row in rows:
        ran = linear_ce.SET_VARIANTS[row["variant_set"]]
        for variant in ran:
            assert row[f"{variant}_ms"] > 0 and row[f"{variant}_temp_gb"] >= 0
        assert not {f"{v}_ms" for v in linear_ce.VARIANTS if v not in ran} & row.keys()
        losses = [row[f"{v}_loss"] for v in ran if v != "gemms"]
        assert max(losses) - min(losses) <= 1e-4 * (1 + abs(losses[0])), losses
        assert isinstance(row["meets"], bool) and row["fused_over_gemms"] > 0
    assert rows[1]["fused_over_xla"] > 0 and rows[1]["token_loss_over_xla"] > 0
    assert isinstance(rows[1]["token_loss_meets"], bool)  # the grpo row's targets
    assert "| 64 x 16 x 100 | float32 | grpo |" in (tmp_path / "linear_ce.md").read_text()
