"""Exceptions.  Everything shmeval raises derives from ShmevalError, except bad
arguments, which raise ValueError / TypeError."""


class ShmevalError(Exception):
    """Base class of every shmeval error."""


class SegmentError(ShmevalError):
    """A shared segment is missing, foreign, corrupt or of another version."""


class ClientTableFull(ShmevalError):
    """Every client-table entry is taken; raise ``max_clients``."""


class EvaluatorClosed(ShmevalError):
    """The evaluator was closed; the request was not (or will not be) answered."""


class EvaluatorDied(ShmevalError):
    """The evaluator's process or serving thread is gone."""


class ModelError(ShmevalError):
    """The model failed on the batch that held this request.

    ``message`` is the original error text (type and message) as the evaluator
    saw it; the evaluator itself keeps serving.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
