#!/usr/bin/env python
"""Round-trip benchmark: kept for old command lines; the suite is now the
package's ``shmeval bench`` (src/shmeval/bench/), which takes the same options
and more (see ``shmeval bench --help``).

    python bench/roundtrip.py --workers 1,4,16 --seconds 3 --repeats 3 \\
        --methods queue,pipe,shmeval --json results.json
"""
import sys

from shmeval.bench.cli import main

if __name__ == "__main__":  # spawned workers import this file as __mp_main__
    sys.exit(main())
