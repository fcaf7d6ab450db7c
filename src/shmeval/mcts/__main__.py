"""``python -m shmeval.mcts``: the search's speed with Connect Four and the
null model, one game and sixteen at once (:mod:`shmeval.mcts.speed`)."""
from ..games import connect4
from .speed import measure_speed

for n in (1, 16):
    r = measure_speed(connect4, n)
    print(f"{n:3d} games: {r['simulations_per_s']:9,.0f} simulations/s "
          f"{r['node_visits_per_s']:10,.0f} node visits/s  "
          f"mean batch {r['mean_batch']:.1f}")
