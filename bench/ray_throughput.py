"""Ray worker actors evaluating one state at a time: shmeval on Ray against
what a Ray user would otherwise pick, and against shmeval on one node.

Four ways, the same model (``shmeval.bench.demo.TinyNet``, a small NumPy
policy-value net) and the same number of workers, each evaluating one
Connect Four state per call, as fast as it can, for ``--seconds``:

``shmeval-ray``
    a simulated Ray cluster of ``--nodes`` nodes on this machine
    (``shmeval.ray.simulated_cluster``); ``ClusterEvaluator`` places one
    evaluator per node; the workers (Ray actors, spread evenly over the
    nodes) evaluate through their own node's evaluator's shared memory.
``ray-serve``
    the same cluster; a Ray Serve deployment of the net with one replica
    per node, batching with ``@serve.batch`` (``max_batch_size`` = the
    workers, ``batch_wait_timeout_s`` 1 ms, ``max_ongoing_requests`` = the
    workers, so that a batch can hold every worker's request); each worker
    calls the deployment handle and waits for the result.
``ray-actor``
    the same cluster; one plain Ray actor per node holding the net; each
    worker calls its node's actor (``ray.get(actor.evaluate.remote(x))``).
``shmeval``
    no Ray: the same number of worker processes against one
    ``Evaluator.spawn`` (``shmeval demo``'s harness, ``shmeval.bench.demo``).

Run from the repository root (needs ``pip install "ray[serve]"``)::

    python bench/ray_throughput.py --json bench/results/ray_throughput.json

It prints evaluations/s of each and shmeval-ray's ratios to the others;
with ``--repeats N`` it runs the ways in rounds and reports medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List

import numpy as np
import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info
from shmeval.bench import demo
from shmeval.ray import ClusterEvaluator, simulated_cluster

WAYS = ("shmeval-ray", "ray-serve", "ray-actor", "shmeval")
#: Seconds between handing the ready workers their start time and the
#: start: every worker is waiting in its loop when the clock starts.
START_DELAY_S = 1.0


def _states(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2, size=(64,) + demo.INPUT_SHAPE).astype(np.float32)


@ray.remote(num_cpus=0)
class Worker:
    """Evaluates one state per call through the ``evaluate`` its way gives
    it, from ``start`` (wall-clock time, the same on every node of this
    machine) for ``seconds``."""

    def __init__(self, way: str, target: Any, seed: int) -> None:
        self.states = _states(seed)
        if way == "shmeval-ray":
            client = target.connect()
            self.evaluate = client.evaluate
        elif way == "ray-serve":
            self.evaluate = lambda x: target.remote(x).result()
        else:  # ray-actor: this node's actor
            self.evaluate = lambda x: ray.get(target.evaluate.remote(x))
        for i in range(100):  # connect, warm up
            self.evaluate(self.states[i % 64])

    def ready(self) -> None:
        """Returns once the constructor (connecting, warming up) is done."""

    def run(self, start: float, seconds: float) -> float:
        """Evaluations/s of this worker from ``start`` for ``seconds``."""
        time.sleep(max(0.0, start - time.time()))
        t0 = time.perf_counter()
        end = t0 + seconds
        n = 0
        while True:
            self.evaluate(self.states[n % 64])
            n += 1
            t = time.perf_counter()
            if t >= end:
                return n / (t - t0)


@ray.remote(num_cpus=0)
class NetActor:
    """A plain Ray actor holding the net: one state per call."""

    def __init__(self) -> None:
        self.net = demo.TinyNet()

    def evaluate(self, x: np.ndarray) -> Dict[str, np.ndarray]:
        out = self.net(x[None])
        return {k: v[0] for k, v in out.items()}


def serve_deployment(workers: int, replicas: int) -> Any:
    """The net as a Serve deployment batching with @serve.batch."""

    @serve.deployment(num_replicas=replicas, max_ongoing_requests=workers,
                      ray_actor_options={"num_cpus": 0})
    class ServedNet:
        def __init__(self) -> None:
            self.net = demo.TinyNet()

        @serve.batch(max_batch_size=workers, batch_wait_timeout_s=0.001)
        async def __call__(self, xs: List[np.ndarray]) -> List[Dict[str, np.ndarray]]:
            out = self.net(np.stack(xs))
            return [{k: v[i] for k, v in out.items()} for i in range(len(xs))]

    return ServedNet.bind()


def _measure(workers: List[Any], seconds: float) -> float:
    """Evaluations/s of ``workers``, started together once all are ready."""
    ray.get([w.ready.remote() for w in workers], timeout=300)
    start = time.time() + START_DELAY_S
    rates = ray.get([w.run.remote(start, seconds) for w in workers], timeout=seconds + 120)
    return float(sum(rates))


def _on_nodes(way: str, targets: Dict[str, Any], workers: int) -> List[Any]:
    """``workers`` Worker actors spread evenly over the nodes of ``targets``
    (node id -> what a worker there evaluates through)."""
    nodes = sorted(targets)
    return [Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                nodes[i % len(nodes)], soft=False)).remote(way, targets[nodes[i % len(nodes)]], i)
            for i in range(workers)]


def run_on_ray(way: str, workers: int, seconds: float) -> Dict[str, Any]:
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    extra: Dict[str, Any] = {}
    if way == "shmeval-ray":
        owner: Any = ClusterEvaluator(demo.tiny_net, input_shape=demo.INPUT_SHAPE,
                                      outputs=demo.OUTPUTS)
        ws = _on_nodes(way, {n: owner for n in nodes}, workers)
        rate = _measure(ws, seconds)
        stats = owner.stats()
        extra["mean_batch_per_node"] = {n[:8]: s["mean_batch"] for n, s in stats.items()}
        owner.close()
    elif way == "ray-actor":
        actors = {n: NetActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n, soft=False)).remote() for n in nodes}
        ws = _on_nodes(way, actors, workers)
        rate = _measure(ws, seconds)
        for a in actors.values():
            ray.kill(a)
    else:
        quiet = {"log_level": "WARNING"}  # Serve logs every call otherwise
        serve.start(proxy_location="Disabled", logging_config=quiet)
        handle = serve.run(serve_deployment(workers, len(nodes)), name="net", route_prefix=None,
                           logging_config=quiet)
        ws = _on_nodes(way, {n: handle for n in nodes}, workers)
        rate = _measure(ws, seconds)
        serve.shutdown()
    for w in ws:
        ray.kill(w)
    return {"evals_per_s": rate, **extra}


def run_local(workers: int, seconds: float) -> Dict[str, Any]:
    r = demo.run(workers=workers, seconds=seconds)
    return {"evals_per_s": r["round_trips_per_s"], "mean_batch": r["mean_batch"]}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16, help="worker actors (default 16)")
    p.add_argument("--nodes", type=int, default=2, help="simulated Ray nodes (default 2)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="measured window per way (default 10)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every way; medians reported (default 1)")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                   help="which ways to run (default all)")
    p.add_argument("--json", metavar="PATH", help="write settings, machine and results here")
    a = p.parse_args(argv)
    runs: Dict[str, List[Dict[str, Any]]] = {w: [] for w in a.ways}
    on_ray = [w for w in a.ways if w != "shmeval"]
    for round_ in range(a.repeats):
        if "shmeval" in a.ways:  # first, before the cluster's processes exist
            runs["shmeval"].append(run_local(a.workers, a.seconds))
            print(f"round {round_ + 1}: shmeval {runs['shmeval'][-1]['evals_per_s']:,.0f}/s",
                  flush=True)
        if on_ray:
            with simulated_cluster(a.nodes, num_cpus=1):
                for way in on_ray:
                    runs[way].append(run_on_ray(way, a.workers, a.seconds))
                    print(f"round {round_ + 1}: {way} {runs[way][-1]['evals_per_s']:,.0f}/s",
                          flush=True)
    medians = {w: statistics.median(r["evals_per_s"] for r in rs) for w, rs in runs.items()}
    print(f"\n{a.workers} Ray worker actors, one state per call, {a.seconds:g} s windows, "
          f"{a.nodes} simulated nodes; medians of {a.repeats}")
    print(f"{'way':<12} {'evals/s':>10}  shmeval-ray / way")
    ratios = {}
    for way, rate in medians.items():
        ratio = medians.get("shmeval-ray", float("nan")) / rate if rate else float("nan")
        ratios[way] = ratio
        print(f"{way:<12} {rate:>10,.0f}  {ratio:.2f}x")
    if a.json:
        write_json(a.json, {
            "settings": vars(a), "machine": machine_info(ray=("ray",)),
            "serve": {"max_batch_size": a.workers, "batch_wait_timeout_s": 0.001,
                      "max_ongoing_requests": a.workers, "replicas": a.nodes},
            "evals_per_s": medians, "shmeval_ray_over": ratios, "runs": runs})
        print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
