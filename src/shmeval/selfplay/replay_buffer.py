"""The learner's replay buffer: the most recent samples in a ring, drawn
with left-right mirror augmentation."""
from __future__ import annotations

import threading
from typing import Tuple

import numpy as np

from ..games import connect4
from .records import Games


def mirror_samples(states: np.ndarray, policies: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The left-right mirror images (copies) of encoded states ``[n, 6, 7, 2]``
    and their policies ``[n, 7]`` (Connect Four's one symmetry; outcomes do
    not change)."""
    return (np.ascontiguousarray(connect4.mirror(states)),
            np.ascontiguousarray(connect4.mirror_policy(policies)))


class ReplayBuffer:
    """The most recent ``capacity`` samples (state, visit-count policy,
    outcome), in a ring.  Samples are stored once; :meth:`sample` mirrors
    each drawn sample left-right with probability 1/2."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = int(capacity)
        self.states = np.zeros((self.capacity,) + connect4.INPUT_SHAPE, np.uint8)
        self.policies = np.zeros((self.capacity, connect4.N_ACTIONS), np.float32)
        self.outcomes = np.zeros(self.capacity, np.float32)
        self.size = 0
        self.added = 0  # samples ever added
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.size

    def add(self, states: np.ndarray, policies: np.ndarray, outcomes: np.ndarray) -> None:
        """Appends samples (states 0/1 ``[n, 6, 7, 2]``, any numeric dtype),
        overwriting the oldest once full."""
        n = len(states)
        if policies.shape != (n, connect4.N_ACTIONS) or np.shape(outcomes) != (n,) or \
                states.shape[1:] != connect4.INPUT_SHAPE:
            raise ValueError(f"add: shapes {states.shape}, {policies.shape}, "
                             f"{np.shape(outcomes)} do not line up")
        with self._lock:
            if n > self.capacity:
                states, policies, outcomes = (states[-self.capacity:], policies[-self.capacity:],
                                              outcomes[-self.capacity:])
                self.added += n - self.capacity
                n = self.capacity
            idx = (self._next + np.arange(n)) % self.capacity
            self.states[idx] = states
            self.policies[idx] = policies
            self.outcomes[idx] = outcomes
            self._next = int((self._next + n) % self.capacity)
            self.size = min(self.capacity, self.size + n)
            self.added += n

    def add_games(self, games: Games) -> None:
        self.add(games.states, games.policies, games.outcomes)

    def batch(self, indices: np.ndarray, flip: np.ndarray
              ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Samples ``indices`` as float32 training arrays, the rows where
        ``flip`` is True mirrored left-right."""
        with self._lock:
            x = self.states[indices].astype(np.float32)
            p = self.policies[indices].copy()
            z = self.outcomes[indices].copy()
        if flip.any():
            x[flip], p[flip] = mirror_samples(x[flip], p[flip])
        return x, p, z

    def sample(self, n: int, rng: np.random.Generator, mirror: bool = True
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` samples drawn uniformly (with replacement), each mirrored
        with probability 1/2 when ``mirror``."""
        if self.size == 0:
            raise ValueError("the replay buffer is empty")
        idx = rng.integers(0, self.size, n)
        flip = rng.random(n) < 0.5 if mirror else np.zeros(n, bool)
        return self.batch(idx, flip)
