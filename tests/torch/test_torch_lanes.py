"""``TorchModel``'s CUDA lanes (``shmeval.backends._torch_lanes``), checked
on the CPU: the CUDA calls are recorded by stand-ins, and a lane's buffers
are ordinary tensors, so that what a call copies, runs and returns is the
real code's.

- GpuWait: "block" blocks on the event at once, "spin" looks first and
  blocks only when its budget runs out, and a call waits on its lane's
  event, recorded on its lane's stream, as the model's policy says;
- a lane's buffers cut to a batch size are made once per size and are
  views of the lane's one buffer per input and one packed output buffer;
  a call answers as the module does through them, with one output or
  several, by a graph's replay or by the function;
- building a lane: its stream waits for the thread's stream, its buffers
  are made on its stream, its event blocks, three warm-ups come before
  each capture, which is thread-local, on the lane's stream;
- lanes are built one at a time (BUILD_LOCK), from two threads at once
  too; prepare builds one per serving thread up front, with the replica's
  GPU current (cuda:1 is GPU 1), and serving threads take them without
  building.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest

from backend_contract import F32, INPUT_SHAPE, OUTPUTS, random_states
from shmeval.spec import Spec
from torch_models import pv_net, reference

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")

SPEC = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1)


@pytest.fixture(scope="module")
def torch() -> Any:
    import torch

    torch.set_num_threads(1)
    return torch


@pytest.fixture(scope="module")
def lanes(torch: Any) -> Any:
    from shmeval.backends import _torch_lanes

    return _torch_lanes


@pytest.fixture(scope="module")
def backend(torch: Any) -> Any:
    from shmeval.backends import torch as backend

    return backend


class Event:
    """A CUDA event's stand-in: done at the ``done_after``-th query (never
    with None); counts queries and synchronizes, and records streams."""

    def __init__(self, done_after: Any = 1) -> None:
        self.done_after = done_after
        self.queries = 0
        self.synchronized = 0
        self.recorded: list[Any] = []

    def query(self) -> bool:
        self.queries += 1
        return self.done_after is not None and self.queries >= self.done_after

    def synchronize(self) -> None:
        self.synchronized += 1

    def record(self, stream: Any = None) -> None:
        self.recorded.append(stream)


def served_method(backend: Any, outputs: str = "dict", spec: Spec = SPEC) -> tuple[Any, Any]:
    """(a prepared CPU TorchModel's method, the net)."""
    net = pv_net(0, outputs)
    tm = backend.TorchModel(net, device="cpu", freeze=False)
    tm.prepare(spec, None)
    return tm._served[0], net


def cpu_lane(lanes: Any, methods: Any, rows: int = 8) -> Any:
    """A lane of ordinary CPU tensors (no stream: torch.cuda.stream(None)
    does nothing) and a stand-in event."""
    return lanes.Lane(stream=None, done=Event(),
                      methods=[lanes.LaneMethod(m, rows, "cpu", pin=False) for m in methods])


# -- waiting ------------------------------------------------------------------------


def test_gpu_wait_settings(lanes: Any, backend: Any) -> None:
    assert lanes.GpuWait.of("block") == lanes.GpuWait(0.0)
    assert lanes.GpuWait.of("spin") == lanes.GpuWait(None)
    assert lanes.GpuWait.of(25) == lanes.GpuWait(25.0)
    assert lanes.GpuWait.of("spin").spin_ns() > 0  # one wake-up's cost, measured
    assert lanes.GpuWait.of(25).spin_ns() == 25_000
    for bad in ("fast", -1, True, float("nan"), 2e6, None):
        with pytest.raises(ValueError, match="gpu_wait"):
            lanes.GpuWait.of(bad)
    assert backend.TorchModel(pv_net(), device="cpu").gpu_wait == lanes.GpuWait(None)
    assert backend.TorchModel(pv_net(), device="cpu", gpu_wait="block").gpu_wait.spin_us == 0
    with pytest.raises(ValueError, match="gpu_wait"):
        backend.TorchModel(pv_net(), device="cpu", gpu_wait="busy")


def test_block_sleeps_at_once_spin_looks_first(lanes: Any) -> None:
    """block: synchronize, no query; spin: queries until done, no
    synchronize; a spin whose budget runs out blocks."""
    blocked = Event(done_after=3)
    lanes.GpuWait.of("block").wait(blocked)
    assert (blocked.queries, blocked.synchronized) == (0, 1)

    spun = Event(done_after=3)
    lanes.GpuWait.of(1e6).wait(spun)  # a second's budget: done long before
    assert (spun.queries, spun.synchronized) == (3, 0)

    never = Event(done_after=None)
    lanes.GpuWait.of(1).wait(never)  # 1 µs, then block
    assert never.queries >= 1 and never.synchronized == 1


def test_a_call_waits_on_its_lanes_event(lanes: Any, backend: Any, torch: Any) -> None:
    m, net = served_method(backend)
    lane = cpu_lane(lanes, [m])
    lane.stream = "the lane's stream"
    waited: list[Any] = []

    class Policy:
        def wait(self, event: Any) -> None:
            waited.append(event)

    x = random_states(5, 1)
    with torch.inference_mode():
        out = lanes.call_on_lane(lane, 0, m, [x], Policy())
    assert waited == [lane.done] and lane.done.recorded == ["the lane's stream"]
    for name, want in reference(net)(x).items():
        np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-6)


# -- buffers ------------------------------------------------------------------------


def test_packed_offsets_are_aligned(lanes: Any) -> None:
    # policy 7 float32 (28 bytes a row), value 4 bytes, a bool 3 bytes a row
    assert lanes.packed_offsets(3, [28, 4, 3]) == [0, 96, 112, 128]
    assert lanes.packed_offsets(4, [28, 4]) == [0, 112, 128]
    assert all(at % lanes.ALIGN == 0 for at in lanes.packed_offsets(5, [1, 3, 7, 8]))


def test_cuts_are_cached_views_of_one_buffer(lanes: Any, backend: Any, torch: Any) -> None:
    m, _ = served_method(backend)
    lm = lanes.LaneMethod(m, 8, "cpu", pin=False)
    four = lm.cut(4)
    assert lm.cut(4) is four and lm.cut(2) is not four
    assert four.device_in[0].data_ptr() == lm.device_in[0].data_ptr()
    assert four.device_in[0].shape == (4, *INPUT_SHAPE)
    assert np.shares_memory(four.host_in[0], lm.host_in[0].numpy())
    assert four.host_in_t[0].data_ptr() == lm.host_in[0].data_ptr()
    host = lm.host_out.numpy()
    for name, shape in (("policy", (4, 7)), ("value", (4,))):
        assert four.host_out[name].shape == shape and np.shares_memory(four.host_out[name], host)
    # Two outputs: packed on the device, one run of bytes copied back.
    assert four.device_packed.data_ptr() == lm.device_out.data_ptr()
    assert four.host_packed.data_ptr() == lm.host_out.data_ptr()
    assert all(t.data_ptr() >= lm.device_out.data_ptr() for t in four.device_out)


def test_one_output_is_copied_back_as_it_is(lanes: Any, backend: Any, torch: Any) -> None:
    spec = Spec.build(INPUT_SHAPE, F32, {"policy": ((7,), F32)}, 8, 1, 1)
    m, net = served_method(backend, "policy", spec)
    lane = cpu_lane(lanes, [m])
    assert lane.methods[0].device_out is None
    x = random_states(3, 2)
    with torch.inference_mode():
        out = lanes.call_on_lane(lane, 0, m, [x], lanes.GpuWait.of("block"))
    np.testing.assert_allclose(out["policy"], reference(net)(x)["policy"], rtol=1e-5, atol=1e-6)
    assert np.shares_memory(out["policy"], lane.methods[0].host_out.numpy())


def test_calls_through_a_replay_and_through_the_function(lanes: Any, backend: Any,
                                                         torch: Any) -> None:
    """Batches of a size with a graph replay it and copy back what it left;
    others run the function; both answer as the module, from the lane's
    buffers, and the next call of a size reuses them."""
    m, net = served_method(backend)
    lane = cpu_lane(lanes, [m])
    lm = lane.methods[0]
    four = lm.cut(4)
    replays: list[int] = []

    class Replay:  # what a CUDA graph of the packed function does on replay
        def replay(self) -> None:
            replays.append(4)
            four.pack(m.fitted(four.device_in))

    ref = reference(net)
    with torch.inference_mode():
        lm.graphs[4] = (Replay(), four.pack(m.fitted(four.device_in)))
        for rows, seed in ((4, 1), (3, 2), (4, 3)):
            x = random_states(rows, seed)
            out = lanes.call_on_lane(lane, 0, m, [x], lanes.GpuWait.of("block"))
            for name, want in ref(x).items():
                np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-6)
                assert np.shares_memory(out[name], lm.host_out.numpy())
    assert replays == [4, 4] and lane.done.synchronized == 3
    assert lm.cut(4) is four


# -- building -----------------------------------------------------------------------


@contextlib.contextmanager
def recorded_cuda(torch: Any, lanes: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """torch.cuda's streams, events, graphs and stream contexts as
    stand-ins that record what build_lane does; its LaneMethods on the CPU."""
    log = SimpleNamespace(events=[], captures=[], made_on=[], order=[], active=None)
    made_here = lanes.LaneMethod

    class Stream:
        def wait_stream(self, other: Any) -> None:
            log.order.append(("wait_stream", other))

        def synchronize(self) -> None:
            log.order.append("synchronize")

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        before, log.active = log.active, s
        try:
            yield
        finally:
            log.active = before

    class Graph:
        def pool(self) -> str:
            return "pool"

    @contextlib.contextmanager
    def graph(g: Any, **kw: Any) -> Iterator[None]:
        log.captures.append(kw)
        log.order.append("capture")
        with stream(kw["stream"]):
            yield

    def lane_method(m: Any, rows: int, device: Any) -> Any:
        log.made_on.append(log.active)
        return made_here(m, rows, "cpu", pin=False)

    def event(**kw: Any) -> Event:
        log.events.append(kw)
        return Event()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "the thread's stream")
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(lanes, "LaneMethod", lane_method)
    yield log


def test_building_a_lane(lanes: Any, backend: Any, torch: Any,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane's stream waits for the thread's; buffers are made on the
    lane's stream; its event blocks; each size is run WARMUPS times, then
    captured thread-local on the lane's stream into the lane's pool."""
    m, _ = served_method(backend)
    calls: list[int] = []
    fitted = m.fitted
    monkeypatch.setattr(m, "fitted", lambda xs: calls.append(len(xs[0])) or fitted(xs))
    with recorded_cuda(torch, lanes, monkeypatch) as log:
        with lanes.BUILD_LOCK:
            lane = lanes.build_lane("cuda:1", [m], 8, (8, 2), True)
    assert log.order[0] == ("wait_stream", "the thread's stream")
    assert log.made_on == [lane.stream] and log.events == [{"blocking": True}]
    assert calls == [8] * (lanes.WARMUPS + 1) + [2] * (lanes.WARMUPS + 1) and lanes.WARMUPS == 3
    assert [c["capture_error_mode"] for c in log.captures] == ["thread_local"] * 2
    assert all(c["stream"] is lane.stream for c in log.captures)
    assert [c["pool"] for c in log.captures] == [None, "pool"] and lane.captures == 2
    assert sorted(lane.methods[0].graphs) == [2, 8]
    assert log.order.count("synchronize") == 2  # the warm-ups are done before each capture


def test_build_lane_wants_the_lock(lanes: Any, backend: Any) -> None:
    m, _ = served_method(backend)
    with pytest.raises(AssertionError):
        lanes.build_lane("cuda", [m], 8, (), False)


@pytest.mark.filterwarnings("ignore:TorchModel. more threads:RuntimeWarning")
def test_lanes_are_built_one_at_a_time(backend: Any, lanes: Any,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads beyond the lanes build one each, at the same moment: the
    builds do not overlap, each thread keeps its own, and every capture
    is counted."""
    tm = backend.TorchModel(pv_net(), device="cpu", freeze=False)
    tm.prepare(SPEC, None)
    tm._free_lanes = queue.SimpleQueue()  # as if every lane were taken
    active, most = [0], [0]

    def build(*args: Any) -> Any:
        assert lanes.BUILD_LOCK.locked()
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.05)  # long enough for the other thread to try
        active[0] -= 1
        return SimpleNamespace(captures=2)

    monkeypatch.setattr(backend, "build_lane", build)
    go = threading.Barrier(2)
    taken: list[Any] = []

    def serve() -> None:
        go.wait()
        taken.append(tm._take_lane())

    threads = [threading.Thread(target=serve) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1 and len(taken) == 2 and taken[0] is not taken[1]
    assert tm.graph_captures == 4


def test_prepare_builds_a_lane_per_serving_thread_on_the_replicas_gpu(
        backend: Any, lanes: Any, torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica on cuda:1 prepared for 3 serving threads builds 3 lanes up
    front, each with GPU 1 current and under the lock, warms up through
    them (waiting as gpu_wait says), and gives the caller its device back;
    3 serving threads then take them without building, each making GPU 1
    its own; a fourth builds one, on GPU 1."""
    current: dict[str, Any] = {}  # each thread's current device, where one was set
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: current.__setitem__(threading.current_thread().name, d))

    class Device:  # torch.cuda.device: a class (torch's own code asks isinstance)
        def __init__(self, d: Any) -> None:
            self.d = d

        def __enter__(self) -> None:
            me = threading.current_thread().name
            self.before = current.get(me)
            current[me] = self.d

        def __exit__(self, *exc: Any) -> None:
            me = threading.current_thread().name
            current.pop(me) if self.before is None else current.__setitem__(me, self.before)

    monkeypatch.setattr(torch.cuda, "device", Device)
    built: list[tuple[Any, bool]] = []

    def build(device: Any, methods: Any, rows: int, sizes: Any, graphs: bool) -> Any:
        built.append((current.get(threading.current_thread().name), lanes.BUILD_LOCK.locked()))
        return cpu_lane(lanes, methods, rows)

    monkeypatch.setattr(backend, "build_lane", build)
    tm = backend.TorchModel(pv_net(), device="cpu", freeze=False, cuda_graphs=False,
                            gpu_wait="block")
    tm.device = torch.device("cuda", 1)  # as if there were two GPUs
    tm.prepare(SPEC, None, serving_threads=3)
    gpu1 = torch.device("cuda", 1)
    assert built == [(gpu1, True)] * 3
    assert current == {}  # the caller's device again
    assert tm.lanes == tm.max_concurrency == 3 and tm._free_lanes.qsize() == 3
    # The warm-up (1 and 8 rows) ran on one of them, blocking on its event.
    free = [tm._free_lanes.get_nowait() for _ in range(3)]
    assert sorted(lane.done.synchronized for lane in free) == [0, 0, 2]
    for lane in free:
        tm._free_lanes.put(lane)

    current.clear()
    taken: list[Any] = []
    go = threading.Barrier(3)

    def serve() -> None:
        go.wait()
        taken.append(tm._take_lane())

    threads = [threading.Thread(target=serve, name=f"serving {i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(built) == 3 and len({id(lane) for lane in taken}) == 3
    assert current == {f"serving {i}": gpu1 for i in range(3)}

    extra = threading.Thread(target=lambda: taken.append(tm._take_lane()), name="extra")
    with pytest.warns(RuntimeWarning, match="more threads call the model than it has lanes"):
        extra.start()
        extra.join(30)
    assert built[3:] == [(gpu1, True)]


def test_prepare_checks_serving_threads(backend: Any) -> None:
    tm = backend.TorchModel(pv_net(), device="cpu", freeze=False)
    with pytest.raises(ValueError, match="serving_threads"):
        tm.prepare(SPEC, None, serving_threads=0)
    tm.prepare(SPEC, None, serving_threads=3)  # on the CPU there are no lanes
    assert tm._free_lanes is None and tm.lanes == 2
