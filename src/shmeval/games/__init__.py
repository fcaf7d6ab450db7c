"""Games for the self-play demo and tests.

Each game is a module providing the interface described by
:class:`shmeval.mcts.Game` (``initial``, ``legal_moves``, ``play``,
``terminal_value``, ``encode``, ``encode_many``, ``N_ACTIONS``,
``INPUT_SHAPE``), so the module itself can be passed to the search.

* :mod:`shmeval.games.connect4` -- Connect Four on a 6 x 7 board.
"""
from . import connect4

__all__ = ["connect4"]
