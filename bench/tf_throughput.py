#!/usr/bin/env python
"""Throughput benchmark with a real TensorFlow model: shmeval against three ways of
serving a policy-value net to many self-play processes without it.

Every method evaluates the same small convolutional policy-value net (Connect
Four input 6x7x2 float32, a 7-way policy and a tanh value, identical weights)
one state per request from N worker processes, in a closed loop:

  local     each worker imports TensorFlow, builds its own copy of the Keras
            model and calls it traced for [1,6,7,2] (the tf.function's concrete
            function, tf.constant input) on one state at a time
  queue     one evaluator process owns the model; workers send states (raw bytes)
            through one multiprocessing.Queue and get answers on a Queue of their
            own; the evaluator drains up to --max-batch requests with get_nowait
            and calls the same model traced for [None,6,7,2]
  tfserver  a tf.distribute.Server (job "ps") holds the variables; each worker
            builds the same net in TF1 graph mode (raw tf.nn ops, variables on
            /job:ps/task:0), opens a tf.compat.v1.Session on the server and runs
            sess.run with a batch-1 feed per request; the graph executes in the
            server process
  shmeval   shmeval.Evaluator.spawn(factory): the factory builds the Keras model
            in the evaluator process (shmeval.backends.tensorflow.TFModel);
            workers call ev.evaluate(state) and never import TensorFlow

    python bench/tf_throughput.py --json bench/results/tf_throughput-cpu.json   # ~6 min on 2 cores
    python bench/tf_throughput.py --quick              # 1 and 16 workers, short windows: ~2 min
    python bench/tf_throughput.py --workers 16 --methods local,shmeval --json out.json

For each worker count and method, the workers (and the method's server) are
started once, warm up and report ready; then --repeats windows of --seconds
are measured back to back with the same processes, and everything is shut
down before the next method starts (at 16 workers, two methods' worth of TF
workers would not fit the memory of a small machine).  Inside a window each
worker counts the evaluations it completes and samples their latencies
(time.perf_counter_ns); this process samples every worker's VmRSS
(/proc/<pid>/status) a few times during the window, and the CPU time of the
workers and of the server.

A last phase measures the shmeval evaluator's own time per batch (everything
outside the model call: gather, output checks, scatter, wake-ups) against the
model's time per batch at large batches: --overhead-workers processes call
evaluate_many with 64 to 256 states each, and ev.stats() is read before and
after the window.

Every method's worker 0 evaluates a fixed set of states before the first
window; its answers must match the Keras model's (run eagerly in a separate
process) within 1e-4.

Each worker has one request in flight, so the evaluators of queue and shmeval
never see batches larger than N.  Besides evals/s, latency and RSS, the table
shows each method's CPU time per evaluation (workers and server together), the
server's share of it, and "other load": busy CPU time of the machine that
belongs to none of the measured processes (other programs skew every figure).

Defaults.  The net has 3 conv layers of 32 filters (--filters): on this
2-core VM it costs 0.4 ms per call at batch 1 and 18 us per state at batch
256, near the "small conv net" of the design brief (0.7 ms, 22 us); 64
filters cost 3x more per state.  The central servers (queue, tfserver,
shmeval alike) run TensorFlow with one intra-op and one inter-op thread
(--server-threads 1): measured here, TensorFlow's default of one thread per
core makes a batch of 16 take 0.88 ms of wall time and 1.2 ms of CPU
instead of 0.62 ms and 0.61 ms with one thread, and the second core is
needed by the worker processes anyway.

Machine-independent: on a machine with a GPU, TensorFlow uses it in the
evaluators, the tf.distribute server and the local workers (all with memory
growth, so that 16 local workers fit); the tfserver workers only build graphs
and are kept off the GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Sequence

# Before anything can import TensorFlow; inherited by every spawned process.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from shmeval.bench.report import machine_info  # noqa: E402
from shmeval.bench.roundtrip import weighted_quantiles  # noqa: E402
from shmeval._util.children import child_setup  # noqa: E402
from shmeval._util.jsonout import write_json  # noqa: E402
from shmeval._util.procstat import cpu_s, machine_busy_s, pss_mb, rss_mb  # noqa: E402
from shmeval._util.queue_batches import queued_batches  # noqa: E402

STATE_SHAPE = (6, 7, 2)
POLICY_SIZE = 7
METHODS = ("local", "queue", "tfserver", "shmeval")
# States every worker cycles through (random positions, regenerated per worker).
POOL_SIZE = 512
# States whose outputs every method must reproduce (same for all methods).
N_CHECK_STATES = 8
CHECK_TOLERANCE = 1e-4
# Latencies a worker can record in one window (np.empty commits only the pages written).
LATENCY_CAP = 1 << 20
# Between the run message and the window: every worker is past its recv() and
# already evaluating (untimed) when the window opens.
START_DELAY_NS = 250_000_000
# Sixteen processes importing TensorFlow on two cores take about a minute.
READY_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0
QUANTILES = {"p1": 0.01, "p10": 0.10, "p50": 0.50, "p90": 0.90, "p99": 0.99, "p99.9": 0.999, "max": 1.0}
# Where the figures of the targets are read (the largest worker count run).
TARGETS = {"shmeval/local evals/s": 5.0, "shmeval/queue evals/s": 2.0, "shmeval/tfserver evals/s": 2.0,
           "worker RSS local/shmeval": 5.0}
OVERHEAD_TARGET = 0.10


# --- the net --------------------------------------------------------------------------


@dataclass(frozen=True)
class NetConfig:
    filters: int = 64
    layers: int = 3
    value_hidden: int = 64
    seed: int = 0


def layer_shapes(cfg: NetConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(kernel shape, bias shape) per named layer, Keras layout: conv kernels
    [kh, kw, in, out] (as tf.nn.conv2d takes them), dense kernels [in, out]."""
    h, w, c = STATE_SHAPE
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for i in range(cfg.layers):
        shapes[f"conv{i}"] = ((3, 3, c if i == 0 else cfg.filters, cfg.filters), (cfg.filters,))
    shapes["policy_conv"] = ((1, 1, cfg.filters, 2), (2,))
    shapes["policy_dense"] = ((h * w * 2, POLICY_SIZE), (POLICY_SIZE,))
    shapes["value_conv"] = ((1, 1, cfg.filters, 1), (1,))
    shapes["value_dense1"] = ((h * w, cfg.value_hidden), (cfg.value_hidden,))
    shapes["value_dense2"] = ((cfg.value_hidden, 1), (1,))
    return shapes


def make_weights(cfg: NetConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The one set of weights every method serves (He-scaled normal kernels,
    small non-zero biases so that the bias paths are checked too)."""
    rng = np.random.default_rng(cfg.seed)
    weights = {}
    for name, (kshape, bshape) in layer_shapes(cfg).items():
        fan_in = math.prod(kshape[:-1])
        kernel = (rng.standard_normal(kshape) * math.sqrt(2.0 / fan_in)).astype(np.float32)
        bias = (rng.standard_normal(bshape) * 0.05).astype(np.float32)
        weights[name] = (kernel, bias)
    return weights


def build_keras_model(cfg: NetConfig, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> Any:
    import keras

    layers = keras.layers
    x = keras.Input(STATE_SHAPE, name="state")
    h = x
    for i in range(cfg.layers):
        h = layers.Conv2D(cfg.filters, 3, padding="same", activation="relu", name=f"conv{i}")(h)
    p = layers.Conv2D(2, 1, activation="relu", name="policy_conv")(h)
    p = layers.Dense(POLICY_SIZE, activation="softmax", name="policy_dense")(layers.Flatten()(p))
    v = layers.Conv2D(1, 1, activation="relu", name="value_conv")(h)
    v = layers.Dense(cfg.value_hidden, activation="relu", name="value_dense1")(layers.Flatten()(v))
    v = layers.Dense(1, activation="tanh", name="value_dense2")(v)
    v = layers.Reshape((), name="value")(v)
    model = keras.Model(x, {"policy": p, "value": v}, name="c4_policy_value")
    for name, (kernel, bias) in weights.items():
        model.get_layer(name).set_weights([kernel, bias])
    return model


def build_tf1_graph(tf: Any, cfg: NetConfig, initial: dict[str, tuple[np.ndarray, np.ndarray]] | None) -> Any:
    """The same net with raw ops in the default TF1 graph, its variables on the
    parameter server.  With ``initial`` the variables' initializers hold those
    values (the server runs them once); without, they are never run: the
    variables already live on the server, shared by every session there."""
    v1 = tf.compat.v1
    x = v1.placeholder(tf.float32, (None,) + STATE_SHAPE, name="state")
    params: dict[str, tuple[Any, Any]] = {}
    with tf.device("/job:ps/task:0"):
        for name, (kshape, bshape) in layer_shapes(cfg).items():
            if initial is not None:
                kinit = v1.constant_initializer(initial[name][0])
                binit = v1.constant_initializer(initial[name][1])
            else:
                kinit = binit = v1.zeros_initializer()
            params[name] = (v1.get_variable(f"{name}/kernel", kshape, tf.float32, initializer=kinit),
                            v1.get_variable(f"{name}/bias", bshape, tf.float32, initializer=binit))

    def conv(t: Any, name: str, padding: str) -> Any:
        k, b = params[name]
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(t, k, strides=1, padding=padding), b))

    def dense(t: Any, name: str) -> Any:
        k, b = params[name]
        return tf.matmul(t, k) + b

    h = x
    for i in range(cfg.layers):
        h = conv(h, f"conv{i}", "SAME")
    n_cells = STATE_SHAPE[0] * STATE_SHAPE[1]
    p = tf.reshape(conv(h, "policy_conv", "VALID"), [-1, n_cells * 2])  # NHWC row-major, as Flatten
    policy = tf.nn.softmax(dense(p, "policy_dense"))
    v = tf.reshape(conv(h, "value_conv", "VALID"), [-1, n_cells])
    value = tf.reshape(tf.tanh(dense(tf.nn.relu(dense(v, "value_dense1")), "value_dense2")), [-1])
    return x, policy, value


# --- TensorFlow in a child process ---------------------------------------------------

def import_tf(threads: int | None = None, gpu: bool = True) -> Any:
    """Imports TensorFlow with its start-up banner filtered out and the CPU
    thread pools sized (shmeval.games.connect4_net.import_tensorflow), then
    turns on GPU memory growth (many TF processes may share one GPU)."""
    from shmeval.games.connect4_net import import_tensorflow

    if not gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # before the import
    tf = import_tensorflow(threads)
    if gpu:
        for device in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(device, True)
    # Full float32 everywhere: with TensorFloat-32 (on by default on recent
    # NVIDIA GPUs) convolutions round to 10-bit mantissas and no two batch
    # sizes would agree within the 1e-4 the outputs are checked to.
    tf.config.experimental.enable_tensor_float_32_execution(False)
    return tf


def _exit_quickly() -> None:
    """Ends a process that imported TensorFlow: tearing TensorFlow down takes
    seconds of CPU per process (16 at once outlast any sane join timeout),
    and there is nothing left to save."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shmeval_model_factory(cfg: NetConfig, weights: dict[str, tuple[np.ndarray, np.ndarray]],
                          threads: int | None = None) -> Any:
    """Evaluator.spawn's factory: runs in the evaluator process, the only
    process of the shmeval method that imports TensorFlow."""
    import_tf(threads=threads)
    from shmeval.backends.tensorflow import TFModel

    return TFModel(build_keras_model(cfg, weights))


def reference_main(cfg: NetConfig, weights: dict[str, tuple[np.ndarray, np.ndarray]], states: np.ndarray,
                   conn: Connection) -> None:
    """The Keras model run eagerly on the check states, and what TF sees."""
    child_setup()
    try:
        tf = import_tf()
        import keras

        model = build_keras_model(cfg, weights)
        out = model(tf.constant(states), training=False)
        gpus = []
        for device in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(device)
            gpus.append(details.get("device_name", device.name))
        conn.send(("ok", {
            "policy": out["policy"].numpy(), "value": out["value"].numpy(),
            "params": int(model.count_params()),
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "gpus": gpus, "built_with_cuda": tf.test.is_built_with_cuda(),
        }))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    _exit_quickly()


# --- states -------------------------------------------------------------------------


def random_states(rng: np.random.Generator, n: int) -> np.ndarray:
    """Connect Four positions reached by random legal moves: plane 0 holds the
    stones of the player to move, plane 1 the opponent's (wins not checked)."""
    rows, cols, _ = STATE_SHAPE
    out = np.zeros((n,) + STATE_SHAPE, dtype=np.float32)
    for k in range(n):
        board = np.zeros((rows, cols), dtype=np.int8)  # 0 empty, 1 first player, 2 second
        heights = np.zeros(cols, dtype=np.int64)
        moves = int(rng.integers(0, rows * cols - 6))
        for m in range(moves):
            col = int(rng.choice(np.flatnonzero(heights < rows)))
            board[rows - 1 - heights[col], col] = 1 + m % 2
            heights[col] += 1
        to_move = 1 + moves % 2
        out[k, :, :, 0] = board == to_move
        out[k, :, :, 1] = board == 3 - to_move
    return out


def check_states() -> np.ndarray:
    return random_states(np.random.default_rng(12345), N_CHECK_STATES)


# --- the clients each worker runs ----------------------------------------------------
#
# open_<method>(params, worker_id) -> (step, check, info):
#   step(state) evaluates one state (the timed operation),
#   check(states) -> (policy [n, 7], value [n]) evaluates states one at a time,
#   info: what the worker reports about itself.


# step(state), check(states) -> (policy, value), info
Opened = tuple[Callable[[np.ndarray], Any], Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], dict[str, Any]]


def _no_tensorflow(method: str) -> dict[str, Any]:
    imported = "tensorflow" in sys.modules
    if imported:
        raise AssertionError(f"a {method} worker imported TensorFlow")
    return {"tensorflow_imported": imported}


def _check_one_by_one(evaluate: Callable[[np.ndarray], tuple[Any, Any]], states: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    outs = [evaluate(s) for s in states]
    return (np.stack([np.asarray(p, dtype=np.float32).reshape(POLICY_SIZE) for p, _ in outs]),
            np.array([float(np.asarray(v)) for _, v in outs], dtype=np.float32))


def open_local(params: dict[str, Any], worker_id: int) -> Opened:
    tf = import_tf(threads=params["threads"])
    model = build_keras_model(params["cfg"], params["weights"])
    # Traced once, here, for batches of exactly one; calling the concrete
    # function skips tf.function's argument dispatch (TFModel calls its
    # concrete functions the same way).
    fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec((1,) + STATE_SHAPE, tf.float32))
    constant = tf.constant

    def step(state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = fn(constant(state[None]))
        return out["policy"].numpy()[0], out["value"].numpy()[0]

    return step, functools.partial(_check_one_by_one, step), {"tensorflow_imported": True}


class QueueServerCounters:
    """Shared counters the queue evaluator updates after every batch:
    requests, batches, model ns, busy ns (from batch formed to answers sent)."""
    FIELDS = ("requests", "batches", "model_ns", "busy_ns")


def queue_server_main(params: dict[str, Any], requests: Any, responses: list[Any], counters: Any,
                      conn: Connection) -> None:
    child_setup()
    try:
        tf = import_tf(threads=params["threads"])
        model = build_keras_model(params["cfg"], params["weights"])
        fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(
            tf.TensorSpec((None,) + STATE_SHAPE, tf.float32))
        for n in (1, params["max_batch"]):
            fn(tf.constant(np.zeros((n,) + STATE_SHAPE, np.float32)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    conn.close()
    constant = tf.constant
    n_req = n_batch = model_ns = busy_ns = 0
    for items in queued_batches(requests, params["max_batch"]):
        t0 = time.perf_counter_ns()
        batch = np.frombuffer(b"".join(s for _, s in items), dtype=np.float32).reshape((len(items),) + STATE_SHAPE)
        t1 = time.perf_counter_ns()
        out = fn(constant(batch))
        replies = np.concatenate([out["policy"].numpy(), out["value"].numpy()[:, None]], axis=1)
        t2 = time.perf_counter_ns()
        for (worker_id, _), row in zip(items, replies):
            responses[worker_id].put(row.tobytes())
        t3 = time.perf_counter_ns()
        n_req += len(items)
        n_batch += 1
        model_ns += t2 - t1
        busy_ns += t3 - t0
        counters[0], counters[1], counters[2], counters[3] = n_req, n_batch, model_ns, busy_ns
    _exit_quickly()


def open_queue(params: dict[str, Any], worker_id: int) -> Opened:
    requests, response = params["requests"], params["responses"][worker_id]
    put, get = requests.put, response.get
    frombuffer = np.frombuffer

    def step(state: np.ndarray) -> tuple[np.ndarray, np.float32]:
        put((worker_id, state.tobytes()))
        reply = frombuffer(get(), dtype=np.float32)
        return reply[:POLICY_SIZE], reply[POLICY_SIZE]

    return step, functools.partial(_check_one_by_one, step), _no_tensorflow("queue")


def tfserver_main(params: dict[str, Any], conn: Connection) -> None:
    child_setup()
    try:
        tf = import_tf()
        v1 = tf.compat.v1
        v1.disable_eager_execution()
        threads = params["threads"] or 0  # 0: TensorFlow's default
        config = v1.ConfigProto(allow_soft_placement=True, gpu_options=v1.GPUOptions(allow_growth=True),
                                intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads)
        last: Exception | None = None
        for _ in range(10):
            with socket.socket() as s:  # a free port (tiny race with other programs: retried)
                s.bind(("localhost", 0))
                port = s.getsockname()[1]
            try:
                server = tf.distribute.Server({"ps": [f"localhost:{port}"]}, job_name="ps", task_index=0,
                                              config=config, start=True)
                break
            except Exception as e:
                last = e
        else:
            raise RuntimeError(f"no port for the tf.distribute.Server: {last}")
        build_tf1_graph(tf, params["cfg"], params["weights"])
        with v1.Session(server.target, config=config) as sess:
            sess.run(v1.global_variables_initializer())  # once: every session on the server shares them
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", (os.getpid(), server.target)))
    with contextlib.suppress(EOFError, OSError):
        conn.recv()  # until told to stop (or the parent is gone)
    os._exit(0)  # the gRPC server has no clean stop; the process just ends


def open_tfserver(params: dict[str, Any], worker_id: int) -> Opened:
    # The graph runs on the server: these processes need no GPU.
    tf = import_tf(gpu=False)
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    x, policy, value = build_tf1_graph(tf, params["cfg"], None)
    sess = v1.Session(params["target"], config=v1.ConfigProto(allow_soft_placement=True))
    run = sess.run
    fetches = [policy, value]

    def step(state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p, v = run(fetches, feed_dict={x: state[None]})
        return p[0], v[0]

    return step, functools.partial(_check_one_by_one, step), {"tensorflow_imported": True}


def open_shmeval(params: dict[str, Any], worker_id: int) -> Opened:
    evaluate = params["evaluator"].evaluate

    def step(state: np.ndarray) -> tuple[Any, Any]:
        out = evaluate(state)
        return out["policy"], out["value"]

    return step, functools.partial(_check_one_by_one, step), _no_tensorflow("shmeval")


OPENERS = {"local": open_local, "queue": open_queue, "tfserver": open_tfserver, "shmeval": open_shmeval}


# --- the worker process ----------------------------------------------------------------

class Window:
    """A worker's measured windows of its closed loop (this script's,
    bench/torch_throughput.py's and bench/replicas.py's workers)."""

    def __init__(self) -> None:
        self.latencies = np.empty(LATENCY_CAP, dtype=np.int64)
        self.i = 0  # the loop's step count, carried from window to window

    def run(self, one: Callable[[int], int], start_ns: int, end_ns: int,
            n_samples: int) -> tuple[int, int, np.ndarray]:
        """Calls ``one(i)`` (which returns the evaluations it made) untimed
        until ``start_ns``, so that the server is loaded when the window
        opens, then timed until ``end_ns``; only calls that complete inside
        the window count.  Returns the evaluations, the calls, and the
        latencies (ns) of at most ``n_samples`` calls spread evenly over the
        window."""
        now, latencies = time.perf_counter_ns, self.latencies
        i = self.i
        while now() < start_ns:
            one(i)
            i += 1
        count = calls = 0
        before = now()
        while True:
            n = one(i)
            i += 1
            after = now()
            if after > end_ns:
                break
            if calls < LATENCY_CAP:
                latencies[calls] = after - before
            calls += 1
            count += n
            before = after
        self.i = i
        recorded = latencies[:min(calls, LATENCY_CAP)]
        if len(recorded) > n_samples:
            recorded = recorded[np.linspace(0, len(recorded) - 1, n_samples).astype(np.int64)]
        return count, calls, recorded.copy()


def worker_main(method: str, params: dict[str, Any], worker_id: int, n_warmup: int, conn: Connection) -> None:
    """Opens the method's client, warms up, reports ready, then runs one
    measured window per ("run", start_ns, end_ns, n_samples) message until
    ("stop",) or the pipe closes."""
    child_setup()
    try:
        rng = np.random.default_rng(1000 + worker_id)
        if method == "shmeval_many":
            sizes = params["sizes"]
            pool = random_states(rng, POOL_SIZE + sizes[1])
            many = params["evaluator"].evaluate_many
            info = _no_tensorflow("shmeval")
            plan = [(int(rng.integers(0, POOL_SIZE)), int(rng.integers(sizes[0], sizes[1] + 1))) for _ in range(256)]

            def one(i: int) -> int:
                off, n = plan[i % len(plan)]
                many(pool[off:off + n])
                return n
            check_out = None
        else:
            pool = random_states(rng, POOL_SIZE)
            step, check, info = OPENERS[method](params, worker_id)

            def one(i: int) -> int:
                step(pool[i % POOL_SIZE])
                return 1
            check_out = check(check_states()) if worker_id == 0 else None
        for i in range(n_warmup):
            one(i)
        info["pid"] = os.getpid()
        conn.send(("ready", info, check_out))
        window = Window()
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                msg = ("stop",)
            if msg[0] != "run":
                break
            _, start_ns, end_ns, n_samples = msg
            count, calls, recorded = window.run(one, start_ns, end_ns, n_samples)
            conn.send(("done", count, calls, recorded))
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        return
    if "tensorflow" in sys.modules:
        _exit_quickly()


# --- one method at one worker count -------------------------------------------------

_LIVE: list["MethodRun"] = []


def _join(procs: Sequence[BaseProcess], timeout: float) -> list[str]:
    """Joins with one shared deadline; terminates, then kills, the stragglers."""
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in stuck:
        p.terminate()
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    return [p.name for p in stuck]


def _await(conn: Connection, proc: BaseProcess, timeout: float, what: str) -> Any:
    """The next message from a child, or an error if it dies or times out."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not proc.is_alive() and not conn.poll(0):
            raise RuntimeError(f"{what}: process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: no answer within {timeout:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{what}: process exited (exit code {proc.exitcode})") from None


class MethodRun:
    """One method's server and N workers, started once and measured over
    several windows."""

    def __init__(self, method: str, n_workers: int, args: argparse.Namespace, cfg: NetConfig,
                 weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.method = method
        self.n_workers = n_workers
        self.args = args
        self.cfg = cfg
        self.weights = weights
        self.ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.infos: list[dict[str, Any]] = []
        self.check: Any = None
        self.server_pid: int | None = None
        self.startup_s = 0.0

    # subclasses: the server side ------------------------------------------------
    worker_kind = ""

    def start_server(self) -> dict[str, Any]:
        """Starts the server; returns the workers' params."""
        return {}

    def stop_server(self, abort: bool) -> None:
        pass

    def counters(self) -> dict[str, float] | None:
        return None

    # ------------------------------------------------------------------------------
    def start(self) -> None:
        _LIVE.append(self)
        t0 = time.monotonic()
        params = self.start_server()
        kind = self.worker_kind or self.method
        for i in range(self.n_workers):
            parent_end, child_end = self.ctx.Pipe()
            proc = self.ctx.Process(target=worker_main, name=f"bench-{kind}-{i}", daemon=True,
                                 args=(kind, params, i, self.args.warmup, child_end))
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, READY_TIMEOUT_S, f"{kind} worker {i} start-up")
            if msg[0] != "ready":
                raise RuntimeError(f"{kind} worker {i} failed to start:\n{msg[1]}")
            self.infos.append(msg[1])
            if i == 0:
                self.check = msg[2]
        self.startup_s = time.monotonic() - t0

    def pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def window(self, seconds: float, repeat: int) -> dict[str, Any]:
        start_ns = time.perf_counter_ns() + START_DELAY_NS
        end_ns = start_ns + int(seconds * 1e9)
        for conn in self.conns:
            conn.send(("run", start_ns, end_ns, self.args.samples))
        pids = self.pids()

        def sleep_until(t_ns: int) -> None:
            time.sleep(max(0.0, (t_ns - time.perf_counter_ns()) / 1e9))

        sleep_until(start_ns)
        system0 = machine_busy_s()
        cpu0 = [cpu_s(pid) for pid in pids]
        server_cpu0 = cpu_s(self.server_pid) if self.server_pid else float("nan")
        counters0 = self.counters()
        rss: list[list[float]] = [[] for _ in pids]
        pss: list[float | None] = [None] * len(pids)
        for k, frac in enumerate((0.25, 0.5, 0.75)):
            sleep_until(start_ns + int(frac * (end_ns - start_ns)))
            for j, pid in enumerate(pids):
                r = rss_mb(pid)
                if r is not None:
                    rss[j].append(r)
                if k == 1:
                    pss[j] = pss_mb(pid)
            if k == 1 and self.server_pid:
                server_rss, server_pss = rss_mb(self.server_pid), pss_mb(self.server_pid)
        sleep_until(end_ns)
        system1 = machine_busy_s()
        cpu1 = [cpu_s(pid) for pid in pids]
        server_cpu1 = cpu_s(self.server_pid) if self.server_pid else float("nan")
        counters1 = self.counters()

        counts, calls, samples = [], [], []
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, seconds + 120.0, f"{self.method} x{self.n_workers} worker {i}")
            if msg[0] != "done":
                raise RuntimeError(f"{self.method} x{self.n_workers}: worker {i} failed:\n{msg[1]}")
            counts.append(msg[1])
            calls.append(msg[2])
            samples.append(msg[3])
        total = sum(counts)
        if total == 0:
            raise RuntimeError(f"{self.method} x{self.n_workers}: nothing completed in the window")
        lat = weighted_quantiles([s for s in samples], calls, list(QUANTILES.values())) / 1e3
        latency_us = dict(zip(QUANTILES, lat.tolist()))
        worker_rss = [max(r) if r else float("nan") for r in rss]
        trial: dict[str, Any] = {
            "method": self.method, "workers": self.n_workers, "repeat": repeat, "seconds": seconds,
            "evaluations": total, "calls": sum(calls), "throughput": total / seconds,
            "p50_us": latency_us["p50"], "p99_us": latency_us["p99"], "latency_us": latency_us,
            "fairness": min(counts) / (total / self.n_workers), "worker_counts": counts,
            "worker_rss_mb": worker_rss, "worker_rss_mb_median": statistics.median(worker_rss),
            "worker_pss_mb_median": statistics.median([p for p in pss if p is not None]) if any(
                p is not None for p in pss) else None,
            "server_rss_mb": server_rss if self.server_pid else None,
            "server_pss_mb": server_pss if self.server_pid else None,
            "cpu_s_workers": sum(b - a for a, b in zip(cpu0, cpu1)),
            "cpu_s_server": server_cpu1 - server_cpu0 if self.server_pid else None,
            # Busy CPU time of the whole machine in the window: what exceeds the
            # workers' and the server's is other load (this process, other programs).
            "cpu_s_machine": system1 - system0,
            "cpu_s_available": seconds * len(os.sched_getaffinity(0)),
        }
        trial["cpu_s_other"] = trial["cpu_s_machine"] - trial["cpu_s_workers"] - (trial["cpu_s_server"] or 0.0)
        if counters0 is not None and counters1 is not None:
            trial["server"] = self.server_delta(counters0, counters1, seconds)
        return trial

    def server_delta(self, c0: dict[str, float], c1: dict[str, float], seconds: float) -> dict[str, Any]:
        d = {k: c1[k] - c0[k] for k in c0}
        batches = d["batches"]
        return {
            "requests": d["requests"], "batches": batches,
            "mean_batch": d["requests"] / batches if batches else None,
            "model_ms_per_batch": d["model_ns"] / batches / 1e6 if batches else None,
            "overhead_us_per_batch": (d["busy_ns"] - d["model_ns"]) / batches / 1e3 if batches else None,
            "model_time_share": d["model_ns"] / (seconds * 1e9),
        }

    def stop(self, abort: bool = False) -> list[str]:
        """Stops the workers (politely unless aborting), then the server."""
        stuck: list[str] = []
        try:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    if not abort:
                        conn.send(("stop",))
            if abort:
                for p in self.procs:
                    if p.pid is not None and p.is_alive():
                        p.terminate()
            stuck = _join(self.procs, JOIN_TIMEOUT_S)
        finally:
            for conn in self.conns:
                conn.close()
            try:
                self.stop_server(abort)
            finally:
                if self in _LIVE:
                    _LIVE.remove(self)
        return stuck


class LocalRun(MethodRun):
    def start_server(self) -> dict[str, Any]:
        return {"cfg": self.cfg, "weights": self.weights, "threads": self.args.local_threads}


def stop_queue_server(run: Any, abort: bool) -> None:
    """Stops a queue evaluator that ``run`` started (its ``server``,
    ``requests``, ``responses`` and ``control``), if it started one."""
    if getattr(run, "server", None) is None:
        return
    with contextlib.suppress(Exception):
        run.requests.put(None)
    _join([run.server], 2.0 if abort else JOIN_TIMEOUT_S)
    for q in (run.requests, *run.responses):
        q.cancel_join_thread()  # nothing we sent may keep this process from exiting
        q.close()
    run.control.close()


class QueueRun(MethodRun):
    def start_server(self) -> dict[str, Any]:
        ctx = self.ctx
        self.requests = ctx.Queue()
        self.responses = [ctx.Queue() for _ in range(self.n_workers)]
        self.shared = ctx.Array("q", len(QueueServerCounters.FIELDS), lock=False)
        params = {"cfg": self.cfg, "weights": self.weights, "max_batch": self.args.max_batch,
                  "threads": self.args.server_threads or None}
        self.control, child_end = ctx.Pipe()
        self.server = ctx.Process(target=queue_server_main, name="bench-queue-server", daemon=True,
                                  args=(params, self.requests, self.responses, self.shared, child_end))
        self.server.start()
        child_end.close()
        msg = _await(self.control, self.server, READY_TIMEOUT_S, "queue evaluator start-up")
        if msg[0] != "ready":
            raise RuntimeError(f"queue evaluator failed to start:\n{msg[1]}")
        self.server_pid = msg[1]
        return {"requests": self.requests, "responses": self.responses}

    def counters(self) -> dict[str, float]:
        return dict(zip(QueueServerCounters.FIELDS, list(self.shared)))

    def stop_server(self, abort: bool) -> None:
        stop_queue_server(self, abort)


class TFServerRun(MethodRun):
    def start_server(self) -> dict[str, Any]:
        self.control, child_end = self.ctx.Pipe()
        self.server = self.ctx.Process(target=tfserver_main, name="bench-tf-server", daemon=True,
                                       args=({"cfg": self.cfg, "weights": self.weights,
                                              "threads": self.args.server_threads}, child_end))
        self.server.start()
        child_end.close()
        msg = _await(self.control, self.server, READY_TIMEOUT_S, "tf.distribute.Server start-up")
        if msg[0] != "ready":
            raise RuntimeError(f"tf.distribute.Server failed to start:\n{msg[1]}")
        self.server_pid, self.target = msg[1]
        return {"cfg": self.cfg, "target": self.target}

    def stop_server(self, abort: bool) -> None:
        if getattr(self, "server", None) is None:
            return
        with contextlib.suppress(OSError):
            self.control.send("stop")
        _join([self.server], 2.0 if abort else JOIN_TIMEOUT_S)
        self.control.close()


def _shm_totals(st: dict[str, Any]) -> dict[str, float]:
    """Cumulative totals behind ev.stats(), so that a window's share can be
    taken as a difference (stats() reports averages since start)."""
    batches = float(st["batches"])
    return {
        "requests": float(st["requests"]), "batches": batches,
        "model_ns": float(st["model_time_share"]) * float(st["uptime_s"]) * 1e9,
        "busy_ns": float(st["model_time_share"]) * float(st["uptime_s"]) * 1e9
        + float(st["overhead_us_per_batch"]) * batches * 1e3,
    }


class ShmevalRun(MethodRun):
    slots_per_client: int | None = None
    evaluator: Any = None

    def start_server(self) -> dict[str, Any]:
        import shmeval

        kwargs: dict[str, Any] = dict(
            input_shape=STATE_SHAPE, input_dtype="float32",
            outputs={"policy": ((POLICY_SIZE,), "float32"), "value": ((), "float32")},
            max_batch=self.args.max_batch)
        if self.slots_per_client:
            kwargs["slots_per_client"] = self.slots_per_client
        self.evaluator = shmeval.Evaluator.spawn(
            functools.partial(shmeval_model_factory, self.cfg, self.weights, self.args.server_threads or None),
            **kwargs)
        self.server_pid = self.evaluator.pid
        return {"evaluator": self.evaluator}

    def counters(self) -> dict[str, float]:
        return _shm_totals(self.evaluator.stats())

    def stop_server(self, abort: bool) -> None:
        ev = getattr(self, "evaluator", None)
        if ev is not None:
            self.final_stats = dict(ev.stats())
            ev.close()
            self.evaluator = None


class ShmevalManyRun(ShmevalRun):
    """Large batches: each worker calls evaluate_many with 64-256 states."""
    worker_kind = "shmeval_many"
    slots_per_client = 64  # the most a client may have: evaluate_many sends 64 rows a round

    def start_server(self) -> dict[str, Any]:
        params = super().start_server()
        params["sizes"] = (self.args.overhead_rows[0], self.args.overhead_rows[1])
        return params

    def window(self, seconds: float, repeat: int) -> dict[str, Any]:
        hist0 = dict(self.evaluator.stats()["batch_hist"])
        trial = super().window(seconds, repeat)
        hist1 = dict(self.evaluator.stats()["batch_hist"])
        hist = {k: v - hist0.get(k, 0) for k, v in hist1.items() if v - hist0.get(k, 0)}
        total = sum(hist.values())
        srv = trial["server"]
        srv["batches_ge_64_share"] = sum(v for k, v in hist.items() if k >= 64) / total if total else None
        srv["batch_hist"] = hist
        srv["overhead_over_model"] = (srv["overhead_us_per_batch"] / 1e3 / srv["model_ms_per_batch"]
                                      if srv["model_ms_per_batch"] else None)
        return trial


RUNS: dict[str, type[MethodRun]] = {"local": LocalRun, "queue": QueueRun, "tfserver": TFServerRun,
                                    "shmeval": ShmevalRun}


# --- reporting ---------------------------------------------------------------------------


def _stat(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for t in trials:
        groups.setdefault((t["workers"], t["method"]), []).append(t)
    rows = []
    for (workers, method), ts in groups.items():
        rows.append({
            "workers": workers, "method": method, "repeats": len(ts),
            "throughput": _stat([t["throughput"] for t in ts]),
            "p50_us": _stat([t["p50_us"] for t in ts]),
            "p99_us": _stat([t["p99_us"] for t in ts]),
            "worker_rss_mb": _stat([t["worker_rss_mb_median"] for t in ts]),
            "worker_pss_mb": _stat([t["worker_pss_mb_median"] for t in ts]),
            "server_rss_mb": _stat([t["server_rss_mb"] for t in ts]),
            "fairness": _stat([t["fairness"] for t in ts]),
            "mean_batch": _stat([t.get("server", {}).get("mean_batch") for t in ts]),
            "cpu_share_server": _stat([t["cpu_s_server"] / (t["cpu_s_server"] + t["cpu_s_workers"])
                                       for t in ts if t["cpu_s_server"] is not None]),
            "cpu_us_per_eval": _stat([1e6 * (t["cpu_s_workers"] + (t["cpu_s_server"] or 0.0)) / t["evaluations"]
                                      for t in ts]),
            "other_load_cores": _stat([t["cpu_s_other"] / t["seconds"] for t in ts]),
        })
    return rows


def _fmt(stat: dict[str, float] | None, spec: str, ranges: bool) -> str:
    if stat is None:
        return "-"
    text = format(stat["median"], spec)
    return f"{text} [{format(stat['min'], spec)}-{format(stat['max'], spec)}]" if ranges else text


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def ratios(summary: list[dict[str, Any]], workers: int) -> dict[str, float]:
    by = {r["method"]: r for r in summary if r["workers"] == workers}
    out: dict[str, float] = {}
    if "shmeval" in by:
        s = by["shmeval"]
        for other in ("local", "queue", "tfserver"):
            if other in by:
                out[f"shmeval/{other} evals/s"] = s["throughput"]["median"] / by[other]["throughput"]["median"]
        if "local" in by and s["worker_rss_mb"] and by["local"]["worker_rss_mb"]:
            out["worker RSS local/shmeval"] = by["local"]["worker_rss_mb"]["median"] / s["worker_rss_mb"]["median"]
    return out


def print_report(summary: list[dict[str, Any]], args: argparse.Namespace) -> dict[int, dict[str, float]]:
    ranges = args.repeats > 1
    all_ratios = {}
    print(f"\nresults: median{' [min-max]' if ranges else ''} of {args.repeats} window(s) of {args.seconds:g} s")
    for workers in args.workers:
        rows = [r for r in summary if r["workers"] == workers]
        rows.sort(key=lambda r: METHODS.index(r["method"]))
        print(f"\n{workers} worker{'s' if workers > 1 else ''}")
        _print_table(
            ["method", "evals/s", "p50 us", "p99 us", "worker RSS MB", "worker PSS MB", "server RSS MB",
             "mean batch", "server CPU share", "CPU us/eval", "other load"],
            [[r["method"], _fmt(r["throughput"], ",.0f", ranges), _fmt(r["p50_us"], ",.0f", ranges),
              _fmt(r["p99_us"], ",.0f", ranges), _fmt(r["worker_rss_mb"], ".0f", False),
              _fmt(r["worker_pss_mb"], ".0f", False), _fmt(r["server_rss_mb"], ".0f", False),
              _fmt(r["mean_batch"], ".1f", False), _fmt(r["cpu_share_server"], ".0%", False),
              _fmt(r["cpu_us_per_eval"], ",.0f", False), _fmt(r["other_load_cores"], ".2f", False)]
             for r in rows])
        rs = ratios(summary, workers)
        all_ratios[workers] = rs
        if rs:
            print("ratios: " + ";  ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
    return all_ratios


def _dev_shm_shmeval() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "shmeval" in n}
    except FileNotFoundError:
        return set()


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workers", type=_int_list, help="worker counts (default 1,4,8,16)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    parser.add_argument("--seconds", type=float, help="measured window (default 4)")
    parser.add_argument("--repeats", type=int, help="windows per method and worker count (default 3)")
    parser.add_argument("--warmup", type=int, help="untimed evaluations per worker before ready (default 50)")
    parser.add_argument("--samples", type=int, default=20000, help="latencies each worker reports per window")
    parser.add_argument("--max-batch", type=int, default=256, help="batch limit of queue and shmeval (256)")
    parser.add_argument("--local-threads", type=int, default=1,
                        help="TF intra/inter-op threads of each local worker (default 1: N processes "
                             "share the cores; 0 = TensorFlow's default)")
    parser.add_argument("--server-threads", type=int, default=1,
                        help="TF intra/inter-op threads of the queue evaluator, the tf.distribute server "
                             "and the shmeval evaluator (default 1; 0 = TensorFlow's default, one per "
                             "core; see 'Defaults' in the module docstring)")
    parser.add_argument("--filters", type=int, default=32, help="conv filters (default 32)")
    parser.add_argument("--layers", type=int, default=3, help="3x3 conv layers (default 3)")
    parser.add_argument("--overhead-workers", type=int, default=4,
                        help="processes calling evaluate_many in the large-batch phase (default 4; 0 skips it)")
    parser.add_argument("--overhead-rows", type=_int_list, default=[64, 256],
                        help="rows per evaluate_many call, min,max (default 64,256)")
    parser.add_argument("--overhead-seconds", type=float, help="window of the large-batch phase (default 4)")
    parser.add_argument("--quick", action="store_true",
                        help="workers 1,16, one 1.5 s window each: a couple of minutes")
    parser.add_argument("--json", metavar="PATH", help="write machine info, every window and the summary here")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, short in (("workers", [1, 4, 8, 16], [1, 16]), ("seconds", 4.0, 1.5), ("repeats", 3, 1),
                              ("warmup", 50, 20), ("overhead_seconds", 4.0, 2.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    args.methods = [m for m in METHODS if m in args.methods]
    if len(args.overhead_rows) != 2 or args.overhead_rows[0] > args.overhead_rows[1]:
        parser.error("--overhead-rows takes MIN,MAX")
    if args.seconds <= 0 or args.repeats < 1 or args.warmup < 1 or args.samples < 1 or args.max_batch < 1:
        parser.error("--seconds, --repeats, --warmup, --samples and --max-batch must be positive")
    return args


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_all(abort: bool) -> None:
    for run in list(reversed(_LIVE)):
        with contextlib.suppress(Exception):
            run.stop(abort=abort)


def verify(name: str, check: Any, ref: dict[str, Any]) -> dict[str, Any]:
    if check is None:
        return {"ok": None}
    policy, value = check
    dp = float(np.max(np.abs(policy - ref["policy"])))
    dv = float(np.max(np.abs(value - ref["value"])))
    ok = max(dp, dv) <= CHECK_TOLERANCE
    print(f"check {name}: {N_CHECK_STATES} states, max |diff| vs Keras: policy {dp:.1e}, value {dv:.1e} "
          f"({'ok' if ok else 'MISMATCH'}, tolerance {CHECK_TOLERANCE:g})", file=sys.stderr)
    if not ok:
        raise RuntimeError(f"{name}: outputs differ from the Keras model's by more than {CHECK_TOLERANCE}")
    return {"ok": ok, "policy_max_abs_diff": dp, "value_max_abs_diff": dv}


def reference(cfg: NetConfig, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=reference_main, name="bench-reference", daemon=True,
                    args=(cfg, weights, check_states(), child_end))
    p.start()
    child_end.close()
    try:
        status, payload = _await(parent_end, p, READY_TIMEOUT_S, "reference model")
    finally:
        _join([p], JOIN_TIMEOUT_S)
        parent_end.close()
    if status != "ok":
        raise RuntimeError(f"reference model failed:\n{payload}")
    return dict(payload)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    shm_before = _dev_shm_shmeval()
    cfg = NetConfig(filters=args.filters, layers=args.layers)
    weights = make_weights(cfg)
    began = time.monotonic()
    trials: list[dict[str, Any]] = []
    runs_info: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    overhead: list[dict[str, Any]] = []
    try:
        ref = reference(cfg, weights)
        machine = machine_info()
        machine.update({"tensorflow": ref["tensorflow"], "keras": ref["keras"],
                        "device": ", ".join(ref["gpus"]) or "CPU (no GPU visible to TensorFlow)",
                        "gpus": ref["gpus"]})
        print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "gpus"))
        print(f"net: {cfg.layers} x conv3x3 {cfg.filters} + policy (7, softmax) and value (tanh) heads, "
              f"{ref['params']:,} parameters, input 6x7x2 float32; methods {','.join(args.methods)}; "
              f"workers {','.join(map(str, args.workers))}; {args.repeats} x {args.seconds:g} s windows; "
              f"max_batch {args.max_batch}; TF threads: local workers {args.local_threads or 'default'}, "
              f"servers {args.server_threads or 'default'}")

        for n_workers in args.workers:
            for method in args.methods:
                # On any exception the handler below aborts every live run.
                run = RUNS[method](method, n_workers, args, cfg, weights)
                run.start()
                if method not in checks:
                    checks[method] = verify(method, run.check, ref)
                info: dict[str, Any] = {
                    "method": method, "workers": n_workers, "startup_s": run.startup_s,
                    "tensorflow_imported_in_workers": sum(i["tensorflow_imported"] for i in run.infos)}
                runs_info.append(info)
                for repeat in range(args.repeats):
                    t = run.window(args.seconds, repeat)
                    trials.append(t)
                    srv = t.get("server") or {}
                    print(f"[{n_workers:>2} x {method:<8} {repeat + 1}/{args.repeats}] "
                          f"{t['throughput']:>9,.0f} evals/s  p50 {t['p50_us']:>8,.0f} us  "
                          f"p99 {t['p99_us']:>8,.0f} us  worker RSS {t['worker_rss_mb_median']:>5.0f} MB"
                          + (f"  mean batch {srv['mean_batch']:.1f}" if srv.get("mean_batch") else "")
                          + f"  other load {t['cpu_s_other'] / t['seconds']:.2f} cores"
                          + (f"  (start-up {run.startup_s:.0f} s)" if repeat == 0 else ""), file=sys.stderr)
                if method == "shmeval":
                    print(f"    shmeval workers with TensorFlow imported: "
                          f"{info['tensorflow_imported_in_workers']}/{n_workers}", file=sys.stderr)
                t_stop = time.monotonic()
                stuck = run.stop()
                info["stop_s"] = time.monotonic() - t_stop
                if stuck:
                    print(f"warning: {method} x{n_workers}: had to terminate {', '.join(stuck)}", file=sys.stderr)
                final_stats = getattr(run, "final_stats", None)
                if final_stats:
                    info["evaluator_stats"] = final_stats
                gc.collect()  # finalises the run's queues and pipes now

        if "shmeval" in args.methods and args.overhead_workers > 0:
            run = ShmevalManyRun("shmeval_many", args.overhead_workers, args, cfg, weights)
            run.start()
            for repeat in range(args.repeats):
                t = run.window(args.overhead_seconds, repeat)
                overhead.append(t)
                s = t["server"]
                print(f"[large batches {repeat + 1}/{args.repeats}] {args.overhead_workers} workers x "
                      f"evaluate_many({args.overhead_rows[0]}-{args.overhead_rows[1]}): "
                      f"{t['throughput']:,.0f} evals/s, mean batch {s['mean_batch']:.1f} "
                      f"({s['batches_ge_64_share']:.0%} of batches >= 64), model "
                      f"{s['model_ms_per_batch']:.2f} ms/batch, evaluator outside the model "
                      f"{s['overhead_us_per_batch']:.0f} us/batch = {s['overhead_over_model']:.1%} "
                      f"of model time", file=sys.stderr)
            run.stop()
            gc.collect()
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        print(f"\n{'interrupted' if interrupted else 'failed'}: stopping every process", file=sys.stderr)
        _stop_all(abort=True)
        leftovers = sorted(_dev_shm_shmeval() - shm_before)
        print(f"new shmeval entries in /dev/shm: {', '.join(leftovers) or 'none'}", file=sys.stderr)
        if interrupted:
            return 130
        raise
    elapsed = time.monotonic() - began

    summary = summarise(trials)
    all_ratios = print_report(summary, args)
    top = max(args.workers)
    targets = {}
    rs = all_ratios.get(top, {})
    if rs:
        print(f"\ntargets at {top} workers (reported, not enforced):")
        for name, goal in TARGETS.items():
            if name in rs:
                met = rs[name] >= goal
                targets[name] = {"value": rs[name], "target": goal, "met": met}
                print(f"  {name}: {rs[name]:.2f}x (target >= {goal:g}x: {'met' if met else 'NOT met'})")
    overhead_summary = None
    if overhead and all(t["server"]["overhead_over_model"] is not None for t in overhead):
        ratio = _stat([t["server"]["overhead_over_model"] for t in overhead])
        o_us = _stat([t["server"]["overhead_us_per_batch"] for t in overhead])
        m_ms = _stat([t["server"]["model_ms_per_batch"] for t in overhead])
        mb = _stat([t["server"]["mean_batch"] for t in overhead])
        assert ratio and o_us and m_ms and mb
        overhead_summary = {"overhead_over_model": ratio, "overhead_us_per_batch": o_us,
                            "model_ms_per_batch": m_ms, "mean_batch": mb, "target": OVERHEAD_TARGET,
                            "met": ratio["median"] <= OVERHEAD_TARGET}
        print(f"  shmeval evaluator time outside the model at large batches (mean batch {mb['median']:.0f}): "
              f"{o_us['median']:.0f} us/batch vs model {m_ms['median']:.2f} ms/batch = {ratio['median']:.1%} "
              f"(target <= {OVERHEAD_TARGET:.0%}: {'met' if overhead_summary['met'] else 'NOT met'})")
    tf_in_shm = [r for r in runs_info if r["method"] == "shmeval"]
    if tf_in_shm:
        n_tf = sum(r["tensorflow_imported_in_workers"] for r in tf_in_shm)
        print(f"  shmeval workers that imported TensorFlow: {n_tf} of {sum(r['workers'] for r in tf_in_shm)}")
    leftovers = sorted(_dev_shm_shmeval() - shm_before)
    print(f"\nwall time {elapsed:.0f} s; new shmeval entries in /dev/shm: {', '.join(leftovers) or 'none'}")
    if args.json:
        write_json(args.json, {"machine": machine, "net": {**asdict(cfg), "params": ref["params"]},
                               "config": {k: v for k, v in vars(args).items()},
                               "checks": checks, "runs": runs_info, "trials": trials,
                               "summary": summary,
                               "ratios": {str(k): v for k, v in all_ratios.items()},
                               "targets": targets,
                               "overhead_phase": {"trials": overhead, "summary": overhead_summary},
                               "dev_shm_leftovers": leftovers, "wall_s": elapsed})
        print(f"raw results: {args.json}")
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
