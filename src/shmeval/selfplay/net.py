"""The net where it runs: the shmeval evaluator's model, the queue
evaluator's and the local workers' functions of it.  TensorFlow is imported
inside the functions, in the processes that call them."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np

from .._util.simdevice import SimLink, wrap_if
from ..games import connect4
from ..games.connect4_net import NetConfig
from .pinning import pin
from .settings import Settings

#: The net's outputs, as the shmeval evaluator declares them.
OUTPUTS = {"policy": ((connect4.N_ACTIONS,), "float32"), "value": ((), "float32")}

#: What a worker's search calls: states -> (policy [n, 7], value [n]).
EvaluateBatch = Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]]


def evaluator_model(net: NetConfig, seed: int, threads: int,
                    cpus: Optional[set[int]] = None, serving_threads: Union[int, str] = 1,
                    freeze: bool = False, bfloat16: bool = False,
                    sim: Optional[SimLink] = None) -> Any:
    """Evaluator.spawn's factory: runs in the evaluator process, the only
    process of the shmeval mode that imports TensorFlow.  ``threads`` intra-op
    threads per model call; as many inter-op threads as calls in flight
    (``serving_threads``, "auto": TFModel's two; with fewer, concurrent calls
    partly wait for each other: `bench/tf_model_cost.py --concurrent`).
    ``freeze``: TFModel's freeze="auto" (folded while that pays), else
    unfrozen.  ``sim``: the TFModel behind the simulated GPU (its warm-ups
    in ``prepare`` bypass it)."""
    from ..games.connect4_net import build_resnet, import_tensorflow

    pin(cpus)  # before TensorFlow starts its threads
    import_tensorflow()
    from ..backends.tensorflow import TFModel, configure

    # Before the net is built: building it initialises TensorFlow.
    calls = serving_threads if isinstance(serving_threads, int) else TFModel.max_concurrency
    configure(intra_op_threads=threads or None,
              inter_op_threads=max(threads, calls) if threads else None)
    return wrap_if(sim, TFModel(build_resnet(net, seed=seed, compile=False),
                                freeze="auto" if freeze else False, bfloat16=bfloat16))


def net_function(tf: Any, model: Any, rows: Optional[int], s: Settings
                 ) -> Callable[[np.ndarray], Dict[str, np.ndarray]]:
    """The queue and local modes' net, ndarrays in and out: the Keras
    model's concrete function for batches of ``rows`` (None: any, for
    batched calls; 1: one row at a time); with ``s.freeze`` its weights
    folded in and run in the caller's thread by a FrozenGraph (in
    ``s.net_precision``), as TFModel(freeze=True) serves it in the shmeval
    mode."""
    fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec((rows,) + connect4.INPUT_SHAPE, tf.float32))
    if s.freeze:
        from ..backends.tensorflow import FrozenGraph
        return FrozenGraph(fn, bfloat16=s.net_precision(batched=rows is None) == "bfloat16")
    constant = tf.constant

    def run(x: np.ndarray) -> Dict[str, np.ndarray]:
        return {k: t.numpy() for k, t in fn(constant(x)).items()}

    return run


def local_net(s: Settings, batched: bool, sim: Optional[SimLink] = None) -> EvaluateBatch:
    """A local worker's own copy of the net, traced once for batches of one
    (or any size when ``batched``); behind the simulated GPU ``sim`` when
    given, each call of the net (each row, unless ``batched``) a call of
    the device."""
    from ..games.connect4_net import build_resnet, import_tensorflow

    tf = import_tensorflow(1)
    model = build_resnet(s.net, seed=s.seed, compile=False)
    rows = None if batched else 1
    fn = wrap_if(sim, net_function(tf, model, rows, s))
    n_actions = connect4.N_ACTIONS

    if batched:
        def evaluate_batch(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
            out = fn(x)
            return out["policy"], out["value"].reshape(len(x))
        return evaluate_batch

    def evaluate_one_by_one(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        n = len(x)
        policy = np.empty((n, n_actions), np.float32)
        value = np.empty(n, np.float32)
        for i in range(n):
            out = fn(x[i:i + 1])
            policy[i] = out["policy"][0]
            value[i] = out["value"][0, 0]
        return policy, value

    return evaluate_one_by_one
