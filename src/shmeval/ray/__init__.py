"""shmeval on a Ray cluster (extra ``[ray]``): one evaluator per node.

:class:`ClusterEvaluator`, created in the driver after ``ray.init()``,
places one shmeval evaluator (``Evaluator.spawn``) on every Ray node and
on each node that joins, and sends weight updates to all of them through
Ray's object store.  Passed to Ray workers, it pickles as a
:class:`ClusterHandle`; ``connect()`` there returns a plain
:class:`shmeval.Client` on the worker's own node's evaluator, found by
Ray's node id, and from then on every evaluation goes through shared
memory, never through Ray::

    ray.init()                                    # or ray.init(address=...)
    evaluators = ClusterEvaluator(factory, input_shape=(6, 7, 2), outputs=...)

    @ray.remote
    class SelfPlay:
        def __init__(self, evaluators):
            self.ev = evaluators.connect()        # this node's evaluator
        def play(self):
            ... self.ev.evaluate(state) ...       # shared memory only

    evaluators.set_weights(learner.get_weights())  # every node, in order

=====================  ==================================================
``cluster_evaluator``  :class:`ClusterEvaluator`, its settings
                       (:class:`ClusterConfig`), :class:`ClusterHandle`
``node_evaluator``     the actor that owns one node's evaluator
``simulated``          :func:`simulated_cluster`: several nodes here
``selfplay``           ``shmeval selfplay --ray``
=====================  ==================================================
"""
from .cluster_evaluator import NAMESPACE, ClusterConfig, ClusterEvaluator, ClusterHandle
from .simulated import simulated_cluster

__all__ = ["ClusterEvaluator", "ClusterConfig", "ClusterHandle", "simulated_cluster",
           "NAMESPACE"]
