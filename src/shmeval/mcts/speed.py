"""How fast the search itself is: :func:`measure_speed` searches with the
null model, so no network and no round trip is timed.

``python -m shmeval.mcts`` measures 800 simulations from positions after 4
random moves, Connect Four, in one process.  On a 2-vCPU AMD EPYC VM,
CPython 3.11, three runs:

=========  ==================  ==================  ==========
games      simulations/s       node visits/s       mean batch
                               [#nv]_
=========  ==================  ==================  ==========
1          151-153 k           518-522 k           1.0
16         487-517 k           1.73-1.83 M         14.9
=========  ==================  ==================  ==========

.. [#nv] edges followed on the way down, summed over simulations (mean
   depth about 3.5 with the null model).

With 16 games the per-call costs (encoding, the model call, converting its
outputs) are shared by the batch, so a simulation costs about 2 us against
6.6 us alone; what remains is mostly the Python of :meth:`MCTS.search`
and of the model's call.  (The batch is a little under 16 because terminal
leaves are not sent.)
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np

from .evaluators import uniform_model
from .search import MCTS, Game


def measure_speed(game: Game[Any], n_games: int, simulations: int = 800,
                  seed: int = 0) -> Mapping[str, float]:
    """Searches ``n_games`` positions after a few random opening moves with
    the null model; returns simulations/s and node visits/s (edges followed
    on the way down, summed over all simulations) over all games together."""
    rng = np.random.default_rng(seed)
    roots = []
    for _ in range(n_games):
        s = game.initial()
        for _ in range(4):
            s = game.play(s, int(rng.choice(list(game.legal_moves(s)))))
        roots.append(s)
    m = MCTS(game, uniform_model(game.N_ACTIONS))
    trees = [m.new_tree(s) for s in roots]
    t0 = time.perf_counter()
    m.search(trees, simulations, rng, noise=True)
    dt = time.perf_counter() - t0
    sims = n_games * simulations
    # each simulation adds one visit to every edge on its path
    node_visits = sum(t.edge_visits() for t in trees)
    return {"games": n_games, "seconds": dt, "simulations_per_s": sims / dt,
            "node_visits_per_s": node_visits / dt, "evaluate_calls": m.calls,
            "mean_batch": m.evaluated / max(1, m.calls)}
