"""The evaluator process shares the GPUs before its factory runs: JAX's
preallocation off and TensorFlow's memory growth on, unless the user set
either (shmeval.backends._device.GPU_SHARING_ENV); and the device names a
replica's factory is given ("cuda:N") read as each framework's own."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, fake_model
from shmeval.backends._device import GPU_SHARING_ENV, cuda_index

NAMES = sorted(GPU_SHARING_ENV)


def recording_factory(path: str, device: str = "") -> Callable[..., Any]:
    """Writes what the factory's process sees of the variables, then serves
    the fake model."""
    import os

    with open(path, "a") as f:
        f.write(json.dumps({"device": device,
                            **{name: os.environ.get(name) for name in NAMES}}) + "\n")
    return fake_model


def seen_by_factories(tmp_path: Path, **kw: Any) -> list[dict[str, Any]]:
    path = tmp_path / "env.jsonl"
    with shmeval.Evaluator.spawn(functools.partial(recording_factory, str(path)),
                                 input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8,
                                 max_clients=2, slots_per_client=2, start_timeout=60, **kw):
        pass
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_the_defaults_are_set_before_the_factory_runs(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    seen = seen_by_factories(tmp_path, devices=["cuda:0", "cuda:1"])
    assert sorted(s["device"] for s in seen) == ["cuda:0", "cuda:1"]
    for s in seen:  # every replica's process
        assert {name: s[name] for name in NAMES} == {
            "TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    import os

    assert all(name not in os.environ for name in NAMES)  # this process is left alone


@pytest.mark.timeout(120)
def test_a_value_the_user_set_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false")
    [seen] = seen_by_factories(tmp_path)
    assert seen["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert seen["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"


def test_cuda_index() -> None:
    assert cuda_index("cuda") == 0 and cuda_index("cuda:0") == 0 and cuda_index("cuda:3") == 3
    assert cuda_index("CUDA:2") == 2
    for other in ("cpu", "gpu", "/GPU:1", "cuda:", "cuda:x", "cuda:-1"):
        assert cuda_index(other) is None, other
