"""PUCT Monte Carlo tree search (AlphaZero style) over several games at once.

A self-play worker keeps several games going and searches all of them
together: every simulation step selects one leaf in each game's tree,
encodes those leaves into one batch, makes **one** call of
``evaluate_batch`` for the whole batch, then expands each leaf and backs its
value up its own tree.  With an shmeval client as the evaluator (see
:func:`evaluator_fn`) each step is one ``evaluate_many`` round trip carrying
as many states as the worker has unfinished games, instead of one round trip
per state.

Game interface
--------------
Anything shaped like :class:`Game` plugs in; a module works (pass
``shmeval.games.connect4`` itself).  Games are two-player, zero-sum and
alternate turns.

Evaluator
---------
``evaluate_batch(states) -> (policy, value)``: ``states`` is a float32 array
``[n, *game.INPUT_SHAPE]`` (a view of a buffer the search reuses: copy it
if you keep it); ``policy`` is ``[n, game.N_ACTIONS]`` of **probabilities**
(non-negative; illegal moves are masked out and the rest renormalized, so
they need not sum to 1 -- wrap a logits model with
``evaluator_fn(..., logits=True)`` or apply a softmax); ``value`` is ``[n]``
(or ``[n, 1]``) in [-1, 1].  Terminal leaves are scored by the game and never
sent to the network.

Sign convention
---------------
Every value is from the view of **the player to move** in the state it
belongs to: the network's value of a state, ``game.terminal_value`` (e.g.
-1 when the player to move has lost), and the edge statistics: ``W[s][a]``
sums values of playing ``a`` in ``s`` from the view of the player who
chooses ``a``.  A leaf value ``v`` is therefore added as ``-v`` to the edge
leading to the leaf, ``+v`` one level up, and so on.  Training samples carry
the final result from the view of the player to move in the sample's state.

Selection is ``argmax_a Q(s,a) + c_puct * P(s,a) * sqrt(N(s) + 1) / (1 + N(s,a))``
with ``N(s) = sum_a N(s,a)``, ``Q = W / N``, and ``Q = fpu`` (default 0)
for an unvisited edge.  Dirichlet noise ``(1 - fraction) * P + fraction *
Dir(alpha)`` is mixed into the root priors only, freshly for every search
(the noise-free priors are kept and restored first).

Trees
-----
A :class:`Tree` (the C extension ``shmeval.mcts._tree``) keeps its statistics in
flat C arrays: per node the first edge, the number of edges and the visit
count; per edge the action, prior, visit count, value sum and child id.
The states stay Python objects in ``tree.state`` (and terminal values in
``tree.term``), indexed by node id.  A node's edges
are created when it is expanded, a child node when its edge is first
selected.  Moving on with :meth:`Tree.advance` re-roots the tree at the
child and keeps its subtree (the abandoned nodes stay until the game ends:
at most ``moves * simulations`` nodes, well under 1 MB of arrays for
Connect Four).  ``tree.edges(node)`` returns a node's statistics as lists.

The walk down the tree, the PUCT arithmetic, expansion and backup run in C
(:func:`shmeval.mcts._tree.select_leaves` selects one leaf in every tree,
:func:`shmeval.mcts._tree.expand_backup` expands the evaluated leaves and
backs their values up); the game's ``play``, ``terminal_value`` and
``legal_moves`` are called from there, once per new node.

Pipelining
----------
A worker that waits for every batch leaves its CPU idle while the model
runs.  ``MCTS.play_games(..., pipeline=K, submit_batch=submitter_fn(client))``
plays its games in K groups and :func:`run_pipelined` interleaves their
searches: while one group is searched, the leaves of the other K - 1 are
being evaluated (``client.submit``, :mod:`shmeval.pipeline`).  Any search
written as steps (:meth:`MCTS.search_steps`, :meth:`MCTS.play_steps`, a
generator that yields leaf batches and is sent their ``(policy, value)``)
can be run this way; :func:`drive` runs one a call at a time.

Speed: :mod:`shmeval.mcts.speed` (``python -m shmeval.mcts``).
"""
from .evaluators import (SupportsEvaluateMany, SupportsSubmit, as_submit, evaluator_fn,
                         submitter_fn, uniform_model)
from .pipelined import run_pipelined
from .search import MCTS, Game, GameRecord, Sample, play_games, search_many, select_move
from .steps import EvaluateBatch, Steps, SubmitBatch, drive
from .speed import measure_speed
from ._tree import Tree

__all__ = ["MCTS", "Tree", "Game", "EvaluateBatch", "Sample", "GameRecord", "select_move",
           "search_many", "play_games", "evaluator_fn", "SupportsEvaluateMany", "uniform_model",
           "measure_speed", "Steps", "drive", "SubmitBatch", "submitter_fn", "SupportsSubmit",
           "as_submit", "run_pipelined"]
