#!/usr/bin/env python
"""Cost of one TFModel call by batch size and TensorFlow thread count.

Serves the net of bench/tf_throughput.py through shmeval's TFModel in this
process (no IPC) and prints wall and CPU time per call and per state, e.g.

    python bench/tf_model_cost.py --filters 32 --threads 1
    python bench/tf_model_cost.py --filters 32 --threads 0   # TF's default pools

TensorFlow's thread pools are process-wide and fixed at initialisation, so
compare thread counts in separate runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--filters", type=int, default=32)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra- and inter-op threads (0: TensorFlow's default)")
    ap.add_argument("--batches", default="1,4,16,64,256")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tf_throughput as tb

    from shmeval.backends.tensorflow import TFModel, configure
    from shmeval.spec import Spec

    threads = args.threads or None
    # Before the model is built: building it initialises TensorFlow.
    configure(intra_op_threads=threads, inter_op_threads=threads)
    cfg = tb.NetConfig(filters=args.filters, layers=args.layers)
    model = TFModel(tb.build_keras_model(cfg, tb.make_weights(cfg)))
    model.prepare(Spec.build((6, 7, 2), "float32",
                             {"policy": ((7,), "float32"), "value": ((), "float32")},
                             256, 8, 8), None)
    print(f"filters {args.filters}, layers {args.layers}, "
          f"TF threads {args.threads or 'default'}")
    print(f"{'batch':>6} {'wall us':>9} {'cpu us':>9} {'us/state':>9}")
    for b in (int(x) for x in args.batches.split(",")):
        x = np.random.default_rng(0).random((b, 6, 7, 2), np.float32)
        for _ in range(20):
            model(x)
        n = max(20, 4000 // b)
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            model(x)
        wall = (time.perf_counter() - w0) / n
        cpu = (time.process_time() - c0) / n
        print(f"{b:>6} {wall * 1e6:>9.0f} {cpu * 1e6:>9.0f} {wall / b * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
