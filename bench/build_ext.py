#!/usr/bin/env python
"""Builds shmeval's extensions in place (``setup.py build_ext --inplace``)
after checking that this machine can: a C compiler and the ``Python.h``
of this interpreter.  Without them the build fails deep inside setuptools;
this says what is missing and how to get it, before anything is built.
Standard library only: it runs where nothing of shmeval works yet (the
borrowed GPU machine, before bench/gpu.py).

    python3 bench/build_ext.py            # check, then build
    python3 bench/build_ext.py --check    # check only
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiler() -> str:
    """The C compiler setuptools will call: $CC, else the one this Python
    was built with."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)[0]


def problems(cc: Optional[str] = None, include: Optional[str] = None) -> list[str]:
    """What stops the build here, one sentence each (empty: nothing)."""
    cc = cc or compiler()
    include = include or sysconfig.get_paths()["include"]
    found = []
    if shutil.which(cc) is None:
        found.append(f"no C compiler: {cc!r} is not on PATH (install gcc, e.g. "
                     f"apt-get install gcc, or set CC)")
    if not os.path.isfile(os.path.join(include, "Python.h")):
        version = sysconfig.get_python_version()
        found.append(f"no Python.h in {include} (install this Python's headers, e.g. "
                     f"apt-get install python{version}-dev)")
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check only, build nothing")
    args = parser.parse_args(argv)
    missing = problems()
    if missing:
        print("cannot build shmeval's extensions here:\n  " + "\n  ".join(missing),
              file=sys.stderr)
        return 2
    if args.check:
        print(f"ready to build: {compiler()} and Python.h found")
        return 0
    return subprocess.call([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                           cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
