"""A Ray cluster of several nodes on this machine, for the tests, the
benchmark and ``shmeval selfplay --ray`` without an address.

Its nodes share the machine's ``/dev/shm`` and its IP address, so they
prove that a worker finds its own node's evaluator by Ray's node id.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def simulated_cluster(nodes: int, num_cpus: int = 1, **init_kwargs: Any) -> Iterator[Cluster]:
    """Starts a head node and ``nodes - 1`` more, each declaring
    ``num_cpus`` CPUs to Ray's scheduler, connects this process with
    ``ray.init(**init_kwargs)`` and yields the ``Cluster`` (``add_node``,
    ``remove_node``); on exit disconnects and stops every node's processes."""
    if nodes < 1:
        raise ValueError(f"a cluster needs at least one node, got {nodes}")
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": num_cpus, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=num_cpus)
        init_kwargs.setdefault("logging_level", logging.WARNING)
        ray.init(address=cluster.address, **init_kwargs)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
