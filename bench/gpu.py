#!/usr/bin/env python
"""The GPU benchmark, prepared to run once on a GPU machine (about 5 minutes
on one GPU; it stops starting phases and methods after --budget-s, 480 s)
and to write one JSON file.

1. The model alone: the net of bench/torch_throughput.py as TorchModel
   serves it (CUDA graphs on a GPU, a batch of ndarrays in, ndarrays out)
   at batch 1 to 4096, ms per call and rows/s; beside it the plain forward
   on a batch already on the device (what the GPU itself does).  Run in a
   child process, so that its GPU memory is free again afterwards.
   TorchModel waits for the GPU as --gpu-wait says (block, or spin first:
   run it with each to compare; the JSON's "device" entry says which).
2. 16 and 64 workers, one state per request, through shmeval (TorchModel,
   two serving threads), the multiprocessing.Queue evaluator, TorchRL's
   ProcessInferenceServer and a model per worker, all on the same device
   (one process per model on one GPU): evals/s, p50/p99, mean batch, the
   GPU memory of every process that holds a context on it, and the share
   of the window the GPU was busy (NVML's utilisation, sampled every 50
   ms; nvidia-smi when the NVML module is missing).
3. A model whose cost is per call, not per row (the net on the GPU at
   small batches is one graph replay whatever its rows; on the CPU a
   stand-in that sleeps --call-us per call, the GIL released), served to
   --call-cost-workers workers, one state per request, greedy batching:
   one model; one replica with two serving threads (on a GPU two lanes,
   each its own CUDA stream); two replica processes on the one device;
   and, with several GPUs, one replica per GPU.  Beside each: the closed
   loop's best, every model always busy with its even share of the
   workers' requests.

A phase that fails does not end the run: its error and traceback go into
its entry of "phases" and the next phase starts; a method that fails (out
of memory with 64 contexts, say) has its error in its entry of "runs" and
the next method starts.  The JSON file is written after each phase and
each method (with "partial": true), then once more at the end; SIGTERM or
Ctrl-C writes what was measured so far (with "interrupted") and exits.
Each write goes to a temporary file renamed over the last, so the file is
whole whenever the run is killed.  "versions" holds the CUDA runtime
PyTorch was built with, the driver's version (nvidia-smi) and the
device's properties.

The device's per-command limit is 10 minutes: run it under ``timeout``,
which sends SIGTERM at 9 minutes (and SIGKILL 20 s later, should the
writing hang), while the budget stops starting new work at 8::

    timeout -s TERM -k 20 540 python bench/gpu.py --json bench/results/gpu-h200.json
    python bench/gpu.py --device cpu --workers 2 --seconds 0.5 --repeats 1 \\
        --batches 1,8,64 --call-cost-workers 4 --json /tmp/gpu-cpu.json   # the same code on the CPU

Targets on the GPU (reported, not enforced): at 64 workers shmeval reaches
70% of the model alone's rows/s at the batch size it forms, 5x the
per-worker models and 2x the Queue evaluator, with one GPU context where
the per-worker models have one each.

On a GPU machine without network, with PyTorch but without posix_ipc and
TorchRL (the project's device machine: Python 3.12, torch 2.11): bring the
wheels along.  Here, in the repository root::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        --platform manylinux1_x86_64 -d .whl posix_ipc==1.3.2 torchrl==0.14.1 \\
        tensordict==0.14.3 pyvers==0.2.3 hoptorch==0.1.4 orjson==3.13.0 \\
        lazy-importer==0.1.0 importlib_metadata==10.2.0

(4 MB; ``unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist``
lists what each needs; cloudpickle, packaging and zipp, which tensordict
needs as well, are there).  There, with ``.whl`` carried, build the extensions
in place (Cython, NumPy and setuptools are there) and run::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PWD/src &&
    python3 bench/build_ext.py &&
    timeout -s TERM -k 20 540 python3 bench/gpu.py --json $OUT/gpu.json

(bench/build_ext.py checks for a C compiler and Python.h first, naming what
is missing, then builds the extensions in place.)
"""
from __future__ import annotations

import argparse
import functools
import math
import multiprocessing as mp
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, Sequence

import numpy as np

from torch_throughput import (METHODS, STATE_SHAPE, NetConfig, Probe, _await, _int_list,
                              _on_sigterm, add_arguments, build_net, check_arguments,
                              import_torch, make_weights, measure, print_table, report_targets,
                              summarise, torchmodel_factory)

from shmeval._util.children import child_setup, start_process
from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info

OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}
#: The least time each batch size of the model-alone phase is timed for
#: (--sweep-seconds).
SWEEP_S = 0.3
#: Seconds after which no phase or method starts (--budget-s): with the
#: one running when it passes and the writes, the run ends well inside the
#: 540 s of the ``timeout`` wrapper and the device's 600 s per command.
BUDGET_S = 480.0
#: The stand-in's cost per call on the CPU (--call-us): the 4 ms of the
#: issue's call-cost measurements.
CALL_US = 4000.0
#: The longest the model-alone phase may take (start-up included).
MODEL_ALONE_TIMEOUT_S = 180.0
TARGETS = {"shmeval / model alone rows/s at its batch": 0.7, "shmeval/local evals/s": 5.0,
           "shmeval/queue evals/s": 2.0}


# --- 1. the model alone -------------------------------------------------------------

def _timed(call: Any, sync: Any, sweep_s: float) -> float:
    """Seconds per call: the median of 5 rounds, each long enough to hold
    sweep_s / 5 of calls."""
    call()
    sync()
    t0 = time.perf_counter()
    call()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(sweep_s / 5 / once))
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        sync()
        rounds.append((time.perf_counter() - t0) / n)
    return float(np.median(rounds))


def sweep_main(cfg: NetConfig, weights: Any, device: str, threads: Optional[int],
               batches: Sequence[int], sweep_s: float, conn: Connection,
               gpu_wait: Any = "spin") -> None:
    """Times TorchModel calls (waiting for the GPU as ``gpu_wait`` says)
    and the plain forward at each batch size."""
    child_setup()
    try:
        torch = import_torch(threads)
        from shmeval.backends.torch import TorchModel
        from shmeval.spec import Spec

        net = build_net(cfg, weights, device)
        tm = TorchModel(net, device=device, lanes=1, gpu_wait=gpu_wait)
        tm.prepare(Spec.build(STATE_SHAPE, "float32", OUTPUTS, max(batches), 1, 1),
                   sorted(batches))
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        rng = np.random.default_rng(0)
        rows = []
        for n in sorted(batches):
            batch = rng.random((n, *STATE_SHAPE), np.float32)
            resident = torch.from_numpy(batch).to(device)

            def forward() -> None:
                with torch.inference_mode():
                    net(resident)

            served = _timed(lambda: tm(batch), sync, sweep_s)
            plain = _timed(forward, sync, sweep_s)
            rows.append({"batch": n, "served_ms": served * 1e3, "served_rows_per_s": n / served,
                         "device_ms": plain * 1e3, "device_rows_per_s": n / plain})
            print(f"[model alone] batch {n:>5}: TorchModel {served * 1e3:8.3f} ms "
                  f"({n / served:>12,.0f} rows/s)   forward on the device {plain * 1e3:8.3f} ms "
                  f"({n / plain:>12,.0f} rows/s)", file=sys.stderr)
        info = {"torch": torch.__version__, "cuda_graphs": tm.cuda_graphs, "gpu_wait": gpu_wait,
                "graph_captures": tm.graph_captures, "warmup_s": tm.warmup_s,
                "device_name": (torch.cuda.get_device_name(device)
                                if device.startswith("cuda") else "cpu")}
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(device)
            info["device_properties"] = {
                "name": props.name, "capability": f"{props.major}.{props.minor}",
                "total_memory_mb": props.total_memory / 2**20,
                "multi_processors": props.multi_processor_count}
        conn.send(("ok", rows, info))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", None))


def model_alone(args: argparse.Namespace, cfg: NetConfig, weights: Any, timeout: float
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=sweep_main, name="bench-model-alone", daemon=True,
                    args=(cfg, weights, args.device, args.threads, args.batches,
                          args.sweep_seconds, child_end, args.gpu_wait))
    p.start()
    child_end.close()
    try:
        status, rows, info = _await(parent_end, p, timeout, "model alone")
    except BaseException:
        # Out of time or interrupted: what it measured is lost either way.
        p.kill()
        p.join(5.0)
        raise
    p.join(30.0)
    if p.is_alive():
        p.kill()
    if status != "ok":
        raise RuntimeError(f"model alone: {rows}")
    return rows, info


def rows_per_s_at(sweep: list[dict[str, Any]], batch: float) -> float:
    """The model alone's served rows/s at ``batch`` rows, interpolated in
    log2(batch) between the sizes measured."""
    xs = [math.log2(r["batch"]) for r in sweep]
    ys = [r["served_rows_per_s"] for r in sweep]
    return float(np.interp(math.log2(max(batch, 1.0)), xs, ys))


def cuda_versions() -> dict[str, Any]:
    """The CUDA runtime PyTorch was built with, cuDNN's version and the
    driver's (nvidia-smi; None where it is missing), without creating a
    CUDA context in this process."""
    import torch

    found: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                             "cudnn": None, "driver": None, "gpus": None}
    try:
        found["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # no cuDNN in this build: None says so
        pass
    if shutil.which("nvidia-smi") is not None:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=20)
        gpus = [[f.strip() for f in line.split(",")] for line in r.stdout.splitlines()
                if line.strip()]
        found["driver"] = gpus[0][0] if gpus else None
        found["gpus"] = [{"name": g[1], "memory": g[2]} for g in gpus if len(g) >= 3]
    return found


# --- 3. a model whose cost is per call ----------------------------------------------

class CallCostModel:
    """The CPU's stand-in for a GPU call: ``call_s`` per call whatever its
    rows (a sleep: the GIL released, no CPU used), zeros out.  Up to four
    calls may overlap, as a GPU's streams may."""

    max_concurrency = 4

    def __init__(self, call_s: float) -> None:
        self.call_s = call_s

    def __call__(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        time.sleep(self.call_s)
        n = len(batch)
        return {"policy": np.zeros((n, 7), np.float32), "value": np.zeros(n, np.float32)}


def call_cost_factory(cfg: NetConfig, weights: Any, threads: Optional[int], call_s: float,
                      device: str) -> Any:
    """A replica's model: the net on a GPU, the stand-in elsewhere."""
    if device.startswith("cuda"):
        return torchmodel_factory(cfg, weights, device, threads)
    return CallCostModel(call_s)


def call_cost_worker(ev: Any, seconds: float, ready: Any, go: Any, counts: Any) -> None:
    """Evaluates one state at a time: once to attach, then for ``seconds``
    after ``go``; puts how many it answered."""
    child_setup()
    state = np.zeros(STATE_SHAPE, np.float32)
    ev.evaluate(state)
    ready.put(1)
    go.wait()
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        ev.evaluate(state)
        n += 1
    counts.put(n)


def call_cost_cells(device: str, gpus: int) -> list[tuple[str, list[str], int]]:
    """(name, one device per replica, serving threads per replica)."""
    cells = [("one model", [device], 1), ("two serving threads (streams)", [device], 2),
             ("two replicas, one device", [device, device], 1)]
    if gpus > 1:
        cells.append((f"one replica per GPU ({gpus})", [f"cuda:{i}" for i in range(gpus)], 1))
    return cells


def call_cost_cell(args: argparse.Namespace, cfg: NetConfig, weights: Any,
                   devices: list[str], threads: int, timeout: float) -> dict[str, Any]:
    """One cell: evals/s over one window, and each replica's mean batch."""
    import shmeval

    ev = shmeval.Evaluator.spawn(
        functools.partial(call_cost_factory, cfg, weights, args.threads,
                          args.call_us * 1e-6),
        devices=devices, input_shape=STATE_SHAPE, outputs=OUTPUTS, max_batch=args.max_batch,
        max_clients=args.call_cost_workers + 8, serving_threads=threads, max_wait_us=0,
        start_timeout=timeout)
    ctx = mp.get_context("spawn")
    ready, counts, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = []
    try:
        for i in range(args.call_cost_workers):
            workers.append(start_process(ctx, call_cost_worker, f"bench-call-cost-{i}",
                                         (ev, args.seconds, ready, go, counts)))
        for _ in workers:
            ready.get(timeout=timeout)
        before = ev.stats()["replicas"]
        go.set()
        total = sum(counts.get(timeout=args.seconds + 60) for _ in workers)
        after = ev.stats()["replicas"]
        for w in workers:
            w.join(5.0)
    finally:
        for w in workers:  # those left after an error: nothing to wait for
            if w.is_alive():
                w.kill()
        ev.close()
    batches = [(a["requests"] - b["requests"]) / max(1, a["batches"] - b["batches"])
               for a, b in zip(after, before)]
    return {"evals_per_s": total / args.seconds, "mean_batch_per_replica": batches}


# --- the GPU beside each window -----------------------------------------------------

class GpuProbe(Probe):
    """The device's busy share over a window, sampled every 50 ms, and the
    GPU memory of each process holding a context on it at the window's end
    (NVML through the nvidia-ml-py module, else nvidia-smi).  On the CPU
    it measures nothing."""

    def __init__(self, device: str) -> None:
        self.index = None
        if device.startswith("cuda"):
            self.index = int(device.split(":")[1]) if ":" in device else 0
        self.nvml: Any = None
        self.handle: Any = None
        if self.index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(self.index)
            except Exception:  # the module or the library is missing: nvidia-smi
                self.nvml = None
        self.samples: list[float] = []
        self.stopping = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.pids: list[int] = []

    def utilisation(self) -> Optional[float]:
        if self.nvml is not None:
            return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        out = self.smi("--query-gpu=utilization.gpu")
        return float(out[0]) if out else None

    def memory_by_pid(self) -> dict[int, float]:
        if self.nvml is not None:
            return {p.pid: (p.usedGpuMemory or 0) / 2**20
                    for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)}
        found = {}
        for line in self.smi("--query-compute-apps=pid,used_memory"):
            pid, mb = line.split(",")
            found[int(pid)] = float(mb)
        return found

    def smi(self, query: str) -> list[str]:
        if shutil.which("nvidia-smi") is None:
            return []
        r = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits",
                            f"--id={self.index}"], capture_output=True, text=True, timeout=10)
        return [line.strip() for line in r.stdout.splitlines() if line.strip()]

    def sample(self) -> None:
        while not self.stopping.wait(0.05):
            u = self.utilisation()
            if u is not None:
                self.samples.append(u)

    def start(self, pids: Sequence[int]) -> None:
        if self.index is None:
            return
        self.pids = list(pids)
        self.samples = []
        self.stopping.clear()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def stop(self) -> dict[str, Any]:
        if self.index is None or self.thread is None:
            return {"gpu_busy_share": None, "gpu_contexts": None, "gpu_memory_mb_total": None}
        self.stopping.set()
        self.thread.join(5.0)
        memory = self.memory_by_pid()
        ours = {pid: mb for pid, mb in memory.items() if pid in self.pids}
        return {"gpu_busy_share": (float(np.mean(self.samples)) / 100 if self.samples
                                   else None),
                # In a pid namespace other than the driver's, no pid matches:
                # then every context on the GPU counts.
                "gpu_contexts": len(ours) if ours else len(memory),
                "gpu_memory_mb_total": sum((ours or memory).values()),
                "gpu_memory_mb_by_pid": {str(pid): mb for pid, mb in (ours or memory).items()}}


# --- a whole run ----------------------------------------------------------------------

class Run:
    """The run's results as they grow, and the phases that fill them: a
    phase that raises has its error in its entry of ``phases`` and the next
    one starts; after each phase (and each method) the JSON file is
    written again."""

    def __init__(self, args: argparse.Namespace, cfg: NetConfig, weights: Any) -> None:
        self.args, self.cfg, self.weights = args, cfg, weights
        self.began = time.monotonic()
        self.deadline: float = self.began + args.budget_s
        machine = machine_info(torch=("torch",), torchrl=("torchrl",), tensordict=("tensordict",))
        print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
        self.results: dict[str, Any] = {
            "machine": machine, "versions": None, "device": None, "net": vars(cfg),
            "config": vars(args), "phases": {}, "model_alone": None, "runs": [], "trials": [],
            "call_cost": None}

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, **flags: Any) -> None:
        if self.args.json:
            write_json(self.args.json, {**self.results, **flags,
                                        "wall_s": time.monotonic() - self.began})

    def phase(self, name: str, body: Callable[[], None]) -> None:
        entry: dict[str, Any] = {"ok": None}  # None while it runs
        self.results["phases"][name] = entry
        t0 = time.monotonic()
        try:
            body()
            entry["ok"] = True
        except Exception as e:
            entry.update(ok=False, error=f"{type(e).__name__}: {e}",
                         traceback=traceback.format_exc()[-4000:])
            print(f"error: phase {name}: {type(e).__name__}: {e}; going on with the next",
                  file=sys.stderr)
        finally:
            entry["seconds"] = time.monotonic() - t0
        self.save(partial=True)

    # -- the phases ----------------------------------------------------------------

    def versions(self) -> None:
        self.results["versions"] = v = cuda_versions()
        print(f"torch {v['torch']} (CUDA {v['torch_cuda']}, cuDNN {v['cudnn']}), driver "
              f"{v['driver']}")

    def model_alone(self) -> None:
        rows, info = model_alone(self.args, self.cfg, self.weights,
                                 min(MODEL_ALONE_TIMEOUT_S, max(self.left_s(), 1.0)))
        self.results["model_alone"], self.results["device"] = rows, info
        print(f"device: {info['device_name']}, torch {info['torch']}, "
              f"CUDA graphs {info['cuda_graphs']}")

    def methods(self) -> None:
        """Every method at every worker count, one at a time, so that none
        starts past the budget: one that would is recorded as skipped."""
        args, probe = self.args, GpuProbe(self.args.device)
        for n in args.workers:
            for method in args.methods:
                if self.left_s() < args.repeats * args.seconds:
                    self.results["runs"].append(
                        {"method": method, "workers": n,
                         "skipped": f"out of time ({self.left_s():.0f} s of --budget-s left)"})
                    print(f"skipped: {method} x{n}: out of time", file=sys.stderr)
                    continue
                one = argparse.Namespace(**{**vars(args), "workers": [n], "methods": [method]})
                # keep_going: one method failing (out of memory with 64
                # contexts, say) is recorded in its run entry.
                trials, runs = measure(one, self.cfg, self.weights, probe, keep_going=True)
                self.results["trials"] += trials
                self.results["runs"] += runs
                self.save(partial=True)

    def call_cost(self) -> None:
        args = self.args
        gpus = 0
        if args.device.startswith("cuda"):
            import torch

            gpus = torch.cuda.device_count()
        sweep = self.results["model_alone"]
        cells = self.results["call_cost"] = []
        print(f"\ncall cost: {args.call_cost_workers} workers, one state per request, greedy"
              + ("" if gpus else f"; the stand-in sleeps {args.call_us:g} us per call"))
        for name, devices, threads in call_cost_cells(args.device, gpus):
            models = len(devices) * threads
            share = args.call_cost_workers / models
            # Every model always busy with its even share of the requests.
            if gpus:
                best = models * rows_per_s_at(sweep, share) if sweep else None
            else:
                best = args.call_cost_workers / (args.call_us * 1e-6)
            cell: dict[str, Any] = {"cell": name, "devices": devices, "serving_threads": threads,
                                    "closed_loop_best": best}
            cells.append(cell)
            if self.left_s() < args.seconds:
                cell["skipped"] = f"out of time ({self.left_s():.0f} s of --budget-s left)"
                continue
            try:
                cell.update(call_cost_cell(args, self.cfg, self.weights, devices, threads,
                                           max(self.left_s(), 10.0)))
            except Exception as e:  # the next cell may fit (two replicas out of memory)
                cell["error"] = f"{type(e).__name__}: {e}"
                print(f"error: call cost, {name}: {cell['error']}", file=sys.stderr)
                continue
            batches = ", ".join(f"{b:.1f}" for b in cell["mean_batch_per_replica"])
            print(f"  {name:<34} {cell['evals_per_s']:>9,.0f} evals/s (best "
                  + (f"{best:,.0f}" if best else "?") + f"), rows per call {batches}")
            self.save(partial=True)

    def report(self) -> None:
        args, r = self.args, self.results
        keys = ("gpu_busy_share", "gpu_contexts", "gpu_memory_mb_total")
        r["summary"] = summary = summarise(r["trials"], keys)
        extra = [("GPU busy", "gpu_busy_share", ".0%"), ("GPU contexts", "gpu_contexts", ".0f"),
                 ("GPU MB", "gpu_memory_mb_total", ",.0f")]
        measured = sorted({row["workers"] for row in summary})
        all_ratios = {n: print_table(summary, n, extra) for n in measured}
        r["ratios"] = {str(k): v for k, v in all_ratios.items()}
        r["methods"] = list(METHODS)
        if not measured:
            return
        top = max(measured)
        shm = next((row for row in summary if row["workers"] == top
                    and row["method"] == "shmeval"), None)
        if shm and shm["mean_batch"] and r["model_alone"]:
            batch = shm["mean_batch"]["median"]
            alone = rows_per_s_at(r["model_alone"], batch)
            all_ratios[top]["shmeval / model alone rows/s at its batch"] = (
                shm["throughput"]["median"] / alone)
            print(f"\nshmeval at {top} workers: {shm['throughput']['median']:,.0f} evals/s at a "
                  f"mean batch of {batch:.1f}; the model alone there: {alone:,.0f} rows/s")
        r["targets"] = report_targets(all_ratios[top], TARGETS, top)


def _gpu_wait(text: str) -> Any:
    """--gpu-wait: "block", "spin" or a number of µs."""
    return text if text in ("block", "spin") else float(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser, "16,64", 3.0, 2)
    parser.add_argument("--device", default="cuda",
                        help="cuda, cuda:N or cpu (default cuda: the first GPU)")
    parser.add_argument("--batches", type=_int_list,
                        default=[1 << i for i in range(13)],
                        help="batch sizes of the model-alone phase (default 1,2,4,...,4096)")
    parser.add_argument("--sweep-seconds", type=float, default=SWEEP_S,
                        help="the least time each batch size of the model-alone phase is "
                             "timed for, TorchModel and the plain forward each "
                             f"(default {SWEEP_S:g})")
    parser.add_argument("--gpu-wait", type=_gpu_wait, default="spin",
                        help="how TorchModel waits for the GPU in the model-alone phase: "
                             "block, spin (one wake-up's cost, then block; the default) or "
                             "a spin budget in µs")
    parser.add_argument("--serving-threads", type=int,
                        help="shmeval's serving threads (default 2 on a GPU: one batch is "
                             "copied while the previous one computes; 1 on the CPU)")
    parser.add_argument("--call-cost-workers", type=int, default=16,
                        help="workers of the call-cost phase (default 16; 0: skip it)")
    parser.add_argument("--call-us", type=float, default=CALL_US,
                        help="the CPU stand-in's cost per call in the call-cost phase "
                             f"(default {CALL_US:g})")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="no phase or method starts after this many seconds "
                             f"(default {BUDGET_S:g}); the one running finishes")
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.sweep_seconds <= 0 or args.budget_s <= 0:
        parser.error("--sweep-seconds and --budget-s must be positive")
    if args.serving_threads is None:
        args.serving_threads = 2 if args.device.startswith("cuda") else 1
    signal.signal(signal.SIGTERM, _on_sigterm)
    cfg = NetConfig(filters=args.filters, layers=args.layers)
    run = Run(args, cfg, make_weights(cfg))
    try:
        run.phase("versions", run.versions)
        run.phase("model_alone", run.model_alone)
        run.phase("methods", run.methods)
        if args.call_cost_workers:
            run.phase("call_cost", run.call_cost)
        run.phase("report", run.report)
    except KeyboardInterrupt as e:
        # SIGTERM (the timeout wrapper) or Ctrl-C: write what there is, and
        # let no second signal cut that write short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        why = str(e) or "interrupted"
        print(f"\n{why}: writing what was measured and stopping", file=sys.stderr)
        run.save(partial=True, interrupted=why)
        return 130
    failed = [name for name, p in run.results["phases"].items() if not p["ok"]]
    print(f"\nwall time {time.monotonic() - run.began:.0f} s"
          + (f"; failed phases: {', '.join(failed)}" if failed else ""))
    run.save()
    if args.json:
        print(f"raw results: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
