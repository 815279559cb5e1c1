"""The device kernels of a ``jax.profiler`` trace and their kinds, for the benchmarks'
breakdowns of device time (``train_lm.py --profile``, ``profile_linear_ce.py``)."""

from __future__ import annotations

import gzip
import json
import pathlib
import re

# a device kernel's kind, by its name: quack_jax's kernels (their symbols start
# "kernel_"), cuDNN's attention, cuBLAS's and XLA's GEMMs, copies; any other is one of
# XLA's fusions
KINDS = (
    ("quack_jax", re.compile(r"^kernel_")),
    ("attention", re.compile(r"cudnn|fmha|flash|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cublas|cutlass", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_kind(name: str) -> str | None:
    """The kind of the kernel ``name`` (see ``KINDS``); None for one of XLA's fusions."""
    return next((k for k, pattern in KINDS if pattern.search(name)), None)


def traced_events(run, log_dir) -> list[dict]:
    """Run ``run()`` under ``jax.profiler.trace`` into ``log_dir``; returns the trace's
    timed events on the GPUs (on a machine without one, those of the HLO ops)."""
    import jax

    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        run()
    (path,) = pathlib.Path(log_dir).rglob("*perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes = {
        e.get("pid"): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpus = {pid for pid, name in processes.items() if name.startswith("/device:GPU")}
    return [
        e
        for e in events
        if e.get("ph") == "X" and (e.get("pid") in gpus if gpus else "hlo_op" in e.get("args", {}))
    ]
