"""What a self-play run raises when one of its processes fails."""


class WorkerError(RuntimeError):
    """A worker process or an evaluator failed; the message holds its traceback."""
