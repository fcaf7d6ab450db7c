"""A client entry whose claimer was killed between its claim and the store
of its start time holds start time 0 ("whichever process has this pid"):
the evaluator's housekeeping frees it once the pid belongs to a process
started after the entry was first seen so, and never while the pid may
still be the claimer's (_ServingLoop.reclaim_dead_clients)."""
from __future__ import annotations

from typing import Any

import pytest

from shmeval import evaluator, segment


class FakeSegment:
    def __init__(self, entries: list[tuple[int, int, int, int, bool]]) -> None:
        self.entries = entries
        self.reclaimed: list[int] = []

    def clients(self) -> list[tuple[int, int, int, int, bool]]:
        return [e for e in self.entries if e[0] not in self.reclaimed]

    def reclaim(self, c: int) -> int:
        self.reclaimed.append(c)
        return 0


def loop_on(seg: FakeSegment) -> Any:
    loop = object.__new__(evaluator._ServingLoop)
    loop.seg, loop.pid_ns, loop.unstamped = seg, 7, {}
    return loop


def test_an_unstamped_entry_is_freed_once_its_pid_is_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000]
    started = {4242: 900}  # the pid's process, started before the entry was seen
    monkeypatch.setattr(evaluator, "_boot_ticks", lambda: now[0])
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
