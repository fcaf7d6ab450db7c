"""The transports shmeval is measured against, each serving the null model
from one server process to N worker processes.

queue
    One shared request ``multiprocessing.Queue``, one response Queue per
    worker; the server takes whatever is queued (up to max_batch) as a batch.
    Every message is pickled and goes through a pipe and a feeder thread.
pipe
    One duplex ``multiprocessing.Pipe`` per worker carrying raw bytes (no
    pickling); the server batches the ends ``connection.wait`` reports ready.
faster_fifo
    The ``faster-fifo`` package: a circular buffer in shared memory guarded by
    a process-shared pthread mutex and condition variables.  One shared
    request queue, drained with ``get_many`` into a batch, and one response
    queue per worker.  By default it pickles each message; it also takes a
    per-queue ``loads``/``dumps`` pair, which is used here to send raw bytes:
    a request is a record (worker id as int32, then the state's bytes), so
    ``get_many``'s messages are joined and viewed as one structured array
    without unpickling anything, and a reply is the policy row followed by
    the value.  On the 2-vCPU reference VM (1 s windows, two rounds in one
    run) that doubled faster-fifo's throughput against its pickling default:
    c4 states, 16 workers, ~35 k against ~15 k round trips/s; go states ~24 k
    against ~12 k; 1 worker 1.8-5x.
locksem
    Per-worker slots in one ``multiprocessing.shared_memory.SharedMemory``
    block (NumPy views, no pickling), ready flags guarded by a
    ``multiprocessing.Lock``, one counting ``Semaphore`` that wakes the server
    and one ``Semaphore`` per worker that wakes it: the design of the closest
    existing Python inference servers, written here from its description.
    Per-worker semaphores rather than ``Event``s: ``Event.set()`` goes
    through the event's Condition (a client killed while holding its lock
    stalls the server) and costs several semaphore operations where
    ``Semaphore.release()`` costs one.

Servers report ``server_counters`` (requests, batches, mean batch) when they
stop.  Only the standard library, NumPy and (for faster_fifo) faster-fifo are
imported: the modules of spawned workers import this one.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import queue
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Lock, Semaphore
from typing import Any, Callable, Mapping, TypeAlias, cast

import numpy as np

from .._util.queue_batches import queued_batches
from .roundtrip import (
    JOIN_TIMEOUT_S,
    REPLY_TIMEOUT_S,
    Client,
    ModelFactory,
    NullModel,
    StateSpec,
    join_processes,
    server_counters,
)


class _ServerProcess:
    """Lifecycle shared by the baselines: a server process that reports its
    counters on a control pipe when it stops."""

    server: BaseProcess | None = None
    control: Connection | None = None

    def __init__(self, model: ModelFactory = NullModel) -> None:
        self.model = model

    def _launch(self, ctx: SpawnContext, target: Callable[..., None], *args: Any) -> None:
        control, server_end = ctx.Pipe()
        server = ctx.Process(target=target, args=(*args, self.model, server_end),
                             name=f"bench-{target.__name__}", daemon=True)
        try:
            server.start()
        except BaseException:
            control.close()
            raise
        finally:
            server_end.close()  # the child holds its own duplicate
        self.server, self.control = server, control

    def _finish(self) -> dict[str, Any]:
        """Collect the counters after the stop signal, then join the server."""
        if self.server is None or self.control is None:
            return {}
        try:
            stats = self.control.recv() if self.control.poll(JOIN_TIMEOUT_S) else {}
        except EOFError:  # the server died without reporting
            stats = {}
        finally:
            join_processes([self.server], JOIN_TIMEOUT_S)
            self.control.close()
            self.server = self.control = None
        return cast(dict[str, Any], stats)


# --- multiprocessing.Queue ----------------------------------------------------------

# None is the server's stop sentinel.
RequestQueue: TypeAlias = "mp.Queue[tuple[int, np.ndarray] | None]"
ResponseQueue: TypeAlias = "mp.Queue[Mapping[str, Any]]"


class QueueClient:
    def __init__(self, worker_id: int, requests: RequestQueue, responses: ResponseQueue) -> None:
        self.worker_id = worker_id
        self.requests = requests
        self.responses = responses

    def evaluate(self, state: np.ndarray) -> Mapping[str, Any]:
        self.requests.put((self.worker_id, state))
        return self.responses.get(timeout=REPLY_TIMEOUT_S)


def queue_server(requests: RequestQueue, responses: list[ResponseQueue], spec: StateSpec, max_batch: int,
                 model_factory: ModelFactory, control: Connection) -> None:
    model = model_factory(spec.policy_size)
    n_requests = n_batches = 0
    for items in queued_batches(requests, max_batch):
        out = model(np.stack([state for _, state in items]))
        policy, value = out["policy"], out["value"]
        for i, (worker_id, _) in enumerate(items):
            responses[worker_id].put({"policy": policy[i], "value": value[i]})
        n_requests += len(items)
        n_batches += 1
    control.send(server_counters(n_requests, n_batches))


class QueueMethod(_ServerProcess):
    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        self.requests: RequestQueue = ctx.Queue()
        self.responses: list[ResponseQueue] = [ctx.Queue() for _ in range(n_workers)]
        self._launch(ctx, queue_server, self.requests, self.responses, spec, max_batch)
        return [QueueClient(i, self.requests, q) for i, q in enumerate(self.responses)]

    def stop(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        self.requests.put(None)
        stats = self._finish()
        # Their feeder threads flush and exit; nothing is left to collect later.
        self.requests.close()
        self.requests.join_thread()
        for q in self.responses:
            q.close()
            q.join_thread()
        return stats


# --- multiprocessing.Pipe -----------------------------------------------------------


class PipeClient:
    def __init__(self, conn: Connection, policy_size: int) -> None:
        self.conn = conn
        self.policy_size = policy_size

    def evaluate(self, state: np.ndarray) -> Mapping[str, Any]:
        self.conn.send_bytes(state.data)  # the array's own buffer: no pickling, no copy
        reply = np.frombuffer(self.conn.recv_bytes(), dtype=np.float32)
        return {"policy": reply[: self.policy_size], "value": reply[self.policy_size]}


def pipe_server(conns: list[Connection], spec: StateSpec, max_batch: int, model_factory: ModelFactory,
                control: Connection) -> None:
    model = model_factory(spec.policy_size)
    watched = [*conns, control]
    n_requests = n_batches = 0
    while True:
        ready = cast(list[Connection], wait(watched))
        if control in ready:
            break
        # Each worker has at most one request in flight, so one read per ready
        # end drains it; ends beyond max_batch stay ready for the next wait().
        batch_conns: list[Connection] = []
        payloads: list[bytes] = []
        for conn in ready[:max_batch]:
            try:
                payloads.append(conn.recv_bytes())
            except EOFError:  # the worker exited (end of its window, or crashed)
                watched.remove(conn)
                continue
            batch_conns.append(conn)
        if not batch_conns:
            continue
        batch = np.frombuffer(b"".join(payloads), dtype=np.float32).reshape(len(payloads), *spec.shape)
        out = model(batch)
        # One contiguous float32 row per worker: policy followed by value.
        replies = np.empty((len(batch_conns), spec.policy_size + 1), dtype=np.float32)
        replies[:, :-1] = out["policy"]
        replies[:, -1] = out["value"]
        for conn, row in zip(batch_conns, replies):
            conn.send_bytes(row.data)
        n_requests += len(batch_conns)
        n_batches += 1
    control.send(server_counters(n_requests, n_batches))


class PipeMethod(_ServerProcess):
    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        pairs = [ctx.Pipe(duplex=True) for _ in range(n_workers)]
        self._launch(ctx, pipe_server, [server_end for server_end, _ in pairs], spec, max_batch)
        for server_end, _ in pairs:
            server_end.close()
        # The worker ends live only in the clients: once the harness drops them
        # after spawning the workers, a worker's exit shows as EOF at the server.
        return [PipeClient(worker_end, spec.policy_size) for _, worker_end in pairs]

    def stop(self) -> dict[str, Any]:
        if self.control is not None:
            with contextlib.suppress(OSError):  # a dead server cannot be told; _finish reaps it
                self.control.send(None)
        return self._finish()


# --- faster-fifo --------------------------------------------------------------------

# The server stops on a request record whose worker id is this.
_STOP = -1


def _request_dtype(spec: StateSpec) -> np.dtype[Any]:
    # Packed: the state starts 4 bytes into the record, which keeps float32
    # aligned since every record's size is a multiple of 4.
    return np.dtype([("worker", "<i4"), ("state", "<f4", spec.shape)])


def raw_dumps(message: bytes) -> bytes:
    """faster-fifo serializer for messages that already are bytes."""
    return message


def raw_loads(message: memoryview) -> memoryview:
    """faster-fifo deserializer: the message's bytes in the queue's receive
    buffer, valid until the next get on that queue (the server consumes them
    before its next get_many)."""
    return message


def copy_loads(message: memoryview) -> bytes:
    """faster-fifo deserializer for a reply the caller keeps."""
    return bytes(message)


class FasterFifoClient:
    def __init__(self, worker_id: int, requests: Any, responses: Any, policy_size: int) -> None:
        self.header = np.int32(worker_id).tobytes()
        self.requests = requests
        self.responses = responses
        self.policy_size = policy_size

    def evaluate(self, state: np.ndarray) -> Mapping[str, Any]:
        self.requests.put(self.header + state.tobytes(), timeout=REPLY_TIMEOUT_S)
        reply = np.frombuffer(self.responses.get(timeout=REPLY_TIMEOUT_S), dtype=np.float32)
        return {"policy": reply[: self.policy_size], "value": reply[self.policy_size]}


def faster_fifo_server(requests: Any, responses: list[Any], spec: StateSpec, max_batch: int,
                       model_factory: ModelFactory, control: Connection) -> None:
    model = model_factory(spec.policy_size)
    record = _request_dtype(spec)
    n_requests = n_batches = 0
    stopping = False
    while not stopping:
        try:
            messages = requests.get_many(timeout=1.0, max_messages_to_get=max_batch)
        except queue.Empty:
            continue
        received = np.frombuffer(b"".join(messages), dtype=record)
        workers = received["worker"]
        if (workers == _STOP).any():
            stopping = True
            received = received[workers != _STOP]
            workers = received["worker"]
            if not len(received):
                break
        out = model(received["state"])
        replies = np.empty((len(received), spec.policy_size + 1), dtype=np.float32)
        replies[:, :-1] = out["policy"]
        replies[:, -1] = out["value"]
        for worker_id, row in zip(workers.tolist(), replies):
            responses[worker_id].put(row.tobytes(), timeout=REPLY_TIMEOUT_S)
        n_requests += len(received)
        n_batches += 1
    control.send(server_counters(n_requests, n_batches))


class FasterFifoMethod(_ServerProcess):
    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        from faster_fifo import Queue  # an optional dependency: pip install 'shmeval[bench]'

        # Each circular buffer must hold every message that can be in it at
        # once (one request per worker, plus the stop record; one reply), with
        # faster-fifo's size word per message.
        request_bytes = _request_dtype(spec).itemsize + 8
        reply_bytes = 4 * (spec.policy_size + 1) + 8
        self.requests = Queue(max(1 << 20, 2 * (n_workers + 1) * request_bytes), loads=raw_loads, dumps=raw_dumps)
        self.responses = [Queue(max(1 << 14, 4 * reply_bytes), loads=copy_loads, dumps=raw_dumps)
                          for _ in range(n_workers)]
        self.stop_record = np.zeros(1, dtype=_request_dtype(spec))
        self.stop_record["worker"] = _STOP
        self._launch(ctx, faster_fifo_server, self.requests, self.responses, spec, max_batch)
        return [FasterFifoClient(i, self.requests, q, spec.policy_size) for i, q in enumerate(self.responses)]

    def stop(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        with contextlib.suppress(queue.Full):  # a dead server's full queue; _finish reaps it
            self.requests.put(self.stop_record.tobytes(), timeout=1.0)
        stats = self._finish()
        self.requests = None
        self.responses = []
        return stats


# --- shared-memory slots, Lock and Semaphores ---------------------------------------


class SlotBlock:
    """The views of one SharedMemory block laid out for n workers:
    ``flags`` (n uint8: 1 = request ready), ``stop`` (1 uint8, server stop),
    ``inputs`` (n states), ``outputs`` (n rows of policy then value).  Each
    area starts on a 64-byte boundary."""

    def __init__(self, shm: shared_memory.SharedMemory, n_workers: int, spec: StateSpec) -> None:
        self.shm = shm
        offset = 0

        def area(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
            nonlocal offset
            view = np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=offset)
            offset += -(-view.nbytes // 64) * 64
            return view

        self.flags = area((n_workers,), np.uint8)
        self.stop = area((1,), np.uint8)
        self.inputs = area((n_workers, *spec.shape), np.float32)
        self.outputs = area((n_workers, spec.policy_size + 1), np.float32)

    @staticmethod
    def nbytes(n_workers: int, spec: StateSpec) -> int:
        def rounded(n: int) -> int:
            return -(-n // 64) * 64

        return (rounded(n_workers) + rounded(1) + rounded(n_workers * spec.nbytes)
                + rounded(4 * n_workers * (spec.policy_size + 1)))

    def close(self) -> None:
        """Drop the views, then unmap: SharedMemory.close() refuses while a
        NumPy array still exports the buffer."""
        del self.flags, self.stop, self.inputs, self.outputs
        self.shm.close()


class LocksemClient:
    """Attaches to the block on first use, in the worker process."""

    def __init__(self, worker_id: int, name: str, n_workers: int, spec: StateSpec, lock: Lock,
                 server_wake: Semaphore, wake: Semaphore) -> None:
        self.worker_id = worker_id
        self.name = name
        self.n_workers = n_workers
        self.spec = spec
        self.lock = lock
        self.server_wake = server_wake
        self.wake = wake
        self.block: SlotBlock | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "block": None}

    def _attach(self) -> SlotBlock:
        block = SlotBlock(shared_memory.SharedMemory(self.name), self.n_workers, self.spec)
        # Before interpreter teardown, while no view of ours is left elsewhere.
        atexit.register(block.close)
        self.block = block
        return block

    def evaluate(self, state: np.ndarray) -> Mapping[str, Any]:
        block = self.block or self._attach()
        i = self.worker_id
        block.inputs[i] = state
        with self.lock:
            block.flags[i] = 1
        self.server_wake.release()
        if not self.wake.acquire(timeout=REPLY_TIMEOUT_S):
            raise RuntimeError(f"locksem: no reply in {REPLY_TIMEOUT_S:g} s")
        # A copy: the server may overwrite the slot once the next request is in.
        reply = block.outputs[i].copy()
        return {"policy": reply[: self.spec.policy_size], "value": reply[self.spec.policy_size]}


def locksem_server(name: str, n_workers: int, lock: Lock, server_wake: Semaphore, wakes: list[Semaphore],
                   spec: StateSpec, max_batch: int, model_factory: ModelFactory, control: Connection) -> None:
    model = model_factory(spec.policy_size)
    block = SlotBlock(shared_memory.SharedMemory(name), n_workers, spec)
    n_requests = n_batches = 0
    backlog = False  # ready requests left over because the last batch was full
    try:
        while True:
            if not backlog:
                server_wake.acquire()
            # Releases are only a doorbell, the flags are the truth: consume the
            # ones already posted, then serve every flag that is up.  A release
            # that lands after the scan wakes the next acquire(), which at worst
            # finds nothing new to serve.
            while server_wake.acquire(block=False):
                pass
            if block.stop[0]:
                break
            with lock:
                ready = np.flatnonzero(block.flags)
                backlog = len(ready) > max_batch
                ready = ready[:max_batch]
                # Taking the request clears its flag: the worker cannot raise it
                # again before its reply, so this equals clearing after serving
                # and saves a second trip through the lock.
                block.flags[ready] = 0
            if not len(ready):
                continue
            out = model(block.inputs[ready])  # fancy indexing: one gather copy
            block.outputs[ready, :-1] = out["policy"]
            block.outputs[ready, -1] = out["value"]
            for i in ready.tolist():
                wakes[i].release()
            n_requests += len(ready)
            n_batches += 1
    finally:
        block.close()
    control.send(server_counters(n_requests, n_batches))


class LocksemMethod(_ServerProcess):
    shm: shared_memory.SharedMemory | None = None
    shm_name: str | None = None  # the block's name, kept after stop() unlinks it

    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        self.shm = shared_memory.SharedMemory(create=True, size=SlotBlock.nbytes(n_workers, spec))
        self.shm_name = self.shm.name
        self.block = SlotBlock(self.shm, n_workers, spec)
        self.block.flags[:] = 0
        self.block.stop[0] = 0
        # Held here until stop(): a spawned process opens each semaphore by its
        # name, which is unlinked as soon as this process drops the object.
        self.lock = ctx.Lock()
        self.server_wake = ctx.Semaphore(0)
        self.wakes = [ctx.Semaphore(0) for _ in range(n_workers)]
        self._launch(ctx, locksem_server, self.shm.name, n_workers, self.lock, self.server_wake, self.wakes, spec,
                     max_batch)
        return [LocksemClient(i, self.shm.name, n_workers, spec, self.lock, self.server_wake, wake)
                for i, wake in enumerate(self.wakes)]

    def stop(self) -> dict[str, Any]:
        if self.shm is None:
            return {}
        try:
            if self.server is not None:
                self.block.stop[0] = 1
                self.server_wake.release()
            return self._finish()
        finally:
            self.block.close()
            self.shm.unlink()
            self.shm = None
