"""CPU per evaluation of the self-play search itself, without shmeval or a net.

One process plays Connect Four the way a `shmeval selfplay` worker does
(`--games` games at once, `--simulations` per move, root noise, a new game
when one ends), with a NumPy stand-in for the net behind
`shmeval.mcts.evaluator_fn` (random priors and values, float32 outputs as
an shmeval client returns them).  Prints the process CPU time per
evaluation, with and without the stand-in's own calls: the cost the
workers of every self-play mode pay outside their evaluation calls, before
their share of the machine with the others inflates it.

    python bench/search_cost.py                 # 16 games, 32 simulations
    python bench/search_cost.py --games 8 --repeats 5
"""
from __future__ import annotations

import argparse
import time
from typing import Dict

import numpy as np

from shmeval import mcts
from shmeval.games import connect4


class StandIn:
    """evaluate_many of random priors and values; counts its own CPU time."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.cpu_ns = 0

    def evaluate_many(self, x: np.ndarray) -> Dict[str, np.ndarray]:
        t0 = time.process_time_ns()
        n = len(x)
        out = {"policy": self.rng.dirichlet(np.ones(7), size=n).astype(np.float32),
               "value": (self.rng.random((n, 1), dtype=np.float32) - 0.5)}
        self.cpu_ns += time.process_time_ns() - t0
        return out


def run(games: int, simulations: int, moves: int, seed: int) -> Dict[str, float]:
    net = StandIn(seed)
    rng = np.random.default_rng(seed)
    search = mcts.MCTS(connect4, mcts.evaluator_fn(net))
    trees = [search.new_tree(connect4.initial()) for _ in range(games)]
    played = [0] * games
    done = 0
    t0 = time.process_time_ns()
    while done < moves:
        counts = search.search(trees, simulations, rng, noise=True)
        for j, t in enumerate(trees):
            c = counts[j]
            a = mcts.select_move(c, 1.0 if played[j] < 10 else 0.0, rng)
            (c / c.sum()).astype(np.float32)          # the sample a worker keeps
            t.advance(connect4, a)
            played[j] += 1
            if t.term[t.root] is not None:
                trees[j] = search.new_tree(connect4.initial())
                played[j] = 0
        done += games
    cpu_ns = time.process_time_ns() - t0
    evals = search.evaluated
    return {"evals": evals, "us_per_eval": cpu_ns / evals / 1e3,
            "us_per_eval_without_net": (cpu_ns - net.cpu_ns) / evals / 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--games", type=int, default=16)
    p.add_argument("--simulations", type=int, default=32)
    p.add_argument("--moves", type=int, default=2000, help="moves per round, all games together")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    run(a.games, a.simulations, a.moves // 4, a.seed)          # warm-up
    print(f"{a.games} games, {a.simulations} simulations per move, {a.moves} moves per round")
    rows = [run(a.games, a.simulations, a.moves, a.seed + r) for r in range(a.repeats)]
    for r in rows:
        print(f"  {r['evals']:8,d} evaluations: {r['us_per_eval']:5.2f} us CPU per evaluation, "
              f"{r['us_per_eval_without_net']:5.2f} without the stand-in net")
    med = float(np.median([r["us_per_eval_without_net"] for r in rows]))
    print(f"median without the stand-in net: {med:.2f} us per evaluation")


if __name__ == "__main__":
    main()
