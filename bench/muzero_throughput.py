#!/usr/bin/env python
"""MuZero-style search served three ways, and what named inputs cost.

Part 1: recurrent inference at N worker processes (16 by default), one
state per request.  Every worker mimics a MuZero search: per move it makes
one initial-inference request (an observation in; a hidden state, a policy
and a value out), then --simulations recurrent-inference requests, each
with the hidden state of a node already in its tree (picked at random from
a fixed plan) and an action (a hidden state, a reward, a policy and a
value out); it keeps every hidden state it was given and sends it back
as is.  Three ways of serving the same net (the same weights, built from
one seed in every process):

  shmeval   one ``shmeval.Evaluator.spawn`` serving both functions as
            methods: ``TorchModel(net, methods={"initial":
            "initial_inference", "recurrent": "recurrent_inference"})``;
            workers call ``ev.evaluate({...}, method=...)`` and never import
            torch
  queue     one server process with the net, behind one
            ``multiprocessing.Queue`` of requests ``(worker id, method, state
            bytes, action)``; it takes one request and whatever else is
            queued (``shmeval._util.queue_batches``, as the self-play demo's
            queue mode does), calls each method once on its rows (the
            traced and frozen functions below) and puts each answer (hidden
            state, policy, value, reward as float32 bytes) on the worker's
            own ``multiprocessing.SimpleQueue`` (as the demo does; cheaper
            per request here than a ``Queue``, which ``--queue-responses
            queue`` uses); the worker slices the hidden state's bytes off
            the answer and sends them back as they are
  local     a net per worker: each worker process holds its own copy of the
            net and calls it on its own states, one state per call (batch
            1): the same traced and frozen functions the queue server
            calls (``torch.jit.trace`` + ``torch.jit.freeze``, which run
            without Python between ops; ``--local-form eager`` calls the
            module instead), one intra-op thread, inside one
            ``torch.inference_mode`` entered at start, the hidden state
            kept as the tensor the net returned and fed back as is.  A
            search that evaluated several leaves at once could batch its
            own states; with one state per request there is nothing for a
            worker to batch.

The servers (queue, shmeval) run PyTorch with --threads intra-op threads
(default 1: the cores are shared with the workers); shmeval runs with its
defaults otherwise (the net traced and frozen, the tuner's serving
threads and batch wait).

The net (--channels, --blocks): muzero-general's ResNet layout on Connect
Four's board.  Observation 3x6x7 float32 (its Connect Four observation);
hidden state C x 6 x 7 float32, scaled to [0, 1] per state; the action
as a plane of action / 7 beside it.  representation: conv3x3 + BN +
--blocks residual blocks; dynamics: conv3x3 + BN + --blocks residual
blocks, and a reward head (conv1x1 to 2 channels, 32 hidden, 1);
prediction: --blocks residual blocks, a policy head (conv1x1 to 4
channels, 7 moves, softmax) and a value head (conv1x1 to 2 channels, 32
hidden, tanh).  Initial inference is representation + prediction,
recurrent inference dynamics + prediction: 1 + 4 x --blocks 3x3
convolutions each.  The default, 1 block of 32 channels (73,129
parameters; 5 convolutions, about 4 MFLOP per recurrent call), sits
between muzero-general's two board-game ResNets: its tic-tac-toe net (1
block of 16 channels on a 3x3 board) and its Connect Four net (6 blocks of
64 channels: 25 convolutions of 4x the work each per recurrent call,
about 20x this default's arithmetic).  A recurrent call costs a little
more than the conv net of bench/torch_throughput.py (5 convolutions of
32 channels against 3).  It is a small net of the kind people run
self-play with on CPUs, where how a state reaches the net is a large part
of its cost; a larger net shifts the cost to the arithmetic, which is the
same however the state arrives.

Part 2: the cost of a named-inputs request against one packed array of
the same bytes.  Two evaluators of a null model (it reads its input's
first element and answers one float32), N workers each, calling
``evaluate`` in a C loop (``shmeval.bench._timing.timed_calls``):
``inputs={"hidden": ((C, 6, 7), "float32"), "action": ((), "int64")}``
against ``input_shape=(bytes,), input_dtype="uint8"`` of the same bytes
(5,384 B by default), the packed array made once.  Round trips/s and the
CPU per round trip of the workers and the evaluator together.

Every mode of a part is started once, checked and warmed up, then measured
in --rounds rounds (8) of one --seconds window (3 s) per mode, the order
rotated each round, so that the host's noise hits the modes alike; idle
modes wait blocked.  The table gives each mode's medians over its
windows, the ratios are of those medians, with the lowest and highest
ratio of one round's windows beside them.  Each window also records
the workers' mean RSS (and PSS: torch's shared pages counted once) and
the server's, the CPU per request of the workers and the server, and the
"other load": what the machine's cores spent beyond the mode's processes
(this script, other programs), which skews every figure.  Before each
window the workers run untimed for --settle seconds.  Worker 0 of every
mode of part 1 answers a fixed set of searches first; its answers must
match the module's, called in this process, within 1e-4.

    python bench/muzero_throughput.py --json bench/results/muzero-throughput.json
    python bench/muzero_throughput.py --quick        # 2 workers, short windows

Targets (reported, not enforced): shmeval's recurrent evaluations/s at
least 2x the queue's and 2x the local's, a shmeval worker's RSS at most a
fifth of a local worker's, and a named-inputs round trip at most 10% more
CPU than a packed one.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
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

from shmeval._util.children import child_setup
from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info
from shmeval._util.procstat import cpu_s, machine_busy_s, pss_mb, rss_mb
from shmeval._util.queue_batches import queued_batches
from shmeval.bench.roundtrip import weighted_quantiles

MODES = ("shmeval", "queue", "local")
NULL_MODES = ("named", "packed")
BOARD = (6, 7)
N_ACTIONS = 7
OBS_SHAPE = (3, *BOARD)
INITIAL, RECURRENT = 0, 1
QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
CHECK_TOLERANCE = 1e-4
N_CHECK_SEARCHES = 3
CHECK_DEPTH = 5
OBS_POOL = 64
PLAN_MOVES = 32
LATENCY_CAP = 1 << 20
# Sixteen processes importing torch on two busy cores take a minute or more.
READY_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0
START_DELAY_NS = 200_000_000
TARGETS = {"shmeval/queue recurrent evals/s": 2.0, "shmeval/local recurrent evals/s": 2.0,
           "worker RSS local/shmeval": 5.0}
NAMED_TARGET = 1.10  # named/packed CPU per round trip, at most


# --- the net ------------------------------------------------------------------------------

def import_torch(threads: Optional[int]) -> Any:
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch


# The inference mode a process entered for good: its guard lasts as long as
# the context object does.
_INFERENCE_MODE: list[Any] = []


def enter_inference_mode(torch: Any) -> None:
    """Puts this thread in ``torch.inference_mode`` for the rest of its
    life (a worker and the queue server are one thread each)."""
    mode = torch.inference_mode()
    mode.__enter__()
    _INFERENCE_MODE.append(mode)


def build_net(channels: int, blocks: int, seed: int) -> Any:
    """The MuZero-style net (the module docstring says what it is), its
    weights and batch-norm statistics drawn from ``seed``: every process
    that builds it gets the same net.  In eval mode."""
    import torch
    from torch import nn

    cells = BOARD[0] * BOARD[1]

    def conv3(cin: int, cout: int) -> Any:
        return nn.Conv2d(cin, cout, 3, padding=1, bias=False)

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = conv3(channels, channels), nn.BatchNorm2d(channels)
            self.conv2, self.bn2 = conv3(channels, channels), nn.BatchNorm2d(channels)

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(y)))

    def tower() -> Any:
        return nn.Sequential(*(Residual() for _ in range(blocks)))

    def scaled(h: Any) -> Any:
        """Each state's hidden values scaled to [0, 1] (muzero-general's)."""
        flat = h.flatten(1)
        lo = flat.min(dim=1, keepdim=True)[0]
        hi = flat.max(dim=1, keepdim=True)[0]
        return ((flat - lo) / (hi - lo).clamp_min(1e-5)).view_as(h)

    class MuZeroNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.repr_conv, self.repr_bn = conv3(OBS_SHAPE[0], channels), nn.BatchNorm2d(channels)
            self.repr_tower = tower()
            self.dyn_conv, self.dyn_bn = conv3(channels + 1, channels), nn.BatchNorm2d(channels)
            self.dyn_tower = tower()
            self.reward_conv = nn.Conv2d(channels, 2, 1)
            self.reward_fc = nn.Sequential(nn.Linear(2 * cells, 32), nn.ReLU(), nn.Linear(32, 1))
            self.pred_tower = tower()
            self.policy_conv = nn.Conv2d(channels, 4, 1)
            self.policy_fc = nn.Linear(4 * cells, N_ACTIONS)
            self.value_conv = nn.Conv2d(channels, 2, 1)
            self.value_fc = nn.Sequential(nn.Linear(2 * cells, 32), nn.ReLU(), nn.Linear(32, 1))

        def prediction(self, h: Any) -> tuple[Any, Any]:
            x = self.pred_tower(h)
            policy = torch.softmax(self.policy_fc(torch.relu(self.policy_conv(x)).flatten(1)), -1)
            value = torch.tanh(self.value_fc(torch.relu(self.value_conv(x)).flatten(1)))
            return policy, value.flatten()

        def initial_inference(self, observation: Any) -> dict[str, Any]:
            x = torch.relu(self.repr_bn(self.repr_conv(observation)))
            hidden = scaled(self.repr_tower(x))
            policy, value = self.prediction(hidden)
            return {"hidden": hidden, "policy": policy, "value": value}

        def recurrent_inference(self, hidden: Any, action: Any) -> dict[str, Any]:
            plane = (action.to(hidden.dtype) / N_ACTIONS)[:, None, None, None]
            x = torch.cat([hidden, plane.expand(-1, 1, *BOARD)], dim=1)
            x = self.dyn_tower(torch.relu(self.dyn_bn(self.dyn_conv(x))))
            reward = self.reward_fc(torch.relu(self.reward_conv(x)).flatten(1)).flatten()
            nxt = scaled(x)
            policy, value = self.prediction(nxt)
            return {"hidden": nxt, "reward": reward, "policy": policy, "value": value}

    gen = torch.Generator().manual_seed(seed)
    net = MuZeroNet()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(max(1, p[0].numel()))))
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
    return net.eval()


def n_parameters(cfg: dict[str, Any]) -> int:
    """The net's parameters (batch-norm statistics not counted)."""
    net = build_net(cfg["channels"], cfg["blocks"], cfg["seed"])
    return sum(p.numel() for p in net.parameters())


def net_functions(torch: Any, net: Any, form: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(initial(observation) -> (hidden, policy, value), recurrent(hidden,
    action) -> (hidden, reward, policy, value))``: the module's functions
    as they are (``form`` "eager"), or traced and frozen ("frozen"), traced
    at 2 rows; either serves any batch size."""
    from torch import nn

    class Initial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, observation: Any) -> tuple[Any, Any, Any]:
            out = self.net.initial_inference(observation)
            return out["hidden"], out["policy"], out["value"]

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, hidden: Any, action: Any) -> tuple[Any, Any, Any, Any]:
            out = self.net.recurrent_inference(hidden, action)
            return out["hidden"], out["reward"], out["policy"], out["value"]

    initial, recurrent = Initial().eval(), Recurrent().eval()
    if form == "eager":
        return initial, recurrent
    with torch.inference_mode():
        obs = torch.rand((2, *OBS_SHAPE))
        hidden = initial(obs)[0]
        action = torch.tensor([1, 5])
        frozen_initial = torch.jit.freeze(torch.jit.trace(initial, (obs,)))
        frozen_recurrent = torch.jit.freeze(torch.jit.trace(recurrent, (hidden, action)))
    return frozen_initial, frozen_recurrent


def check_observations() -> np.ndarray:
    return np.random.default_rng(7).random((N_CHECK_SEARCHES, *OBS_SHAPE), dtype=np.float32)


def check_searches(initial: Callable[[np.ndarray], tuple[Any, Any, float]],
                   recurrent: Callable[[Any, int], tuple[Any, Any, float, float]],
                   to_array: Callable[[Any], np.ndarray]) -> dict[str, np.ndarray]:
    """A fixed set of short searches, each hidden state fed back as the
    step returned it: the last hidden state, and every policy, value and
    reward (initial inference's reward as 0), of each search."""
    hidden, policies, values, rewards = [], [], [], []
    for s, obs in enumerate(check_observations()):
        h, p, v = initial(obs)
        ps, vs, rs = [np.asarray(p, np.float32)], [v], [0.0]
        for d in range(CHECK_DEPTH):
            h, p, v, r = recurrent(h, (s + 3 * d) % N_ACTIONS)
            ps.append(np.asarray(p, np.float32))
            vs.append(v)
            rs.append(r)
        hidden.append(to_array(h).reshape(-1))
        policies.append(np.stack(ps))
        values.append(vs)
        rewards.append(rs)
    return {"hidden": np.stack(hidden), "policy": np.stack(policies),
            "value": np.array(values, np.float32), "reward": np.array(rewards, np.float32)}


def reference(cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The check searches through the module itself, in this process."""
    torch = import_torch(None)
    net = build_net(cfg["channels"], cfg["blocks"], cfg["seed"])
    with torch.inference_mode():
        def initial(obs: np.ndarray) -> tuple[Any, Any, float]:
            out = net.initial_inference(torch.from_numpy(obs[None]))
            return out["hidden"], out["policy"][0].numpy(), float(out["value"][0])

        def recurrent(h: Any, a: int) -> tuple[Any, Any, float, float]:
            out = net.recurrent_inference(h, torch.tensor([a]))
            return (out["hidden"], out["policy"][0].numpy(), float(out["value"][0]),
                    float(out["reward"][0]))

        return check_searches(initial, recurrent, lambda h: h.numpy())


# --- the clients each worker runs ------------------------------------------------------
#
# open_<mode>(params) -> (initial, recurrent, info): initial(obs) -> (hidden,
# policy, value), recurrent(hidden, action) -> (hidden, policy, value,
# reward); a hidden state is whatever the mode's client returned, fed back
# as is.

Opened = tuple[Callable[[np.ndarray], Any], Callable[[Any, int], Any], dict[str, Any]]


def _imported() -> dict[str, Any]:
    return {"torch_imported": "torch" in sys.modules}


def open_local(params: dict[str, Any]) -> Opened:
    cfg = params["cfg"]
    torch = import_torch(params["threads"])
    initial_fn, recurrent_fn = net_functions(
        torch, build_net(cfg["channels"], cfg["blocks"], cfg["seed"]), params["local_form"])
    enter_inference_mode(torch)
    from_numpy = torch.from_numpy
    actions = [torch.tensor([a]) for a in range(N_ACTIONS)]

    def initial(obs: np.ndarray) -> tuple[Any, Any, float]:
        h, p, v = initial_fn(from_numpy(obs[None]))
        return h, p[0].numpy(), float(v[0])

    def recurrent(h: Any, action: int) -> tuple[Any, Any, float, float]:
        h, r, p, v = recurrent_fn(h, actions[action])
        return h, p[0].numpy(), float(v[0]), float(r[0])

    return initial, recurrent, _imported()


def open_queue(params: dict[str, Any]) -> Opened:
    worker_id = params["worker_id"]
    put, get = params["requests"].put, params["responses"][worker_id].get
    hidden_nbytes = params["hidden_nbytes"]
    frombuffer, float32 = np.frombuffer, np.float32

    def initial(obs: np.ndarray) -> tuple[Any, Any, float]:
        put((worker_id, INITIAL, obs.tobytes(), 0))
        reply = get()
        tail = frombuffer(reply, float32, offset=hidden_nbytes)
        return reply[:hidden_nbytes], tail[:N_ACTIONS], float(tail[N_ACTIONS])

    def recurrent(h: bytes, action: int) -> tuple[Any, Any, float, float]:
        put((worker_id, RECURRENT, h, action))
        reply = get()
        tail = frombuffer(reply, float32, offset=hidden_nbytes)
        return (reply[:hidden_nbytes], tail[:N_ACTIONS], float(tail[N_ACTIONS]),
                float(tail[N_ACTIONS + 1]))

    return initial, recurrent, _imported()


def open_shmeval(params: dict[str, Any]) -> Opened:
    evaluate = params["evaluator"].evaluate
    actions = np.arange(N_ACTIONS, dtype=np.int64)

    def initial(obs: np.ndarray) -> tuple[Any, Any, float]:
        out = evaluate({"observation": obs}, method="initial")
        return out["hidden"], out["policy"], float(out["value"])

    def recurrent(h: np.ndarray, action: int) -> tuple[Any, Any, float, float]:
        out = evaluate({"hidden": h, "action": actions[action]}, method="recurrent")
        return out["hidden"], out["policy"], float(out["value"]), float(out["reward"])

    return initial, recurrent, _imported()


OPENERS = {"shmeval": open_shmeval, "queue": open_queue, "local": open_local}


def _to_array(h: Any) -> np.ndarray:
    if isinstance(h, (bytes, bytearray)):
        return np.frombuffer(h, np.float32)
    if hasattr(h, "numpy"):
        return h.numpy()
    return np.asarray(h, np.float32)


class Search:
    """A worker's searches, request by request: per move one initial
    request, then ``simulations`` recurrent ones, each expanding a node of
    the move's tree (its parent and action from a fixed random plan).
    Counts and latencies (ns) are kept per window."""

    def __init__(self, initial: Callable[[np.ndarray], Any],
                 recurrent: Callable[[Any, int], Any], simulations: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.initial, self.recurrent, self.simulations = initial, recurrent, simulations
        self.observations = rng.random((OBS_POOL, *OBS_SHAPE), dtype=np.float32)
        # Parent k-1 of simulation k is a node already in the tree: the root
        # (0) or one that an earlier simulation of the move expanded.
        self.parents = [[int(rng.integers(0, k)) for k in range(1, simulations + 1)]
                        for _ in range(PLAN_MOVES)]
        self.actions = [rng.integers(0, N_ACTIONS, simulations).tolist()
                        for _ in range(PLAN_MOVES)]
        self.move = 0
        self.k = 0
        self.tree: list[Any] = []
        self.total = 0.0  # what the search reads of the answers

    def step(self) -> bool:
        """One request; True when it was a recurrent one."""
        k = self.k
        if k == 0:
            h, p, v = self.initial(self.observations[self.move % OBS_POOL])
            self.tree = [h]
            self.total += v
            self.k = 1
            return False
        plan = self.move % PLAN_MOVES
        h, p, v, r = self.recurrent(self.tree[self.parents[plan][k - 1]],
                                    self.actions[plan][k - 1])
        self.tree.append(h)
        self.total += v + r
        if k == self.simulations:
            self.k = 0
            self.move += 1
        else:
            self.k = k + 1
        return True

    def run(self, start_ns: int, end_ns: int, lat_r: np.ndarray, lat_i: np.ndarray
            ) -> tuple[int, int, int, int]:
        """Untimed until ``start_ns``, then timed until ``end_ns`` (only
        requests completed inside the window count).  Returns the recurrent
        and initial requests counted, and how many latencies of each were
        recorded in ``lat_r`` / ``lat_i``."""
        now, step = time.perf_counter_ns, self.step
        while now() < start_ns:
            step()
        n_r = n_i = 0
        cap_r, cap_i = len(lat_r), len(lat_i)
        before = now()
        while True:
            recurrent = step()
            after = now()
            if after > end_ns:
                break
            if recurrent:
                if n_r < cap_r:
                    lat_r[n_r] = after - before
                n_r += 1
            else:
                if n_i < cap_i:
                    lat_i[n_i] = after - before
                n_i += 1
            before = after
        return n_r, n_i, min(n_r, cap_r), min(n_i, cap_i)


def _spread(recorded: np.ndarray, n: int) -> np.ndarray:
    """At most ``n`` of ``recorded``, evenly spread over the window."""
    if len(recorded) > n:
        recorded = recorded[np.linspace(0, len(recorded) - 1, n).astype(np.int64)]
    return recorded.copy()


def search_worker_main(mode: str, params: dict[str, Any], conn: Connection) -> None:
    """Opens the mode's client, checks worker 0's answers, warms up, reports
    ready, then runs one window per ("run", start_ns, end_ns, n_samples)
    until ("stop",) or the pipe closes."""
    child_setup()
    try:
        initial, recurrent, info = OPENERS[mode](params)
        check = (check_searches(initial, recurrent, _to_array) if params["worker_id"] == 0
                 else None)
        search = Search(initial, recurrent, params["simulations"], 1000 + params["worker_id"])
        for _ in range(params["warmup"]):
            search.step()
        info["pid"] = os.getpid()
        conn.send(("ready", info, check))
        lat_r = np.empty(LATENCY_CAP, np.int64)
        lat_i = np.empty(LATENCY_CAP // 16, np.int64)
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] != "run":
                break
            _, start_ns, end_ns, n_samples = msg
            n_r, n_i, k_r, k_i = search.run(start_ns, end_ns, lat_r, lat_i)
            conn.send(("done", n_r, n_i, _spread(lat_r[:k_r], n_samples),
                       _spread(lat_i[:k_i], n_samples)))
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        return
    if "torch" in sys.modules:  # slow to tear down; nothing left to flush
        sys.stdout.flush()
        os._exit(0)


# --- the servers ------------------------------------------------------------------------

def shmeval_factory(cfg: dict[str, Any], threads: Optional[int]) -> Any:
    """Evaluator.spawn's factory: runs in the evaluator process, the only
    process of the shmeval mode that imports torch."""
    import_torch(threads)
    from shmeval.backends.torch import TorchModel

    return TorchModel(build_net(cfg["channels"], cfg["blocks"], cfg["seed"]), device="cpu",
                      methods={"initial": "initial_inference",
                               "recurrent": "recurrent_inference"},
                      intra_op_threads=threads or "auto")


def shmeval_methods(channels: int) -> dict[str, Any]:
    import shmeval

    hidden = ((channels, *BOARD), "float32")
    return {
        "initial": shmeval.Method(
            inputs={"observation": (OBS_SHAPE, "float32")},
            outputs={"hidden": hidden, "policy": ((N_ACTIONS,), "float32"),
                     "value": ((), "float32")}),
        "recurrent": shmeval.Method(
            inputs={"hidden": hidden, "action": ((), "int64")},
            outputs={"hidden": hidden, "reward": ((), "float32"),
                     "policy": ((N_ACTIONS,), "float32"), "value": ((), "float32")}),
    }


def queue_server_main(params: dict[str, Any], requests: Any, responses: list[Any],
                      counters: Any, conn: Connection) -> None:
    """The Queue evaluator: batches what is queued, one call per method per
    batch, each answer on its worker's own queue as float32 bytes (hidden
    state, policy, value, reward)."""
    child_setup()
    try:
        cfg = params["cfg"]
        torch = import_torch(params["threads"])
        initial_fn, recurrent_fn = net_functions(
            torch, build_net(cfg["channels"], cfg["blocks"], cfg["seed"]), "frozen")
        enter_inference_mode(torch)
        hidden_shape = (cfg["channels"], *BOARD)
        for n in (1, 2, params["max_batch"]):
            h = initial_fn(torch.zeros((n, *OBS_SHAPE)))[0]
            recurrent_fn(h, torch.zeros(n, dtype=torch.long))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    conn.close()
    from_numpy, cat = torch.from_numpy, torch.cat
    zero = torch.zeros(1)
    n_req = n_batch = rec_rows = rec_calls = 0

    def tensor(items: list[Any], shape: tuple[int, ...]) -> Any:
        # A bytearray: torch.from_numpy wants a writable buffer.
        rows = np.frombuffer(bytearray().join(item[2] for item in items), np.float32)
        return from_numpy(rows.reshape((len(items), *shape)))

    for items in queued_batches(requests, params["max_batch"]):
        by_method: tuple[list[Any], list[Any]] = ([], [])
        for item in items:
            by_method[item[1]].append(item)
        for method, group in enumerate(by_method):
            if not group:
                continue
            n = len(group)
            if method == INITIAL:
                h, p, v = initial_fn(tensor(group, OBS_SHAPE))
                r = zero.expand(n)
            else:
                actions = torch.tensor([item[3] for item in group], dtype=torch.long)
                h, r, p, v = recurrent_fn(tensor(group, hidden_shape), actions)
                rec_rows += n
                rec_calls += 1
            packed = cat([h.flatten(1), p, v[:, None], r[:, None]], dim=1).numpy()
            for item, row in zip(group, packed):
                responses[item[0]].put(row.tobytes())
        n_req += len(items)
        n_batch += 1
        counters[0], counters[1], counters[2], counters[3] = n_req, n_batch, rec_rows, rec_calls
    sys.stdout.flush()
    os._exit(0)


# --- the null model of part 2 --------------------------------------------------------

class NamedNull:
    """Reads the hidden state's first element; answers one float32."""

    def __call__(self, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        h = x["hidden"]
        return {"value": h.reshape(len(h), -1)[:, 0]}


class PackedNull:
    """Reads the packed array's first byte; answers one float32."""

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"value": x[:, 0].astype(np.float32)}


def null_worker_main(mode: str, ev: Any, state: Any, warmup: int, conn: Connection) -> None:
    """Calls ``ev.evaluate(state)`` untimed until each window opens, then in
    the C loop until it closes."""
    child_setup()
    try:
        from shmeval.bench._timing import timed_calls

        evaluate = ev.evaluate
        for _ in range(warmup):
            evaluate(state)
        conn.send(("ready", {"pid": os.getpid()}, None))
        lat = np.empty(LATENCY_CAP, np.int64)
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] != "run":
                break
            _, start_ns, end_ns, n_samples = msg
            while time.perf_counter_ns() < start_ns:
                evaluate(state)
            count, _ = timed_calls(evaluate, state, end_ns, lat)
            conn.send(("done", count, 0, _spread(lat[:min(count, len(lat))], n_samples),
                       np.empty(0, np.int64)))
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


# --- one mode: its server and its workers, started once ---------------------------------

def _await(conn: Connection, proc: BaseProcess, timeout: float, what: str) -> Any:
    """The next message from a child; RuntimeError if it dies or times out."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not proc.is_alive() and not conn.poll(0):
            raise RuntimeError(f"{what}: process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: no answer within {timeout:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{what}: process exited (exit code {proc.exitcode})") from None


def _join(procs: Sequence[BaseProcess], timeout: float) -> list[str]:
    """Joins with one shared deadline; terminates, then kills, the stragglers."""
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in stuck:
        p.terminate()
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    return [p.name or "?" for p in stuck]


class ModeRun:
    """One mode's server and workers, started once, measured in several
    windows."""

    mode = ""
    part = "search"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n_workers = args.workers
        self.ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.infos: list[dict[str, Any]] = []
        self.check: Any = None
        self.server_pid: Optional[int] = None
        self.startup_s = 0.0

    # What each mode fills in.
    def start_server(self) -> dict[str, Any]:
        return {}

    def await_server(self) -> None:
        pass

    def stop_server(self, abort: bool) -> None:
        pass

    def counters(self) -> Optional[dict[str, float]]:
        """Cumulative recurrent requests and recurrent model calls."""
        return None

    def worker(self, i: int, params: dict[str, Any],
               conn: Connection) -> tuple[Any, tuple[Any, ...]]:
        """The target and arguments of worker ``i``'s process."""
        args = self.args
        return search_worker_main, (self.mode, {**params, "worker_id": i, "cfg": args.cfg,
                                                "simulations": args.simulations,
                                                "warmup": args.warmup,
                                                "threads": args.threads,
                                                "local_form": args.local_form}, conn)

    def start(self) -> None:
        t0 = time.monotonic()
        params = self.start_server()
        for i in range(self.n_workers):
            parent_end, child_end = self.ctx.Pipe()
            target, targs = self.worker(i, params, child_end)
            proc = self.ctx.Process(target=target, args=targs, daemon=True,
                                    name=f"bench-{self.mode}-{i}")
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self.await_server()
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, READY_TIMEOUT_S, f"{self.mode} worker {i} start-up")
            if msg[0] != "ready":
                raise RuntimeError(f"{self.mode} worker {i} failed to start:\n{msg[1]}")
            self.infos.append(msg[1])
            if i == 0:
                self.check = msg[2]
        self.startup_s = time.monotonic() - t0

    def window(self, seconds: float, settle: float, n_samples: int, round_: int) -> dict[str, Any]:
        now_ns = time.perf_counter_ns()
        start_ns = now_ns + START_DELAY_NS + int(settle * 1e9)
        end_ns = start_ns + int(seconds * 1e9)
        for conn in self.conns:
            conn.send(("run", start_ns, end_ns, n_samples))
        pids = [info["pid"] for info in self.infos]

        def sleep_until(t_ns: int) -> None:
            time.sleep(max(0.0, (t_ns - time.perf_counter_ns()) / 1e9))

        sleep_until(start_ns)
        busy0, cpu0 = machine_busy_s(), [cpu_s(pid) for pid in pids]
        server0 = cpu_s(self.server_pid) if self.server_pid else None
        counters0 = self.counters()
        rss: list[list[float]] = [[] for _ in pids]
        server_rss = worker_pss = server_pss = None
        for frac in (0.25, 0.5, 0.75):
            sleep_until(start_ns + int(frac * (end_ns - start_ns)))
            for j, pid in enumerate(pids):
                r = rss_mb(pid)
                if r is not None:
                    rss[j].append(r)
            if frac == 0.5:
                if self.server_pid:
                    server_rss, server_pss = rss_mb(self.server_pid), pss_mb(self.server_pid)
                pss = [v for v in (pss_mb(pid) for pid in pids) if v is not None]
                worker_pss = statistics.fmean(pss) if pss else None
        sleep_until(end_ns)
        busy1, cpu1 = machine_busy_s(), [cpu_s(pid) for pid in pids]
        server1 = cpu_s(self.server_pid) if self.server_pid else None
        counters1 = self.counters()

        counts_r, counts_i, samples_r, samples_i = [], [], [], []
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, seconds + 120.0, f"{self.mode} worker {i}")
            if msg[0] != "done":
                raise RuntimeError(f"{self.mode}: worker {i} failed:\n{msg[1]}")
            counts_r.append(msg[1])
            counts_i.append(msg[2])
            samples_r.append(msg[3])
            samples_i.append(msg[4])
        total_r, total_i = sum(counts_r), sum(counts_i)
        if total_r == 0:
            raise RuntimeError(f"{self.mode}: nothing completed in the window")
        lat = weighted_quantiles(samples_r, counts_r, list(QUANTILES.values())) / 1e3
        lat_i = (weighted_quantiles(samples_i, counts_i, list(QUANTILES.values())) / 1e3
                 if total_i and any(len(s) for s in samples_i) else None)
        worker_rss = [max(r) if r else float("nan") for r in rss]
        cpu_workers = sum(b - a for a, b in zip(cpu0, cpu1))
        cpu_server = server1 - server0 if server0 is not None and server1 is not None else None
        trial: dict[str, Any] = {
            "part": self.part, "mode": self.mode, "round": round_, "workers": self.n_workers,
            "seconds": seconds, "recurrent": total_r, "initial": total_i,
            "recurrent_per_s": total_r / seconds, "requests_per_s": (total_r + total_i) / seconds,
            "latency_us": dict(zip(QUANTILES, lat.tolist())),
            "initial_latency_us": dict(zip(QUANTILES, lat_i.tolist())) if lat_i is not None
            else None,
            "worker_counts": counts_r, "worker_rss_mb": worker_rss,
            "worker_rss_mb_mean": statistics.fmean(worker_rss),
            "worker_pss_mb_mean": worker_pss,
            "server_rss_mb": server_rss, "server_pss_mb": server_pss,
            "cpu_s_workers": cpu_workers, "cpu_s_server": cpu_server,
            # What the cores spent beyond this mode's processes (this script,
            # other programs on the shared machine): it skews every figure.
            "cpu_s_other": busy1 - busy0 - cpu_workers - (cpu_server or 0.0),
            "cpu_us_per_request": 1e6 * (cpu_workers + (cpu_server or 0.0)) / (total_r + total_i),
            "mean_recurrent_batch": None,
        }
        if counters0 and counters1 and counters1["calls"] > counters0["calls"]:
            trial["mean_recurrent_batch"] = ((counters1["requests"] - counters0["requests"])
                                             / (counters1["calls"] - counters0["calls"]))
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
            self.conns = []
            self.stop_server(abort)


class LocalRun(ModeRun):
    mode = "local"


class QueueRun(ModeRun):
    mode = "queue"
    server: Any = None

    def start_server(self) -> dict[str, Any]:
        ctx, args = self.ctx, self.args
        self.requests = ctx.Queue()
        make = ctx.SimpleQueue if args.queue_responses == "simple" else ctx.Queue
        self.responses = [make() for _ in range(self.n_workers)]
        # requests and batches; recurrent requests and recurrent model calls
        self.shared = ctx.Array("q", 4, lock=False)
        params = {"cfg": args.cfg, "max_batch": args.max_batch, "threads": args.threads}
        self.control, child_end = ctx.Pipe()
        self.server = ctx.Process(target=queue_server_main, name="bench-queue-server",
                                  daemon=True, args=(params, self.requests, self.responses,
                                                     self.shared, child_end))
        self.server.start()
        child_end.close()
        return {"requests": self.requests, "responses": self.responses,
                "hidden_nbytes": 4 * args.cfg["channels"] * BOARD[0] * BOARD[1]}

    def await_server(self) -> None:
        msg = _await(self.control, self.server, READY_TIMEOUT_S, "queue evaluator start-up")
        if msg[0] != "ready":
            raise RuntimeError(f"queue evaluator failed to start:\n{msg[1]}")
        self.server_pid = msg[1]

    def counters(self) -> dict[str, float]:
        return {"requests": float(self.shared[2]), "calls": float(self.shared[3])}

    def stop_server(self, abort: bool) -> None:
        if self.server is None:
            return
        with contextlib.suppress(Exception):
            self.requests.put(None)
        self.server.join(2.0 if abort else JOIN_TIMEOUT_S)
        if self.server.is_alive():
            self.server.terminate()
            self.server.join(2.0)
        for q in (self.requests, *self.responses):
            q.close()
            if hasattr(q, "cancel_join_thread"):
                q.cancel_join_thread()
        self.control.close()
        self.server = None


class ShmevalRun(ModeRun):
    mode = "shmeval"
    evaluator: Any = None
    final_stats: Optional[dict[str, Any]] = None

    def start_server(self) -> dict[str, Any]:
        import shmeval

        args = self.args
        self.evaluator = shmeval.Evaluator.spawn(
            functools.partial(shmeval_factory, args.cfg, args.threads),
            methods=shmeval_methods(args.cfg["channels"]), max_batch=args.max_batch,
            max_clients=self.n_workers + 8)
        self.server_pid = self.evaluator.pid
        return {"evaluator": self.evaluator}

    def counters(self) -> Optional[dict[str, float]]:
        m = (self.evaluator.stats().get("methods") or {}).get("recurrent")
        if not m:
            return None
        return {"requests": float(m["requests"]), "calls": float(m["batches"])}

    def stop_server(self, abort: bool) -> None:
        if self.evaluator is not None:
            with contextlib.suppress(Exception):
                self.final_stats = dict(self.evaluator.stats())
            self.evaluator.close()
            self.evaluator = None


class NullRun(ModeRun):
    """Part 2: an evaluator of the null model, named inputs or one packed
    array of the same bytes."""

    part = "null"
    evaluator: Any = None

    def __init__(self, args: argparse.Namespace, mode: str) -> None:
        super().__init__(args)
        self.mode = mode

    def start_server(self) -> dict[str, Any]:
        import shmeval

        channels = self.args.cfg["channels"]
        outputs = {"value": ((), "float32")}
        rng = np.random.default_rng(3)
        hidden = rng.random((channels, *BOARD), dtype=np.float32)
        if self.mode == "named":
            self.evaluator = shmeval.Evaluator.spawn(
                NamedNull, inputs={"hidden": ((channels, *BOARD), "float32"),
                                   "action": ((), "int64")},
                outputs=outputs, max_batch=self.args.max_batch,
                max_clients=self.n_workers + 8)
            self.state: Any = {"hidden": hidden, "action": np.int64(3)}
        else:
            self.evaluator = shmeval.Evaluator.spawn(
                PackedNull, input_shape=(hidden.nbytes + 8,), input_dtype="uint8",
                outputs=outputs, max_batch=self.args.max_batch,
                max_clients=self.n_workers + 8)
            self.state = np.frombuffer(hidden.tobytes() + np.int64(3).tobytes(), np.uint8).copy()
        self.server_pid = self.evaluator.pid
        return {}

    def worker(self, i: int, params: dict[str, Any],
               conn: Connection) -> tuple[Any, tuple[Any, ...]]:
        return null_worker_main, (self.mode, self.evaluator, self.state, self.args.warmup, conn)

    def stop_server(self, abort: bool) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator = None


RUNS: dict[str, Callable[[argparse.Namespace], ModeRun]] = {
    "shmeval": ShmevalRun, "queue": QueueRun, "local": LocalRun,
    "named": functools.partial(NullRun, mode="named"),
    "packed": functools.partial(NullRun, mode="packed")}


# --- a part: every mode started, then rounds of windows ---------------------------------

def verify(mode: str, check: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, Any]:
    """Worker 0's answers to the check searches against the module's."""
    diffs = {k: float(np.max(np.abs(np.asarray(check[k]) - ref[k]))) for k in ref}
    ok = max(diffs.values()) <= CHECK_TOLERANCE
    print(f"check {mode}: {N_CHECK_SEARCHES} searches of {CHECK_DEPTH} recurrent steps, max "
          f"|diff| vs the module: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
          + f" ({'ok' if ok else 'MISMATCH'})", file=sys.stderr)
    if not ok:
        raise RuntimeError(f"{mode}: answers differ from the module's by more than "
                           f"{CHECK_TOLERANCE}")
    return {"ok": ok, "max_abs_diff": diffs}


def measure_part(args: argparse.Namespace, modes: Sequence[str],
                 ref: Optional[dict[str, np.ndarray]]) -> tuple[list[dict[str, Any]],
                                                                list[dict[str, Any]]]:
    """Starts every mode of a part, then runs ``args.rounds`` rounds of one
    window per mode, the order rotated by one each round; stops them all.
    Returns (trials, runs)."""
    runs: dict[str, ModeRun] = {}
    infos: list[dict[str, Any]] = []
    trials: list[dict[str, Any]] = []
    try:
        for mode in modes:
            run = runs[mode] = RUNS[mode](args)
            run.start()
            info: dict[str, Any] = {"mode": mode, "startup_s": run.startup_s,
                                    "workers_that_imported_torch":
                                        sum(bool(i.get("torch_imported")) for i in run.infos)}
            if ref is not None:
                info["check"] = verify(mode, run.check, ref)
            infos.append(info)
            print(f"{mode}: started in {run.startup_s:.0f} s", file=sys.stderr)
        for r in range(args.rounds):
            order = [modes[(r + j) % len(modes)] for j in range(len(modes))]
            for mode in order:
                t = runs[mode].window(args.seconds, args.settle, args.samples, r)
                trials.append(t)
                lat = t["latency_us"]
                what = "recurrent evals/s" if t["part"] == "search" else "round trips/s"
                print(f"[round {r + 1}/{args.rounds}] {mode:<8} {t['recurrent_per_s']:>9,.0f} "
                      f"{what}  p50 {lat['p50']:>7,.0f} us  p99 {lat['p99']:>8,.0f} us  "
                      f"CPU {t['cpu_us_per_request']:>6,.1f} us/request  other load "
                      f"{t['cpu_s_other'] / t['seconds']:.2f} cores", file=sys.stderr)
    except BaseException:
        for run in runs.values():
            with contextlib.suppress(Exception):
                run.stop(abort=True)
        raise
    for mode, run in runs.items():
        stuck = run.stop()
        if stuck:
            print(f"warning: {mode}: had to terminate {', '.join(stuck)}", file=sys.stderr)
        stats = getattr(run, "final_stats", None)
        if stats is not None:
            for info in infos:
                if info["mode"] == mode:
                    info["evaluator_stats"] = stats
    gc.collect()  # finalises the queues and pipes now
    return trials, infos


def _stat(values: Sequence[Optional[float]]) -> Optional[dict[str, float]]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


SUMMARY_KEYS = ("recurrent_per_s", "requests_per_s", "worker_rss_mb_mean", "worker_pss_mb_mean",
                "server_rss_mb", "server_pss_mb", "mean_recurrent_batch", "cpu_us_per_request")


def summarise(trials: list[dict[str, Any]], modes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Median [min, max] over each mode's windows."""
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        ts = [t for t in trials if t["mode"] == mode]
        if not ts:
            continue
        row: dict[str, Any] = {"windows": len(ts)}
        for key in SUMMARY_KEYS:
            row[key] = _stat([t.get(key) for t in ts])
        for q in QUANTILES:
            row[f"{q}_us"] = _stat([t["latency_us"][q] for t in ts])
        row["other_load_cores"] = _stat([t["cpu_s_other"] / t["seconds"] for t in ts])
        out[mode] = row
    return out


def per_round_ratios(trials: list[dict[str, Any]], a: str, b: str, key: str
                     ) -> list[float]:
    """a's ``key`` over b's, round by round (both measured in each)."""
    by = {(t["mode"], t["round"]): t[key] for t in trials}
    rounds = sorted({t["round"] for t in trials})
    return [by[(a, r)] / by[(b, r)] for r in rounds if (a, r) in by and (b, r) in by and by[(b, r)]]


def _fmt(stat: Optional[dict[str, float]], spec: str) -> str:
    return "-" if stat is None else format(stat["median"], spec)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                    for i, (h, w) in enumerate(zip(headers, widths))))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))


def ratio_entry(summary: dict[str, dict[str, Any]], trials: list[dict[str, Any]], a: str,
                b: str, key: str, sub: str = "median") -> Optional[dict[str, Any]]:
    if a not in summary or b not in summary or summary[b][key] is None:
        return None
    value = summary[a][key][sub] / summary[b][key][sub]
    rounds = per_round_ratios(trials, a, b, key)
    return {"value": value, "per_round": rounds,
            "per_round_median": statistics.median(rounds) if rounds else None,
            "per_round_min": min(rounds) if rounds else None,
            "per_round_max": max(rounds) if rounds else None}


def _ratio_text(name: str, entry: dict[str, Any], spec: str = ".2f") -> str:
    text = f"{name} {format(entry['value'], spec)}x"
    if entry["per_round"]:
        text += (f" (rounds: median {format(entry['per_round_median'], spec)}x, "
                 f"{format(entry['per_round_min'], spec)}-{format(entry['per_round_max'], spec)})")
    return text


def report_search(summary: dict[str, dict[str, Any]], trials: list[dict[str, Any]],
                  args: argparse.Namespace) -> dict[str, Any]:
    print(f"\nMuZero-style search, {args.workers} workers, one state per request "
          f"(median of {args.rounds} windows of {args.seconds:g} s per mode):")
    columns = [("recurrent/s", "recurrent_per_s", ",.0f"), ("requests/s", "requests_per_s", ",.0f"),
               ("p50 us", "p50_us", ",.0f"), ("p90 us", "p90_us", ",.0f"),
               ("p99 us", "p99_us", ",.0f"), ("worker RSS MB", "worker_rss_mb_mean", ".0f"),
               ("worker PSS MB", "worker_pss_mb_mean", ".0f"),
               ("server RSS MB", "server_rss_mb", ".0f"),
               ("mean batch", "mean_recurrent_batch", ".1f"),
               ("CPU us/request", "cpu_us_per_request", ",.0f"),
               ("other load", "other_load_cores", ".2f")]
    print_table(["mode", *(h for h, _, _ in columns)],
                [[m, *(_fmt(summary[m][k], f) for _, k, f in columns)]
                 for m in MODES if m in summary])
    ratios: dict[str, Any] = {}
    for other in ("queue", "local"):
        entry = ratio_entry(summary, trials, "shmeval", other, "recurrent_per_s")
        if entry:
            ratios[f"shmeval/{other} recurrent evals/s"] = entry
    entry = ratio_entry(summary, trials, "local", "shmeval", "worker_rss_mb_mean")
    if entry:
        ratios["worker RSS local/shmeval"] = entry
    for other in ("queue", "local"):
        # Less moved by other programs' load than evaluations/s: what each
        # request costs the cores, whatever share of them the mode got.
        entry = ratio_entry(summary, trials, other, "shmeval", "cpu_us_per_request")
        if entry:
            ratios[f"CPU per request {other}/shmeval"] = entry
    if ratios:
        print("ratios of the medians (and of each round's windows: their median, lowest and "
              "highest):")
        for k, v in ratios.items():
            print("  " + _ratio_text(k, v))
    return ratios


def report_null(summary: dict[str, dict[str, Any]], trials: list[dict[str, Any]],
                args: argparse.Namespace) -> dict[str, Any]:
    nbytes = 4 * args.cfg["channels"] * BOARD[0] * BOARD[1] + 8
    print(f"\nNamed inputs against one packed array, null model, {args.workers} workers, "
          f"{nbytes:,} B per request (median of {args.rounds} windows of {args.seconds:g} s):")
    columns = [("round trips/s", "recurrent_per_s", ",.0f"), ("p50 us", "p50_us", ",.1f"),
               ("p90 us", "p90_us", ",.1f"), ("p99 us", "p99_us", ",.1f"),
               ("CPU us/round trip", "cpu_us_per_request", ",.2f"),
               ("other load", "other_load_cores", ".2f")]
    print_table(["mode", *(h for h, _, _ in columns)],
                [[m, *(_fmt(summary[m][k], f) for _, k, f in columns)]
                 for m in NULL_MODES if m in summary])
    ratios: dict[str, Any] = {}
    cpu = ratio_entry(summary, trials, "named", "packed", "cpu_us_per_request")
    rate = ratio_entry(summary, trials, "named", "packed", "recurrent_per_s")
    if cpu and rate:
        ratios = {"named/packed CPU per round trip": cpu, "named/packed round trips/s": rate}
        print("named/packed, ratios of the medians (and of each round's windows: their "
              "median, lowest and highest):")
        for k, v in ratios.items():
            print("  " + _ratio_text(k, v, ".3f"))
    return ratios


def report_targets(ratios: dict[str, Any]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for name, goal in TARGETS.items():
        if name in ratios:
            v = ratios[name]["value"]
            targets[name] = {"value": v, "rounds_median": ratios[name]["per_round_median"],
                             "target": f">= {goal:g}", "met": v >= goal}
    name = "named/packed CPU per round trip"
    if name in ratios:
        v = ratios[name]["value"]
        targets[name] = {"value": v, "rounds_median": ratios[name]["per_round_median"],
                         "target": f"<= {NAMED_TARGET:g}", "met": v <= NAMED_TARGET}
    if targets:
        print("\ntargets, on the ratios of the medians (reported, not enforced):")
        for name, t in targets.items():
            print(f"  {name}: {t['value']:.2f}x (target {t['target']}x: "
                  f"{'met' if t['met'] else 'NOT met'}; the rounds' median "
                  f"{t['rounds_median']:.2f}x)")
    return targets


# --- the command ------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16, help="worker processes per mode (16)")
    p.add_argument("--seconds", type=float, default=3.0, help="measured window (3)")
    p.add_argument("--rounds", type=int, default=8,
                   help="rounds of one window per mode, order rotated each round (8)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="untimed load before each window, seconds (1)")
    p.add_argument("--simulations", type=int, default=50,
                   help="recurrent requests per initial one: a move's search (50)")
    p.add_argument("--warmup", type=int, default=60, help="untimed requests per worker (60)")
    p.add_argument("--samples", type=int, default=20000,
                   help="latencies each worker reports per window (20000)")
    p.add_argument("--max-batch", type=int, default=256, help="the servers' batch limit (256)")
    p.add_argument("--threads", type=int, default=1,
                   help="PyTorch intra-op threads of every process that runs the net (1; 0: "
                        "each one's default)")
    p.add_argument("--channels", type=int, default=32, help="hidden channels (32)")
    p.add_argument("--blocks", type=int, default=1, help="residual blocks per function (1)")
    p.add_argument("--seed", type=int, default=0, help="the net's weights (0)")
    p.add_argument("--local-form", choices=("frozen", "eager"), default="frozen",
                   help="how local workers call their net: traced and frozen (the default) or "
                        "the module itself")
    p.add_argument("--part", choices=("both", "search", "named"), default="both",
                   help="run part 1 (search), part 2 (named) or both (the default)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"part 1's modes, a subset of {','.join(MODES)} (default all)")
    p.add_argument("--queue-responses", choices=("simple", "queue"), default="simple",
                   help="the queue mode's response queues: multiprocessing.SimpleQueue (the "
                        "default, as the self-play demo's; the cheaper of the two here) or "
                        "multiprocessing.Queue")
    p.add_argument("--quick", action="store_true",
                   help="2 workers, a 0.4 s window per mode, small searches: the script "
                        "working, in about a minute")
    p.add_argument("--json", metavar="PATH", help="write every window and the summary here")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.seconds, args.rounds, args.settle = 2, 0.4, 1, 0.1
        args.simulations, args.warmup, args.max_batch, args.samples = 4, 5, 16, 2000
    if min(args.workers, args.rounds, args.simulations, args.samples, args.max_batch,
           args.channels, args.blocks) < 1 or args.seconds <= 0 or args.settle < 0 \
            or args.warmup < 0:
        p.error("--workers, --rounds, --simulations, --samples, --max-batch, --channels and "
                "--blocks must be positive, --seconds too, --settle and --warmup not negative")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    args.modes = [m for m in MODES if m in args.modes]
    args.threads = args.threads or None
    args.cfg = {"channels": args.channels, "blocks": args.blocks, "seed": args.seed}
    return args


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    machine = machine_info(torch=("torch",))
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    c, b = args.channels, args.blocks
    hidden_nbytes = 4 * c * BOARD[0] * BOARD[1]
    import_torch(None)
    params = n_parameters(args.cfg)
    print(f"net: MuZero-style ResNet, {b} residual block(s) of {c} channels per function, "
          f"{params:,} parameters; observation 3x6x7 float32, hidden state "
          f"{c}x6x7 float32 ({hidden_nbytes:,} B) + action int64; {1 + 4 * b} 3x3 convolutions "
          f"per recurrent call")
    print(f"{args.workers} workers per mode, each a search of 1 initial + {args.simulations} "
          f"recurrent requests per move, one state per request; {args.rounds} rounds of a "
          f"{args.seconds:g} s window per mode (after {args.settle:g} s untimed), order rotated "
          f"each round; max_batch {args.max_batch}; {args.threads or 'default'} intra-op "
          f"thread(s); local workers' net {args.local_form}")
    began = time.monotonic()
    result: dict[str, Any] = {"machine": machine, "net": {**args.cfg,
                                                          "parameters": params},
                              "config": {k: v for k, v in vars(args).items() if k != "cfg"}}
    ratios: dict[str, Any] = {}
    try:
        if args.part in ("both", "search"):
            ref = reference(args.cfg)
            trials, runs = measure_part(args, args.modes, ref)
            summary = summarise(trials, args.modes)
            ratios.update(report_search(summary, trials, args))
            result["search"] = {"trials": trials, "runs": runs, "summary": summary}
        if args.part in ("both", "named"):
            trials, runs = measure_part(args, NULL_MODES, None)
            summary = summarise(trials, NULL_MODES)
            ratios.update(report_null(summary, trials, args))
            result["named"] = {"trials": trials, "runs": runs, "summary": summary}
    except KeyboardInterrupt:
        return 130
    result["ratios"] = ratios
    result["targets"] = report_targets(ratios)
    result["wall_s"] = time.monotonic() - began
    print(f"\nwall time {result['wall_s']:.0f} s")
    if args.json:
        write_json(args.json, result)
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
