"""Build of the Cython extensions shmeval._ring (the shared-memory ring),
shmeval.mcts._tree (the search tree of shmeval.mcts), shmeval.games._connect4
(Connect Four's moves and encoding) and shmeval.bench._timing (the benchmark
suite's timing in C); everything else is in pyproject.toml.

SHMEVAL_DEBUG=1 builds with -DSHM_DEBUG: state-machine assertions in the C
core (_core/ring.h and the headers under _core/ring/).
"""
import glob
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("SHMEVAL_DEBUG") == "1"

# The C core's headers: a change to any of them rebuilds the extensions.
core_headers = sorted(glob.glob("src/shmeval/_core/*.h") + glob.glob("src/shmeval/_core/ring/*.h"))

ext = Extension(
    "shmeval._ring",
    sources=["src/shmeval/_ring.pyx"],  # includes _core/pyx/*.pxi
    include_dirs=["src/shmeval/_core", np.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), ("_GNU_SOURCE", None)]
    + ([("SHM_DEBUG", None)] if debug else []),
    extra_compile_args=["-std=gnu11", "-O2"] + (["-UNDEBUG", "-g"] if debug else []),
    depends=core_headers,
)

# The benchmark suite's timing (the ping-pong reference, the timed loop): an
# extension of its own, so that the ring carries no benchmark code.  Its
# header, pingpong.h, builds on ring.h's primitives.
timing = Extension(
    "shmeval.bench._timing",
    sources=["src/shmeval/bench/_timing.pyx"],
    include_dirs=["src/shmeval/bench", "src/shmeval/_core", np.get_include()],
    define_macros=ext.define_macros,
    extra_compile_args=ext.extra_compile_args,
    depends=core_headers + ["src/shmeval/bench/pingpong.h"],
)


def _plain(name: str) -> Extension:
    """An extension of one .pyx and no C headers (the search tree, the game)."""
    return Extension(name, sources=["src/" + name.replace(".", "/") + ".pyx"],
                     extra_compile_args=["-O2"] + (["-UNDEBUG", "-g"] if debug else []))


setup(
    ext_modules=cythonize(
        [ext, timing, _plain("shmeval.mcts._tree"), _plain("shmeval.games._connect4")],
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
