"""shmeval.ray on a real Ray cluster of two nodes simulated on this machine
(``simulated_cluster``): the nodes share /dev/shm and the IP address, so a
worker must find its own node's evaluator by Ray's node id.

- one evaluator per node; each worker evaluates through its own node's
  evaluator, with no Ray call per evaluation (counted in the worker);
  ``replicas=`` passes through: each node serves with its own replicas;
- weights reach every node through one object-store copy, in order: no
  worker sees versions go backwards;
- a node that joins gets an evaluator serving the latest weights; a node
  removed under load takes its workers with it, the others keep playing;
- bad input fails at start-up, leaving no actor and no segment behind;
  so does a driver that dies without closing.

One cluster serves the whole module (a Ray node takes seconds to start):
about 60-90 s on 2 cores.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import cluster_parts  # noqa: E402
import shmeval  # noqa: E402
from cluster_parts import SPEC, Player  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from shmeval import segment  # noqa: E402
from shmeval.ray import ClusterConfig, ClusterEvaluator, simulated_cluster  # noqa: E402

TIMEOUT = 60.0
#: Bound on a node's or a worker's start, which other load can stretch.
START_TIMEOUT = 180.0
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two nodes; each evaluator process and Ray worker can import
    cluster_parts.  Shut down with the module: later test folders fork,
    which a process with Ray's threads must not."""
    here = str(Path(cluster_parts.__file__).parent)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        with simulated_cluster(2) as c:
            yield c
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def wait_for(what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    """Polls ``check`` until it returns something true; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def on_node(node_id: str, handle: Any) -> Any:
    return Player.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(handle)


def alive_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def segment_exists(address: str) -> bool:
    return os.path.exists("/dev/shm" + address)


def test_each_worker_uses_its_own_nodes_evaluator_without_ray_calls(cluster: Any) -> None:
    with ClusterEvaluator(cluster_parts.pid_net, **SPEC) as ce:
        stats = ce.stats()
        nodes = alive_nodes()
        assert sorted(stats) == sorted(nodes) and len(nodes) == 2
        players = [on_node(n, ce) for n in nodes for _ in range(2)]
        results = ray.get([p.evaluate_counting.remote(200) for p in players], timeout=TIMEOUT)
        for r in results:
            own = stats[r["node_id"]]
            assert r["address"] == own["address"]
            assert set(r["pids"]) <= replica_pids(own)  # answered by its node's evaluator only
            assert r["ray_calls_connect"] > 0         # the counter sees Ray calls ...
            assert r["ray_calls_evaluating"] == 0     # ... and evaluations make none
        after = ce.stats()
        for n in nodes:
            assert after[n]["requests"] - stats[n]["requests"] == 400
        addresses = [s["address"] for s in stats.values()]
        assert all(segment_exists(a) for a in addresses)
        for s in stats.values():
            # Neither a child of its actor (the segment's creator) nor in its
            # session: Ray kills a worker's direct children and a removed
            # node's process groups before they could clean up.
            creator = int(s["address"].split("-")[1])
            assert all(parent_of(pid) != creator for pid in replica_pids(s))
            assert all(os.getsid(pid) == pid for pid in replica_pids(s))
        for p in players:
            ray.kill(p)
    assert not any(segment_exists(a) for a in addresses)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(ce.name)]


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def replica_pids(stats: dict[str, Any]) -> set[int]:
    return {r["pid"] for r in stats["replicas"]}


def test_replicas_pass_through_to_every_node(cluster: Any) -> None:
    with ClusterEvaluator(cluster_parts.pid_net, replicas=2, **SPEC) as ce:
        assert ce.set_weights([np.float32(4.0)]) == 1
        stats = ce.stats()
        for node_stats in stats.values():
            assert len(node_stats["replicas"]) == 2
            assert {r["model_version"] for r in node_stats["replicas"]} == {1}
        pids = [replica_pids(s) for s in stats.values()]
        assert not pids[0] & pids[1]                  # each node its own replicas
        players = [on_node(n, ce) for n in stats]
        results = ray.get([p.evaluate_counting.remote(100) for p in players], timeout=TIMEOUT)
        for r in results:
            assert set(r["pids"]) <= replica_pids(stats[r["node_id"]])
            assert r["ray_calls_evaluating"] == 0
        for p in players:
            ray.kill(p)


def test_weights_reach_every_node_once_and_in_order(cluster: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value: puts.append(1) or real_put(value))
    with ClusterEvaluator(cluster_parts.pid_net, **SPEC) as ce:
        players = [on_node(n, ce) for n in alive_nodes()]
        playing = [p.play.remote() for p in players]
        wait_for("every player to evaluate", lambda: all(
            ray.get([p.progress.remote() for p in players], timeout=TIMEOUT)), START_TIMEOUT)
        for v in range(1, 6):
            assert ce.set_weights([np.float32(v)]) == v
        assert len(puts) == 5                         # one copy per update, for both nodes
        assert ce.set_weights([np.float32(10)], version=10) == 10
        with pytest.raises(ValueError, match="larger than the current model version 10"):
            ce.set_weights([np.float32(9)], version=9)
        assert {s["model_version"] for s in ce.stats().values()} == {10}
        before = ray.get([p.progress.remote() for p in players], timeout=TIMEOUT)
        wait_for("evaluations with the last weights", lambda: all(
            a > b for a, b in zip(ray.get([p.progress.remote() for p in players],
                                          timeout=TIMEOUT), before)))
        reports = ray.get([p.halt.remote() for p in players], timeout=TIMEOUT)
        ray.get(playing, timeout=TIMEOUT)
        for r in reports:
            assert r["error"] is None and r["versions_backwards"] == 0
            assert r["weights_seen"] == sorted(r["weights_seen"])
            assert r["weights_seen"][-1] == 10.0
        for p in players:
            ray.kill(p)
    with pytest.raises(shmeval.EvaluatorClosed):
        ce.set_weights([np.float32(11)])


def test_a_state_dict_reaches_every_node(cluster: Any) -> None:
    """ClusterEvaluator.set_weights takes a state dict as Evaluator's does
    (shmeval.weights): the workers of both nodes see its weight."""
    with ClusterEvaluator(cluster_parts.pid_net, **SPEC) as ce:
        assert ce.set_weights({"weight": np.float32(6.0)}) == 1
        players = [on_node(n, ce) for n in alive_nodes()]
        playing = [p.play.remote() for p in players]
        wait_for("every player to evaluate", lambda: all(
            ray.get([p.progress.remote() for p in players], timeout=TIMEOUT)), START_TIMEOUT)
        reports = ray.get([p.halt.remote() for p in players], timeout=TIMEOUT)
        ray.get(playing, timeout=TIMEOUT)
        assert [(r["error"], r["weights_seen"]) for r in reports] == [(None, [6.0])] * 2
        for p in players:
            ray.kill(p)


def test_node_joins_and_leaves_under_load(cluster: Any) -> None:
    with ClusterEvaluator(cluster_parts.pid_net, watch_s=0.2, **SPEC) as ce:
        ce.set_weights([np.float32(2.0)])
        joined = cluster.add_node(num_cpus=1)
        try:
            check_join_and_leave(cluster, ce, joined)
        finally:  # the other tests expect two nodes
            if joined in cluster.worker_nodes:
                cluster.remove_node(joined)


def check_join_and_leave(cluster: Any, ce: ClusterEvaluator, joined: Any) -> None:
    new = joined.node_id
    # The new node's evaluator starts with the latest weights.
    wait_for("the new node's evaluator", lambda: new in ce.addresses(), START_TIMEOUT)
    address = ce.addresses()[new]
    assert ce.stats()[new]["model_version"] == 1
    players = {n: on_node(n, ce) for n in alive_nodes()}
    assert len(players) == 3
    playing = {n: p.play.remote() for n, p in players.items()}
    wait_for("every player to evaluate", lambda: all(
        ray.get([p.progress.remote() for p in players.values()], timeout=TIMEOUT)),
        START_TIMEOUT)
    cluster.remove_node(joined)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(playing[new], timeout=TIMEOUT)         # its workers went with it
    rest = [p for n, p in players.items() if n != new]
    before = ray.get([p.progress.remote() for p in rest], timeout=TIMEOUT)
    wait_for("the other nodes to keep playing", lambda: all(
        a > b + 100 for a, b in zip(ray.get([p.progress.remote() for p in rest],
                                            timeout=TIMEOUT), before)))
    wait_for("the left node's evaluator to be forgotten", lambda: new not in ce.addresses())
    wait_for("the left node's segment to go", lambda: not segment_exists(address))
    assert ce.set_weights([np.float32(3.0)]) == 2      # the nodes left get it
    reports = ray.get([p.halt.remote() for p in rest], timeout=TIMEOUT)
    for r in reports:
        assert r["error"] is None and r["versions_backwards"] == 0
        assert r["weights_seen"] == sorted(r["weights_seen"])
    for p in rest:
        ray.kill(p)


def left_behind(name: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(name)]


def test_the_settings_are_spawns_and_the_clusters_own() -> None:
    """ClusterEvaluator takes the fields of its ClusterConfig: every
    setting of Evaluator.spawn, with the cluster's default start method,
    and its own three."""
    def keywords(fn: Callable[..., Any]) -> dict[str, Any]:
        return {p.name: p.default for p in inspect.signature(fn).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}

    cluster, spawn = keywords(ClusterEvaluator), keywords(shmeval.Evaluator.spawn)
    assert cluster.keys() == {f.name for f in dataclasses.fields(ClusterConfig) if f.init}
    assert cluster.keys() - spawn.keys() == {"namespace", "watch_s", "actor_options"}
    assert {k for k in spawn if cluster[k] != spawn[k]} == {"mp_context"}
    assert cluster["mp_context"] == "forkserver"


def test_failing_factory_fails_at_start_and_leaves_nothing(cluster: Any) -> None:
    with pytest.raises(shmeval.ModelError, match="Ray node .*this node has no model"):
        ClusterEvaluator(cluster_parts.failing_factory, name="failing", **SPEC)
    wait_for("the actors to go", lambda: not left_behind("failing"))


def test_bad_arguments_fail_before_anything_is_placed(cluster: Any) -> None:
    with pytest.raises(TypeError, match="max_batchh"):
        ClusterEvaluator(cluster_parts.pid_net, name="typo", max_batchh=3, **SPEC)
    with pytest.raises(TypeError, match="outputs"):
        ClusterEvaluator(cluster_parts.pid_net, name="typo", input_shape=(3,))
    assert not left_behind("typo")
    with pytest.raises(ValueError, match="max_batch"):
        ClusterEvaluator(cluster_parts.pid_net, name="bad-value",
                         **{**SPEC, "max_batch": 0})
    wait_for("the actors to go", lambda: not left_behind("bad-value"))


def _driver_factory() -> Any:
    return cluster_parts.pid_net()


def test_a_factory_of_the_driver_script_is_refused(cluster: Any) -> None:
    """Defined in the driver's script, a factory reaches each node's actor
    but not the evaluator process it starts: refused, saying where to put
    it, before anything is placed (Ray pickles a test module's function
    by reference, so the test makes this one look like the script's)."""
    factory = functools.partial(_driver_factory)
    _driver_factory.__module__ = "__main__"
    try:
        with pytest.raises(TypeError, match="defined in the driver's script .*py_modules"):
            ClusterEvaluator(factory, name="driver", **SPEC)
    finally:
        _driver_factory.__module__ = __name__
    assert not left_behind("driver")


def test_the_name_reaches_each_nodes_segment(cluster: Any) -> None:
    """name names each node's segment too (with the actor's pid: nodes of
    one machine share /dev/shm), so that shmeval ls shows whose it is."""
    with ClusterEvaluator(cluster_parts.pid_net, name="named", start_timeout=START_TIMEOUT,
                          **SPEC) as ce:
        addresses = ce.addresses()
        assert len(addresses) == 2
        assert all(re.fullmatch(r"/shmeval-\d+-named", a) for a in addresses.values()), addresses
        listed = {s["address"] for s in segment.list_segments()}
        assert set(addresses.values()) <= listed
    with pytest.raises(ValueError, match="name must be"):
        ClusterEvaluator(cluster_parts.pid_net, name="a/b", **SPEC)
    with pytest.raises(TypeError, match="start_timeout must be a number"):
        ClusterEvaluator(cluster_parts.pid_net, name="no-timeout", start_timeout=None, **SPEC)


def test_a_name_in_use_is_refused(cluster: Any) -> None:
    with ClusterEvaluator(cluster_parts.pid_net, name="taken", **SPEC) as ce:
        with pytest.raises(ValueError, match="taken"):
            ClusterEvaluator(cluster_parts.pid_net, name="taken", **SPEC)
        assert len(ce.stats()) == 2                   # the first one still serves


def test_a_driver_that_dies_leaves_nothing_behind(cluster: Any) -> None:
    code = (f"import os, ray, cluster_parts\n"
            f"from shmeval.ray import ClusterEvaluator\n"
            f"ray.init(address={cluster.address!r}, logging_level='warning')\n"
            f"ce = ClusterEvaluator(cluster_parts.pid_net, name='orphaned', **cluster_parts.SPEC)\n"
            f"print(' '.join(ce.addresses().values()), flush=True)\n"
            f"os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    addresses = r.stdout.split()
    assert len(addresses) == 2
    wait_for("the evaluators' segments to go",
             lambda: not any(segment_exists(a) for a in addresses))
    wait_for("the actors to go", lambda: not left_behind("orphaned"))
