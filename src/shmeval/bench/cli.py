"""``shmeval bench``: round trips through every method, the machine's
reference figures and the evaluator's batch path, in one run.  shmeval.cli
imports this module only when that subcommand is chosen; it adds the
arguments (:func:`add_arguments`) and runs them (:func:`run`).

    shmeval bench --quick                     # under a minute
    shmeval bench --json bench.json --plot bench.png
    shmeval bench --workers 1,4,16 --state go --methods queue,pipe,shmeval

Round trips first: for each state, each repetition runs every worker count,
and every method in turn at each count (the order of the methods rotating
from one repetition to the next), so slow drifts of the machine hit them
alike.  Then the reference (once) and the batch path (once per state), never
interleaved with the round trips.  Exits 1 if a trial or a section failed or
the run left entries in /dev/shm, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable, Collection


from . import DEFAULT_METHODS, METHODS, OPTIONAL_PACKAGES, STATES
from . import report
from .._util.display import format_duration
from .._util.jsonout import write_json
from .roundtrip import CDF_GRID, StateSpec, TrialConfig, run_trial

FULL_WORKERS = (1, 2, 4, 8, 16, 32, 64)
QUICK_WORKERS = (1, 16)
FULL_STATES = ("c4", "go")
FULL_REPEATS = 3
FULL_SECONDS = 2.0
QUICK_SECONDS = 1.0
FULL_SECTION_SECONDS = {"reference": 1.0, "batch_path": 0.5}
QUICK_SECTION_SECONDS = {"reference": 0.2, "batch_path": 0.05}
# For the ETA only: seconds of spawning and warm-up per worker on a 2-core
# machine, and of fixed cost per trial.  The progress line rescales them
# by what the run has taken so far.
SPAWN_S_PER_WORKER = 0.12
TRIAL_OVERHEAD_S = 0.6


# --- arguments ----------------------------------------------------------------------


def _comma_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _worker_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in _comma_list(text)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return sorted(set(values))


def _known_names(text: str, known: Collection[str], kind: str) -> list[str]:
    """The comma-separated names of text, in order, once each; all known."""
    names = list(dict.fromkeys(_comma_list(text)))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {kind}(s) {', '.join(unknown) or repr(text)}; "
                                         f"choose from {', '.join(known)}")
    return names


def _method_list(text: str) -> list[str]:
    names = _known_names(text, METHODS, "method")
    for m in names:
        package = OPTIONAL_PACKAGES.get(m)
        if package and importlib.util.find_spec(package) is None:
            raise argparse.ArgumentTypeError(f"method {m} needs the {package} package: "
                                             "pip install 'shmeval[bench]'")
    return names


def _state_list(text: str) -> list[str]:
    return _known_names(text, STATES, "state")


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def _png_path(text: str) -> str:
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("--plot needs matplotlib: pip install 'shmeval[bench]'")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: workers {','.join(map(str, QUICK_WORKERS))}, c4, 1 repetition of "
                   f"{QUICK_SECONDS:g} s windows, short reference and batch path (explicit options still apply)")
    p.add_argument("--workers", type=_worker_list, metavar="N,N,...",
                   help=f"worker counts (default {','.join(map(str, FULL_WORKERS))})")
    p.add_argument("--state", type=_state_list, metavar="c4|go|c4,go",
                   help="c4: 6x7x2, go: 19x19x17 float32 (default c4,go)")
    p.add_argument("--methods", type=_method_list, metavar="M,M,...",
                   help=f"from {','.join(METHODS)} (default {','.join(DEFAULT_METHODS)})")
    p.add_argument("--seconds", type=_positive(float), help=f"timed window per trial (default {FULL_SECONDS:g})")
    p.add_argument("--repeats", type=_positive(int), help=f"repetitions (default {FULL_REPEATS})")
    p.add_argument("--warmup", type=_positive(int), default=200, help="untimed round trips per worker (default 200)")
    p.add_argument("--samples", type=_positive(int), default=20_000,
                   help="latencies each worker reports (default 20000)")
    p.add_argument("--max-batch", type=_positive(int), default=256, help="server batch limit (default 256)")
    p.add_argument("--worker-sched", choices=("normal", "batch"), default="normal",
                   help="scheduling policy of every method's workers: normal (the default policy) or "
                   "batch (SCHED_BATCH, what shmeval.use_batch_scheduling sets) (default normal)")
    p.add_argument("--loop", choices=("c", "python"), default="c",
                   help="the workers' timed loop around each call: c (shmeval.bench._timing.timed_calls) or python "
                   "(the same loop in bytecode, which adds its own CPU to every method's round trip) "
                   "(default c)")
    p.add_argument("--no-reference", action="store_true", help="skip the machine's reference figures")
    p.add_argument("--no-batch-path", action="store_true", help="skip the evaluator's batch-path table")
    p.add_argument("--reference-seconds", type=_positive(float),
                   help=f"per reference measurement (default {FULL_SECTION_SECONDS['reference']:g}, "
                   f"quick {QUICK_SECTION_SECONDS['reference']:g})")
    p.add_argument("--batch-path-seconds", type=_positive(float),
                   help=f"per batch size (default {FULL_SECTION_SECONDS['batch_path']:g}, "
                   f"quick {QUICK_SECTION_SECONDS['batch_path']:g})")
    p.add_argument("--json", metavar="PATH", help="write machine info, config, every trial, the summary, "
                   "the reference and the batch path here")
    p.add_argument("--plot", type=_png_path, metavar="PATH.png",
                   help="draw round trips/s against workers and the latency CDFs (needs matplotlib)")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The run's configuration: the options given, the rest from the quick or
    the full defaults."""
    quick = bool(args.quick)
    states = args.state or (["c4"] if quick else list(FULL_STATES))
    if args.methods:
        methods = args.methods
    else:
        methods = [m for m in DEFAULT_METHODS
                   if m not in OPTIONAL_PACKAGES or importlib.util.find_spec(OPTIONAL_PACKAGES[m]) is not None]
    sections = QUICK_SECTION_SECONDS if quick else FULL_SECTION_SECONDS
    return {
        "quick": quick,
        "states": states,
        "workers": args.workers or list(QUICK_WORKERS if quick else FULL_WORKERS),
        "methods": methods,
        "skipped_methods": [m for m in DEFAULT_METHODS if not args.methods and m not in methods],
        "repeats": args.repeats or (1 if quick else FULL_REPEATS),
        "trial": asdict(TrialConfig(seconds=args.seconds or (QUICK_SECONDS if quick else FULL_SECONDS),
                                    warmup=args.warmup, samples=args.samples, max_batch=args.max_batch,
                                    worker_sched=args.worker_sched, loop=args.loop)),
        "reference": None if args.no_reference else args.reference_seconds or sections["reference"],
        "batch_path": None if args.no_batch_path else args.batch_path_seconds or sections["batch_path"],
        "cdf_grid": list(CDF_GRID),
    }


# --- the run ------------------------------------------------------------------------


def dev_shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def mapped_by_others() -> set[str]:
    """/dev/shm names that another live process has mapped.  Every process the
    benchmark started has exited by the time this is asked, so such entries
    belong to something running alongside (a test suite, say), not to us."""
    names: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return names


def _trial_weight(n_workers: int, seconds: float) -> float:
    return seconds + TRIAL_OVERHEAD_S + SPAWN_S_PER_WORKER * n_workers


def _plan(config: dict[str, Any]) -> list[tuple[StateSpec, int, int, str]]:
    """(state, repetition, workers, method) of every trial, in running order:
    within a repetition every worker count runs each method in turn, the
    methods' order rotating from one repetition to the next."""
    methods = config["methods"]
    plan = []
    for state in config["states"]:
        for repeat in range(config["repeats"]):
            shift = repeat % len(methods)
            order = methods[shift:] + methods[:shift]
            plan += [(STATES[state], repeat, n, m) for n in config["workers"] for m in order]
    return plan


def _section(name: str, progress: report.Progress, failures: list[str], measure: Callable[[], Any]) -> Any:
    """A section's result, or {"error": traceback} (and a failure) if it raised."""
    try:
        result = measure()
    except Exception:
        result = {"error": traceback.format_exc()}
        failures.append(name)
        progress.note(f"FAILED: {name}:\n{result['error']}")
    progress.step(name)
    return result


def run(args: argparse.Namespace) -> int:
    config = resolve(args)
    specs = [STATES[s] for s in config["states"]]
    trial_config = TrialConfig(**config["trial"])
    shm_before = dev_shm_entries()
    machine = report.machine_info()
    print(report.describe_machine(machine))
    print(f"methods {','.join(config['methods'])}; workers {','.join(map(str, config['workers']))}; "
          f"states {', '.join(s.describe() for s in specs)}; {trial_config.seconds:g} s windows; "
          f"{config['repeats']} repetition(s); max_batch {trial_config.max_batch}; "
          f"workers' scheduling policy {trial_config.worker_sched}; {trial_config.loop} loop", flush=True)
    for m in config["skipped_methods"]:
        print(f"note: {m} skipped: its package is not installed (pip install 'shmeval[bench]')", file=sys.stderr)

    plan = _plan(config)
    weights = [_trial_weight(n, trial_config.seconds) for _, _, n, _ in plan]
    if config["reference"]:
        weights.append(6 * config["reference"] + 3)
    if config["batch_path"]:
        weights += [11 * config["batch_path"] + 1] * len(specs)
    progress = report.Progress(weights, trials=len(plan))
    progress.show("")

    failures: list[str] = []
    trials: list[dict[str, Any]] = []
    reference: Any = None
    batch_path: dict[str, Any] = {}
    began = time.monotonic()
    try:
        for spec, repeat, n_workers, method in plan:
            try:
                trial = run_trial(METHODS[method](), method, n_workers, spec, trial_config)
                last = f"{n_workers} x {method} {trial['throughput']:,.0f}/s"
            except Exception as e:  # recorded, reported, and the run goes on
                trial = {"method": method, "state": spec.name, "workers": n_workers, "error": str(e)}
                failures.append(f"{method} x{n_workers} ({spec.name}, repetition {repeat + 1})")
                progress.note(f"FAILED: {e}")
                last = f"{n_workers} x {method} FAILED"
            trial["repeat"] = repeat
            trials.append(trial)
            gc.collect()  # finalises the trial's queues and semaphores now, not at exit
            progress.step(f"{last} ({spec.name})")
        # After the trials, never among them: each section loads the machine
        # in its own way.
        if config["reference"]:
            def measure_reference() -> Any:
                from . import reference

                return reference.run_reference(seconds=config["reference"], state_nbytes=[s.nbytes for s in specs])

            reference = _section("reference", progress, failures, measure_reference)
        for spec in specs if config["batch_path"] else []:
            def measure_batch_path(spec: StateSpec = spec) -> Any:
                from . import batchpath

                return batchpath.run_batch_path(spec.shape, spec.policy_size, seconds=config["batch_path"])

            batch_path[spec.name] = _section(f"batch path ({spec.name})", progress, failures, measure_batch_path)
    finally:
        progress.close()
    elapsed = time.monotonic() - began

    summary = report.summarise(trials)
    for spec in specs:
        print()
        print(report.format_state_report(spec.describe(), [r for r in summary if r["state"] == spec.name],
                                         config["methods"], config["workers"], config["repeats"],
                                         trial_config.seconds))
    versus: list[dict[str, Any]] = []
    if isinstance(reference, dict) and "error" not in reference:
        from . import reference as reference_section

        print()
        print(reference_section.format_reference(reference))
        versus = report.versus_reference(summary, reference, int(machine.get("cpus_usable") or os.cpu_count() or 1))
        if versus:
            print()
            print(report.format_versus_reference(versus))
    for name, rows in batch_path.items():
        if isinstance(rows, list):
            from . import batchpath

            print()
            print(batchpath.format_batch_path(rows, name))

    if args.plot:
        try:
            report.plot(args.plot, trials, summary, [(s.name, s.describe()) for s in specs], config["methods"])
            print(f"\nplot: {args.plot}")
        except Exception as e:
            failures.append("plot")
            print(f"error: could not draw the plot: {e}", file=sys.stderr)

    leftovers = sorted(dev_shm_entries() - shm_before - mapped_by_others())
    print(f"\nwall time {format_duration(elapsed)}; new entries in /dev/shm: {', '.join(leftovers) or 'none'}")
    if failures:
        print(f"FAILED: {', '.join(failures)}")
    if args.json:
        write_json(args.json, {"machine": machine, "config": config, "trials": trials,
                               "summary": summary, "reference": reference, "versus_reference": versus,
                               "batch_path": batch_path, "failures": failures,
                               "dev_shm_leftovers": leftovers, "wall_s": elapsed})
        print(f"raw results: {args.json}")
    return 1 if failures or leftovers else 0
