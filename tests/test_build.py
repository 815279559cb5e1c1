"""Everything about building that runs without a GPU: every kernel the GPU tests and the
benchmarks use compiles to an sm_90a cubin; the cache; the build command; the FFI
library; the wheel; and the lowering that launches a kernel when compiling for a CUDA device."""

import ast
import base64
import collections
import importlib.util
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import jax
import jax.numpy as jnp
import pytest

import quack_jax
from quack_jax import _cache, _ffi, _registry, bench, build
from quack_jax._lowering import lowering
from quack_jax._tiling import STREAM_MIN_ROWS, RowTiling, candidate_tilings, choose_tiling
from quack_jax.cross_entropy.tilings import CE_BWD, CE_ENTROPY, CE_FWD, CE_GRAD
from quack_jax.softmax.config import Softmax, SoftmaxDerivative
from quack_jax.softmax.tilings import SOFTMAX_BWD, SOFTMAX_FWD

ROOT = pathlib.Path(__file__).resolve().parent.parent
EM_CUDA = 190
PACKAGED = _cache.PACKAGED  # the wheel's cubins (quack_jax/cubins), which ``cache`` hides


def cubin_arch(cubin: bytes) -> int:
    """The SM version an ELF cubin was built for (bits 8-15 of e_flags)."""
    assert cubin[:4] == b"\x7fELF"
    assert int.from_bytes(cubin[18:20], "little") == EM_CUDA
    return (int.from_bytes(cubin[48:52], "little") >> 8) & 0xFF


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, and no fallback or packaged cubins to find."""
    monkeypatch.setenv("QUACK_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_cache, "fallback_dir", lambda: tmp_path / "fallback")
    monkeypatch.setattr(_cache, "PACKAGED", tmp_path / "packaged")
    monkeypatch.setattr(_cache, "_memory", {})
    return tmp_path / "cache"


def import_prebuild():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import prebuild
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return prebuild


@pytest.mark.cutlass
def test_every_softmax_test_and_benchmark_kernel_compiles(cache):
    prebuild = import_prebuild()
    lowerings = prebuild.test_lowerings(["softmax"]) + prebuild.benchmark_lowerings(("softmax",))
    kernels = prebuild.lower_for_cuda(lowerings, "softmax", verbose=False)
    assert len(kernels) > 100
    entries = sorted(cache.glob("*.json"))
    assert len(entries) == len(kernels)
    for path in entries:
        entry = json.loads(path.read_text())
        assert cubin_arch(base64.b64decode(entry["cubin"])) == 90
        assert entry["symbol"].startswith("kernel_")


def test_the_tuner_builds_the_norm_forward_on_both_grids(monkeypatch):
    """``prebuild.py --tune`` lowers the norm forward's candidates as the tuner times
    them: on one wave, within the staged rows' shared memory, and on one CTA per row
    block (+full-grid), where the kernel stages nothing and more tilings fit."""
    prebuild = import_prebuild()
    monkeypatch.setattr(bench, "launched_tiling", lambda t, arguments: None)  # the family's
    lowerings = [
        low
        for low in prebuild.tuning_lowerings(("rms_norm",))
        if low.label.startswith("rms_norm fwd float32 n=8192 ")
    ]
    assert all(low.label.endswith("+full-grid") == (not low.one_wave) for low in lowerings)
    staged = {low.tiling[3] for low in lowerings if low.one_wave}
    direct = {low.tiling[3] for low in lowerings if not low.one_wave}
    assert staged < direct


def test_the_tuner_builds_from_each_tuned_kernels_own_tiling(monkeypatch):
    """``prebuild.py --tune`` starts each tuned kernel's candidates from the tiling that
    kernel launches at each tuned shape (``bench.launched_tiling``, as the tuner on the
    GPU does), not from another kernel of the same op name: cross-entropy's forward with
    the gradient and without share one."""
    prebuild = import_prebuild()
    op = bench.benchmarks()["cross_entropy"]
    # a tiling of 4-element vectors for each kernel, where the family's choice has 8
    launched = {t.name: candidate_tilings(t.family, 32000, 2, 4)[i] for i, t in enumerate(op.tuned)}
    asked = []

    def launched_tiling(t, arguments):
        m, n = arguments[0].shape
        asked.append((m, n))
        return launched[t.name] if n == 32000 else None

    monkeypatch.setattr(bench, "launched_tiling", launched_tiling)
    lowerings = prebuild.tuning_lowerings(("cross_entropy",))
    assert set(asked) == set(op.shapes + op.quick_shapes)
    for name, tiling in launched.items():
        ours = [
            low
            for low in lowerings
            if low.label.startswith(f"cross_entropy {name} bfloat16 n=32000 ")
        ]
        assert ours[0].tiling[3] == tiling
        assert {low.tiling[3].vec for low in ours} == {4}
    assert len(set(launched.values())) == len(launched)


def test_the_cache_key_covers_every_module_the_kernels_import():
    """Each quack_jax module that a kernel module imports (the tiling, the kernel
    configurations) is hashed into the cubins' key, so that an edit to it cannot serve a
    cubin compiled before it."""
    hashed = {p.resolve() for p in _cache.source_files()}
    imported = set()
    for kernel in (ROOT / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(kernel.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quack_jax"):
                for alias in node.names:
                    spec = importlib.util.find_spec(node.module)
                    if spec.submodule_search_locations:  # a package: the name is a module
                        spec = importlib.util.find_spec(f"{node.module}.{alias.name}")
                    imported.add(pathlib.Path(spec.origin).resolve())
    assert imported and imported <= hashed, imported - hashed


def test_the_packaged_build_removes_entries_of_other_sources(cache, monkeypatch):
    """An entry of an earlier kernel source would never load, and must not ship."""
    from quack_jax import build

    cache.mkdir()
    current = cache / f"softmax_fwd-float32-n8-t8x128c1v1-sm_90a-{_cache.source_hash()}-dsl4.json"
    stale = cache / "softmax_fwd-float32-n8-t8x128c1v1-sm_90a-0123456789abcdef-dsl4.json"
    current.write_text("{}")
    stale.write_text("{}")
    monkeypatch.setattr(build._registry, "specs", dict)  # no op to build
    build.build_packaged("sm_90a", verbose=False)
    assert sorted(cache.iterdir()) == [current]


@pytest.mark.cutlass
def test_cache_reuses_and_repairs_entries(cache):
    tiling = choose_tiling(SOFTMAX_FWD, 4096, 2)
    first = _cache.get_kernel(Softmax(), "bfloat16", tiling, "sm_90a")
    (path,) = cache.glob("*.json")
    assert cubin_arch(first.cubin) == 90
    _cache._memory.clear()
    assert _cache.get_kernel(Softmax(), "bfloat16", tiling, "sm_90a") == first
    path.write_text(path.read_text()[:200])  # a torn write
    _cache._memory.clear()
    assert _cache.get_kernel(Softmax(), "bfloat16", tiling, "sm_90a") == first
    assert json.loads(path.read_text())["sha256"]


@pytest.mark.cutlass
def test_corrupted_entry_is_detected_and_rebuilt(cache):
    """A cubin whose bytes changed (same length, so only the hash can tell) is not
    loaded: the kernel is compiled again and the entry rewritten."""
    tiling = choose_tiling(SOFTMAX_FWD, 1000, 4)
    first = _cache.get_kernel(Softmax(), "float32", tiling, "sm_90a")
    (path,) = cache.glob("*.json")
    entry = json.loads(path.read_text())
    cubin = bytearray(base64.b64decode(entry["cubin"]))
    cubin[len(cubin) // 2] ^= 0xFF
    path.write_text(json.dumps(entry | {"cubin": base64.b64encode(cubin).decode()}))
    _cache._memory.clear()
    assert _cache.get_kernel(Softmax(), "float32", tiling, "sm_90a") == first
    assert base64.b64decode(json.loads(path.read_text())["cubin"]) == first.cubin


@pytest.mark.cutlass
def test_two_processes_compiling_one_kernel_both_succeed(cache):
    """Two processes that miss the same entry at once both compile it and write it; each
    write is atomic, so the entry left is whole and no temporary file remains."""
    code = (
        "from quack_jax import _cache; from quack_jax._tiling import choose_tiling; "
        "from quack_jax.softmax.config import SoftmaxDerivative as D; "
        "from quack_jax.softmax.tilings import SOFTMAX_BWD; "
        "k = _cache.get_kernel(D(), 'bfloat16', choose_tiling(SOFTMAX_BWD, 3000, 2), "
        "'sm_90a'); print(len(k.cubin))"
    )
    (cache.parent / "tmp").mkdir()  # the children's own fallback folder: empty
    env = os.environ | {"QUACK_JAX_CACHE": str(cache), "TMPDIR": str(cache.parent / "tmp")}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    sizes = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and sizes[0] == sizes[1] != ""
    (path,) = cache.glob("*.json")
    assert not list(cache.glob("*.tmp"))
    entry = json.loads(path.read_text())
    assert len(base64.b64decode(entry["cubin"])) == int(sizes[0])


@pytest.mark.cutlass
def test_unwritable_cache_falls_back_to_a_temporary_folder(tmp_path, monkeypatch):
    """A cache path that cannot be made (its parent is a file) gives a warning naming
    both folders, and the entry lands in the fallback folder, where the next lookup finds
    it without compiling."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("QUACK_JAX_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(_cache, "fallback_dir", lambda: tmp_path / "fallback")
    monkeypatch.setattr(_cache, "PACKAGED", tmp_path / "packaged")
    monkeypatch.setattr(_cache, "_memory", {})
    tiling = choose_tiling(SOFTMAX_FWD, 700, 2)
    with pytest.warns(UserWarning, match="cannot write the kernel cache.*using .*fallback"):
        first = _cache.get_kernel(Softmax(), "float16", tiling, "sm_90a")
    assert len(list((tmp_path / "fallback").glob("*.json"))) == 1
    _cache._memory.clear()
    monkeypatch.setattr(_cache, "dsl_version", lambda: None)  # a compile would now fail
    assert _cache.get_kernel(Softmax(), "float16", tiling, "sm_90a") == first


@pytest.mark.cutlass
def test_packaged_cubins_are_found_without_cutlass(cache, monkeypatch):
    """An entry among the cubins packaged with quack_jax serves a lookup when the cache
    is empty and CuTe-DSL is absent (a user who installed only the wheel)."""
    tiling = choose_tiling(SOFTMAX_FWD, 2048, 2)
    built = _cache.get_kernel(Softmax(), "bfloat16", tiling, "sm_90a")
    (path,) = cache.glob("*.json")
    packaged = cache.parent / "packaged"
    packaged.mkdir()
    path.rename(packaged / path.name)
    _cache._memory.clear()
    monkeypatch.setattr(_cache, "dsl_version", lambda: None)
    assert _cache.get_kernel(Softmax(), "bfloat16", tiling, "sm_90a") == built
    assert not list(cache.glob("*.json"))


@pytest.fixture
def wheel_only(cache, monkeypatch):
    """The packaged cubins as the only ones to find, and no CuTe-DSL to compile a missing
    kernel: a user who installed only the wheel. Skips where they are not built (or were
    built from other kernel sources)."""
    built = list(PACKAGED.glob(f"*-{_cache.source_hash()}-dsl*.json"))
    if not built:
        pytest.skip(
            f"no cubins of these kernels in {PACKAGED}: python -m quack_jax.build --packaged"
        )
    monkeypatch.setattr(_cache, "PACKAGED", PACKAGED)
    monkeypatch.setattr(_cache, "dsl_version", lambda: None)
    return built


def test_packaged_cubins_run_the_quick_benchmark(wheel_only):
    """Every kernel that `python -m quack_jax.bench --quick` launches on an H200 (each
    benchmark's quick shapes, each dtype, forward and forward+backward) is packaged."""
    missing = []
    with _cache.kernels_used() as used:
        for op in bench.benchmarks().values():
            for dtype, (m, n) in itertools.product(bench.DTYPES, op.quick_shapes):
                args = [jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(m, n, dtype)]
                for case in (case for case in op.cases if case.kernel):
                    try:
                        build.lower_for_cuda(case.fn, args[: case.args])
                    except quack_jax.MissingKernelError as error:
                        missing.append(f"{op.name} {case.key} {dtype} {m}x{n}: {error}")
    assert not missing, "\n".join(missing)
    assert used


@pytest.mark.parametrize("dtype", build.DTYPES)
def test_packaged_cubins_run_per_row_head_losses(wheel_only, dtype):
    """Per-row losses of linear_cross_entropy and linear_token_logprobs with its entropy
    (the default options), over every packaged vocabulary at 8192 tokens and at as many
    tokens as the vocabulary (the most vocabulary slices the default chunk gives), find
    every kernel they launch among the packaged cubins."""
    from quack_jax.linear_cross_entropy import options

    missing = []
    for v in build.PACKAGED_SIZES["vocab"]:
        for t in (8192, v):
            h = jax.ShapeDtypeStruct((t, 64), dtype)
            w = jax.ShapeDtypeStruct((64, v), dtype)
            labels = jax.ShapeDtypeStruct((t,), "int32")

            def f(h, w, labels):
                logp, ent = quack_jax.linear_token_logprobs(h, w, labels, return_entropy=True)
                none = quack_jax.linear_cross_entropy(h, w, labels, reduction="none")
                return jnp.sum(logp + ent + none)

            try:
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(options, "_free_bytes", lambda: None)
                    build.lower_for_cuda(jax.grad(f, argnums=(0, 1)), (h, w, labels))
            except quack_jax.MissingKernelError as error:
                missing.append(f"{t} x {v}: {error}")
    assert not missing, "\n".join(missing)


def test_packaged_cubins_cover_the_packaged_row_lengths(wheel_only):
    """Each op with kernels has the same kernel variants packaged at each of its row
    lengths (``build.packaged_sizes``) in each dtype (but the norm backward's summing
    variant, which exists only where its tiling has no cluster of its own), and those
    lengths include the norms' QK-norm head sizes and every multiple of 256 up to 8192,
    and the 32000 vocabulary (Llama 2, Mistral v0.1) for cross-entropy."""
    name = re.compile(r"([a-z_]+)((?:-[a-z_]+=[^-]+)*)-([a-z0-9]+)-n(\d+)-")
    variants = collections.defaultdict(set)  # (op, dtype, n) -> kernel ops and variants
    for path in wheel_only:
        kernel, variant, dtype, n = name.match(path.name.replace("-summing=True", "")).groups()
        for op in _registry.public_ops(kernel):
            variants[op, dtype, int(n)].add(kernel + variant)
    hidden = {64, 128, *range(256, 8192 + 1, 256)}
    required = {"rms_norm": hidden, "layer_norm": hidden, "cross_entropy": {32000}}
    for op, spec in _registry.specs().items():
        sizes = build.packaged_sizes(spec)
        assert required.get(op, set()) <= set(sizes), op
        if not spec.configs:  # it launches another family's kernels
            continue
        for dtype in build.DTYPES:
            every = set().union(*(variants[op, dtype, n] for n in sizes))
            short = {n: gone for n in sizes if (gone := sorted(every - variants[op, dtype, n]))}
            assert every and not short, f"{op} {dtype} not packaged: {short}"


def test_missing_kernel_without_cutlass_names_the_build_command(cache, monkeypatch):
    monkeypatch.setattr(_cache, "dsl_version", lambda: None)
    tiling = choose_tiling(SOFTMAX_BWD, 5000, 4)
    with pytest.raises(quack_jax.MissingKernelError) as info:
        _cache.get_kernel(SoftmaxDerivative(), "float32", tiling, "sm_90a")
    message = str(info.value)
    assert "n=5000" in message and _cache.INSTALL_COMPILER in message
    assert "python -m quack_jax.build --arch sm_90a --ops softmax_bwd --dtypes float32" in message
    with pytest.raises(quack_jax.MissingKernelError, match="--ops log_softmax_jvp --dtypes bf"):
        _cache.get_kernel(SoftmaxDerivative(kind="log_jvp"), "bfloat16", tiling, "sm_90a")


@pytest.mark.cutlass
def test_build_command(cache):
    """The command a missing cubin's error names: a kernel op builds its family's public
    ops' kernels (softmax's and log_softmax's forwards and derivatives), the one named
    among them."""
    cmd = [
        sys.executable,
        "-m",
        "quack_jax.build",
        "--cache",
        str(cache),
        "--ops",
        "softmax_bwd",
        "--dtypes",
        "float16",
        "--sizes",
        "7",
        "65536",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    assert "softmax log_softmax: " in out
    for n in (7, 65536):
        assert len(list(cache.glob(f"softmax_bwd-float16-n{n}-*.json"))) == 1


def test_tiling_rules():
    with pytest.raises(ValueError, match="cluster needs at least a warp"):
        RowTiling(1024, 8, 16, 128, 2)
    with pytest.raises(ValueError, match="vec must divide n"):
        RowTiling(1000, 16, 32, 128, 1)
    for n in (1, 7, 100, 1000, 5000, 131071, 262144):
        for itemsize in (2, 4):
            for family in (SOFTMAX_FWD, SOFTMAX_BWD):
                t = choose_tiling(family, n, itemsize)
                assert t.vec * itemsize <= 16 and n % t.vec == 0
                assert t.cols_per_cta * t.cluster_n >= n > t.cols_per_cta * (t.cluster_n - 1)
    assert choose_tiling(SOFTMAX_BWD, 2**20, 4) is None


@pytest.mark.parametrize("family", [CE_FWD, CE_ENTROPY, CE_BWD], ids=repr)
def test_streamed_tilings_cover_the_row_in_steps(family):
    """Streamed from STREAM_MIN_ROWS rows on (long rows of 8-byte vectors only); each
    CTA's columns are whole steps of one group a thread; the tuner's streamed candidates
    obey the same."""
    for n in (1000, 16384, 16388, 32000, 50257, 151936, 262144):
        for rows in (1, STREAM_MIN_ROWS - 1, STREAM_MIN_ROWS, 10**6):
            t = choose_tiling(family, n, 2, rows=rows)
            long = n > 16384 and n % 4 == 0
            assert bool(t.group) == (rows >= STREAM_MIN_ROWS and long), (n, rows, t)
    assert not [c for c in candidate_tilings(family, 50257, 2) if c.group]
    for n in (32000, 151936, 262144):
        candidates = [c for c in candidate_tilings(family, n, 2) if c.group]
        assert candidates
        for t in [*candidates, choose_tiling(family, n, 2, rows=STREAM_MIN_ROWS)]:
            assert t.steps > 1 and t.steps * t.step_cols == t.cols_per_cta
            assert t.step_cols == t.group * t.vec * t.threads_per_row
            assert t.cols_per_cta * t.cluster_n >= n > t.cols_per_cta * (t.cluster_n - 1)
            assert t.live_elems <= 32


def test_ffi_library_loads_and_registers():
    lib = _ffi.load_library()
    assert lib.QuackJaxLaunch and lib.QuackJaxLaunchInitialize
    _ffi.register_target()
    assert _ffi.captured_launches() == 0


def test_ffi_library_builds_without_cuda(tmp_path):
    include = pathlib.Path(jax.ffi.include_dir())
    out = tmp_path / "lib.so"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-Wall",
            "-Werror",
            "-isystem",
            str(include),
            str(ROOT / "ffi" / "launcher.cc"),
            "-o",
            str(out),
            "-ldl",
        ],
        check=True,
    )
    symbols = subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert exported == {
        "QuackJaxLaunch",
        "QuackJaxLaunchInitialize",
        "QuackJaxCapturedLaunches",
        "QuackJaxMaxActiveClusters",
    }


def test_occupancy_query_failure_names_the_kernel():
    """The persistent grids' occupancy query raises, naming the kernel, where the driver
    fails (here without a GPU: no libcuda)."""
    kernel = _cache.CubinKernel("op", "some_kernel_name", b"not a cubin", 0)
    with pytest.raises(RuntimeError, match="quack_jax kernel some_kernel_name: "):
        _ffi.max_active_clusters(kernel, 128, 1, 0)


@pytest.mark.cutlass
def test_a_call_that_misses_a_kernel_parameter_is_an_error_at_lowering(cache):
    """The launcher passes a pointer per operand and result, then the scalars; a call
    whose count differs from the kernel's parameters (softmax's forward: x, y, m) raises
    at lowering, naming the kernel, instead of launching with the wrong arguments."""
    tiling = choose_tiling(SOFTMAX_FWD, 4096, 2)
    kernel = _cache.get_kernel(Softmax(), "bfloat16", tiling, "sm_90a")
    assert kernel.parameters == 3
    x = jax.ShapeDtypeStruct((4, 4096), jnp.bfloat16)
    good = _ffi.call(kernel, (4, 1, 1), tiling.block, (1, 1, 1), (4,), [x])
    text = jax.jit(good).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"custom_call @{_ffi.TARGET}") == 1
    bad = _ffi.call(kernel, (4, 1, 1), tiling.block, (1, 1, 1), (4,), [x, x])
    with pytest.raises(RuntimeError, match=f"{kernel.symbol} takes 3 parameters; .* pass 4 "):
        jax.jit(bad).trace(x)


@pytest.mark.skipif(sysconfig.get_platform() != "linux-x86_64", reason="manylinux: x86_64 only")
def test_wheel_is_manylinux_and_licensed(tmp_path):
    """`pip wheel .` makes one py3-none-manylinux wheel carrying the license and exactly
    the cubins of quack_jax/cubins (not one that an earlier build left in build/) and every
    module of quack_jax, and its
    library asks for no glibc symbol newer than the tag's floor and for no libstdc++."""
    source = tmp_path / "source"  # a copy, so no earlier build is reused
    stale = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "*.so", "__pycache__")
    shutil.copytree(ROOT, source, ignore=stale)
    (source / "quack_jax" / "cubins").mkdir(exist_ok=True)
    (source / "quack_jax" / "cubins" / "new-entry.json").write_text("{}")
    # setuptools' build folder of this platform and Python, where an earlier build copied
    # the package
    platform_lib = f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    earlier = source / "build" / platform_lib / "quack_jax" / "cubins"
    earlier.mkdir(parents=True)
    (earlier / "old-entry.json").write_text("{}")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path, source],
        check=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    name, version, python, abi, platform = wheel.stem.split("-")
    assert (python, abi) == ("py3", "none")
    floor = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", platform)
    assert floor, platform
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert "License-Expression: Apache-2.0" in archive.read(f"{dist_info}/METADATA").decode()
        cubins = {n for n in archive.namelist() if n.startswith("quack_jax/cubins/")}
        packaged = {p.name for p in (source / "quack_jax" / "cubins").glob("*.json")}
        assert cubins == {f"quack_jax/cubins/{name}" for name in packaged}
        assert "quack_jax/cubins/new-entry.json" in cubins
        sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "quack_jax").rglob("*.py")}
        missing = sources - set(archive.namelist())
        assert not missing, f"modules missing from the wheel: {sorted(missing)}"
        library = archive.extract("quack_jax/libquack_jax_ffi.so", tmp_path)
    if shutil.which("objdump") is None:
        pytest.skip("objdump is needed to read the library's symbol versions")
    symbols = subprocess.run(["objdump", "-T", library], capture_output=True, text=True).stdout
    glibc = {tuple(map(int, v.split("."))) for v in re.findall(r"\(GLIBC_([\d.]+)\)", symbols)}
    assert glibc and max(glibc) <= tuple(map(int, floor.groups())), sorted(glibc)
    assert not re.findall(r"\((?:GLIBCXX|CXXABI)_[\d.]+\)", symbols)


@pytest.mark.cutlass
def test_bench_reads_each_tuned_kernels_own_tiling(cache, monkeypatch):
    """The bench's tiling columns and the tuner's first candidate are the tiling each
    tuned function launches: cross-entropy's forward with the gradient (ce_grad) and
    without (ce_fwd) have one kernel name and different tables."""
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")
    op = bench.benchmarks()["cross_entropy"]
    arguments = [jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(1024, 1024, "float32")]
    launched = {t.name: bench.launched_tiling(t, arguments) for t in op.tuned}
    assert launched == {t.name: choose_tiling(t.family, 1024, 4) for t in op.tuned}
    assert launched["fwd"] != launched["grad"]
    # asked again (the bench's row, then its tuner): JAX's lowering cache must not hide it
    assert {t.name: bench.launched_tiling(t, arguments) for t in op.tuned} == launched


@pytest.mark.cutlass
def test_a_dtype_table_reaches_the_kernel(cache, monkeypatch):
    """ce_grad has a table of its own for bfloat16: at n = 152064 the kernel that the mean
    loss's gradient launches takes it for bfloat16, and float16 takes the 16-bit table."""
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")
    op = bench.benchmarks()["cross_entropy"]
    grad = next(t for t in op.tuned if t.name == "grad")
    launched = {}
    for dtype in ("bfloat16", "float16"):
        arguments = [jax.ShapeDtypeStruct(s, d) for s, d, *_ in op.arguments(8, 152064, dtype)]
        launched[dtype] = bench.launched_tiling(grad, arguments).tag
    assert launched == {"bfloat16": "t256x256c8v8", "float16": "t1024x1024c4v8"}
    assert choose_tiling(CE_GRAD, 152064, 2).tag == "t1024x1024c4v8"


@pytest.mark.cutlass
def test_cuda_lowering_launches_kernels(cache, monkeypatch):
    """Lowered for a CUDA device (here, without one), the ops become kernel launches."""
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")

    def lowered(fn, x):
        return jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()

    x = jnp.zeros((4, 7, 1000), jnp.bfloat16)
    grad = jax.grad(lambda x: jnp.sum(quack_jax.log_softmax(x).astype(jnp.float32) ** 2))
    text = lowered(grad, x)
    assert text.count(f"custom_call @{_ffi.TARGET}") == 2
    rows_per_cta = choose_tiling(SOFTMAX_FWD, 1000, 2).rows_per_cta
    assert f"grid = dense<[{-(-28 // rows_per_cta)}, 1, 1]>" in text
    assert "scalars = dense<28>" in text
    # log-softmax's derivative reads x: only it runs when nothing uses the forward output;
    # softmax's reads y, so its forward kernel runs too
    jvp_text = lowered(lambda x: jax.jvp(quack_jax.log_softmax, (x,), (x,))[1], x)
    assert jvp_text.count(f"custom_call @{_ffi.TARGET}") == 1
    vjp_text = lowered(lambda x: jax.vjp(quack_jax.softmax, x)[1](x)[0], x)
    assert vjp_text.count(f"custom_call @{_ffi.TARGET}") == 2
    assert {k[0] for k in _cache._memory} == {
        "log_softmax_fwd",
        "log_softmax_bwd",
        "log_softmax_jvp",
        "softmax_fwd",
        "softmax_bwd",
    }
    # float64 has no kernel, nor an empty array: both lower to the XLA reference
    with jax.enable_x64(True):
        assert _ffi.TARGET not in lowered(quack_jax.softmax, jnp.zeros((4, 8), jnp.float64))
    assert _ffi.TARGET not in lowered(quack_jax.softmax, jnp.zeros((0, 8), jnp.float32))


@pytest.mark.cutlass
def test_lowering_hooks_record_the_kernels_and_set_the_grid(cache, monkeypatch):
    """``_cache.kernels_used`` lists the kernels a lowering takes; a persistent kernel
    gets one wave, or one CTA per row block where its family's rule says so (the float32
    norm forwards up to n = 8192) or inside ``_lowering.lowering(one_wave=False)``. The
    norm forward stages its rows in shared memory on one wave only."""
    monkeypatch.setenv("QUACK_JAX_CUDA_ARCH", "sm_90a")
    x = jnp.zeros((65536, 1024), jnp.bfloat16)

    def grid(x=x):
        fresh = jax.jit(lambda x: quack_jax.rms_norm(x))  # not JAX's cached lowering
        text = fresh.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        return int(text.split("grid = dense<[", 1)[1].split(",", 1)[0])

    with _cache.kernels_used() as outer:
        with _cache.kernels_used() as used:
            one_wave = grid()
        with _cache.kernels_used() as again:
            grid()
    assert used == again == outer
    ((op, dtype, tiling, variant),) = used
    assert (op, dtype, variant) == ("rms_norm_fwd", "bfloat16", ())
    with lowering(one_wave=False), _cache.kernels_used() as used:
        assert grid() == 65536 // tiling.rows_per_cta > one_wave
    assert [variant for *_, variant in used] == [(("staged", False),)]
    assert grid() == one_wave
    for n in (1024, 8192):
        x32 = jax.ShapeDtypeStruct((65536, n), jnp.float32)  # traced, never allocated
        with _cache.kernels_used() as used:
            full = grid(x32)
        ((_, dtype, tiling, variant),) = used
        assert dtype == "float32" and full == 65536 // tiling.rows_per_cta
        assert variant == (("staged", False),)
        with lowering(one_wave=True), _cache.kernels_used() as used:
            assert grid(x32) < full
        assert [variant for *_, variant in used] == [()]


@pytest.mark.cutlass
@pytest.mark.parametrize("op", _registry.kernel_configs())
def test_kernel_configs_match_the_kernels(op):
    """Each kernel class takes its configuration's scalars, whose names are its kernel's
    parameters after ``m``, in order; the configuration's options and selecting fields
    are keyword arguments of the kernel class; its default is one of its kernel ops."""
    import inspect

    from quack_jax import kernels

    config = _registry.kernel_configs()[op]
    cls, fixed = kernels.kernel_class(config.kernel_class), config.kernels[op]
    assert list(cls.scalars.items()) == list(config.scalar_types().items())
    params = list(inspect.signature(cls.kernel).parameters)
    assert params[params.index("m") + 1 :] == list(config.scalar_types())
    init = inspect.signature(cls.__init__).parameters
    assert {f.name for f in config._fields("option")} <= set(init)
    assert set(fixed) == {f.name for f in config._fields(None)} <= set(init)
    assert config().op in config.kernels


def test_cuda_lowering_without_arch_uses_the_reference(monkeypatch):
    monkeypatch.delenv("QUACK_JAX_CUDA_ARCH", raising=False)
    x = jnp.zeros((4, 1024), jnp.float32)
    text = jax.jit(quack_jax.softmax).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert _ffi.TARGET not in text


@pytest.mark.cutlass
def test_every_norm_variant_compiles(cache):
    """The norm kernels of every usual operand mix (weights none, in x's dtype or float32;
    residual, pre-norm), each dtype, at sizes that take one warp, a CTA and a cluster."""
    norms = ("rms_norm", "layer_norm")
    build.build(norms, build.DTYPES, [7, 4096, 65536], "sm_90a", verbose=False)
    entries = sorted(cache.glob("*norm*.json"))
    ops = {path.name.split("-")[0] for path in entries}
    assert ops == {"rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd"}
    assert len(entries) > 150
    for path in entries:
        assert cubin_arch(base64.b64decode(json.loads(path.read_text())["cubin"])) == 90
    # the backward that sums its own partials on one cluster (few rows), beside the one
    # whose partials XLA sums (many rows)
    names = {path.name for path in entries}
    summing = {name for name in names if "-summing=True" in name}
    assert {name.replace("-summing=True", "") for name in summing} <= names
    for op, n in itertools.product(norms, (7, 4096)):
        assert any(name.startswith(f"{op}_bwd") and f"-n{n}-" in name for name in summing)


@pytest.mark.cutlass
@pytest.mark.parametrize("rows", [8, 2 * STREAM_MIN_ROWS])
def test_a_build_holds_the_kernels_of_every_row_count(cache, rows):
    """Lowered at few rows or at many, a build gets both the register-resident forward
    (fewer than STREAM_MIN_ROWS rows) and the streamed one (many rows) of a long row:
    lowered only at 4096 rows, the latency benchmark's rows of 1 to 512 had no kernel."""
    args = (
        jax.ShapeDtypeStruct((rows, 131072), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )
    with _cache.kernels_used() as used:
        build.lower_for_cuda(
            lambda x, labels: quack_jax.cross_entropy(x, labels, reduction="none"),
            args,
            any_rows=True,
        )
    assert {tiling.group > 0 for _, _, tiling, _ in used} == {False, True}


@pytest.mark.cutlass
def test_a_build_holds_both_norm_backwards_at_any_row_count(cache):
    """Lowered at one row, a build also gets the norm backward that sums its own weight
    gradient in one cluster (2-16 row blocks), beside the one whose partials XLA sums:
    built at their cases' row counts only, some of the fuzz tests' draws had no kernel."""
    n = 1000
    args = (jax.ShapeDtypeStruct((1, n), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.float32))

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(quack_jax.rms_norm, x, w)
        return vjp(y)

    with _cache.kernels_used() as used:
        build.lower_for_cuda(fwd_bwd, args, any_rows=True)
    backwards = [dict(variant) for op, _, _, variant in used if op == "rms_norm_bwd"]
    assert sorted(b.get("summing", False) for b in backwards) == [False, True]


@pytest.mark.cutlass
def test_every_cross_entropy_variant_compiles(cache):
    """Forward kernels (with and without the gradient) and backward kernels, with and
    without label smoothing and softcap, each dtype, from a one-warp row to odd-length
    and 16-CTA rows; and the streamed ones that many rows of 262144 take in 2-byte
    dtypes (the forward without the gradient and the backward)."""
    sizes = [2, 1000, 50257, 262144]
    build.build(["cross_entropy"], build.DTYPES, sizes, "sm_90a", verbose=False)
    entries = sorted(cache.glob("cross_entropy*.json"))
    assert {path.name.split("-")[0] for path in entries} == {
        "cross_entropy_fwd",
        "cross_entropy_bwd",
    }
    streamed = [p for p in entries if re.search(r"-t\d+x\d+c\d+v\d+g\d+-", p.name)]
    assert len(entries) - len(streamed) == 3 * len(sizes) * (8 + 2)
    assert len(streamed) == 2 * (4 + 2) and all("-n262144-" in p.name for p in streamed)
    for path in entries:
        assert cubin_arch(base64.b64decode(json.loads(path.read_text())["cubin"])) == 90
