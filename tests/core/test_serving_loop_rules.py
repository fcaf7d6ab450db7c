"""Rules of the serving loop (ServingLoop) checked on their own, with a
stand-in for the segment: the cases that a run of real processes reaches
only by chance or after long waits."""
from __future__ import annotations

from typing import Any, Optional

import pytest

from shmeval import segment
from shmeval import serving as loop_module


class FakeSegment:
    def __init__(self, entries: Optional[list[tuple[int, int, int, int, bool]]] = None,
                 serving: int = 1) -> None:
        self.entries = entries or []
        self.reclaimed: list[int] = []
        self.serving = serving
        self.calls: list[str] = []

    def replicas_serving(self) -> int:
        return self.serving

    def replica_stop(self, r: int, state: str) -> int:
        self.calls.append(f"stop {r} {state}")
        self.serving -= 1
        return self.serving

    def close_and_wake(self, reason: int) -> None:
        self.calls.append("close")

    def restarts_left(self) -> int:
        return 0

    def clients(self) -> list[tuple[int, int, int, int, bool]]:
        return [e for e in self.entries if e[0] not in self.reclaimed]

    def reclaim(self, c: int) -> int:
        self.reclaimed.append(c)
        return 0


def loop_on(seg: FakeSegment) -> Any:
    loop = object.__new__(loop_module.ServingLoop)
    loop.seg, loop.pid_ns, loop.unstamped = seg, 7, {}
    return loop


class Exited(Exception):
    pass


def fake_exit(code: int) -> None:
    raise Exited(code)


@pytest.mark.parametrize("serving", [1, 2])
def test_a_replica_with_a_stuck_thread_ends_its_process(
        monkeypatch: pytest.MonkeyPatch, serving: int) -> None:
    """A serving thread that did not return (stuck in a model call) could
    still complete a batch the other replicas took again: while others
    serve, the replica ends its process instead of stopping; the last one
    out closes as ever."""
    monkeypatch.setattr(loop_module.os, "_exit", fake_exit)
    seg = FakeSegment(serving=serving)
    loop = loop_on(seg)
    loop.replica, loop.stop_reason = 1, 3
    if serving > 1:
        with pytest.raises(Exited, match=str(loop_module.EXIT_STUCK)):
            loop.leave(joined=False)
        assert seg.calls == []  # not stopped: the others find it dead once it is gone
    else:
        loop.leave(joined=False)
        assert seg.calls == ["stop 1 stopped", "close"]
    seg = FakeSegment(serving=2)
    loop.seg = seg
    loop.leave(joined=True)
    assert seg.calls == ["stop 1 stopped"]  # its batches: put back by the others


def test_an_unstamped_entry_is_freed_once_its_pid_is_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000]
    started = {4242: 900}  # the pid's process, started before the entry was seen
    monkeypatch.setattr(loop_module, "_boot_ticks", lambda: now[0])
    monkeypatch.setattr(segment, "process_starttime", lambda pid: started.get(pid))
    seg = FakeSegment([(0, 4242, 0, 7, False), (1, 4343, 0, 7, False)])
    started[4343] = 950
    loop = loop_on(seg)
    loop.reclaim_dead_clients()
    now[0] = 1100
    loop.reclaim_dead_clients()
    assert seg.reclaimed == []  # alive, and may be the claimer
    started[4242] = 1050  # the claimer died; its pid went to a newer process
    loop.reclaim_dead_clients()
    assert seg.reclaimed == [0]
    del started[4343]  # the other claimer died (pid not reused): reclaimed as ever
    loop.reclaim_dead_clients()
    assert seg.reclaimed == [0, 1]
    assert loop.unstamped == {}
