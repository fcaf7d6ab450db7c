"""The ``shmeval`` command: ``selfplay``, ``bench``, ``demo``, ``stats``, ``cleanup``."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List, Optional

from . import segment


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


def cmd_selfplay(args: argparse.Namespace) -> int:
    from . import selfplay

    return selfplay.main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import cli as bench_cli

    return bench_cli.run(args)


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
    p = argparse.ArgumentParser(prog="shmeval", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("selfplay", help="Connect Four self-play with a TensorFlow net: "
                        "shmeval against a Queue evaluator and per-worker models")
    from .selfplay import add_arguments
    add_arguments(sp)
    sp.set_defaults(func=cmd_selfplay)
    b = sub.add_parser("bench", help="round trips/s and latency of shmeval against multiprocessing.Queue, "
                       "Pipe, faster-fifo and a lock-and-semaphore server, with the machine's reference figures",
                       description="Round trips through every method, the machine's reference figures and "
                       "the evaluator's batch path; 'shmeval bench --quick' takes under a minute.")
    from .bench.cli import add_arguments as add_bench_arguments
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)
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
