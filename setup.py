"""Builds the FFI launcher (ffi/launcher.cc) into quack_jax/libquack_jax_ffi.so.

The library is plain C ABI, loaded with ctypes, so it does not depend on the Python
version. It needs only a C++17 compiler and the XLA FFI headers that jaxlib ships; the
CUDA driver is opened at run time.
"""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext


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


class AnyPythonWheel(bdist_wheel):
    """The library is loaded with ctypes, not imported: one wheel serves every Python 3."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(
    ext_modules=[
        SharedLibrary(
            "quack_jax.quack_jax_ffi",
            sources=["ffi/launcher.cc"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": BuildSharedLibrary, "bdist_wheel": AnyPythonWheel},
)
