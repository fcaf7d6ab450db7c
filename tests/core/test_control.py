"""The serving loop's control path and its quiet points.

A control request is announced in the segment (a ticket any process of the
user can bump) and its message comes through the owner's pipe.  The loop
never waits for an announced message: a bump with nothing behind it costs a
look at the pipe, not a stall.  And work that needs no batch in flight
(reclaiming, weight updates) waits for quiet, or does not happen at all when
the group is stopping."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import numpy as np
import pytest

from shmeval import _ring, segment, serving
from shmeval.config import ServeConfig
from shmeval.spec import Spec
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, fake_model, make_ev, make_state
from test_hotswap import WeightedModel


class RecordingPipe:
    """The loop's end of the control pipe: records every poll's timeout."""

    def __init__(self) -> None:
        self.inbox: list[Any] = []
        self.sent: list[Any] = []
        self.timeouts: list[Optional[float]] = []

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        self.timeouts.append(timeout)
        return bool(self.inbox)

    def recv(self) -> Any:
        return self.inbox.pop(0)

    def send(self, obj: Any) -> None:
        self.sent.append(obj)


def serving_loop(pipe: RecordingPipe) -> tuple[serving.ServingLoop, str]:
    # Fixed settings (no tuner): greedy, a 50 µs spin, one thread.
    config = ServeConfig(input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8, max_clients=4,
                         slots_per_client=4, max_wait_us=0, evaluator_spin_us=50,
                         serving_threads=1)
    seg, name = segment.create(config.spec)
    return serving.ServingLoop(seg, WeightedModel(), config, pipe), name


def test_an_announced_message_is_not_waited_for() -> None:
    pipe = RecordingPipe()
    loop, name = serving_loop(pipe)
    try:
        seg = loop.seg
        ticket = seg.request_control()           # announced, not sent (yet)
        t0 = time.monotonic()
        loop.handle_control()
        assert time.monotonic() - t0 < 0.5
        assert pipe.timeouts and all(not t for t in pipe.timeouts), pipe.timeouts
        assert seg.control_pending(0) == (ticket, ticket)  # the loop moves on
        assert loop.control_until > 0                     # and looks again soon
        # The message arrives: the next look applies it.
        pipe.inbox.append((ticket, "set_weights", [np.float32(5)], 1))
        loop.poll_control(_ring.now_ns())
        assert pipe.sent == [(ticket, True, 1)]
        assert loop.version == 1 and seg.replicas()[0]["version"] == 1
        assert loop.control_until == 0
        # A bump that never gets a message: looked for until CONTROL_WAIT_NS.
        seg.request_control()
        loop.handle_control()
        assert loop.control_until > 0
        loop.poll_control(loop.control_until)
        assert loop.control_until == 0
    finally:
        segment.unlink(name)


@pytest.mark.timeout(60)
def test_bumps_without_messages_do_not_stall_serving() -> None:
    """Another process of the user bumps the control ticket again and again;
    requests keep being answered and weight updates still apply.  (A
    serving loop that waited for a message after each bump would stall up
    to a second per bump.)"""
    with make_ev(WeightedModel()) as ev:
        peer = segment.attach(ev.address)[0]
        stop = threading.Event()

        def bump() -> None:
            while not stop.is_set():
                peer.request_control()
                time.sleep(0.005)

        t = threading.Thread(target=bump)
        t.start()
        try:
            for i in range(200):
                check_answer(ev.evaluate(make_state(i)), i)
            assert ev.set_weights([np.float32(1000)], timeout=30) == 1
            out, version = ev.evaluate(make_state(7), return_version=True)
            assert version == 1 and out["value"] == -7 + 1000
        finally:
            stop.set()
            t.join()


def test_quiesce_waits_for_batches_and_refuses_when_stopping() -> None:
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 4, 4)
    seg, name = segment.create(spec)
    try:
        seg.set_serving(0, 0, 0)
        group = _ring.ServeGroup()
        batch = np.zeros((8,) + INPUT_SHAPE, np.float32)
        server = _ring.Server(seg, batch, group)
        assert group.quiesce() is True            # nothing in flight
        c = seg.register(os.getpid(), 0, 0)
        seg.post(c, [0], np.stack([make_state(4)]), 0)
        assert server.collect(8, 0, 0, 10_000_000) == 1 and group.in_flight == 1
        # Stopping with a batch in flight: no quiet to be had, say so at once.
        group.stop = True
        assert group.quiesce() is False
        # Not stopping: wait until the batch is finished.
        group.stop = False
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(group.quiesce()))
        t.start()
        time.sleep(0.05)
        assert not done
        out = fake_model(batch[:1])
        server.complete([np.ascontiguousarray(out[k]) for k in spec.output_names], 0)
        t.join(10)
        assert done == [True]
    finally:
        segment.unlink(name)
