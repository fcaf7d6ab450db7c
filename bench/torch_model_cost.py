#!/usr/bin/env python
"""Cost of one call of bench/torch_throughput.py's PyTorch net by batch
size, in this process on the CPU (no IPC, no shmeval), as the evaluator
calls it:

  module    the nn.Module under torch.inference_mode
  frozen    traced and frozen, as TorchModel(freeze="auto") serves it
  frozen-no-onednn
            the frozen net with oneDNN turned off for the call
            (torch.backends.mkldnn.enabled = False, which also moves the
            dense layers off oneDNN)
  frozen-own-conv
            the frozen net with its convolutions rewritten to PyTorch's own
            kernel (aten::thnn_conv2d), which PyTorch uses for one row and
            hands to oneDNN from two rows on
  served    what TorchModel(freeze="auto") serves: frozen-own-conv up to
            the batch size its start-up timing chose (own_conv_rows,
            printed), frozen from there
  compiled  torch.compile (inductor, one graph per batch size), with
            --compile only: each batch size compiles for seconds

Each figure is the median of --rounds rounds of --calls calls, the styles
and batch sizes interleaved within a round, so that a disturbance of the
machine falls on all of them alike.  Then, at each batch size, calls of
`served` alternate with calls of the frozen form it serves that size
with (as many as the table's calls of one figure): the difference of
their medians is what TorchModel itself adds to a call.

    python bench/torch_model_cost.py
    python bench/torch_model_cost.py --batches 1,2,4,8,16,32 --threads 1 --compile
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

from tf_throughput import POLICY_SIZE, STATE_SHAPE, NetConfig, make_weights
from torch_throughput import build_net, import_torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads")
    ap.add_argument("--filters", type=int, default=32)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20, help="calls per round and figure")
    ap.add_argument("--compile", action="store_true", help="add torch.compile's net")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    torch = import_torch(args.threads)
    from shmeval.backends.torch import TorchModel, _own_convolutions
    from shmeval.spec import Spec

    cfg = NetConfig(filters=args.filters, layers=args.layers)
    net = build_net(cfg, make_weights(cfg))
    # Prepared as an evaluator prepares it, outside inference mode.
    served = TorchModel(net)
    served.prepare(Spec.build(STATE_SHAPE, "float32",
                              {"policy": ((POLICY_SIZE,), "float32"), "value": ((), "float32")},
                              max(batches), 1, 1), None)
    with torch.inference_mode():
        frozen = torch.jit.freeze(torch.jit.trace(net, torch.zeros(4, *STATE_SHAPE), strict=False))

        def no_onednn(x: Any) -> Any:
            torch.backends.mkldnn.enabled = False
            try:
                return frozen(x)
            finally:
                torch.backends.mkldnn.enabled = True

        own_conv = torch.jit.freeze(torch.jit.trace(net, torch.zeros(4, *STATE_SHAPE),
                                                    strict=False))
        _own_convolutions(own_conv)
        styles: Dict[str, Callable[[Any], Any]] = {
            "module": net, "frozen": frozen, "frozen-no-onednn": no_onednn,
            "frozen-own-conv": own_conv, "served": lambda x: served(x.numpy())}
        if args.compile:
            styles["compiled"] = torch.compile(net, dynamic=False)
        xs = {b: torch.randn(b, *STATE_SHAPE) for b in batches}
        for f in styles.values():
            for x in xs.values():
                for _ in range(3):
                    f(x)
        times: Dict[tuple, List[float]] = {(s, b): [] for s in styles for b in batches}
        for _ in range(args.rounds):
            for s, f in styles.items():
                for b, x in xs.items():
                    t = time.perf_counter_ns()
                    for _ in range(args.calls):
                        f(x)
                    times[s, b].append((time.perf_counter_ns() - t) / args.calls / 1e3)

    print(f"torch {torch.__version__}, {args.threads} intra-op thread(s); "
          f"µs per call (µs per row), median of {args.rounds} rounds of {args.calls} calls; "
          f"served: own convolution up to {served.own_conv_rows} rows")
    print("| style | " + " | ".join(f"{b} row{'s' if b > 1 else ''}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for s in styles:
        cells = []
        for b in batches:
            us = statistics.median(times[s, b])
            cells.append(f"{us:,.0f} ({us / b:,.0f})")
        print(f"| {s} | " + " | ".join(cells) + " |")
    added = own_cost(served, xs, args.rounds * args.calls)
    print("TorchModel's own cost per call (served against the form it calls for that batch, "
          "alternating call by call; median µs, the difference of the medians): "
          + ", ".join(f"{b} row{'s' if b > 1 else ''} {a:,.0f} - {f:,.0f} = {a - f:+,.0f}"
                      for b, (a, f) in added.items()))
    return 0


def own_cost(served: Any, xs: Dict[int, Any], calls: int) -> Dict[int, tuple[float, float]]:
    """Per batch size, the median µs of a call of ``served`` (a prepared
    TorchModel, given an ndarray) and of the frozen form it calls for that
    size (given the tensor; a frozen form needs no grad mode), timed in
    pairs, each first in every other pair: what TorchModel itself adds
    (its checks, inference mode, the conversions to and from arrays),
    without the block ordering of the table, whose styles run one after
    another each with its own copy of the weights."""
    out = {}
    # Outside inference mode, as the evaluator calls: a mode held across
    # calls makes them cheaper than one entered for each.
    method = served.methods[""]  # its only function, and the forms that serve it
    for b, x in xs.items():
        small = method.small is not None and b <= method.own_conv_rows
        form = method.small if small else method.forward
        batch = x.numpy()
        pairs: Dict[str, List[int]] = {"served": [], "form": []}
        both = (("served", lambda: served(batch)), ("form", lambda: form(x)))
        for i in range(calls + 10):
            # Each goes first in half the pairs: the second call of a
            # pair runs on caches the first left.
            for name, call in both[::1 if i % 2 else -1]:
                t = time.perf_counter_ns()
                call()
                if i >= 10:  # the first calls warm both up
                    pairs[name].append(time.perf_counter_ns() - t)
        out[b] = (statistics.median(pairs["served"]) / 1e3,
                  statistics.median(pairs["form"]) / 1e3)
    return out


if __name__ == "__main__":
    sys.exit(main())
