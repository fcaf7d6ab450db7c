#!/usr/bin/env python
"""AlphaZero self-play with a PyTorch net of two named inputs: the board
planes and a legal-move mask.

The net takes ``planes`` (float32, 6 x 7 x 2: Connect Four as
``shmeval.games.connect4`` encodes it) and ``mask`` (bool, 7: the columns
that are not full) and applies the mask itself: illegal moves get logit
-inf, so the softmax gives them probability exactly 0.  One evaluator
process serves the net (``Evaluator.spawn`` with a ``TorchModel``); N
worker processes play games against themselves with ``shmeval.mcts``, each
search step sending the leaves of all its games in play in one
``evaluate_many`` call.  The workers never import PyTorch.

    python examples/alphazero_mask_torch.py                      # a few seconds
    python examples/alphazero_mask_torch.py --workers 16 --games 16 \\
        --simulations 200 --concurrent 8                          # a real run

It prints moves/s, games/s and evaluations/s, and the evaluator's mean
batch.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import queue
import time

import numpy as np

import shmeval
from shmeval.games import connect4
from shmeval.mcts import MCTS

ROWS, COLS, PLANES = 6, 7, 2
INPUTS = {"planes": ((ROWS, COLS, PLANES), "float32"), "mask": ((COLS,), "bool")}
OUTPUTS = {"policy": ((COLS,), "float32"), "value": ((), "float32")}


def make_net(channels: int, seed: int = 0):
    """A small AlphaZero-style net: three 3x3 convolutions, a
    policy head that masks illegal moves before its softmax, and a tanh
    value head.  PyTorch is imported here, so that only the processes that
    build a net load it."""
    import torch
    from torch import nn

    class MaskedPolicyValueNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(PLANES, channels, 3, padding=1), nn.ReLU(),
                nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                nn.Flatten())
            self.policy = nn.Linear(channels * ROWS * COLS, COLS)
            self.value = nn.Linear(channels * ROWS * COLS, 1)

        def forward(self, planes: torch.Tensor, mask: torch.Tensor) -> dict:
            # planes [n, 6, 7, 2] (rows, columns, planes) -> [n, 2, 6, 7]
            h = self.body(planes.permute(0, 3, 1, 2))
            logits = self.policy(h).masked_fill(~mask, float("-inf"))
            return {"policy": torch.softmax(logits, dim=1),
                    "value": torch.tanh(self.value(h))[:, 0]}

    torch.manual_seed(seed)
    return MaskedPolicyValueNet().eval()


def factory(channels: int):
    """Runs in the evaluator's process only: the net, wrapped for shmeval
    (traced and frozen on the CPU, each batch size run once at start-up).
    TorchModel calls ``net(planes=..., mask=...)``."""
    from shmeval.backends.torch import TorchModel

    return TorchModel(make_net(channels))


def legal_mask(planes: np.ndarray) -> np.ndarray:
    """The legal moves of encoded positions: a column is playable while its
    top cell (row 0 of the encoding) holds no stone of either player."""
    return planes[:, 0, :, :].sum(axis=-1) == 0


def masked_evaluator(ev: shmeval.Client):
    """The ``evaluate_batch(states) -> (policy, value)`` that shmeval.mcts
    calls once per search step with the encoded leaves of all games in
    play: it adds their masks and sends both inputs in one request."""

    def evaluate_batch(planes: np.ndarray):
        mask = legal_mask(planes)
        out = ev.evaluate_many({"planes": planes, "mask": mask})
        policy = out["policy"]
        # The net masks: illegal moves get exactly 0, before the search's own masking.
        assert not policy[~mask].any(), "the net gave an illegal move probability"
        return policy, out["value"]

    return evaluate_batch


def selfplay_worker(index: int, ev: shmeval.Client, args: argparse.Namespace,
                    go, results) -> None:
    """One self-play process: attaches to the evaluator, reports ready,
    waits for the start signal, plays its games and reports its counts."""
    search = MCTS(connect4, masked_evaluator(ev))
    start = connect4.encode_many([connect4.initial()])
    ev.evaluate_many({"planes": start, "mask": legal_mask(start)})   # attach, warm up
    results.put(("ready", index))
    go.wait()
    games = search.play_games(args.games, args.simulations, np.random.default_rng(index),
                              concurrent=args.concurrent)
    results.put(("done", {"games": len(games), "moves": sum(len(g.moves) for g in games),
                          "evaluations": search.evaluated, "calls": search.calls}))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="self-play processes (16)")
    parser.add_argument("--games", type=int, default=2, help="games per worker (16)")
    parser.add_argument("--simulations", type=int, default=16, help="per move (200)")
    parser.add_argument("--concurrent", type=int, default=2,
                        help="games in play at once per worker, searched together (8)")
    parser.add_argument("--channels", type=int, default=32, help="filters per convolution")
    parser.add_argument("--max-batch", type=int, default=256)
    args = parser.parse_args()

    with shmeval.Evaluator.spawn(functools.partial(factory, args.channels), inputs=INPUTS,
                                 outputs=OUTPUTS, max_batch=args.max_batch,
                                 slots_per_client=max(16, args.concurrent)) as ev:
        reports, seconds = run_workers(selfplay_worker, args.workers, ev, args)
        stats = ev.stats()
    games = sum(r["games"] for r in reports)
    moves = sum(r["moves"] for r in reports)
    evaluations = sum(r["evaluations"] for r in reports)
    print(f"{args.workers} workers, {games} games, {moves} moves, "
          f"{args.simulations} simulations a move, in {seconds:.2f} s")
    print(f"moves/s: {moves / seconds:,.1f}")
    print(f"games/s: {games / seconds:,.2f}")
    print(f"evaluations/s: {evaluations / seconds:,.0f}")
    print(f"mean batch: {stats['mean_batch']:.1f} states per model call")


if __name__ == "__main__":
    main()
