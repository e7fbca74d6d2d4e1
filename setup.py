"""Only the optional C kernel of the statistics level; everything else is in pyproject.toml.

`oneiter/format/_statskernel.c` is built when a C compiler is present; without one the install still succeeds
(`optional=True`) and `--level stats` reduces with torch instead (`oneiter/format/stats.py`)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("oneiter.format._statskernel", ["oneiter/format/_statskernel.c"],
                             extra_compile_args=["-O3"], optional=True)])
