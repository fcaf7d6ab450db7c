#!/usr/bin/env python
"""Cost of one TFModel call by batch size and TensorFlow thread count.

Serves the net of bench/tf_throughput.py through shmeval's TFModel in this
process (no IPC) and prints wall and CPU time per call and per state, e.g.

    python bench/tf_model_cost.py --filters 32 --threads 1
    python bench/tf_model_cost.py --filters 32 --threads 0   # TF's default pools
    python bench/tf_model_cost.py --styles --batches 1,32    # calling styles
    python bench/tf_model_cost.py --floor --batches 1,32     # a trivial graph's call
    python bench/tf_model_cost.py --net selfplay --jit       # compiled with XLA
    python bench/tf_model_cost.py --net selfplay --freeze    # weights folded in
    python bench/tf_model_cost.py --net selfplay --freeze --bfloat16   # in bfloat16
    python bench/tf_model_cost.py --concurrent 2 --inter-threads 2 --batches 32
                                  # two threads calling at once (serving_threads)
    python bench/tf_model_cost.py --net selfplay --freeze --concurrent 2 --batches 1,32
                                  # the same, FrozenGraph against frozen_function

TensorFlow's thread pools are process-wide and fixed at initialisation, so
compare thread counts in separate runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", choices=("bench", "selfplay"), default="bench",
                    help="bench: the conv net of bench/tf_throughput.py (--filters, --layers); "
                         "selfplay: the self-play demo's residual net")
    ap.add_argument("--filters", type=int, default=32)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra- and inter-op threads (0: TensorFlow's default)")
    ap.add_argument("--inter-threads", type=int, default=None,
                    help="inter-op threads when they should differ from --threads")
    ap.add_argument("--concurrent", type=int, default=0,
                    help="calls/s from this many threads calling at once against one thread "
                         "(what Evaluator(serving_threads=N) does)")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--jit", action="store_true",
                    help="TFModel(jit_compile=True): the net compiled with XLA (batches padded "
                         "to powers of two)")
    ap.add_argument("--freeze", action="store_true",
                    help="TFModel(freeze=True): the weights folded into the graph as constants")
    ap.add_argument("--bfloat16", action="store_true",
                    help="with --freeze: TFModel(bfloat16=True), the convolutions in bfloat16")
    ap.add_argument("--buckets", default="",
                    help="TFModel(buckets=...): batch sizes to pad to, e.g. 1,2,4,...,256 "
                         "(each is traced, and with --freeze folded again at every weight "
                         "update)")
    ap.add_argument("--updates", type=int, default=0,
                    help="weight updates to time (default 3) and print the RSS across, "
                         "every 50")
    ap.add_argument("--styles", action="store_true",
                    help="compare ways of calling the model instead (try --batches 1,32)")
    ap.add_argument("--floor", action="store_true",
                    help="the cost of calling a trivial graph (x * 2) instead: eagerly, and "
                         "through a session with an inter-op pool or in the caller's thread")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tf_throughput as tb

    from shmeval.backends.tensorflow import TFModel, configure
    from shmeval.spec import Spec

    threads = args.threads or None
    # Before the model is built: building it initialises TensorFlow.
    inter = args.inter_threads if args.inter_threads is not None else args.threads
    configure(intra_op_threads=threads, inter_op_threads=inter or None)
    buckets = [int(x) for x in args.buckets.split(",")] if args.buckets else None
    if args.net == "selfplay":
        from shmeval.games.connect4_net import build_resnet

        model = TFModel(build_resnet(compile=False), jit_compile=args.jit, freeze=args.freeze,
                        buckets=buckets, bfloat16=args.bfloat16)
    else:
        cfg = tb.NetConfig(filters=args.filters, layers=args.layers)
        model = TFModel(tb.build_keras_model(cfg, tb.make_weights(cfg)), jit_compile=args.jit,
                        freeze=args.freeze, buckets=buckets, bfloat16=args.bfloat16)
    model.prepare(Spec.build((6, 7, 2), "float32",
                             {"policy": ((7,), "float32"), "value": ((), "float32")},
                             256, 8, 8), None)
    shape = "residual (2 x 32)" if args.net == "selfplay" else f"{args.filters} filters x {args.layers}"
    print(f"net {args.net}: {shape}, TF threads {args.threads or 'default'}, inter-op {inter or 'default'}"
          + (", XLA" if args.jit else "") + (", frozen" if args.freeze else "")
          + (", bfloat16" if args.bfloat16 else ""))
    if args.concurrent:
        batches = [int(x) for x in args.batches.split(",")]
        if args.freeze and not args.jit:
            # TFModel(freeze=True) runs FrozenGraphs; frozen_function, the
            # same graph called eagerly, is what it is compared with.
            import tensorflow as tf

            from shmeval.backends.tensorflow import frozen_function

            print("TFModel(freeze=True): FrozenGraph, a session in the caller's thread"
                  + (", bfloat16" if args.bfloat16 else ""))
            concurrent_calls(model, batches, args.concurrent)
            eager = frozen_function(_keras_function(model.model).get_concrete_function())
            print("frozen_function, called eagerly (float32)")
            concurrent_calls(lambda x: [t.numpy() for t in tf.nest.flatten(eager(tf.constant(x)))],
                             batches,
                             args.concurrent)
        else:
            concurrent_calls(model, batches, args.concurrent)
        return
    if args.styles:
        calling_styles(model, [int(x) for x in args.batches.split(",")])
        return
    if args.floor:
        call_floor([int(x) for x in args.batches.split(",")])
        return
    # With --bfloat16: how far the answers move from the float32 graph's.
    exact = None
    if args.bfloat16:
        exact = TFModel(model.model, freeze=True)
        exact.prepare(model.spec, None)
    print(f"{'batch':>6} {'wall us':>9} {'cpu us':>9} {'us/state':>9}"
          + ("   max |bfloat16 - float32| policy, value" if exact else ""))
    for b in (int(x) for x in args.batches.split(",")):
        x = np.random.default_rng(0).random((b, 6, 7, 2), np.float32)
        wall, cpu = per_call(model, x)
        moved = ""
        if exact is not None:
            got, want = model(x), exact(x)
            moved = "".join(f"{float(np.abs(got[k] - want[k]).max()):>10.1e}"
                            for k in ("policy", "value"))
        print(f"{b:>6} {wall * 1e6:>9.0f} {cpu * 1e6:>9.0f} {wall / b * 1e6:>9.1f}   {moved}")
    # A weight update: assigning the variables, and with --freeze folding
    # them into new functions and running each once.
    # With --updates N, also the process's RSS across them (whether the
    # functions an update replaces are freed).
    weights = model.get_weights()
    times = []
    rss = [_rss_now()]
    for i in range(max(3, args.updates)):
        t0 = time.perf_counter()
        model.set_weights(weights)
        times.append(time.perf_counter() - t0)
        if args.updates and (i + 1) % 50 == 0:
            rss.append(_rss_now())
    print("set_weights: " + ", ".join(f"{t * 1e3:.1f}" for t in times[:3]) + " ms")
    if args.updates:
        print(f"RSS over {len(times)} updates, every 50: " + ", ".join(map(str, rss)) + " MB")


def _rss_now() -> int:
    from shmeval._util.procstat import rss_mb

    return int(rss_mb(os.getpid()) or 0)


def per_call(fn: Callable[[Any], Any], x: Any, n: int = 0) -> tuple[float, float]:
    """Wall and CPU seconds per call of fn(x), after 20 warm-up calls."""
    for _ in range(20):
        fn(x)
    n = n or max(20, 4000 // len(x))
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n


def concurrent_calls(model: Any, batches: list[int], n_threads: int, seconds: float = 3.0) -> None:
    """Calls/s of one thread calling the model in a loop, then of n_threads
    threads calling it at the same time (TensorFlow releases the GIL during
    a call; whether the calls run in parallel depends on its inter-op pool)."""
    import threading

    print(f"{'batch':>6} {'1 thread calls/s':>17} {f'{n_threads} threads calls/s':>18} {'ratio':>6}")
    for b in batches:
        x = np.random.default_rng(0).random((b, 6, 7, 2), np.float32)
        per_call(model, x, 20)  # warm-up
        counts = [0] * n_threads

        def loop(i: int, until: float) -> None:
            while time.perf_counter() < until:
                model(x)
                counts[i] += 1

        loop(0, time.perf_counter() + seconds)
        one = counts[0] / seconds
        counts = [0] * n_threads
        until = time.perf_counter() + seconds
        threads = [threading.Thread(target=loop, args=(i, until)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        many = sum(counts) / seconds
        print(f"{b:>6} {one:>17,.0f} {many:>18,.0f} {many / one:>5.2f}x")


def _keras_function(keras_model: Any) -> Any:
    """The Keras model as a tf.function of batches of any size."""
    import tensorflow as tf

    spec = tf.TensorSpec((None, 6, 7, 2), tf.float32)
    return tf.function(lambda t: keras_model(t, training=False), input_signature=[spec])


def calling_styles(model: Any, batches: list[int]) -> None:
    """The ways of calling the same Keras model that docs/performance.md
    compares (outputs converted to NumPy in each)."""
    import tensorflow as tf

    keras_model = model.model
    fn = _keras_function(keras_model)
    concrete = fn.get_concrete_function()
    numpy = lambda out: tf.nest.map_structure(lambda t: np.asarray(t), out)  # noqa: E731
    styles = {
        "TFModel (concrete fn, tf.constant)": model,
        "tf.function(input_signature)(ndarray)": lambda x: numpy(fn(x)),
        "concrete function(tf.constant)": lambda x: numpy(concrete(tf.constant(x))),
        "model.predict_on_batch": keras_model.predict_on_batch,
        "eager model(x)": lambda x: numpy(keras_model(x, training=False)),
    }
    # The weights folded into the graph as constants: TFModel(freeze=True)
    # (a FrozenGraph), frozen_function called eagerly, the FrozenGraph
    # itself, and the converted function called as it comes (its public
    # call) and through its private flat-call entry point.
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    from shmeval.backends.tensorflow import FrozenGraph, TFModel, frozen_function

    frozen_model = TFModel(keras_model, freeze=True)
    frozen_model.prepare(model.spec, None)
    styles["TFModel(freeze=True)"] = frozen_model
    eager_frozen = frozen_function(concrete)
    styles["frozen_function(tf.constant)"] = lambda x: numpy(eager_frozen(tf.constant(x)))
    styles["FrozenGraph(ndarray)"] = FrozenGraph(concrete)
    converted = convert_variables_to_constants_v2(concrete)
    styles["converted function(tf.constant)"] = lambda x: numpy(converted(tf.constant(x)))
    flat = getattr(converted, "_inference_function", None)
    if flat is not None:
        styles["converted, private flat call"] = lambda x: numpy(flat.call_flat(tf.constant(x)))
    print_styles("calling style", styles, batches, 300)


def print_styles(title: str, styles: dict[str, Callable[[Any], Any]], batches: list[int],
                 calls: int) -> None:
    """A table of wall / CPU µs per call, a row per style, a column per batch."""
    print(f"{title:<40}" + "".join(f"{'batch ' + str(b):>14}" for b in batches)
          + "   (wall / CPU us per call)")
    for name, call in styles.items():
        cells = []
        for b in batches:
            x = np.random.default_rng(0).random((b, 6, 7, 2), np.float32)
            wall, cpu = per_call(call, x, calls)
            cells.append(f"{wall * 1e6:>8.0f} /{cpu * 1e6:>5.0f}")
        print(f"{name:<40}" + "".join(cells))


def call_floor(batches: list[int]) -> None:
    """What TensorFlow costs per call before the model: a graph of one
    multiplication, called as a concrete function and through a session
    (what a FrozenGraph runs), with an inter-op pool of one and in the
    caller's thread."""
    import tensorflow as tf

    spec = tf.TensorSpec((None, 6, 7, 2), tf.float32)
    concrete = tf.function(lambda t: t * 2.0).get_concrete_function(spec)
    styles: dict[str, Callable[[Any], Any]] = {
        "concrete function(tf.constant)": lambda x: concrete(tf.constant(x)).numpy()}
    for label, inter in (("session, inter-op pool of 1", 1),
                         ("session, caller's thread (-1)", -1)):
        graph = tf.Graph()
        with graph.as_default():
            feed = tf.compat.v1.placeholder(tf.float32, spec.shape)
            out = feed * 2.0
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter)
        styles[label] = tf.compat.v1.Session(graph=graph, config=config).make_callable(
            out, [feed])
    print_styles("x * 2, called as", styles, batches, 2000)


if __name__ == "__main__":
    main()
