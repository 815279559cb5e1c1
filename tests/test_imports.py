"""The package's import structure: no import circle among quack_jax's modules (imports
inside functions included), JAX's private API used in one module only, and one clear
line naming the install where an optional dependency is missing."""

import ast
import importlib.util
import pathlib
import subprocess
import sys

import quack_jax
from quack_jax import _cache

PACKAGE = pathlib.Path(quack_jax.__file__).parent
KERNELS = pathlib.Path(
    next(iter(importlib.util.find_spec("quack_jax.kernels").submodule_search_locations))
)


def modules() -> dict[str, pathlib.Path]:
    """quack_jax's modules (the kernels package included) by dotted name."""
    found = {}
    for root, prefix in ((PACKAGE, "quack_jax"), (KERNELS, "quack_jax.kernels")):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def imports(name: str, path: pathlib.Path, known) -> set[str]:
    """The quack_jax modules that ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names} & set(known)
            # "from . import x" imports the submodule x; "from .m import y", module m
            out |= subs if subs else {base} & set(known)
    return out - {name}


def test_no_import_circle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import circle: " + " -> ".join([*trail, name])
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, [*trail, name])
        state[name] = "done"

    for name in graph:
        visit(name, [])


def test_private_jax_api_in_one_module():
    users = {
        name
        for name, path in modules().items()
        if "jax._src" in path.read_text() and not name.endswith("_jax_private")
    }
    assert not users, users


WITHOUT = """
import importlib.util, runpy, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: (
    None if name.split(".")[0] == {missing!r} else real(name, *a)
)
{run}
"""


def without(missing: str, run: str) -> subprocess.CompletedProcess:
    """``run`` in a fresh Python in which ``missing`` looks not installed."""
    code = WITHOUT.format(missing=missing, run=run)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_build_without_cutdsl_says_what_to_install():
    """``python -m quack_jax.build`` without CuTe-DSL: one line naming the install, exit 1."""
    run = 'sys.argv = ["x"]; runpy.run_module("quack_jax.build", run_name="__main__")'
    done = without("cutlass", run)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert _cache.INSTALL_COMPILER in done.stderr


def test_flax_modules_without_flax_say_what_to_install():
    """``import quack_jax.flax`` without Flax: a ModuleNotFoundError naming the install."""
    run = """
try:
    import quack_jax.flax
except ModuleNotFoundError as error:
    print(error)
"""
    done = without("flax", run)
    assert done.returncode == 0 and done.stdout.strip().count("\n") == 0, done.stderr
    assert "pip install flax" in done.stdout
