"""The settings are defined once (shmeval.config): the public methods take
exactly the config's fields as keyword arguments, each field has its
docstring, the config keeps the checked values, and the Server reads it
whole (Server.configure)."""
from __future__ import annotations

import dataclasses
import inspect
import os
import pickle
from typing import Any, Callable

import numpy as np
import pytest

import shmeval
from shmeval import _ring, segment
from shmeval.config import ServeConfig, SpawnConfig, settings_help
from helpers import INPUT_SHAPE, OUTPUTS, fake_model, serve_config


def keyword_only(fn: Callable[..., Any]) -> dict[str, Any]:
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def settings(cls: type[ServeConfig]) -> dict[str, Any]:
    return {f.name: (inspect.Parameter.empty if f.default is dataclasses.MISSING
                     else f.default)
            for f in dataclasses.fields(cls) if f.init}


@pytest.mark.parametrize("method, cls", [(shmeval.Evaluator.__init__, ServeConfig),
                                         (shmeval.Evaluator.spawn, SpawnConfig)])
def test_the_methods_take_the_configs_fields(method: Callable[..., Any],
                                             cls: type[ServeConfig]) -> None:
    assert keyword_only(method) == settings(cls)


def test_each_setting_has_its_docstring() -> None:
    text = settings_help(SpawnConfig)
    documented = {line.split(" ")[0] for line in text.splitlines()[1:]
                  if line and not line.startswith(" ")}
    assert documented == set(settings(SpawnConfig))


def test_unknown_missing_and_bad_settings_are_refused_up_front() -> None:
    with pytest.raises(TypeError, match=r"Evaluator.__init__\(\) got an unexpected keyword "
                                        r"argument 'restarts'"):
        shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS, restarts=1)
    with pytest.raises(TypeError, match="outputs must be a non-empty dict"):
        shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE)
    with pytest.raises(ValueError, match="restarts must be an int >= 0"):
        SpawnConfig(input_shape=INPUT_SHAPE, outputs=OUTPUTS, restarts=-1)
    with pytest.raises(ValueError, match="replicas=3 but 2 devices"):
        SpawnConfig(input_shape=INPUT_SHAPE, outputs=OUTPUTS, replicas=3, devices=["a", "b"])
    with pytest.raises(ValueError, match="cannot find context for 'nope'"):
        SpawnConfig(input_shape=INPUT_SHAPE, outputs=OUTPUTS, mp_context="nope")


def test_the_config_keeps_the_checked_values() -> None:
    config = SpawnConfig(input_shape=[6, 7, 2], outputs={"value": ([], np.float32)},
                         input_dtype=np.float32, max_wait_us=10, buckets=[8, 4, 8],
                         max_batch=8, spin_us=None, devices=["cuda:0", "cuda:1"],
                         reject_nonfinite=np.bool_(False))
    assert config.input_shape == (6, 7, 2) and config.input_dtype == np.dtype(np.float32)
    assert config.outputs == {"value": ((), np.dtype(np.float32))}
    assert (config.max_wait_us, config.buckets, config.spin_us) == (10.0, (4, 8), "auto")
    assert config.devices == config.replica_devices == ("cuda:0", "cuda:1")
    assert config.reject_nonfinite is False
    assert config.policy.buckets == (4, 8) and config.spec.max_batch == 8
    # The checked values build the same config again, and it pickles whole.
    assert dataclasses.replace(config) == config
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy.spec == config.spec and copy.policy == config.policy
    assert ServeConfig(**config.keywords(ServeConfig)).spec == config.spec


def test_the_server_reads_its_settings_from_the_config() -> None:
    spec = serve_config().spec
    seg, name = segment.create(spec)
    try:
        server = _ring.Server(seg, np.zeros((8,) + INPUT_SHAPE, np.float32))
        with pytest.raises(shmeval.ShmevalError, match="before configure"):
            server.serve(fake_model, 0)
        with pytest.raises(ValueError, match="larger than the batch buffer"):
            server.configure(serve_config(8, buckets=[4, 16]), 0)
        with pytest.raises(ValueError, match="max_batch must be >= 1"):
            server.tune(0, 0, 0)
        seg.set_serving(0, os.getpid(), 0)
        server.configure(serve_config(8), 0)
        assert server.serve(fake_model, 0)[0] == _ring.SERVE_IDLE  # nothing posted
        server.unlock()
    finally:
        segment.unlink(name)


def test_a_prepare_hook_that_asks_is_told_the_serving_threads() -> None:
    """The model's prepare hook gets serving_threads= where it takes that
    keyword (TorchModel builds a CUDA lane per thread up front); a hook of
    (spec, buckets) alone is called as before."""
    from shmeval.serving import prepare

    seen: list[Any] = []

    class Asks:
        def __call__(self, batch: Any) -> Any:
            return fake_model(batch)

        def prepare(self, spec: Any, buckets: Any, serving_threads: int = 0) -> None:
            seen.append(serving_threads)

    class Plain(Asks):
        def prepare(self, spec: Any, buckets: Any) -> None:  # type: ignore[override]
            seen.append("plain")

    config = serve_config(serving_threads=3)
    prepare(Asks(), config)
    prepare(Plain(), config)
    assert seen == [3, "plain"]
