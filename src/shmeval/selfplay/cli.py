"""``shmeval selfplay``'s command line: :func:`add_arguments` builds the
parser, :func:`main` runs it and returns the exit code."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import replace
from typing import Any, List

from .._util.display import Display
from .._util.simdevice import DEFAULT_CALL_US, DEFAULT_ROW_US, parse_device
from ..games.connect4_net import NetConfig
from .errors import WorkerError
from .runner import run
from .settings import COMPARE_MODES, MODES, Settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    n = NetConfig()
    p.add_argument("--mode", choices=MODES, default="shmeval",
                   help="how the workers reach the net (default shmeval)")
    p.add_argument("--compare", nargs="?", const=list(COMPARE_MODES), type=_modes,
                   metavar="MODES",
                   help=f"run several modes one after the other, same settings: MODES "
                        f"comma-separated or all (default {','.join(COMPARE_MODES)}: local, "
                        f"one net call per leaf, only when named; it adds about half a minute "
                        f"of start-up). Every mode runs without a cache unless --cache and "
                        f"--local-cache give each one (a mix is refused)")
    p.add_argument("--workers", type=int, default=d.workers,
                   help=f"worker processes playing games (default {d.workers})")
    p.add_argument("--games-per-worker", type=int, default=d.games_per_worker,
                   help=f"games each worker plays at once, leaves evaluated together "
                        f"(default {d.games_per_worker})")
    p.add_argument("--simulations", type=int, default=d.simulations,
                   help=f"MCTS simulations per move (default {d.simulations})")
    p.add_argument("--pipeline", type=int, default=d.pipeline, metavar="K",
                   help="shmeval mode: K groups of --games-per-worker games per worker, each "
                        "searched while the others' leaves are evaluated (default 1: the "
                        "blocking search; see docs/selfplay.md)")
    p.add_argument("--cache", type=int, metavar="N",
                   help="shmeval mode: a shared evaluation cache of N entries (a power of "
                        "two; 0: none), consulted by every worker before it sends a position "
                        f"(default {d.cache:,}, 16 MiB; with --compare 0; see docs/selfplay.md)")
    p.add_argument("--local-cache", type=int, default=d.local_cache, metavar="N",
                   help="a cache of N entries in each worker, the scheme of engines that run "
                        "one search per process: in every mode but shmeval with its shared "
                        "cache (--cache 0 gives shmeval this one too; default: none)")
    p.add_argument("--seconds", type=float, default=d.seconds,
                   help=f"measured window per mode (default {d.seconds:g})")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="run each mode this many times (with --compare: in rounds, "
                        "shmeval, queue, local-batched, shmeval, ...) and report medians "
                        "(default 1)")
    p.add_argument("--warmup", type=float, default=d.warmup,
                   help=f"seconds of play before the window opens (default {d.warmup:g})")
    p.add_argument("--seed", type=int, default=d.seed, help="initial weights and games (default 0)")
    p.add_argument("--evaluator-threads", type=int, default=d.evaluator_threads,
                   help="TensorFlow intra- and inter-op threads of the central evaluators "
                        "(0: TensorFlow's default; default: from the CPUs, each mode's way, "
                        "see docs/selfplay.md)")
    p.add_argument("--serving-threads", type=_auto_or_int, default=d.serving_threads,
                   help="shmeval mode: model calls the evaluator runs at once, or auto "
                        "(the default): one or two, whichever its tuner measures serving more")
    p.add_argument("--worker-sched", choices=("auto", "normal", "batch"), default=d.worker_sched,
                   help="the workers' scheduling policy: batch is SCHED_BATCH, auto (the "
                        "default) batch when the workers outnumber the CPUs")
    p.add_argument("--no-freeze", action="store_true",
                   help="keep the net's weights in variables instead of folding them into "
                        "the graph (slower calls; see docs/selfplay.md)")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default=d.precision,
                   help="what the frozen net computes in; auto (the default) picks bfloat16 "
                        "for batched calls on CPUs with native bfloat16 (docs/selfplay.md)")
    p.add_argument("--pin", action="store_true",
                   help="give the central evaluator a CPU of its own, the workers the others")
    p.add_argument("--device", type=_device, default=d.device, metavar="cpu|sim[:CALL_US,ROW_US]",
                   help=f"cpu (the default): the net as it is; sim: every mode's net calls go "
                        f"through one simulated GPU shared by all the run's processes, one call "
                        f"at a time, each costing CALL_US + ROW_US x rows microseconds (default "
                        f"{DEFAULT_CALL_US:g} and {DEFAULT_ROW_US:g}, an H100-class GPU's for "
                        f"this net); the answers still come from the real net "
                        f"(docs/selfplay.md, A simulated GPU)")
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"most rows per model call of the central evaluators (default {d.max_batch})")
    p.add_argument("--blocks", type=int, default=n.blocks, help=f"residual blocks (default {n.blocks})")
    p.add_argument("--filters", type=int, default=n.filters,
                   help=f"conv filters (default {n.filters})")
    p.add_argument("--json", metavar="PATH", help="write settings, machine and results here")
    p.add_argument("--games", metavar="PATH.npz", help="save the finished games here")
    p.add_argument("--train", action="store_true",
                   help="shmeval mode: train the net on the games in this process and push the "
                        "weights into the running evaluator")
    p.add_argument("--push-every", type=float, default=d.push_every,
                   help=f"seconds between weight pushes (default {d.push_every:g})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"learner minibatch (default {d.batch_size})")
    p.add_argument("--buffer-size", type=int, default=d.buffer_size,
                   help=f"replay buffer samples (default {d.buffer_size:,})")
    p.add_argument("--sample-reuse", type=float, default=d.sample_reuse,
                   help=f"the learner trains while the samples have been drawn fewer than "
                        f"this many times on average (default {d.sample_reuse:g})")
    p.add_argument("--learning-rate", type=float, default=n.learning_rate,
                   help=f"the learner's Adam learning rate (default {n.learning_rate:g})")
    p.add_argument("--load-games", metavar="PATH.npz",
                   help="seed the replay buffer with games saved by --games")
    p.add_argument("--eval-every", type=float, default=d.eval_every, metavar="SECONDS",
                   help="with --train: every this many seconds, play the current net against "
                        "a plain MCTS with random rollouts and record the win rate (default: "
                        "never)")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="play on a Ray cluster (needs shmeval[ray]): one evaluator per node, "
                        "--workers worker actors per node, --train pushing to every node; "
                        "without ADDRESS on a cluster simulated on this machine")
    p.add_argument("--nodes", type=int,
                   help="with --ray: the simulated cluster's nodes (default 2), or with "
                        "ADDRESS the nodes to wait for (default: those there)")
    p.add_argument("--eval-games", type=int, default=d.eval_games,
                   help=f"games per --eval-every match, the net first in half of them "
                        f"(default {d.eval_games})")


def _device(text: str) -> str:
    """``--device``, as the settings record it ("sim" with its costs)."""
    try:
        spec = parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return "cpu" if spec is None else str(spec)


def _auto_or_int(text: str) -> "int | str":
    return text if text == "auto" else int(text)


def _modes(text: str) -> List[str]:
    """``--compare``'s MODES: comma-separated names, or all."""
    if text == "all":
        return list(MODES)
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from "
            f"{', '.join(MODES)} or all")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a mode named twice in {text!r}")
    return modes


def settings_from_args(args: argparse.Namespace) -> Settings:
    net = replace(NetConfig(), blocks=args.blocks, filters=args.filters,
                  learning_rate=args.learning_rate)
    return Settings(workers=args.workers, games_per_worker=args.games_per_worker,
                    simulations=args.simulations, pipeline=args.pipeline,
                    cache=(args.cache if args.cache is not None
                           else 0 if args.compare else Settings.cache),
                    local_cache=args.local_cache,
                    seconds=args.seconds, warmup=args.warmup,
                    repeats=args.repeats,
                    seed=args.seed, evaluator_threads=args.evaluator_threads,
                    serving_threads=args.serving_threads, worker_sched=args.worker_sched,
                    freeze=not args.no_freeze, precision=args.precision,
                    max_batch=args.max_batch, pin=args.pin, device=args.device, net=net,
                    train=args.train,
                    push_every=args.push_every, batch_size=args.batch_size,
                    buffer_size=args.buffer_size, sample_reuse=args.sample_reuse,
                    eval_every=args.eval_every, eval_games=args.eval_games)


def _run_on_ray(args: argparse.Namespace, s: Settings, modes: list[str],
                display: Display) -> None:
    """``--ray``: the shmeval mode on a Ray cluster (shmeval.ray.selfplay)."""
    if modes != ["shmeval"]:
        raise ValueError("--ray plays in the shmeval mode only (no --mode or --compare)")
    if s.sim() is not None:
        raise ValueError("--device sim is one device on this machine: not with --ray")
    if s.pipeline > 1:
        raise ValueError("--ray plays the blocking search (no --pipeline)")
    try:
        from ..ray.selfplay import run_on_ray
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] == "shmeval":
            raise
        raise ValueError(f"--ray needs: pip install 'shmeval[ray]' ({e.name} missing)") from None
    run_on_ray(s, display, args.ray or None, args.nodes, games_path=args.games,
               load_games_path=args.load_games, json_path=args.json)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(args: argparse.Namespace) -> int:
    """``shmeval selfplay``: returns the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # inherited by every child
    modes = args.compare or [args.mode]
    display = Display()
    try:
        s = settings_from_args(args)
        s.check()
    except ValueError as e:
        print(f"shmeval selfplay: {e}", file=sys.stderr)
        return 2
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.ray is not None:
            _run_on_ray(args, s, modes, display)
        else:
            run(s, modes, display, games_path=args.games, load_games_path=args.load_games,
                json_path=args.json)
    except KeyboardInterrupt:
        display.end_status()
        print("\ninterrupted: every process stopped", file=sys.stderr)
        return 130
    except (WorkerError, ValueError) as e:
        display.end_status()
        print(f"\nshmeval selfplay failed: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    return 0
