#!/usr/bin/env python
"""The GPU benchmark, prepared to run once on a GPU machine (about 5 minutes
on one GPU, under 8) and to write one JSON file.

1. The model alone: the net of bench/torch_throughput.py as TorchModel
   serves it (CUDA graphs on a GPU, a batch of ndarrays in, ndarrays out)
   at batch 1 to 4096, ms per call and rows/s; beside it the plain forward
   on a batch already on the device (what the GPU itself does).  Run in a
   child process, so that its GPU memory is free again afterwards.
2. 16 and 64 workers, one state per request, through shmeval (TorchModel,
   two serving threads), the multiprocessing.Queue evaluator, TorchRL's
   ProcessInferenceServer and a model per worker, all on the same device
   (one process per model on one GPU): evals/s, p50/p99, mean batch, the
   GPU memory of every process that holds a context on it, and the share
   of the window the GPU was busy (NVML's utilisation, sampled every 50
   ms; nvidia-smi when the NVML module is missing).

A method that fails (out of memory with 64 contexts, say) does not end
the run: its error goes into its entry of "runs" and the next method
starts.  The JSON file is written after the model-alone phase and after
each method (with "partial": true), then whole at the end, so a run cut
short on a borrowed GPU keeps what it measured.

    python bench/gpu.py --json bench/results/gpu-h200.json
    python bench/gpu.py --device cpu --workers 2 --seconds 0.5 --repeats 1 \\
        --batches 1,8,64 --json /tmp/gpu-cpu.json        # the same code on the CPU

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
    python3 setup.py build_ext --inplace -q &&
    python3 bench/gpu.py --json $OUT/gpu.json
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import shutil
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Optional, Sequence

import numpy as np

from torch_throughput import (METHODS, STATE_SHAPE, NetConfig, Probe, _await, _int_list,
                              _on_sigterm, add_arguments, build_net, check_arguments,
                              import_torch, make_weights, measure, print_table, report_targets,
                              summarise)

from shmeval._util.children import child_setup
from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info

OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}
#: The least time each batch size of the model-alone phase is timed for
#: (--sweep-seconds).
SWEEP_S = 0.3
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
               batches: Sequence[int], sweep_s: float, conn: Connection) -> None:
    """Times TorchModel calls and the plain forward at each batch size."""
    child_setup()
    try:
        torch = import_torch(threads)
        from shmeval.backends.torch import TorchModel
        from shmeval.spec import Spec

        net = build_net(cfg, weights, device)
        tm = TorchModel(net, device=device, lanes=1)
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
        info = {"torch": torch.__version__, "cuda_graphs": tm.cuda_graphs,
                "graph_captures": tm.graph_captures, "warmup_s": tm.warmup_s,
                "device_name": (torch.cuda.get_device_name(device)
                                if device.startswith("cuda") else "cpu")}
        conn.send(("ok", rows, info))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", None))


def model_alone(args: argparse.Namespace, cfg: NetConfig, weights: Any
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=sweep_main, name="bench-model-alone", daemon=True,
                    args=(cfg, weights, args.device, args.threads, args.batches,
                          args.sweep_seconds, child_end))
    p.start()
    child_end.close()
    try:
        status, rows, info = _await(parent_end, p, 600.0, "model alone")
    finally:
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
    parser.add_argument("--serving-threads", type=int,
                        help="shmeval's serving threads (default 2 on a GPU: one batch is "
                             "copied while the previous one computes; 1 on the CPU)")
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.sweep_seconds <= 0:
        parser.error("--sweep-seconds must be positive")
    if args.serving_threads is None:
        args.serving_threads = 2 if args.device.startswith("cuda") else 1
    signal.signal(signal.SIGTERM, _on_sigterm)
    cfg = NetConfig(filters=args.filters, layers=args.layers)
    weights = make_weights(cfg)
    machine = machine_info(torch=("torch",), torchrl=("torchrl",), tensordict=("tensordict",))
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    began = time.monotonic()

    def save(partial: bool, **parts: Any) -> None:
        """The JSON file, with what is measured so far while ``partial``:
        the one run on a borrowed GPU keeps what it got if a later phase
        fails."""
        if args.json:
            write_json(args.json, {"machine": machine, "device": model_info, "net": vars(cfg),
                                   "config": vars(args), "model_alone": sweep,
                                   **({"partial": True} if partial else {}), **parts})

    try:
        sweep, model_info = model_alone(args, cfg, weights)
        print(f"device: {model_info['device_name']}, torch {model_info['torch']}, "
              f"CUDA graphs {model_info['cuda_graphs']}")
        save(True)
        # One method failing (out of memory with 64 contexts, say) leaves
        # the others' figures: it is recorded in its run entry.
        trials, runs = measure(args, cfg, weights, GpuProbe(args.device), keep_going=True,
                               after=lambda trials, runs: save(True, trials=trials, runs=runs))
    except KeyboardInterrupt:
        return 130
    elapsed = time.monotonic() - began
    keys = ("gpu_busy_share", "gpu_contexts", "gpu_memory_mb_total")
    summary = summarise(trials, keys)
    extra = [("GPU busy", "gpu_busy_share", ".0%"), ("GPU contexts", "gpu_contexts", ".0f"),
             ("GPU MB", "gpu_memory_mb_total", ",.0f")]
    all_ratios = {n: print_table(summary, n, extra) for n in args.workers}
    top = max(args.workers)
    shm = next((r for r in summary if r["workers"] == top and r["method"] == "shmeval"), None)
    if shm and shm["mean_batch"]:
        batch = shm["mean_batch"]["median"]
        alone = rows_per_s_at(sweep, batch)
        all_ratios[top]["shmeval / model alone rows/s at its batch"] = (
            shm["throughput"]["median"] / alone)
        print(f"\nshmeval at {top} workers: {shm['throughput']['median']:,.0f} evals/s at a mean "
              f"batch of {batch:.1f}; the model alone there: {alone:,.0f} rows/s")
    targets = report_targets(all_ratios[top], TARGETS, top)
    print(f"\nwall time {elapsed:.0f} s")
    save(False, runs=runs, trials=trials, summary=summary,
         ratios={str(k): v for k, v in all_ratios.items()}, targets=targets,
         methods=list(METHODS), wall_s=elapsed)
    if args.json:
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
