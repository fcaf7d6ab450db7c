"""``shmeval selfplay``'s run: the modes one after the other (in rounds
with ``--repeats``), the learner with ``--train``, the summary printed, the
results and games written.

All modes use the same seeded initial weights, the same number of games
per worker and of simulations per move.  The central evaluators (``shmeval``
and ``queue``) run TensorFlow with ``evaluator_threads`` intra- and
inter-op threads; by default from the CPUs: for shmeval the CPUs its
evaluator may use split between the calls it keeps in flight (its calls
already run side by side; TensorFlow's pools would make each slower and
costlier), TensorFlow's default pools (one thread per CPU) for queue (its
one evaluator thread reaches the other CPUs only through them).

A comparison runs every mode with a cache or every mode without one (each
mode's one cache: :meth:`Settings.cache_of`); a mix is refused before
anything starts (:func:`~shmeval.selfplay.report.mixed_caches`).

Moves/s and evals/s are measured over a window that opens ``warmup``
seconds after every worker has started playing and lasts ``seconds``.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

from .._util.display import Display
from .._util.jsonout import write_json
from .._util.machine import machine_info
from .learner import Learner
from .mode_run import ModeRun
from .modes import MODE_CLASSES
from .records import GameStore, load_games, save_games
from .replay_buffer import ReplayBuffer
from .report import (caches_line, combine_runs, device_lines, format_table, like_for_like_phrase,
                     mixed_caches, ratios, round_ratios)
from .settings import MODES, Settings

#: CPU cores used by other programs in a window above which the summary warns.
OTHER_LOAD_WARN = 0.2


def win_rate_line(matches: List[Dict[str, Any]]) -> str:
    """The summary of ``--eval-every``: the net's first and last score
    against the rollout MCTS (wins plus half the draws, per game)."""
    if not matches:
        return "arena: no match finished (a match takes longer than the run?)"
    first, last = matches[0], matches[-1]

    def score(m: Dict[str, Any]) -> str:
        return (f"{m['score']:.2f} ({m['wins']}-{m['draws']}-{m['losses']}, model "
                f"v{m['version_max']}, at {m['t_s']:.0f} s)")

    return (f"arena: {len(matches)} matches of {first['games']} games against a plain MCTS "
            f"with random rollouts; the net's score {score(first)} -> {score(last)}")


def run(s: Settings, modes: Sequence[str], display: Optional[Display] = None,
        games_path: Optional[str] = None, load_games_path: Optional[str] = None,
        json_path: Optional[str] = None) -> Dict[str, Any]:
    """Runs ``modes`` one after the other with settings ``s``; prints the
    live status and the summary; returns everything the JSON holds."""
    s.check()
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if s.pipeline > 1 and list(modes) != ["shmeval"]:
        raise ValueError("--pipeline searches through Client.submit: the shmeval mode only "
                         "(no --mode or --compare)")
    caches = {m: MODE_CLASSES[m](s).cache() for m in modes}
    problem = mixed_caches(caches) if len(modes) > 1 else None
    if problem:
        raise ValueError(problem)
    if s.local_cache and all(c.kind == "shared" for c in caches.values()):
        raise ValueError("--local-cache is the cache of the modes without the shared one, and "
                         "shmeval's shared cache is on: add --cache 0 to give shmeval's workers "
                         "a cache each instead")
    if s.train and list(modes) != ["shmeval"]:
        raise ValueError("--train runs in shmeval mode only (the learner pushes its weights "
                         "into the shmeval evaluator)")
    display = display or Display()
    began = time.monotonic()
    machine = machine_info(tensorflow=("tensorflow", "tensorflow-cpu"), keras=("keras",))
    store = GameStore()
    buffer: Optional[ReplayBuffer] = None
    learner: Optional[Learner] = None
    if importlib.util.find_spec("tensorflow") is None:
        raise ValueError("the self-play demo needs TensorFlow: pip install 'shmeval[tensorflow]'")
    if load_games_path and not s.train:
        raise ValueError("--load-games seeds the learner's replay buffer: use it with --train")
    loaded = load_games(load_games_path) if load_games_path else None
    net = s.net
    central = {m: MODE_CLASSES[m](s).tf_threads() for m in ("shmeval", "queue")}
    display.line(
        f"shmeval selfplay: Connect Four, {s.workers} workers x "
        + (f"{s.pipeline} pipelined groups of " if s.pipeline > 1 else "")
        + f"{s.games_per_worker} games, "
        f"{s.simulations} simulations/move; net {net.blocks} residual blocks x {net.filters} "
        f"filters; modes {', '.join(modes)}; {s.seconds:g} s each after {s.warmup:g} s warm-up; "
        f"central evaluators' TF threads: shmeval {central['shmeval'] or 'default'}, "
        f"queue {central['queue'] or 'default'}; workers "
        f"{'under SCHED_BATCH' if s.worker_policy() == 'batch' else 'scheduled normally'}"
        f"; weights "
        f"{'folded into the graph' if s.freeze else 'in variables'}; net in "
        + ", ".join(f"{m} {MODE_CLASSES[m](s).precision()}" for m in modes)
        + ("; central evaluator pinned to its own CPU" if s.pin else ""))
    display.line(caches_line(caches))
    sim = s.sim()
    if sim is not None:
        display.line(f"device: a simulated GPU ({sim}: {sim.call_us:g} us per call + "
                     f"{sim.row_us:g} us per row, one call at a time, shared by every process "
                     f"of a mode's run; the answers from the real net on the CPU)")
    if s.train:
        buffer = ReplayBuffer(s.buffer_size)
        if loaded is not None:
            buffer.add_games(loaded)
        display.line(f"learner: builds the net in this process (TensorFlow, "
                     f"{s.learner_threads or 'default'} thread(s)), minibatches of "
                     f"{s.batch_size}, pushes weights every {s.push_every:g} s; replay buffer "
                     f"seeded with {len(buffer):,} samples")
        learner = Learner(s, buffer)
        if s.eval_every:
            display.line(f"arena: every {s.eval_every:g} s, {s.eval_games} games of the current "
                         f"net against a plain MCTS with uniform priors and random rollouts, "
                         f"{s.simulations} simulations/move each")
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
    for round_ in range(s.repeats):
        if s.repeats > 1:
            display.line(f"round {round_ + 1} of {s.repeats}")
        for mode in modes:
            r = ModeRun(mode, s, display, store, buffer, learner).run()
            runs[mode].append(r)
            if r["tensorflow_in_workers"] and MODE_CLASSES[mode].central:
                display.line(f"warning: {r['tensorflow_in_workers']} {mode} workers "
                             "imported TensorFlow")
    results = {m: combine_runs(rs) for m, rs in runs.items()}
    wall = time.monotonic() - began
    display.line()
    if s.repeats > 1:
        display.line(f"medians [min-max] of {s.repeats} runs per mode")
    display.line(format_table(results, s.workers))
    busy = [m for m, r in results.items() if r["cpu"]["other_cores"] > OTHER_LOAD_WARN]
    if busy:
        display.line(f"warning: other programs kept the CPUs busy during the window of "
                     f"{', '.join(busy)} ('other load', in cores): those figures are skewed")
    if sim is not None:
        for line in device_lines(results):
            display.line(line)
    shm_ratios = ratios(results)
    if shm_ratios:
        display.line(f"ratios ({'simulated GPU, ' if sim is not None else ''}"
                     f"{like_for_like_phrase(caches)}): "
                     + "; ".join(f"{k} {v:.2f}x" for k, v in shm_ratios.items()))
    paired = round_ratios(runs)
    if paired:
        display.line("round by round: " + "; ".join(
            f"{k} " + " ".join("-" if v is None else f"{v:.2f}x" for v in vs)
            for k, vs in paired.items()))
    for mode, r in results.items():
        if "train" in r:
            t = r["train"]
            lf, ll = t["loss_first"], t["loss_last"]
            display.line(f"learner: {t['steps']} steps of {t['batch_size']}, {t['pushes']} weight "
                         f"pushes, model version {r['model_version']}, loss "
                         + (f"{lf:.3f} (first 10 steps) -> {ll:.3f} (last 10)"
                            if lf is not None and ll is not None else "- (no training step)"))
        elif mode == "shmeval":
            display.line(f"shmeval workers that imported TensorFlow: "
                         f"{r['tensorflow_in_workers']} of {s.workers}")
        if "win_rate" in r:
            display.line(win_rate_line(r["win_rate"]))
    out: Dict[str, Any] = {
        "settings": {**asdict(s), "modes": list(modes)}, "machine": machine,
        "caches": {m: c.to_json() for m, c in caches.items()},
        "modes": results, "ratios": shm_ratios, "round_ratios": paired, "wall_s": wall,
        "games_received": len(store), "loaded_samples": len(loaded) if loaded is not None else 0}
    if games_path:
        meta = {"settings": out["settings"], "machine": machine}
        save_games(games_path, store.to_games(meta))
        display.line(f"games: {len(store):,} finished games, {sum(len(m) for m in store.moves):,} "
                     f"positions -> {games_path}")
        out["games_path"] = games_path
    if json_path:
        write_json(json_path, out)
        display.line(f"results: {json_path}")
    display.line(f"wall time {wall:.0f} s")
    return out
