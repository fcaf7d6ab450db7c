#!/usr/bin/env python
"""Instructions a worker's request costs in the client, counted by
callgrind: load-independent, so two builds (or two ways of sending the same
bytes) compare on a shared machine where their timings would not.

Each call runs this script under ``valgrind --tool=callgrind`` with
collection switched on only inside the request method's C function
(``--toggle-collect='*client_*'``: ``client_evaluate``,
``client_evaluate_many``, ``client_submit``), against an evaluator spawned
in its own process (not traced), with the client's spin off (its waits
then count no spinning).  It prints the instructions per call.  The wait
itself and the GIL's release around it are inside: callgrind_annotate on
the output file splits them out.

    python bench/client_instructions.py                       # this checkout: evaluate, evaluate_many, submit
    PYTHONPATH=/tmp/old/src python bench/client_instructions.py   # another build, built in place
    python bench/client_instructions.py --calls named,packed  # named inputs against one packed array

Calls: ``evaluate`` of one Connect Four state; ``evaluate_many`` and
``submit`` (collected at once, not counted) of 4; ``named``: ``evaluate``
of {"hidden": (32, 6, 7) float32, "action": int64 scalar}; ``packed``:
``evaluate`` of the same 5,384 bytes as one uint8 array.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

SHAPE = (6, 7, 2)
HIDDEN = (32, 6, 7)
CALLS = ("evaluate", "evaluate_many", "submit", "named", "packed")


def board_model(batch: np.ndarray) -> dict:
    n = len(batch)
    return {"policy": np.full((n, 7), 1 / 7, np.float32),
            "value": batch.reshape(n, -1).mean(axis=1)}


def named_model(batch: dict) -> dict:
    return {"value": batch["hidden"][:, 0, 0, 0].copy()}


def packed_model(batch: np.ndarray) -> dict:
    return {"value": batch[:, 0].astype(np.float32)}


def _factory(call: str):
    return {"named": named_model, "packed": packed_model}.get(call, board_model)


def run(call: str, n: int) -> None:
    """The traced side: an evaluator, then n calls of ``call``."""
    import functools

    import shmeval

    hidden = np.random.default_rng(3).random(HIDDEN, dtype=np.float32)
    common = dict(max_batch=64, max_clients=16, spin_us=0)
    factory = functools.partial(_factory, call)
    if call == "named":
        ev = shmeval.Evaluator.spawn(factory, inputs={"hidden": (HIDDEN, "float32"),
                                                      "action": ((), "int64")},
                                     outputs={"value": ((), "float32")}, **common)
        state = {"hidden": hidden, "action": np.int64(3)}
    elif call == "packed":
        ev = shmeval.Evaluator.spawn(factory, input_shape=(hidden.nbytes + 8,),
                                     input_dtype="uint8", outputs={"value": ((), "float32")},
                                     **common)
        state = np.frombuffer(hidden.tobytes() + np.int64(3).tobytes(), np.uint8).copy()
    else:
        ev = shmeval.Evaluator.spawn(factory, input_shape=SHAPE,
                                     outputs={"policy": ((7,), "float32"), "value": ((), "float32")},
                                     **common)
        state = np.zeros(SHAPE if call == "evaluate" else (4, *SHAPE), np.float32)
    try:
        if call == "evaluate_many":
            for _ in range(n):
                ev.evaluate_many(state)
        elif call == "submit":
            for _ in range(n):
                ev.submit(state).result()
        else:
            ev.evaluate(state)
            for _ in range(n):
                ev.evaluate(state)
    finally:
        ev.close()


def count(call: str, n: int) -> float:
    """Instructions per call of ``call``, from one traced run of n calls."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        r = subprocess.run(["valgrind", "--tool=callgrind", "--toggle-collect=*client_*",
                            f"--callgrind-out-file={out}", sys.executable, __file__,
                            "--traced", call, "--n", str(n)],
                           capture_output=True, text=True, timeout=600)
        m = re.search(r"Collected : (\d+)", r.stderr)
        if r.returncode != 0 or m is None:
            raise RuntimeError(f"{call}: valgrind failed:\n{r.stderr[-2000:]}")
        return int(m.group(1)) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", default="evaluate,evaluate_many,submit",
                   help=f"comma-separated, of {', '.join(CALLS)}")
    p.add_argument("--n", type=int, default=1000, help="calls per traced run")
    p.add_argument("--traced", choices=CALLS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.traced:
        run(args.traced, args.n)
        return
    import shmeval
    print(f"shmeval from {os.path.dirname(shmeval.__file__)}")
    for call in args.calls.split(","):
        if call not in CALLS:
            p.error(f"unknown call {call!r}")
        print(f"{call:<14} {count(call, args.n):8,.0f} instructions per call")


if __name__ == "__main__":
    main()
