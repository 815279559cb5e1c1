"""The on-disk cubin cache.

One JSON file per kernel configuration holds the cubin (base64), its kernel symbol, its
dynamic shared memory and a SHA-256 of the cubin. Files are named by op, dtype, row
length, tiling, variant (the op's options: other dtypes, optional operands), arch, a
hash of the kernel sources and the CuTe-DSL version that built them, written
atomically (temporary file, then rename), and checked against their SHA-256 when read,
so concurrent writers and torn files are both harmless.

The folder is ``$QUACK_JAX_CACHE``, else ``$XDG_CACHE_HOME/quack_jax``, else
``~/.cache/quack_jax``; where it cannot be written (read-only, or not a folder), new
entries go to a folder in the temporary directory instead, with a warning. Lookups also
read the cubins packaged with quack_jax (``quack_jax/cubins``, built for the common
configurations when the wheel is made). On a miss the kernel is compiled with CuTe-DSL,
imported only then; without CuTe-DSL a miss is an error that names the config and the
build command. Why the key is what it is (any edit under ``kernels/`` or of
``_tiling.py``, a comment too, changes it): docs/decisions/003-cubin-cache-key.md.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import struct
import tempfile
import threading
import warnings

from ._configs import KernelConfig
from ._lowering import lowering, options
from ._tiling import RowTiling

# The command that installs what compiles kernels, named by every error that needs it.
INSTALL_COMPILER = "pip install 'nvidia-cutlass-dsl[cu13]~=4.8.1' 'cuda-python>=13'"


class MissingKernelError(RuntimeError):
    """A kernel configuration is not in the cache and CuTe-DSL is not installed to build it."""


@dataclasses.dataclass(frozen=True)
class CubinKernel:
    op: str
    symbol: str
    cubin: bytes
    smem_bytes: int

    @property
    def digest(self) -> int:
        """A signed 64-bit digest of cubin and symbol: the launcher's module-cache key."""
        h = hashlib.sha256(self.cubin + self.symbol.encode()).digest()
        return int.from_bytes(h[:8], "little", signed=True)

    @property
    def registers(self) -> int:
        """Registers per thread, from the cubin's EIATTR_REGCOUNT (0 if absent)."""
        return cubin_registers(self.cubin)

    @property
    def parameters(self) -> int:
        """The kernel's parameters: its EIATTR_KPARAM_INFO records (one per parameter)."""
        return sum(attr == 0x17 for attr, _ in nv_info(self.cubin, f".nv.info.{self.symbol}"))


def cubin_registers(cubin: bytes) -> int:
    """The register count of an ELF64 cubin: EIATTR_REGCOUNT (0x2f) in ``.nv.info`` holds
    (function symbol u32, registers u32)."""
    records = nv_info(cubin, ".nv.info")
    return next((struct.unpack_from("<I", v, 4)[0] for a, v in records if a == 0x2F), 0)


def nv_info(cubin: bytes, section: str):
    """(attribute, payload) of each attribute record in ``section`` of an ELF64 cubin
    (``.nv.info``, or ``.nv.info.<kernel>``): records are (format u8, attribute u8, then a
    u16 size and payload for format 4; other formats carry no payload here)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = sections[names][4]
    for name, _, _, _, offset, size, *_ in sections:
        if cubin[strtab + name : cubin.index(b"\0", strtab + name)] != section.encode():
            continue
        at = offset
        while at < offset + size:
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt == 4:
                length = struct.unpack_from("<H", cubin, at + 2)[0]
                yield attr, cubin[at + 4 : at + 4 + length]
                at += 4 + length
            else:
                yield attr, b""
                at += 4 if fmt in (2, 3) else 2


PACKAGED = pathlib.Path(__file__).with_name("cubins")


def cache_dir() -> pathlib.Path:
    if path := os.environ.get("QUACK_JAX_CACHE"):
        return pathlib.Path(path)
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "quack_jax"


def fallback_dir() -> pathlib.Path:
    """Where entries go when the cache folder cannot be written."""
    return pathlib.Path(tempfile.gettempdir()) / f"quack_jax-{os.getuid()}"


def search_dirs() -> list[pathlib.Path]:
    """The folders a lookup reads, in order."""
    return [cache_dir(), fallback_dir(), PACKAGED]


def dsl_version() -> str | None:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


_source_hash: str | None = None


def source_files() -> list[pathlib.Path]:
    """Everything that decides a cubin's contents: the kernels, the tiling, and the kernel
    configurations, whose fields the kernels read (their variants' options and their
    scalar lists): ``_configs.py`` and each family's ``config.py``."""
    spec = importlib.util.find_spec("quack_jax.kernels")
    kernel_dir = pathlib.Path(next(iter(spec.submodule_search_locations)))
    package = pathlib.Path(__file__).parent
    return [
        *sorted(kernel_dir.glob("*.py")),
        package / "_tiling.py",
        package / "_configs.py",
        *sorted(package.glob("*/config.py")),
    ]


def source_hash() -> str:
    """Hash of the names and bytes of ``source_files``."""
    global _source_hash
    if _source_hash is None:
        h = hashlib.sha256()
        for f in source_files():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        _source_hash = h.hexdigest()[:16]
    return _source_hash


def variant_tag(variant: tuple) -> str:
    return "".join(f"-{k}={v}" for k, v in variant)


def entry_stem(op: str, dtype: str, tiling: RowTiling, arch: str, variant: tuple = ()) -> str:
    return f"{op}{variant_tag(variant)}-{dtype}-n{tiling.n}-{tiling.tag}-{arch}-{source_hash()}"


def stale_entries(folder: pathlib.Path) -> list[pathlib.Path]:
    """The entries in ``folder`` of other kernel sources (``source_hash``), which no
    lookup finds."""
    return [p for p in folder.glob("*.json") if f"-{source_hash()}-dsl" not in p.name]


def build_command(op: str, dtype: str, tiling: RowTiling, arch: str) -> str:
    """The build command for kernel ``op``, which builds the public ops that launch it."""
    return f"python -m quack_jax.build --arch {arch} --ops {op} --dtypes {dtype} --sizes {tiling.n}"


_memory: dict[tuple, CubinKernel] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def kernels_used():
    """Collects the kernels, as (op, dtype, tiling, variant), that ``get_kernel`` returns
    inside the block, each once, in the order first returned (so, lowering on a kernel
    device or for one: the kernels launched): the keys of the dict it yields. Blocks
    nest; each collects its own."""
    used: dict = {}
    with lowering(recorders=(*options().recorders, used)):
        yield used


def _read(path: pathlib.Path, op: str) -> CubinKernel | None:
    try:
        entry = json.loads(path.read_text())
        cubin = base64.b64decode(entry["cubin"])
        if hashlib.sha256(cubin).hexdigest() != entry["sha256"]:
            return None
        return CubinKernel(op, entry["symbol"], cubin, int(entry["smem_bytes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(name: str, kernel: CubinKernel, version: str) -> None:
    """Store an entry in the cache folder, or where that cannot be written, in the
    fallback folder (with a warning)."""
    entry = {
        "symbol": kernel.symbol,
        "smem_bytes": kernel.smem_bytes,
        "dsl_version": version,
        "sha256": hashlib.sha256(kernel.cubin).hexdigest(),
        "cubin": base64.b64encode(kernel.cubin).decode(),
    }
    try:
        _write_atomic(cache_dir() / name, entry)
    except OSError as e:
        fallback = fallback_dir()
        warnings.warn(
            f"quack_jax: cannot write the kernel cache at {cache_dir()} ({e}); "
            f"using {fallback} instead (set QUACK_JAX_CACHE to a writable folder)",
            stacklevel=3,
        )
        try:
            _write_atomic(fallback / name, entry)
        except OSError as e2:
            warnings.warn(f"quack_jax: cannot write {fallback} either ({e2})", stacklevel=3)


def _write_atomic(path: pathlib.Path, entry: dict) -> None:
    """Write a temporary file beside ``path``, then rename it over ``path``: readers see
    the old entry or the new one, never a part of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(entry, f)
    os.replace(f.name, path)


def get_kernel(config: KernelConfig, dtype: str, tiling: RowTiling, arch: str) -> CubinKernel:
    """The cubin of ``config``'s kernel for rows of ``dtype`` with ``tiling``: from
    memory, the cache folder, or a fresh compile."""
    kernel = _get_kernel(config, dtype, tiling, arch)
    for seen in options().recorders:
        seen[config.op, dtype, tiling, config.variant()] = None
    return kernel


def _get_kernel(config: KernelConfig, dtype: str, tiling: RowTiling, arch: str):
    op, variant = config.op, config.variant()
    key = (op, dtype, tiling, arch, variant, os.environ.get("QUACK_JAX_CACHE"))
    with _lock:
        if key in _memory:
            return _memory[key]
        stem = entry_stem(op, dtype, tiling, arch, variant)
        version = dsl_version()
        # Without CuTe-DSL any build of these sources will do; with it, only its own.
        pattern = f"{stem}-dsl{version}.json" if version else f"{stem}-dsl*.json"
        for folder in search_dirs():
            for path in sorted(folder.glob(pattern)):
                if kernel := _read(path, op):
                    _memory[key] = kernel
                    return kernel
        if version is None:
            raise MissingKernelError(
                f"quack_jax has no cubin for {op}{variant_tag(variant)} ({dtype}, n={tiling.n}, "
                f"{tiling.tag}, {arch}) "
                f"in {cache_dir()} or among the cubins packaged with quack_jax, and "
                f"nvidia-cutlass-dsl is not installed to compile it. Install "
                f"it with `{INSTALL_COMPILER}`, or build the cubin elsewhere with "
                f"`{build_command(op, dtype, tiling, arch)}` and point QUACK_JAX_CACHE at it."
            )
        from . import kernels

        compiled = kernels.compile_kernel(config, dtype, tiling, arch)
        kernel = CubinKernel(op, compiled.symbol, compiled.cubin, compiled.smem_bytes)
        _write(f"{stem}-dsl{version}.json", kernel, version)
        _memory[key] = kernel
        return kernel
