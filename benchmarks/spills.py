"""Registers and register spills of compiled kernels, read from their SASS.

    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm  # any venv; not a dependency
    python benchmarks/spills.py CACHE [REGEX]

For each cubin in the cache folder CACHE (``QUACK_JAX_CACHE``'s layout: one JSON file per
kernel) whose file name matches REGEX, prints its registers per thread and its STL and
LDL instructions (stores to and loads from local memory: the spills). ``cuobjdump`` is
taken from PATH, or from the ``nvidia-cuda-cuobjdump`` wheel of this interpreter's
environment; it needs ``nvdisasm`` beside it or on PATH. No GPU needed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from quack_jax._cache import cubin_registers


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    wheel = pathlib.Path(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "bin", "cuobjdump")
    if found or wheel.exists():
        return found or str(wheel)
    sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def spills(cubin: bytes, tool: str) -> tuple[int, int]:
    """(STL, LDL) instructions in the SASS of ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        path = os.pathsep.join([str(pathlib.Path(tool).parent), os.environ.get("PATH", "")])
        sass = subprocess.run(
            [tool, "-sass", f.name], capture_output=True, text=True, check=True, env={"PATH": path}
        ).stdout
    return len(re.findall(r"\bSTL\b", sass)), len(re.findall(r"\bLDL\b", sass))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cache", type=pathlib.Path)
    parser.add_argument("regex", nargs="?", default="", help="only files whose name matches")
    args = parser.parse_args()
    tool = cuobjdump()
    for path in sorted(args.cache.glob("*.json")):
        if re.search(args.regex, path.name):
            cubin = base64.b64decode(json.loads(path.read_text())["cubin"])
            stores, loads = spills(cubin, tool)
            print(f"{path.stem}  registers {cubin_registers(cubin)}  STL {stores}  LDL {loads}")


if __name__ == "__main__":
    main()
