"""The ``shmeval`` command: ``selfplay``, ``bench``, ``demo``, ``stats``, ``cleanup``."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, List, Optional

from . import segment


@dataclass(frozen=True)
class Application:
    """A subcommand that lives in its own package, behind its own extra.

    Its module is imported only once the subcommand is chosen, so that
    ``shmeval stats`` and ``shmeval cleanup`` load neither the applications
    nor a framework.  The module adds the subcommand's arguments
    (``add_arguments(parser)``) and runs it (``entry(args)``, the exit code).
    """

    module: str
    entry: str
    extra: str
    # Modules the extra installs that the subcommand cannot run without,
    # checked once the arguments are parsed (so --help works without them).
    requires: tuple[str, ...]
    help: str
    description: Optional[str] = None


APPLICATIONS = {
    "selfplay": Application(
        "shmeval.selfplay", "main", "selfplay", ("tensorflow",),
        help="Connect Four self-play with a TensorFlow net: shmeval against a Queue evaluator and "
        "per-worker models"),
    "bench": Application(
        "shmeval.bench.cli", "run", "bench", (),
        help="round trips/s and latency of shmeval against multiprocessing.Queue, Pipe, faster-fifo and "
        "a lock-and-semaphore server, with the machine's reference figures",
        description="Round trips through every method, the machine's reference figures and the "
        "evaluator's batch path; 'shmeval bench --quick' takes under a minute."),
}


def _install_hint(app: Application, missing: str) -> str:
    return f"needs: pip install 'shmeval[{app.extra}]' ({missing} missing)"


def _import_application(app: Application) -> ModuleType:
    try:
        return importlib.import_module(app.module)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] == "shmeval":
            raise  # shmeval itself is broken: not a missing extra
        sys.exit(_install_hint(app, e.name))


def run_application(name: str, argv: List[str]) -> int:
    """``shmeval NAME ARGV...`` for an application: its module parses argv."""
    app = APPLICATIONS[name]
    module = _import_application(app)
    parser = argparse.ArgumentParser(prog=f"shmeval {name}", description=app.description)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    for required in app.requires:
        if importlib.util.find_spec(required) is None:
            sys.exit(_install_hint(app, required))
    return int(getattr(module, app.entry)(args))


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    print(f"shmeval demo: {args.workers} worker processes -> one evaluator (TinyNet, NumPy), "
          f"{args.seconds:g} s ...", flush=True)
    r = demo.run(args.workers, args.seconds, args.max_batch)
    s = r["stats"]
    print(f"round trips/s      {r['round_trips_per_s']:,.0f}")
    print(f"latency p50 / p99  {r['p50_us']:.1f} / {r['p99_us']:.1f} µs")
    print(f"mean batch         {r['mean_batch']:.2f}   (batches: {s['batches']:,})")
    print(f"slowest worker     {r['slowest_worker_share']:.2f} x the mean worker")
    print(f"model time share   {s['model_time_share']:.0%} of the evaluator's uptime")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2, default=str)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from .client import connect

    _print_json(connect(args.address).stats())
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    segs = segment.list_segments()
    for s in segs:
        pid = s["owner_pid"]
        state = ("owner unknown, kept" if not pid else
                 "alive" if s["owner_alive"] else "DEAD")
        uid = s["uid"]
        print(f"{s['address']}  owner {pid or '?'} {state}  "
              f"uid {uid}  {s['bytes']:,} bytes")
    errors: dict[str, str] = {}
    removed = segment.cleanup_stale(dry_run=args.dry_run, errors=errors)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(removed)} stale segment(s)")
    for address, why in sorted(errors.items()):
        print(f"could not remove {address}: {why}")
    print("shmeval creates no named semaphores or other named objects (its doorbells "
          "are futex words inside the segment): there is nothing else to clean up")
    return 1 if errors else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in APPLICATIONS:
        return run_application(argv[0], argv[1:])
    p = argparse.ArgumentParser(prog="shmeval", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, app in APPLICATIONS.items():
        # Listed for `shmeval --help`; their arguments are parsed by
        # run_application, above.
        sub.add_parser(name, help=app.help)
    d = sub.add_parser("demo", help="round trips through a NumPy model from N processes")
    d.add_argument("--workers", type=int, default=8)
    d.add_argument("--seconds", type=float, default=5.0)
    d.add_argument("--max-batch", type=int, default=256)
    d.add_argument("--json", metavar="PATH")
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("stats", help="print an evaluator's statistics")
    s.add_argument("address")
    s.set_defaults(func=cmd_stats)
    c = sub.add_parser("cleanup", help="list shmeval segments in /dev/shm and remove those "
                       "of dead owners (the only named objects shmeval creates)")
    c.add_argument("--dry-run", action="store_true")
    c.set_defaults(func=cmd_cleanup)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
