"""Every Python example of README.md and docs/guide.md runs as written.

Each ```python block is written to a script of its own in a fresh
directory and run there with ``python script.py`` in a subprocess: the way
a reader runs it, so an ``Evaluator.spawn`` outside ``if __name__ ==
"__main__":`` fails here as it fails for them (the new process runs the
script again).  A block that is a fragment says so in an HTML comment on
the line before it, which the rendered page does not show:

    <!-- example: with evaluator -->       run it after the HARNESSES named
                                          (comma-separated), which define
                                          what it uses (``ev``, ``state``,
                                          a model file) and close it after
    <!-- example: skip: needs a GPU -->    not run, for the reason given

Examples that start processes or load a framework are marked ``slow``.
The frameworks' examples run on the CPU.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/guide.md")
TIMEOUT_S = 240

# --- what a fragment may be run after ------------------------------------

NUMPY_MODEL = '''\
import numpy as np
import shmeval

outputs = {"policy": ((7,), "float32"), "value": ((), "float32")}

def model(batch):
    n = len(batch)
    return {"policy": np.full((n, 7), 1 / 7, np.float32),
            "value": batch.reshape(n, -1).mean(axis=1)}

def factory():
    return model

state = np.zeros((6, 7, 2), np.float32)
states = np.stack([state + i for i in range(4)])
'''


class Harness(NamedTuple):
    before: str
    after: str = ""


HARNESSES = {
    # names the examples use: a model, its factory, states, keys
    "names": Harness(NUMPY_MODEL + "zobrist = 0x9E3779B97F4A7C15\nkeys = [1, 2, 3, 4]\n"),
    # a thread evaluator `ev` over the NumPy model, closed after
    "evaluator": Harness(
        NUMPY_MODEL + "ev = shmeval.Evaluator(model, input_shape=(6, 7, 2), outputs=outputs)\n"
        "leaves_a, leaves_b = states[:2], states[2:]\n"
        "def use(outputs):\n    assert set(outputs) == {'policy', 'value'}\n",
        "ev.close()\n"),
    # a model with weight methods, a learner and a worker's handle
    "weights": Harness(
        NUMPY_MODEL + '''\
class Model:
    def __init__(self):
        self.weights = [np.zeros(3, np.float32)]
    def __call__(self, batch):
        return model(batch)
    def set_weights(self, weights):
        self.weights = list(weights)
    def load_weights(self, path):          # a real model reads the file
        pass

class Learner:
    def get_weights(self):
        return [np.ones(3, np.float32)]

learner = Learner()
ev = shmeval.Evaluator(Model(), input_shape=(6, 7, 2), outputs=outputs)
worker_ev = shmeval.connect(ev.address)
''', "worker_ev.close()\nev.close()\n"),
    # the block defines factory(); serve it and ask once
    "spawn": Harness("", '''
if __name__ == "__main__":
    import numpy as np
    import shmeval
    with shmeval.Evaluator.spawn(factory, input_shape=(6, 7, 2),
                                 outputs={"policy": ((7,), "float32"),
                                          "value": ((), "float32")}) as ev:
        out = ev.evaluate(np.zeros((6, 7, 2), np.float32))
        assert out["policy"].shape == (7,) and out["value"].shape == (), out
'''),
    # a trained Keras net in net.keras
    "keras-file": Harness('''\
if __name__ == "__main__":
    import keras
    x = keras.Input((6, 7, 2))
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(x))
    keras.Model(x, {"policy": keras.layers.Dense(7, activation="softmax")(h),
                    "value": keras.layers.Dense(1, activation="tanh")(h)}).save("net.keras")
'''),
    # a PyTorch net `net` (policy, value)
    "torch-net": Harness('''\
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(84, 8)
    def forward(self, x):
        h = self.linear(x.flatten(1))
        return h[:, :7].softmax(-1), h[:, 7]

net = Net()
'''),
    # that net exported to net.pt2 with a dynamic batch dimension
    "torch-file": Harness('''\
if __name__ == "__main__":
    import torch
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(84, 8)
        def forward(self, x):
            h = self.linear(x.flatten(1))
            return h[:, :7].softmax(-1), h[:, 7]
    ep = torch.export.export(Net().eval(), (torch.zeros(2, 6, 7, 2),),
                             dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(ep, "net.pt2")
'''),
    # a JAX net: `net.apply(params, batch)` as Flax's, and its `params`
    "jax-net": Harness('''\
import numpy as np

class Net:
    @staticmethod
    def apply(params, x):
        import jax
        h = x.reshape(x.shape[0], -1) @ params["w"]
        return {"policy": jax.nn.softmax(h[:, :7]), "value": h[:, 7]}

net = Net()
params = {"w": np.random.default_rng(0).normal(0, 0.1, (84, 8)).astype(np.float32)}
'''),
}

# --- the examples ----------------------------------------------------------

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
DIRECTIVE = re.compile(r"<!--\s*example:\s*(.*?)\s*-->")


class Example(NamedTuple):
    doc: str
    line: int
    code: str
    harnesses: tuple[str, ...]
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def slow(self) -> bool:
        text = self.code + "".join(HARNESSES[h].before + HARNESSES[h].after
                                   for h in self.harnesses)
        return bool(re.search(r"\.spawn\(|\bmp\.|torch|tensorflow|keras|jax|\bray\b", text))


def examples(doc: str, text: str) -> list[Example]:
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        last_line = text[:m.start()].rstrip().rpartition("\n")[2]
        harnesses: tuple[str, ...] = ()
        skip = None
        d = DIRECTIVE.fullmatch(last_line.strip())
        if d:
            words = d.group(1)
            if words.startswith("skip:"):
                skip = words[len("skip:"):].strip()
                assert skip, f"{doc}:{line}: a skipped example says why"
            elif words.startswith("with "):
                harnesses = tuple(h.strip() for h in words[len("with "):].split(","))
                unknown = [h for h in harnesses if h not in HARNESSES]
                assert not unknown, f"{doc}:{line}: no harness {unknown} (known: {sorted(HARNESSES)})"
            else:
                raise AssertionError(f"{doc}:{line}: unknown directive {words!r}")
        out.append(Example(doc, line, m.group(1), harnesses, skip))
    return out


ALL = [e for doc in DOCS for e in examples(doc, (ROOT / doc).read_text())]


def script(e: Example) -> str:
    return ("".join(HARNESSES[h].before for h in e.harnesses) + "\n" + e.code + "\n"
            + "".join(HARNESSES[h].after for h in e.harnesses))


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("example", [
    pytest.param(e, id=e.id, marks=[pytest.mark.slow] if e.slow else [])
    for e in ALL])
def test_example_runs(example: Example, tmp_path: Path) -> None:
    if example.skip:
        pytest.skip(f"{example.id}: {example.skip}")
    path = tmp_path / "example.py"
    path.write_text(script(example))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    if env.get("PYTHONPATH"):  # the script runs elsewhere: keep relative entries meaning the same
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(e) if e else e
                                            for e in env["PYTHONPATH"].split(os.pathsep))
    r = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, (
        f"{example.id} failed (exit {r.returncode}):\n--- the script\n{path.read_text()}"
        f"\n--- its output\n{r.stdout}\n{r.stderr[-6000:]}")


def test_every_block_is_found() -> None:
    """The parser sees every ```python block of the docs (a fence it missed
    would go unrun)."""
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        assert len(examples(doc, text)) == text.count("```python\n"), doc
