"""The self-play demo: ``shmeval selfplay``.

Worker processes play Connect Four against themselves with the batched PUCT
search of :mod:`shmeval.mcts`, several games per worker, and evaluate the
leaves of all their games together with a Keras residual policy-value net
(:mod:`shmeval.games.connect4_net`).  How the net is reached is the mode
(:mod:`~shmeval.selfplay.modes`: shmeval, queue, local, local-batched).
Finished games go to the main process, which can save them to an ``.npz``
(:func:`save_games` / :func:`load_games`) and, with ``train``, feeds them to
a learner that trains the same net on a replay buffer (:class:`ReplayBuffer`,
left-right mirror augmentation) and pushes its weights into the running
evaluator with ``Evaluator.set_weights``; with ``eval_every`` an arena
process plays the current net against a plain MCTS with random rollouts
and records the win rate.

The package does not import TensorFlow; only the processes that run the net
do (the evaluator, the queue evaluator, the local workers, and the main
process when it trains).

=====================  =====================================================
``settings``           :class:`Settings`: what a run depends on
``modes``              one class per mode: how the workers reach the net
``mode_run``           one mode's run: workers, measured window, stop
``worker``             a worker process: the self-play loop and its counters
``net``                the net in the processes that run it
``queue_evaluator``    the queue mode's evaluator process and its wire format
``pinning``            ``--pin``: the evaluator's CPU and the workers'
``records``            finished games: checked, stored, saved, loaded
``replay_buffer``      the learner's samples, mirrored when drawn
``learner``            ``--train``: trains and pushes weights
``arena``              ``--eval-every``: the net against a rollout MCTS
``series``             the per-second time series of ``--json``
``report``             medians over runs, ratios, the summary table
``runner``             :func:`run`: the modes in turn, summary, files
``cli``                :func:`add_arguments`, :func:`main`
=====================  =====================================================
"""
from .cli import add_arguments, main
from .errors import WorkerError
from .learner import Learner
from .records import Games, GameStore, load_games, replay_game, save_games
from .replay_buffer import ReplayBuffer, mirror_samples
from .runner import run
from .settings import COMPARE_MODES, MODES, Settings

__all__ = ["Settings", "Games", "GameStore", "ReplayBuffer", "Learner", "WorkerError",
           "load_games", "save_games", "mirror_samples", "replay_game", "run", "main",
           "add_arguments", "MODES", "COMPARE_MODES"]
