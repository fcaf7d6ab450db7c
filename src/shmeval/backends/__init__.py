"""Adapters that turn a framework's model into an evaluator model.

Each backend lives in its own module and imports its framework at module
level, so import it only where the model runs (the evaluator process, e.g.
inside the factory given to ``Evaluator.spawn``)::

    from shmeval.backends.tensorflow import TFModel

This package itself imports no framework: worker processes that only hold
an ``Evaluator`` handle never load TensorFlow.
"""
