#!/usr/bin/env python
"""Throughput benchmark with a real PyTorch model: shmeval + TorchModel against
the ways a PyTorch user would otherwise serve a policy-value net to many
self-play processes.

Every method evaluates the small convolutional policy-value net of
bench/tf_throughput.py, rebuilt in PyTorch with the same weights (Connect
Four input 6x7x2 float32, 3 conv layers of 32 filters, a 7-way softmax
policy and a tanh value), one state per request from N worker processes, in
a closed loop:

  local     each worker builds its own copy of the net and calls it on one
            state at a time (batch 1, torch.inference_mode)
  queue     one evaluator process owns the net; workers send states (raw
            bytes) through one multiprocessing.Queue and get answers on a
            Queue of their own; the evaluator drains up to --max-batch
            requests (shmeval._util.queue_batches) and calls the net once
  torchrl   TorchRL's ProcessInferenceServer: the net in a process of its
            own behind a ProcessSlotTransport (fixed shared-memory slots,
            one per worker; the transport TorchRL recommends for process
            workers, and the fastest of its three: at 16 workers on the
            2-core machine process_slot 1,496 evals/s, shared_memory
            1,050, mp 202, each from `--methods torchrl --seconds 3
            --repeats 2 --torchrl-transport NAME`); workers call their
            client with a TensorDict, so they import torch, tensordict and
            torchrl
  shmeval   shmeval.Evaluator.spawn with a TorchModel factory; workers call
            ev.evaluate(state) and never import torch

    python bench/torch_throughput.py --json bench/results/torch_throughput-cpu.json
    python bench/torch_throughput.py --quick            # 16 workers, short windows
    python bench/torch_throughput.py --workers 4,16 --methods queue,shmeval

For each worker count and method, the workers (and the method's server)
start once, warm up and report ready; then --repeats windows of --seconds
are measured with the same processes, and everything stops before the next
method starts.  Inside a window each worker counts the evaluations it
completes and samples their latencies; this process samples every worker's
VmRSS a few times, and the CPU time of the workers and of the server.
Worker 0 of every method evaluates a fixed set of states first; its answers
must match the net's, called in this process, within 1e-4.

The servers (queue, torchrl, shmeval) and each local worker run PyTorch
with one intra-op thread (--threads): the cores are shared with the
workers.  --threads 0 leaves each its default instead (PyTorch's, one
per core; TorchModel's "auto").  shmeval runs with its defaults:
TorchModel serves the net traced and frozen (freeze="auto") and the
evaluator's tuner chooses its serving threads and batch wait
(--serving-threads and --max-wait-us fix them); the tuner's final choice
is printed after the run.  --device runs the servers' and the local
workers' nets on another device (bench/gpu.py drives this on a GPU).

Targets at the largest worker count (reported, not enforced): shmeval at
least 10x torchrl, 2x queue and 3x local evals/s, with a worker's RSS at
most a fifth of a local worker's.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Optional, Sequence

import numpy as np

# What both TensorFlow and PyTorch benchmarks share: the net's shape and
# weights, the states, the summaries and the tables.
from tf_throughput import (N_CHECK_STATES, POLICY_SIZE, POOL_SIZE, QUANTILES,
                           START_DELAY_NS, STATE_SHAPE, NetConfig, Window, _await, _exit_quickly,
                           _fmt, _join, _print_table, _stat, check_states, make_weights,
                           random_states, stop_queue_server)

from shmeval._util.children import child_setup
from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info
from shmeval._util.procstat import cpu_s, machine_busy_s, rss_mb
from shmeval._util.queue_batches import queued_batches
from shmeval.bench.roundtrip import weighted_quantiles

METHODS = ("local", "queue", "torchrl", "shmeval")
CHECK_TOLERANCE = 1e-4
# Sixteen processes importing torch on two cores take tens of seconds.
READY_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0
TORCHRL_TRANSPORTS = ("process_slot", "shared_memory", "mp")
TARGETS = {"shmeval/torchrl evals/s": 10.0, "shmeval/queue evals/s": 2.0,
           "shmeval/local evals/s": 3.0, "worker RSS local/shmeval": 5.0}

Weights = dict[str, tuple[np.ndarray, np.ndarray]]


# --- the net --------------------------------------------------------------------------

def import_torch(threads: Optional[int]) -> Any:
    """Imports torch with ``threads`` intra-op threads (None: its default)
    and full float32 on a GPU: with TensorFloat-32 no two batch sizes would
    agree within the tolerance the answers are checked to."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def build_net(cfg: NetConfig, weights: Weights, device: str = "cpu") -> Any:
    """The net of bench/tf_throughput.py in PyTorch, with its weights (Keras
    layouts converted), on ``device``, in eval mode.  It takes NHWC states
    [n, 6, 7, 2] and flattens its heads in NHWC order, as Keras does, so
    that both nets compute the same function."""
    import torch
    from torch import nn

    class PolicyValueNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            channels = STATE_SHAPE[2]
            self.convs = nn.ModuleList(
                nn.Conv2d(channels if i == 0 else cfg.filters, cfg.filters, 3, padding=1)
                for i in range(cfg.layers))
            cells = STATE_SHAPE[0] * STATE_SHAPE[1]
            self.policy_conv = nn.Conv2d(cfg.filters, 2, 1)
            self.policy_dense = nn.Linear(cells * 2, POLICY_SIZE)
            self.value_conv = nn.Conv2d(cfg.filters, 1, 1)
            self.value_dense1 = nn.Linear(cells, cfg.value_hidden)
            self.value_dense2 = nn.Linear(cfg.value_hidden, 1)

        def forward(self, x: Any) -> dict[str, Any]:
            h = x.permute(0, 3, 1, 2)
            for conv in self.convs:
                h = torch.relu(conv(h))
            p = torch.relu(self.policy_conv(h)).permute(0, 2, 3, 1).flatten(1)
            p = torch.softmax(self.policy_dense(p), dim=-1)
            v = torch.relu(self.value_conv(h)).permute(0, 2, 3, 1).flatten(1)
            v = torch.tanh(self.value_dense2(torch.relu(self.value_dense1(v))))
            return {"policy": p, "value": v.reshape(-1)}

    net = PolicyValueNet()
    layers = {f"conv{i}": net.convs[i] for i in range(cfg.layers)}
    layers.update(policy_conv=net.policy_conv, policy_dense=net.policy_dense,
                  value_conv=net.value_conv, value_dense1=net.value_dense1,
                  value_dense2=net.value_dense2)
    with torch.no_grad():
        for name, layer in layers.items():
            kernel, bias = weights[name]
            # Keras: conv [kh, kw, in, out], dense [in, out].
            k = kernel.transpose(3, 2, 0, 1) if kernel.ndim == 4 else kernel.T
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(k)))
            layer.bias.copy_(torch.from_numpy(bias))
    return net.to(device).eval()


def reference(cfg: NetConfig, weights: Weights) -> dict[str, np.ndarray]:
    """The net's answers to the check states, on the CPU in this process."""
    torch = import_torch(None)
    with torch.inference_mode():
        out = build_net(cfg, weights)(torch.from_numpy(check_states()))
    return {"policy": out["policy"].numpy(), "value": out["value"].numpy()}


def torchmodel_factory(cfg: NetConfig, weights: Weights, device: str, threads: Optional[int],
                       freeze: Any = "auto") -> Any:
    """Evaluator.spawn's factory: runs in the evaluator process, the only
    process of the shmeval method that imports torch."""
    import_torch(threads)
    from shmeval.backends.torch import TorchModel

    return TorchModel(build_net(cfg, weights, device), device=device, freeze=freeze,
                      intra_op_threads=threads or "auto")


def torchrl_policy(cfg: NetConfig, weights: Weights, device: str, threads: Optional[int]) -> Any:
    """ProcessInferenceServer's policy factory: the net as a
    TensorDictModule, observation -> policy, value."""
    import_torch(threads)
    from tensordict.nn import TensorDictModule
    from torch import nn

    net = build_net(cfg, weights, device)

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Any) -> tuple[Any, Any]:
            out = self.net(x)
            return out["policy"], out["value"]

    return TensorDictModule(Heads(), in_keys=["observation"], out_keys=["policy", "value"])


# --- the clients each worker runs ----------------------------------------------------
#
# open_<method>(params) -> (step, info): step(state) -> (policy, value)
# evaluates one state (the timed operation); info is what the worker
# reports about itself.

Opened = tuple[Callable[[np.ndarray], tuple[Any, Any]], dict[str, Any]]


def _imported() -> dict[str, Any]:
    return {"torch_imported": "torch" in sys.modules}


def open_local(params: dict[str, Any]) -> Opened:
    torch = import_torch(params["threads"])
    device = params["device"]
    net = build_net(params["cfg"], params["weights"], device)
    from_numpy, inference_mode = torch.from_numpy, torch.inference_mode

    def step(state: np.ndarray) -> tuple[Any, Any]:
        with inference_mode():
            out = net(from_numpy(state[None]).to(device))
            return out["policy"][0].cpu().numpy(), float(out["value"][0])

    return step, _imported()


def open_queue(params: dict[str, Any]) -> Opened:
    requests, response = params["requests"], params["responses"][params["worker_id"]]
    put, get, worker_id = requests.put, response.get, params["worker_id"]

    def step(state: np.ndarray) -> tuple[Any, Any]:
        put((worker_id, state.tobytes()))
        reply = np.frombuffer(get(), dtype=np.float32)
        return reply[:POLICY_SIZE], reply[POLICY_SIZE]

    return step, _imported()


def open_torchrl(params: dict[str, Any]) -> Opened:
    import torch
    from tensordict import TensorDict

    torch.set_num_threads(1)
    client = params["clients"][params["worker_id"]]
    request = TensorDict({"observation": torch.zeros(STATE_SHAPE)})
    observation = request["observation"]

    def step(state: np.ndarray) -> tuple[Any, Any]:
        observation.copy_(torch.from_numpy(state))
        out = client(request)
        return out["policy"].numpy(), float(out["value"])

    return step, _imported()


def open_shmeval(params: dict[str, Any]) -> Opened:
    evaluate = params["evaluator"].evaluate

    def step(state: np.ndarray) -> tuple[Any, Any]:
        out = evaluate(state)
        return out["policy"], out["value"]

    return step, _imported()


OPENERS = {"local": open_local, "queue": open_queue, "torchrl": open_torchrl,
           "shmeval": open_shmeval}


def worker_main(method: str, params: dict[str, Any], n_warmup: int, conn: Connection) -> None:
    """Opens the method's client, checks worker 0's answers, warms up,
    reports ready, then runs one measured window per ("run", start_ns,
    end_ns, n_samples) message until ("stop",) or the pipe closes."""
    child_setup()
    try:
        rng = np.random.default_rng(1000 + params["worker_id"])
        pool = random_states(rng, POOL_SIZE)
        step, info = OPENERS[method](params)
        check = None
        if params["worker_id"] == 0:
            outs = [step(s) for s in check_states()]
            check = (np.stack([np.asarray(p, np.float32).reshape(POLICY_SIZE) for p, _ in outs]),
                     np.array([float(v) for _, v in outs], np.float32))
        for i in range(n_warmup):
            step(pool[i % POOL_SIZE])
        info["pid"] = os.getpid()
        conn.send(("ready", info, check))

        def one(i: int) -> int:
            step(pool[i % POOL_SIZE])
            return 1

        window = Window()
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] != "run":
                break
            _, start_ns, end_ns, n_samples = msg
            count, _, recorded = window.run(one, start_ns, end_ns, n_samples)
            conn.send(("done", count, recorded))
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        return
    if "torch" in sys.modules:  # as slow to tear down as TensorFlow
        _exit_quickly()


# --- one method at one worker count ----------------------------------------------------

class Probe:
    """Something measured beside a window (bench/gpu.py: the GPU's busy share
    and memory per process): started when the window opens, read when it
    closes."""

    def start(self, pids: Sequence[int]) -> None:
        pass

    def stop(self) -> dict[str, Any]:
        return {}


class MethodRun:
    """One method's server and N workers, started once and measured over
    several windows."""

    method = ""

    def __init__(self, n_workers: int, args: argparse.Namespace, cfg: NetConfig,
                 weights: Weights) -> None:
        self.n_workers = n_workers
        self.args = args
        self.cfg = cfg
        self.weights = weights
        self.ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.infos: list[dict[str, Any]] = []
        self.check: Any = None
        self.server_pid: Optional[int] = None
        self.startup_s = 0.0

    def start_server(self) -> dict[str, Any]:
        """Starts the server, or as much of it as the workers need to be
        spawned; returns the workers' params."""
        return {}

    def await_server(self) -> None:
        """Waits until the server started by start_server serves."""

    def stop_server(self, abort: bool) -> None:
        pass

    def counters(self) -> Optional[dict[str, float]]:
        """The server's cumulative requests and batches (None: no server)."""
        return None

    def start(self) -> None:
        t0 = time.monotonic()
        params = self.start_server()
        for i in range(self.n_workers):
            parent_end, child_end = self.ctx.Pipe()
            proc = self.ctx.Process(target=worker_main, name=f"bench-{self.method}-{i}",
                                    daemon=True, args=(self.method, {**params, "worker_id": i},
                                                       self.args.warmup, child_end))
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        # The server finishes starting while the workers import and open
        # their clients; a request sent before it serves waits for it.
        self.await_server()
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, READY_TIMEOUT_S, f"{self.method} worker {i} start-up")
            if msg[0] != "ready":
                raise RuntimeError(f"{self.method} worker {i} failed to start:\n{msg[1]}")
            self.infos.append(msg[1])
            if i == 0:
                self.check = msg[2]
        self.startup_s = time.monotonic() - t0

    def window(self, seconds: float, repeat: int, probe: Probe) -> dict[str, Any]:
        start_ns = time.perf_counter_ns() + START_DELAY_NS
        end_ns = start_ns + int(seconds * 1e9)
        for conn in self.conns:
            conn.send(("run", start_ns, end_ns, self.args.samples))
        pids = [info["pid"] for info in self.infos]

        def sleep_until(t_ns: int) -> None:
            time.sleep(max(0.0, (t_ns - time.perf_counter_ns()) / 1e9))

        sleep_until(start_ns)
        probe.start(pids + ([self.server_pid] if self.server_pid else []))
        busy0, cpu0 = machine_busy_s(), [cpu_s(pid) for pid in pids]
        server0 = cpu_s(self.server_pid) if self.server_pid else None
        counters0 = self.counters()
        rss: list[list[float]] = [[] for _ in pids]
        server_rss = None
        for frac in (0.25, 0.5, 0.75):
            sleep_until(start_ns + int(frac * (end_ns - start_ns)))
            for j, pid in enumerate(pids):
                r = rss_mb(pid)
                if r is not None:
                    rss[j].append(r)
            if frac == 0.5 and self.server_pid:
                server_rss = rss_mb(self.server_pid)
        sleep_until(end_ns)
        busy1, cpu1 = machine_busy_s(), [cpu_s(pid) for pid in pids]
        server1 = cpu_s(self.server_pid) if self.server_pid else None
        counters1 = self.counters()
        probed = probe.stop()

        counts, samples = [], []
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, seconds + 120.0, f"{self.method} x{self.n_workers} worker {i}")
            if msg[0] != "done":
                raise RuntimeError(f"{self.method} x{self.n_workers}: worker {i} failed:\n{msg[1]}")
            counts.append(msg[1])
            samples.append(msg[2])
        total = sum(counts)
        if total == 0:
            raise RuntimeError(f"{self.method} x{self.n_workers}: nothing completed in the window")
        lat = weighted_quantiles(samples, counts, list(QUANTILES.values())) / 1e3
        latency_us = dict(zip(QUANTILES, lat.tolist()))
        worker_rss = [max(r) if r else float("nan") for r in rss]
        cpu_workers = sum(b - a for a, b in zip(cpu0, cpu1))
        cpu_server = server1 - server0 if server0 is not None and server1 is not None else None
        trial: dict[str, Any] = {
            "method": self.method, "workers": self.n_workers, "repeat": repeat,
            "seconds": seconds, "evaluations": total, "throughput": total / seconds,
            "p50_us": latency_us["p50"], "p99_us": latency_us["p99"], "latency_us": latency_us,
            "worker_counts": counts, "worker_rss_mb": worker_rss,
            "worker_rss_mb_median": statistics.median(worker_rss), "server_rss_mb": server_rss,
            "cpu_s_workers": cpu_workers, "cpu_s_server": cpu_server,
            # What the machine's cores spent beyond the workers and the server
            # (this process, other programs): other load skews every figure.
            "cpu_s_other": busy1 - busy0 - cpu_workers - (cpu_server or 0.0),
            "mean_batch": None, **probed,
        }
        if counters0 and counters1 and counters1["batches"] > counters0["batches"]:
            trial["mean_batch"] = ((counters1["requests"] - counters0["requests"])
                                   / (counters1["batches"] - counters0["batches"]))
        return trial

    def stop(self, abort: bool = False) -> list[str]:
        """Stops the workers (politely unless aborting), then the server."""
        try:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    if not abort:
                        conn.send(("stop",))
            if abort:
                for p in self.procs:
                    if p.pid is not None and p.is_alive():
                        p.terminate()
            return _join(self.procs, JOIN_TIMEOUT_S)
        finally:
            for conn in self.conns:
                conn.close()
            self.stop_server(abort)


class LocalRun(MethodRun):
    method = "local"

    def start_server(self) -> dict[str, Any]:
        return {"cfg": self.cfg, "weights": self.weights, "threads": self.args.threads,
                "device": self.args.device}


def queue_server_main(params: dict[str, Any], requests: Any, responses: list[Any],
                      counters: Any, conn: Connection) -> None:
    """The Queue evaluator: batches what is queued, one net call per batch."""
    child_setup()
    try:
        torch = import_torch(params["threads"])
        device = params["device"]
        net = build_net(params["cfg"], params["weights"], device)
        with torch.inference_mode():
            for n in (1, params["max_batch"]):
                net(torch.zeros((n, *STATE_SHAPE), device=device))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    conn.close()
    n_req = n_batch = 0
    with torch.inference_mode():
        for items in queued_batches(requests, params["max_batch"]):
            # A bytearray: torch.from_numpy wants a writable buffer.
            batch = np.frombuffer(bytearray().join(s for _, s in items), dtype=np.float32)
            out = net(torch.from_numpy(batch.reshape((len(items), *STATE_SHAPE))).to(device))
            replies = torch.cat([out["policy"], out["value"][:, None]], dim=1).cpu().numpy()
            for (worker_id, _), row in zip(items, replies):
                responses[worker_id].put(row.tobytes())
            n_req += len(items)
            n_batch += 1
            counters[0], counters[1] = n_req, n_batch
    _exit_quickly()


class QueueRun(MethodRun):
    method = "queue"

    def start_server(self) -> dict[str, Any]:
        ctx = self.ctx
        self.requests = ctx.Queue()
        self.responses = [ctx.Queue() for _ in range(self.n_workers)]
        self.shared = ctx.Array("q", 2, lock=False)
        params = {"cfg": self.cfg, "weights": self.weights, "max_batch": self.args.max_batch,
                  "threads": self.args.threads, "device": self.args.device}
        self.control, child_end = ctx.Pipe()
        self.server = ctx.Process(target=queue_server_main, name="bench-queue-server",
                                  daemon=True, args=(params, self.requests, self.responses,
                                                     self.shared, child_end))
        self.server.start()
        child_end.close()
        return {"requests": self.requests, "responses": self.responses}

    def await_server(self) -> None:
        msg = _await(self.control, self.server, READY_TIMEOUT_S, "queue evaluator start-up")
        if msg[0] != "ready":
            raise RuntimeError(f"queue evaluator failed to start:\n{msg[1]}")
        self.server_pid = msg[1]

    def counters(self) -> dict[str, float]:
        return {"requests": float(self.shared[0]), "batches": float(self.shared[1])}

    def stop_server(self, abort: bool) -> None:
        stop_queue_server(self, abort)


class TorchRLRun(MethodRun):
    method = "torchrl"

    def start_server(self) -> dict[str, Any]:
        import torch
        from tensordict import TensorDict
        from torchrl.modules.inference_server import (MPTransport, ProcessInferenceServer,
                                                      ProcessSlotTransport,
                                                      SharedMemoryTransport)

        request = TensorDict({"observation": torch.zeros(STATE_SHAPE)})
        response = TensorDict({"policy": torch.zeros(POLICY_SIZE), "value": torch.zeros(()),
                               "policy_version": torch.zeros((), dtype=torch.long)})
        kind = self.args.torchrl_transport
        if kind == "process_slot":
            transport: Any = ProcessSlotTransport(request, response, num_slots=self.n_workers,
                                                  ctx=self.ctx)
        elif kind == "shared_memory":
            transport = SharedMemoryTransport(request, response, num_slots=self.n_workers,
                                              ctx=self.ctx)
        else:
            transport = MPTransport(ctx=self.ctx)
        device = self.args.device
        self.server = ProcessInferenceServer(
            policy_factory=functools.partial(torchrl_policy, self.cfg, self.weights, device,
                                             self.args.threads),
            transport=transport, request_spec=request, max_batch_size=self.args.max_batch,
            policy_device=device, output_device="cpu", mp_context=self.ctx,
            startup_timeout=READY_TIMEOUT_S)
        return {"clients": self.server.clients(self.n_workers)}

    def await_server(self) -> None:
        self.server.start()
        self.server_pid = self.server._process.pid  # no public accessor

    def counters(self) -> dict[str, float]:
        s = self.server.stats()
        return {"requests": float(s["requests"]), "batches": float(s["batches"])}

    def stop_server(self, abort: bool) -> None:
        if getattr(self, "server", None) is not None:
            self.server.shutdown(timeout=2.0 if abort else JOIN_TIMEOUT_S)


class ShmevalRun(MethodRun):
    method = "shmeval"
    evaluator: Any = None

    def start_server(self) -> dict[str, Any]:
        import shmeval

        self.evaluator = shmeval.Evaluator.spawn(
            functools.partial(torchmodel_factory, self.cfg, self.weights, self.args.device,
                              self.args.threads, getattr(self.args, "freeze", "auto")),
            input_shape=STATE_SHAPE, outputs={"policy": ((POLICY_SIZE,), "float32"),
                                              "value": ((), "float32")},
            max_batch=self.args.max_batch, max_clients=self.n_workers + 8,
            serving_threads=self.args.serving_threads,
            max_wait_us=getattr(self.args, "max_wait_us", "auto"))
        self.server_pid = self.evaluator.pid
        return {"evaluator": self.evaluator}

    def counters(self) -> dict[str, float]:
        s = self.evaluator.stats()
        return {"requests": float(s["requests"]), "batches": float(s["batches"])}

    def stop_server(self, abort: bool) -> None:
        if self.evaluator is not None:
            self.final_stats = dict(self.evaluator.stats())
            self.evaluator.close()
            self.evaluator = None


RUNS: dict[str, type[MethodRun]] = {"local": LocalRun, "queue": QueueRun, "torchrl": TorchRLRun,
                                    "shmeval": ShmevalRun}


# --- a whole run ----------------------------------------------------------------------

def verify(method: str, check: Any, ref: dict[str, np.ndarray]) -> dict[str, Any]:
    """Worker 0's answers against the net's (RuntimeError beyond 1e-4)."""
    policy, value = check
    dp = float(np.max(np.abs(policy - ref["policy"])))
    dv = float(np.max(np.abs(value - ref["value"])))
    ok = max(dp, dv) <= CHECK_TOLERANCE
    print(f"check {method}: {N_CHECK_STATES} states, max |diff| vs the net: policy {dp:.1e}, "
          f"value {dv:.1e} ({'ok' if ok else 'MISMATCH'})", file=sys.stderr)
    if not ok:
        raise RuntimeError(f"{method}: answers differ from the net's by more than "
                           f"{CHECK_TOLERANCE}")
    return {"ok": ok, "policy_max_abs_diff": dp, "value_max_abs_diff": dv}


def measure(args: argparse.Namespace, cfg: NetConfig, weights: Weights,
            probe: Optional[Probe] = None, keep_going: bool = False,
            after: Optional[Callable[[list[dict[str, Any]], list[dict[str, Any]]], None]] = None
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every method at every worker count: (trials, runs), printing a line
    per window.  Any error stops every process of the run in progress and
    is raised; with ``keep_going`` an error of a method (not an interrupt)
    is kept in its run's entry instead (``error``, ``traceback``; the
    windows it finished stay in the trials) and the next method starts.
    ``after(trials, runs)`` is called once each method is done."""
    probe = probe or Probe()
    ref = reference(cfg, weights)
    trials: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for n_workers in args.workers:
        for method in args.methods:
            run = RUNS[method](n_workers, args, cfg, weights)
            try:
                run.start()
                info = {"method": method, "workers": n_workers, "startup_s": run.startup_s,
                        "check": verify(method, run.check, ref),
                        "workers_that_imported_torch": sum(i["torch_imported"]
                                                           for i in run.infos)}
                for repeat in range(args.repeats):
                    t = run.window(args.seconds, repeat, probe)
                    trials.append(t)
                    print(f"[{n_workers:>2} x {method:<8} {repeat + 1}/{args.repeats}] "
                          f"{t['throughput']:>9,.0f} evals/s  p50 {t['p50_us']:>8,.0f} us  "
                          f"p99 {t['p99_us']:>8,.0f} us  worker RSS "
                          f"{t['worker_rss_mb_median']:>5.0f} MB"
                          + (f"  mean batch {t['mean_batch']:.1f}" if t["mean_batch"] else "")
                          + f"  other load {t['cpu_s_other'] / t['seconds']:.2f} cores",
                          file=sys.stderr)
            except Exception as e:
                run.stop(abort=True)
                if not keep_going:
                    raise
                print(f"error: {method} x{n_workers}: {type(e).__name__}: {e}; going on with "
                      "the next method", file=sys.stderr)
                runs.append({"method": method, "workers": n_workers,
                             "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-4000:]})
                if after is not None:
                    after(trials, runs)
                continue
            except BaseException:
                run.stop(abort=True)
                raise
            stuck = run.stop()
            if stuck:
                print(f"warning: {method} x{n_workers}: had to terminate {', '.join(stuck)}",
                      file=sys.stderr)
            info["evaluator_stats"] = getattr(run, "final_stats", None)
            tuner = (info["evaluator_stats"] or {}).get("tuner")
            if tuner:
                print(f"[{n_workers:>2} x {method:<8}] the tuner at the end ({tuner['phase']}): "
                      f"{tuner['serving_threads']} serving thread(s) ({tuner['why_threads']}); "
                      f"max_wait_us {tuner['max_wait_us']:.0f} ({tuner['why_wait']})",
                      file=sys.stderr)
            runs.append(info)
            gc.collect()  # finalises the run's queues and pipes now
            if after is not None:
                after(trials, runs)
    return trials, runs


def summarise(trials: list[dict[str, Any]], keys: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Median [min, max] over the windows of each (workers, method)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for t in trials:
        groups.setdefault((t["workers"], t["method"]), []).append(t)
    rows = []
    for (workers, method), ts in groups.items():
        row: dict[str, Any] = {"workers": workers, "method": method, "repeats": len(ts)}
        for key in ("throughput", "p50_us", "p99_us", "worker_rss_mb_median", "server_rss_mb",
                    "mean_batch", *keys):
            row[key] = _stat([t.get(key) for t in ts])
        row["cpu_us_per_eval"] = _stat([1e6 * (t["cpu_s_workers"] + (t["cpu_s_server"] or 0.0))
                                        / t["evaluations"] for t in ts])
        row["other_load_cores"] = _stat([t["cpu_s_other"] / t["seconds"] for t in ts])
        rows.append(row)
    return rows


def ratios(summary: list[dict[str, Any]], workers: int) -> dict[str, float]:
    """shmeval's evals/s over each other method's, and a local worker's RSS
    over a shmeval worker's, at one worker count."""
    by = {r["method"]: r for r in summary if r["workers"] == workers}
    out: dict[str, float] = {}
    s = by.get("shmeval")
    if s is None:
        return out
    for other in METHODS:
        if other != "shmeval" and other in by:
            out[f"shmeval/{other} evals/s"] = (s["throughput"]["median"]
                                               / by[other]["throughput"]["median"])
    if "local" in by:
        out["worker RSS local/shmeval"] = (by["local"]["worker_rss_mb_median"]["median"]
                                           / s["worker_rss_mb_median"]["median"])
    return out


def print_table(summary: list[dict[str, Any]], workers: int,
                extra: Sequence[tuple[str, str, str]] = ()) -> dict[str, float]:
    """The table of one worker count (``extra``: more columns as (header,
    key, format)), and its ratios line; returns the ratios."""
    rows = sorted((r for r in summary if r["workers"] == workers),
                  key=lambda r: METHODS.index(r["method"]))
    print(f"\n{workers} workers: median of windows")
    columns = [("evals/s", "throughput", ",.0f"), ("p50 us", "p50_us", ",.0f"),
               ("p99 us", "p99_us", ",.0f"), ("worker RSS MB", "worker_rss_mb_median", ".0f"),
               ("server RSS MB", "server_rss_mb", ".0f"), ("mean batch", "mean_batch", ".1f"),
               ("CPU us/eval", "cpu_us_per_eval", ",.0f"), *extra,
               ("other load", "other_load_cores", ".2f")]
    _print_table(["method", *(h for h, _, _ in columns)],
                 [[r["method"], *(_fmt(r[k], f, False) for _, k, f in columns)] for r in rows])
    rs = ratios(summary, workers)
    if rs:
        print("ratios: " + ";  ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
    return rs


def report_targets(ratios_here: dict[str, float], goals: dict[str, float],
                   workers: int) -> dict[str, dict[str, Any]]:
    """Prints each target whose ratio the run measured at ``workers`` and
    whether it is met (reported, not enforced); returns them for the JSON."""
    targets = {}
    for name, goal in goals.items():
        if name in ratios_here:
            if not targets:
                print(f"\ntargets at {workers} workers (reported, not enforced):")
            value = ratios_here[name]
            targets[name] = {"value": value, "target": goal, "met": value >= goal}
            print(f"  {name}: {value:.2f}x (target >= {goal:g}x: "
                  f"{'met' if value >= goal else 'NOT met'})")
    return targets


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, "
                                         f"got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser, workers: str, seconds: float,
                  repeats: int) -> None:
    """The options this script and bench/gpu.py share."""
    parser.add_argument("--workers", type=_int_list, default=_int_list(workers),
                        help=f"worker counts (default {workers})")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"a subset of {','.join(METHODS)} (default all)")
    parser.add_argument("--seconds", type=float, default=seconds,
                        help=f"measured window (default {seconds:g})")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"windows per method and worker count (default {repeats})")
    parser.add_argument("--warmup", type=int, default=50,
                        help="untimed evaluations per worker before ready (default 50)")
    parser.add_argument("--samples", type=int, default=20000,
                        help="latencies each worker reports per window (default 20000)")
    parser.add_argument("--max-batch", type=int, default=256,
                        help="batch limit of the servers (default 256)")
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch intra-op threads of every process that runs the net "
                             "(default 1; 0: each one's default: PyTorch's, one per core, "
                             "and TorchModel's \"auto\", the CPUs split between its calls "
                             "in flight)")
    parser.add_argument("--filters", type=int, default=32, help="conv filters (default 32)")
    parser.add_argument("--layers", type=int, default=3, help="3x3 conv layers (default 3)")
    parser.add_argument("--torchrl-transport", choices=TORCHRL_TRANSPORTS,
                        default="process_slot",
                        help="TorchRL's transport (default process_slot, its fastest for "
                             "process workers)")
    parser.add_argument("--json", metavar="PATH", help="write every window and the summary here")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    args.methods = [m for m in METHODS if m in args.methods]
    if args.seconds <= 0 or min(args.repeats, args.warmup, args.samples, args.max_batch) < 1:
        parser.error("--seconds, --repeats, --warmup, --samples and --max-batch must be positive")
    args.threads = args.threads or None


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _auto_or(number: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: "auto", or a number that ``number`` reads."""
    def parse(text: str) -> Any:
        if text == "auto":
            return text
        try:
            return number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be auto or a number, got {text!r}") \
                from None
    return parse


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser, "16", 4.0, 3)
    parser.add_argument("--quick", action="store_true",
                        help="one 1.5 s window per method: a minute or two")
    parser.add_argument("--freeze", choices=("auto", "true", "false"), default="auto",
                        help="TorchModel's freeze (default auto: the net serves traced and "
                             "frozen on the CPU)")
    parser.add_argument("--serving-threads", type=_auto_or(int), default="auto",
                        help="shmeval's serving threads: auto (the default: the tuner "
                             "decides) or a number")
    parser.add_argument("--max-wait-us", type=_auto_or(float), default="auto",
                        help="shmeval's wait for a fuller batch: auto (the default: the "
                             "tuner decides) or microseconds (0: greedy)")
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    args.freeze = {"auto": "auto", "true": True, "false": False}[args.freeze]
    if args.quick:
        args.seconds, args.repeats, args.warmup = 1.5, 1, 20
    args.device = "cpu"
    signal.signal(signal.SIGTERM, _on_sigterm)
    cfg = NetConfig(filters=args.filters, layers=args.layers)
    weights = make_weights(cfg)
    machine = machine_info(torch=("torch",), torchrl=("torchrl",), tensordict=("tensordict",))
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    print(f"net: {cfg.layers} x conv3x3 {cfg.filters} + policy and value heads, input 6x7x2 "
          f"float32; workers {','.join(map(str, args.workers))}; {args.repeats} x "
          f"{args.seconds:g} s windows; max_batch {args.max_batch}; torchrl transport "
          f"{args.torchrl_transport}")
    began = time.monotonic()
    try:
        trials, runs = measure(args, cfg, weights)
    except KeyboardInterrupt:
        return 130
    elapsed = time.monotonic() - began
    summary = summarise(trials)
    all_ratios = {n: print_table(summary, n) for n in args.workers}
    top = max(args.workers)
    targets = report_targets(all_ratios[top], TARGETS, top)
    print(f"\nwall time {elapsed:.0f} s")
    if args.json:
        write_json(args.json, {"machine": machine, "net": vars(cfg), "config": vars(args),
                               "runs": runs, "trials": trials, "summary": summary,
                               "ratios": {str(k): v for k, v in all_ratios.items()},
                               "targets": targets, "wall_s": elapsed})
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
