"""A run's figures second by second, for ``--json`` and ``shmeval plot``:
moves, evaluations and games per second, the mean batch, the model
version, the learner's loss and buffer, each over the second that ended
at ``t_s`` (seconds since the workers started playing)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .modes import Snapshot

#: Seconds between two points.
EVERY_S = 1.0
#: The columns, in the order the JSON lists them.
COLUMNS = ("t_s", "moves_per_s", "evals_per_s", "games_per_s", "mean_batch", "model_version",
           "loss", "buffer")


class TimeSeries:
    """Points every :data:`EVERY_S` seconds from the counters' snapshots;
    :meth:`to_json` gives one list per column (None where a figure does
    not apply: no model version outside the shmeval mode, no loss before
    the learner's first step)."""

    def __init__(self, start: Snapshot) -> None:
        self.t0 = start["t"]
        self._prev = start
        self.columns: Dict[str, List[Any]] = {c: [] for c in COLUMNS}

    def due(self, t: float) -> bool:
        return bool(t - self._prev["t"] >= EVERY_S)

    def add(self, snap: Snapshot, mean_batch: Optional[float], loss: Optional[float],
            buffer: Optional[int]) -> None:
        """Records the second that ends with ``snap``; ``mean_batch`` over
        that second, ``loss`` and ``buffer`` as the learner has them now."""
        a, dt = self._prev, snap["t"] - self._prev["t"]
        point = {"t_s": round(snap["t"] - self.t0, 3),
                 "moves_per_s": (snap["moves"] - a["moves"]) / dt,
                 "evals_per_s": (snap["evals"] - a["evals"]) / dt,
                 "games_per_s": (snap["games"] - a["games"]) / dt,
                 "mean_batch": mean_batch, "model_version": snap.get("model_version"),
                 "loss": loss, "buffer": buffer}
        for c in COLUMNS:
            self.columns[c].append(point[c])
        self._prev = snap

    @property
    def last(self) -> Snapshot:
        """The snapshot the latest point ended with (the next one starts there)."""
        return self._prev

    def to_json(self) -> Dict[str, List[Any]]:
        return self.columns
