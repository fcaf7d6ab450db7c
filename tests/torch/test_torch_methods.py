"""TorchModel's named inputs and methods, on the CPU, through its own
start-up hook (``prepare``) and callables, as the evaluator calls them.

- a MuZero-style net served as two methods, ``initial`` and ``recurrent``
  (``TorchModel(net, methods={...})``; an nn.Module frozen or not, a
  TorchScript file, functions of the module, torch.compile): each answers
  as the module's own function does, at every batch size;
- a masked AlphaZero net (planes and a legal-move mask) served as one
  function of two named inputs (``net(planes=..., mask=...)``);
- one set of weights: set_weights / load_weights change every method at
  once, and each frozen method is frozen again with the new weights;
- start-up checks every method: an output of the wrong shape, an output or
  input of the wrong name raise ModelError naming the method and the
  output or input; a method the module lacks, or methods that are not the
  evaluator's, fail clearly; a bad batch names its input;
- on a GPU (skipped without one): both methods through CUDA graphs, and a
  weight update reaches both.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np
import pytest

import shmeval
from shmeval.spec import Method, Spec
from torch_models import (ACTIONS, COLS, HIDDEN, OBS, PLANES, ROWS, masked_net, muzero_net,
                          seeded_weights)

# TorchScript is deprecated, and still what many saved models are.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")

F32 = "float32"
TARGETS = {"initial": "initial_inference", "recurrent": "recurrent_inference"}
PREDICTION = {"policy": ((ACTIONS,), F32), "value": ((), F32)}


def muzero_methods(reward: Any = ((), F32), outputs: Optional[dict[str, Any]] = None,
                   action: str = "action") -> dict[str, Method]:
    """The two methods' declarations (``reward``: the reward's; ``outputs``:
    the recurrent method's instead of its own; ``action``: that input's
    name)."""
    recurrent = outputs or {"hidden_state": ((HIDDEN,), F32), "reward": reward, **PREDICTION}
    return {
        "initial": Method({"observation": ((OBS,), F32)},
                          {"hidden_state": ((HIDDEN,), F32), **PREDICTION}),
        "recurrent": Method({"hidden_state": ((HIDDEN,), F32), action: ((), "int64")},
                            recurrent),
    }


def muzero_spec(max_batch: int = 16, **kwargs: Any) -> Spec:
    return Spec.build(None, None, None, max_batch, 1, 1, methods=muzero_methods(**kwargs))


def muzero_batches(rows: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Random inputs of ``rows`` rows for the initial and the recurrent method."""
    rng = np.random.default_rng(seed)
    return ({"observation": rng.normal(size=(rows, OBS)).astype(np.float32)},
            {"hidden_state": rng.normal(size=(rows, HIDDEN)).astype(np.float32),
             "action": rng.integers(0, ACTIONS, rows).astype(np.int64)})


def eager(net: Any, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The net's own function called on the inputs, its outputs as declared
    (the reward column as a scalar per row)."""
    import torch

    with torch.no_grad():
        out = getattr(net, function)(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    arrays = {k: v.numpy() for k, v in out.items()}
    if "reward" in arrays:
        arrays["reward"] = arrays["reward"][:, 0]
    return arrays


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def assert_muzero_answers(tm: Any, net: Any, sizes: tuple[int, ...] = (1, 3, 16),
                          seed: int = 0) -> None:
    """Both methods of ``tm`` answer as the net's own functions."""
    for rows in sizes:
        initial, recurrent = muzero_batches(rows, seed + rows)
        assert_same(tm.initial(initial), eager(net, "initial_inference", initial))
        assert_same(tm.recurrent(recurrent), eager(net, "recurrent_inference", recurrent))


@pytest.fixture(scope="module")
def torch() -> Any:
    import torch

    torch.set_num_threads(1)  # the machine is shared; batches are small
    return torch


@pytest.fixture(scope="module")
def backend(torch: Any) -> Any:
    from shmeval.backends import torch as backend

    return backend


@pytest.mark.parametrize("kind", ["frozen", "unfrozen", "torchscript_file", "functions",
                                  "compiled"])
def test_methods_answer_as_the_module(kind: str, torch: Any, backend: Any,
                                      tmp_path: Any) -> None:
    net = muzero_net(1)
    source: Any = net
    targets: dict[str, Any] = dict(TARGETS)
    kwargs: dict[str, Any] = {}
    if kind == "unfrozen":
        kwargs["freeze"] = False
    if kind == "torchscript_file":
        torch.jit.script(net).save(str(tmp_path / "muzero.ts"))
        source = str(tmp_path / "muzero.ts")
    if kind == "functions":
        targets = {"initial": lambda m, observation: m.initial_inference(observation),
                   "recurrent": lambda m, **inputs: m.recurrent_inference(**inputs)}
    if kind == "compiled":
        kwargs["compile"] = "aot_eager"
    tm = backend.TorchModel(source, methods=targets, **kwargs)
    assert tm.methods.keys() == {"initial", "recurrent"}
    # Before prepare: the module's own outputs, in its structure.
    initial, _ = muzero_batches(3, 0)
    assert sorted(tm.initial(initial)) == ["hidden_state", "policy", "value"]
    wanted = tm.prepare(muzero_spec(), None)
    compiled = tm.compile_count
    if kind == "compiled":
        # Powers of two up to max_batch, one graph per size and method.
        assert wanted == (1, 2, 4, 8, 16) and compiled >= 2 * len(wanted)
    else:
        assert wanted is None
    frozen = kind in ("frozen", "torchscript_file", "functions")
    assert tm.frozen == frozen, tm.freeze_reason
    for m in tm.methods.values():
        assert m.frozen == frozen, m.freeze_reason
    assert tm.max_concurrency == (2 if frozen else 1)
    sizes = (1, 4, 16) if kind == "compiled" else (1, 3, 16)  # compiled: the buckets
    assert_muzero_answers(tm, net, sizes)
    assert tm.compile_count == compiled, "serving compiled the model again"
    # The callables are the attributes the evaluator looks up by name.
    assert callable(getattr(tm, "recurrent")) and "recurrent" in repr(tm.recurrent)


def test_named_inputs_of_one_function(torch: Any, backend: Any) -> None:
    """A net of two named inputs, planes and a bool mask: called with them
    as keyword arguments, frozen, answering as the module does; a bad
    batch names its input."""
    net = masked_net(2)
    spec = Spec.build(None, None, {"policy": ((COLS,), F32), "value": ((), F32)}, 16, 1, 1,
                      inputs={"planes": ((PLANES, ROWS, COLS), F32), "mask": ((COLS,), "bool")})
    rng = np.random.default_rng(3)

    def batch(rows: int) -> dict[str, np.ndarray]:
        mask = rng.random((rows, COLS)) < 0.6
        mask[:, 0] = True  # a legal move in every row
        return {"planes": rng.normal(size=(rows, PLANES, ROWS, COLS)).astype(np.float32),
                "mask": mask}

    tm = backend.TorchModel(net)
    x = batch(3)
    before = tm(x)  # before prepare: the module's own structure
    np.testing.assert_allclose(before["value"], eager(net, "forward", x)["value"], atol=1e-6)
    tm.prepare(spec, None)
    assert tm.frozen, tm.freeze_reason
    for rows in (1, 5, 16):
        x = batch(rows)
        want = eager(net, "forward", x)
        want["value"] = want["value"][:, 0]
        out = tm(x)
        assert_same(out, want)
        assert np.all(out["policy"][~x["mask"]] == 0)
    x = batch(2)
    with pytest.raises(ValueError, match=r"takes a dict of the inputs \['planes', 'mask'\], "
                                         r"got \['planes'\]"):
        tm({"planes": x["planes"]})
    with pytest.raises(ValueError, match=r"got \['extra', 'mask', 'planes'\]"):
        tm({**x, "extra": x["mask"]})
    with pytest.raises(ValueError, match=r"input 'mask' was prepared for \[n, \*\(7,\)\] bool"):
        tm({"planes": x["planes"], "mask": x["mask"][:, :5]})
    with pytest.raises(ValueError, match="input 'mask'"):
        tm({"planes": x["planes"], "mask": x["mask"].astype(np.float32)})
    with pytest.raises(ValueError, match="input 'mask'"):  # rows that differ
        tm({"planes": x["planes"], "mask": batch(3)["mask"]})
    with pytest.raises(ValueError, match="takes a dict"):
        tm(x["planes"])


@pytest.mark.parametrize("freeze", ["auto", True])
def test_set_weights_changes_every_method(freeze: Any, torch: Any, backend: Any,
                                          tmp_path: Any) -> None:
    """One set of weights: an update (a state dict, a list, a file) changes
    both methods at once; frozen methods are frozen again with the new
    weights (freeze=True at once, "auto" once that pays)."""
    tm = backend.TorchModel(muzero_net(1), methods=TARGETS, freeze=freeze)
    tm.prepare(muzero_spec(), None)
    assert tm.frozen
    assert_muzero_answers(tm, muzero_net(1))
    tm.set_weights(muzero_net(2).state_dict())
    assert tm.frozen == (freeze is True)
    assert_muzero_answers(tm, muzero_net(2))
    if freeze == "auto":
        for m in tm.methods.values():
            assert "since a weight update" in m.freeze_reason
            m.fold.saving = (1e12, 0.0)  # as if an unfrozen call lost 1000 s: it freezes
        assert tm.max_concurrency == 2  # they will be frozen again
        assert_muzero_answers(tm, muzero_net(2), sizes=(1,))
        assert tm.frozen, tm.freeze_reason
        assert_muzero_answers(tm, muzero_net(2))
    tm.set_weights(seeded_weights(muzero_net(), 3))  # a list in state_dict order
    expect = muzero_net(3)
    assert_muzero_answers(tm, expect)
    for got, want in zip(tm.get_weights(), expect.state_dict().values()):
        np.testing.assert_array_equal(got, want.numpy())
    torch.save(muzero_net(4).state_dict(), tmp_path / "four.pt")
    tm.load_weights(tmp_path / "four.pt")
    assert_muzero_answers(tm, muzero_net(4))


def test_methods_from_two_threads(torch: Any, backend: Any) -> None:
    """Two serving threads, each calling another method: every answer is
    its own batch's."""
    net = muzero_net(5)
    tm = backend.TorchModel(net, methods=TARGETS)
    tm.prepare(muzero_spec(), None)
    failures: list[BaseException] = []

    def serve(method: str) -> None:
        try:
            for i in range(30):
                inputs = muzero_batches(1 + i % 16, i)[method == "recurrent"]
                assert_same(getattr(tm, method)(inputs),
                            eager(net, TARGETS[method], inputs))
        except BaseException as e:  # reported by the test's thread
            failures.append(e)

    threads = [threading.Thread(target=serve, args=(m,)) for m in TARGETS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures


def test_one_method_by_name(torch: Any, backend: Any) -> None:
    """An evaluator of one method declared by name (methods= with one):
    served by its name and by a call of the model alike."""
    net = muzero_net(6)
    spec = Spec.build(None, None, None, 8, 1, 1,
                      methods={"recurrent": muzero_methods()["recurrent"]})
    tm = backend.TorchModel(net, methods={"recurrent": "recurrent_inference"})
    tm.prepare(spec, None)
    assert tm.frozen, tm.freeze_reason
    _, inputs = muzero_batches(5, 1)
    want = eager(net, "recurrent_inference", inputs)
    assert_same(tm.recurrent(inputs), want)
    assert_same(tm(inputs), want)


@pytest.mark.parametrize("case, words", [
    # The recurrent reward declared (2,) per row; the model gives one value.
    ("reward_shape", ["method 'recurrent'", "'reward'", "(1,) per row", "declares (2,)"]),
    # A declared output the model does not give.
    ("output_name", ["method 'recurrent'", "outputs are named", "'rewards'"]),
    # An input the function does not take.
    ("input_name", ["method 'recurrent'", "batch of 1 zero states", "'act'"]),
    # An output dtype PyTorch has none of.
    ("output_dtype", ["method 'recurrent'", "output 'reward'", "uint32"]),
])
def test_start_up_names_the_method(case: str, words: list[str], torch: Any,
                                   backend: Any) -> None:
    if case == "reward_shape":
        spec = muzero_spec(reward=((2,), F32))
    elif case == "output_name":
        spec = muzero_spec(outputs={"hidden_state": ((HIDDEN,), F32), "rewards": ((), F32),
                                    **PREDICTION})
    elif case == "input_name":
        spec = muzero_spec(action="act")
    else:
        spec = muzero_spec(reward=((), "uint32"))
    for freeze in ("auto", False):
        tm = backend.TorchModel(muzero_net(), methods=TARGETS, freeze=freeze)
        with pytest.raises(shmeval.ModelError) as info:
            tm.prepare(spec, None)
        for w in words:
            assert w in str(info.value), (w, str(info.value))
        assert "method 'initial'" not in str(info.value)


def test_a_missing_method_fails_clearly(torch: Any, backend: Any, tmp_path: Any) -> None:
    net = muzero_net()
    with pytest.raises(ValueError, match=r"methods\['recurrent'\]: the module \(MuZeroNet\) "
                                         r"has no function 'recurrent_inferense'"):
        backend.TorchModel(net, methods={"initial": "initial_inference",
                                         "recurrent": "recurrent_inferense"})
    # A TorchScript module has the methods marked for export only.
    torch.jit.script(net).save(str(tmp_path / "muzero.ts"))
    with pytest.raises(ValueError, match=r"no function 'represent' \(a TorchScript module "
                                         r"has the methods marked @torch.jit.export only\)"):
        backend.TorchModel(str(tmp_path / "muzero.ts"), methods={"initial": "represent"})
    with pytest.raises(ValueError, match="'prepare' is the name of one of TorchModel's own"):
        backend.TorchModel(net, methods={"prepare": "initial_inference"})
    with pytest.raises(TypeError, match="non-empty dict"):
        backend.TorchModel(net, methods={})
    with pytest.raises(TypeError, match="name of one of the module's functions"):
        backend.TorchModel(net, methods={"initial": 3})
    # Methods that are not the evaluator's.
    one = backend.TorchModel(net, methods={"initial": "initial_inference"})
    with pytest.raises(shmeval.ModelError, match=r"serves the methods \('initial',\), the "
                                                 r"evaluator declares \('initial', 'recurrent'\)"):
        one.prepare(muzero_spec(), None)
    plain = Spec.build((OBS,), F32, {"hidden_state": ((HIDDEN,), F32), **PREDICTION}, 8, 1, 1)
    with pytest.raises(shmeval.ModelError, match=r"the evaluator has none \(no methods=\)"):
        backend.TorchModel(net, methods=TARGETS).prepare(plain, None)
    with pytest.raises(shmeval.ModelError, match=r"serves one function: name the module's "
                                                 r"function for each"):
        backend.TorchModel(net).prepare(muzero_spec(), None)
    with pytest.raises(TypeError, match=r"call one by its name \(tm.initial\(inputs\)\)"):
        backend.TorchModel(net, methods=TARGETS)(np.zeros((1, OBS), np.float32))


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a GPU")
def test_methods_on_a_gpu(torch: Any, backend: Any) -> None:
    """On a GPU: one CUDA graph per method and bucket in each lane; both
    methods answer as the module does (on the GPU), before and after a
    weight update, which the graphs of both read."""
    net = muzero_net(1)
    tm = backend.TorchModel(net, methods=TARGETS, device="cuda", lanes=2)
    assert tm.prepare(muzero_spec(), None) == (1, 2, 4, 8, 16)
    assert tm.graph_captures == 2 * 2 * 5  # lanes x methods x buckets
    reference = muzero_net(1)
    assert_muzero_answers(tm, reference, sizes=(1, 4, 16))
    tm.set_weights(muzero_net(2).state_dict())
    assert_muzero_answers(tm, muzero_net(2), sizes=(1, 4, 16))
    assert tm.graph_captures == 2 * 2 * 5
