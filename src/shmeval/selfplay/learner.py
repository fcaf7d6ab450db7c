"""The learner of ``shmeval selfplay --train``: trains the net on the
replay buffer in a thread of the main process and pushes its weights into
the running shmeval evaluator."""
from __future__ import annotations

import statistics
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy as np

from .replay_buffer import ReplayBuffer
from .settings import Settings


class Learner:
    """Trains the net in a thread of the main process on a replay buffer and
    pushes the weights into the running evaluator every ``push_every``
    seconds.  It trains only while every sample added has been drawn fewer
    than ``sample_reuse`` times on average (a batch draws ``batch_size``)."""

    def __init__(self, s: Settings, buffer: ReplayBuffer) -> None:
        from ..games.connect4_net import build_resnet, import_tensorflow

        import_tensorflow(s.learner_threads or None)
        self.s = s
        self.buffer = buffer
        self.model = build_resnet(s.net, seed=s.seed, compile=True)
        self.rng = np.random.default_rng([s.seed, 99])
        self.steps = 0
        self.pushes = 0
        self.version = 0
        self.history: List[Dict[str, float]] = []  # one entry per step
        self.push_log: List[Dict[str, float]] = []
        self.error: Optional[str] = None
        self._steps_at_push = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ev: Any = None
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    @property
    def loss(self) -> Optional[float]:
        """Mean loss of the last 20 steps."""
        with self._lock:
            recent = self.history[-20:]
        return statistics.fmean(h["loss"] for h in recent) if recent else None

    def start(self, ev: Any) -> None:
        self._ev = ev
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="shmeval-learner", daemon=True)
        self._thread.start()

    def _can_train(self) -> bool:
        b = self.buffer
        return (len(b) >= self.s.batch_size
                and self.steps * self.s.batch_size < self.s.sample_reuse * b.added)

    def _run(self) -> None:
        last_push = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._can_train():
                    self.step()
                else:
                    self._stop.wait(0.05)
                if time.monotonic() - last_push >= self.s.push_every:
                    self.push()
                    last_push = time.monotonic()
        except BaseException:
            self.error = traceback.format_exc()

    def step(self) -> Dict[str, float]:
        x, p, z = self.buffer.sample(self.s.batch_size, self.rng)
        r = self.model.train_on_batch(x, {"policy": p, "value": z[:, None]}, return_dict=True)
        rec = {"t": time.monotonic() - self._t0, "step": float(self.steps + 1)}
        for k in ("loss", "policy_loss", "value_loss"):
            if k in r:
                rec[k] = float(r[k])
        with self._lock:
            self.history.append(rec)
        self.steps += 1
        return rec

    def push(self) -> None:
        """Sends the weights to the evaluator if they changed since the last push."""
        if self._ev is None or self.steps == self._steps_at_push:
            return
        self.version = int(self._ev.set_weights(self.model.get_weights()))
        self._steps_at_push = self.steps
        self.pushes += 1
        self.push_log.append({"t": time.monotonic() - self._t0, "version": self.version,
                              "step": self.steps})

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
        if self.error is None:
            self.push()  # the last steps reach the evaluator too

    def abort(self) -> None:
        """Stops training without a last push."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def summary(self) -> Dict[str, Any]:
        h = self.history

        def mean(part: List[Dict[str, float]], key: str) -> Optional[float]:
            vals = [r[key] for r in part if key in r]
            return statistics.fmean(vals) if vals else None

        first, last = h[:10], h[-10:]
        return {"steps": self.steps, "pushes": self.pushes, "model_version": self.version,
                "batch_size": self.s.batch_size, "samples_in_buffer": len(self.buffer),
                "samples_added": self.buffer.added,
                "loss_first": mean(first, "loss"), "loss_last": mean(last, "loss"),
                "policy_loss_first": mean(first, "policy_loss"),
                "policy_loss_last": mean(last, "policy_loss"),
                "value_loss_first": mean(first, "value_loss"),
                "value_loss_last": mean(last, "value_loss"),
                "history": h[:: max(1, len(h) // 200)], "pushes_log": self.push_log}
