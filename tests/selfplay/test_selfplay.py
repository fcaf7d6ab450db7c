"""The self-play demo, ``shmeval selfplay``.

- one short run per mode (shmeval, queue, local, local-batched) through the
  CLI in a subprocess: exit code 0, the JSON has the figures and settings,
  the games file reads back with load_games and every game replays to the
  stored states, policies and outcomes; every mode served the same initial
  weights (the probe positions evaluate alike, with the weights folded
  into the graph or, in local-batched, in variables); shmeval and queue workers
  never imported TensorFlow;
- a short --train run seeded with saved games: weights pushed, the model
  version went up, the loss recorded;
- Ctrl-C stops a run and every process it started; a dead evaluator is
  reported with the worker's error;
- in-process, without TensorFlow: replay, replay buffer (ring, mirror
  augmentation), save/load round trip and corrupt files, the display,
  argument errors.

The runs are shared by the tests that check them (module-scoped, run on
first use).  Nothing here imports TensorFlow into the pytest process.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

from shmeval import selfplay
from shmeval._util.display import Display
from shmeval._util.procstat import rss_mb
from shmeval.backends import _device
from shmeval.selfplay import report, settings
from shmeval.selfplay.modes import MODE_CLASSES
from shmeval.selfplay.pinning import cpu_split
from shmeval.games import connect4 as c4
from test_progress import check_training_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT = 180
WORKERS = 2
GAMES_PER_WORKER = 2
#: Short games and a 2 s window: every mode finishes games in it even on a
#: crowded machine (each run's game records are checked).
SIMULATIONS = 4
TINY = ["--workers", str(WORKERS), "--games-per-worker", str(GAMES_PER_WORKER),
        "--simulations", str(SIMULATIONS), "--seconds", "2", "--warmup", "0.5"]
REQUIRED = ("moves_per_s", "evals_per_s", "mean_batch", "worker_rss_mb", "games", "startup_s",
            "tensorflow_in_workers", "probe", "cpu", "precision")


def _env() -> Dict[str, str]:
    # The installed package (editable or not), as the tests import it: never
    # src/ itself, which holds no built extension after a plain `pip install .`.
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _cli(args: List[str], timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmeval", "selfplay", *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


class Runs:
    """Runs each mode once, on first use; keeps (json, games path, output)."""

    def __init__(self, tmp: Any) -> None:
        self.tmp = tmp
        self.done: Dict[str, Tuple[Dict[str, Any], str, str]] = {}

    def get(self, mode: str) -> Tuple[Dict[str, Any], str, str]:
        if mode not in self.done:
            js = str(self.tmp / f"{mode}.json")
            npz = str(self.tmp / f"{mode}.npz")
            # queue: pinned, float32 (shmeval and local: the default
            # precision, bfloat16 for shmeval on CPUs with native bfloat16);
            # local-batched: weights in variables (the probe test then
            # also shows frozen and unfrozen nets agree).
            extra = {"shmeval": ["--worker-sched", "batch"],
                     "queue": ["--pin", "--precision", "float32"],
                     "local-batched": ["--no-freeze"]}.get(mode, [])
            r = _cli(["--mode", mode, *TINY, *extra, "--json", js, "--games", npz])
            assert r.returncode == 0, r.stdout + r.stderr
            with open(js) as f:
                self.done[mode] = (json.load(f), npz, r.stdout + r.stderr)
        return self.done[mode]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Runs:
    return Runs(tmp_path_factory.mktemp("selfplay"))


def check_games(g: selfplay.Games, mode: str, workers: int = WORKERS) -> None:
    """Every stored game replays to its states; policies, outcomes, winners
    and moves agree with the rules; each position is stored once."""
    assert g.n_games >= 1 and len(g) == int(g.offsets[-1]) == len(g.moves)
    assert g.states.shape == (len(g), 6, 7, 2) and g.states.dtype == np.float32
    assert g.policies.shape == (len(g), 7) and g.outcomes.shape == (len(g),)
    np.testing.assert_allclose(g.policies.sum(axis=1), 1.0, atol=1e-5)
    assert (g.policies >= 0).all()
    assert set(np.unique(g.outcomes)) <= {-1.0, 0.0, 1.0}
    assert set(g.mode.tolist()) == {mode}
    assert set(g.worker.tolist()) <= set(range(workers))
    for i in range(g.n_games):
        lo, hi = int(g.offsets[i]), int(g.offsets[i + 1])
        s = c4.initial()
        for row, a in zip(range(lo, hi), g.game_moves(i)):
            np.testing.assert_array_equal(g.states[row], c4.encode(s))
            legal = c4.legal_mask(s)
            assert not g.policies[row][~legal].any(), "visits to an illegal move"
            assert g.policies[row][a] > 0, "a move the search never visited was played"
            sign = 1 if c4.to_move(s) == 0 else -1
            assert g.outcomes[row] == sign * g.winner[i]
            assert g.ply[row] == row - lo and g.game[row] == i
            s = c4.play(s, a)
        assert c4.winner(s) == g.winner[i], "the stored winner is not the game's"
    # One copy per position: as many samples as moves played, no mirrored extras.
    assert len(g) == sum(len(g.game_moves(i)) for i in range(g.n_games))


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("mode", ["shmeval", "queue", "local", "local-batched"])
def test_mode_runs_and_reports(runs: Runs, mode: str) -> None:
    out, npz, text = runs.get(mode)
    r = out["modes"][mode]
    for key in REQUIRED:
        assert key in r, key
    assert r["moves_per_s"] > 0 and r["evals_per_s"] > 0 and r["worker_rss_mb"] > 0
    assert r["evals_per_s"] >= r["moves_per_s"]   # at least one evaluation per move
    assert 1.0 <= r["mean_batch"] <= WORKERS * GAMES_PER_WORKER
    if mode == "local":
        assert r["mean_batch"] == 1.0
    tf_workers = WORKERS if mode.startswith("local") else 0
    assert r["tensorflow_in_workers"] == tf_workers
    if mode in ("shmeval", "queue"):
        assert r["evaluator_rss_mb"] > 0 and r["evaluator"]["batches"] > 0
    # the queue run is pinned (--pin): evaluator and workers on separate CPUs
    assert r["pinned"] == (mode == "queue" and len(os.sched_getaffinity(0)) >= 2)
    st = out["settings"]
    assert ((st["workers"], st["games_per_worker"], st["simulations"])
            == (WORKERS, GAMES_PER_WORKER, SIMULATIONS))
    assert st["evaluator_threads"] is None and st["modes"] == [mode]
    # each central mode's TensorFlow threads: its own best by default
    assert r["evaluator_tf_threads"] == {"shmeval": 1, "queue": 0}.get(mode)
    # the workers' scheduling policy, as they reported it: the shmeval run
    # asks for SCHED_BATCH, the others keep "auto" (batch only when the 2
    # workers outnumber the CPUs)
    assert st["worker_sched"] == ("batch" if mode == "shmeval" else "auto")
    outnumber = WORKERS > len(os.sched_getaffinity(0))
    assert r["worker_sched"] == ("batch" if mode == "shmeval" or outnumber else "normal")
    assert st["freeze"] == (mode != "local-batched")
    assert ("weights in variables" in text) == (mode == "local-batched")
    assert out["machine"]["cpus_usable"] >= 1 and out["machine"]["tensorflow"]
    assert out["wall_s"] > 0
    assert "mode " in text and "moves/s" in text   # the summary table was printed
    g = selfplay.load_games(npz)
    check_games(g, mode)
    assert g.n_games == out["games_received"] >= r["games"]
    assert g.meta["settings"]["workers"] == WORKERS


@pytest.mark.timeout(4 * RUN_TIMEOUT)
def test_every_mode_serves_the_same_initial_weights(runs: Runs) -> None:
    probes = {m: runs.get(m)[0]["modes"][m]["probe"]
              for m in ("shmeval", "queue", "local", "local-batched")}
    precision = {m: runs.get(m)[0]["modes"][m]["precision"] for m in probes}
    assert precision["queue"] == precision["local-batched"] == precision["local"] == "float32"
    native = _device.cpu_bfloat16() and not _device.gpu_visible()
    assert precision["shmeval"] == ("bfloat16" if native else "float32")
    ref = probes["queue"]
    assert len(ref["value"]) == len(ref["policy"]) == 5
    assert np.ptp(np.array(ref["policy"])) > 1e-3   # not a trivial net
    for m, p in probes.items():
        # float32 nets agree to 1e-4; a bfloat16 one moves by about 1e-4-1e-3
        atol = 1e-4 if precision[m] == "float32" else 2e-3
        np.testing.assert_allclose(p["policy"], ref["policy"], atol=atol, err_msg=m)
        np.testing.assert_allclose(p["value"], ref["value"], atol=atol, err_msg=m)


@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_train_pushes_weights_and_records_the_loss(runs: Runs, tmp_path: Any) -> None:
    seed_npz = runs.get("shmeval")[1]
    seeded = len(selfplay.load_games(seed_npz))
    js = str(tmp_path / "train.json")
    npz = str(tmp_path / "train.npz")
    r = _cli(["--train", "--workers", "2", "--games-per-worker", "4", "--simulations", "8",
              "--seconds", "4", "--warmup", "0.5", "--push-every", "0.5", "--batch-size", "32",
              "--eval-every", "1.5", "--eval-games", "2",
              "--load-games", seed_npz, "--json", js, "--games", npz])
    assert r.returncode == 0, r.stdout + r.stderr
    with open(js) as f:
        out = json.load(f)
    m = out["modes"]["shmeval"]
    t = m["train"]
    assert out["loaded_samples"] == seeded > 0
    assert t["steps"] > 0 and t["pushes"] >= 1
    assert m["model_version"] == t["model_version"] == t["pushes"] > 0
    assert m["pushes"] == t["pushes"]
    versions = [p["version"] for p in t["pushes_log"]]
    assert versions == list(range(1, t["pushes"] + 1))
    assert np.isfinite(t["loss_first"]) and np.isfinite(t["loss_last"]) and m["loss"] == t["loss_last"]
    assert t["history"] and all(np.isfinite(h["loss"]) for h in t["history"])
    assert "loss" in r.stdout and "model version" in r.stdout
    assert out["settings"]["train"] is True
    check_games(selfplay.load_games(npz), "shmeval")
    check_training_run(Path(js), r.stdout)   # the series, the matches, the plot


def _group_members(pgid: int) -> List[str]:
    """Processes of process group ``pgid`` that are not zombies."""
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            left.append(pid)
    return left


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(RUN_TIMEOUT)
def test_ctrl_c_stops_every_process(tmp_path: Any) -> None:
    p = subprocess.Popen([sys.executable, "-m", "shmeval", "selfplay", "--mode", "queue",
                          *TINY[:-4], "--seconds", "60", "--warmup", "0.5"],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True, preexec_fn=_restore_sigint)
    try:
        assert p.stdout is not None
        seen = []
        for line in p.stdout:   # plain lines (not a TTY); the phase change is printed
            seen.append(line)
            if "measuring" in line:
                break
        assert any("measuring" in s for s in seen), "".join(seen)
        os.killpg(p.pid, signal.SIGINT)   # what Ctrl-C in a terminal does
        rest, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, "".join(seen) + rest
    assert "interrupted" in rest
    deadline = time.monotonic() + 10   # a tick for the kernel to reap the last exits
    while _group_members(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_members(p.pid) == []
    # The conftest fixture checks /dev/shm.


@pytest.mark.timeout(RUN_TIMEOUT)
def test_a_dead_evaluator_is_reported() -> None:
    p = subprocess.Popen([sys.executable, "-m", "shmeval", "selfplay", "--mode", "shmeval",
                          *TINY[:-4], "--seconds", "60", "--warmup", "0.5"],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        assert p.stdout is not None
        for line in p.stdout:
            if "measuring" in line:
                break
        # The evaluator is the child that holds TensorFlow: the largest RSS.
        kids = [int(k) for k in os.listdir("/proc") if k.isdigit() and _ppid(int(k)) == p.pid]
        evaluator = max(kids, key=lambda k: rss_mb(k) or 0.0)
        os.kill(evaluator, signal.SIGKILL)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1, err
    # The workers' EvaluatorDied, or the run's own look at the evaluator,
    # whichever sees the death first.
    assert ("worker" in err and "EvaluatorDied" in err) or \
        "evaluator is no longer serving (died: its process vanished" in err, err


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


# --------------------------------------------------------------------------- in-process


def test_replay_game() -> None:
    moves = [3, 3, 4, 4, 5, 5, 6]          # the first player wins along the bottom row
    states, outcomes, w = selfplay.replay_game(moves)
    assert w == 1 and states.dtype == np.uint8 and states.shape == (7, 6, 7, 2)
    assert outcomes.tolist() == [1, -1, 1, -1, 1, -1, 1]
    np.testing.assert_array_equal(states[2], c4.encode(c4.from_moves(moves[:2])))
    with pytest.raises(ValueError, match="not over"):
        selfplay.replay_game([3, 3])
    with pytest.raises(ValueError):
        selfplay.replay_game([0] * 7)       # the seventh stone does not fit


def _random_games(n: int, seed: int) -> selfplay.GameStore:
    rng = np.random.default_rng(seed)
    store = selfplay.GameStore()
    for i in range(n):
        s, moves, pols = c4.initial(), [], []
        while not c4.is_terminal(s):
            legal = c4.legal_moves(s)
            counts = np.zeros(7)
            counts[legal] = rng.integers(1, 9, len(legal))
            a = int(rng.choice(legal))
            moves.append(a)
            pols.append(counts / counts.sum())
            s = c4.play(s, a)
        store.add("shmeval", i % 3, moves, np.array(pols))
    return store


def test_games_round_trip(tmp_path: Any) -> None:
    store = _random_games(12, 0)
    path = str(tmp_path / "g.npz")
    selfplay.save_games(path, store.to_games({"note": "test"}))
    g = selfplay.load_games(path)
    assert g.n_games == 12 and g.meta == {"note": "test"}
    check_games(g, "shmeval", workers=3)
    # what went in comes out
    np.testing.assert_array_equal(g.states, np.concatenate(store.states).astype(np.float32))
    np.testing.assert_allclose(g.policies, np.concatenate(store.policies))
    assert [g.game_moves(i) for i in range(12)] == [m.tolist() for m in store.moves]


def test_load_games_rejects_inconsistent_files(tmp_path: Any) -> None:
    path = str(tmp_path / "g.npz")
    selfplay.save_games(path, _random_games(4, 1).to_games())
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}

    def broken(**changes: Any) -> str:
        p = str(tmp_path / f"bad-{'-'.join(changes)}.npz")
        np.savez(p, **{**arrays, **changes})
        return p

    flipped = arrays["outcomes"].copy()
    flipped[0] = -flipped[0] if flipped[0] else 1
    for bad, what in [(broken(outcomes=flipped), "outcomes"),
                      (broken(policies=arrays["policies"] * 2), "policies"),
                      (broken(offsets=arrays["offsets"][:-1]), "offsets"),
                      (broken(states=arrays["states"][1:]), "states"),
                      (broken(format=np.array("something else")), "format")]:
        with pytest.raises(ValueError, match=what):
            selfplay.load_games(bad)
    np.savez(str(tmp_path / "other.npz"), x=np.zeros(3))
    with pytest.raises(ValueError, match="not a self-play games file"):
        selfplay.load_games(str(tmp_path / "other.npz"))


def test_mirror_samples() -> None:
    s = c4.from_moves([0, 1, 1, 2, 6])
    x = c4.encode(s)[None]
    p = np.arange(7, dtype=np.float32)[None] / 21
    mx, mp_ = selfplay.mirror_samples(x, p)
    np.testing.assert_array_equal(mx[0], c4.encode(c4.mirror_state(s)))
    np.testing.assert_array_equal(mp_[0], p[0][::-1])
    back = selfplay.mirror_samples(mx, mp_)
    np.testing.assert_array_equal(back[0], x)
    np.testing.assert_array_equal(back[1], p)


def test_replay_buffer_ring_and_augmentation() -> None:
    store = _random_games(10, 2)
    states = np.concatenate(store.states)
    pols = np.concatenate(store.policies)
    outs = np.concatenate(store.outcomes).astype(np.float32)
    n = len(states)
    buf = selfplay.ReplayBuffer(capacity=n - 5)
    buf.add(states[:10], pols[:10], outs[:10])
    assert len(buf) == 10 and buf.added == 10
    buf.add(states[10:], pols[10:], outs[10:])
    assert len(buf) == n - 5 and buf.added == n     # the 5 oldest were overwritten
    kept = set(map(bytes, (states[5:]).reshape(n - 5, -1)))
    assert set(map(bytes, buf.states.reshape(n - 5, -1))) == kept

    idx = np.arange(len(buf))
    x0, p0, z0 = buf.batch(idx, np.zeros(len(idx), bool))
    x1, p1, z1 = buf.batch(idx, np.ones(len(idx), bool))
    assert x0.dtype == np.float32 and x0.shape == (len(buf), 6, 7, 2)
    np.testing.assert_array_equal(x1, x0[:, :, ::-1, :])
    np.testing.assert_array_equal(p1, p0[:, ::-1])
    np.testing.assert_array_equal(z1, z0)
    # the buffer itself holds each position once, unmirrored
    assert buf.states.shape[0] == n - 5

    rng = np.random.default_rng(0)
    xs, ps, zs = buf.sample(4000, rng)
    assert xs.shape == (4000, 6, 7, 2) and ps.shape == (4000, 7) and zs.shape == (4000,)
    np.testing.assert_allclose(ps.sum(axis=1), 1.0, atol=1e-5)
    # about half the draws are mirrored: count the draws that match a stored
    # sample only as its mirror image
    stored = {bytes(a) + bytes(b) for a, b in zip(x0.astype(np.uint8), p0)}
    mirrored = sum(bytes(a) + bytes(b) not in stored
                   for a, b in zip(xs.astype(np.uint8), ps))
    assert 0.3 < mirrored / 4000 < 0.7
    xs, ps, _ = buf.sample(500, rng, mirror=False)
    assert all(bytes(a) + bytes(b) in stored for a, b in zip(xs.astype(np.uint8), ps))
    with pytest.raises(ValueError):
        selfplay.ReplayBuffer(10).sample(1, rng)


def test_display_tty_and_plain() -> None:
    tty = io.StringIO()
    d = Display(tty, tty=True)
    d.status("one")
    d.status("two")
    d.line("done")
    assert tty.getvalue() == "\rone\x1b[K\rtwo\x1b[K\r\x1b[Kdone\n"
    plain = io.StringIO()
    d = Display(plain, tty=False, plain_every=3600)
    d.status("first")
    d.status("second")             # within the interval: not printed
    d.status("third", force=True)  # a phase change: printed
    d.line("end")
    assert plain.getvalue() == "first\nthird\nend\n"


def test_cpu_split() -> None:
    assert cpu_split(False) == (None, None)
    cpus = os.sched_getaffinity(0)
    ev, workers = cpu_split(True)
    if len(cpus) < 2:
        assert (ev, workers) == (None, None)
    else:
        assert ev is not None and workers is not None
        assert len(ev) == 1 and not ev & workers and ev | workers == cpus


def test_worker_policy() -> None:
    # auto: SCHED_BATCH when the workers outnumber the CPUs
    assert selfplay.Settings(workers=8).worker_policy(cpus=2) == "batch"
    assert selfplay.Settings(workers=8).worker_policy(cpus=8) == "normal"
    assert selfplay.Settings(workers=2).worker_policy(cpus=2) == "normal"
    for forced in ("normal", "batch"):
        s = selfplay.Settings(workers=8, worker_sched=forced)
        assert {s.worker_policy(cpus=c) for c in (2, 8)} == {forced}
    with pytest.raises(ValueError, match="worker_sched"):
        selfplay.Settings(worker_sched="fifo").check()


def test_net_precision(monkeypatch: Any, tmp_path: Any) -> None:
    # auto: bfloat16 for a frozen net called with batches on a CPU with
    # native bfloat16; local's one-row calls stay float32
    batched = ("shmeval", "queue", "local-batched")

    def precision(mode: str, s: selfplay.Settings) -> str:
        return MODE_CLASSES[mode](s).precision()

    monkeypatch.setattr(settings, "gpu_visible", lambda: False)
    for native in (True, False):
        monkeypatch.setattr(settings, "cpu_bfloat16", lambda native=native: native)
        for mode in batched:
            assert precision(mode, selfplay.Settings()) == ("bfloat16" if native else "float32")
            assert precision(mode, selfplay.Settings(freeze=False)) == "float32"
        assert precision("local", selfplay.Settings()) == "float32"
        for forced in ("float32", "bfloat16"):
            s = selfplay.Settings(precision=forced)
            assert {precision(m, s) for m in (*batched, "local")} == {forced}
    with pytest.raises(ValueError, match="precision"):
        selfplay.Settings(precision="float16").check()
    with pytest.raises(ValueError, match="no-freeze"):
        selfplay.Settings(precision="bfloat16", freeze=False).check()
    selfplay.Settings(precision="float32", freeze=False).check()
    # the driver's GPU list, as CUDA_VISIBLE_DEVICES leaves it
    gpus = tmp_path / "gpus"
    assert not _device.gpu_visible(str(gpus))             # no driver
    (gpus / "0000:00:04.0").mkdir(parents=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _device.gpu_visible(str(gpus))
    for hidden, seen in (("", False), ("-1", False), ("0", True)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert _device.gpu_visible(str(gpus)) == seen
    # a visible GPU runs the net: auto stays float32, bfloat16 is refused
    monkeypatch.setattr(settings, "cpu_bfloat16", lambda: True)
    monkeypatch.setattr(settings, "gpu_visible", lambda: True)
    assert precision("shmeval", selfplay.Settings()) == "float32"
    with pytest.raises(ValueError, match="GPU"):
        selfplay.Settings(precision="bfloat16").check()


def test_repeats_are_summarised_by_medians() -> None:
    def fake(moves: float, rss: float, other: float) -> Dict[str, Any]:
        return {"moves_per_s": moves, "evals_per_s": 30 * moves, "mean_batch": 2.0,
                "worker_rss_mb": rss, "evaluator_rss_mb": None, "games": int(moves),
                "startup_s": 1.0, "cpu": {"other_cores": other}, "tag": moves,
                "cache_setting": {"kind": "none", "entries": 0}}

    runs = [fake(300, 40, 0.0), fake(100, 50, 0.5), fake(200, 45, 0.1)]
    r = report.combine_runs(runs)
    assert r["tag"] == 200 and r["moves_per_s"] == 200 and r["evals_per_s"] == 6000
    assert r["range"]["moves_per_s"] == [100, 300] and r["worker_rss_mb"] == 45
    assert r["cpu"]["other_cores"] == 0.1 and r["runs"] == runs
    assert r["evaluator_rss_mb"] is None
    assert runs[2]["cpu"]["other_cores"] == 0.1   # the runs themselves are left alone
    assert report.combine_runs(runs[:1]) is runs[0]
    assert "[100-300]" in report.format_table({"shmeval": {**r, "tensorflow_in_workers": 0}}, 8)


def test_round_ratios_pair_the_runs_of_each_round() -> None:
    def run(moves: float) -> Dict[str, Any]:
        return {"moves_per_s": moves}

    runs = {"shmeval": [run(300), run(200), run(240)], "queue": [run(200), run(200), run(160)],
            "local": [run(30), run(40), run(0)]}
    r = report.round_ratios(runs)
    assert r["shmeval/queue moves_per_s"] == [1.5, 1.0, 1.5]
    assert r["shmeval/local moves_per_s"] == [10.0, 5.0, None]   # no division by zero
    assert set(r) == {"shmeval/queue moves_per_s", "shmeval/local moves_per_s"}
    # one round, a missing round, no shmeval: nothing to pair
    assert report.round_ratios({"shmeval": [run(1)], "queue": [run(1)]}) == {}
    assert report.round_ratios({"shmeval": [run(1), run(2)], "queue": [run(1)]}) == {}
    assert report.round_ratios({"queue": [run(1), run(2)], "local": [run(1), run(2)]}) == {}


def exit_codes_in_a_fresh_interpreter(argvs: List[List[str]]) -> Tuple[List[int], bool]:
    """Runs ``cli.main(argv)`` for each argv in one new interpreter (other
    tests may have imported TensorFlow into this one); returns the exit codes
    and whether TensorFlow got imported."""
    code = ("import json, sys\nfrom shmeval import cli\n"
            "codes = [cli.main(a) for a in json.loads(sys.argv[1])]\n"
            "print(json.dumps([codes, 'tensorflow' in sys.modules]))")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert p.returncode == 0, p.stderr
    codes, tf = json.loads(p.stdout.strip().splitlines()[-1])
    return codes, tf


def test_argument_errors_fail_before_starting_anything() -> None:
    codes, tf = exit_codes_in_a_fresh_interpreter([
        ["selfplay", "--compare", "--train", "--seconds", "1"],
        ["selfplay", "--workers", "0"],
        ["selfplay", "--load-games", "x.npz"],
        ["selfplay", "--train", "--repeats", "2"]])
    assert codes == [1, 2, 1, 2]
    assert not tf
