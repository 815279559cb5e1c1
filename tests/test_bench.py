"""The benchmark inside the package (``python -m quack_jax.bench``) and the side-by-side
report built from its JSON and a QuACK file, on the CPU with small shapes."""

import json
import pathlib

import pytest

import quack_jax
from quack_jax import bench


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
    assert text.count("| 0.50x |") == 4  # fwd and fwd+bwd of each op's first row
    behind = text.split("## Where quack_jax is behind QuACK")[1]
    assert behind.count("0.50x") == 4 and "4096 x 1024" in behind
    assert (bench_dir / "report.png").stat().st_size > 10_000


def test_bench_skips_kernels_it_cannot_get(monkeypatch, tmp_path, capsys):
    """A wheel without CuTe-DSL lacks the unpackaged configs: those cells stay empty."""
    timed = bench.time_per_call

    def time_per_call(fn, inputs, reps, require_kernel=False):
        if fn is quack_jax.softmax:
            raise quack_jax.MissingKernelError("no cubin for softmax_fwd (n=1024)")
        return timed(fn, inputs, reps, require_kernel)

    monkeypatch.setattr(bench, "time_per_call", time_per_call)
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
