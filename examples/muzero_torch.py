#!/usr/bin/env python
"""MuZero-style self-play: one PyTorch net of representation, dynamics
and prediction functions, served to many search processes through two
methods of one evaluator, against the same search with a net per worker.

MuZero's search calls two functions of one set of weights:
``initial_inference(observation)`` once at the root (representation, then
prediction) and ``recurrent_inference(hidden_state, action)`` at every
expansion (dynamics, then prediction; a reward as well).  Here
``TorchModel(net, methods={"initial": "initial_inference", "recurrent":
"recurrent_inference"})`` serves both from one evaluator process: each
method's requests from all workers are batched together, and a weight
update (``ev.set_weights``) changes both at once.  The game played is
Connect Four (``shmeval.games.connect4``); inside the tree the search
plans with the learned model only, as MuZero does.

Each run starts N worker processes that play games with the search,
one state per request, in two set-ups:

  shmeval         one evaluator process serves the net; workers call
                  ev.evaluate(..., method="initial" / "recurrent") and
                  never import PyTorch
  net per worker  each worker builds its own copy of the net and calls it
                  on one state at a time (eager PyTorch, one thread)

    python examples/muzero_torch.py                                # a few seconds
    python examples/muzero_torch.py --workers 16 --games 2 --simulations 50 --hidden 256

It prints, for both, simulations/s (one recurrent evaluation each), moves/s
and the mean worker RSS, and the ratios.
"""
from __future__ import annotations

import argparse
import functools
import math
import multiprocessing as mp
import queue
import time

import numpy as np

import shmeval
from shmeval.games import connect4

OBS = 6 * 7 * 2          # Connect Four's encoding, flattened
ACTIONS = 7
F32 = "float32"


def methods(hidden: int) -> dict:
    """What the evaluator serves: each method's named inputs and outputs."""
    prediction = {"hidden_state": ((hidden,), F32), "policy": ((ACTIONS,), F32),
                  "value": ((), F32)}
    return {"initial": shmeval.Method(inputs={"observation": ((OBS,), F32)},
                                      outputs=prediction),
            "recurrent": shmeval.Method(inputs={"hidden_state": ((hidden,), F32),
                                                "action": ((), "int64")},
                                        outputs={**prediction, "reward": ((), F32)})}


def make_net(hidden: int, seed: int = 0):
    """The MuZero net (two-layer MLPs; PyTorch imported here, so that only
    the processes that build a net load it)."""
    import torch
    from torch import nn

    def mlp(n_in: int) -> nn.Module:
        return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                             nn.Tanh())

    class MuZeroNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.representation = mlp(OBS)
            self.dynamics = mlp(hidden + ACTIONS)
            self.reward = nn.Linear(hidden, 1)
            self.policy = nn.Linear(hidden, ACTIONS)
            self.value = nn.Linear(hidden, 1)

        def prediction(self, h: torch.Tensor) -> dict:
            return {"hidden_state": h, "policy": torch.softmax(self.policy(h), dim=1),
                    "value": torch.tanh(self.value(h))[:, 0]}

        def initial_inference(self, observation: torch.Tensor) -> dict:
            return self.prediction(self.representation(observation))

        def recurrent_inference(self, hidden_state: torch.Tensor, action: torch.Tensor) -> dict:
            a = nn.functional.one_hot(action, ACTIONS).to(hidden_state.dtype)
            h = self.dynamics(torch.cat([hidden_state, a], dim=1))
            return {**self.prediction(h), "reward": torch.tanh(self.reward(h))[:, 0]}

    torch.manual_seed(seed)
    return MuZeroNet().eval()


def factory(hidden: int):
    """Runs in the evaluator's process only: both methods of one net."""
    from shmeval.backends.torch import TorchModel

    return TorchModel(make_net(hidden), methods={"initial": "initial_inference",
                                                 "recurrent": "recurrent_inference"})


class ServedModel:
    """The worker's view of the served net: one state per request."""

    def __init__(self, ev: shmeval.Client) -> None:
        self.initial = functools.partial(ev.evaluate, method="initial")
        self.recurrent = functools.partial(ev.evaluate, method="recurrent")


class LocalModel:
    """The net in this process, called on one state at a time."""

    def __init__(self, hidden: int) -> None:
        import torch

        torch.set_num_threads(1)        # N workers share the cores
        self.torch, self.net = torch, make_net(hidden)

    def _call(self, fn, inputs: dict) -> dict:
        with self.torch.inference_mode():
            out = fn(**{k: self.torch.as_tensor(np.asarray(v))[None] for k, v in inputs.items()})
        return {k: v[0].numpy() for k, v in out.items()}

    def initial(self, inputs: dict) -> dict:
        return self._call(self.net.initial_inference, inputs)

    def recurrent(self, inputs: dict) -> dict:
        return self._call(self.net.recurrent_inference, inputs)


class Node:
    """A node of the search tree: its value is from the view of the player
    to move there; ``reward`` is the reward of the move into it, for the
    player who made it."""

    __slots__ = ("prior", "hidden", "reward", "children", "visits", "value_sum")

    def __init__(self, prior: float) -> None:
        self.prior, self.hidden, self.reward = prior, None, 0.0
        self.children: dict = {}
        self.visits, self.value_sum = 0, 0.0

    def expand(self, out: dict, actions) -> float:
        """Keeps the net's hidden state and priors; returns its value."""
        self.hidden, self.reward = out["hidden_state"], float(out.get("reward", 0.0))
        p = out["policy"][actions]
        self.children = {int(a): Node(float(q)) for a, q in zip(actions, p / p.sum())}
        return float(out["value"])

    def q(self) -> float:
        """The mean value of the move into this node, for the parent's player."""
        return self.reward - self.value_sum / self.visits if self.visits else 0.0


def muzero_search(model, observation: np.ndarray, legal: list, simulations: int,
                  rng: np.random.Generator, c_puct: float = 1.25) -> np.ndarray:
    """One move's search: ``initial`` at the root (legal moves only, with
    Dirichlet noise), then per simulation a walk down by pUCT, one
    ``recurrent`` call to expand the leaf (every action: the model has no
    rules), and the backup.  Returns the root's visit counts."""
    root = Node(1.0)
    root.expand(model.initial({"observation": observation}), np.asarray(legal))
    noise = rng.dirichlet([1.0] * len(legal))
    for child, n in zip(root.children.values(), noise):
        child.prior = 0.75 * child.prior + 0.25 * n
    all_actions = np.arange(ACTIONS)
    for _ in range(simulations):
        node, path, action = root, [root], 0
        while node.children:
            sqrt_n = math.sqrt(node.visits + 1)
            parent = node
            action, node = max(node.children.items(), key=lambda kv: kv[1].q()
                               + c_puct * kv[1].prior * sqrt_n / (1 + kv[1].visits))
            path.append(node)
        value = node.expand(model.recurrent({"hidden_state": parent.hidden,
                                             "action": np.int64(action)}), all_actions)
        for n in reversed(path):        # two players: each level sees the other side
            n.value_sum += value
            n.visits += 1
            value = n.reward - value
    return np.array([root.children[a].visits if a in root.children else 0
                     for a in range(ACTIONS)], dtype=float)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def selfplay_worker(index: int, setup: str, ev, args: argparse.Namespace, go, results) -> None:
    """Plays ``args.games`` games with the search, then reports its counts."""
    model = ServedModel(ev) if setup == "shmeval" else LocalModel(args.hidden)
    rng = np.random.default_rng(index)
    model.initial({"observation": np.zeros(OBS, np.float32)})       # attach, warm up
    results.put(("ready", index))
    go.wait()
    moves = 0
    for _ in range(args.games):
        state = connect4.initial()
        while connect4.terminal_value(state) is None:
            legal = list(connect4.legal_moves(state))
            counts = muzero_search(model, connect4.encode(state).reshape(-1), legal,
                                   args.simulations, rng)
            # Sample in proportion to the visits for the opening, then play the best.
            a = rng.choice(ACTIONS, p=counts / counts.sum()) if moves < 8 else counts.argmax()
            state = connect4.play(state, int(a))
            moves += 1
    results.put(("done", {"moves": moves, "simulations": moves * args.simulations,
                          "rss_mib": rss_mib()}))


def run_workers(target, n: int, *args) -> tuple[list[dict], float]:
    """Starts ``n`` processes of ``target(i, *args, go, results)``, lets them
    go together once all are ready, and returns their reports and the
    seconds from the start signal to the last report."""
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(i, *args, go, results)) for i in range(n)]
    for p in procs:
        p.start()

    def collect(kind: str) -> list:
        got = []
        while len(got) < n:
            try:
                what, item = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a worker process failed (its traceback is above)")
                continue
            assert what == kind
            got.append(item)
        return got

    collect("ready")
    t0 = time.perf_counter()
    go.set()
    reports = collect("done")
    seconds = time.perf_counter() - t0
    for p in procs:
        p.join()
    return reports, seconds


def summary(name: str, reports: list[dict], seconds: float) -> dict:
    row = {"simulations/s": sum(r["simulations"] for r in reports) / seconds,
           "moves/s": sum(r["moves"] for r in reports) / seconds,
           "rss": sum(r["rss_mib"] for r in reports) / len(reports)}
    print(f"{name:15s} simulations/s: {row['simulations/s']:9,.0f}   moves/s: "
          f"{row['moves/s']:7,.1f}   worker RSS: {row['rss']:6,.0f} MiB")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="self-play processes (16)")
    parser.add_argument("--games", type=int, default=1, help="games per worker (2)")
    parser.add_argument("--simulations", type=int, default=8, help="per move (50)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden state size (256)")
    args = parser.parse_args()

    print(f"{args.workers} workers, {args.games} games each, {args.simulations} simulations "
          f"a move, hidden state {args.hidden}")
    with shmeval.Evaluator.spawn(functools.partial(factory, args.hidden),
                                 methods=methods(args.hidden)) as ev:
        served = summary("shmeval", *run_workers(selfplay_worker, args.workers, "shmeval", ev,
                                                 args))
        for name, m in ev.stats()["methods"].items():
            print(f"  {name}: {m['requests']:,} requests, mean batch {m['mean_batch']:.1f}")
    local = summary("net per worker", *run_workers(selfplay_worker, args.workers, "local",
                                                   None, args))
    ratio = served["simulations/s"] / local["simulations/s"]
    print(f"shmeval / net per worker: simulations/s {ratio:.2f}x, "
          f"worker RSS {served['rss'] / local['rss']:.2f}x")


if __name__ == "__main__":
    main()
