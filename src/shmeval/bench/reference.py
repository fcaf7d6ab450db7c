"""The machine's physical limits, measured in the same run as the benchmarks.

Two references that put shmeval's figures in proportion:

* **ping-pong**: two processes handing a token back and forth, each waiting
  for the other.  ``kind="futex"`` uses ``_timing.pingpong``, built on the
  core's own futex primitives (a shared word, ``FUTEX_WAIT``/``FUTEX_WAKE``,
  no Python between rounds): the cheapest blocking request/response the
  kernel allows, i.e. the wake-up cost a blocking shmeval round trip pays.
  With ``spin_us > 0`` (free cores only) both sides spin before they sleep
  (with shmeval's default budgets, client 100 µs and evaluator 50 µs): what
  a spinning client on a free core can reach.  ``kind="semaphore"`` is the
  same ping-pong written in Python with two named POSIX semaphores
  (``posix_ipc``): what a plain-Python design pays per wake-up.  Each runs
  **free** (no affinity set) and **pinned** (both processes on one CPU).
* **copy**: ``np.copyto`` of one state and of a batch of 256 states between
  preallocated arrays: the memory-bandwidth floor of gathering a batch.

The partner process is a ``spawn`` child driven through a pipe; every wait
has a timeout, so a dead partner fails the measurement in seconds (the
ping-pong raises ``TimeoutError``) instead of hanging it.  The shared word
and the semaphores are removed whatever happens.  Machine details (CPU
model, kernel, load) are left to the caller, which records them once.
"""
from __future__ import annotations

import gc
import mmap
import multiprocessing as mp
import os
import secrets
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, Optional, Sequence

import numpy as np
import posix_ipc

from . import _timing

__all__ = ["run_reference", "format_reference", "pingpong", "Partner", "copy_cost_ns",
           "latency_row"]

#: The batch size of the batch-copy reference (the issue's headline batch).
COPY_BATCH = 256
#: A partner that stays silent this long fails the measurement.
DEFAULT_TIMEOUT_S = 5.0
#: Spawning the partner (a fresh interpreter importing NumPy) on a busy machine.
STARTUP_TIMEOUT_S = 30.0
_CALIBRATION_ROUNDS = 400
_MIN_ROUNDS = 100
_MAX_ROUNDS = 2_000_000


def pingpong(buf: Any, side: int, lat: np.ndarray, spin_ns: int = 0,
             timeout_ns: int = 10_000_000_000) -> int:
    """One side of the futex ping-pong in C (``_timing.pingpong``);
    returns the elapsed ns."""
    return int(_timing.pingpong(buf, side, lat, int(spin_ns), int(timeout_ns)))


# ------------------------------------------------------------------ partner

def _partner_main(conn: Connection, shm_name: str) -> None:
    """The answering side, in a spawn child.  Commands arrive on conn:
    ("affinity", cpus | None), ("futex", rounds, spin_ns, timeout_ns),
    ("semaphore", ping_name, pong_name, rounds, timeout_s), ("quit",).
    Each is answered ("ok", pid, affinity) or ("error", text).  Exits when the
    parent stays silent for a minute (it died) or the pipe breaks."""
    # The word is mapped through /dev/shm directly: attaching a
    # multiprocessing SharedMemory would register it with a resource tracker
    # too, and the parent alone owns (and unlinks) it.
    fd = os.open(os.path.join("/dev/shm", shm_name.lstrip("/")), os.O_RDWR)
    try:
        word = mmap.mmap(fd, 64)
    finally:
        os.close(fd)
    original = os.sched_getaffinity(0)
    try:
        conn.send(("ok", os.getpid(), sorted(original)))
        while conn.poll(60.0):
            msg = conn.recv()
            cmd = msg[0]
            if cmd == "quit":
                break
            try:
                if cmd == "affinity":
                    os.sched_setaffinity(0, original if msg[1] is None else msg[1])
                elif cmd == "futex":
                    _, rounds, spin_ns, timeout_ns = msg
                    pingpong(word, 1, np.zeros(rounds, np.int64), spin_ns, timeout_ns)
                elif cmd == "semaphore":
                    _, ping_name, pong_name, rounds, timeout_s = msg
                    _semaphore_side(1, ping_name, pong_name, rounds, timeout_s, None)
                else:
                    raise ValueError(f"unknown command {cmd!r}")
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            else:
                conn.send(("ok", os.getpid(), sorted(os.sched_getaffinity(0))))
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        word.close()


def _semaphore_side(side: int, ping_name: str, pong_name: str, rounds: int,
                    timeout_s: float, lat: Optional[np.ndarray]) -> None:
    """One side of the semaphore ping-pong: side 0 posts ping and waits for
    pong, storing each round trip's ns in lat; side 1 answers.  A partner
    silent for timeout_s raises TimeoutError."""
    ping = posix_ipc.Semaphore(ping_name)
    pong = posix_ipc.Semaphore(pong_name)
    clock = time.perf_counter_ns
    try:
        if side == 0:
            assert lat is not None
            post, wait = ping.release, pong.acquire
            for i in range(rounds):
                t0 = clock()
                post()
                wait(timeout_s)
                lat[i] = clock() - t0
        else:
            wait, post = ping.acquire, pong.release
            for _ in range(rounds):
                wait(timeout_s)
                post()
    except posix_ipc.BusyError:
        raise TimeoutError("the other side of the semaphore ping-pong stopped answering") \
            from None
    finally:
        ping.close()
        pong.close()


class Partner:
    """A spawn child that answers ping-pongs; the parent side runs here.

    ``futex()`` and ``semaphore()`` run one ping-pong of ``rounds`` round trips
    and return ``(lat_ns, elapsed_ns)``; ``set_affinity()`` moves the child.
    Use as a context manager: ``close()`` stops the child (killing it if it
    does not exit within a second) and frees the shared word."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.timeout_s = float(timeout_s)
        self.proc: Optional[Any] = None
        self.conn: Optional[Connection] = None
        self.shm: Optional[SharedMemory] = SharedMemory(create=True, size=64)
        try:
            self._word()[:64] = bytes(64)
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            self.conn = parent
            proc = ctx.Process(target=_partner_main, args=(child, self.shm.name),
                               name="shmeval-bench-partner", daemon=True)
            try:
                proc.start()
            finally:
                child.close()
            self.proc = proc  # only a started process is joined by close()
            _, self.pid, self.child_cpus = self._reply(startup_timeout_s)
            #: The child's affinity as it reported it after the last ping-pong.
            self.last_cpus: list[int] = list(self.child_cpus)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Partner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- plumbing
    def _send(self, *msg: Any) -> None:
        if self.conn is None:
            raise RuntimeError("partner closed")
        try:
            self.conn.send(msg)
        except OSError:
            raise RuntimeError("the ping-pong partner process died") from None

    def _word(self) -> memoryview:
        """The shared ping-pong word's mapping (64 bytes)."""
        buf = None if self.shm is None else self.shm.buf
        if buf is None:
            raise RuntimeError("partner closed")
        return buf

    def _reply(self, timeout_s: Optional[float] = None) -> tuple[Any, ...]:
        if self.conn is None:
            raise RuntimeError("partner closed")
        t = self.timeout_s if timeout_s is None else timeout_s
        try:
            ready = self.conn.poll(t)
            msg: tuple[Any, ...] = self.conn.recv() if ready else ()
        except (EOFError, OSError):
            raise RuntimeError("the ping-pong partner process died") from None
        if not ready:
            raise TimeoutError(f"the ping-pong partner did not answer within {t:g} s")
        if msg[0] == "error":
            raise RuntimeError(f"ping-pong partner: {msg[1]}")
        return msg

    def set_affinity(self, cpus: Optional[set[int]]) -> list[int]:
        """Moves the child to cpus (None: back to where it started); returns
        the affinity the child reports afterwards."""
        self._send("affinity", None if cpus is None else sorted(cpus))
        cpus_now: list[int] = self._reply()[2]
        return cpus_now

    # ----------------------------------------------------------- ping-pongs
    def futex(self, rounds: int, spin_ns: int = 0,
              partner_spin_ns: Optional[int] = None) -> tuple[np.ndarray, int]:
        """One ``_timing.pingpong`` of rounds round trips: (ns per round trip,
        elapsed ns).  This side spins up to spin_ns before it sleeps, the
        child up to partner_spin_ns (default: the same)."""
        word = self._word()
        timeout_ns = int(self.timeout_s * 1e9)
        word[:4] = bytes(4)  # the child finished the previous one
        lat = np.zeros(rounds, np.int64)
        other = spin_ns if partner_spin_ns is None else partner_spin_ns
        self._send("futex", rounds, int(other), timeout_ns)
        elapsed = pingpong(word, 0, lat, spin_ns, timeout_ns)
        self.last_cpus = self._reply()[2]
        return lat, elapsed

    def semaphore(self, rounds: int) -> tuple[np.ndarray, int]:
        """The same ping-pong with two named POSIX semaphores, in Python."""
        tag = f"/shmeval-bench-{os.getpid()}-{secrets.token_hex(6)}"
        names = (tag + "-ping", tag + "-pong")
        sems: list[Any] = []
        try:
            for name in names:
                sems.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600,
                                                initial_value=0))
            lat = np.zeros(rounds, np.int64)
            self._send("semaphore", names[0], names[1], rounds, self.timeout_s)
            t0 = time.perf_counter_ns()
            _semaphore_side(0, names[0], names[1], rounds, self.timeout_s, lat)
            elapsed = time.perf_counter_ns() - t0
            self.last_cpus = self._reply()[2]
            return lat, elapsed
        finally:
            for s in sems:
                try:
                    s.unlink()
                except posix_ipc.ExistentialError:
                    pass
                s.close()

    # -------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Stops the child (a second to exit, then SIGKILL) and unlinks the
        shared word.  Idempotent."""
        proc, conn, shm = self.proc, self.conn, self.shm
        self.proc = self.conn = self.shm = None
        try:
            if conn is not None:
                try:
                    conn.send(("quit",))
                except (OSError, ValueError):
                    pass
            if proc is not None:
                proc.join(1.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5.0)
        finally:
            if conn is not None:
                conn.close()
            if shm is not None:
                shm.close()
                shm.unlink()


# ------------------------------------------------------------------ figures

def latency_row(kind: str, pinned: bool, spin_us: float, lat_ns: np.ndarray,
                elapsed_ns: int, partner_spin_us: Optional[float] = None) -> dict[str, Any]:
    """One result row from a ping-pong's per-round-trip ns and elapsed ns."""
    p50, p99, p999 = np.percentile(lat_ns, [50, 99, 99.9]) / 1e3
    rounds = int(lat_ns.size)
    return {"kind": kind, "pinned": pinned, "spin_us": spin_us,
            "partner_spin_us": spin_us if partner_spin_us is None else partner_spin_us,
            "round_trips_per_s": rounds / (elapsed_ns / 1e9),
            "p50_us": float(p50), "p99_us": float(p99), "p99.9_us": float(p999),
            "mean_us": float(lat_ns.mean()) / 1e3, "rounds": rounds,
            "elapsed_s": elapsed_ns / 1e9}


def _calibrated(run: Callable[[int], tuple[np.ndarray, int]], seconds: float) -> tuple[
        np.ndarray, int]:
    """A short run (also a warm-up) to estimate the rate, then a run of the
    number of rounds that takes about `seconds`."""
    lat, elapsed = run(_CALIBRATION_ROUNDS)
    rate = _CALIBRATION_ROUNDS / max(elapsed / 1e9, 1e-9)
    rounds = int(min(max(rate * seconds, _MIN_ROUNDS), _MAX_ROUNDS))
    return run(rounds)


def copy_cost_ns(nbytes: int, count: int = 1, seconds: float = 0.2) -> float:
    """ns per ``np.copyto`` of `count` states of `nbytes` each (float32 when
    nbytes allows it), between two preallocated C-contiguous arrays, source
    and destination warm: the median over blocks of repetitions (the Python
    loop and NumPy's call overhead, ~0.1-0.5 µs, are included)."""
    dtype = np.dtype(np.float32) if nbytes % 4 == 0 else np.dtype(np.uint8)
    shape = (count, nbytes // dtype.itemsize)
    src = np.arange(shape[0] * shape[1], dtype=dtype).reshape(shape)
    dst = np.zeros(shape, dtype)
    copyto, clock = np.copyto, time.perf_counter_ns
    # Block length: about 2 ms of copies.
    t0 = clock()
    copyto(dst, src)
    one = max(clock() - t0, 1)
    reps = max(1, min(100_000, int(2e6 / one)))
    per: list[float] = []
    end = clock() + int(seconds * 1e9)
    was = gc.isenabled()
    gc.disable()
    try:
        while len(per) < 5 or (clock() < end and len(per) < 10_000):
            t0 = clock()
            for _ in range(reps):
                copyto(dst, src)
            per.append((clock() - t0) / reps)
    finally:
        if was:
            gc.enable()
    if not np.array_equal(dst, src):
        raise RuntimeError("copy reference: the destination differs from the source")
    return float(np.median(per))


def run_reference(seconds: float = 1.0, state_nbytes: Sequence[int] = (336, 24548), *,
                  spin_us: float = 100.0, partner_spin_us: float = 50.0,
                  timeout_s: float = DEFAULT_TIMEOUT_S,
                  semaphore: bool = True) -> dict[str, Any]:
    """Measures the references (about 5 x `seconds` of ping-pong, then the
    copies); returns a JSON-able dict {"pingpong": rows, "copy": rows,
    "seconds": seconds, "pinned_cpu": cpu or None}.

    Ping-pong rows, in order: futex free (no spin, then spinning: the
    requesting side up to `spin_us`, the answering side up to
    `partner_spin_us`), semaphore free, futex pinned, semaphore pinned.  The
    spin budgets are shmeval's defaults (client 100 µs, evaluator 50 µs) and
    unequal on purpose: with equal budgets the pair can settle into a mode
    where each side gives up just before the other answers and every round
    trip pays two wake-ups, which measures that trap rather than what
    spinning reaches.  Pinned: this thread and the child on one CPU, the
    highest this process may use (with a single usable CPU, "free" is on
    that CPU too).  Each row:
    kind, pinned, spin_us, partner_spin_us, round_trips_per_s (rounds / elapsed), p50_us,
    p99_us, p99.9_us, mean_us, rounds, elapsed_s, child_cpus (the child's
    own report of its affinity during the measurement).

    Copy rows, one per state size: state_nbytes, one_state_ns,
    batch (256), batch_us, batch_gb_s (bytes copied per s)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    usable = os.sched_getaffinity(0)
    cpu = max(usable)
    rows: list[dict[str, Any]] = []
    with Partner(timeout_s=timeout_s) as partner:
        def measure(kind: str, pinned: bool, spin: float, other: float = 0.0) -> None:
            if kind == "futex":
                lat, elapsed = _calibrated(
                    lambda r: partner.futex(r, int(spin * 1000), int(other * 1000)), seconds)
            else:
                lat, elapsed = _calibrated(partner.semaphore, seconds)
            row = latency_row(kind, pinned, spin, lat, elapsed, other)
            row["child_cpus"] = partner.last_cpus
            rows.append(row)

        measure("futex", False, 0.0)
        measure("futex", False, float(spin_us), float(partner_spin_us))
        if semaphore:
            measure("semaphore", False, 0.0)
        # Pinned: this thread and the child on one CPU.
        os.sched_setaffinity(0, {cpu})
        try:
            partner.set_affinity({cpu})
            measure("futex", True, 0.0)
            if semaphore:
                measure("semaphore", True, 0.0)
        finally:
            os.sched_setaffinity(0, usable)
    copies = []
    for nbytes in state_nbytes:
        one = copy_cost_ns(int(nbytes), 1, seconds / 4)
        batch_ns = copy_cost_ns(int(nbytes), COPY_BATCH, seconds / 4)
        copies.append({"state_nbytes": int(nbytes), "one_state_ns": one,
                       "batch": COPY_BATCH, "batch_us": batch_ns / 1e3,
                       "batch_gb_s": COPY_BATCH * int(nbytes) / batch_ns})
    return {"pingpong": rows, "copy": copies, "seconds": seconds, "pinned_cpu": cpu}


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Aligned columns: the first `left` left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [c.ljust(w) if i < left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def format_reference(ref: dict[str, Any]) -> str:
    """A short printable section: the ping-pong table, then the copy table."""
    lines = ["Reference: the machine's limits, same run",
             "  two-process ping-pong (round trip = one wake-up each way unless spinning)"]
    pp = [[r["kind"], "pinned" if r["pinned"] else "free",
           f"{r['spin_us']:g}/{r.get('partner_spin_us', r['spin_us']):g}",
           f"{r['round_trips_per_s']:,.0f}", f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}",
           f"{r['p99.9_us']:.1f}"] for r in ref.get("pingpong", [])]
    lines += ["  " + s for s in _table(
        ["kind", "cpus", "spin µs (each side)", "round trips/s", "p50 µs", "p99 µs", "p99.9 µs"], pp, 2)]
    cp = [[f"{c['state_nbytes']:,}", f"{c['one_state_ns']:,.0f}",
           f"{c['batch_us']:,.1f}", f"{c['batch_gb_s']:.1f}"] for c in ref.get("copy", [])]
    if cp:
        batch = ref["copy"][0]["batch"]
        lines.append("  np.copyto between preallocated arrays")
        lines += ["  " + s for s in _table(
            ["state bytes", "1 state ns", f"{batch} states µs", "GB/s"], cp, 0)]
    return "\n".join(lines)
