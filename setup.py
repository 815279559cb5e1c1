"""Builds the FFI launcher (ffi/launcher.cc) into quack_jax/libquack_jax_ffi.so.

The library is plain C ABI, loaded with ctypes, so it does not depend on the Python
version. It needs only a C++17 compiler and the XLA FFI headers that jaxlib ships; the
CUDA driver is opened at run time.

On x86_64 Linux it is built for a manylinux_2_17 wheel, whatever the build machine's
glibc: libstdc++ is linked in (its symbols hidden, its unused parts dropped), so the
library needs no libstdc++ of the user's, and the few glibc symbols whose default version
is newer than 2.17 are bound to their oldest version (ffi/glibc_compat.cc).
"""

import importlib.util
import os
import pathlib
import sysconfig

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py


class SharedLibrary(Extension):
    """A shared library for ctypes, not a Python extension module."""


class BuildSharedLibrary(build_ext):
    def get_ext_filename(self, fullname):
        if isinstance(self.ext_map.get(fullname), SharedLibrary):
            package, _, name = fullname.rpartition(".")
            return os.path.join(*package.split("."), f"lib{name}.so")
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext):
        return [] if isinstance(ext, SharedLibrary) else super().get_export_symbols(ext)

    def build_extension(self, ext):
        if isinstance(ext, SharedLibrary):
            jaxlib = importlib.util.find_spec("jaxlib")
            if jaxlib is None:
                raise RuntimeError("building quack_jax needs jaxlib for the XLA FFI headers")
            (jaxlib_dir,) = jaxlib.submodule_search_locations
            ext.include_dirs.append(os.path.join(jaxlib_dir, "include"))
        super().build_extension(ext)


class BuildPackage(build_py):
    """Copies the package into the build folder, where the prebuilt kernels must be
    exactly those of quack_jax/cubins: a cubin an earlier build left there is removed, or
    the wheel would carry it."""

    def run(self):
        super().run()
        source = pathlib.Path("quack_jax", "cubins")
        for path in pathlib.Path(self.build_lib, "quack_jax", "cubins").glob("*.json"):
            if not (source / path.name).exists():
                path.unlink()


MANYLINUX = sysconfig.get_platform() == "linux-x86_64"
# the symbols ffi/glibc_compat.cc binds to their oldest glibc version
GLIBC_WRAPPED = ["dlopen", "dlsym", "dlerror", "pthread_once", "__libc_single_threaded"]


class AnyPythonWheel(bdist_wheel):
    """The library is loaded with ctypes, not imported: one wheel serves every Python 3."""

    def get_tag(self):
        return ("py3", "none", "manylinux_2_17_x86_64" if MANYLINUX else super().get_tag()[2])


if MANYLINUX:
    linking = {
        "sources": ["ffi/launcher.cc", "ffi/glibc_compat.cc"],
        "extra_link_args": [
            "-static-libstdc++",
            "-Wl,--exclude-libs,ALL",
            "-Wl,--gc-sections",
            "-Wl,--strip-debug",
            *(f"-Wl,--wrap={name}" for name in GLIBC_WRAPPED),
            # where glibc is older than 2.34, the oldest dlopen and pthread_once live here
            "-Wl,--no-as-needed",
            "-l:libdl.so.2",
            "-l:libpthread.so.0",
            "-Wl,--as-needed",
        ],
    }
else:
    linking = {"sources": ["ffi/launcher.cc"], "libraries": ["dl"]}

setup(
    ext_modules=[
        SharedLibrary(
            "quack_jax.quack_jax_ffi",
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
            depends=["setup.py"],  # relinked when the flags here change
            **linking,
        )
    ],
    cmdclass={
        "build_ext": BuildSharedLibrary,
        "build_py": BuildPackage,
        "bdist_wheel": AnyPythonWheel,
    },
)
