"""shmeval: batched model evaluation for many processes over shared memory.

Worker processes write states into lock-free shared-memory slots; one
evaluator drains them into large batches for the model and writes results
back in place.  See README.md and docs/protocol.md.
"""
from .client import Client, connect
from .errors import (ClientTableFull, DeviceLost, EvaluatorClosed, EvaluatorDied, ModelError,
                     NotTheMainProcess, SegmentError, ShmevalError, ShmevalTimeout)
from .config import BatchPolicy
from .evaluator import Evaluator
from .sched import use_batch_scheduling
from .spec import Method

__version__ = "0.1.0"

__all__ = [
    "Evaluator", "Client", "connect", "BatchPolicy", "Method", "use_batch_scheduling",
    "ShmevalError", "SegmentError", "ClientTableFull", "EvaluatorClosed", "EvaluatorDied",
    "ModelError", "DeviceLost", "ShmevalTimeout", "NotTheMainProcess", "__version__",
]
