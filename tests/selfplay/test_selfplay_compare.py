"""``shmeval selfplay --compare``: which modes it runs (local-batched, the
per-worker net a user would write, by default), the cache each mode ran
with in the summary and the JSON, and the like-for-like rule: every mode
with a cache or none, a mix refused before anything starts."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict

import pytest

from shmeval import selfplay
from shmeval.selfplay import cli, report
from shmeval.selfplay.modes import MODE_CLASSES
from shmeval.selfplay.settings import NO_CACHE, CacheSetting
from test_selfplay import RUN_TIMEOUT, TINY, _cli, exit_codes_in_a_fresh_interpreter


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_compare_runs_local_batched_and_no_cache_by_default() -> None:
    assert "local-batched" in selfplay.COMPARE_MODES
    args = _parse("--compare")
    assert args.compare == ["shmeval", "queue", "local-batched"]
    s = cli.settings_from_args(args)
    assert (s.cache, s.local_cache) == (0, 0)    # no mode answers from a cache
    # one mode alone keeps shmeval's shared cache on by default
    assert cli.settings_from_args(_parse()).cache == selfplay.Settings().cache > 0
    assert _parse("--compare", "all").compare == list(selfplay.MODES)
    assert _parse("--compare", "local,shmeval").compare == ["local", "shmeval"]
    assert cli.settings_from_args(_parse("--compare", "--cache", "1024")).cache == 1024


def test_compare_refuses_unknown_modes(capsys: Any) -> None:
    for bad, why in (("shmeval,nope", "unknown mode(s) nope"),
                     ("shmeval,shmeval", "a mode named twice"), (",", "unknown mode(s) (none)")):
        with pytest.raises(SystemExit):
            _parse("--compare", bad)
        assert why in capsys.readouterr().err


def test_each_mode_has_one_cache() -> None:
    def caches(**kw: Any) -> Dict[str, CacheSetting]:
        s = selfplay.Settings(**kw)
        return {m: MODE_CLASSES[m](s).cache() for m in selfplay.MODES}

    assert set(caches(cache=0).values()) == {NO_CACHE}
    c = caches(cache=1024, local_cache=64)
    assert c["shmeval"] == CacheSetting("shared", 1024)    # not also one per worker
    assert c["shmeval"].per_worker == 0 and c["shmeval"].label() == "shared 1,024"
    for m in ("queue", "local", "local-batched"):
        assert c[m] == CacheSetting("per worker", 64) and c[m].per_worker == 64
    # without the shared table shmeval's workers get the per-worker one too
    assert set(caches(cache=0, local_cache=64).values()) == {CacheSetting("per worker", 64)}


def test_a_mixed_comparison_is_refused() -> None:
    shared, per_worker = CacheSetting("shared", 1024), CacheSetting("per worker", 64)
    assert report.mixed_caches({"shmeval": NO_CACHE, "queue": NO_CACHE}) is None
    assert report.mixed_caches({"shmeval": shared, "queue": per_worker}) is None
    problem = report.mixed_caches({"shmeval": shared, "queue": NO_CACHE,
                                   "local-batched": NO_CACHE})
    assert problem is not None and "not like for like" in problem
    assert "shmeval (shared 1,024)" in problem and "queue, local-batched from none" in problem

    # results that mix are refused too: no ratio credits the transport
    # with a cache's answers
    def result(cache: CacheSetting, moves: float) -> Dict[str, Any]:
        return {"moves_per_s": moves, "evals_per_s": 30 * moves, "worker_rss_mb": 50.0,
                "cache_setting": cache.to_json()}

    with pytest.raises(ValueError, match="not like for like"):
        report.ratios({"shmeval": result(shared, 300), "local-batched": result(NO_CACHE, 200)})
    r = report.ratios({"shmeval": result(NO_CACHE, 300), "local-batched": result(NO_CACHE, 200)})
    assert r["shmeval/local-batched moves_per_s"] == 1.5
    assert r["worker RSS local-batched/shmeval"] == 1.0

    # through the command line: refused before anything starts
    # (and a per-worker cache that no mode would use)
    codes, tf = exit_codes_in_a_fresh_interpreter([
        ["selfplay", "--compare", "--cache", "1024", "--seconds", "1"],
        ["selfplay", "--compare", "shmeval,local-batched", "--cache", "1024", "--seconds", "1"],
        ["selfplay", "--local-cache", "64", "--seconds", "1"]])
    assert codes == [1, 1, 1]
    assert not tf


@pytest.mark.timeout(RUN_TIMEOUT * 3)
def test_compare_reports_each_modes_cache(tmp_path: Any) -> None:
    js = str(tmp_path / "compare.json")
    r = _cli(["--compare", *TINY, "--json", js], timeout=RUN_TIMEOUT * 3)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(js) as f:
        out = json.load(f)
    modes = ["shmeval", "queue", "local-batched"]
    assert out["settings"]["modes"] == modes and list(out["modes"]) == modes
    none = {"kind": "none", "entries": 0}
    assert out["caches"] == {m: none for m in modes}
    for m in modes:
        assert out["modes"][m]["cache_setting"] == none
        assert "cache" not in out["modes"][m] and "local_cache" not in out["modes"][m]
    assert out["modes"]["local-batched"]["tensorflow_in_workers"] == 2
    assert {"shmeval/local-batched moves_per_s", "shmeval/queue moves_per_s",
            "worker RSS local-batched/shmeval"} <= set(out["ratios"])
    assert "caches: none in any mode" in r.stdout
    assert "ratios (like for like: no mode with a cache):" in r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("mode "))
    assert header.split()[:2] == ["mode", "cache"]


@pytest.mark.timeout(RUN_TIMEOUT * 2)
def test_compare_with_a_cache_on_every_side(tmp_path: Any) -> None:
    js = str(tmp_path / "compare-cached.json")
    r = _cli(["--compare", "shmeval,queue", "--cache", "1024", "--local-cache", "64", *TINY,
              "--json", js], timeout=RUN_TIMEOUT * 2)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(js) as f:
        out = json.load(f)
    shm, q = out["modes"]["shmeval"], out["modes"]["queue"]
    assert shm["cache_setting"] == {"kind": "shared", "entries": 1024}
    assert q["cache_setting"] == {"kind": "per worker", "entries": 64}
    # shmeval answered from its shared table only, queue from its workers' own
    assert shm["cache"]["entries"] == 1024 and "local_cache" not in shm
    assert q["local_cache"]["entries_per_worker"] == 64 and "cache" not in q
    assert q["local_cache"]["hits"] + q["local_cache"]["misses"] > 0
    assert "caches: shmeval shared 1,024; queue per worker 64" in r.stdout
    assert "shmeval/queue moves_per_s" in out["ratios"]
    assert "ratios (like for like: every mode with a cache):" in r.stdout
