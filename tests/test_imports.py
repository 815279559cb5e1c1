"""The package's import structure: no import circle among quack_jax's modules (imports
inside functions included, and the modules imported by name: ``importlib.import_module``
and the kernel classes that configurations name), the runtime never importing the
tooling, JAX's private API used in one module only, and one clear line naming the
install where an optional dependency is missing."""

import ast
import importlib.util
import pathlib
import subprocess
import sys

import quack_jax
from quack_jax import _cache, _registry

PACKAGE = pathlib.Path(quack_jax.__file__).parent
KERNELS = pathlib.Path(
    next(iter(importlib.util.find_spec("quack_jax.kernels").submodule_search_locations))
)
# What builds, benchmarks and tests the ops; the runtime (everything else) must not need it.
TOOLING = {
    "quack_jax._registry",
    "quack_jax._spec",
    "quack_jax.build",
    "quack_jax.bench",
    "quack_jax._timing",
    "quack_jax._report",
}


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


def names(tree: ast.Module) -> dict[str, list[str]]:
    """The strings that a name stands for: a module-level list or tuple of strings, and
    the variable of a loop or comprehension over one."""
    constants = {
        target.id: [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    loops = {
        node.target.id: constants[node.iter.id]
        for node in ast.walk(tree)
        if isinstance(node, ast.For | ast.comprehension)
        and isinstance(node.target, ast.Name)
        and isinstance(node.iter, ast.Name)
        and node.iter.id in constants
    }
    return constants | loops


def by_name(node: ast.Call, strings: dict[str, list[str]]) -> list[str]:
    """The modules that an ``importlib.import_module`` call imports: its literal, or the
    strings its name stands for."""
    func, arg = node.func, node.args[0] if node.args else None
    if not (isinstance(func, ast.Attribute) and func.attr == "import_module"):
        return []
    if isinstance(arg, ast.Constant):
        return [arg.value]
    return strings.get(arg.id, []) if isinstance(arg, ast.Name) else []


def imports(name: str, path: pathlib.Path, tree: ast.Module, known) -> set[str]:
    """The quack_jax modules that ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    strings = names(tree)
    out = set()
    for node in ast.walk(tree):
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
        elif isinstance(node, ast.Call):
            out |= set(by_name(node, strings)) & set(known)
    return out - {name}


def kernel_modules(tree: ast.Module) -> set[str]:
    """The kernel modules that the configurations in ``tree`` name (``kernel_class =
    "module:Class"``), which ``quack_jax.kernels`` imports when it compiles them."""
    named = [
        node.value.value.split(":")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and any(isinstance(t, ast.Name) and t.id == "kernel_class" for t in node.targets)
    ]
    return {module if "." in module else f"quack_jax.kernels.{module}" for module in named}


def graph() -> dict[str, set[str]]:
    """Each quack_jax module, and the quack_jax modules it imports."""
    known = modules()
    trees = {name: ast.parse(path.read_text()) for name, path in known.items()}
    edges = {name: imports(name, known[name], trees[name], known) for name in known}
    edges["quack_jax.kernels"] |= set().union(*map(kernel_modules, trees.values())) & set(known)
    return edges


def test_the_edgesholds_the_imports_by_name():
    edges = graph()
    assert set(_registry.FAMILIES) & set(edges) <= edges["quack_jax._registry"]
    assert "quack_jax.softmax.spec" in edges["quack_jax._registry"]
    kernels = {"quack_jax.kernels.softmax", "quack_jax.kernels.norm"}
    assert kernels <= edges["quack_jax.kernels"]


def test_no_import_circle():
    edges = graph()
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import circle: " + " -> ".join([*trail, name])
        state[name] = "open"
        for dep in sorted(edges[name]):
            visit(dep, [*trail, name])
        state[name] = "done"

    for name in edges:
        visit(name, [])


def tooling(name: str) -> bool:
    return name in TOOLING or name.endswith(".spec")


def test_the_runtime_never_imports_the_tooling():
    """The tooling (the op registry, the specs, build and bench) may import the runtime,
    never the reverse: a runtime module (any other, the kernels included) imports no
    tooling module, so nothing the runtime imports, lazily or by name, reaches one."""
    wrong = [
        f"{name} -> {dep}"
        for name, deps in sorted(graph().items())
        if not tooling(name)
        for dep in sorted(deps)
        if tooling(dep)
    ]
    assert not wrong, wrong


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
