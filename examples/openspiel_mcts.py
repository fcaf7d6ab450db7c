#!/usr/bin/env python
"""OpenSpiel's MCTSBot with its leaves evaluated by a PyTorch
policy-value net that shmeval serves to many self-play processes, against
the same bots with a net per process.

OpenSpiel's MCTS (``open_spiel.python.algorithms.mcts.MCTSBot``) asks an
``Evaluator`` for two things: ``evaluate(state)``, the value of a leaf for
every player, and ``prior(state)``, the prior of each legal action when a
node is expanded.  ``NetEvaluator`` below answers both from one call of a
net that takes two named inputs, the observation tensor and the
legal-actions mask (as OpenSpiel's own AlphaZero model does), and keeps
the priors of the states it evaluated, since MCTSBot asks for a node's
priors a simulation after it asked for its value.

Two set-ups, each N processes playing games against themselves:

  shmeval      one evaluator process serves the net (Evaluator.spawn with
               a TorchModel); the bots' evaluator calls ev.evaluate({...})
               and the workers never import PyTorch
  net per process  each process builds its own copy of the net and calls
               it on one state at a time (eager PyTorch, one thread)

    pip install open_spiel
    python examples/openspiel_mcts.py                              # a few seconds
    python examples/openspiel_mcts.py --game connect_four --workers 16 \\
        --games 2 --simulations 100 --hidden 256

It prints games/s and moves/s of both, and the ratios.
"""
from __future__ import annotations

import argparse
import collections
import functools
import math
import multiprocessing as mp
import queue
import time

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

import shmeval


def make_net(obs_shape: tuple, n_actions: int, hidden: int, seed: int = 0):
    """An MLP policy-value net of two inputs: ``observation`` (the game's
    observation tensor, of its own shape) and ``legals_mask`` (illegal
    actions get probability 0).  PyTorch is
    imported here, so that only the processes that build a net load it."""
    import torch
    from torch import nn

    class PolicyValueNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(obs_shape), hidden),
                                      nn.ReLU(),
                                      nn.Linear(hidden, hidden), nn.ReLU())
            self.policy = nn.Linear(hidden, n_actions)
            self.value = nn.Linear(hidden, 1)

        def forward(self, observation: torch.Tensor, legals_mask: torch.Tensor) -> dict:
            h = self.body(observation)
            logits = self.policy(h).masked_fill(~legals_mask, float("-inf"))
            return {"policy": torch.softmax(logits, dim=1),
                    "value": torch.tanh(self.value(h))[:, 0]}

    torch.manual_seed(seed)
    return PolicyValueNet().eval()


def factory(obs_shape: tuple, n_actions: int, hidden: int):
    """Runs in the evaluator's process only; TorchModel calls
    ``net(observation=..., legals_mask=...)`` on each batch."""
    from shmeval.backends.torch import TorchModel

    return TorchModel(make_net(obs_shape, n_actions, hidden))


class LocalNet:
    """The net in this process, called on one state at a time: a callable
    like ``ev.evaluate``, a dict of inputs to a dict of outputs."""

    def __init__(self, *sizes: int) -> None:
        import torch

        torch.set_num_threads(1)        # N processes share the cores
        self.torch, self.net = torch, make_net(*sizes)

    def __call__(self, inputs: dict) -> dict:
        with self.torch.inference_mode():
            out = self.net(**{k: self.torch.from_numpy(v)[None] for k, v in inputs.items()})
        return {k: v[0].numpy() for k, v in out.items()}


class NetEvaluator(mcts.Evaluator):
    """OpenSpiel's evaluator interface over a policy-value function
    ``infer({"observation", "legals_mask"}) -> {"policy", "value"}``:
    ``ev.evaluate`` of a shmeval client, or a ``LocalNet``.  For two-player
    zero-sum games."""

    def __init__(self, infer, obs_shape: tuple, cache_size: int = 4096) -> None:
        self.infer, self.obs_shape = infer, obs_shape
        self.evaluations = 0
        self._priors: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_size

    def _run(self, state) -> float:
        """One net call for ``state``: keeps its priors, returns its value
        for the player to move."""
        obs = np.asarray(state.observation_tensor(), np.float32).reshape(self.obs_shape)
        out = self.infer({"observation": obs,
                          "legals_mask": np.asarray(state.legal_actions_mask(), bool)})
        self.evaluations += 1
        policy = out["policy"]
        self._priors[state.history_str()] = [(a, float(policy[a]))
                                             for a in state.legal_actions()]
        if len(self._priors) > self._cache_size:
            self._priors.popitem(last=False)
        return float(out["value"])

    def evaluate(self, state) -> np.ndarray:
        v = self._run(state)
        return np.array([v, -v]) if state.current_player() == 0 else np.array([-v, v])

    def prior(self, state) -> list:
        if state.is_chance_node():
            return state.chance_outcomes()
        key = state.history_str()
        if key not in self._priors:
            self._run(state)
        return self._priors.pop(key)    # a node is expanded once


def selfplay_worker(index: int, ev, args: argparse.Namespace, go, results) -> None:
    """Plays ``args.games`` games of MCTSBot against itself (one bot plays
    both sides: it searches for the player to move), then reports."""
    game = pyspiel.load_game(args.game)
    infer = ev.evaluate if ev is not None else LocalNet(*net_sizes(game, args.hidden))
    evaluator = NetEvaluator(infer, tuple(game.observation_tensor_shape()))
    # solve=False: every move runs all its simulations, so both set-ups do the same work.
    bot = mcts.MCTSBot(game, uct_c=2.0, max_simulations=args.simulations, evaluator=evaluator,
                       solve=False, random_state=np.random.RandomState(index))
    evaluator.evaluate(game.new_initial_state())        # attach, warm up
    results.put(("ready", index))
    go.wait()
    moves = 0
    for _ in range(args.games):
        state = game.new_initial_state()
        while not state.is_terminal():
            state.apply_action(bot.step(state))
            moves += 1
    results.put(("done", {"games": args.games, "moves": moves,
                          "evaluations": evaluator.evaluations}))


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


def net_sizes(game, hidden: int) -> tuple:
    return tuple(game.observation_tensor_shape()), game.num_distinct_actions(), hidden


def summary(name: str, reports: list[dict], seconds: float) -> dict:
    row = {k: sum(r[k] for r in reports) / seconds for k in ("games", "moves", "evaluations")}
    print(f"{name:17s} games/s: {row['games']:7,.2f}   moves/s: {row['moves']:8,.1f}   "
          f"evaluations/s: {row['evaluations']:8,.0f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--game", default="tic_tac_toe", help="an OpenSpiel game (connect_four)")
    parser.add_argument("--workers", type=int, default=2, help="self-play processes (16)")
    parser.add_argument("--games", type=int, default=2, help="games per process (2)")
    parser.add_argument("--simulations", type=int, default=16, help="per move (100)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units per layer (256)")
    args = parser.parse_args()

    game = pyspiel.load_game(args.game)
    obs_shape, n_actions, _ = sizes = net_sizes(game, args.hidden)
    print(f"{args.game}: {args.workers} processes, {args.games} games each, "
          f"{args.simulations} simulations a move")
    inputs = {"observation": (obs_shape, "float32"), "legals_mask": ((n_actions,), "bool")}
    outputs = {"policy": ((n_actions,), "float32"), "value": ((), "float32")}
    with shmeval.Evaluator.spawn(functools.partial(factory, *sizes), inputs=inputs,
                                 outputs=outputs) as ev:
        served = summary("shmeval", *run_workers(selfplay_worker, args.workers, ev, args))
        print(f"  mean batch {ev.stats()['mean_batch']:.1f} states per model call")
    local = summary("net per process",
                    *run_workers(selfplay_worker, args.workers, None, args))
    print(f"shmeval / net per process: games/s {served['games'] / local['games']:.2f}x, "
          f"moves/s {served['moves'] / local['moves']:.2f}x")


if __name__ == "__main__":
    main()
