"""The ``shmeval`` command: ``selfplay``, ``bench``, ``metrics``, ``plot``,
``demo``, ``ls``, ``stats``, ``cleanup``.  A shmeval error ends any of them
with one line on stderr and exit code 1, not a traceback."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, List, Optional

from . import segment
from .errors import ShmevalError

DESCRIPTION = ("Batched neural-network evaluation for many processes over shared memory: "
               "the self-play demo, the benchmark suite, and tools to look at and clean up "
               "running evaluators.")


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
    "metrics": Application(
        "shmeval.monitor.prometheus", "main", "monitor", ("prometheus_client",),
        help="serve a running evaluator's counters and histograms to Prometheus over HTTP",
        description="Serves the evaluator's counters, histograms and gauges in Prometheus' text "
        "format, read from its segment at each scrape, until Ctrl-C or the evaluator stops."),
    "plot": Application(
        "shmeval.monitor.plot", "main", "monitor", ("matplotlib",),
        help="draw the time series of a 'shmeval selfplay --json' run to a PNG"),
}

#: ``shmeval stats ADDRESS --watch``: the live view, behind the same extra as
#: the other monitoring commands.
WATCH = Application("shmeval.monitor.watch", "watch", "monitor", ("rich",),
                    help="a live view of a running evaluator")


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
    """Strict JSON: NaN and inf as null."""
    print(json.dumps(_nan_to_null(obj), indent=2, default=str, allow_nan=False))


def _nan_to_null(obj: Any) -> Any:
    """``obj`` with every float that strict JSON cannot spell (NaN, inf)
    as None, in nested dicts, lists and tuples: ``stats()`` reports a
    percentile of nothing measured yet as NaN, and strict parsers reject a
    bare ``NaN``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _nan_to_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_null(v) for v in obj]
    return obj


def cmd_demo(args: argparse.Namespace) -> int:
    from .bench import demo

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
    if args.address is None:
        if args.watch:
            sys.exit("shmeval stats: --watch needs an evaluator's address (see shmeval ls)")
        return cmd_ls(args)
    if args.watch:
        if not args.interval > 0:
            sys.exit(f"shmeval stats: --interval must be > 0, got {args.interval:g}")
        return int(getattr(_import_application(WATCH), WATCH.entry)(args.address, args.interval))
    from .client import connect

    _print_json(connect(args.address).stats())
    return 0


def live_evaluators() -> list[dict[str, Any]]:
    """This user's evaluators whose owner is alive, each with its address,
    owner, serving process, state, uptime, clients and requests; a segment
    that cannot be read says why under "error"."""
    import os

    from .client import connect

    found = []
    for s in segment.list_segments():
        if s["uid"] != os.geteuid() or not s["owner_alive"]:
            continue
        row: dict[str, Any] = {"address": s["address"], "owner_pid": s["owner_pid"]}
        try:
            client = connect(str(s["address"]))
            st = client.stats()
            row.update(pid=client._attach().replicas()[0]["pid"] or None, state=st["state"],
                       uptime_s=st["uptime_s"], clients=st["clients"],
                       requests=st["requests"], mean_batch=st["mean_batch"])
        except ShmevalError as e:
            row["error"] = str(e)
        found.append(row)
    return found


def cmd_ls(args: argparse.Namespace) -> int:
    rows = live_evaluators()
    if getattr(args, "json", False):
        _print_json(rows)
        return 0
    if not rows:
        print("no running evaluator of this user")
        return 0
    print(f"{'address':<38} {'owner':>7} {'pid':>7} {'state':<8} {'uptime':>9} "
          f"{'clients':>7} {'requests':>12} {'mean batch':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['address']:<38} {r['owner_pid']:>7}  cannot read it: {r['error']}")
            continue
        print(f"{r['address']:<38} {r['owner_pid']:>7} {r['pid'] or '-':>7} {r['state']:<8} "
              f"{r['uptime_s']:>8.0f}s {r['clients']:>7} {r['requests']:>12,} "
              f"{r['mean_batch']:>10.1f}")
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
    try:
        if argv and argv[0] in APPLICATIONS:
            return run_application(argv[0], argv[1:])
        args = parser().parse_args(argv)
        return int(args.func(args))
    except ShmevalError as e:
        name = argv[0] if argv else ""
        print(f"shmeval {name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def parser() -> argparse.ArgumentParser:
    """The parser of every subcommand but the applications', which parse
    their own arguments (run_application)."""
    p = argparse.ArgumentParser(prog="shmeval", description=DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, app in APPLICATIONS.items():
        # Listed for `shmeval --help`; their arguments are parsed by
        # run_application, above.
        sub.add_parser(name, help=app.help)
    d = sub.add_parser("demo", help="round trips through a NumPy model from N processes")
    d.add_argument("--workers", type=int, default=8, help="worker processes (default 8)")
    d.add_argument("--seconds", type=float, default=5.0,
                   help="how long the workers send requests (default 5)")
    d.add_argument("--max-batch", type=int, default=256,
                   help="most requests per model call (default 256)")
    d.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    d.set_defaults(func=cmd_demo)
    ls = sub.add_parser("ls", help="list this user's running evaluators: owner, serving process, "
                        "state, uptime, clients, requests")
    ls.add_argument("--json", action="store_true", help="print them as JSON")
    ls.set_defaults(func=cmd_ls)
    s = sub.add_parser("stats", help="print an evaluator's statistics as JSON (without an "
                       "address: list the running evaluators, as ls does)")
    s.add_argument("address", nargs="?",
                   help="the evaluator's address, e.g. /shmeval-4242-9f0c1e2d3b4a5968 "
                   "(ev.address; see shmeval ls)")
    s.add_argument("--watch", action="store_true",
                   help="show a live view, redrawn every interval, until Ctrl-C or the "
                   "evaluator stops (needs the [monitor] extra)")
    s.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="with --watch: seconds between two views (default 1)")
    s.set_defaults(func=cmd_stats)
    c = sub.add_parser("cleanup", help="list shmeval segments in /dev/shm and remove those "
                       "of dead owners (the only named objects shmeval creates)")
    c.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    c.set_defaults(func=cmd_cleanup)
    return p


if __name__ == "__main__":
    sys.exit(main())
